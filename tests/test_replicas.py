"""A source that receives its rows by replication is refused (the rows could be cut past and lost there): a
PostgreSQL hot standby, a table a logical replication subscription fills, a MariaDB replica. Each test starts its
own primary and replica from the Debian binaries the stack uses (a standby cannot be made of the shared server
without copying every test's databases); Kafka and Spark are the stack's."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pymysql
import pytest
import yaml
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import OperationalError, ProgrammingError

from assets.relay import build_table_slices, channel_for
from orchestration.cli import main
from resources.slices import SliceRange
from resources.source_database import SourceDatabaseResource, SourceError
from resources.spark import SparkResource
from tests.pipeline import relay_config, topic_names
from tests.test_edge_watermarks import create_holding_table, id_held_without_xid

pytestmark = pytest.mark.integration

USER = "rowrelay"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def polled(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.1)


def owned_by(path: Path, user: str) -> None:
    """Server processes run as the Debian service user when the tests run as root (PostgreSQL refuses root)."""
    if os.geteuid() == 0:
        entry = pwd.getpwnam(user)
        os.chown(path, entry.pw_uid, entry.pw_gid)
        for parent in path.parents:  # reachable (search bit) from the service user
            os.chmod(parent, os.stat(parent).st_mode | 0o001)


# --------------------------------------------------------------------------- PostgreSQL primary + standby


@dataclass
class PgPair:
    primary_port: int
    standby_port: int

    def url(self, port: int, database: str = "postgres", user: str = USER) -> URL:
        return URL.create("postgresql+psycopg", username=user, host="127.0.0.1", port=port, database=database)


def _pg_bin(tool: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{tool}"))
    if not found:
        pytest.skip("no PostgreSQL server binaries (the local stack's Debian packages)")
    return found[-1]


@pytest.fixture(scope="module")
def pg_pair() -> Iterator[PgPair]:
    """A primary (wal_level=logical, trust on 127.0.0.1) and a streaming hot standby of it."""
    base = Path(tempfile.mkdtemp(prefix="rowrelay-pg-replica-"))
    owned_by(base, "postgres")
    as_pg = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    pair = PgPair(free_port(), free_port())
    primary, standby = base / "primary", base / "standby"

    def start(data: Path, port: int) -> None:
        subprocess.run([*as_pg, _pg_bin("pg_ctl"), "-D", str(data), "-l", str(base / f"{data.name}.log"), "-o",
                        f"-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' "
                        "-c wal_level=logical -c shared_buffers=16MB -c fsync=off", "-w", "-t", "60", "start"],
                       check=True, capture_output=True, text=True, start_new_session=True)

    try:
        subprocess.run([*as_pg, _pg_bin("initdb"), "-D", str(primary), "-U", USER, "--auth=trust", "-E", "UTF8",
                        "--locale=C.UTF-8"], check=True, capture_output=True, text=True)
        with open(primary / "pg_hba.conf", "a") as hba:
            hba.write(f"host replication {USER} 127.0.0.1/32 trust\n")
        start(primary, pair.primary_port)
        subprocess.run([*as_pg, _pg_bin("pg_basebackup"), "-h", "127.0.0.1", "-p", str(pair.primary_port), "-U", USER,
                        "-D", str(standby), "-R", "-X", "stream"], check=True, capture_output=True, text=True)
        start(standby, pair.standby_port)
        yield pair
    finally:
        for data in (standby, primary):
            if (data / "postmaster.pid").exists():
                subprocess.run([*as_pg, _pg_bin("pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                               capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


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
    _pg_execute(pg_pair.url(pg_pair.primary_port), f'CREATE DATABASE "{db}"')
    primary_url, standby_url = pg_pair.url(pg_pair.primary_port, db), pg_pair.url(pg_pair.standby_port, db)
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
            build_table_slices(standby, SparkResource(master="local[1]"), table, channel_for(table),
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
    admin = pg_pair.url(pg_pair.primary_port)
    _pg_execute(admin, f'CREATE DATABASE "{pub_db}"', f'CREATE DATABASE "{sub_db}"')
    pub, sub = pg_pair.url(pg_pair.primary_port, pub_db), pg_pair.url(pg_pair.primary_port, sub_db)
    create = f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v int)"
    _pg_execute(pub, create, f"INSERT INTO {name} (v) SELECT g FROM generate_series(1, 5) g",
                f"CREATE PUBLICATION {name}_p FOR TABLE {name}",
                f"SELECT pg_create_logical_replication_slot('{name}_s', 'pgoutput')")
    # In one cluster a subscription cannot create its slot (it would wait on itself): the slot is made above.
    _pg_execute(sub, create, f"CREATE TABLE {name}_local (id bigserial PRIMARY KEY, v int)",
                f"INSERT INTO {name}_local (v) VALUES (1)",
                f"CREATE SUBSCRIPTION {name}_sub CONNECTION 'host=127.0.0.1 port={pg_pair.primary_port} "
                f"dbname={pub_db} user={USER}' PUBLICATION {name}_p WITH (create_slot = false, slot_name = '{name}_s')",
                f"CREATE ROLE {name}_reader LOGIN", f"GRANT SELECT ON {name}, {name}_local TO {name}_reader")
    polled(lambda: _pg_count(sub, name) == 5, "the subscription copies the publisher's rows")
    # Read as a role with SELECT only: the catalogs the check reads are readable by every role.
    source = SourceDatabaseResource(url=pg_pair.url(pg_pair.primary_port, sub_db, f"{name}_reader")
                                    .render_as_string(hide_password=False))
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


@dataclass
class MariadbPair:
    primary_port: int
    replica_port: int

    def url(self, port: int, database: str, user: str, password: str) -> URL:
        return URL.create("mysql+pymysql", username=user, password=password, host="127.0.0.1", port=port,
                          database=database)


@pytest.fixture(scope="module")
def mariadb_pair() -> Iterator[MariadbPair]:
    """A primary (binary log on) and a replica of it, replication running; root over each server's socket."""
    mariadbd = shutil.which("mariadbd") or "/usr/sbin/mariadbd"
    if not os.path.exists(mariadbd) or not shutil.which("mariadb-install-db"):
        pytest.skip("no MariaDB server binaries (the local stack's Debian packages)")
    base = Path(tempfile.mkdtemp(prefix="rowrelay-mariadb-replica-"))
    user = "mysql" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
    owned_by(base, user)
    pair = MariadbPair(free_port(), free_port())
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for server_id, (role, port) in enumerate((("primary", pair.primary_port), ("replica", pair.replica_port)), 1):
            data = base / role
            subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={data}", f"--user={user}",
                            "--auth-root-authentication-method=normal", "--skip-test-db"],
                           check=True, capture_output=True, text=True)
            log_bin = [f"--log-bin={data}/binlog"] if role == "primary" else []
            with open(base / f"{role}.log", "ab") as out:
                procs.append(subprocess.Popen(
                    [mariadbd, "--no-defaults", f"--datadir={data}", f"--port={port}", "--bind-address=127.0.0.1",
                     f"--socket={base}/{role}.sock", f"--user={user}", "--skip-name-resolve",
                     f"--server-id={server_id}", "--innodb-buffer-pool-size=32M", *log_bin],
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        for role in ("primary", "replica"):
            polled(lambda role=role: (base / f"{role}.sock").exists(), f"the MariaDB {role} starts")
        _root(base, "primary", f"CREATE USER '{USER}'@'127.0.0.1' IDENTIFIED BY 'pw'",
              f"GRANT ALL ON *.* TO '{USER}'@'127.0.0.1' WITH GRANT OPTION")
        _root(base, "replica", f"CHANGE MASTER TO MASTER_HOST='127.0.0.1', MASTER_PORT={pair.primary_port}, "
                               f"MASTER_USER='{USER}', MASTER_PASSWORD='pw', MASTER_USE_GTID=slave_pos",
              "START SLAVE")
        yield pair
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(base, ignore_errors=True)


def _root(base: Path, role: str, *statements: str) -> None:
    conn = pymysql.connect(unix_socket=str(base / f"{role}.sock"), user="root", autocommit=True)
    try:
        with conn.cursor() as cursor:
            for statement in statements:
                cursor.execute(statement)
    finally:
        conn.close()


def test_mariadb_replica_is_refused_primary_is_not(mariadb_pair, name) -> None:
    admin = create_engine(mariadb_pair.url(mariadb_pair.primary_port, "mysql", USER, "pw"),
                          isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
        conn.execute(text(f"CREATE TABLE {name}.t (id bigint AUTO_INCREMENT PRIMARY KEY, v int)"))
        conn.execute(text(f"INSERT INTO {name}.t (v) VALUES (1), (2)"))
        # The privileges rowrelay documents (SELECT, PROCESS); the replica gets the user by replication.
        conn.execute(text(f"CREATE USER '{name}'@'127.0.0.1' IDENTIFIED BY 'pw'"))
        conn.execute(text(f"GRANT SELECT, PROCESS ON *.* TO '{name}'@'127.0.0.1'"))
    admin.dispose()
    primary = SourceDatabaseResource(url=mariadb_pair.url(mariadb_pair.primary_port, name, name, "pw")
                                     .render_as_string(hide_password=False))
    replica = SourceDatabaseResource(url=mariadb_pair.url(mariadb_pair.replica_port, name, name, "pw")
                                     .render_as_string(hide_password=False))
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
    finally:
        primary.dispose()
        replica.dispose()
