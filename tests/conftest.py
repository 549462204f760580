"""Session fixtures on real services.

Default: the project's local stack (`python -m stack up`, settings in ~/.cache/rowrelay/stack.env).
With ROWRELAY_TEST_CONTAINERS=1 and a reachable Docker engine: Kafka, PostgreSQL and MariaDB from
testcontainers instead. Every test gets its own databases, tables and topics (unique names), so tests
never see each other's data.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import settings
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, Engine

pytest_plugins = ["tests.ci_skips"]  # under CI=true, a skipped integration or fault test fails


@dataclass(frozen=True)
class Services:
    kafka_bootstrap: str
    pg_host: str
    pg_port: int
    pg_user: str
    pg_password: str
    mariadb_host: str
    mariadb_port: int
    mariadb_user: str
    mariadb_password: str
    jdbc_jars: str
    spark_remote: str | None = None  # the stack's Spark Connect server

    def pg_url(self, database: str = "postgres") -> URL:
        return URL.create("postgresql+psycopg", self.pg_user, self.pg_password, self.pg_host, self.pg_port, database)

    def mariadb_url(self, database: str | None = None) -> URL:
        return URL.create("mysql+pymysql", self.mariadb_user, self.mariadb_password, self.mariadb_host,
                          self.mariadb_port, database)

    def dagster_storage(self, database: str, pooled: bool = True) -> dict[str, Any]:
        """dagster.yaml's `storage:` for an instance in `database`: rowrelay's pooled storage, as the product's
        dagster.yaml has it, or (pooled=False) stock dagster-postgres."""
        postgres_db = {"username": self.pg_user, "password": self.pg_password, "hostname": self.pg_host,
                       "db_name": database, "port": self.pg_port}
        if not pooled:
            return {"postgres": {"postgres_db": postgres_db}}
        return {"custom": {"module": "orchestration.storage", "class": "PooledPostgresStorage",
                           "config": {"postgres_db": postgres_db}}}


def _docker_reachable() -> bool:
    if not shutil.which("docker"):
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def _containers() -> Iterator[Services]:
    from testcontainers.kafka import KafkaContainer
    from testcontainers.mysql import MySqlContainer
    from testcontainers.postgres import PostgresContainer

    from stack.local import jdbc_jars

    with KafkaContainer().with_kraft() as kafka, \
            PostgresContainer("postgres:16", username="rowrelay", password="rowrelay-local") as pg, \
            MySqlContainer("mariadb:11", username="root", password="rowrelay-local") as maria:
        yield Services(
            kafka_bootstrap=kafka.get_bootstrap_server(),
            pg_host=pg.get_container_host_ip(), pg_port=int(pg.get_exposed_port(5432)),
            pg_user="rowrelay", pg_password="rowrelay-local",
            mariadb_host=maria.get_container_host_ip(), mariadb_port=int(maria.get_exposed_port(3306)),
            mariadb_user="root", mariadb_password="rowrelay-local",
            jdbc_jars=",".join(jdbc_jars()),
        )


def _local_stack() -> Services:
    from stack.local import StackError, load_env_file

    try:
        env = load_env_file()
    except StackError as exc:
        pytest.exit(f"local stack not set up: {exc}", returncode=2)
    return Services(
        kafka_bootstrap=env["ROWRELAY_KAFKA_BOOTSTRAP"],
        pg_host=env["ROWRELAY_PG_HOST"], pg_port=int(env["ROWRELAY_PG_PORT"]),
        pg_user=env["ROWRELAY_PG_USER"], pg_password=env["ROWRELAY_PG_PASSWORD"],
        mariadb_host=env["ROWRELAY_MARIADB_HOST"], mariadb_port=int(env["ROWRELAY_MARIADB_PORT"]),
        mariadb_user=env["ROWRELAY_MARIADB_USER"], mariadb_password=env["ROWRELAY_MARIADB_PASSWORD"],
        jdbc_jars=env["ROWRELAY_JDBC_JARS"],
        spark_remote=env.get("ROWRELAY_SPARK_REMOTE"),
    )


@pytest.fixture(scope="session")
def services() -> Iterator[Services]:
    if os.environ.get("ROWRELAY_TEST_CONTAINERS") == "1":
        if not _docker_reachable():
            pytest.exit("ROWRELAY_TEST_CONTAINERS=1 but no Docker engine answers `docker info`", returncode=2)
        yield from _containers()
    else:
        yield _local_stack()


def partition_ends(bootstrap: str, topic: str, partition: int = 0) -> tuple[int, int]:
    """The partition's (low, high) watermarks, asked by a read_uncommitted client: a read_committed reader is done
    at that high watermark.

    Not the end a read_committed client is told (the last stable offset): right after a commit returns, the
    transaction's markers may not be written yet, and that end still stops before the committed rows."""
    from confluent_kafka import Consumer, TopicPartition

    from resources.exactly_once import partition_watermarks

    conf = {"bootstrap.servers": bootstrap}
    ends = Consumer({**conf, "group.id": f"ends-{uuid.uuid4().hex}", "isolation.level": "read_uncommitted"})
    try:
        # The product's read: a topic just created may not serve offsets yet (NOT_LEADER_FOR_PARTITION), seen in CI.
        return partition_watermarks(ends, TopicPartition(topic, partition), 10, conf)
    finally:
        ends.close()


_MADE_HERE: set[str] = set()  # every name unique() gave in this process: its topics go at the session's end


def unique(prefix: str = "t") -> str:
    made = f"{prefix}{uuid.uuid4().hex[:12]}"
    _MADE_HERE.add(made)
    return made


@pytest.hookimpl(trylast=True)  # after the runner's own hook has torn down session fixtures (daemons, servers)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Delete the topics this process's tests made on the local stack (names holding a unique() name).

    A developer's stack outlives its sessions: left, the topics grew to ~15,000 partitions (18 GB), and the broker
    then took over two minutes to start and spent CPU on them in every run. Only this process's names are matched,
    so a concurrent pytest session (another checkout on the same stack) or the other xdist worker keeps its own."""
    if not _MADE_HERE or os.environ.get("ROWRELAY_TEST_CONTAINERS") == "1":
        return  # containers go away with their topics
    from confluent_kafka.admin import AdminClient

    from stack.local import load_env_file

    try:
        admin = AdminClient({"bootstrap.servers": load_env_file()["ROWRELAY_KAFKA_BOOTSTRAP"]})
        topics = [t for t in admin.list_topics(timeout=10).topics
                  if not t.startswith("__") and any(made in t for made in _MADE_HERE)]
        if topics:
            for future in admin.delete_topics(topics, operation_timeout=30).values():
                future.result()
    except Exception as exc:  # cleanup only (no stack.env, a broker away): it never fails the session
        print(f"\n[tests] left this session's topics on the stack: {exc}")


@pytest.fixture
def name() -> str:
    """A fresh lower-case identifier for a table, topic or database."""
    return unique()


@pytest.fixture
def pg_database(services: Services) -> Iterator[URL]:
    """A fresh PostgreSQL database for one test; dropped afterwards."""
    db = unique("db")
    admin = create_engine(services.pg_url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{db}"'))
    yield services.pg_url(db)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def mariadb_database(services: Services) -> Iterator[URL]:
    """A fresh MariaDB database for one test; dropped afterwards."""
    db = unique("db")
    admin = create_engine(services.mariadb_url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE `{db}`"))
    yield services.mariadb_url(db)
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS `{db}`"))
    admin.dispose()


@pytest.fixture
def pg_engine(pg_database: URL) -> Iterator[Engine]:
    engine = create_engine(pg_database)
    yield engine
    engine.dispose()


@pytest.fixture
def mariadb_engine(mariadb_database: URL) -> Iterator[Engine]:
    engine = create_engine(mariadb_database)
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def spark(services: Services):  # -> SparkSession
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("rowrelay-tests")
        .config("spark.jars", services.jdbc_jars)
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", "1g")
        .getOrCreate()
    )
    yield session
    session.stop()


@pytest.fixture(scope="session")
def dagster_home(services: Services, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """DAGSTER_HOME of a Dagster instance whose storage is a fresh PostgreSQL database."""
    db = unique("dagster")
    admin = create_engine(services.pg_url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{db}"'))
    home = tmp_path_factory.mktemp("dagster_home")
    (home / "dagster.yaml").write_text(yaml.safe_dump({
        "storage": services.dagster_storage(db),
        "concurrency": {"pools": {"granularity": "run", "default_limit": 1}},
        "telemetry": {"enabled": False}}))
    yield home
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(scope="session")
def dagster_instance(dagster_home: Path):
    from dagster import DagsterInstance

    instance = DagsterInstance.from_config(str(dagster_home))
    yield instance
    instance.dispose()



# Property tests (tests/test_properties_*.py): a bounded number of examples keeps each to seconds; no deadline, as
# the two shared cores make one example's time vary. HYPOTHESIS_PROFILE=deep searches longer (minutes).
settings.register_profile("rowrelay", max_examples=150, deadline=None)
settings.register_profile("deep", max_examples=5000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "rowrelay"))
