"""The only creator and checker of a table's topics."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, OffsetSpec

from resources.cache import KeptAnswers
from resources.exactly_once.clients import _consumer, _log, _topic_metadata, base_conf
from resources.exactly_once.errors import KafkaUnavailable, RelayError, TopicSettingsError
from resources.exactly_once.progress_log import partition_watermarks
from resources.exactly_once.records import TableChannel


@dataclass(frozen=True)
class TopicsReady:
    """What `ensure_topics` found: the data topic's partition count and, where readable, its max.message.bytes."""

    partitions: int
    max_message_bytes: int | None = None


# Existing topics found fit (and the data topic's max.message.bytes), per process: an early read and the run it
# feeds, seconds apart, check them once.
TOPICS_FIT_TTL_S = 60.0
_TOPICS_FIT: KeptAnswers[tuple[str, str, str, bool, tuple[str, ...]], tuple[int | None]] = KeptAnswers(
    ttl_s=TOPICS_FIT_TTL_S)


def _topic_configs(admin: AdminClient, topics: list[str], timeout: float) -> dict[str, dict[str, str]]:
    """Each topic's configuration (name -> value); a topic whose configuration is not readable (no DescribeConfigs
    permission) is left out: its checks are skipped, the broker still enforces what it enforces."""
    found: dict[str, dict[str, str]] = {}
    if not topics:
        return found
    asked = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, name) for name in topics],
                                   request_timeout=timeout)
    for resource, fut in asked.items():
        try:
            found[resource.name] = {k: e.value for k, e in fut.result(timeout=timeout).items() if e.value is not None}
        except Exception:  # noqa: BLE001 - unreadable: skip the checks (docstring)
            _log.info("configuration of topic %s not readable; its settings are not checked", resource.name)
    return found


# Durability warnings already given, per process: one line per topic and kind, not one per run or tick.
_WARNED: set[tuple[str, str]] = set()


def durability_warning(table: str, topic: str, role: str, brokers: int, replicas: int, min_isr: int | None
                       ) -> str | None:
    """What is weak about a topic's durability on a cluster of `brokers`, with the fix; None if nothing is.

    The progress topic is the authority on where a table stands: with one replica, that broker's disk is the table's
    place; with `min.insync.replicas=1`, a commit one replica acknowledged dies with it."""
    lost = "the table's place (its slices would be sent again)" if role == "progress" else "the rows in it"
    if brokers > 1 and replicas == 1:
        return (f"{table}: {role} topic {topic} has one replica on a cluster of {brokers} brokers: losing that "
                f"broker's disk loses {lost}. Give it 3 replicas (kafka-reassign-partitions.sh) and "
                "min.insync.replicas=2")
    if replicas > 1 and min_isr == 1:
        return (f"{table}: {role} topic {topic} has {replicas} replicas but min.insync.replicas=1: a commit only one "
                f"replica acknowledged is lost if that broker fails before the others copy it, and with it {lost}. "
                f"Set min.insync.replicas=2 (kafka-configs.sh --alter --entity-type topics --entity-name {topic} "
                "--add-config min.insync.replicas=2)")
    return None


def _warn_durability(admin: AdminClient, channel: TableChannel, existing: dict[str, Any],
                     configs: dict[str, dict[str, str]], timeout: float) -> None:
    """Log, once per process, each of the channel's topics that a single broker's loss could undo."""
    brokers = len(admin.list_topics(timeout=timeout).brokers)
    for topic, role in ((channel.topic, "data"), (channel.progress_topic, "progress")):
        meta = existing.get(topic)
        if meta is None or not meta.partitions:
            continue
        replicas = min(len(p.replicas) for p in meta.partitions.values())
        min_isr = configs.get(topic, {}).get("min.insync.replicas")
        text = durability_warning(channel.table, topic, role, brokers, replicas, int(min_isr) if min_isr else None)
        if text is not None and (topic, text[:40]) not in _WARNED:
            _WARNED.add((topic, text[:40]))
            _log.warning("rowrelay: %s", text)


def _check_existing_topics(admin: AdminClient, channel: TableChannel, existing: dict[str, Any],
                           timeout: float, bootstrap: str) -> int | None:
    """Refuse topics someone else created with settings rowrelay cannot work with; returns the data topic's
    max.message.bytes where readable.

    - The progress topic is read at partition 0 only: a record in another partition (a topic created with the
      cluster's default partition count, before rowrelay produced to partition 0 explicitly) would be progress
      never seen, and its slices sent again.
    - Progress must never expire: a table whose progress expired would be sent again from its start, so the
      progress topic must be compacted and nothing else (`compact,delete` expires too).
    - A compacted data topic refuses messages without a key (the broker's INVALID_RECORD).
    """
    ch = channel
    mine = [t for t in (ch.topic, ch.progress_topic) if t in existing]
    configs = _topic_configs(admin, mine, timeout)
    if ch.progress_topic in existing:
        others = [TopicPartition(ch.progress_topic, p) for p in existing[ch.progress_topic].partitions if p != 0]
        if others:
            ends = admin.list_offsets({tp: OffsetSpec.latest() for tp in others}, request_timeout=timeout)
            try:
                held = sorted(tp.partition for tp, fut in ends.items() if fut.result(timeout=timeout).offset > 0)
            except KafkaException as exc:  # a partition without a leader now: not known, asked again next run
                raise KafkaUnavailable(f"{ch.table}: cannot read the ends of progress topic {ch.progress_topic}'s "
                                       f"partitions: {exc.args[0].str()}") from exc
            if held:
                raise TopicSettingsError(
                    f"{ch.table}: progress topic {ch.progress_topic} has {len(others) + 1} partitions and its "
                    f"partition(s) {held} hold records; rowrelay reads progress from partition 0 only, so those "
                    "records were never seen, and slices they record may have been sent twice. Stop the table, "
                    f"run `rowrelay verify --table {ch.table}`, then re-create the progress topic with one partition "
                    "and cleanup.policy=compact holding the last record of partition 0 (or set a new baseline with "
                    "`rowrelay reset`); nothing was sent")
        policy = configs.get(ch.progress_topic, {}).get("cleanup.policy")
        if policy is not None and policy.replace(" ", "") != "compact":
            raise TopicSettingsError(
                f"{ch.table}: progress topic {ch.progress_topic} has cleanup.policy={policy}: its records expire "
                "(retention.ms), and a table whose progress expired would be sent again from its start. Make it "
                f"compacted only: kafka-configs.sh --alter --entity-type topics --entity-name {ch.progress_topic} "
                f"--add-config cleanup.policy=compact --bootstrap-server {bootstrap.split(',')[0]} (with the "
                "client settings your cluster needs: --command-config); nothing was sent")
    _warn_durability(admin, ch, existing, configs, timeout)
    data = configs.get(ch.topic, {})
    if ch.shared_with and "compact" in data.get("cleanup.policy", ""):
        raise TopicSettingsError(
            f"{ch.table}: topic {ch.topic} is compacted (cleanup.policy={data['cleanup.policy']}), and table(s) "
            f"{', '.join(ch.shared_with)} write to it too: compaction keeps one message per key, and a message's key "
            "holds the row's key columns only (no table), so one table's row would erase another's with the same "
            "key, for good. Give each table a topic of its own (`topic:`) or make this one not compacted "
            "(cleanup.policy=delete); nothing was sent")
    if not ch.keyed and "compact" in data.get("cleanup.policy", ""):
        raise TopicSettingsError(
            f"{ch.table}: topic {ch.topic} is compacted (cleanup.policy={data['cleanup.policy']}), and Kafka refuses "
            "a message without a key there; the table has `key: none`. Set `key:` (its primary key, or hash_row) "
            "or relay it to a topic that is not compacted; nothing was sent")
    return int(data["max.message.bytes"]) if "max.message.bytes" in data else None


def ensure_topics(kafka_conf: dict[str, Any], channel: TableChannel, timeout: float = 30.0) -> TopicsReady:
    """Create the channel's topics if missing, and check those that existed (`_check_existing_topics`)."""
    # No automatic creation by asking about a topic (librdkafka's producer-type clients, AdminClient among
    # them, would let a broker with auto.create.topics.enable create it with the broker's defaults): the
    # progress topic must be created compacted, below.
    admin = AdminClient({**base_conf(kafka_conf), "allow.auto.create.topics": False})
    existing = _topic_metadata(admin, kafka_conf, [channel.topic, channel.progress_topic], timeout)
    if channel.topic in existing and existing[channel.topic].partitions:
        partitions = len(existing[channel.topic].partitions)
    else:
        partitions = channel.topic_partitions
    memo = (str(kafka_conf.get("bootstrap.servers")), channel.topic, channel.progress_topic, channel.keyed,
            channel.shared_with)
    hit = _TOPICS_FIT.get(memo)
    if hit is not None and len(existing) == 2:
        ready = TopicsReady(partitions, hit[0])
    else:
        ready = TopicsReady(partitions, _check_existing_topics(
            admin, channel, existing, timeout, str(kafka_conf.get("bootstrap.servers", "<broker:port>"))))
        if len(existing) == 2:
            _TOPICS_FIT.keep(memo, (ready.max_message_bytes,))
    wanted = []
    if channel.topic not in existing:
        wanted.append(NewTopic(channel.topic, channel.topic_partitions, channel.replication_factor))
    if channel.progress_topic not in existing:
        # The cluster's min.insync.replicas, as for the data topic: the progress record is the authority, so it
        # gets no weaker durability than the rows it covers.
        wanted.append(NewTopic(channel.progress_topic, 1, channel.replication_factor,
                               config={"cleanup.policy": "compact"}))
    if not wanted:
        return ready
    for topic, fut in admin.create_topics(wanted, request_timeout=timeout).items():
        try:
            fut.result(timeout=timeout)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise RelayError(f"cannot create topic {topic}: {exc.args[0].str()}") from exc
    # Wait until the new topics have leaders, so the first read or produce does not race their creation.
    deadline = time.monotonic() + timeout
    names = [t.topic for t in wanted]
    while time.monotonic() < deadline:
        topics = _topic_metadata(admin, kafka_conf, names, timeout)
        if all(n in topics and topics[n].partitions and all(p.leader >= 0 for p in topics[n].partitions.values())
               for n in names):
            return ready
        time.sleep(0.05)  # a new topic's leader is usually elected within tens of milliseconds
    return ready


# A reader fetches again 10 ms after its queue was full, not librdkafka's default 1000 ms (fetch.queue.backoff.ms):
# reading a 1M-row slice back (63 MB of lz4) took 5.7 s with the default, the client and broker busy for 1.3 CPU-s
# of it, and 1.0 s with this; every long read (progress history, verify, load_input, replay) waited the same way.


def topic_end_offsets(kafka_conf: dict[str, Any], topic: str, timeout: float = 30.0) -> dict[str, int]:
    """Each partition's log end offset (high watermark) now, by partition number as text; {} if no such topic.
    Read uncommitted: read committed, an open transaction of another producer (another table sharing the topic, a
    replay) would hold the answer back at its first message."""
    consumer = _consumer(kafka_conf, "read_uncommitted")
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                meta = consumer.list_topics(topic, timeout=max(1.0, deadline - time.monotonic())).topics.get(topic)
            except KafkaException as exc:
                raise KafkaUnavailable(f"cannot reach Kafka at {kafka_conf.get('bootstrap.servers')}: "
                                       f"{exc.args[0].str()}") from exc
            if meta is None or (meta.error is not None and meta.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
                return {}
            if meta.error is None and meta.partitions:
                break
            if time.monotonic() > deadline:  # a new topic's partitions take a moment to be known
                raise KafkaUnavailable(f"{topic}: no partition metadata on {kafka_conf.get('bootstrap.servers')} "
                                       f"({meta.error})")
            time.sleep(0.2)
        return {str(p): partition_watermarks(consumer, TopicPartition(topic, p), timeout, kafka_conf)[1]
                for p in sorted(meta.partitions)}
    finally:
        consumer.close()
