"""`make bench`: rowrelay against this box's raw limit, a Spark ceiling and two peers on one PostgreSQL table.

Measured back to back in one run, on the local stack (python -m stack up); every tool reads PostgreSQL over plain
TCP (sslmode=disable) and produces lz4 to the same broker:
  raw       COPY (SELECT row_to_json(t) ...) TO STDOUT streamed into a plain producer (no transactions, lz4)
  ceiling   rowrelay's slice path (JDBC read, JSON expressions, read-ahead into Python bytes) without Kafka, from
            process launch (bench/spark_ceiling.py), after one untimed pass that warms the Connect server's JIT;
            then the same read published as a run publishes it but without Dagster (--publish-table), timed to
            visibility like rowrelay: what the orchestration around the read and publish costs
  rowrelay  `rowrelay backfill` of the whole backlog from the CLI, from launch until the last slice is visible
            read_committed (its progress record, polled every 50 ms); slice_max_rows 100k and 1M
  dpone     its PostgreSQL -> Kafka sink on the same table (own venv, at-least-once)
  debezium  Kafka Connect + Debezium's PostgreSQL connector, snapshot.mode=initial_only, from JVM launch until the
            topic holds every row: standalone (at-least-once) and distributed with exactly-once source support
  idle tick one sensor evaluation with no new rows
  freshness insert one row, time until it is visible read_committed, with the daemon's sensor ticking at
            the default interval; warm Spark (Connect server) and cold Spark (a JVM per run)
  memory    peak RSS of the run worker (the backfill process) for the largest slice
  cluster   that slice again, read on a private two-worker Spark standalone cluster (bench/cluster.py): rows/s,
            executors used, and its ratio to the memory run's local[2]
  kafka_cluster  the 1M-row backfill in 1M-row slices to a private three-node Kafka cluster (replication 3,
            min.insync.replicas 2), and its ratio to the single broker's (the rowrelay part's median)
The 1M-row runs (raw, ceiling, rowrelay, dpone, Debezium) go in `--repeats` rounds (3), every tool once per round;
each figure is the median of its rounds, and every sample is kept in results.json. The ceiling, ceiling + Kafka and
rowrelay runs also record the CPU-seconds of each process of the stack over the run (`cpu_s`).
Prints a table and writes bench/results.json. Not a test: figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import yaml
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results.json"
BENCH_DB = "rowrelay_bench"
BENCH_DAGSTER_DB = "rowrelay_bench_dagster"
PRODUCER_CONF = {"compression.type": "lz4", "linger.ms": 50, "batch.size": 1_000_000,
                 "queue.buffering.max.messages": 1_000_000, "queue.buffering.max.kbytes": 1_048_576}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class Stack:
    bootstrap: str = field(default_factory=lambda: os.environ["ROWRELAY_KAFKA_BOOTSTRAP"])
    pg_host: str = field(default_factory=lambda: os.environ.get("ROWRELAY_PG_HOST", "127.0.0.1"))
    pg_port: int = field(default_factory=lambda: int(os.environ.get("ROWRELAY_PG_PORT", "15432")))
    pg_user: str = field(default_factory=lambda: os.environ.get("ROWRELAY_PG_USER", "rowrelay"))
    pg_password: str = field(default_factory=lambda: os.environ["ROWRELAY_PG_PASSWORD"])
    spark_remote: str = field(default_factory=lambda: os.environ.get("ROWRELAY_SPARK_REMOTE", ""))
    home: Path = field(default_factory=lambda: Path(os.environ.get("ROWRELAY_HOME",
                                                                    Path.home() / ".cache" / "rowrelay")))

    def pg(self, dbname: str = BENCH_DB) -> dict[str, Any]:
        return {"host": self.pg_host, "port": self.pg_port, "user": self.pg_user, "password": self.pg_password,
                "dbname": dbname}

    def connect(self, dbname: str = BENCH_DB, autocommit: bool = True) -> psycopg.Connection:
        return psycopg.connect(**self.pg(dbname), autocommit=autocommit)


# -- source data --------------------------------------------------------------------------------------

def ensure_database(stack: Stack, name: str, fresh: bool = False) -> None:
    with stack.connect("postgres") as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if exists and fresh:
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
            exists = None
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')


def load_table(stack: Stack, table: str, rows: int) -> float:
    """The issue's table shape, filled in 1M-row statements; returns seconds taken."""
    started = time.perf_counter()
    with stack.connect() as conn:
        # The stack's server commits asynchronously: VACUUM right after an asynchronous commit may not set the
        # rows' hint bits yet, so it marked no page all-visible (relallvisible 0) and every count of the table
        # fetched each row from the heap. Committed synchronously, VACUUM leaves the settled table a backfill
        # meets in practice.
        conn.execute("SET synchronous_commit = on")
        conn.execute(f"DROP TABLE IF EXISTS {table}")
        conn.execute(f"CREATE TABLE {table} (id bigserial PRIMARY KEY, category varchar, domain varchar, "
                     "ts timestamp, amount numeric(12,2), note text)")
        for lo in range(1, rows + 1, 1_000_000):
            hi = min(rows, lo + 999_999)
            conn.execute(
                f"INSERT INTO {table} (category, domain, ts, amount, note) "
                "SELECT (ARRAY['books','music','garden','toys','food'])[1 + g %% 5], "
                "'shop' || (g %% 97) || '.example.com', timestamp '2026-01-01' + g * interval '1 second', "
                "round((g %% 100000) / 100.0, 2), md5(g::text) FROM generate_series(%s::bigint, %s::bigint) g",
                (lo, hi))
        conn.execute(f"VACUUM ANALYZE {table}")
        visible, pages = conn.execute("SELECT relallvisible, relpages FROM pg_class WHERE oid = %s::regclass",
                                      (table,)).fetchone()
        if visible < pages:
            log(f"warning: VACUUM marked {visible} of {pages} pages of {table} all-visible")
    return time.perf_counter() - started


def drop_bench_topics(stack: Stack) -> None:
    admin = AdminClient({"bootstrap.servers": stack.bootstrap})
    topics = [t for t in admin.list_topics(timeout=30).topics
              if t.startswith(("bench.", "bench_")) or ".bench_" in t or t.startswith("_rowrelay.progress.bench")]
    if topics:
        for fut in admin.delete_topics(topics, operation_timeout=30).values():
            with contextlib.suppress(Exception):  # already gone
                fut.result()


def broker_state(stack: Stack) -> dict[str, Any]:
    """What the broker carries and how its JVM runs: a developer's stack collects thousands of test topics, and a
    heap too small for them costs every publish G1 marking (`cpu_s.broker_gc_marking`)."""
    from stack.local import read_pid

    topics = AdminClient({"bootstrap.servers": stack.bootstrap}).list_topics(timeout=30).topics
    pid = read_pid(stack.home / "kafka" / "kafka.pid")
    jvm: list[str] = []
    with contextlib.suppress(OSError, TypeError):
        jvm = [a for a in Path(f"/proc/{pid}/cmdline").read_text().split("\0") if a.startswith("-X")]
    return {"topics": len(topics), "partitions": sum(len(t.partitions) for t in topics.values()), "jvm": jvm}


def topic_count(stack: Stack, topic: str) -> int:
    """Committed messages in a topic, counted by a read_committed consumer to the end."""
    return topic_census(stack, topic, 0).messages


@dataclass
class TopicCensus:
    """A topic read to its end, read_committed: its messages, and whether their `rowrelay.watermark` headers are
    1..hi each exactly once (no duplicate, no gap; a count alone misses a duplicate beside a missing row)."""
    messages: int
    duplicates: int
    missing: int

    @property
    def exactly_once(self) -> bool:
        return self.duplicates == 0 and self.missing == 0


def topic_census(stack: Stack, topic: str, hi: int) -> TopicCensus:
    """Read `topic` to its end and check its watermark headers against 1..`hi` (`hi` 0: count only)."""
    import numpy as np

    from resources.exactly_once import FAST_READS

    seen = np.zeros(hi + 1, dtype=np.int32)
    outside = 0  # a watermark header outside 1..hi, or none
    consumer = Consumer({"bootstrap.servers": stack.bootstrap, "group.id": f"bench-{uuid.uuid4().hex}",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "auto.offset.reset": "earliest", **FAST_READS})
    count = 0
    try:
        md = consumer.list_topics(topic, timeout=30)
        for p in sorted(md.topics[topic].partitions):
            tp = TopicPartition(topic, p)
            low, high = consumer.get_watermark_offsets(tp, timeout=30)
            consumer.assign([TopicPartition(topic, p, low)])
            while consumer.position([tp])[0].offset < high:
                wms = []
                for msg in consumer.consume(10_000, 1.0):
                    if msg.error():
                        continue
                    count += 1
                    if hi:
                        wm = dict(msg.headers() or ()).get("rowrelay.watermark")
                        wms.append(int(wm) if wm is not None else -1)
                if wms:
                    at = np.asarray(wms, dtype=np.int64)
                    inside = (at >= 1) & (at <= hi)
                    outside += int((~inside).sum())
                    np.add.at(seen, at[inside], 1)
    finally:
        consumer.close()
    if not hi:
        return TopicCensus(count, 0, 0)
    rows = seen[1:]
    return TopicCensus(count, int(np.maximum(rows.astype(np.int64) - 1, 0).sum()) + outside, int((rows == 0).sum()))


# -- raw ceiling --------------------------------------------------------------------------------------

def create_topic(stack: Stack, topic: str) -> None:
    """The stack's broker does not auto-create topics."""
    from confluent_kafka.admin import NewTopic

    admin = AdminClient({"bootstrap.servers": stack.bootstrap})
    for fut in admin.create_topics([NewTopic(topic, 1)], operation_timeout=30).values():
        fut.result()


def run_raw(stack: Stack, table: str, topic: str) -> float:
    create_topic(stack, topic)
    producer = Producer({"bootstrap.servers": stack.bootstrap, **PRODUCER_CONF})
    produce, poll = producer.produce, producer.poll
    started = time.perf_counter()
    query = f"COPY (SELECT row_to_json(t) FROM {table} t ORDER BY id) TO STDOUT"
    with stack.connect() as conn, conn.cursor() as cur, cur.copy(query) as copy:
        rest = b""
        for chunk in copy:
            lines = (rest + bytes(chunk)).split(b"\n")
            rest = lines.pop()
            for line in lines:
                try:
                    produce(topic, line)
                except BufferError:
                    poll(0.1)
                    produce(topic, line)
            poll(0)
    producer.flush(300)
    return time.perf_counter() - started


def init_instance(stack: Stack, workdir: Path) -> None:
    """Create the fresh bench instance's Dagster tables before anything is timed: a deployment's instance exists
    already, and its first use (schema creation and migrations, ~1 s here) would otherwise be charged to the first
    timed run."""
    env = dagster_env(stack, write_config(stack, workdir / "init.yaml", [
        {"source": "init", "table": "public.init", "watermark": "id"}]))
    subprocess.run([sys.executable, "-c", "from dagster import DagsterInstance\nDagsterInstance.get().dispose()"],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)


# -- Spark ceiling ------------------------------------------------------------------------------------

def source_url(stack: Stack) -> str:
    return (f"postgresql://{stack.pg_user}:{stack.pg_password}@{stack.pg_host}:{stack.pg_port}/{BENCH_DB}"
            "?sslmode=disable")


def run_spark_ceiling(stack: Stack, table: str, rows: int) -> dict[str, Any]:
    """rowrelay's slice path (reflection, JDBC read, JSON expressions, read-ahead into Python bytes) without
    Kafka, in a fresh process timed from launch like a backfill (bench/spark_ceiling.py)."""
    cmd = [sys.executable, "-m", "bench.spark_ceiling", "--url", source_url(stack), "--table", f"public.{table}",
           "--rows", str(rows)] + (["--remote", stack.spark_remote] if stack.spark_remote else [])
    meter = CpuMeter(stack)
    cpu_start, process_start = meter.snapshot(), children_cpu_s()
    started = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                         text=True, timeout=1800)
    seconds = time.perf_counter() - started
    cpu = CpuMeter.seconds(cpu_start, meter.snapshot(), children_cpu_s() - process_start)  # until its exit
    if out.returncode != 0:
        raise RuntimeError(f"spark ceiling failed: {out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {"seconds": round(seconds, 2), "read_seconds": result["read_seconds"], "rows": result["rows"],
            "rows_per_s": round(rows / seconds), "cpu_s": cpu}


def run_kafka_path(stack: Stack, table: str, rows: int, label: str) -> dict[str, Any]:
    """The Spark ceiling's read published as a run publishes it (SlicePublisher) but without Dagster, timed from
    launch to visibility like a backfill (bench/spark_ceiling.py --publish-table): what the orchestration costs."""
    table_id = f"bench{label}.public.{table}"
    cmd = [sys.executable, "-m", "bench.spark_ceiling", "--url", source_url(stack), "--table", f"public.{table}",
           "--rows", str(rows), "--publish-table", table_id, "--bootstrap", stack.bootstrap] + \
        (["--remote", stack.spark_remote] if stack.spark_remote else [])
    with CommittedWatch(stack, table_id, rows) as watch:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        watch.watch_pid(proc.pid)
        process_start = children_cpu_s()
        _, stderr = proc.communicate(timeout=1800)
        process_s = children_cpu_s() - process_start
    if proc.returncode != 0 or watch.at is None:
        raise RuntimeError(f"Spark ceiling + Kafka failed: {stderr[-2000:]}")
    return watch.figures(started, process_s_if_gone=process_s)


# -- rowrelay -----------------------------------------------------------------------------------------

# Appended to the bench instance's dagster.yaml to measure a run launcher other than the checkout's.
LAUNCHERS = {
    "default": "run_launcher:\n  module: dagster._core.launcher.default_run_launcher\n  class: DefaultRunLauncher\n",
    "warm": "run_launcher:\n  module: orchestration.launcher\n  class: WarmRunLauncher\n",
}


def dagster_env(stack: Stack, config: Path, launcher: str | None = None) -> dict[str, str]:
    home = stack.home / "bench" / ("dagster-home" + (f"-{launcher}" if launcher else ""))
    home.mkdir(parents=True, exist_ok=True)
    text = (ROOT / "dagster.yaml").read_text()
    if launcher:  # drop the checkout's run_launcher stanza (the key and its indented lines), then add ours
        kept, skipping = [], False
        for line in text.splitlines():
            if line.startswith("run_launcher:"):
                skipping = True
                continue
            if skipping and (line.startswith(" ") or not line.strip()):
                continue
            skipping = False
            kept.append(line)
        text = "\n".join(kept) + "\n" + LAUNCHERS[launcher]
    (home / "dagster.yaml").write_text(text)
    return {**os.environ, "DAGSTER_HOME": str(home), "DAGSTER_PG_DB": BENCH_DAGSTER_DB,
            "ROWRELAY_DAGSTER_DIR": str(stack.home / "bench" / "dagster-artifacts"),
            "ROWRELAY_CONFIG": str(config), "PYTHONPATH": str(ROOT)}


def write_config(stack: Stack, path: Path, tables: list[dict[str, Any]], warm_spark: bool = True,
                 spark_remote: str | None = None) -> Path:
    url = ("postgresql://${ROWRELAY_PG_USER:-rowrelay}:${ROWRELAY_PG_PASSWORD}@${ROWRELAY_PG_HOST:-127.0.0.1}:"
           "${ROWRELAY_PG_PORT:-15432}/" + BENCH_DB + "?sslmode=disable")  # every tool reads over plain TCP here
    sources = {t["source"]: {"url": url} for t in tables}
    remote = spark_remote or (stack.spark_remote if warm_spark else "")
    spark = {"remote": remote} if remote else {"master": "local[2]"}
    path.write_text(yaml.safe_dump({"sources": sources, "tables": tables, "spark": spark,
                                    "kafka": {"bootstrap_servers": stack.bootstrap}}))
    return path


def peak_rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(stat: str) -> list[str]:
    """A /proc stat line's fields after its `(name)`, which may itself hold spaces and parentheses."""
    return stat.rsplit(")", 1)[1].split()


def _cpu_ticks(pid: int) -> int:
    """User + system ticks of a process (all its threads) and of its children it has reaped; 0 if it is gone."""
    try:
        fields = _stat_fields(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return 0
    return sum(int(v) for v in fields[11:15])


def thread_cpu_ticks(pid: int, name_prefix: str) -> int:
    """User + system ticks of a process's live threads whose name starts with `name_prefix`."""
    total = 0
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                stat = (task / "stat").read_text()
                if stat[stat.index("(") + 1:].startswith(name_prefix):
                    total += sum(int(v) for v in _stat_fields(stat)[11:13])
    return total


def live_cpu_ticks(field: int, value: int) -> int:
    """User + system ticks of every live process whose /proc stat `field` (after the command name) is `value`:
    1, the parent pid; 3, the session id."""
    total = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int(_stat_fields((entry / "stat").read_text())[field]) == value:
                    total += _cpu_ticks(int(entry.name))
    return total


class CpuMeter:
    """CPU-seconds of the stack's processes over a run, to show where a tool's CPU goes on this shared box: the
    Spark Connect server, PostgreSQL (the postmaster, its live backends and the ended ones it reaped: a run's
    connections end with it), the broker, and the tool's own process (its threads and reaped children)."""

    def __init__(self, stack: Stack) -> None:
        from stack.local import read_pid

        self.pids = {"spark": read_pid(stack.home / "spark-connect" / "spark-connect.pid"),
                     "postgres": read_pid(stack.home / "postgres" / "data" / "postmaster.pid"),
                     "broker": read_pid(stack.home / "kafka" / "kafka.pid")}

    def snapshot(self, pid: int | None = None) -> dict[str, int]:
        out = {name: _cpu_ticks(p) for name, p in self.pids.items() if p}
        postmaster = self.pids.get("postgres")
        if postmaster:  # the live backends (an ended one is in the postmaster's own)
            out["postgres"] += live_cpu_ticks(1, postmaster)
        if pid is not None:
            out["process"] = _cpu_ticks(pid)
        if self.pids.get("broker"):  # G1's concurrent marking: high when the broker's heap is short (stack/local.py)
            out["broker_gc_marking"] = thread_cpu_ticks(self.pids["broker"], "G1 Conc#")
        return out

    @staticmethod
    def seconds(start: dict[str, int], end: dict[str, int], process_s: float | None = None) -> dict[str, float]:
        """CPU-seconds per process between two snapshots (`process_s`: the tool's own, measured otherwise)."""
        out = {k: round((end[k] - start.get(k, 0)) / CLK_TCK, 2) for k in ("process", "spark", "postgres", "broker")
               if k in end}
        if process_s is not None:
            out["process"] = round(process_s, 2)
        out["all"] = round(sum(out.values()), 2)
        if "broker_gc_marking" in end:  # part of "broker", not added to "all" again
            marking = end["broker_gc_marking"] - start.get("broker_gc_marking", 0)
            out["broker_gc_marking"] = round(marking / CLK_TCK, 2)
        return out


def children_cpu_s() -> float:
    """CPU-seconds of the children this process has waited for (a finished tool's whole process)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_watching_rss(cmd: list[str], env: dict[str, str], log_path: Path,
                     on_start: Callable[[int], None] | None = None) -> tuple[float, int, int]:
    """Run a command; returns (seconds, exit code, peak RSS in KiB sampled from /proc every 0.1 s). `on_start` gets
    the process id once it runs."""
    peak = 0
    started = time.perf_counter()
    with log_path.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        if on_start is not None:
            on_start(proc.pid)
        stop = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, peak_rss_kib(proc.pid))
                stop.wait(0.1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        code = proc.wait()
        stop.set()
        watcher.join()
    return time.perf_counter() - started, code, peak


class CommittedWatch:
    """Polls a table's committed progress (read_committed, the progress record commits with the rows) every 50 ms
    from launch and notes when it first reaches `hi`: when the last slice became visible to consumers."""

    def __init__(self, stack: Stack, table_id: str, hi: int) -> None:
        from resources.exactly_once import ProgressTail, TableChannel
        from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX

        self.tail = ProgressTail({"bootstrap.servers": stack.bootstrap}, TableChannel.for_table(
            table_id, table_id, prefix=DEFAULT_TRANSACTIONAL_ID_PREFIX).progress_topic)
        self.stack, self.table_id = stack, table_id
        self.hi, self.at, self.committed_hi = hi, None, None
        # CPU per process from launch until visible: snapshots now and when the rows become visible.
        self.meter = CpuMeter(stack)
        self.pid: int | None = None
        self.cpu_start, self.cpu_end = self.meter.snapshot(), None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> CommittedWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.at is None:
            self._poll()  # one last look after the process ended
        self.stop.set()
        self.thread.join()
        self.tail.close()

    def _poll(self) -> None:
        with contextlib.suppress(Exception):  # the topic does not exist until the run creates it
            record = self.tail.read(5.0)
            if record is not None:
                self.committed_hi = record.hi
                if record.hi >= self.hi and self.at is None:
                    self.at = time.perf_counter()
                    self.cpu_end = self.meter.snapshot(self.pid)

    def _watch(self) -> None:
        while self.at is None and not self.stop.wait(0.05):
            self._poll()

    def figures(self, started: float, process_s_if_gone: float | None = None) -> dict[str, Any]:
        """Seconds from `started` (perf_counter) until the rows became visible, and the topic counted to check
        exactly once: every row, once, under the progress record that made them visible. `process_s_if_gone`: the
        tool's CPU to its exit, for when it had exited (and been reaped) before the snapshot at visibility read it
        (the ceiling + Kafka process exits right after its commit; its CPU read 0 once)."""
        assert self.at is not None
        seconds = self.at - started
        census = topic_census(self.stack, self.table_id, self.hi)
        out = {"seconds": round(seconds, 2), "rows_per_s": round(self.hi / seconds), "messages": census.messages,
               "committed_hi": self.committed_hi, "duplicates": census.duplicates, "missing": census.missing,
               "exactly_once": census.exactly_once}
        if self.cpu_end is not None and self.pid is not None:
            gone = not self.cpu_end.get("process") and process_s_if_gone is not None
            out["cpu_s"] = CpuMeter.seconds(self.cpu_start, self.cpu_end, process_s_if_gone if gone else None)
            if gone:
                out["cpu_s_process_to_exit"] = True
        return out

    def watch_pid(self, pid: int) -> None:
        """The tool's process, whose CPU the snapshot at visibility takes too."""
        self.pid = pid


def run_rowrelay(stack: Stack, table: str, rows: int, slice_rows: int, workdir: Path, label: str,
                 spark_remote: str | None = None) -> dict[str, Any]:
    """`rowrelay backfill` of `table` under a source of its own (`label`: its own topic and progress); Spark is the
    stack's Connect server unless `spark_remote` names another."""
    source = f"bench{label}"
    table_id = f"{source}.public.{table}"
    config = write_config(stack, workdir / f"rowrelay-{label}.yaml", [
        {"source": source, "table": f"public.{table}", "watermark": "id", "slice_max_rows": slice_rows,
         "key": ["id"]}], spark_remote=spark_remote)
    env = dagster_env(stack, config)
    cmd = [sys.executable, "-m", "orchestration.cli", "backfill", "--table", table_id]
    # Timed from launch until the last slice is visible read_committed, as the peers are (Debezium: until the
    # topic holds every row); the process then still records the run's checks and exits (seconds_to_exit).
    with CommittedWatch(stack, table_id, rows) as watch:
        started = time.perf_counter()
        seconds_to_exit, code, peak = run_watching_rss(cmd, env, workdir / f"rowrelay-{label}.log",
                                                       on_start=watch.watch_pid)
    if code != 0:
        raise RuntimeError(f"rowrelay backfill failed ({code}); see {workdir / f'rowrelay-{label}.log'}")
    if watch.at is None:
        raise RuntimeError(f"rowrelay backfill of {table_id} exited without committing up to {rows}")
    return {"slice_max_rows": slice_rows, **watch.figures(started), "seconds_to_exit": round(seconds_to_exit, 2),
            "peak_rss_mib": round(peak / 1024, 1)}


# -- idle tick and freshness --------------------------------------------------------------------------

def idle_tick_ms(stack: Stack, config: Path, env: dict[str, str], ticks: int = 10) -> float:
    """Median time of one sensor evaluation with no new rows, in a fresh process like the daemon's."""
    code = (
        "import json, time\n"
        "from dagster import DagsterInstance, build_sensor_context\n"
        "from resources.config import load_config\n"
        "from orchestration.factory import build_definitions\n"
        "cfg = load_config()\n"
        "defs = build_definitions(cfg)\n"
        "table = cfg.tables[0]\n"
        "sensor = defs.resolve_sensor_def(f'{table.dagster_name}_slices')\n"
        "times, cursor = [], None\n"
        "with DagsterInstance.get() as instance:\n"
        f"    for i in range({ticks} + 1):\n"
        "        with build_sensor_context(cursor=cursor, resources=defs.resources, definitions=defs,\n"
        "                                  sensor_name=sensor.name, instance=instance) as ctx:\n"
        "            t = time.perf_counter()\n"
        "            data = sensor.evaluate_tick(ctx)\n"
        "            times.append((time.perf_counter() - t) * 1000)\n"
        "        assert not data.run_requests, data.run_requests\n"
        "        cursor = data.cursor\n"
        "print(json.dumps(times[1:]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "ROWRELAY_CONFIG": str(config)},
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"idle tick failed: {out.stderr[-2000:]}")
    return statistics.median(json.loads(out.stdout.strip().splitlines()[-1]))


@dataclass
class FreshnessSample:
    freshness_s: float  # insert -> visible read_committed
    run_start_s: float | None  # the run launched -> its worker executing (Dagster's run stats)
    run_overhead_s: float | None  # the run launched -> its first message produced (the message's CreateTime)


def run_timings(env: dict[str, str], job: str, row_id: int, produced_ms: int) -> tuple[float | None, float | None]:
    """(launch -> worker executing, launch -> first message) of the run that published `row_id`."""
    from dagster import DagsterInstance, RunsFilter

    from orchestration.runs import run_slices

    saved = dict(os.environ)
    os.environ.update({k: env[k] for k in ("DAGSTER_HOME", "DAGSTER_PG_DB", "ROWRELAY_DAGSTER_DIR")})
    try:
        with DagsterInstance.get() as instance:
            for run in instance.get_runs(RunsFilter(job_name=job), limit=20):
                span = run_slices(dict(run.tags))
                if span is None or not span[0].lo < row_id <= span[1].hi:
                    continue
                stats = instance.get_run_stats(run.run_id)
                if stats.launch_time is None:
                    return None, None
                start = stats.start_time - stats.launch_time if stats.start_time else None
                return start, produced_ms / 1000 - stats.launch_time
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return None, None


def measure_freshness(stack: Stack, workdir: Path, samples: int, warm_spark: bool, label: str,
                      launcher: str | None = None) -> list[FreshnessSample]:
    """The daemon relays a live table; each sample inserts one row and times until it is read_committed, and
    how long the run that published it took from launch to its worker executing and to its first message."""
    table = f"bench_fresh_{label}_{uuid.uuid4().hex[:6]}"
    source = f"fresh{label}"
    table_id = f"{source}.public.{table}"
    with stack.connect() as conn:
        conn.execute(f"CREATE TABLE {table} (id bigserial PRIMARY KEY, category varchar, note text)")
    config = write_config(stack, workdir / f"fresh-{label}.yaml", [
        {"source": source, "table": f"public.{table}", "watermark": "id", "key": ["id"]}], warm_spark=warm_spark)
    env = dagster_env(stack, config, launcher)
    job = f"relay_{source}_public_{table}"
    daemon_log = (workdir / f"daemon-{label}.log").open("w")
    daemon = subprocess.Popen([sys.executable, "-m", "dagster._daemon", "run", "-w", "workspace.yaml"],
                              cwd=ROOT, env=env, stdout=daemon_log, stderr=subprocess.STDOUT, start_new_session=True)
    consumer = Consumer({"bootstrap.servers": stack.bootstrap, "group.id": f"bench-{uuid.uuid4().hex}",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "auto.offset.reset": "earliest"})
    results: list[FreshnessSample] = []
    try:
        # Warm-up: the first row also waits for the daemon and code server to start.
        for i in range(samples + 1):
            with stack.connect() as conn:
                (row_id,) = conn.execute(f"INSERT INTO {table} (category, note) VALUES ('fresh', 'sample {i}') "
                                         "RETURNING id").fetchone()
            inserted = time.perf_counter()
            deadline = inserted + (300 if i == 0 else 120)
            found = False
            if i == 0:
                while table_id not in consumer.list_topics(timeout=10).topics:
                    if time.perf_counter() > deadline:
                        raise RuntimeError(f"freshness: topic {table_id} never appeared; see {daemon_log.name}")
                    time.sleep(0.2)
                consumer.subscribe([table_id])
            while not found:
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"freshness: row {row_id} not visible in time; see {daemon_log.name}")
                msg = consumer.poll(0.1)
                if msg is None or msg.error():
                    continue
                found = json.loads(msg.value())["id"] == row_id
            if i > 0:
                seen = time.perf_counter() - inserted
                start, overhead = run_timings(env, job, row_id, msg.timestamp()[1])
                results.append(FreshnessSample(seen, start, overhead))
                log(f"freshness {label}: sample {i}: {seen:.1f} s (run start {start}, to first message {overhead})")
            time.sleep(0.5)
    finally:
        consumer.close()
        stop_process_group(daemon)
        daemon_log.close()
    return results


def stop_process_group(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM a process started with start_new_session (a daemon with its code server and run workers, a webserver)
    and its group; SIGKILL after `grace_s`."""
    os.killpg(proc.pid, 15)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# -- main ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rss-rows", type=int, default=10_000_000, help="rows of the one-slice memory run (0: skip)")
    parser.add_argument("--freshness-samples", type=int, default=20)
    parser.add_argument("--cold-samples", type=int, default=5, help="freshness samples with a JVM per run (0: skip)")
    parser.add_argument("--skip-dpone", action="store_true")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of the 1M-row throughput runs (raw, ceiling, rowrelay, dpone, Debezium); each "
                             "figure is the median of its rounds")
    parser.add_argument("--launchers", nargs="+", choices=sorted(LAUNCHERS), default=["warm"],
                        help="run launchers to measure freshness and run overhead with (the first gives the "
                             "unsuffixed keys)")
    parts = ["raw", "ceiling", "rowrelay", "dpone", "debezium", "idle", "scale", "freshness", "memory", "cluster",
             "kafka_cluster"]
    parser.add_argument("--only", choices=parts, nargs="*")
    args = parser.parse_args(argv)
    only = set(args.only or parts)
    if "cluster" in only and "memory" not in only:  # the cluster's slice is the memory part's, beside it
        parser.error("--only cluster needs memory in the same run (the same slice on local[2], its baseline)")
    if "idle" in only and "rowrelay" not in only:  # the idle tick is that of the table the rowrelay runs relayed
        parser.error("--only idle needs rowrelay in the same run (its idle tick is on the table rowrelay relays)")
    stack = Stack()
    workdir = stack.home / "bench" / "work"
    workdir.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex[:6]
    table = f"bench_events_{run_id}"
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}
    results: dict[str, Any] = {"rows": args.rows, "machine": machine,
                               "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    log("dropping old bench topics and databases")
    drop_bench_topics(stack)
    ensure_database(stack, BENCH_DB, fresh=True)
    ensure_database(stack, BENCH_DAGSTER_DB, fresh=True)
    init_instance(stack, workdir)
    log(f"loading {args.rows:,} rows into {BENCH_DB}.public.{table}")
    results["load_seconds"] = round(load_table(stack, table, args.rows), 1)

    # The 1M-row throughput figures: `--repeats` rounds, each running every tool once in the same order, so a slow
    # stretch of this shared box slows each tool alike; each figure is the median of its rounds (every sample is
    # in results.json, and so are the ratios within each round).
    results["broker"] = broker_state(stack)
    log(f"broker: {results['broker']['partitions']:,} partitions, JVM {' '.join(results['broker']['jvm'])}")
    if "ceiling" in only:
        # Long-running services have a warm JIT; a fresh Spark Connect server compiles its JDBC and JSON code paths
        # on the first read (the first 1M rows took 2-3x longer here), a fresh broker its produce path (its C2
        # compiler took 5.9 CPU-s of its first 1M-row publish). One untimed pass of the ceiling + Kafka path warms
        # both for every figure.
        log("warm-up: one untimed pass of the Spark ceiling + Kafka path (Spark Connect server and broker)")
        run_kafka_path(stack, table, args.rows, f"warm{run_id}")
    samples: dict[str, list[dict[str, Any]]] = {}
    for rnd in range(1, args.repeats + 1):
        tag = "" if rnd == 1 else f"r{rnd}"  # round 1 keeps the plain names (the idle tick reuses its config)
        log(f"throughput round {rnd} of {args.repeats}")
        if "raw" in only:
            log("raw: COPY row_to_json -> plain producer")
            topic = f"bench.raw.{run_id}{tag}"
            seconds = run_raw(stack, table, topic)
            count = topic_count(stack, topic)
            samples.setdefault("raw", []).append({"seconds": round(seconds, 2), "messages": count,
                                                  "rows_per_s": round(args.rows / seconds)})
            log(f"raw: {seconds:.1f} s, {round(args.rows / seconds):,} rows/s, {count:,} messages")
        if "ceiling" in only:
            log("spark ceiling: the slice path into Python without Kafka")
            c = run_spark_ceiling(stack, table, args.rows)
            samples.setdefault("spark_ceiling", []).append(c)
            log(f"spark ceiling: {c['seconds']} s ({c['read_seconds']} s reading), {c['rows_per_s']:,} rows/s")
            log("spark ceiling + Kafka: the same read published like a run's, without Dagster")
            k = run_kafka_path(stack, table, args.rows, f"kp{run_id}{tag}")
            samples.setdefault("kafka_path", []).append(k)
            log(f"spark ceiling + Kafka: {k['seconds']} s, {k['rows_per_s']:,} rows/s, exactly once: "
                f"{k['exactly_once']}")
        if "rowrelay" in only:
            # The two slice sizes swap places every round: the run right after the ceiling + Kafka run was the
            # slower one more often than not here, and a fixed order put that on the ten-slice figure every round.
            sizes = ((100_000, "100k"), (1_000_000, "1m"))
            for slice_rows, label in (sizes if rnd % 2 else sizes[::-1]):
                log(f"rowrelay: backfill from the CLI, slice_max_rows {slice_rows:,}")
                r = run_rowrelay(stack, table, args.rows, slice_rows, workdir, label + tag)
                log(f"rowrelay {label}: {r['seconds']} s, {r['rows_per_s']:,} rows/s, exactly once: "
                    f"{r['exactly_once']}")
                samples.setdefault(f"rowrelay_{label}", []).append(r)
        if "dpone" in only and not args.skip_dpone:
            from bench.dpone_peer import run_dpone

            log("dpone: PostgreSQL -> Kafka sink (separate venv)")
            try:
                d = run_dpone(stack.pg(), table, stack.bootstrap, f"bench.dpone.{run_id}{tag}", args.rows, workdir)
                samples.setdefault("dpone", []).append(d)
                log(f"dpone: {d['seconds']:.1f} s, {d['rows_per_s']:,.0f} rows/s, {d['messages']:,} messages")
            except Exception as exc:  # noqa: BLE001 - a peer failing is a figure to report, not a crash
                samples.setdefault("dpone", []).append({"error": str(exc)[-2000:]})
                log(f"dpone failed: {exc}")
        if "debezium" in only:
            from bench.debezium_peer import run_debezium

            for exactly_once in (False, True):
                label = "debezium_eos" if exactly_once else "debezium"
                log(f"{label}: Kafka Connect + Debezium PostgreSQL connector, snapshot.mode=initial_only"
                    + (" (distributed worker, exactly.once.source.support)" if exactly_once else " (standalone)"))
                try:
                    d = run_debezium(stack.pg(), f"public.{table}", stack.bootstrap, f"bench.{label}.{run_id}{tag}",
                                     args.rows, workdir / f"{label}{tag}", exactly_once=exactly_once)
                    samples.setdefault(label, []).append(d)
                    log(f"{label}: {d['seconds']:.1f} s, {d['rows_per_s']:,.0f} rows/s, {d['messages']:,} messages")
                except Exception as exc:  # noqa: BLE001 - a peer failing is a figure to report, not a crash
                    samples.setdefault(label, []).append({"error": str(exc)[-2000:]})
                    log(f"{label} failed: {exc}")
    summarize_throughput(results, samples, args.repeats)

    if "idle" in only:
        source = "bench100k"
        config = workdir / "rowrelay-100k.yaml"
        if not config.exists():
            write_config(stack, config, [{"source": source, "table": f"public.{table}", "watermark": "id",
                                          "slice_max_rows": 100_000}])
        results["idle_tick_ms"] = round(idle_tick_ms(stack, config, dagster_env(stack, config)), 1)
        log(f"idle sensor tick: {results['idle_tick_ms']} ms")

    if "scale" in only:
        from bench.scale import idle_daemon, idle_tick_large_history_ms

        log("idle tick with 300k committed slices of history (seeded straight into Kafka and the instance)")
        results["idle_tick_large_history_ms"] = round(idle_tick_large_history_ms(stack, workdir), 1)
        log(f"idle tick, large history: {results['idle_tick_large_history_ms']} ms")
        log("100 tables under one daemon: the worst gap between a sensor's ticks (4 min)")
        many = idle_daemon(stack, workdir, 100, run_s=180.0, warmup_s=60.0)
        results["sensor_lag_100_tables_s"] = round(many.worst_gap_ratio, 1)
        results["idle_cpu_pct_100_tables"] = many.cpu_pct
        log(f"100 tables: worst tick gap {results['sensor_lag_100_tables_s']} s (interval 5 s); idle CPU, % of a "
            f"core: {many.cpu_pct}")
        # Up to 20 tables each has a sensor of its own: the most a table's idle ticks cost.
        log("20 idle tables under one daemon, a sensor each: CPU (2 min)")
        few = idle_daemon(stack, workdir, 20, run_s=60.0, warmup_s=60.0)
        results["idle_cpu_pct_20_tables"] = few.cpu_pct
        log(f"20 tables: idle CPU, % of a core: {few.cpu_pct}; worst tick gap {few.worst_gap_ratio:.1f} s")

    if "freshness" in only:
        # Each launcher relays its own live table through the daemon: freshness and what one run costs.
        for launcher in args.launchers:
            suffix = "" if launcher == args.launchers[0] else f"_{launcher}_launcher"
            samples = measure_freshness(stack, workdir, args.freshness_samples, warm_spark=True,
                                        label=f"warm_{launcher}", launcher=launcher)
            fresh = [x.freshness_s for x in samples]
            starts = [x.run_start_s for x in samples if x.run_start_s is not None]
            overheads = [x.run_overhead_s for x in samples if x.run_overhead_s is not None]
            results[f"freshness_samples_s{suffix}"] = [round(x, 2) for x in fresh]
            results[f"freshness_p50_s{suffix}"] = round(percentile(fresh, 0.5), 2)
            results[f"freshness_p95_s{suffix}"] = round(percentile(fresh, 0.95), 2)
            results[f"run_start_s{suffix}"] = round(statistics.median(starts), 2) if starts else None
            results[f"run_overhead_s{suffix}"] = round(statistics.median(overheads), 2) if overheads else None
            results[f"run_overhead_samples_s{suffix}"] = [round(x, 2) for x in overheads]
            results[f"launcher{suffix}"] = launcher
        if args.cold_samples:
            cold = measure_freshness(stack, workdir, args.cold_samples, warm_spark=False, label="cold")
            results["freshness_cold_samples_s"] = [round(x.freshness_s, 2) for x in cold]
            results["freshness_cold_p50_s"] = round(percentile([x.freshness_s for x in cold], 0.5), 2)

    if "kafka_cluster" in only:
        from bench.cluster import kafka_cluster_backfill  # it builds on this module: imported where used

        k = kafka_cluster_backfill(stack, table, args.rows, 1_000_000, workdir)
        results["kafka_cluster"] = k
        results["kafka_cluster_rows_per_s"] = k["rows_per_s"]
        if single := results.get("rowrelay_1m_slice_rows_per_s"):  # the rowrelay part's median, same slices
            results["ratio_kafka_cluster_vs_single_broker"] = round(k["rows_per_s"] / single, 2)
        log(f"kafka cluster: {k['rows_per_s']:,} rows/s on {k['brokers']} brokers, exactly once: {k['exactly_once']}")

    if "memory" in only and args.rss_rows:
        big = f"bench_big_{run_id}"
        log(f"memory: loading {args.rss_rows:,} rows for one slice")
        load_table(stack, big, args.rss_rows)
        r = run_rowrelay(stack, big, args.rss_rows, args.rss_rows, workdir, "rss")
        results["memory"] = r
        results["peak_rss_mib"] = r["peak_rss_mib"]
        results["peak_rss_rows"] = args.rss_rows
        log(f"memory: {args.rss_rows:,}-row slice, peak RSS {r['peak_rss_mib']} MiB, {r['rows_per_s']:,} rows/s")
        if "cluster" in only:
            from bench.cluster import cluster_slice  # it builds on this module: imported where used

            c = cluster_slice(stack, big, args.rss_rows, workdir)
            results["cluster"] = c
            results["cluster_slice_rows_per_s"] = c["rows_per_s"]
            results["cluster_executors_used"] = c["executors_used"]
            results["ratio_cluster_vs_local"] = round(c["rows_per_s"] / r["rows_per_s"], 2)
            log(f"cluster: {args.rss_rows:,}-row slice on {c['workers']} workers, {c['rows_per_s']:,} rows/s on "
                f"{c['executors_used']} executor(s); {results['ratio_cluster_vs_local']}x local[2]")
        with stack.connect() as conn:
            conn.execute(f"DROP TABLE IF EXISTS {big}")

    mine = results.get("rowrelay_rows_per_s")
    for peer, ratio in (("raw_rows_per_s", "ratio_vs_raw"), ("dpone_rows_per_s", "ratio_vs_dpone"),
                        ("debezium_rows_per_s", "ratio_vs_debezium"),
                        ("debezium_eos_rows_per_s", "ratio_vs_debezium_eos"),
                        ("spark_ceiling_rows_per_s", "ratio_vs_spark_ceiling"),
                        ("kafka_path_rows_per_s", "ratio_vs_kafka_path")):
        if results.get(peer) and mine:
            results[ratio] = round(mine / results[peer], 2)
    if results.get("kafka_path_rows_per_s") and results.get("spark_ceiling_rows_per_s"):
        # How close the same read and publish get without Dagster: the part of the gap that is orchestration.
        results["ratio_kafka_path_vs_spark_ceiling"] = round(
            results["kafka_path_rows_per_s"] / results["spark_ceiling_rows_per_s"], 2)
    for key in ("raw_rows_per_s", "rowrelay_rows_per_s", "dpone_rows_per_s", "ratio_vs_raw", "ratio_vs_dpone",
                "debezium_rows_per_s", "spark_ceiling_rows_per_s", "ratio_vs_debezium", "ratio_vs_spark_ceiling",
                "rowrelay_100k_slices_rows_per_s", "idle_tick_large_history_ms", "sensor_lag_100_tables_s",
                "idle_tick_ms", "freshness_p50_s", "freshness_p95_s", "run_start_s", "run_overhead_s",
                "peak_rss_mib", "peak_rss_rows"):
        results.setdefault(key, None)
    # Exactly once in every run that promises it (rowrelay's, the ceiling + Kafka path's, which publishes with
    # rowrelay's publisher, the memory run's): each topic read to its end, every watermark once.
    promised = [*results.get("rowrelay_runs", []), *results.get("kafka_path_runs", []),
                *([results["memory"]] if "memory" in results else []),
                *([results["cluster"]] if "cluster" in results else []),
                *([results["kafka_cluster"]] if "kafka_cluster" in results else [])]
    broken = [r for r in promised if not r.get("exactly_once")]
    results["exactly_once_every_run"] = not broken if promised else None
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    log(f"wrote {RESULTS}")
    if broken:
        for r in broken:
            log(f"NOT exactly once: {r.get('messages')} messages, {r.get('duplicates')} duplicate(s), "
                f"{r.get('missing')} missing")
        return 1
    return 0


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run with the median rows/s (of an even number, the slower middle one); None if none succeeded."""
    ok = sorted((r for r in runs if r.get("rows_per_s")), key=lambda r: r["rows_per_s"])
    return ok[(len(ok) - 1) // 2] if ok else None


def summarize_throughput(results: dict[str, Any], samples: dict[str, list[dict[str, Any]]], repeats: int) -> None:
    """Each tool's figure: the median of its rounds (`<tool>` is that run, `<tool>_runs` every run)."""
    results["repeats"] = repeats
    for name in ("raw", "spark_ceiling", "kafka_path", "dpone", "debezium", "debezium_eos"):
        runs = samples.get(name)
        if not runs:
            continue
        mid = median_run(runs)
        results[name] = mid if mid is not None else runs[-1]
        results[f"{name}_runs"] = runs
        if mid is not None:
            results[f"{name}_rows_per_s"] = round(mid["rows_per_s"])
    if samples.get("rowrelay_100k") and samples.get("rowrelay_1m"):
        hundred, million = median_run(samples["rowrelay_100k"]), median_run(samples["rowrelay_1m"])
        assert hundred is not None and million is not None
        results["rowrelay"] = [hundred, million]
        results["rowrelay_runs"] = samples["rowrelay_100k"] + samples["rowrelay_1m"]
        results["rowrelay_exactly_once"] = all(r["exactly_once"] for r in results["rowrelay_runs"])
        results["rowrelay_100k_slices_rows_per_s"] = hundred["rows_per_s"]
        results["rowrelay_1m_slice_rows_per_s"] = million["rows_per_s"]
        results["rowrelay_100k_vs_1m_slice"] = round(hundred["rows_per_s"] / million["rows_per_s"], 2)
        best = max(hundred, million, key=lambda r: r["rows_per_s"])
        results["rowrelay_rows_per_s"] = best["rows_per_s"]
        results["rowrelay_best_slice_max_rows"] = best["slice_max_rows"]
        # Where the CPU went (process, Spark server, PostgreSQL, broker), mean of the rounds: what rowrelay adds to
        # the ceiling's work on a box whose two cores the ceiling's read already keeps busy.
        for name, runs in (("spark_ceiling", samples.get("spark_ceiling")), ("kafka_path", samples.get("kafka_path")),
                           ("rowrelay_1m", samples["rowrelay_1m"])):
            cpus = [r["cpu_s"] for r in runs or [] if r.get("cpu_s")]
            if cpus:
                results[f"{name}_cpu_s"] = {k: round(statistics.mean(c[k] for c in cpus), 2) for k in cpus[0]}
        # Within each round: rowrelay's better slice size against each tool measured in the same round.
        for peer, key in (("spark_ceiling", "ratio_vs_spark_ceiling_by_round"), ("dpone", "ratio_vs_dpone_by_round"),
                          ("debezium", "ratio_vs_debezium_by_round"), ("kafka_path", "ratio_vs_kafka_path_by_round")):
            pairs = zip(samples["rowrelay_100k"], samples["rowrelay_1m"], samples.get(peer, []), strict=False)
            results[key] = [round(max(a["rows_per_s"], b["rows_per_s"]) / p["rows_per_s"], 2)
                            for a, b, p in pairs if p.get("rows_per_s")]


def print_table(r: dict[str, Any]) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "yes" if v else "NO"
        return "-" if v is None else (f"{v:,}" if isinstance(v, int) else str(v))

    rows = [("rows", r["rows"]), ("rounds of the 1M-row runs (each figure: the median)", r.get("repeats")),
            ("raw rows/s (COPY -> producer)", r["raw_rows_per_s"])]
    for run in r.get("rowrelay", []):
        rows.append((f"rowrelay rows/s, slice_max_rows {run['slice_max_rows']:,}", run["rows_per_s"]))
    rows += [("Spark ceiling rows/s (slice path, no Kafka)", r["spark_ceiling_rows_per_s"]),
             ("Spark ceiling + Kafka rows/s (the same publisher, no Dagster)", r.get("kafka_path_rows_per_s")),
             ("dpone rows/s", r["dpone_rows_per_s"]), ("Debezium rows/s (standalone)", r["debezium_rows_per_s"]),
             ("Debezium rows/s (exactly-once source)", r.get("debezium_eos_rows_per_s")),
             ("rowrelay / raw", r["ratio_vs_raw"]), ("rowrelay / dpone", r["ratio_vs_dpone"]),
             ("rowrelay / Debezium", r["ratio_vs_debezium"]), ("rowrelay / Spark ceiling", r["ratio_vs_spark_ceiling"]),
             ("rowrelay 100k slices / 1M slice", r.get("rowrelay_100k_vs_1m_slice")),
             ("rowrelay / Spark ceiling, each round", " ".join(map(str, r.get("ratio_vs_spark_ceiling_by_round") or
                                                                    [])) or None),
             ("rowrelay / dpone, each round", " ".join(map(str, r.get("ratio_vs_dpone_by_round") or [])) or None),
             ("Spark ceiling + Kafka / Spark ceiling", r.get("ratio_kafka_path_vs_spark_ceiling")),
             ("rowrelay / Spark ceiling + Kafka, each round",
              " ".join(map(str, r.get("ratio_vs_kafka_path_by_round") or [])) or None),
             ("rowrelay exactly once in every run", r.get("rowrelay_exactly_once")),
             ("exactly once in every run that promises it (+ ceiling + Kafka, memory)",
              r.get("exactly_once_every_run")),
             *((f"CPU-s, {label} (process / Spark / PostgreSQL / broker = all; broker's G1 marking)",
                " / ".join(str(cpu.get(k)) for k in ("process", "spark", "postgres", "broker")) + f" = {cpu['all']}"
                + f"; {cpu.get('broker_gc_marking')}")
               for label, cpu in (("Spark ceiling", r.get("spark_ceiling_cpu_s")),
                                  ("ceiling + Kafka", r.get("kafka_path_cpu_s")),
                                  ("rowrelay 1M slice", r.get("rowrelay_1m_cpu_s"))) if cpu),
             ("idle sensor tick, ms", r["idle_tick_ms"]),
             ("idle sensor tick with 300k slices of history, ms", r.get("idle_tick_large_history_ms")),
             ("100 tables: worst gap between a sensor's ticks, s", r.get("sensor_lag_100_tables_s")),
             *((f"idle CPU, {n} tables under one daemon, % of a core (daemon + code server / PostgreSQL / broker / "
                "Spark = all)", " / ".join(str(cpu.get(k)) for k in ("daemon", "postgres", "broker", "spark"))
                + f" = {cpu['all']}")
               for n, cpu in ((20, r.get("idle_cpu_pct_20_tables")), (100, r.get("idle_cpu_pct_100_tables"))) if cpu),
             ("freshness p50 / p95, s (warm Spark)",
              f"{fmt(r['freshness_p50_s'])} / {fmt(r['freshness_p95_s'])}"),
             ("run start / to first message, s (median)",
              f"{fmt(r['run_start_s'])} / {fmt(r['run_overhead_s'])}"),
             ("freshness p50, s (JVM per run)", r.get("freshness_cold_p50_s")),
             ("peak RSS of the run worker, MiB", r["peak_rss_mib"]),
             ("  for a one-slice run of rows", r["peak_rss_rows"]),
             *((("the same slice on a two-worker Spark cluster, rows/s", r["cluster_slice_rows_per_s"]),
                ("  executors that ran its tasks", r["cluster_executors_used"]),
                ("  ratio to local[2]", r["ratio_cluster_vs_local"])) if r.get("cluster_slice_rows_per_s") else ()),
             *((("rowrelay 1M slice to a three-broker Kafka cluster, rows/s", r["kafka_cluster_rows_per_s"]),
                ("  ratio to the single broker", r.get("ratio_kafka_cluster_vs_single_broker")))
               if r.get("kafka_cluster_rows_per_s") else ())]
    width = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"  {k:<{width}}  {fmt(v):>14}")
    print()


if __name__ == "__main__":
    sys.exit(main())
