"""Run the peer tool **Debezium** (PostgreSQL connector on Kafka Connect) so a benchmark can compare it with rowrelay.

Debezium reads a table's existing rows in its *snapshot* phase; ``snapshot.mode=initial_only`` stops after the
snapshot (no replication slot, no streaming), which is the same job as rowrelay's backfill and dpone's
full_refresh: publish a bounded table once. Kafka Connect and the connector come from Maven Central
(``stack/poms/debezium.xml``, fetched once by ``stack.debezium.ensure_debezium_jars``) and run as one JVM:

* ``exactly_once=False``: ``ConnectStandalone worker.properties pg.properties``. At-least-once: source offsets
  live in a file flushed every few seconds, so a crash re-sends what was produced since the last flush.
* ``exactly_once=True``: a one-node ``ConnectDistributed`` with ``exactly.once.source.support=enabled`` and the
  connector submitted over REST with ``exactly.once.support=required`` (KIP-618): records and source offsets are
  written in one Kafka transaction per ``poll()`` batch (``transaction.boundary=poll``, the default).

The timer runs **from the JVM's launch until the topic holds every row** (jar fetching, topic creation and
config writing happen before it): at-least-once polls the topic's high watermark until it reaches ``rows``; the
transactional run polls the last stable offset (read_committed) and counts the committed records up to it as it
goes, because commit markers take offsets too, so an end offset alone says nothing about how many rows are in.
Then the worker's process group is killed and the topic is counted read_committed.

Settings, and why:

* JSON converter, ``schemas.enable=false``, ``ExtractNewRecordState`` (``transforms=unwrap``): the value is the
  row's columns only (``{"id":1,"category":"books",...}``), like rowrelay's and dpone's messages, not Debezium's
  before/after/source envelope; the key is ``{"id":1}`` (Debezium keys by primary key).
* ``decimal.handling.mode=string``: NUMERIC as ``"12.34"`` instead of base64 bytes.
* ``snapshot.fetch.size`` 10240, ``max.batch.size`` 20480, ``max.queue.size`` 81920 (defaults 10240 / 2048 /
  8192): bigger batches between the snapshot reader and Connect, as in ConduitIO's tuned Debezium benchmark.
* Producer: ``compression.type=lz4``, ``linger.ms=50``, ``batch.size=1000000`` (bench/run.py's ``PRODUCER_CONF``).
  Connect's own producer defaults stay (``acks=all``, ``max.in.flight.requests.per.connection=1`` outside
  exactly-once mode).
* The database password reaches the JVM as an environment variable through Kafka's ``EnvVarConfigProvider``
  (``${env:...}``), so it is never written to the workdir or sent over REST.
* Offsets, logs and properties files go into ``workdir``; the Connect JVM runs with ``cwd=workdir``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stack.local import free_ports

CONNECTOR_CLASS = "io.debezium.connector.postgresql.PostgresConnector"
SNAPSHOT_FETCH_SIZE = 10_240
MAX_BATCH_SIZE = 20_480
MAX_QUEUE_SIZE = 81_920
# bench/run.py's PRODUCER_CONF in the Java producer's terms.
PRODUCER_OVERRIDES = {"compression.type": "lz4", "linger.ms": "50", "batch.size": "1000000"}
# The variable the JVM reads the PostgreSQL password from (EnvVarConfigProvider).
PASSWORD_ENV = "ROWRELAY_DBZ_PG_PASSWORD"
JVM_OPTS = ["-Xms256m", "-Xmx2g", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true"]

LOG4J2 = """\
status = warn
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.reflections.name = org.reflections
logger.reflections.level = ERROR
"""


class DebeziumPeerError(RuntimeError):
    """The Debezium run could not produce a figure; the message says why and where the worker's log is."""


# -- pure pieces ------------------------------------------------------------------------------------------


def split_table(table: str) -> tuple[str, str]:
    schema, _, name = table.rpartition(".")
    return (schema or "public"), name


def topic_for(topic_prefix: str, table: str) -> str:
    """Debezium's topic name for a table: ``<topic.prefix>.<schema>.<table>``."""
    schema, name = split_table(table)
    return f"{topic_prefix}.{schema}.{name}"


def properties_text(props: dict[str, str]) -> str:
    """A Java .properties file; values here are plain (no newlines), only backslashes need escaping."""
    return "".join(f"{k}={str(v).replace(chr(92), chr(92) * 2)}\n" for k, v in props.items())


def converter_props() -> dict[str, str]:
    return {
        "key.converter": "org.apache.kafka.connect.json.JsonConverter",
        "key.converter.schemas.enable": "false",
        "value.converter": "org.apache.kafka.connect.json.JsonConverter",
        "value.converter.schemas.enable": "false",
    }


def worker_props(bootstrap: str, port: int, workdir: Path, *, distributed: bool, names: InternalTopics | None,
                 ) -> dict[str, str]:
    """Worker config for ConnectStandalone (file offsets) or a one-node, exactly-once ConnectDistributed."""
    props = {
        "bootstrap.servers": bootstrap,
        "listeners": f"http://127.0.0.1:{port}",
        "rest.advertised.host.name": "127.0.0.1",
        "rest.advertised.port": str(port),
        # Every jar on the classpath has ServiceLoader manifests; the default (hybrid_warn) also runs the
        # reflection scanner, ~5 s of start-up that Kafka's own warning says to drop.
        "plugin.discovery": "service_load",
        "config.providers": "env",
        "config.providers.env.class": "org.apache.kafka.common.config.provider.EnvVarConfigProvider",
        **converter_props(),
        **{f"producer.{k}": v for k, v in PRODUCER_OVERRIDES.items()},
    }
    if not distributed:
        props["offset.storage.file.filename"] = str(workdir / "connect.offsets")
        props["offset.flush.interval.ms"] = "5000"
        return props
    assert names is not None
    props.update({
        "group.id": names.group,
        "exactly.once.source.support": "enabled",
        # One broker: the worker's internal topics can have one replica only.
        "config.storage.topic": names.configs,
        "config.storage.replication.factor": "1",
        "offset.storage.topic": names.offsets,
        "offset.storage.replication.factor": "1",
        "offset.storage.partitions": "1",
        "status.storage.topic": names.status,
        "status.storage.replication.factor": "1",
        "status.storage.partitions": "1",
        "offset.flush.interval.ms": "5000",
        "scheduled.rebalance.max.delay.ms": "0",
    })
    return props


def connector_props(pg: dict, table: str, topic_prefix: str, name: str, *, exactly_once: bool) -> dict[str, str]:
    schema, tname = split_table(table)
    suffix = name.replace("-", "_")
    props = {
        "name": name,
        "connector.class": CONNECTOR_CLASS,
        "tasks.max": "1",
        "database.hostname": str(pg["host"]),
        "database.port": str(pg["port"]),
        "database.user": str(pg["user"]),
        "database.password": f"${{env:{PASSWORD_ENV}}}",
        "database.dbname": str(pg["dbname"]),
        "database.sslmode": "disable",  # every tool in the bench reads PostgreSQL over plain TCP
        "topic.prefix": topic_prefix,
        "table.include.list": f"{schema}.{tname}",
        "snapshot.mode": "initial_only",
        "plugin.name": "pgoutput",
        # Own names so a run never touches a slot/publication someone else uses; dropped after the run.
        "slot.name": suffix,
        "publication.name": suffix,
        "publication.autocreate.mode": "filtered",
        "snapshot.fetch.size": str(SNAPSHOT_FETCH_SIZE),
        "max.batch.size": str(MAX_BATCH_SIZE),
        "max.queue.size": str(MAX_QUEUE_SIZE),
        "decimal.handling.mode": "string",
        # Debezium 3.x adds four __debezium.context.* headers to every record; the other tools send none.
        "extended.headers.enabled": "false",
        "transforms": "unwrap",
        "transforms.unwrap.type": "io.debezium.transforms.ExtractNewRecordState",
        # The topic is created before the timer; these only matter if it is not there.
        "topic.creation.default.replication.factor": "1",
        "topic.creation.default.partitions": "1",
    }
    if exactly_once:
        props["exactly.once.support"] = "required"
    return props


@dataclass(frozen=True)
class InternalTopics:
    """The distributed worker's group and internal topics, unique per run (deleted afterwards)."""

    group: str
    configs: str
    offsets: str
    status: str

    @classmethod
    def for_run(cls, run: str) -> InternalTopics:
        base = f"bench_dbz_connect_{run}"
        return cls(group=base, configs=f"{base}_configs", offsets=f"{base}_offsets", status=f"{base}_status")

    def topics(self) -> list[str]:
        return [self.configs, self.offsets, self.status]


# -- Kafka helpers ----------------------------------------------------------------------------------------


def ensure_topic(bootstrap: str, topic: str, partitions: int = 1) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    if topic not in admin.list_topics(timeout=10).topics:
        admin.create_topics([NewTopic(topic, partitions, 1)], request_timeout=30)[topic].result(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        meta = admin.list_topics(topic=topic, timeout=10).topics.get(topic)
        if meta is not None and meta.error is None and len(meta.partitions) == partitions:
            return
        time.sleep(0.2)
    raise DebeziumPeerError(f"topic {topic} did not become available")


def delete_topics(bootstrap: str, topics: list[str]) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    existing = [t for t in topics if t in admin.list_topics(timeout=10).topics]
    if not existing:
        return
    for fut in admin.delete_topics(existing, request_timeout=30).values():
        with contextlib.suppress(Exception):  # already gone
            fut.result(timeout=30)


def _consumer(bootstrap: str, read_committed: bool) -> Any:
    from confluent_kafka import Consumer

    return Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": f"rowrelay-bench-dbz-{uuid.uuid4().hex[:8]}",
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed" if read_committed else "read_uncommitted",
        "fetch.wait.max.ms": 50,
    })


class CommittedCounter:
    """Counts a one-partition-or-more topic's committed records incrementally up to its last stable offset.

    ``advance()`` asks for the end offsets (the LSO under read_committed), reads from where it stopped up to them
    and returns the running count; transaction markers and aborted records take offsets but are never counted.
    A fetch can also bring records committed after the end offsets were asked for: they are counted (every
    record read_committed is committed) and ``past_ends`` says so, so a timer knows the count is newer than
    the moment it asked.
    """

    def __init__(self, bootstrap: str, topic: str, *, read_committed: bool = True) -> None:
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        self._tp = TopicPartition
        self.topic = topic
        self.consumer = _consumer(bootstrap, read_committed)
        parts = sorted(self.consumer.list_topics(topic=topic, timeout=10).topics[topic].partitions)
        self.next_offset = {p: 0 for p in parts}
        self.count = 0
        self.past_ends = False
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])

    def end_offsets(self) -> dict[int, int]:
        return {p: self.consumer.get_watermark_offsets(self._tp(self.topic, p), timeout=10, cached=False)[1]
                for p in self.next_offset}

    def advance(self, timeout_s: float = 120.0) -> int:
        ends = self.end_offsets()
        self.past_ends = False
        deadline = time.monotonic() + timeout_s
        while any(self.next_offset[p] < ends[p] for p in ends):
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {self.topic} up to {ends} in {timeout_s}s")
            for msg in self.consumer.consume(num_messages=10_000, timeout=0.5):
                if msg.error() is not None:
                    continue  # partition EOF and the like; real errors surface as a timeout
                p = msg.partition()
                # Count it even past `ends`: skipping it would move next_offset beyond a record never counted.
                self.count += 1
                self.past_ends = self.past_ends or msg.offset() >= ends[p]
                self.next_offset[p] = max(self.next_offset[p], msg.offset() + 1)
            # A partition whose tail is only markers/aborted records yields no message: the position says so.
            for tp in self.consumer.position([self._tp(self.topic, p) for p in ends]):
                if tp.offset >= 0:
                    self.next_offset[tp.partition] = max(self.next_offset[tp.partition], tp.offset)
        return self.count

    def close(self) -> None:
        self.consumer.close()


def count_committed(bootstrap: str, topic: str) -> int:
    """Committed records in ``topic`` now, read_committed from the beginning."""
    counter = CommittedCounter(bootstrap, topic)
    try:
        return counter.advance(timeout_s=300)
    finally:
        counter.close()


# -- the Connect JVM --------------------------------------------------------------------------------------


def launch_worker(libs: Path, main_class: str, args: list[str], workdir: Path, env: dict[str, str],
                  ) -> subprocess.Popen[bytes]:
    """Start the Connect JVM in its own process group (so one killpg stops it and anything it spawned)."""
    log4j = workdir / "log4j2.properties"
    log4j.write_text(LOG4J2.format(log=workdir / "connect.log"), encoding="utf-8")
    tmp = workdir / "tmp"  # lz4/snappy/zstd unpack their native libraries into java.io.tmpdir: keep them here
    tmp.mkdir(exist_ok=True)
    cmd = ["java", *JVM_OPTS, f"-Djava.io.tmpdir={tmp}", f"-Dlog4j2.configurationFile={log4j}",
           "-cp", f"{libs}/*", main_class, *args]
    with open(workdir / "connect.stdout.log", "wb") as out:  # the child keeps its own copy of the fd
        return subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop_worker(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM the worker's process group, SIGKILL it if it lingers; leaves no process behind."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    # The group may outlive its leader if the JVM forked; make sure nothing of it is left.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _rest(method: str, url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            text = resp.read().decode() or "null"
            return resp.status, json.loads(text)
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        try:
            return exc.code, json.loads(text)
        except json.JSONDecodeError:
            return exc.code, text


def log_tail(workdir: Path, lines: int = 40) -> str:
    text = ""
    for name in ("connect.log", "connect.stdout.log"):
        path = workdir / name
        if path.exists():
            text += "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    return text


def first_error(workdir: Path) -> str | None:
    """The first ERROR line of the worker's log (with the exception line after it), if any."""
    path = workdir / "connect.log"
    if not path.exists():
        return None
    lines = path.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        if "] ERROR " in line:
            return " | ".join(x.strip() for x in lines[i:i + 3])[:1500]
    return None


def snapshot_export_seconds(workdir: Path) -> float | None:
    """Debezium's own figure for reading the table ("Finished exporting N records ... total duration 'H:M:S'")."""
    path = workdir / "connect.log"
    if not path.exists():
        return None
    match = re.search(r"Finished exporting \d+ records for table .*? total duration '(\d+):(\d+):([\d.]+)'",
                      path.read_text(errors="replace"))
    if not match:
        return None
    h, m, sec = match.groups()
    return int(h) * 3600 + int(m) * 60 + float(sec)


def _task_failure(base_url: str, name: str) -> str | None:
    with contextlib.suppress(OSError, ValueError):
        code, status = _rest("GET", f"{base_url}/connectors/{name}/status", timeout=3)
        if code == 200 and isinstance(status, dict):
            states = [status.get("connector", {})] + list(status.get("tasks", []))
            for s in states:
                if s.get("state") == "FAILED":
                    return str(s.get("trace", "FAILED"))[:2000]
    return None


def _submit_connector(base_url: str, config: dict[str, str], proc: subprocess.Popen[bytes],
                      timeout_s: float = 120.0) -> None:
    """POST the connector once the distributed worker's REST API answers (it is up before it joined the group)."""
    name = config["name"]
    body = {"name": name, "config": {k: v for k, v in config.items() if k != "name"}}
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DebeziumPeerError(f"Connect worker exited {proc.returncode} before the connector was submitted")
        try:
            code, answer = _rest("POST", f"{base_url}/connectors", body, timeout=10)
        except OSError as exc:  # not listening yet
            last = str(exc)
            time.sleep(0.1)
            continue
        if code in (200, 201):
            return
        last = f"HTTP {code}: {answer}"
        # 404 = Jetty is up but Connect's resources are not registered yet; 409 = rebalance in progress / not
        # joined yet; 500/503 = herder not ready. Anything else is a config error worth reporting now.
        if code not in (404, 409, 500, 503):
            raise DebeziumPeerError(f"connector rejected: {last}")
        time.sleep(0.2)
    raise DebeziumPeerError(f"could not submit the connector in {timeout_s}s: {last}")


def _drop_pg_leftovers(pg: dict, name: str) -> list[str]:
    """Drop the replication slot / publication this run may have created; returns what was dropped."""
    import psycopg

    dropped = []
    ident = name.replace("-", "_")
    with psycopg.connect(**pg, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (ident,)).fetchone():
            conn.execute("SELECT pg_drop_replication_slot(%s)", (ident,))
            dropped.append(f"slot {ident}")
        if conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (ident,)).fetchone():
            conn.execute(f'DROP PUBLICATION "{ident}"')
            dropped.append(f"publication {ident}")
    return dropped


# -- the run ----------------------------------------------------------------------------------------------


def run_debezium(pg: dict, table: str, bootstrap: str, topic_prefix: str, rows: int, workdir: Path, *,
                 exactly_once: bool = False, timeout_s: float = 1800.0) -> dict:
    """Publish ``table``'s rows with Debezium's snapshot into ``<topic_prefix>.<schema>.<table>``; time and verify.

    Returns ``seconds`` (JVM launch -> every row in the topic, committed), ``messages`` (read_committed count
    after the worker stopped), ``rows_per_s``, ``mode``, ``version``, ``exactly_once``, ``topic``,
    ``debezium_reported_seconds`` (Debezium's own snapshot timer, from its log) and a ``note`` when the count is
    off or the worker logged errors. Raises ``DebeziumPeerError`` when the run produced no figure.
    """
    from stack.debezium import ensure_debezium_jars, jar_version

    libs = ensure_debezium_jars()  # before the timer: a first run downloads ~70 jars
    version = jar_version(libs, "debezium-connector-postgres")
    connect_version = jar_version(libs, "connect-runtime")
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    run = uuid.uuid4().hex[:8]
    name = f"rowrelay-bench-dbz-{run}"
    topic = topic_for(topic_prefix, table)
    ensure_topic(bootstrap, topic)
    before = count_committed(bootstrap, topic)

    port = free_ports(1)[0]
    base_url = f"http://127.0.0.1:{port}"
    names = InternalTopics.for_run(run) if exactly_once else None
    worker = worker_props(bootstrap, port, workdir, distributed=exactly_once, names=names)
    connector = connector_props(pg, table, topic_prefix, name, exactly_once=exactly_once)
    (workdir / "worker.properties").write_text(properties_text(worker), encoding="utf-8")
    env = {**os.environ, PASSWORD_ENV: str(pg["password"])}
    if exactly_once:
        main_class = "org.apache.kafka.connect.cli.ConnectDistributed"
        args = ["worker.properties"]
        mode = (f"Kafka Connect {connect_version} ConnectDistributed (1 worker), exactly.once.source.support="
                "enabled, connector exactly.once.support=required over REST; snapshot.mode=initial_only")
    else:
        (workdir / "pg.properties").write_text(properties_text(connector), encoding="utf-8")
        main_class = "org.apache.kafka.connect.cli.ConnectStandalone"
        args = ["worker.properties", "pg.properties"]
        mode = f"Kafka Connect {connect_version} ConnectStandalone (at-least-once); snapshot.mode=initial_only"

    counter = CommittedCounter(bootstrap, topic, read_committed=True)
    notes: list[str] = []
    try:
        started = time.perf_counter()
        proc = launch_worker(libs, main_class, args, workdir, env)
        try:
            if exactly_once:
                _submit_connector(base_url, connector, proc)
            seconds, why = _wait_for_rows(proc, counter, before + rows, started, timeout_s, base_url, name,
                                          workdir, count_records=exactly_once)
        finally:
            stop_worker(proc)
        if seconds is None:
            raise DebeziumPeerError(_failure_text(workdir, why))
    finally:
        counter.close()
        with contextlib.suppress(Exception):
            dropped = _drop_pg_leftovers(pg, name)
            if dropped:
                notes.append("dropped " + ", ".join(dropped))
        if names is not None:
            delete_topics(bootstrap, names.topics())

    messages = count_committed(bootstrap, topic) - before
    figures: dict[str, Any] = {
        "seconds": round(seconds, 3),
        "messages": messages,
        "rows_per_s": round(rows / seconds, 1) if seconds > 0 else 0.0,
        "mode": mode,
        "version": version,
        "exactly_once_mode": exactly_once,  # the mode it ran in (exactly.once.source.support), not a check
        "topic": topic,
    }
    export = snapshot_export_seconds(workdir)
    if export is not None:
        # Debezium's snapshot timer (SELECT -> last record handed to Connect): no JVM start-up, no last flush.
        figures["debezium_reported_seconds"] = round(export, 3)
    if before:
        notes.append(f"topic already held {before} records before the run; they are not counted")
    if messages < rows:
        notes.append(f"delivered {messages} messages for {rows} rows")
    elif messages > rows:
        notes.append(f"delivered {messages} messages for {rows} rows (duplicates)")
    error = first_error(workdir)
    if error:
        notes.append(f"worker logged: {error}")
    if notes:
        figures["note"] = "; ".join(notes)
    return figures


SNAPSHOT_DONE = "Snapshot completed"
# After Debezium says its snapshot is complete, the last batch still has to be produced and committed.
SNAPSHOT_GRACE_S = 30.0


class LogWatch:
    """Reads the worker's log incrementally for one marker line (cheap enough to ask every couple of seconds)."""

    def __init__(self, path: Path, marker: str) -> None:
        self.path, self.marker, self.pos, self.seen = path, marker, 0, False

    def check(self) -> bool:
        if not self.seen and self.path.exists():
            with self.path.open("rb") as f:
                f.seek(self.pos)
                chunk = f.read()
            # Keep a partial last line for the next read.
            cut = chunk.rfind(b"\n") + 1
            self.pos += cut
            self.seen = self.marker.encode() in chunk[:cut]
        return self.seen


def _wait_for_rows(proc: subprocess.Popen[bytes], counter: CommittedCounter, target: int, started: float,
                   timeout_s: float, base_url: str, name: str, workdir: Path, *, count_records: bool,
                   ) -> tuple[float | None, str]:
    """(seconds from ``started`` until the topic holds ``target`` records, or None; why it stopped waiting).

    Without transactions every offset is a record, so the high watermark is the count. With them, commit
    markers take offsets too: read the committed records up to the LSO (incrementally) and count them. The
    time is taken when the end offsets are asked for, not after reading, so counting adds no seconds.
    It gives up when the worker exits, the task FAILED, or the snapshot completed without filling the topic.
    """
    snapshot = LogWatch(workdir / "connect.log", SNAPSHOT_DONE)
    snapshot_done_at: float | None = None
    next_status = time.monotonic() + 2.0
    done = 0
    while time.perf_counter() - started < timeout_s:
        asked = time.perf_counter()
        done = counter.advance() if count_records else sum(counter.end_offsets().values())
        if done >= target:
            # Records read past the end offsets asked for were committed later than `asked`: take the time now.
            return (time.perf_counter() if count_records and counter.past_ends else asked) - started, "ok"
        if proc.poll() is not None:
            return None, f"the worker exited ({proc.returncode}) with {done} of {target} records in the topic"
        if time.monotonic() >= next_status:  # a failed task never fills the topic: stop waiting
            next_status = time.monotonic() + 2.0
            failure = _task_failure(base_url, name)
            if failure:
                return None, f"the task FAILED: {failure}"
            if snapshot_done_at is None and snapshot.check():
                snapshot_done_at = time.monotonic()
            if snapshot_done_at is not None and time.monotonic() - snapshot_done_at > SNAPSHOT_GRACE_S:
                return None, (f"the snapshot completed but the topic held {done} of {target} records "
                              f"{SNAPSHOT_GRACE_S:.0f} s later")
        time.sleep(0.1)
    return None, f"timed out after {timeout_s:.0f} s with {done} of {target} records in the topic"


def _failure_text(workdir: Path, why: str) -> str:
    parts = [f"Debezium gave no figure: {why}"]
    error = first_error(workdir)
    if error:
        parts.append(f"first error: {error}")
    parts.append(f"log: {workdir / 'connect.log'}")
    parts.append("log tail:\n" + log_tail(workdir, 15))
    return "\n".join(parts)


# -- entry point ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run Debezium (Kafka Connect) PostgreSQL -> Kafka on a bench table.")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--exactly-once", action="store_true", help="one-node ConnectDistributed, KIP-618")
    parser.add_argument("--keep-workdir", action="store_true")
    args = parser.parse_args(argv)

    import shutil
    import tempfile

    from bench.run import BENCH_DB, Stack, ensure_database, load_table

    stack = Stack()
    suffix = uuid.uuid4().hex[:8]
    table = f"bench_dbz_{suffix}"
    prefix = f"bench_dbz_{suffix}"
    workdir = Path(tempfile.mkdtemp(prefix="dbz_probe_"))
    topic = topic_for(prefix, table)
    try:
        ensure_database(stack, BENCH_DB)
        load_table(stack, table, args.rows)
        figures = run_debezium(stack.pg(), table, stack.bootstrap, prefix, args.rows, workdir,
                               exactly_once=args.exactly_once)
        print(json.dumps(figures, indent=2))
    finally:
        with stack.connect() as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")
        delete_topics(stack.bootstrap, [topic])
        if args.keep_workdir:
            print(f"workdir kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
