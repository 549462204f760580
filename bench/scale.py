"""Scale measures for issue 12: a long slice history and many tables, simulated on the real stack.

  seed_history                 N committed one-row slices written straight into the source, Kafka (data + progress,
                               one transaction per 10k slices, commit times spread over weeks) and the instance
  idle_tick_large_history_ms   median idle tick of the table's sensor with that history (no compaction first)
  idle_daemon                  a daemon on N tiny idle tables: the worst gap between consecutive ticks of any slice
                               sensor, as a ratio of its interval (<= 2 is the target at 100 tables), and the CPU
                               of the daemon and the stack meanwhile (IdleDaemon)
bench/run.py records them; the test suite (tests/test_history.py) reuses `seed_history`.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Producer

from assets.identity import channel_for, partitions_for
from resources.config import RelayConfig, TableConfig
from resources.exactly_once import ProgressRecord, ensure_topics, read_committed_progress
from resources.slices import SliceRange

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 10_000
MANY_DAGSTER_DB = "rowrelay_bench_many_dagster"


def seed_history(instance: Any, table: TableConfig, source_url: str, kafka_conf: dict[str, Any], slices: int, *,
                 span_days: float = 42.0, now: datetime | None = None, newest_age_s: float = 600.0,
                 transactional_id_prefix: str = "rowrelay") -> None:
    """`slices` committed slices (i-1, i] of one row each, as if relayed over `span_days` ending `newest_age_s`
    ago: the source rows, the data messages and progress records (one Kafka transaction per 10k slices, the
    records' committed_at and Kafka timestamps spread over the span) and one partition key per slice."""
    now = now or datetime.now(UTC)
    engine = sa.create_engine(source_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f"CREATE TABLE {table.table} (id bigint PRIMARY KEY, v text)"))
            conn.execute(sa.text(f"INSERT INTO {table.table} SELECT g, 'r' FROM generate_series(1, {slices}) g"))
    finally:
        engine.dispose()
    channel = channel_for(table, transactional_id_prefix)
    ensure_topics(kafka_conf, channel)
    producer = Producer({**kafka_conf, "transactional.id": channel.transactional_id, "linger.ms": 20,
                         "queue.buffering.max.messages": 1_000_000})
    producer.init_transactions(30)
    first = now - timedelta(days=span_days, seconds=newest_age_s)
    step = timedelta(days=span_days) / max(1, slices - 1)
    table_header = ("rowrelay.table", channel.table.encode())

    for start in range(1, slices + 1, CHUNK):
        ids = range(start, min(slices, start + CHUNK - 1) + 1)
        values = [json.dumps({"id": i, "v": "r"}).encode() for i in ids]
        ends: dict[int, int] = {}  # the offsets of the chunk's first and last message
        producer.begin_transaction()
        for n, (i, value) in enumerate(zip(ids, values, strict=True)):
            report = partial(_offset_of, ends, n) if n in (0, len(values) - 1) else None
            producer.produce(channel.topic, value=value, on_delivery=report,
                             headers=[table_header, ("rowrelay.watermark", str(i).encode())])
        producer.flush(60)  # the offsets go into the progress records of the same transaction
        # One producer, one partition, one open transaction: the chunk's messages hold consecutive offsets.
        if len(ends) != min(2, len(values)) or ends[len(values) - 1] - ends[0] != len(values) - 1:
            raise RuntimeError(f"seed: the chunk from {start} did not land at consecutive offsets: {ends}")
        for n, (i, value) in enumerate(zip(ids, values, strict=True)):
            at = first + step * (i - 1)
            offset = ends[0] + n
            record = ProgressRecord(channel.table, SliceRange(i - 1, i).key, i - 1, i, 1, len(value),
                                    hashlib.sha256(value).hexdigest(), channel.topic, {"0": [offset, offset]},
                                    channel.transactional_id, at.isoformat(), 0.001)
            producer.produce(channel.progress_topic, key=record.slice.encode(), value=record.to_json(),
                             timestamp=int(at.timestamp() * 1000))
        producer.commit_transaction(60)
    name = partitions_for(table).name
    for start in range(0, slices, CHUNK):
        instance.add_dynamic_partitions(name, [SliceRange(i, i + 1).key for i in range(start, min(slices,
                                                                                               start + CHUNK))])
    # Seeded means visible: right after a commit returns its marker may not be on the progress partition yet, and
    # a read_committed reader (a roll-up, the sensor) would still find nothing committed (a CI flake of
    # test_compaction_leaves_keys_a_cut_or_a_ui_run_is_using).
    deadline = time.monotonic() + 30
    while (seen := read_committed_progress(kafka_conf, channel)) is None or seen.hi < slices:
        if time.monotonic() > deadline:
            raise RuntimeError(f"seed: progress up to {slices} not visible after 30 s (seen: {seen})")
        time.sleep(0.1)


def _offset_of(ends: dict[int, int], n: int, err: Any, msg: Any) -> None:
    if err is None:
        ends[n] = msg.offset()


def idle_tick_times(instance: Any, config: RelayConfig, table: TableConfig, ticks: int = 10) -> list[float]:
    """Milliseconds of `ticks` idle evaluations of the table's slice sensor (after one warm-up tick), like the
    daemon's: build_sensor_context + evaluate_tick, the cursor carried over."""
    from dagster import build_sensor_context

    from orchestration.factory import build_definitions

    defs = build_definitions(config)
    sensor = defs.resolve_sensor_def(f"{table.dagster_name}_slices")
    times, cursor = [], None
    for _ in range(ticks + 1):
        with build_sensor_context(cursor=cursor, resources=defs.resources, definitions=defs,
                                  sensor_name=sensor.name, instance=instance) as ctx:
            started = time.perf_counter()
            data = sensor.evaluate_tick(ctx)
            times.append((time.perf_counter() - started) * 1000)
        if data.run_requests:
            raise RuntimeError(f"not idle: {data.run_requests}")
        cursor = data.cursor
    return times[1:]


@contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def idle_tick_large_history_ms(stack: Any, workdir: Path, slices: int = 300_000, ticks: int = 10) -> float:
    """Median idle tick of a table with `slices` committed slices of history (bench/run.py's Stack and helpers)."""
    import uuid

    from dagster import DagsterInstance

    from bench.run import BENCH_DB, dagster_env, ensure_database, write_config
    from resources.config import load_config, resolve_env

    ensure_database(stack, BENCH_DB)
    name = f"bench_hist_{uuid.uuid4().hex[:6]}"
    config_path = write_config(stack, workdir / f"{name}.yaml", [
        {"source": "hist", "table": f"public.{name}", "watermark": "id", "rollup_after_seconds": None}])
    env = dagster_env(stack, config_path)
    with _environ(env):
        config = load_config(config_path)
        table = config.tables[0]
        with DagsterInstance.get() as instance:
            seed_history(instance, table, resolve_env(config.sources["hist"].url).replace(
                "postgresql://", "postgresql+psycopg://", 1), {"bootstrap.servers": stack.bootstrap}, slices)
            try:
                return statistics.median(idle_tick_times(instance, config, table, ticks))
            finally:  # the bench instance and database are kept between runs: leave no 300k keys behind
                from orchestration.compaction import all_keys, delete_keys

                partitions = partitions_for(table).name
                delete_keys(instance, partitions, all_keys(instance, partitions))
                with stack.connect() as conn:
                    conn.execute(f"DROP TABLE IF EXISTS {name}")


def worst_tick_gap_ratio(instance: Any, sensor_names: list[str], interval_s: float, since: float) -> float:
    """The worst gap between consecutive ticks of any of the sensors after `since` (epoch s), over `interval_s`."""
    from dagster._core.scheduler.instigation import InstigatorType

    worst = 0.0
    for name in sensor_names:
        state = next((s for s in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR)
                      if s.name == name), None)
        if state is None:
            return float("inf")  # never ticked
        ticks = instance.get_ticks(state.instigator_origin_id, state.selector_id, after=since, limit=10_000)
        stamps = sorted(t.timestamp for t in ticks)
        if len(stamps) < 2:
            return float("inf")
        worst = max(worst, *(b - a for a, b in zip(stamps, stamps[1:], strict=False)))
    return worst / interval_s


@dataclass
class IdleDaemon:
    """A daemon relaying idle tables, measured after its warm-up: the worst gap between a sensor's ticks (as a
    ratio of the interval) and the CPU, in % of one core, of the daemon with its code server and of the stack's
    PostgreSQL, broker and Spark Connect server."""

    worst_gap_ratio: float
    cpu_pct: dict[str, float]


def idle_daemon(stack: Any, workdir: Path, tables: int, run_s: float, warmup_s: float) -> IdleDaemon:
    """A daemon on `tables` tiny tables (one row each, same PostgreSQL database), every sensor idle: no run, no
    Spark. What is measured is the daemon keeping the sensors' cadence, and what that costs while nothing moves.
    Up to 20 tables each has its own sensor; above, they share group sensors (orchestration/factory.py)."""
    import uuid

    from dagster import DagsterInstance

    from bench.run import (
        BENCH_DB,
        CLK_TCK,
        CpuMeter,
        dagster_env,
        ensure_database,
        live_cpu_ticks,
        stop_process_group,
        write_config,
    )

    ensure_database(stack, BENCH_DB)
    tag = uuid.uuid4().hex[:6]
    names = [f"bench_many_{tag}_{i}" for i in range(tables)]
    with stack.connect() as conn:
        for n in names:
            conn.execute(f"CREATE TABLE {n} (id bigserial PRIMARY KEY, v text)")
            conn.execute(f"INSERT INTO {n} (v) VALUES ('r')")
    config_path = write_config(stack, workdir / f"many-{tag}.yaml", [
        # start_after 1: the one row is skipped on purpose, so every sensor is idle (no run, no Spark).
        {"source": "many", "table": f"public.{n}", "watermark": "id", "start_after": 1} for n in names])
    # Its own instance (database and DAGSTER_HOME): a daemon on the bench's shared instance would fight another
    # daemon's heartbeat there.
    ensure_database(stack, MANY_DAGSTER_DB, fresh=True)
    env = dagster_env(stack, config_path)
    home = workdir / "dagster-home-many"
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text((Path(env["DAGSTER_HOME"]) / "dagster.yaml").read_text())
    env = {**env, "DAGSTER_HOME": str(home), "DAGSTER_PG_DB": MANY_DAGSTER_DB}
    log_file = (workdir / f"daemon-many-{tag}.log").open("w")
    daemon = subprocess.Popen([sys.executable, "-m", "dagster._daemon", "run", "-w", "workspace.yaml"], cwd=ROOT,
                              env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    meter = CpuMeter(stack)
    try:
        time.sleep(warmup_s)
        since = time.time()
        start, start_daemon = meter.snapshot(), live_cpu_ticks(3, daemon.pid)
        time.sleep(run_s)
        end, end_daemon = meter.snapshot(), live_cpu_ticks(3, daemon.pid)
        window = time.time() - since
    finally:
        stop_process_group(daemon)
        log_file.close()
    cpu = {"daemon": (end_daemon - start_daemon) / CLK_TCK,
           **{k: v for k, v in CpuMeter.seconds(start, end).items() if k not in ("all", "broker_gc_marking")}}
    cpu_pct = {k: round(100 * v / window, 1) for k, v in cpu.items()}
    cpu_pct["all"] = round(sum(v for k, v in cpu_pct.items()), 1)
    with _environ(env), DagsterInstance.get() as instance:
        from resources.config import load_config

        config = load_config(config_path)
        with stack.connect() as conn:  # the tables are only needed while the daemon runs
            for n in names:
                conn.execute(f"DROP TABLE IF EXISTS {n}")
        from orchestration.factory import sensor_groups

        names = [f"slices_{g}" if g is not None else f"{t.dagster_name}_slices"
                 for g, members in sensor_groups(config.tables).items() for t in (members if g is None else [None])]
        return IdleDaemon(worst_tick_gap_ratio(instance, names, 1.0, since), cpu_pct)

