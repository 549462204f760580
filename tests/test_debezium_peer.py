"""bench/debezium_peer.py on the real stack: Debezium's snapshot into Kafka, at-least-once and exactly-once.

Each test makes its own table in rowrelay_bench and its own topic prefix, and removes both. The JVM runs take
15-30 s each on this machine.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

import bench
from bench.debezium_peer import (
    PASSWORD_ENV,
    CommittedCounter,
    DebeziumPeerError,
    InternalTopics,
    connector_props,
    delete_topics,
    ensure_topic,
    properties_text,
    run_debezium,
    topic_for,
    worker_props,
)
from bench.run import BENCH_DB, Stack, TopicCensus, ensure_database, load_table, topic_census
from tests.conftest import partition_ends
from tests.pipeline import polled

ROOT = Path(bench.__file__).resolve().parents[1]  # the checkout

# -- pure pieces ------------------------------------------------------------------------------------------

def test_topic_name_is_debeziums() -> None:
    assert topic_for("p", "t") == "p.public.t"
    assert topic_for("p", "s.t") == "p.s.t"


def test_password_never_in_written_config() -> None:
    pg = {"host": "h", "port": 1, "user": "u", "password": "s3cret", "dbname": "d"}
    props = connector_props(pg, "t", "p", "n", exactly_once=True)
    assert "s3cret" not in properties_text(props) + json.dumps(props)
    assert props["database.password"] == f"${{env:{PASSWORD_ENV}}}"
    assert props["exactly.once.support"] == "required"
    assert "exactly.once.support" not in connector_props(pg, "t", "p", "n", exactly_once=False)


def test_distributed_worker_is_exactly_once_on_one_broker(tmp_path: Path) -> None:
    names = InternalTopics.for_run("x")
    props = worker_props("b:1", 1, tmp_path, distributed=True, names=names)
    assert props["exactly.once.source.support"] == "enabled"
    for kind in ("config", "offset", "status"):
        assert props[f"{kind}.storage.replication.factor"] == "1"
    assert "offset.storage.file.filename" not in props
    standalone = worker_props("b:1", 1, tmp_path, distributed=False, names=None)
    assert standalone["offset.storage.file.filename"].startswith(str(tmp_path))


def test_properties_escape_backslashes() -> None:
    assert properties_text({"a": r"x\y"}) == "a=x\\\\y\n"


# -- real runs --------------------------------------------------------------------------------------------

@pytest.fixture
def stack() -> Stack:
    """The local stack; the tests that need it skip without its env (the pure pieces above run anywhere)."""
    if not os.environ.get("ROWRELAY_KAFKA_BOOTSTRAP"):
        pytest.skip("needs the local stack's env (source ~/.cache/rowrelay/stack.env)")
    s = Stack()
    ensure_database(s, BENCH_DB)
    return s


@pytest.fixture
def table(stack: Stack) -> Iterator[str]:
    name = f"bench_dbz_t_{uuid.uuid4().hex[:8]}"
    yield name
    with stack.connect() as conn:
        conn.execute(f"DROP TABLE IF EXISTS {name}")


@pytest.fixture
def prefix(stack: Stack, table: str) -> Iterator[str]:
    p = f"bench_dbz_t_{uuid.uuid4().hex[:8]}"
    yield p
    delete_topics(stack.bootstrap, [topic_for(p, table)])


def _values(bootstrap: str, topic: str, n: int) -> list[dict]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"t-{uuid.uuid4().hex}",
                  "isolation.level": "read_committed", "enable.auto.commit": False})
    try:
        c.assign([TopicPartition(topic, 0, 0)])
        out: list[dict] = []
        for _ in range(60):
            out += [json.loads(m.value()) for m in c.consume(10_000, 1.0) if m.error() is None]
            if len(out) >= n:
                break
        return out
    finally:
        c.close()


def _ends_reaching(counter: CommittedCounter, offset: int, timeout_s: float = 10.0) -> dict[int, int]:
    """The counter's end offsets once partition 0's reaches `offset` (or after `timeout_s`): commit_transaction
    returns before the coordinator has written the commit marker, and until it has, the end a read_committed
    reader is told (the LSO) stays before the transaction."""
    return polled(counter.end_offsets, lambda ends: ends[0] >= offset, timeout_s)


def test_counter_counts_records_committed_after_it_asked_for_the_end(stack: Stack) -> None:
    """Regression: a fetch brings records committed after the LSO was asked for; they must be counted once."""
    from confluent_kafka import Producer

    topic = f"bench_dbz_t_{uuid.uuid4().hex[:8]}"
    ensure_topic(stack.bootstrap, topic)
    producer = Producer({"bootstrap.servers": stack.bootstrap, "transactional.id": topic})
    producer.init_transactions(30)

    def commit(n: int) -> None:
        producer.begin_transaction()
        for i in range(n):
            producer.produce(topic, str(i).encode())
        producer.commit_transaction(30)

    counter = CommittedCounter(stack.bootstrap, topic)
    try:
        commit(5)
        stale = _ends_reaching(counter, 6)  # the end as the timer saw it (5 records and the commit marker) ...
        commit(7)  # ... then more commits land before the records are fetched
        _ends_reaching(counter, 14)  # their marker written too: a fetch now brings all 12 records
        counter.end_offsets = lambda: stale  # type: ignore[method-assign]
        assert counter.advance() == 12 and counter.past_ends
        del counter.end_offsets
        assert counter.advance() == 12 and not counter.past_ends  # nothing counted twice
        assert sum(counter.end_offsets().values()) == 14  # 12 records + 2 commit markers
    finally:
        counter.close()
        delete_topics(stack.bootstrap, [topic])


def test_bench_census_finds_a_duplicate_beside_a_missing_row(stack: Stack) -> None:
    """The bench's exactly-once check reads the watermark headers: the right count with a row twice and another
    never must not pass (a message count alone did)."""
    from confluent_kafka import Producer

    topic = f"bench_census_{uuid.uuid4().hex[:8]}"
    ensure_topic(stack.bootstrap, topic)
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    try:
        def publish(watermarks: list[int]) -> None:
            for wm in watermarks:
                producer.produce(topic, b"{}", headers=[("rowrelay.watermark", str(wm).encode())])
            assert producer.flush(30) == 0

        publish([1, 2, 3])
        assert topic_census(stack, topic, 4) == TopicCensus(3, 0, 1)  # 4 never sent
        publish([3])
        census = topic_census(stack, topic, 4)
        assert (census.messages, census.duplicates, census.missing) == (4, 1, 1) and not census.exactly_once
        assert topic_census(stack, topic, 3) == TopicCensus(4, 1, 0)
        publish([5])  # a watermark the table does not have counts as a duplicate (one message too many)
        assert topic_census(stack, topic, 3).duplicates == 2
        clean = f"{topic}_ok"
        ensure_topic(stack.bootstrap, clean)
        for wm in (2, 1, 3):
            producer.produce(clean, b"{}", headers=[("rowrelay.watermark", str(wm).encode())])
        assert producer.flush(30) == 0
        assert topic_census(stack, clean, 3).exactly_once
    finally:
        delete_topics(stack.bootstrap, [topic, f"{topic}_ok"])


def _connect_jvms_in(workdir: Path) -> list[int]:
    """Pids of processes whose cwd is ``workdir`` (the Connect JVM runs there)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if Path(os.readlink(proc / "cwd")) == workdir.resolve():
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


@pytest.mark.bench
def test_standalone_publishes_every_row_once_and_leaves_nothing(stack: Stack, table: str, prefix: str,
                                                                 tmp_path: Path) -> None:
    rows = 3_000
    load_table(stack, table, rows)
    before_repo = set(os.listdir(ROOT))
    figures = run_debezium(stack.pg(), table, stack.bootstrap, prefix, rows, tmp_path)
    assert figures["messages"] == rows, figures
    assert figures["exactly_once_mode"] is False and figures["version"].startswith("3.")
    assert 0 < figures["seconds"] < 300 and figures["rows_per_s"] == pytest.approx(rows / figures["seconds"], 0.01)
    assert "note" not in figures, figures["note"]
    assert 0 < figures["debezium_reported_seconds"] < figures["seconds"]  # JVM start-up is in ours, not in theirs
    values = _values(stack.bootstrap, figures["topic"], rows)
    assert sorted(v["id"] for v in values) == list(range(1, rows + 1))
    assert values[0]["amount"] == "0.01"  # decimal.handling.mode=string, ExtractNewRecordState (flat row)
    assert set(values[0]) == {"id", "category", "domain", "ts", "amount", "note"}
    # The worker's files are in workdir, none in the checkout; its JVM is gone.
    assert (tmp_path / "connect.offsets").exists() and (tmp_path / "connect.log").exists()
    assert set(os.listdir(ROOT)) <= before_repo
    assert _connect_jvms_in(tmp_path) == []


@pytest.mark.bench
def test_exactly_once_is_transactional_and_cleans_its_internal_topics(stack: Stack, table: str, prefix: str,
                                                                        tmp_path: Path) -> None:
    from confluent_kafka.admin import AdminClient

    def internal_topics() -> set[str]:
        admin = AdminClient({"bootstrap.servers": stack.bootstrap})
        return {t for t in admin.list_topics(timeout=10).topics if t.startswith("bench_dbz_connect_")}

    rows = 3_000
    load_table(stack, table, rows)
    before = internal_topics()
    figures = run_debezium(stack.pg(), table, stack.bootstrap, prefix, rows, tmp_path, exactly_once=True)
    assert figures["messages"] == rows, figures
    assert figures["exactly_once_mode"] is True and "ConnectDistributed" in figures["mode"]
    # Commit markers take offsets: a transactional topic's end offset is past its record count.
    assert partition_ends(stack.bootstrap, figures["topic"])[1] > rows
    assert sorted(v["id"] for v in _values(stack.bootstrap, figures["topic"], rows)) == list(range(1, rows + 1))
    assert internal_topics() <= before  # the worker's config/offset/status topics were deleted
    assert _connect_jvms_in(tmp_path) == []


@pytest.mark.bench
def test_missing_table_fails_with_a_reason_instead_of_waiting(stack: Stack, table: str, prefix: str,
                                                              tmp_path: Path) -> None:
    # `table` was never created: the snapshot completes with nothing to export.
    with pytest.raises(DebeziumPeerError, match="snapshot completed but the topic held 0 of 10"):
        run_debezium(stack.pg(), table, stack.bootstrap, prefix, 10, tmp_path, timeout_s=180)
    assert _connect_jvms_in(tmp_path) == []


@pytest.mark.bench
def test_wrong_password_fails_fast_with_the_workers_error(stack: Stack, table: str, prefix: str,
                                                          tmp_path: Path) -> None:
    load_table(stack, table, 10)
    pg = {**stack.pg(), "password": "not-the-password"}
    with pytest.raises(DebeziumPeerError, match="password authentication failed"):
        run_debezium(pg, table, stack.bootstrap, prefix, 10, tmp_path, timeout_s=180)
    assert _connect_jvms_in(tmp_path) == []
