"""orchestration.storage.PooledPostgresStorage: Dagster's PostgreSQL storage reusing connections, surviving
dropped connections and fork."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
import yaml
from sqlalchemy import URL, create_engine, text

from tests.conftest import Services

pytestmark = pytest.mark.integration


def _storage_yaml(services: Services, db: str, pooled: bool) -> str:
    return yaml.safe_dump({"storage": services.dagster_storage(db, pooled), "telemetry": {"enabled": False}})


@pytest.fixture
def storage_db(pg_database: URL) -> str:
    """A fresh database for one instance's storage (conftest's `pg_database`, dropped afterwards)."""
    assert pg_database.database is not None
    return pg_database.database


def _sessions(services: Services, db: str) -> int:
    """Connections ever opened to `db` (a backend reports its connect at exit or at its next stats flush)."""
    admin = create_engine(services.pg_url(), isolation_level="AUTOCOMMIT")
    try:
        time.sleep(1.2)  # past PostgreSQL's 1 s stats flush interval
        with admin.connect() as conn:
            return conn.execute(text("SELECT sessions FROM pg_stat_database WHERE datname = :db"), {"db": db}).scalar()
    finally:
        admin.dispose()


def _storage_calls(home: Path, calls: int) -> None:
    from dagster import DagsterInstance, DagsterRun

    with DagsterInstance.from_config(str(home)) as instance:
        for i in range(calls):
            run_id = str(uuid.uuid4())
            instance.add_run(DagsterRun(job_name=f"job{i}", run_id=run_id))
            assert instance.get_run_by_id(run_id) is not None
            instance.get_dynamic_partitions("slices")


def test_pooled_storage_reuses_connections_where_dagster_postgres_opens_one_per_call(
        services: Services, storage_db: str, tmp_path: Path) -> None:
    pooled_home, plain_home = tmp_path / "pooled", tmp_path / "plain"
    for home, pooled in ((pooled_home, True), (plain_home, False)):
        home.mkdir()
        (home / "dagster.yaml").write_text(_storage_yaml(services, storage_db, pooled))
    _storage_calls(plain_home, 1)  # creates the tables, so both runs below measure calls only
    base = _sessions(services, storage_db)
    _storage_calls(plain_home, 20)
    plain = _sessions(services, storage_db) - base
    _storage_calls(pooled_home, 20)
    pooled = _sessions(services, storage_db) - base - plain
    # 60 calls: dagster-postgres's NullPool connects for each; the pool connects a handful of times (the three
    # storages' table checks at start, then one pooled connection).
    assert plain >= 60, plain
    assert pooled <= 10, pooled


def test_pooled_storage_replaces_a_connection_the_server_dropped(
        services: Services, storage_db: str, tmp_path: Path) -> None:
    from dagster import DagsterInstance, DagsterRun

    (tmp_path / "dagster.yaml").write_text(_storage_yaml(services, storage_db, pooled=True))
    admin = create_engine(services.pg_url(), isolation_level="AUTOCOMMIT")
    with DagsterInstance.from_config(str(tmp_path)) as instance:
        instance.add_run(DagsterRun(job_name="before", run_id="00000000-0000-0000-0000-000000000001"))
        with admin.connect() as conn:  # as a server restart or failover does to every pooled connection
            killed = conn.execute(text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                       "WHERE datname = :db AND pid <> pg_backend_pid()"), {"db": storage_db}).scalar()
        assert killed >= 1, "the pool held no connection to drop"
        instance.add_run(DagsterRun(job_name="after", run_id="00000000-0000-0000-0000-000000000002"))
        assert {r.job_name for r in instance.get_runs()} == {"before", "after"}
    admin.dispose()


def test_pooled_storage_in_a_forked_child_leaves_the_parents_connection_alone(
        services: Services, storage_db: str, tmp_path: Path) -> None:
    from dagster import DagsterInstance, DagsterRun

    (tmp_path / "dagster.yaml").write_text(_storage_yaml(services, storage_db, pooled=True))
    with DagsterInstance.from_config(str(tmp_path)) as instance:
        instance.add_run(DagsterRun(job_name="parent", run_id="00000000-0000-0000-0000-000000000001"))
        pid = os.fork()
        if pid == 0:  # the child: its own connection, and the parent's is not closed under it
            code = 1
            try:
                instance.add_run(DagsterRun(job_name="child", run_id="00000000-0000-0000-0000-000000000002"))
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        # The parent's pooled connection still works (a child closing it would have sent a Terminate message).
        instance.add_run(DagsterRun(job_name="parent again", run_id="00000000-0000-0000-0000-000000000003"))
        assert {r.job_name for r in instance.get_runs()} == {"parent", "child", "parent again"}


def test_instances_built_one_after_another_in_a_process_share_its_pool(
        services: Services, storage_db: str, tmp_path: Path) -> None:
    """The code server builds a new instance from its ref for every sensor evaluation: each one used to open its
    own connections (dagster-postgres's three table checks, then a pool of its own)."""
    from dagster import DagsterInstance, DagsterRun

    (tmp_path / "dagster.yaml").write_text(_storage_yaml(services, storage_db, pooled=True))
    with DagsterInstance.from_config(str(tmp_path)) as instance:  # creates the schema
        instance.add_run(DagsterRun(job_name="first", run_id=str(uuid.uuid4())))
    base = _sessions(services, storage_db)
    for i in range(10):
        with DagsterInstance.from_config(str(tmp_path)) as instance:
            instance.add_run(DagsterRun(job_name=f"tick{i}", run_id=str(uuid.uuid4())))
            instance.get_dynamic_partitions("slices")
    opened = _sessions(services, storage_db) - base
    assert opened <= 2, opened  # 10 instances: 70 connections before (7 each)
    with DagsterInstance.from_config(str(tmp_path)) as instance:
        assert len(instance.get_runs()) == 11


def test_schedule_storage_asks_the_catalog_about_its_tables_once(
        services: Services, storage_db: str, tmp_path: Path) -> None:
    """Dagster's schedule storage asks whether its optional tables exist on nearly every call; the daemon makes
    several such calls per sensor tick. A yes is remembered; the answers stay the same."""
    from dagster import DagsterInstance
    from sqlalchemy import event

    from orchestration.storage import process_engine

    (tmp_path / "dagster.yaml").write_text(_storage_yaml(services, storage_db, pooled=True))
    with DagsterInstance.from_config(str(tmp_path)) as instance:
        storage = instance.schedule_storage
        assert storage is not None
        engine = process_engine(storage.postgres_url)  # the engine every storage of this process draws from
        catalog: list[str] = []

        def count(conn, cursor, statement, parameters, context, executemany) -> None:  # noqa: ANN001
            if "pg_catalog.pg_class" in statement:
                catalog.append(statement)

        event.listen(engine, "before_cursor_execute", count)
        try:
            answers = [(storage.has_instigators_table(), storage.has_secondary_index_table(),
                        storage.get_instigator_state("origin", "selector"), storage.supports_batch_queries)
                       for _ in range(10)]
        finally:
            event.remove(engine, "before_cursor_execute", count)
    assert answers[0][0] and answers[0][1], answers[0]  # a fresh schema has both tables
    assert all(a == answers[0] for a in answers), answers
    assert len(catalog) <= 2, len(catalog)  # 10 rounds: 60 catalog queries before
