"""Edges of the publish path on the real broker: errors inside a transaction, the transaction timeout, and a
table whose progress is empty while its data topic already holds its messages (issue 9, items 8, 6, 3)."""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, ConfigSource, NewTopic
from sqlalchemy import text

from resources import exactly_once as eo
from resources.exactly_once import (
    OutgoingMessage,
    PublisherFenced,
    RelayError,
    SlicePublisher,
    TableChannel,
    clients,
    progress_log,
    read_committed_progress,
    read_progress_history,
    topics,
)
from resources.kafka_io_manager import STOPPED_TAG
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.slices import SliceRange, micros_text, parse_watermark
from tests.conftest import partition_ends
from tests.pipeline import Harness, assert_exactly_once, read_topic, relay_config, visible_progress
from tests.test_errors import failure_text

pytestmark = pytest.mark.integration


def _messages(lo: int, hi: int, id_offset: int = 0) -> list[OutgoingMessage]:
    """Rows (lo, hi] with watermark i and JSON id i + id_offset (so two tables can share a topic)."""
    out = []
    for i in range(lo + 1, hi + 1):
        value = f'{{"id":{i + id_offset}}}'.encode()
        out.append(OutgoingMessage(str(i).encode(), value, i))
    return out


def _rows(lo: int, hi: int, id_offset: int = 0) -> Callable[[], Iterator[list[OutgoingMessage]]]:
    def batches() -> Iterator[list[OutgoingMessage]]:
        yield _messages(lo, hi, id_offset)
    return batches


def _conf(services, **producer: str) -> dict[str, str]:
    return {"bootstrap.servers": services.kafka_bootstrap, **producer}


def _offsets(bootstrap: str, topic: str) -> tuple[int, int]:
    """(last stable offset, high watermark) of the topic's partition 0: equal when no transaction is open."""
    ends = []
    for isolation in ("read_committed", "read_uncommitted"):
        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"edge-{uuid.uuid4().hex}",
                             "isolation.level": isolation})
        try:
            ends.append(consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=5)[1])
        finally:
            consumer.close()
    return ends[0], ends[1]


def _wait_for(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


# --------------------------------------------------------------------------- item 8: any error aborts


@pytest.mark.parametrize("error", [RuntimeError("rows out of watermark order"), KeyboardInterrupt()],
                         ids=["runtime_error", "keyboard_interrupt"])
def test_error_inside_transaction_aborts_it(services, name, error: BaseException) -> None:
    conf = _conf(services)
    channel = TableChannel.for_table(f"edge.public.{name}", name, prefix=PREFIX)
    publisher = SlicePublisher(channel, conf)

    def failing() -> Iterator[list[OutgoingMessage]]:
        yield _messages(0, 20)  # produced into the open transaction
        # Only once the broker holds them does the open transaction hold the last stable offset.
        _wait_for("rows on the broker", lambda: _offsets(services.kafka_bootstrap, name)[1] >= 20, 10.0)
        raise error  # e.g. the Spark read or the order check failing mid-slice

    try:
        with pytest.raises(type(error)):
            publisher.publish(SliceRange(0, 40), failing)
        # An open transaction would hold the topic's last stable offset: read_committed readers would stall.
        _wait_for("read_committed readers can read to the end",
                  lambda: _offsets(services.kafka_bootstrap, name)[0] == _offsets(services.kafka_bootstrap, name)[1],
                  5.0)
        assert read_topic(services.kafka_bootstrap, name, timeout=5.0) == []
        assert read_committed_progress(conf, channel) is None
        # The same publisher (same epoch) can publish the slice afterwards, once.
        result = publisher.publish(SliceRange(0, 40), _rows(0, 40))
        assert not result.already_committed and result.progress.rows == 40
    finally:
        publisher.close()
    assert_exactly_once(read_topic(services.kafka_bootstrap, name, timeout=5.0), list(range(1, 41)))
    assert visible_progress(conf, channel, 40).hi == 40


def test_a_read_short_of_the_source_count_is_aborted_not_committed(services, name) -> None:
    """The rows read for a slice are checked against the source's count before its progress record: a read that
    lost a row would otherwise commit "sent up to hi" over it, a gap no retry repairs."""
    conf = _conf(services)
    channel = TableChannel.for_table(f"edge.public.{name}", name, prefix=PREFIX)
    publisher = SlicePublisher(channel, conf)
    try:
        with pytest.raises(eo.SliceRowsMismatch, match="the read gave 39 rows but the source counts 40"):
            publisher.publish(SliceRange(0, 40), _rows(0, 39), expected_rows=40)
        _wait_for("read_committed readers can read to the end",
                  lambda: _offsets(services.kafka_bootstrap, name)[0] == _offsets(services.kafka_bootstrap, name)[1],
                  5.0)
        assert read_topic(services.kafka_bootstrap, name, timeout=3.0) == []
        assert read_committed_progress(conf, channel) is None
        result = publisher.publish(SliceRange(0, 40), _rows(0, 40), expected_rows=40)
        assert not result.already_committed and result.progress.rows == 40
    finally:
        publisher.close()
    assert_exactly_once(read_topic(services.kafka_bootstrap, name, timeout=5.0), list(range(1, 41)))


def test_a_row_count_mismatch_late_in_a_long_transaction_is_not_reported_as_a_timeout(services, name) -> None:
    """A mismatch found after 90 % of transaction.timeout.ms was turned into "transaction timed out", and the
    sensor re-cut the slice smaller instead of stopping with the count's diagnosis."""
    conf = _conf(services, **{"transaction.timeout.ms": "6000"})
    channel = TableChannel.for_table(f"edge.public.{name}", name, prefix=PREFIX)
    publisher = SlicePublisher(channel, conf)

    def slow() -> Iterator[list[OutgoingMessage]]:
        yield _messages(0, 9)
        time.sleep(5.5)  # past 0.9 of the timeout, before the coordinator aborts (after 6 s)

    try:
        with pytest.raises(RelayError) as caught:
            publisher.publish(SliceRange(0, 10), slow, expected_rows=10)
    finally:
        publisher.close()
    assert isinstance(caught.value, eo.SliceRowsMismatch), f"{type(caught.value).__name__}: {caught.value}"
    assert read_topic(services.kafka_bootstrap, name, timeout=3.0) == []
    assert read_committed_progress(conf, channel) is None


# --------------------------------------------------------------------------- item 6: the transaction timeout


def test_transaction_outliving_its_timeout_is_reported_as_timed_out(services, name) -> None:
    conf = _conf(services, **{"transaction.timeout.ms": "3000"})  # librdkafka's minimum is 1000
    channel = TableChannel.for_table(f"edge.public.{name}", name, prefix=PREFIX)
    publisher = SlicePublisher(channel, conf)

    def slow() -> Iterator[list[OutgoingMessage]]:
        yield _messages(0, 10)
        time.sleep(6.0)  # the coordinator aborts after 3 s (it checks every 2 s on the stack's broker)
        yield _messages(10, 20)

    started = time.monotonic()
    try:
        with pytest.raises(RelayError) as caught:
            publisher.publish(SliceRange(0, 20), slow)
    finally:
        publisher.close()
    assert isinstance(caught.value, eo.TransactionTimedOut), f"{type(caught.value).__name__}: {caught.value}"
    message = str(caught.value)
    for part in (f"slice {SliceRange(0, 20)}", "3000 ms", "slice_max_rows", "transaction.timeout.ms",
                 "transaction.max.timeout.ms"):
        assert part in message, f"{part!r} not in: {message}"
    # Rows so far: the second batch may be produced before the broker's refusal comes back.
    assert re.search(r"open (\d+\.\d) s \((10|20) rows produced so far\)", message), message
    assert float(re.search(r"open (\d+\.\d) s", message).group(1)) >= 3.0, message
    assert time.monotonic() - started < 20
    assert publisher.transaction_timeout_ms == 3000
    assert read_topic(services.kafka_bootstrap, name, timeout=5.0) == []
    assert read_committed_progress(conf, channel) is None

    # A slice that fits in the timeout commits, and its progress record says how long its transaction took.
    again = SlicePublisher(channel, conf)
    try:
        result = again.publish(SliceRange(0, 20), _rows(0, 20))
    finally:
        again.close()
    assert 0.0 < result.progress.transaction_s < 3.0
    assert read_progress_history(conf, channel)[-1].transaction_s == result.progress.transaction_s
    assert_exactly_once(read_topic(services.kafka_bootstrap, name, timeout=5.0), list(range(1, 21)))


def test_transaction_timeout_setting_wins_and_is_checked(services, name) -> None:
    admin = AdminClient({"bootstrap.servers": services.kafka_bootstrap})
    broker = ConfigResource(ConfigResource.Type.BROKER, str(min(admin.list_topics(timeout=10).brokers)))
    broker_max = int(admin.describe_configs([broker])[broker].result(timeout=10)["transaction.max.timeout.ms"].value)
    too_long = broker_max + 1000
    channel = TableChannel.for_table(f"edge.public.{name}", name, prefix=PREFIX)
    publisher = SlicePublisher(channel, _conf(services, **{"transaction.timeout.ms": str(too_long)}))
    try:
        with pytest.raises(RelayError) as caught:
            publisher.init()
    finally:
        publisher.close()
    message = str(caught.value)
    assert str(too_long) in message and str(broker_max) in message, message
    assert "transaction.max.timeout.ms" in message and "transaction.timeout.ms" in message, message

    assert eo.transaction_timeout_ms({"transaction.timeout.ms": "3000"}) == 3000
    assert eo.transaction_timeout_ms({}) == 600_000
    with pytest.raises(RelayError, match=r"transaction\.timeout\.ms.*'ten minutes'"):
        eo.transaction_timeout_ms({"transaction.timeout.ms": "ten minutes"})


# --------------------------------------------------------------------------- item 3: progress missing


def test_a_slice_read_back_is_its_own_messages_in_a_shared_partition(services, name) -> None:
    """Two tables share a topic, and the second commits a slice while the first one's transaction is open: the
    first slice's recorded offsets then span the second's messages. Reading that slice back (`load_input`,
    `rowrelay replay`) gave both tables' rows; now only its own."""
    conf = _conf(services)
    first = TableChannel.for_table(f"edge.public.{name}", name, prefix=PREFIX)
    second = TableChannel.for_table(f"edge.public.{name}_other", name, prefix=PREFIX)

    def interleaved() -> Iterator[list[OutgoingMessage]]:
        yield _messages(0, 3)
        time.sleep(0.5)  # librdkafka sends the first rows (linger) before the other table's slice
        eo.publish_slice(second, conf, SliceRange(0, 2), _rows(0, 2, id_offset=100))
        yield _messages(3, 6)

    record = eo.publish_slice(first, conf, SliceRange(0, 6), interleaved).progress
    [(first_offset, last_offset)] = record.offsets.values()
    assert last_offset - first_offset + 1 > 6, f"the other table's slice did not land inside this one: {record}"
    read = list(eo.read_published_messages(conf, record))
    assert [dict(m.headers())["rowrelay.watermark"] for m in read] == [b"1", b"2", b"3", b"4", b"5", b"6"]
    assert {dict(m.headers())["rowrelay.table"] for m in read} == {first.table.encode()}


def test_progress_is_found_behind_a_tail_of_aborted_transactions(services, name) -> None:
    """The last progress record is read back from the topic's end in growing windows through one consumer. Behind
    a tail of aborted transactions (no committed record in the first window) the next, lower window came back
    empty: re-assigned at once, librdkafka still reported the end of the last read as the consumer's position.
    The table's progress then read as empty (and the table's highest watermark as None, likewise)."""
    conf = _conf(services)
    channel = TableChannel.for_table(f"edge.public.{name}", name, prefix=PREFIX)
    record = eo.publish_slice(channel, conf, SliceRange(0, 3), _rows(0, 3)).progress
    aborting = Producer({"bootstrap.servers": services.kafka_bootstrap, "transactional.id": f"abort-{name}"})
    aborting.init_transactions(30)
    for _ in range(6):  # each: an aborted record and its marker, 12 offsets in all
        aborting.begin_transaction()
        aborting.produce(channel.progress_topic, record.to_json(), b"aborted")
        aborting.flush(10)
        aborting.abort_transaction(30)
    for _ in range(5):  # a new consumer each time: the stale position showed 8 times in 10
        assert read_committed_progress(conf, channel) == record


def test_empty_progress_with_the_tables_messages_in_topic_is_refused(services, name) -> None:
    conf = _conf(services)
    table = f"edge.public.{name}"
    eo.publish_slice(TableChannel.for_table(table, name, prefix=PREFIX), conf, SliceRange(0, 3), _rows(0, 3))
    # Another table sharing the topic, with empty progress of its own, still publishes.
    eo.publish_slice(TableChannel.for_table(f"edge.public.{name}_other", name, prefix=PREFIX), conf, SliceRange(0, 2),
                     _rows(0, 2, id_offset=100))

    # A new transactional_id_prefix: same table and topic, new (empty) progress topic.
    renamed = TableChannel.for_table(table, name, prefix="other")
    publisher = SlicePublisher(renamed, conf)
    try:
        with pytest.raises(RelayError) as caught:
            publisher.publish(SliceRange(0, 3), _rows(0, 3))
        with pytest.raises(RelayError) as caught_baseline:
            publisher.publish_progress_only(eo.ProgressRecord(table, "baseline-3", 3, 3, 0, 0, "", name))
    finally:
        publisher.close()
    assert sorted(m.value["id"] for m in read_topic(services.kafka_bootstrap, name)) == [1, 2, 3, 101, 102]
    assert isinstance(caught.value, eo.ProgressMissing), f"{type(caught.value).__name__}: {caught.value}"
    assert isinstance(caught_baseline.value, eo.ProgressMissing), caught_baseline.value
    message = str(caught.value)
    assert f"rowrelay reset --table {table} --after 3" in message, message
    assert "transactional_id_prefix" in message, message
    # `rowrelay replay` copies of the table's first row at the end of the topic (more than the first window read
    # backwards): still 3, the copies are not the table's publishing.
    copies = Producer({"bootstrap.servers": services.kafka_bootstrap})
    for _ in range(100):
        copies.produce(name, b'{"id":1}', b"1", headers=[("rowrelay.table", table.encode()),
                                                         ("rowrelay.watermark", b"1"), ("rowrelay.replay", b"r1")])
    copies.flush(10)
    assert eo.table_messages_high_watermark(conf, renamed) == 3
    assert read_committed_progress(conf, renamed) is None


def test_empty_progress_of_a_timestamp_table_names_a_time_to_reset_to(services, name) -> None:
    """The refusal's remedy printed the topic's last watermark as microseconds, which `rowrelay reset --after`
    refuses for a timestamp table ("is an integer, but the table's watermark is a timestamp"): a fix that could not
    be followed. It names the time now, as reset reads it."""
    conf = _conf(services)
    table = f"edge.public.{name}"
    base = 1_795_000_000_000_000
    eo.publish_slice(TableChannel.for_table(table, name, start_after=base, prefix=PREFIX), conf,
                     SliceRange(base, base + 3, timestamps=True), _rows(base, base + 3))
    renamed = TableChannel.for_table(table, name, prefix="other", start_after=base)
    publisher = SlicePublisher(renamed, conf)
    try:
        with pytest.raises(eo.ProgressMissing) as caught:
            publisher.publish(SliceRange(base, base + 3, timestamps=True), _rows(base, base + 3))
    finally:
        publisher.close()
    at = micros_text(base + 3)
    assert f"up to watermark {at}:" in str(caught.value) and f"--after {at}` to set" in str(caught.value), caught.value
    assert parse_watermark(at) == base + 3  # what `rowrelay reset --after` reads back


def test_reset_sets_a_deliberate_baseline_and_fences(services, name) -> None:
    conf = _conf(services)
    table = f"edge.public.{name}"
    eo.publish_slice(TableChannel.for_table(table, name, prefix=PREFIX), conf, SliceRange(0, 3), _rows(0, 3))
    renamed = TableChannel.for_table(table, name, prefix="other")
    running = SlicePublisher(renamed, conf)
    running.init()  # a publisher of the table already holding the current epoch
    resetter = SlicePublisher(renamed, conf)
    try:
        record, _ = resetter.publish_reset(3, "moved to transactional_id_prefix 'other'")
        assert (record.lo, record.hi, record.slice, record.rows) == (3, 3, "reset-3", 0)
        with pytest.raises(PublisherFenced):
            running.publish(SliceRange(3, 5), _rows(3, 5))
        assert resetter.publish(SliceRange(3, 5), _rows(3, 5)).progress.rows == 2
        assert resetter.publish(SliceRange(0, 3), _rows(0, 3)).already_committed
    finally:
        running.close()
        resetter.close()
    history = read_progress_history(conf, renamed)
    assert [(r.slice, r.reset_reason) for r in history] == [
        ("reset-3", "moved to transactional_id_prefix 'other'"), ("000000000003-000000000005", "")]
    assert_exactly_once(read_topic(services.kafka_bootstrap, name), [1, 2, 3, 4, 5])


def test_run_with_empty_progress_and_published_topic_stops_without_publishing(services, pg_database, pg_engine,
                                                                             dagster_instance, spark, name) -> None:
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES ('a'), ('b'), ('c')"))
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}",
                                                         "watermark": "id"}])
    key = SliceRange(0, 3).key
    first = Harness(cfg, dagster_instance)
    dagster_instance.add_dynamic_partitions(f"{first.table().dagster_name}__slices", [key])
    first.run(first.table(), key)
    # The runbook's old advice: a new transactional_id_prefix. Same table, same topic, empty progress.
    renamed = Harness(cfg.model_copy(update={"kafka": cfg.kafka.model_copy(
        update={"transactional_id_prefix": "other"})}), dagster_instance)
    result = renamed.run(renamed.table(), key, raise_on_error=False)
    assert not result.success
    table_id = renamed.table().table_id
    assert f"rowrelay reset --table {table_id} --after 3" in failure_text(result), failure_text(result)
    assert dagster_instance.get_run_by_id(result.run_id).tags.get(STOPPED_TAG) == "progress_missing"
    assert_exactly_once(read_topic(services.kafka_bootstrap, renamed.table().topic_name), [1, 2, 3])


def test_progress_topic_lost_after_the_data_topics_messages_expired_is_refused(services, pg_database, pg_engine,
                                                                               dagster_instance, spark, name) -> None:
    """The progress topic deleted by an admin once the data topic's old messages had aged out: nothing in Kafka
    showed the table's history, and the next backfill sent it all again, exit 0. Dagster's
    storage still records the committed slices: the run refuses, naming the watermark to reset to."""
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES ('a'), ('b'), ('c')"))
    h = Harness(relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}",
                                                               "watermark": "id"}]), dagster_instance)
    table = h.table()
    partitions = f"{table.dagster_name}__slices"
    dagster_instance.add_dynamic_partitions(partitions, [SliceRange(0, 3).key])
    h.run(table, SliceRange(0, 3).key)
    admin = AdminClient({"bootstrap.servers": services.kafka_bootstrap})
    channel = eo.TableChannel.for_table(table.table_id, table.topic_name, prefix=PREFIX)
    admin.delete_topics([channel.progress_topic])[channel.progress_topic].result(timeout=30)
    end = partition_ends(services.kafka_bootstrap, table.topic_name)[1]
    for fut in admin.delete_records([TopicPartition(table.topic_name, 0, end)]).values():  # as retention does
        fut.result(timeout=30)
    _wait_for("the progress topic gone", lambda: read_committed_progress(_conf(services), channel) is None, 30)
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v) VALUES ('d'), ('e')"))
    dagster_instance.add_dynamic_partitions(partitions, [SliceRange(0, 5).key])  # as a cut from empty progress
    result = h.run(table, SliceRange(0, 5).key, raise_on_error=False)
    assert not result.success
    message = failure_text(result)
    assert "slices of this table recorded as committed reach watermark 3" in message, message
    assert f"rowrelay reset --table {table.table_id} --after 3" in message, message
    assert dagster_instance.get_run_by_id(result.run_id).tags.get(STOPPED_TAG) == "progress_missing"
    assert read_topic(services.kafka_bootstrap, table.topic_name, timeout=2) == []


def test_topics_are_made_from_their_own_metadata_not_the_whole_clusters(services, name, monkeypatch) -> None:
    """ensure_topics asks about the table's two topics only: an answer about every topic of the cluster costs
    client and broker CPU in proportion to the cluster (2,500 topics on the test broker). An existing data topic
    keeps its partitions; the missing progress topic is created compacted."""
    conf = _conf(services)
    channel = TableChannel.for_table(name, f"{name}.data", topic_partitions=3, prefix=PREFIX)
    admin = AdminClient({"bootstrap.servers": services.kafka_bootstrap})
    admin.create_topics([NewTopic(channel.topic, 2, 1)])[channel.topic].result(timeout=30)
    asked: list[str | None] = []
    real = eo.list_topics

    def spy(client, kafka_conf, topic=None, timeout=10.0):
        asked.append(topic)
        return real(client, kafka_conf, topic, timeout)

    monkeypatch.setattr(clients, "list_topics", spy)
    monkeypatch.setattr(progress_log, "list_topics", spy)
    monkeypatch.setattr(clients, "_broker_max_timeout_ms", {})  # read it again, through DescribeCluster
    assert eo.ensure_topics(conf, channel).partitions == 2  # the existing topic's own partition count
    assert eo.ensure_topics(conf, channel).partitions == 2  # both exist now: nothing to create
    assert asked and None not in asked, f"whole-cluster metadata asked: {asked}"
    assert set(asked) == {channel.topic, channel.progress_topic}
    progress = ConfigResource(ConfigResource.Type.TOPIC, channel.progress_topic)
    progress_config = admin.describe_configs([progress])[progress].result(timeout=30)
    assert progress_config["cleanup.policy"].value == "compact"
    # No durability weaker than the cluster's for the authority: min.insync.replicas is not overridden per topic.
    assert progress_config["min.insync.replicas"].source != ConfigSource.DYNAMIC_TOPIC_CONFIG.value
    assert len(admin.list_topics(channel.topic, timeout=10).topics[channel.topic].partitions) == 2
    assert eo.broker_max_transaction_timeout_ms(conf) == 900_000  # the stack broker's (Kafka's default)


# --------------------------------------------------------------------------- topics someone else created


def _create_topic(services, topic: str, partitions: int = 1, **config: str) -> None:
    admin = AdminClient({"bootstrap.servers": services.kafka_bootstrap})
    admin.create_topics([NewTopic(topic, partitions, 1, config=config)])[topic].result(timeout=30)


def test_a_progress_topic_with_several_partitions_keeps_every_record_in_the_one_read(services, name,
                                                                                     monkeypatch) -> None:
    """An admin created the progress topic with the cluster's usual partition count. Records spread by key hash
    over its partitions, while progress is read at partition 0: each backfill sent everything after the first slice
    again."""
    conf = _conf(services)
    channel = TableChannel.for_table(f"edge.public.{name}", name, prefix=PREFIX)
    _create_topic(services, channel.progress_topic, 3, **{"cleanup.policy": "compact"})
    for lo in range(0, 400, 100):
        eo.publish_slice(channel, conf, SliceRange(lo, lo + 100), _rows(lo, lo + 100))
    again = eo.publish_slice(channel, conf, SliceRange(100, 200), _rows(100, 200))
    assert again.already_committed
    assert_exactly_once(read_topic(services.kafka_bootstrap, name), list(range(1, 401)))
    progress = read_committed_progress(conf, channel)
    assert progress is not None and progress.hi == 400
    assert [partition_ends(services.kafka_bootstrap, channel.progress_topic, p)[1] for p in (1, 2)] == [0, 0]
    # Records an older release left in another partition are never read: refused, naming them, before anything.
    stray = Producer({"bootstrap.servers": services.kafka_bootstrap})
    stray.produce(channel.progress_topic, b"{}", b"000000000400-000000000500", partition=2)
    stray.flush(10)
    topics._TOPICS_FIT.clear()  # as a process started later (the check is kept for a minute)
    with pytest.raises(eo.TopicSettingsError, match=r"partition\(s\) \[2\] hold records.*reads progress from "
                                                    r"partition 0 only.*nothing was sent"):
        eo.publish_slice(channel, conf, SliceRange(400, 500), _rows(400, 500))
    assert len(read_topic(services.kafka_bootstrap, name)) == 400


@pytest.mark.parametrize("policy", ["delete", "compact,delete"])
def test_a_progress_topic_whose_records_expire_is_refused(services, name, policy) -> None:
    conf = _conf(services)
    channel = TableChannel.for_table(f"edge.public.{name}", name, prefix=PREFIX)
    _create_topic(services, channel.progress_topic, **{"cleanup.policy": policy})
    with pytest.raises(eo.TopicSettingsError, match=rf"has cleanup.policy={policy}: its records expire.*"
                                                    rf"--entity-name {channel.progress_topic} --add-config "
                                                    r"cleanup.policy=compact --bootstrap-server "
                                                    rf"{services.kafka_bootstrap.split(',')[0]} \(with the client "
                                                    r"settings.*nothing was sent"):
        eo.publish_slice(channel, conf, SliceRange(0, 3), _rows(0, 3))
    assert read_topic(services.kafka_bootstrap, name, timeout=2) == []


def test_a_compacted_data_topic_needs_a_key(services, name) -> None:
    """Kafka refuses a message without a key in a compacted topic (INVALID_RECORD); it was reported as a row too
    large, with advice to skip rows."""
    conf = _conf(services)
    _create_topic(services, name, **{"cleanup.policy": "compact"})
    unkeyed = TableChannel.for_table(f"edge.public.{name}", name, keyed=False, prefix=PREFIX)
    with pytest.raises(eo.TopicSettingsError, match=rf"topic {name} is compacted \(cleanup.policy=compact\).*"
                                                    r"`key: none`.*nothing was sent"):
        eo.publish_slice(unkeyed, conf, SliceRange(0, 3), _rows(0, 3))
    # Keyed (as _rows' messages are), the same topic takes them.
    eo.publish_slice(TableChannel.for_table(f"edge.public.{name}", name, prefix=PREFIX), conf, SliceRange(0, 3),
                     _rows(0, 3))
    assert_exactly_once(read_topic(services.kafka_bootstrap, name), [1, 2, 3])


def test_a_compacted_topic_two_tables_share_is_refused(services, name) -> None:
    """Two keyed tables sharing a compacted topic: a message's key holds the row's key columns only, so compaction
    kept one table's `{"id":1}` and erased the other's, rows lost for good. Refused before any
    message; the same topic serves one table alone."""
    conf = _conf(services)
    _create_topic(services, name, **{"cleanup.policy": "compact"})
    other = f"edge.public.{name}_b"
    shared = TableChannel.for_table(f"edge.public.{name}_a", name, shared_with=(other,), prefix=PREFIX)
    with pytest.raises(eo.TopicSettingsError, match=rf"topic {name} is compacted \(cleanup.policy=compact\), and "
                                                    rf"table\(s\) {other} write to it too: .*erase another's .*"
                                                    r"a topic of its own \(`topic:`\).*nothing was sent$"):
        eo.publish_slice(shared, conf, SliceRange(0, 3), _rows(0, 3))
    assert read_topic(services.kafka_bootstrap, name) == []
    eo.publish_slice(TableChannel.for_table(f"edge.public.{name}_a", name, prefix=PREFIX), conf, SliceRange(0, 3),
                     _rows(0, 3))
    assert_exactly_once(read_topic(services.kafka_bootstrap, name), [1, 2, 3])


def test_batches_fit_a_data_topic_with_a_small_max_message_bytes(services, name) -> None:
    """A topic limit of 4,000 bytes against the producer's 1 MB batches: the broker refused every batch and each
    slice failed blaming its largest row (145 bytes); librdkafka does not split a refused batch as Java's does."""
    conf = _conf(services)
    _create_topic(services, name, **{"max.message.bytes": "4000"})
    channel = TableChannel.for_table(f"edge.public.{name}", name, prefix=PREFIX)

    def rows() -> Iterator[list[OutgoingMessage]]:
        yield [OutgoingMessage(str(i).encode(), f'{{"id":{i},"note":"{"x" * 120}"}}'.encode(), i)
               for i in range(1, 301)]

    eo.publish_slice(channel, conf, SliceRange(0, 300), rows)
    assert_exactly_once(read_topic(services.kafka_bootstrap, name), list(range(1, 301)))


def test_progress_that_moves_to_another_topic_and_back_is_refused(services, name) -> None:
    """Staging and production on one cluster, one transactional_id_prefix, topics of their own: each continued
    from the other's progress and skipped the rows the other had sent, every backfill exiting 0.
    A single `topic:` change still moves the table; the move back is refused until a reset says it is meant."""
    conf = _conf(services)
    table = f"edge.public.{name}"
    prod = TableChannel.for_table(table, f"{name}.prod", prefix=PREFIX)
    staging = TableChannel.for_table(table, f"{name}.stg", prefix=PREFIX)
    eo.publish_slice(prod, conf, SliceRange(0, 3), _rows(0, 3))
    eo.publish_slice(staging, conf, SliceRange(3, 5), _rows(3, 5))  # a topic change, as far as anyone can tell
    with pytest.raises(eo.ProgressShared, match=rf"last written for topic {name}.stg .*after earlier slices of this "
                                                rf"run's topic {name}.prod.*rowrelay reset --table {table} --after 5"):
        eo.publish_slice(prod, conf, SliceRange(5, 7), _rows(5, 7))
    assert_exactly_once(read_topic(services.kafka_bootstrap, f"{name}.prod"), [1, 2, 3])
    publisher = SlicePublisher(prod, conf)
    try:
        publisher.publish_reset(5, "topic moved back to prod on purpose")
        assert not publisher.publish(SliceRange(5, 7), _rows(5, 7)).already_committed
    finally:
        publisher.close()
    assert_exactly_once(read_topic(services.kafka_bootstrap, f"{name}.prod"), [1, 2, 3, 6, 7])


def test_slices_read_back_in_one_pass_are_each_as_read_alone(services, name) -> None:
    """A roll-up key's parity check read back each of its slices with a read of its own, ~25 ms each (a 1000-slice
    key held the table's pool 27 s): slices whose offsets follow each other in a partition are now
    read in one pass and split by their records' offsets. Each comes out as read alone, another table's slice
    between them in the shared partition left out; a message outside its slice's range still stops the read."""
    conf = _conf(services)
    a = TableChannel.for_table(f"edge.public.{name}_a", name, prefix=PREFIX)
    b = TableChannel.for_table(f"edge.public.{name}_b", name, prefix=PREFIX)
    eo.publish_slice(a, conf, SliceRange(0, 3), _rows(0, 3))
    eo.publish_slice(b, conf, SliceRange(0, 2), _rows(0, 2))  # between a's slices, in the same partition
    eo.publish_slice(a, conf, SliceRange(3, 7), _rows(3, 7))
    eo.publish_slice(a, conf, SliceRange(7, 8), _rows(7, 8))
    records = [r for r in eo.read_progress_history(conf, a) if r.hi > r.lo]
    assert [r.rows for r in records] == [3, 4, 1]
    together = eo.read_back_slices(conf, records)
    assert together == {r.slice: eo.read_back_slice(conf, r) for r in records}
    assert {s: p.rows for s, p in together.items()} == {r.slice: r.rows for r in records}
    assert all(p.checksum == r.checksum for r, p in zip(records, together.values(), strict=True))

    # A record naming offsets that now hold another slice's messages (the topic re-created) stops the read.
    moved = dataclasses.replace(records[1], offsets=records[2].offsets)
    with pytest.raises(eo.SliceMessagesGone, match=r"has watermark 8, outside slice"):
        eo.read_back_slices(conf, [records[0], moved])
