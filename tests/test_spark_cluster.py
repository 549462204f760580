"""A slice read on a Spark standalone cluster: a master and two workers started from the PySpark distribution
(stack/spark_cluster.py), a Spark Connect server of the test's own attached to it. The read's partitions must run
on both executors (as Spark's REST API counts them, not assumed), every value arrive exact and exactly once; a
worker SIGKILLed mid-read leaves its tasks to Spark to run again, and the slice still commits once.

Part of the fault suite (`make test-faults`): four JVMs on two cores, run alone.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import URL, Engine

from orchestration.verify import verify_table
from resources.config import RelayConfig, SparkConfig
from stack.spark_cluster import AttachedCluster, Cluster, attached_cluster
from tests.conftest import Services
from tests.pipeline import Harness, read_topic, relay_config

pytestmark = [pytest.mark.faults, pytest.mark.integration]

FIRST_ROWS = 2_000_000
MORE_ROWS = 500_000


@pytest.fixture(scope="module")
def private_spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AttachedCluster]:
    with attached_cluster(tmp_path_factory.mktemp("spark_cluster"), 2) as found:
        yield found


def expected_row(i: int) -> dict[str, Any]:
    return {"id": i, "v": hashlib.md5(str(i).encode()).hexdigest(), "amount": Decimal(i % 100_000) / 100}


def insert_rows(engine: Engine, table: str, first: int, count: int) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {table} (id, v, amount) SELECT g, md5(g::text), (g % 100000) / 100.0 "
                          f"FROM generate_series({first}, {first + count - 1}) g"))


def assert_rows_exact(services: Services, topic: str, rows: int) -> None:
    """Every id 1..rows exactly once, each message's values equal to what the source holds for it."""
    seen = 0
    ids: set[int] = set()
    for m in read_topic(services.kafka_bootstrap, topic, timeout=120):
        row = m.value
        want = expected_row(row["id"])
        assert row["v"] == want["v"] and Decimal(str(row["amount"])) == want["amount"], row
        ids.add(row["id"])
        seen += 1
    assert seen == rows and ids == set(range(1, rows + 1)), f"{seen} messages, {len(ids)} distinct ids"


def worker_processes(cluster: Cluster, index: int) -> list[int]:
    """The worker's JVM and the executor JVMs it started (their command lines name its work directory)."""
    marker = str(cluster.base / f"work-{index}")
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline:
                found.append(int(proc.name))
    return found


@pytest.fixture
def cluster_config(services: Services, pg_database: URL, pg_engine: Engine, private_spark: AttachedCluster,
                   name: str) -> RelayConfig:
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint PRIMARY KEY, v text, amount numeric(12, 2))"))
    cfg = relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "id", "slice_max_rows": 3_000_000,
         "topic": f"cluster.{name}"}])
    return cfg.model_copy(update={"spark": SparkConfig(remote=private_spark.remote)})


def test_a_two_million_row_slice_runs_on_both_executors_then_survives_a_worker_killed_mid_read(
        cluster_config: RelayConfig, private_spark: AttachedCluster, services: Services, pg_engine: Engine,
        dagster_instance: Any) -> None:
    table = cluster_config.tables[0]
    insert_rows(pg_engine, table.table_name, 1, FIRST_ROWS)
    h = Harness(cluster_config, dagster_instance)
    h.drain(table, until_hi=FIRST_ROWS, timeout=900)
    busy = {e["id"]: e["totalTasks"] for e in private_spark.executors() if e["totalTasks"] > 0}
    assert len(busy) >= 2, f"the read ran on {busy} only: {private_spark.executors()}"
    assert_rows_exact(services, table.topic_name, FIRST_ROWS)

    # A worker SIGKILLed (with its executor) while the next slice is read: Spark runs its tasks again on the other.
    insert_rows(pg_engine, table.table_name, FIRST_ROWS + 1, MORE_ROWS)
    outcome: dict[str, Any] = {}
    relay = threading.Thread(target=lambda: outcome.update(
        keys=h.drain(table, until_hi=FIRST_ROWS + MORE_ROWS, timeout=900)), daemon=True)
    relay.start()
    deadline = time.monotonic() + 300
    while not private_spark.running_tasks():
        assert time.monotonic() < deadline and relay.is_alive(), "no read in flight to take a worker from"
        time.sleep(0.2)
    killed = worker_processes(private_spark.cluster, 1)
    assert killed, "worker 1 has no process to kill"
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    relay.join(900)
    assert not relay.is_alive() and "keys" in outcome, "the relay did not finish after the worker's kill"
    report = verify_table(cluster_config, table)
    assert report.ok and report.messages == report.source_rows == FIRST_ROWS + MORE_ROWS, report
    assert_rows_exact(services, table.topic_name, FIRST_ROWS + MORE_ROWS)
    print(f"tasks per executor: {busy}; after the kill: "
          f"{ {e['id']: (e['totalTasks'], e['isActive']) for e in private_spark.executors()} }")
