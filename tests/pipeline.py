"""Drives the real pipeline through a Dagster instance on PostgreSQL: sensor ticks, partitions, runs."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from confluent_kafka import Consumer, TopicPartition
from dagster import DagsterInstance, Definitions, DeleteDynamicPartitionsRequest, RunRequest, build_sensor_context
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG
from sqlalchemy import text
from sqlalchemy.engine import URL, Engine

from orchestration.factory import build_definitions, job_name
from resources.config import RelayConfig, TableConfig, parse_config
from resources.exactly_once import FAST_READS, ProgressRecord, TableChannel, read_committed_progress
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from tests.conftest import Services, partition_ends, unique

T = TypeVar("T")


def source_url(url: URL) -> str:
    return url.render_as_string(hide_password=False)


def relay_config(services: Services, sources: dict[str, URL], tables: list[dict[str, Any]],
                 producer: dict[str, Any] | None = None, spark_remote: bool = False) -> RelayConfig:
    """A config on the test services; Spark in-process (local[2]) or the stack's Spark Connect server."""
    if spark_remote and not services.spark_remote:
        import pytest

        pytest.skip("no Spark Connect server in this test environment")
    spark = {"remote": services.spark_remote} if spark_remote else {"master": "local[2]"}
    return parse_config({
        "sources": {name: {"url": source_url(u)} for name, u in sources.items()},
        "tables": tables,
        "kafka": {"bootstrap_servers": services.kafka_bootstrap, "producer": producer or {}},
        "spark": spark,
    })


ROOT = Path(__file__).resolve().parents[1]


def id_table_config(services: Services, pg_database: URL, pg_engine: Engine, label: str) -> RelayConfig:
    """A fresh `(id bigserial, v text)` table in `pg_database`, and a config relaying it to a topic of its own in
    1,000-row slices on the stack's Spark Connect server, its sensor ticking every second: what a deployment test
    (separate Dagster processes, a project of a user's) relays."""
    name = unique(label)
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
    return relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "id", "slice_max_rows": 1000,
         "sensor_interval_seconds": 1, "topic": f"{label}.{name}"}], spark_remote=True)


@contextlib.contextmanager
def dagster_database(pg_engine: Engine) -> Iterator[str]:
    """A fresh database on the stack's PostgreSQL for a Dagster instance's storage; dropped afterwards."""
    name = unique("dagster")
    with contextlib.closing(pg_engine.connect().execution_options(isolation_level="AUTOCOMMIT")) as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield name
    finally:
        with contextlib.closing(pg_engine.connect().execution_options(isolation_level="AUTOCOMMIT")) as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def target(request: RunRequest) -> str:
    """A run request's slices: one partition key, or `first...last` for a range run."""
    if request.partition_key is not None:
        return request.partition_key
    span = request.partition_key_range
    assert span is not None, f"run request without partitions: {request}"
    return f"{span.start}...{span.end}"


@dataclass
class CliRun:
    returncode: int
    output: str

    @property
    def success(self) -> bool:
        return self.returncode == 0


@dataclass
class Harness:
    """One config's definitions on a Dagster instance: tick sensors like the daemon, run requests in-process."""

    config: RelayConfig
    instance: DagsterInstance
    defs: Definitions = field(init=False)
    cursors: dict[str, str | None] = field(default_factory=dict)
    skip_messages: dict[str, str | None] = field(default_factory=dict)  # each table's last tick

    def __post_init__(self) -> None:
        self.defs = build_definitions(self.config)

    def table(self, index: int = 0) -> TableConfig:
        return self.config.tables[index]

    def tick(self, table: TableConfig) -> list[str]:
        """One sensor evaluation, validated like the daemon's; adds partitions; returns requested keys."""
        sensor = self.defs.resolve_sensor_def(f"{table.dagster_name}_slices")
        with build_sensor_context(cursor=self.cursors.get(table.table_id),
                                  resources=self.defs.resources, definitions=self.defs,
                                  sensor_name=sensor.name, instance_ref=self.instance.get_ref()) as ctx:
            data = sensor.evaluate_tick(ctx)
        for req in data.dynamic_partitions_requests or []:  # in order, as the daemon applies them
            if isinstance(req, DeleteDynamicPartitionsRequest):
                for key in req.partition_keys:
                    self.instance.delete_dynamic_partition(req.partitions_def_name, key)
            else:
                self.instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
        self.cursors[table.table_id] = data.cursor
        self.skip_messages[table.table_id] = data.skip_message
        return [target(r) for r in data.run_requests or []]

    def cut(self, table: TableConfig, timeout: float = 60.0) -> list[str]:
        """Tick until a tick requests runs; returns that tick's keys. A PostgreSQL source's new rows are cut only
        once every transaction holding an xid anywhere in the cluster has ended (a snapshot's xmin is
        cluster-wide), and the parallel tests write in other databases of the same cluster: one tick's 1-s wait
        is not always enough. [] after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.tick(table)
            if got or time.monotonic() > deadline:
                return got
            time.sleep(0.2)  # a tick with nothing pending returns at once: do not spin on the source and Kafka

    def baseline(self, table: TableConfig, timeout: float = 60.0) -> ProgressRecord:
        """Tick a `start_after: latest` table until its baseline is recorded; returns the progress then. Ticks
        that request no runs (a baseline never does); the baseline waits, like a cut, for every transaction
        holding an xid in the cluster, which the parallel tests' writes in other databases may be."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.tick(table) == [], "a tick requested runs before the table's baseline"
            progress = self.progress(table)
            if progress is not None:
                return progress
            assert time.monotonic() < deadline, f"no baseline recorded within {timeout} s"
            time.sleep(0.2)

    def run(self, table: TableConfig, key: str, raise_on_error: bool = True) -> Any:
        """One run of the table's job for a slice or a range `first...last`: in-process with local Spark;
        with Spark Connect in a `dagster asset materialize` process (one process cannot hold a classic and a
        remote session)."""
        if self.config.spark.remote:
            result = self.run_cli(table, key)
            if raise_on_error:
                assert result.success, result.output[-4000:]
            return result
        job = self.defs.resolve_job_def(job_name(table))
        if "..." in key:
            first, last = key.split("...")
            return job.execute_in_process(tags={ASSET_PARTITION_RANGE_START_TAG: first,
                                                ASSET_PARTITION_RANGE_END_TAG: last},
                                          instance=self.instance, raise_on_error=raise_on_error)
        return job.execute_in_process(partition_key=key, instance=self.instance, raise_on_error=raise_on_error)

    def config_file(self) -> Path:
        path = Path(self.instance.root_directory) / f"rowrelay-{abs(hash(self.config.model_dump_json()))}.yaml"
        path.write_text(yaml.safe_dump(self.config.model_dump(mode="json", exclude_none=True)))
        return path

    def cli_command(self, table: TableConfig, key: str) -> list[str]:
        """`dagster asset materialize` of a slice or a range `first...last`: the run in a process of its own."""
        from assets.identity import asset_key

        return [sys.executable, "-m", "dagster", "asset", "materialize", "--select", "/".join(asset_key(table).path),
                "--partition-range" if "..." in key else "--partition", key, "-m", "orchestration.definitions"]

    def cli_env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, "DAGSTER_HOME": self.instance.root_directory,
                "ROWRELAY_CONFIG": str(self.config_file()), **(env or {})}

    def run_cli(self, table: TableConfig, key: str, env: dict[str, str] | None = None) -> CliRun:
        proc = subprocess.run(self.cli_command(table, key), cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env=self.cli_env(env))
        return CliRun(proc.returncode, proc.stdout + proc.stderr)

    def drain(self, table: TableConfig, until_hi: int | None = None, timeout: float = 120.0,
              pause: float = 0.3) -> list[str]:
        """Tick and run like the daemon until committed progress reaches `until_hi` (default: the table's
        current max watermark). Returns the slice keys run, in order."""
        if until_hi is None:
            until_hi = self.max_watermark(table)
        done: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            for k in self.tick(table):
                self.run(table, k)
                done.extend(self.expand(table, k))
            progress = self.progress(table)
            if progress is not None and progress.hi >= until_hi:
                return done
            assert time.monotonic() < deadline, f"progress {progress and progress.hi} never reached {until_hi}"
            time.sleep(pause)

    def expand(self, table: TableConfig, target_key: str) -> list[str]:
        """The slice keys a run target covers, in order."""
        from assets.identity import partitions_for
        from resources.slices import SliceRange

        if "..." not in target_key:
            return [target_key]
        first, last = (SliceRange.from_key(k).lo for k in target_key.split("..."))
        keys = self.instance.get_dynamic_partitions(partitions_for(table).name)
        return sorted((k for k in keys if first <= SliceRange.from_key(k).lo <= last),
                      key=lambda k: SliceRange.from_key(k).lo)

    def max_watermark(self, table: TableConfig) -> int:
        from assets.shape import table_shape
        from resources.source_database import SourceDatabaseResource

        source = SourceDatabaseResource(url=self.config.sources[table.source].url)
        try:
            return source.max_watermark(table_shape(source, table)) or 0
        finally:
            source.dispose()

    def materialization(self, table: TableConfig, key: str) -> dict[str, Any]:
        from assets.identity import asset_key

        records = self.instance.fetch_materializations(asset_key(table), limit=1000).records
        for r in records:
            mat = r.asset_materialization
            if mat is not None and mat.partition == key:
                return {k: v.value for k, v in mat.metadata.items()}
        raise AssertionError(f"no materialization recorded for {key}")

    def progress(self, table: TableConfig) -> ProgressRecord | None:
        from assets.identity import channel_for

        return read_committed_progress({"bootstrap.servers": self.config.kafka.bootstrap_servers},
                                       channel_for(table, PREFIX))


@dataclass
class Consumed:
    partition: int
    offset: int
    key: bytes | None
    value: dict[str, Any]
    headers: dict[str, bytes]

    @property
    def watermark(self) -> int:
        return int(self.headers["rowrelay.watermark"])


def polled(read: Callable[[], T], done: Callable[[T], bool], timeout: float = 10.0) -> T:
    """`read()` again every 50 ms until `done` holds for its answer, or `timeout` passed; the last answer (the
    caller's assertion then says what it was)."""
    deadline = time.monotonic() + timeout
    while not done(value := read()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def visible_progress(conf: dict[str, Any], channel: TableChannel, hi: int) -> ProgressRecord | None:
    """The committed progress once it reaches `hi` (or what is visible after 10 s). Right after a commit, the
    commit marker may not be on the progress partition yet (the coordinator writes each partition's marker after
    the commit returns, the data partitions' possibly first), and a read_committed reader still sees the progress
    before it (tests/conftest.py partition_ends tells the same story for data topics)."""
    return polled(lambda: read_committed_progress(conf, channel), lambda p: p is not None and p.hi >= hi)


def topic_names(bootstrap: str) -> set[str]:
    """Every topic of the cluster."""
    from confluent_kafka.admin import AdminClient

    return set(AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics)


def read_topic(bootstrap: str, topic: str, timeout: float = 30.0) -> list[Consumed]:
    """Everything committed in a topic (all partitions), read_committed, by an independent consumer.

    Read up to each partition's high watermark (not the last stable offset a read_committed client is told), so
    a transaction left open makes this fail instead of hiding behind it.
    """
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"check-{uuid.uuid4().hex}",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "auto.offset.reset": "earliest", **FAST_READS})
    out: list[Consumed] = []
    try:
        md = consumer.list_topics(topic, timeout=10)
        parts = sorted(md.topics[topic].partitions) if topic in md.topics else []
        for p in parts:
            tp = TopicPartition(topic, p)
            low, high = partition_ends(bootstrap, topic, p)
            if high <= low:
                continue
            consumer.assign([TopicPartition(topic, p, low)])
            deadline = time.monotonic() + timeout
            while consumer.position([tp])[0].offset < high and time.monotonic() < deadline:
                msg = consumer.poll(0.2)
                if msg is None or msg.error():
                    continue
                out.append(Consumed(msg.partition(), msg.offset(), msg.key(), json.loads(msg.value()),
                                    dict(msg.headers() or [])))
            assert consumer.position([tp])[0].offset >= high, (
                f"{topic}[{p}] not read to its end ({high}) in {timeout}s: a transaction left open?")
    finally:
        consumer.close()
    return out


def assert_exactly_once(messages: list[Consumed], expected_ids: list[int], id_field: str = "id") -> None:
    """Every expected row exactly once, nothing else, watermark order within each Kafka partition."""
    ids = [m.value[id_field] for m in messages]
    dupes = sorted({i for i in ids if ids.count(i) > 1}) if len(ids) != len(set(ids)) else []
    missing = sorted(set(expected_ids) - set(ids))
    extra = sorted(set(ids) - set(expected_ids))
    assert not dupes, f"{len(dupes)} duplicated ids, e.g. {dupes[:10]}"
    assert not missing, f"{len(missing)} missing ids, e.g. {missing[:10]}"
    assert not extra, f"{len(extra)} unexpected ids, e.g. {extra[:10]}"
    by_partition: dict[int, list[int]] = {}
    for m in sorted(messages, key=lambda m: (m.partition, m.offset)):
        by_partition.setdefault(m.partition, []).append(m.watermark)
    for p, wms in by_partition.items():
        assert wms == sorted(wms), f"partition {p} is not in watermark order"


def drained_then_moved_to_another_prefix(services, pg_database, dagster_instance, name: str, rows: int,
                                         **changes: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Table `public.<name>` (ids 1..rows, made by the caller) relayed up to `rows`, then its config with
    `transactional_id_prefix: other` (and `changes` to the table): its progress reads empty there while its rows are
    in the topic ("progress missing"). Returns the config, its table, and the moved config as data."""
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}",
                                                         "watermark": "id"}])
    table = cfg.tables[0]
    Harness(cfg, dagster_instance).drain(table, until_hi=rows)
    data = cfg.model_dump(mode="json", exclude_none=True)
    data["kafka"]["transactional_id_prefix"] = "other"
    data["tables"][0].update(changes)
    return cfg, table, data
