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
