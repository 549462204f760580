"""The local stack itself: Kafka transactions, both databases, Spark JDBC reads, and the stack command."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from sqlalchemy import text

from tests.conftest import Services, partition_ends
from tests.private_servers import free_ports

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


def create_topic(bootstrap: str, topic: str, partitions: int = 1) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(timeout=30)


def read_committed(bootstrap: str, topic: str, timeout: float = 10.0) -> list[bytes]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"g{uuid.uuid4().hex}",
                         "isolation.level": "read_committed", "enable.auto.commit": False})
    try:
        tp = TopicPartition(topic, 0)
        _, high = partition_ends(bootstrap, topic)
        consumer.assign([TopicPartition(topic, 0, 0)])
        values: list[bytes] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                values.append(msg.value())
            # position() passes over transaction markers and aborted messages too.
            if consumer.position([tp])[0].offset >= high:
                break
        return values
    finally:
        consumer.close()


def test_transactional_round_trip(services: Services, name: str) -> None:
    create_topic(services.kafka_bootstrap, name)
    producer = Producer({"bootstrap.servers": services.kafka_bootstrap, "transactional.id": f"tx-{name}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    for i in range(100):
        producer.produce(name, value=f"m{i}".encode())
    producer.commit_transaction(30)
    assert read_committed(services.kafka_bootstrap, name) == [f"m{i}".encode() for i in range(100)]


def test_aborted_transaction_is_invisible(services: Services, name: str) -> None:
    create_topic(services.kafka_bootstrap, name)
    producer = Producer({"bootstrap.servers": services.kafka_bootstrap, "transactional.id": f"tx-{name}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(name, value=b"aborted")
    producer.flush(30)
    producer.abort_transaction(30)
    producer.begin_transaction()
    producer.produce(name, value=b"kept")
    producer.commit_transaction(30)
    assert read_committed(services.kafka_bootstrap, name) == [b"kept"]


def test_newer_producer_fences_older(services: Services, name: str) -> None:
    create_topic(services.kafka_bootstrap, name)
    conf = {"bootstrap.servers": services.kafka_bootstrap, "transactional.id": f"tx-{name}"}
    old = Producer(conf)
    old.init_transactions(30)
    old.begin_transaction()
    old.produce(name, value=b"zombie")
    old.flush(30)
    new = Producer(conf)
    new.init_transactions(30)  # aborts the old instance's open transaction and bumps the epoch
    with pytest.raises(KafkaException) as info:
        old.produce(name, value=b"zombie-2")
        old.commit_transaction(30)
    assert info.value.args[0].fatal() or info.value.args[0].txn_requires_abort()
    new.begin_transaction()
    new.produce(name, value=b"winner")
    new.commit_transaction(30)
    assert read_committed(services.kafka_bootstrap, name) == [b"winner"]


def test_postgres_accepts_connections(pg_engine) -> None:
    with pg_engine.connect() as conn:
        assert "PostgreSQL" in conn.execute(text("SELECT version()")).scalar_one()


def test_mariadb_accepts_connections(mariadb_engine) -> None:
    with mariadb_engine.connect() as conn:
        version = conn.execute(text("SELECT version()")).scalar_one()
        comment = conn.execute(text("SELECT @@version_comment")).scalar_one()
        assert "MariaDB" in version or "MariaDB" in comment, (version, comment)


def _jdbc_count(spark, url: str, table: str, user: str, password: str, driver: str) -> list[int]:
    df = (spark.read.format("jdbc").option("url", url).option("dbtable", table).option("user", user)
          .option("password", password).option("driver", driver).option("fetchsize", "1000")
          .option("partitionColumn", "id").option("lowerBound", "1").option("upperBound", "1001")
          .option("numPartitions", "3").load())
    return sorted(r["id"] for r in df.select("id").collect())


def test_spark_reads_postgres_and_mariadb(spark, services: Services, pg_engine, mariadb_engine) -> None:
    with pg_engine.begin() as conn:
        conn.execute(text("CREATE TABLE items (id bigint PRIMARY KEY, label text)"))
        conn.execute(text("INSERT INTO items SELECT g, 'x' || g FROM generate_series(1, 1000) g"))
    with mariadb_engine.begin() as conn:
        conn.execute(text("CREATE TABLE items (id bigint PRIMARY KEY, label text)"))
        conn.execute(text("INSERT INTO items (id, label) VALUES " + ",".join(f"({i}, 'x{i}')" for i in range(1, 501))))
    pg_db = pg_engine.url.database
    maria_db = mariadb_engine.url.database
    pg_ids = _jdbc_count(spark, f"jdbc:postgresql://{services.pg_host}:{services.pg_port}/{pg_db}", "items",
                         services.pg_user, services.pg_password, "org.postgresql.Driver")
    # jdbc:mysql (with permitMysqlScheme) makes Spark pick its MySQL dialect, which quotes with backticks.
    maria_ids = _jdbc_count(spark,
                            f"jdbc:mysql://{services.mariadb_host}:{services.mariadb_port}/{maria_db}?permitMysqlScheme",
                            "items", services.mariadb_user, services.mariadb_password, "org.mariadb.jdbc.Driver")
    assert pg_ids == list(range(1, 1001))
    assert maria_ids == list(range(1, 501))


# --------------------------------------------------------------------------- the stack command

def _stack_ports(**fixed: int) -> dict[str, int]:
    """Distinct free ports for a private stack, `fixed` ones as given."""
    names = ["ROWRELAY_KAFKA_PORT", "ROWRELAY_KAFKA_CONTROLLER_PORT", "ROWRELAY_KAFKA_SASL_PORT",
             "ROWRELAY_PG_PORT", "ROWRELAY_MARIADB_PORT", "ROWRELAY_SPARK_CONNECT_PORT"]
    return {**dict(zip(names, free_ports(len(names)), strict=True)), **fixed}


def _stack(home: Path, ports: dict[str, int], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "ROWRELAY_HOME": str(home), **{k: str(v) for k, v in ports.items()}}
    return subprocess.run([sys.executable, "-m", "stack", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.skipif(os.environ.get("ROWRELAY_TEST_CONTAINERS") == "1", reason="tests the local stack command")
def test_taken_port_gives_clear_error_not_hang(tmp_path: Path) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]
        started = time.monotonic()
        ports = _stack_ports(ROWRELAY_PG_PORT=taken)
        res = _stack(tmp_path / "home", ports, "up", timeout=60)
    assert res.returncode == 1
    assert f"port {taken}" in res.stderr and "ROWRELAY_PG_PORT" in res.stderr
    assert time.monotonic() - started < 30


@pytest.mark.skipif(os.environ.get("ROWRELAY_TEST_CONTAINERS") == "1", reason="tests the local stack command")
def test_second_stack_up_twice_then_down(tmp_path: Path) -> None:
    """A private stack on other ports: `up` is idempotent, `status` sees it, `down` leaves no process."""
    home = tmp_path / "home"
    ports = _stack_ports()
    try:
        first = _stack(home, ports, "up")
        assert first.returncode == 0, first.stderr + first.stdout
        pids = {
            "kafka": int((home / "kafka" / "kafka.pid").read_text()),
            "mariadb": int((home / "mariadb" / "mariadb.pid").read_text()),
            "postgres": int((home / "postgres" / "data" / "postmaster.pid").read_text().split()[0]),
            "spark connect": int((home / "spark-connect" / "spark-connect.pid").read_text()),
        }
        second = _stack(home, ports, "up")
        assert second.returncode == 0, second.stderr + second.stdout
        assert second.stdout.count("reusing") == 4
        assert int((home / "kafka" / "kafka.pid").read_text()) == pids["kafka"]
        assert _stack(home, ports, "status").returncode == 0
        env_text = (home / "stack.env").read_text()
        assert f"ROWRELAY_KAFKA_BOOTSTRAP=127.0.0.1:{ports['ROWRELAY_KAFKA_PORT']}" in env_text
    finally:
        down = _stack(home, ports, "down")
    assert down.returncode == 0, down.stderr
    for service, pid in pids.items():
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3], \
            f"{service} pid {pid} still running after down"
    assert _stack(home, ports, "status").returncode == 1


def test_spark_connect_client_sets_its_spark_conf_or_names_what_it_cannot(services: Services) -> None:
    """`spark.conf` was ignored with `spark.remote`: the session was built from the remote URL alone. A Connect client's
    own session now takes it; a setting a client cannot
    change fails, naming the key. Each in a process of its own: a process keeps one session per server."""
    if not services.spark_remote:
        pytest.skip("no Spark Connect server in this test environment")
    code = ("import sys, json\nfrom resources.spark import SparkResource\n"
            "session = SparkResource(remote=sys.argv[1], conf=json.loads(sys.argv[2])).get_session()\n"
            "print(session.conf.get('spark.sql.shuffle.partitions'))\n")

    def run(conf: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", code, services.spark_remote, conf], capture_output=True,
                              text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)

    settable = run('{"spark.sql.shuffle.partitions": "7"}')
    assert settable.returncode == 0 and settable.stdout.strip().endswith("7"), settable.stderr[-2000:]
    static = run('{"spark.executor.memory": "3g"}')
    assert static.returncode != 0
    assert "spark.conf spark.executor.memory: a Spark Connect client cannot set it" in static.stderr, \
        static.stderr[-2000:]
