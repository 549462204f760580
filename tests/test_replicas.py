"""A source that receives its rows by replication is refused (the rows could be cut past and lost there): a
PostgreSQL hot standby, a table a logical replication subscription fills, a MariaDB replica. Each test starts its
own primary and replica from the Debian binaries the stack uses (a standby cannot be made of the shared server
without copying every test's databases); Kafka and Spark are the stack's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import yaml
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import OperationalError, ProgrammingError

from assets.identity import channel_for
from assets.relay import build_table_slices
from orchestration.cli import main
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.slices import SliceRange
from resources.source_database import SourceDatabaseResource, SourceError
from resources.spark import SparkResource
from tests.pipeline import relay_config, topic_names
from tests.private_servers import USER, MariadbServer, PostgresServer, mariadb_servers, polled, postgres_servers
from tests.test_edge_watermarks import create_holding_table, id_held_without_xid

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pg_pair() -> Iterator[tuple[PostgresServer, PostgresServer]]:
    """A primary (wal_level=logical, for a subscription too) and a streaming hot standby of it."""
    with postgres_servers("-c wal_level=logical -c fsync=off") as make:
        primary = make()
        yield primary, make(standby_of=primary)


def _pg_execute(url: URL, *statements: str) -> None:
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        for statement in statements:
            conn.execute(text(statement))
    engine.dispose()


def _pg_count(url: URL, table: str) -> int | None:
    """The table's row count; None while the database or table is not there yet (a replica still catching up)."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar())
    except (OperationalError, ProgrammingError):
        return None
    finally:
        engine.dispose()


def test_postgres_standby_is_refused_where_rows_are_cut_or_read(pg_pair, services, dagster_home, name, tmp_path,
                                                                 monkeypatch, capsys) -> None:
    db = f"{name}_db"
    primary_server, standby_server = pg_pair
    _pg_execute(primary_server.url(), f'CREATE DATABASE "{db}"')
    primary_url, standby_url = primary_server.url(db), standby_server.url(db)
    writer = create_engine(primary_url)
    key = create_holding_table(writer, name)  # row 1 committed, the sequence's WAL drawn ahead
    writer.dispose()
    polled(lambda: _pg_count(standby_url, name) == 1, "the standby shows the primary's rows")
    primary = SourceDatabaseResource(url=primary_url.render_as_string(hide_password=False))
    standby = SourceDatabaseResource(url=standby_url.render_as_string(hide_password=False))
    try:
        shape = standby.table_shape("public", name, "id")
        with id_held_without_xid(primary_url, name, key) as (release, _):
            # The hole: the primary holds id 2 drawn, uncommitted, with no xid yet; only the primary can see that.
            seen = primary.observe(primary.table_shape("public", name, "id"))
            assert seen is not None and seen.watermark == 3 and not primary.is_final(seen, 0)
            polled(lambda: _pg_count(standby_url, name) == 2, "the standby shows id 3")
            with pytest.raises(SourceError, match=r"is a PostgreSQL standby \(pg_is_in_recovery\(\)\).*point the "
                                                  r"source's url at the primary.*nothing was cut or sent"):
                standby.observe(shape)
            assert release() == 2
        # A run given slices cut before the url moved to the standby reads nothing there either.
        cfg = relay_config(services, {"src": standby_url}, [{"source": "src", "table": f"public.{name}",
                                                            "watermark": "id", "settle_seconds": 0}])
        table = cfg.tables[0]
        with pytest.raises(SourceError, match="PostgreSQL standby"):
            build_table_slices(standby, SparkResource(master="local[1]"), table, channel_for(table, PREFIX),
                               [SliceRange(0, 3)], 0)
        # As a user meets it: `rowrelay backfill` fails with that message, and nothing reaches Kafka.
        config_file = tmp_path / "rowrelay.yaml"
        config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
        monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
        capsys.readouterr()
        assert main(["--config", str(config_file), "backfill", "--table", table.table_id,
                     "--settle-timeout", "1"]) == 1
        assert "is a PostgreSQL standby" in capsys.readouterr().err
        assert table.topic_name not in topic_names(services.kafka_bootstrap)
    finally:
        primary.dispose()
        standby.dispose()


def test_postgres_table_filled_by_a_subscription_is_refused_other_tables_are_not(pg_pair, name) -> None:
    pub_db, sub_db = f"{name}_pub", f"{name}_sub"
    server = pg_pair[0]
    _pg_execute(server.url(), f'CREATE DATABASE "{pub_db}"', f'CREATE DATABASE "{sub_db}"')
    pub, sub = server.url(pub_db), server.url(sub_db)
    create = f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v int)"
    _pg_execute(pub, create, f"INSERT INTO {name} (v) SELECT g FROM generate_series(1, 5) g",
                f"CREATE PUBLICATION {name}_p FOR TABLE {name}",
                f"SELECT pg_create_logical_replication_slot('{name}_s', 'pgoutput')")
    # In one cluster a subscription cannot create its slot (it would wait on itself): the slot is made above.
    _pg_execute(sub, create, f"CREATE TABLE {name}_local (id bigserial PRIMARY KEY, v int)",
                f"INSERT INTO {name}_local (v) VALUES (1)",
                f"CREATE SUBSCRIPTION {name}_sub CONNECTION 'host=127.0.0.1 port={server.port} "
                f"dbname={pub_db} user={USER}' PUBLICATION {name}_p WITH (create_slot = false, slot_name = '{name}_s')",
                f"CREATE ROLE {name}_reader LOGIN", f"GRANT SELECT ON {name}, {name}_local TO {name}_reader")
    polled(lambda: _pg_count(sub, name) == 5, "the subscription copies the publisher's rows")
    # Read as a role with SELECT only: the catalogs the check reads are readable by every role.
    source = SourceDatabaseResource(url=server.url(sub_db, f"{name}_reader").render_as_string(hide_password=False))
    try:
        with pytest.raises(SourceError, match=rf"filled by logical replication \(subscription '{name}_sub'\).*"
                                              r"relay the table from the publisher"):
            source.observe(source.table_shape("public", name, "id"))
        local = source.observe(source.table_shape("public", f"{name}_local", "id"))
        assert local is not None and local.watermark == 1
    finally:
        source.dispose()
        _pg_execute(sub, f"ALTER SUBSCRIPTION {name}_sub DISABLE",
                    f"ALTER SUBSCRIPTION {name}_sub SET (slot_name = NONE)", f"DROP SUBSCRIPTION {name}_sub")


# --------------------------------------------------------------------------- MariaDB primary + replica


@pytest.fixture(scope="module")
def mariadb_pair() -> Iterator[tuple[MariadbServer, MariadbServer]]:
    """A primary (binary log on) and a replica of it, replication running."""
    with mariadb_servers() as make:
        primary = make("--log-bin=binlog")
        replica = make()
        replica.root(f"CHANGE MASTER TO MASTER_HOST='127.0.0.1', MASTER_PORT={primary.port}, MASTER_USER='{USER}', "
                     "MASTER_PASSWORD='pw', MASTER_USE_GTID=slave_pos", "START SLAVE")
        yield primary, replica


def test_mariadb_replica_is_refused_primary_is_not(mariadb_pair, name) -> None:
    primary_server, replica_server = mariadb_pair
    admin = create_engine(primary_server.url("mysql", USER, "pw"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
        conn.execute(text(f"CREATE TABLE {name}.t (id bigint AUTO_INCREMENT PRIMARY KEY, v int)"))
        conn.execute(text(f"INSERT INTO {name}.t (v) VALUES (1), (2)"))
        # The privileges rowrelay documents (SELECT, PROCESS); the replica gets the user by replication.
        conn.execute(text(f"CREATE USER '{name}'@'127.0.0.1' IDENTIFIED BY 'pw'"))
        conn.execute(text(f"GRANT SELECT, PROCESS ON *.* TO '{name}'@'127.0.0.1'"))
    admin.dispose()
    primary = SourceDatabaseResource(url=primary_server.url(name, name, "pw").render_as_string(hide_password=False))
    replica = SourceDatabaseResource(url=replica_server.url(name, name, "pw").render_as_string(hide_password=False))
    try:
        def replicated() -> bool:
            try:
                return replica.max_watermark(replica.table_shape(name, "t", "id")) == 2
            except (SourceError, OperationalError):  # the database or table not there yet
                return False

        polled(replicated, "the replica shows the primary's rows")
        with pytest.raises(SourceError, match=r"is a MariaDB replica \(Slaves_running = 1\).*point the source's url "
                                              r"at the primary"):
            replica.observe(replica.table_shape(name, "t", "id"))
        seen = primary.observe(primary.table_shape(name, "t", "id"))
        assert seen is not None and seen.watermark == 2
        # A table written on the replica itself, not by replication: relayed once the source says so (every table of a
        # server replicating others was refused, and the remedy named could not work).
        replica_server.root(f"CREATE DATABASE {name}_local",
                            f"CREATE TABLE {name}_local.orders (id bigint AUTO_INCREMENT PRIMARY KEY, v int)",
                            f"INSERT INTO {name}_local.orders (v) VALUES (1), (2)")
        local = replica_server.url(f"{name}_local", USER, "pw").render_as_string(hide_password=False)
        with pytest.raises(SourceError, match=r"set `tables_written_here: true` on the source"):
            SourceDatabaseResource(url=local).observe(replica.table_shape(f"{name}_local", "orders", "id"))
        written_here = SourceDatabaseResource(url=local, tables_written_here=True)
        try:
            seen = written_here.observe(written_here.table_shape(f"{name}_local", "orders", "id"))
            assert seen is not None and seen.watermark == 2
        finally:
            written_here.dispose()
    finally:
        primary.dispose()
        replica.dispose()
