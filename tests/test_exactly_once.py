"""Exactly once under crashes, races and out-of-order commits, on the real broker and databases."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition
from sqlalchemy import text

from resources.exactly_once import (
    OutgoingMessage,
    ProgressTail,
    PublisherFenced,
    RelayError,
    SlicePublisher,
    TableChannel,
    publish_slice,
)
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.slices import SliceRange
from tests.pipeline import Harness, assert_exactly_once, polled, read_topic, relay_config, visible_progress

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


def _rows(lo: int, hi: int):
    def batches():
        yield [OutgoingMessage(str(i).encode(), f'{{"id":{i}}}'.encode(), i)
               for i in range(lo + 1, hi + 1)]
    return batches


def _overtaken_at(stage: str, bootstrap: str, channel: TableChannel, rows: int) -> tuple[object, object]:
    """Publisher A holds at `stage` of the table's first slice (0, rows] while B publishes that slice; A then
    resumes. Returns A's outcome (its result or its exception) and B's result."""
    conf = {"bootstrap.servers": bootstrap}
    paused, resume = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def hold(at: str) -> None:
        if at == stage:
            paused.set()
            resume.wait(60)

    def first() -> None:
        try:
            outcome["a"] = SlicePublisher(channel, conf, on_stage=hold).publish(SliceRange(0, rows), _rows(0, rows))
        except Exception as exc:  # noqa: BLE001 - the outcome is asserted by the caller
            outcome["a"] = exc

    a = threading.Thread(target=first)
    a.start()
    assert paused.wait(60), f"publisher A never reached {stage}"
    b = publish_slice(channel, conf, SliceRange(0, rows), _rows(0, rows))
    resume.set()
    a.join(60)
    return outcome["a"], b


def test_racing_publishers_one_is_fenced_no_duplicate(services, name) -> None:
    # B takes over the table while A holds an open transaction with all 500 rows produced.
    channel = TableChannel.for_table(f"race.public.{name}", name, prefix=PREFIX)
    a, b = _overtaken_at("rows_produced", services.kafka_bootstrap, channel, 500)
    assert not b.already_committed and b.progress.rows == 500
    assert isinstance(a, PublisherFenced), a
    msgs = read_topic(services.kafka_bootstrap, name)
    assert sorted(int(m.key) for m in msgs) == list(range(1, 501))
    assert visible_progress({"bootstrap.servers": services.kafka_bootstrap}, channel, 500).hi == 500


def test_a_publisher_overtaken_after_reading_empty_progress_stops_as_fenced(services, name) -> None:
    """A table's first publisher reads empty progress, then stalls (a frozen worker, a long GC pause) while a newer
    one publishes the first slice. Resumed, it must stop as fenced, never report the progress topic as lost: that
    refusal is not retried and tells the operator to `rowrelay reset` a table whose progress is fine."""
    channel = TableChannel.for_table(f"overtaken.public.{name}", name, prefix=PREFIX)
    a, b = _overtaken_at("progress_read", services.kafka_bootstrap, channel, 50)
    assert not b.already_committed and b.progress.rows == 50
    assert isinstance(a, PublisherFenced), repr(a)
    assert sorted(int(m.key) for m in read_topic(services.kafka_bootstrap, name)) == list(range(1, 51))


def test_a_publisher_fenced_while_it_produces_stops_as_fenced_and_closes_quietly(services, name) -> None:
    """Fenced before its second slice's rows: librdkafka refused the rest as "Local: Fatal error" with no cause,
    which stopped the run as a bare Kafka error instead of "fenced"; and closing the producer then raised (a
    delivery report served with the fatal error pending), replacing the error the run had failed with."""
    from confluent_kafka import Producer

    conf = {"bootstrap.servers": services.kafka_bootstrap}
    channel = TableChannel.for_table(f"fenced.public.{name}", name, prefix=PREFIX)
    publisher = SlicePublisher(channel, conf)
    publisher.publish(SliceRange(0, 10), _rows(0, 10))
    newer = Producer({**conf, "transactional.id": channel.transactional_id})
    newer.init_transactions(30)
    with pytest.raises(PublisherFenced, match="another publisher took over"):
        publisher.publish(SliceRange(10, 200_010), _rows(10, 200_010))  # enough rows to be producing at the refusal
    publisher.close()  # raises nothing
    assert [int(m.key) for m in read_topic(services.kafka_bootstrap, name)] == list(range(1, 11))


def test_slices_commit_in_order_and_repeat_is_a_no_op(services, name) -> None:
    conf = {"bootstrap.servers": services.kafka_bootstrap}
    channel = TableChannel.for_table(f"order.public.{name}", name, prefix=PREFIX)
    with pytest.raises(RelayError, match=r"\(0, 100\] must commit first"):
        publish_slice(channel, conf, SliceRange(100, 200), _rows(100, 200))
    publish_slice(channel, conf, SliceRange(0, 100), _rows(0, 100))
    again = publish_slice(channel, conf, SliceRange(0, 100), _rows(0, 100))
    assert again.already_committed and again.progress.rows == 100
    publish_slice(channel, conf, SliceRange(100, 200), _rows(100, 200))
    assert [int(m.key) for m in read_topic(services.kafka_bootstrap, name)] == list(range(1, 201))


def test_an_idle_progress_tail_fetches_nothing_and_still_sees_the_next_commit(services, name) -> None:
    """A sensor reads its table's progress through a long-lived ProgressTail. Left assigned, its consumer fetched
    the progress partition every fetch.wait.max.ms (10 ms) for as long as the process lived, nobody polling: ~100
    requests a second per table on the broker. librdkafka's `fetch` debug lines count the fetches (through a logger
    of the test's: with a logger set, librdkafka writes nothing to stderr, where an earlier version of this test
    looked and could never find one)."""
    conf = {"bootstrap.servers": services.kafka_bootstrap}
    channel = TableChannel.for_table(f"tail.public.{name}", name, prefix=PREFIX)
    publish_slice(channel, conf, SliceRange(0, 100), _rows(0, 100))
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    log = logging.getLogger(f"tests.tail.{name}")
    log.setLevel(logging.DEBUG)
    log.propagate = False
    log.addHandler(Collect())
    tail = ProgressTail({**conf, "debug": "fetch", "logger": log}, channel.progress_topic)

    def fetches() -> int:
        tail.consumer.poll(0)  # the client's log lines wait in its queue until it is polled
        return sum(1 for line in lines if line.startswith("FETCH"))

    try:
        record = polled(tail.read, lambda r: r is not None)  # the commit marker may come a moment later
        assert record is not None and record.hi == 100
        assert fetches() > 0, "the read itself fetched: the counter must see that"
        lines.clear()
        time.sleep(1.0)  # idle, as between two sensor ticks
        idle = fetches()
        assert idle < 5, f"{idle} fetches in 1 s from an idle tail: {lines[:3]}"
        publish_slice(channel, conf, SliceRange(100, 200), _rows(100, 200))
        record = polled(tail.read, lambda r: r is not None and r.hi == 200)
        assert record is not None and record.hi == 200
    finally:
        tail.close()


# --------------------------------------------------------------------------- crashes of a real run


def _visible_now(bootstrap: str, topic: str, seconds: float = 3.0) -> int:
    """Messages a read_committed consumer receives within a few seconds (an open transaction blocks the rest)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"peek-{uuid.uuid4().hex}",
                  "isolation.level": "read_committed", "auto.offset.reset": "earliest"})
    try:
        c.assign([TopicPartition(topic, 0, 0)])
        n, deadline = 0, time.monotonic() + seconds
        while time.monotonic() < deadline:
            msg = c.poll(0.2)
            if msg is not None and not msg.error():
                n += 1
        return n
    finally:
        c.close()


@pytest.fixture
def crash_table(services, pg_database, pg_engine, dagster_instance, tmp_path, name):
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT md5(g::text) FROM generate_series(1, 3000) g"))
    # The run worker is a separate `dagster` process: Spark Connect spares it a JVM start.
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}", "watermark": "id",
                                                         "slice_max_rows": 3000}], spark_remote=True)
    h = Harness(cfg, dagster_instance)
    keys = h.cut(h.table())
    assert keys == ["000000000000-000000003000"]
    return h, keys[0]


def test_killed_after_kafka_commit_retry_publishes_nothing(services, crash_table) -> None:
    h, key = crash_table
    table = h.table()
    res = h.run_cli(table, key, env={"ROWRELAY_FAILPOINT": "committed"})
    assert res.returncode == -9, res.output[-3000:]
    # Kafka has the slice; Dagster never heard of it.
    assert len(read_topic(services.kafka_bootstrap, table.topic_name)) == 3000
    assert h.progress(table).hi == 3000
    with pytest.raises(AssertionError, match="no materialization"):
        h.materialization(table, key)
    retry = h.run(table, key)  # a new worker process, as a run retry would be
    assert retry.success
    meta = h.materialization(table, key)
    assert meta["already_committed"] is True and meta["rows"] == 3000
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), list(range(1, 3001)))


def test_killed_mid_transaction_nothing_visible_retry_publishes_once(services, crash_table):
    h, key = crash_table
    table = h.table()
    res = h.run_cli(table, key, env={"ROWRELAY_FAILPOINT": "rows_produced"})
    assert res.returncode == -9, res.output[-3000:]
    assert _visible_now(services.kafka_bootstrap, table.topic_name) == 0
    assert h.progress(table) is None
    retry = h.run(table, key)  # its init_transactions aborts the dead run's open transaction
    assert retry.success
    assert h.materialization(table, key)["already_committed"] is False
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), list(range(1, 3001)))


# --------------------------------------------------------------------------- out-of-order commits


def _out_of_order(h: Harness, engine, table_sql: str, insert_one: str, insert_many: str) -> None:
    table = h.table()
    with engine.begin() as conn:
        conn.execute(text(insert_many))  # ids 1..20, committed
    h.drain(table, until_hi=20)
    holder = engine.connect()
    tx = holder.begin()
    res = holder.execute(text(insert_one))
    low_id = res.scalar() if res.returns_rows else res.lastrowid
    with engine.begin() as conn:
        conn.execute(text(insert_many))  # higher ids commit while the low one is still open
    with engine.connect() as conn:
        high = conn.execute(text(f"SELECT max(id) FROM {table_sql}")).scalar()
    assert high > low_id
    for _ in range(4):  # the sensor keeps ticking while the low id is uncommitted
        for key in h.tick(table):
            assert SliceRange.from_key(key).hi < low_id, f"slice {key} cut across uncommitted id {low_id}"
            h.run(table, key)
        time.sleep(0.7)
    tx.commit()
    holder.close()
    h.drain(table, until_hi=high)
    assert_exactly_once(read_topic(h.config.kafka.bootstrap_servers, table.topic_name), list(range(1, high + 1)))
    assert h.progress(table).hi == high


def test_out_of_order_commits_lose_nothing_postgres(services, pg_database, pg_engine, dagster_instance, spark, name):
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v int)"))
    cfg = relay_config(services, {"src": pg_database},
                       [{"source": "src", "table": f"public.{name}", "watermark": "id"}])
    _out_of_order(Harness(cfg, dagster_instance), pg_engine, name,
                  f"INSERT INTO {name} (v) VALUES (0) RETURNING id",
                  f"INSERT INTO {name} (v) SELECT g FROM generate_series(1, 20) g")


def test_out_of_order_commits_lose_nothing_mariadb(services, mariadb_database, mariadb_engine, dagster_instance,
                                                   spark, name):
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint AUTO_INCREMENT PRIMARY KEY, v int)"))
    cfg = relay_config(services, {"src": mariadb_database}, [{"source": "src", "table": name, "watermark": "id",
                                                              "settle_seconds": 0.5}])
    many = f"INSERT INTO {name} (v) VALUES " + ",".join(f"({i})" for i in range(20))
    _out_of_order(Harness(cfg, dagster_instance), mariadb_engine, name, f"INSERT INTO {name} (v) VALUES (0)", many)
