"""A table's slice history kept small: which committed slices roll up into one wider partition key, what that key
carries, and the progress records behind any range. Pure planning plus Kafka reads; no Dagster import.

A roll-up key is an ordinary slice key `(lo, hi]` spanning consecutive committed slices, so `SliceRange.from_key`,
re-runs (a committed range publishes nothing) and `reconcile` treat it like any slice. Kafka's progress topic stays
the source of truth: a roll-up's figures are computed from the progress records of its slices, never from Dagster.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from resources.exactly_once import ProgressRecord, TableChannel, base_conf, unreachable
from resources.slices import SliceRange

HOUR_S = 3600.0
DAY_S = 86_400.0


@dataclass(frozen=True)
class HistoryPolicy:
    """Committed slices older than `rollup_after_s` roll up per hour (UTC) of their commit, older than
    `daily_after_s` per day, older than `monthly_after_s` per month (so years of history stay a few hundred keys:
    ~90 daily + ~24 hourly + one per month). None: never roll up."""

    rollup_after_s: float | None = HOUR_S
    daily_after_s: float = DAY_S
    monthly_after_s: float | None = 90 * DAY_S

    def bucket(self, committed_at: datetime, now: datetime) -> str | None:
        """The roll-up bucket of a slice committed at `committed_at`; None while it is too recent."""
        if self.rollup_after_s is None:
            return None
        age = (now - committed_at).total_seconds()
        if age < self.rollup_after_s:
            return None
        if age < max(self.daily_after_s, self.rollup_after_s):
            return committed_at.strftime("h%Y-%m-%dT%H")
        if self.monthly_after_s is None or age < max(self.monthly_after_s, self.daily_after_s):
            return committed_at.strftime("d%Y-%m-%d")
        return committed_at.strftime("m%Y-%m")


@dataclass(frozen=True)
class Rollup:
    """Consecutive partition keys `keys` (each fully covered by committed progress) replaced by one key `range`."""

    range: SliceRange
    keys: list[SliceRange]
    records: list[ProgressRecord] = field(repr=False)
    bucket: str = ""


def parse_time(value: str) -> datetime | None:
    if not value:
        return None
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def tiling(key: SliceRange, records: list[ProgressRecord]) -> list[ProgressRecord] | None:
    """The records that cover `key` exactly, in order, without gap or overlap; None if they do not."""
    out: list[ProgressRecord] = []
    position = key.lo
    for r in records:
        if r.hi <= r.lo or r.lo < key.lo or r.hi > key.hi:
            continue  # baselines/resets (no range) and records outside the key
        if r.lo != position:
            return None
        out.append(r)
        position = r.hi
    return out if position == key.hi and out else None


def plan_rollups(keys: list[SliceRange], records: list[ProgressRecord], now: datetime,
                 policy: HistoryPolicy) -> list[Rollup]:
    """Group consecutive committed keys whose slices share a roll-up bucket (hour, then day, of their newest
    commit) into one roll-up each. `keys`: the table's partition keys; `records`: the committed progress
    records covering (at least) the keys to consider, in commit order. A key not covered exactly by records
    (uncommitted, a gap, a reset inside it, records not read) is never rolled up and ends a group."""
    records = sorted((r for r in records if r.hi > r.lo), key=lambda r: (r.lo, r.hi))
    los = [r.lo for r in records]
    groups: list[tuple[str, list[SliceRange], list[ProgressRecord]]] = []
    current: tuple[str, list[SliceRange], list[ProgressRecord]] | None = None
    for key in sorted(set(keys)):
        start = bisect.bisect_left(los, key.lo)
        end = bisect.bisect_right(los, key.hi - 1)
        covered = tiling(key, records[start:end])
        newest = max((t for r in covered if (t := parse_time(r.committed_at)) is not None),
                     default=None) if covered else None
        bucket = policy.bucket(newest, now) if newest is not None else None
        if covered is None or bucket is None:
            current = None
            continue
        if current is not None and current[0] == bucket and current[1][-1].hi == key.lo:
            current[1].append(key)
            current[2].extend(covered)
        else:
            current = (bucket, [key], list(covered))
            groups.append(current)
    return [Rollup(g[1][0].span(g[1][0].lo, g[1][-1].hi), g[1], g[2], g[0]) for g in groups if len(g[1]) > 1]


def summarize(records: list[ProgressRecord]) -> dict[str, Any]:
    """What a range of committed slices published, from their progress records: the metadata of a roll-up key and
    what `load_input` / a re-run of it needs. The checksum is sha256 over the slices' checksums in order, so it is
    the same however the range was rolled up (hourly then daily, or at once)."""
    ordered = sorted((r for r in records if r.hi > r.lo), key=lambda r: r.lo)
    if not ordered:
        raise ValueError("no slice records to summarize")
    offsets: dict[str, list[int]] = {}
    digest = hashlib.sha256()
    for r in ordered:
        digest.update(r.checksum.encode() + b"\n")
        for partition, (first, last) in r.offsets.items():
            span = offsets.setdefault(str(partition), [first, last])
            span[0], span[1] = min(span[0], first), max(span[1], last)
    times = [r.committed_at for r in ordered if r.committed_at]
    return {"lo": ordered[0].lo, "hi": ordered[-1].hi, "slices": len(ordered), "rows": sum(r.rows for r in ordered),
            "bytes": sum(r.bytes for r in ordered), "topic": ordered[-1].topic,
            "offsets": dict(sorted(offsets.items(), key=lambda kv: int(kv[0]))), "checksum": digest.hexdigest(),
            "first_committed_at": min(times) if times else "", "last_committed_at": max(times) if times else ""}


# -- reading progress records -------------------------------------------------------------------------------


def _reader(kafka_conf: dict[str, Any]) -> Consumer:
    # Same settings as the protocol's readers (resources/exactly_once.py `_consumer`), without a group: assign only.
    return Consumer({**base_conf(kafka_conf), "group.id": "rowrelay-history-reader",
                     "isolation.level": "read_committed", "enable.auto.commit": False,
                     "enable.partition.eof": False, "auto.offset.reset": "earliest", "fetch.wait.max.ms": 10})


def _bounds(consumer: Consumer, tp: TopicPartition, timeout: float, kafka_conf: dict[str, Any]
            ) -> tuple[int, int]:
    try:
        md = consumer.list_topics(tp.topic, timeout=timeout)
    except KafkaException as exc:
        raise unreachable(consumer, kafka_conf, exc.args[0].str()) from exc
    topic = md.topics.get(tp.topic)
    if topic is None or topic.error is not None or tp.partition not in topic.partitions:
        return 0, 0
    return consumer.get_watermark_offsets(tp, timeout=timeout)


def _scan(consumer: Consumer, tp: TopicPartition, start: int, end: int, timeout: float,
          stop_at_hi: int | None = None) -> list[tuple[int, ProgressRecord]]:
    """(offset, record) of committed records in [start, end), in batches (one poll per message is ~10x slower
    on 300k records); stops early once a record reaches `stop_at_hi`."""
    out: list[tuple[int, ProgressRecord]] = []
    if start >= end:
        return out
    consumer.assign([TopicPartition(tp.topic, tp.partition, start)])
    deadline = time.monotonic() + timeout
    while True:
        # position() moves past transaction markers and aborted records too, which never come out of consume().
        if consumer.position([TopicPartition(tp.topic, tp.partition)])[0].offset >= end:
            return out
        if time.monotonic() > deadline:
            raise TimeoutError(f"reading {tp.topic} stalled before offset {end} (an open transaction?)")
        for msg in consumer.consume(num_messages=5000, timeout=0.05):
            if msg.error() or msg.offset() >= end:
                continue
            deadline = time.monotonic() + timeout
            record = ProgressRecord.from_json(msg.value())
            out.append((msg.offset(), record))
            if stop_at_hi is not None and record.hi >= stop_at_hi:
                return out


def read_records(kafka_conf: dict[str, Any], channel: TableChannel, *, since_ms: int | None = None,
                 timeout: float = 30.0) -> list[ProgressRecord]:
    """The table's committed progress records, oldest first; with `since_ms` only those produced at or after that
    time (Kafka's time index on the progress topic: a few days of history, not all of it)."""
    consumer = _reader(kafka_conf)
    try:
        tp = TopicPartition(channel.progress_topic, 0)
        low, high = _bounds(consumer, tp, timeout, kafka_conf)
        start = low
        if since_ms is not None and high > low:
            found = consumer.offsets_for_times([TopicPartition(tp.topic, 0, since_ms)], timeout=timeout)[0].offset
            start = high if found < 0 else max(low, found)  # -1: nothing that recent
        return [r for _, r in _scan(consumer, tp, start, high, timeout)]
    finally:
        consumer.close()


def _first_at_or_after(consumer: Consumer, tp: TopicPartition, offset: int, end: int, timeout: float
                       ) -> tuple[int, ProgressRecord] | None:
    got = _scan(consumer, tp, offset, end, timeout, stop_at_hi=-(2**63))
    return got[0] if got else None


def records_in_range(kafka_conf: dict[str, Any], channel: TableChannel, rng: SliceRange,
                     timeout: float = 30.0) -> list[ProgressRecord]:
    """The committed progress records that tile `rng` (a slice or roll-up key), in order; [] if the range is not
    exactly covered by committed slices. Progress only grows between resets, so a binary search over the topic's
    offsets finds the first record after `rng.lo` in ~log2(records) reads, then the range is read forward; if that
    does not tile (a reset re-published the range), the whole topic is scanned."""
    consumer = _reader(kafka_conf)
    try:
        tp = TopicPartition(channel.progress_topic, 0)
        low, high = _bounds(consumer, tp, timeout, kafka_conf)
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
        found = [r for _, r in _scan(consumer, tp, lo_off, high, timeout, stop_at_hi=rng.hi)]
        covered = tiling(rng, found)
        if covered is None:
            every = [r for _, r in _scan(consumer, tp, low, high, timeout)]
            latest = {(r.lo, r.hi): r for r in every}  # a range published again after a reset: its newest record
            covered = tiling(rng, sorted(latest.values(), key=lambda r: r.lo))
        return covered or []
    finally:
        consumer.close()


# -- the committed progress, read cheaply tick after tick -------------------------------------------------------


class ProgressTail:
    """The table's last committed progress record through one long-lived consumer per process and progress topic.

    `read_committed_progress` (resources/exactly_once.py) makes a consumer, fetches metadata and reads the tail:
    ~60 ms, the largest part of an idle sensor tick. Here the consumer stays connected and the tail is read again
    only when the topic's end offset moved: an idle tick asks Kafka one ListOffsets (~1-2 ms). Same answer: the
    last committed record, read_committed, found by reading back from the end in growing windows."""

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

    def _reset(self) -> None:
        if self.consumer is not None:
            with contextlib.suppress(Exception):
                self.consumer.close()
        self.consumer, self.seen, self.record = None, None, None

    def _read(self, timeout: float) -> ProgressRecord | None:
        if self.consumer is None:
            self.consumer = _reader(self.kafka_conf)
        if self.seen is None:  # first read (or after an error): the topic may not exist yet
            low, high = _bounds(self.consumer, self.tp, timeout, self.kafka_conf)
            if (low, high) == (0, 0):
                return None  # no topic or empty: asked again next time (metadata each time until it exists)
        else:
            low, high = self.consumer.get_watermark_offsets(self.tp, timeout=timeout, cached=False)
        if self.seen == (low, high):
            return self.record
        record, window = None, 8
        while True:
            start = max(low, high - window)
            got = _scan(self.consumer, self.tp, start, high, timeout)
            if got:
                record = got[-1][1]
                break
            if start <= low:
                break
            window *= 4  # only markers or aborted records at the end: look further back
        self.seen, self.record = (low, high), record
        return record


def read_progress_tail(kafka_conf: dict[str, Any], channel: TableChannel, timeout: float = 30.0
                       ) -> ProgressRecord | None:
    """The table's committed progress, as `read_committed_progress`, through the process's long-lived reader."""
    return ProgressTail.for_channel(kafka_conf, channel).read(timeout)
