"""The progress log: every read of a progress topic."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from resources.exactly_once.clients import READ_BATCH, _consumer, base_conf, list_topics
from resources.exactly_once.errors import KafkaUnavailable, RelayError
from resources.exactly_once.records import START_MARK_KEYS, ProgressRecord, TableChannel, live_records, tiling
from resources.names import progress_topic_suffix
from resources.slices import SliceRange


def _read_range(consumer: Consumer, tp: TopicPartition, start: int, end: int, timeout: float
                ) -> Iterator[Any]:
    """Committed messages of one partition with offsets in [start, end), in order."""
    if start >= end:
        return
    # Unassign first: re-assigned at once, librdkafka's position() keeps reporting the end of the consumer's last
    # read for a while (8 times in 10 here), and a read that starts below it would end at once, empty.
    consumer.unassign()
    consumer.assign([TopicPartition(tp.topic, tp.partition, start)])
    deadline = time.monotonic() + timeout
    while True:
        # position() also moves past transaction markers and aborted messages, which take offsets.
        pos = consumer.position([TopicPartition(tp.topic, tp.partition)])[0].offset
        if pos >= end:
            return
        if time.monotonic() > deadline:
            raise KafkaUnavailable(
                f"reading {tp.topic}[{tp.partition}] stalled at offset {pos if pos >= 0 else start} of {end}: a "
                "transaction may be open there (another producer's: a table sharing the topic, a `rowrelay "
                "replay`), holding every read_committed reader until it ends")
        # Batches (one call per message is much slower on a long history); a short wait: the position also moves
        # past markers, which consume never returns.
        for msg in consumer.consume(num_messages=READ_BATCH, timeout=0.02):
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    continue
                raise KafkaUnavailable(f"reading {tp.topic}: {msg.error().str()}")
            if msg.offset() >= end:
                return
            deadline = time.monotonic() + timeout
            yield msg


def read_progress_history(kafka_conf: dict[str, Any], channel: TableChannel, timeout: float = 30.0
                          ) -> list[ProgressRecord]:
    """Every committed progress record of the table still in the (compacted) progress topic, oldest first."""
    consumer = _consumer(kafka_conf)
    try:
        tp = TopicPartition(channel.progress_topic, 0)
        low, high = partition_watermarks(consumer, tp, timeout, kafka_conf)
        return [ProgressRecord.from_json(m.value()) for m in _read_range(consumer, tp, low, high, timeout)]
    finally:
        consumer.close()


_LEADER_MOVING = (KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE)


def partition_watermarks(consumer: Consumer, tp: TopicPartition, timeout: float, kafka_conf: dict[str, Any]
                         ) -> tuple[int, int]:
    """(low, high) offsets of a partition; (0, 0) if its topic does not exist yet.

    Metadata first, with a bounded timeout: after an all-brokers-down error a repeated
    get_watermark_offsets() call was seen to block far past its own timeout.
    """
    bootstrap = kafka_conf.get("bootstrap.servers")
    deadline = time.monotonic() + timeout
    while True:
        md = list_topics(consumer, kafka_conf, tp.topic, timeout=min(10.0, max(1.0, deadline - time.monotonic())))
        topic = md.topics.get(tp.topic)
        if topic is None or (topic.error is not None and topic.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
            return 0, 0
        part = topic.partitions.get(tp.partition)
        if part is None:
            return 0, 0
        if topic.error is None and part.leader >= 0:
            break
        if time.monotonic() > deadline:  # a new topic's leader takes a moment to be known
            raise KafkaUnavailable(f"{tp.topic}[{tp.partition}] has no leader on {bootstrap}")
        time.sleep(0.2)
    while True:
        try:
            return consumer.get_watermark_offsets(tp, timeout=max(1.0, deadline - time.monotonic()))
        except KafkaException as exc:
            # A new topic's leader may be known to the metadata before it serves offsets (NOT_LEADER...).
            if (exc.args[0].retriable() or exc.args[0].code() in _LEADER_MOVING) and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            raise KafkaUnavailable(f"cannot reach Kafka at {bootstrap} to read offsets of {tp.topic}: "
                                   f"{exc.args[0].str()}") from exc


def read_committed_progress(kafka_conf: dict[str, Any], channel: TableChannel, timeout: float = 30.0
                            ) -> ProgressRecord | None:
    """The table's last committed progress record, reading only the tail of its progress topic."""
    consumer = _consumer(kafka_conf)
    try:
        tp = TopicPartition(channel.progress_topic, 0)
        low, high = partition_watermarks(consumer, tp, timeout, kafka_conf)
        return _last_record(consumer, tp, low, high, timeout)
    finally:
        consumer.close()


def progress_under_other_prefix(kafka_conf: dict[str, Any], channel: TableChannel, timeout: float = 30.0
                                ) -> tuple[str, ProgressRecord] | None:
    """A progress topic of the same table under another transactional_id_prefix that holds a committed record:
    (its name, its last record), else None. One listing of the cluster's topics."""
    admin = AdminClient(base_conf(kafka_conf))
    suffix = progress_topic_suffix(channel.table)
    names = sorted(n for n in list_topics(admin, kafka_conf, timeout=timeout).topics
                   if n.startswith("_") and n.endswith(suffix) and n != channel.progress_topic)
    for name in names:
        try:
            record = read_committed_progress(kafka_conf, replace(channel, progress_topic=name), timeout)
        except (KafkaException, RelayError):  # not ours to read (ACLs: another deployment's topic)
            continue
        if record is not None:
            return name, record
    return None


def _last_record(consumer: Consumer, tp: TopicPartition, low: int, high: int, timeout: float
                 ) -> ProgressRecord | None:
    """The last committed progress record in offsets [low, high), read back from the end in growing windows."""
    window = 8
    while True:
        start = max(low, high - window)
        got = _scan(consumer, tp, start, high, timeout)
        if got:
            return got[-1][1]
        if start <= low:
            return None
        window *= 4  # only markers or aborted records at the end: look further back


def _scan(consumer: Consumer, tp: TopicPartition, start: int, end: int, timeout: float,
          stop_at_hi: int | None = None) -> list[tuple[int, ProgressRecord]]:
    """(offset, record) of the committed progress records in [start, end); stops once one reaches `stop_at_hi`."""
    out: list[tuple[int, ProgressRecord]] = []
    for msg in _read_range(consumer, tp, start, end, timeout):
        record = ProgressRecord.from_json(msg.value())
        out.append((msg.offset(), record))
        if stop_at_hi is not None and record.hi >= stop_at_hi:
            break
    return out


class ProgressTopicReader:
    """One table's progress topic read by offsets and by time: what an incremental roll-up reads of it
    (orchestration/compaction.py `read_windows`). A context manager: its consumer is closed at the end."""

    def __init__(self, kafka_conf: dict[str, Any], channel: TableChannel, timeout: float = 30.0) -> None:
        self.kafka_conf, self.timeout = kafka_conf, timeout
        self.tp = TopicPartition(channel.progress_topic, 0)
        self.consumer = _consumer(kafka_conf)

    def __enter__(self) -> ProgressTopicReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.consumer.close()

    def bounds(self) -> tuple[int, int]:
        """(low, high) offsets; (0, 0) if the topic does not exist yet."""
        return partition_watermarks(self.consumer, self.tp, self.timeout, self.kafka_conf)

    def offset_at(self, ms: int) -> int:
        """The first offset produced at or after `ms` (Kafka's time index); -1 if none is that recent."""
        return self.consumer.offsets_for_times([TopicPartition(self.tp.topic, 0, ms)], timeout=self.timeout)[0].offset

    def records(self, start: int, end: int) -> list[ProgressRecord]:
        """The committed progress records at offsets [start, end), parsed, oldest first."""
        return [r for _, r in _scan(self.consumer, self.tp, start, end, self.timeout)]

    def messages(self, start: int, end: int) -> Iterator[Any]:
        """The committed messages at offsets [start, end), not parsed (for a look at keys and values only)."""
        return _read_range(self.consumer, self.tp, start, end, self.timeout)


def read_records(kafka_conf: dict[str, Any], channel: TableChannel, timeout: float = 30.0) -> list[ProgressRecord]:
    """The table's committed progress records, oldest first (a full roll-up pass; incremental ones read by time
    through `ProgressTopicReader`)."""
    with ProgressTopicReader(kafka_conf, channel, timeout) as reader:
        return reader.records(*reader.bounds())


def _resets_after(consumer: Consumer, tp: TopicPartition, start: int, end: int, timeout: float
                  ) -> list[ProgressRecord]:
    """The resets and baselines (records without a range) at offsets [start, end), told by their keys: the other
    records, one per slice, are read but not parsed."""
    return [ProgressRecord.from_json(msg.value()) for msg in _read_range(consumer, tp, start, end, timeout)
            if (msg.key() or b"").startswith(START_MARK_KEYS)]


def _first_at_or_after(consumer: Consumer, tp: TopicPartition, offset: int, end: int, timeout: float
                       ) -> tuple[int, ProgressRecord] | None:
    got = _scan(consumer, tp, offset, end, timeout, stop_at_hi=-(2**63))
    return got[0] if got else None


def records_in_range(kafka_conf: dict[str, Any], channel: TableChannel, rng: SliceRange,
                     timeout: float = 30.0) -> list[ProgressRecord]:
    """The committed progress records that tile `rng` (a slice or roll-up key), in order; [] if the range is not
    exactly covered by committed slices. Progress only grows between resets, so a binary search over the topic's
    offsets finds the first record after `rng.lo` in ~log2(records) reads, then the range is read forward. The rest
    of the topic is looked through by key alone for a later reset back below `rng.hi` (`live_records`: the records
    it superseded are not the range's, even where they tile it); after one, the records from the range on are read
    again; if nothing tiles, the whole topic is scanned."""
    consumer = _consumer(kafka_conf)
    try:
        tp = TopicPartition(channel.progress_topic, 0)
        low, high = partition_watermarks(consumer, tp, timeout, kafka_conf)
        lo_off, hi_off = low, high
        while lo_off < hi_off:  # first offset whose record ends above rng.lo
            mid = (lo_off + hi_off) // 2
            probe = _first_at_or_after(consumer, tp, mid, high, timeout)
            if probe is None:
                hi_off = mid
            elif probe[1].hi <= rng.lo:
                lo_off = probe[0] + 1
            else:
                hi_off = mid
        scanned = _scan(consumer, tp, lo_off, high, timeout, stop_at_hi=rng.hi)
        covered = tiling(rng, live_records(r for _, r in scanned))
        after = scanned[-1][0] + 1 if scanned else lo_off
        if covered is not None and any(r.hi < rng.hi for r in _resets_after(consumer, tp, after, high, timeout)):
            # A reset back below the range's end came after these records: the range is what follows it.
            covered = tiling(rng, live_records(r for _, r in _scan(consumer, tp, lo_off, high, timeout)))
        if covered is None:
            every = live_records(r for _, r in _scan(consumer, tp, low, high, timeout))
            latest = {(r.lo, r.hi): r for r in every}  # a range published again after a reset: its newest record
            covered = tiling(rng, sorted(latest.values(), key=lambda r: r.lo))
        return covered or []
    finally:
        consumer.close()


def tiles_by_range(kafka_conf: dict[str, Any], channel: TableChannel, ranges: list[SliceRange],
                   timeout: float = 30.0) -> dict[SliceRange, list[ProgressRecord]]:
    """The committed records tiling each of `ranges` (slice or roll-up keys; [] for one not covered): one search
    over their whole span when it is tiled (a run's keys are consecutive), else one search per range."""
    if not ranges:
        return {}
    spanned = records_in_range(kafka_conf, channel, ranges[0].span(min(r.lo for r in ranges),
                                                                   max(r.hi for r in ranges)), timeout)
    if spanned:
        return {r: tiling(r, spanned) or [] for r in ranges}
    return {r: records_in_range(kafka_conf, channel, r, timeout) for r in ranges}


# -- the committed progress, read cheaply tick after tick -------------------------------------------------------


class ProgressTail:
    """The table's last committed progress record through one long-lived consumer per process and progress topic.

    `read_committed_progress` makes a consumer, fetches metadata and reads the tail:
    the largest part of an idle sensor tick. Here the consumer stays connected and the tail is read again
    only when the topic's end offset moved: an idle tick asks Kafka one ListOffsets, and between reads
    no partition stays assigned, so nothing is fetched. Same answer: the last committed record, read_committed,
    found by reading back from the end in growing windows."""

    _lock = threading.Lock()
    _instances: dict[tuple[str, str], ProgressTail] = {}

    def __init__(self, kafka_conf: dict[str, Any], topic: str) -> None:
        self.kafka_conf = kafka_conf
        self.tp = TopicPartition(topic, 0)
        self.consumer: Consumer | None = None
        self.lock = threading.Lock()
        self.seen: tuple[int, int] | None = None  # (low, high) when `record` was read
        self.record: ProgressRecord | None = None

    @classmethod
    def for_channel(cls, kafka_conf: dict[str, Any], channel: TableChannel) -> ProgressTail:
        key = (json.dumps(kafka_conf, sort_keys=True, default=str), channel.progress_topic)
        with cls._lock:
            tail = cls._instances.get(key)
            if tail is None:
                tail = cls._instances[key] = cls(kafka_conf, channel.progress_topic)
            return tail

    def read(self, timeout: float = 30.0) -> ProgressRecord | None:
        with self.lock:
            try:
                return self._read(timeout)
            except Exception:
                self._reset()  # a broken connection: the next call starts over with a new consumer
                raise

    def close(self) -> None:
        """Disconnect; a later read connects again."""
        with self.lock:
            self._reset()

    def _reset(self) -> None:
        if self.consumer is not None:
            with contextlib.suppress(Exception):
                self.consumer.close()
        self.consumer, self.seen, self.record = None, None, None

    def _read(self, timeout: float) -> ProgressRecord | None:
        if self.consumer is None:
            self.consumer = _consumer(self.kafka_conf)
        if self.seen is None:  # first read (or after an error): the topic may not exist yet
            low, high = partition_watermarks(self.consumer, self.tp, timeout, self.kafka_conf)
            if (low, high) == (0, 0):
                return None  # no topic or empty: asked again next time (metadata each time until it exists)
        else:
            low, high = self.consumer.get_watermark_offsets(self.tp, timeout=timeout, cached=False)
        if self.seen == (low, high):
            return self.record
        record = _last_record(self.consumer, self.tp, low, high, timeout)
        # Nothing stays assigned between reads: librdkafka fetches an assigned partition again and again in the
        # background, every fetch.wait.max.ms (10 ms) whether anyone polls or not, so an idle sensor's tail would
        # keep the broker busy serving fetches. The next read assigns again (_read_range).
        self.consumer.unassign()
        self.seen, self.record = (low, high), record
        return record


def read_progress_tail(kafka_conf: dict[str, Any], channel: TableChannel, timeout: float = 30.0
                       ) -> ProgressRecord | None:
    """The table's committed progress, as `read_committed_progress`, through the process's long-lived reader."""
    return ProgressTail.for_channel(kafka_conf, channel).read(timeout)


def find_slice_progress(kafka_conf: dict[str, Any], channel: TableChannel, slice_range: SliceRange
                        ) -> ProgressRecord | None:
    """The progress record of exactly this slice (its newest), found by a search over the progress topic rather
    than a read of all history (a long-lived table has hundreds of thousands of records)."""
    tiles = records_in_range(kafka_conf, channel, slice_range)
    return tiles[0] if len(tiles) == 1 and (tiles[0].lo, tiles[0].hi) == (slice_range.lo, slice_range.hi) else None
