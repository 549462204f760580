"""The exactly-once protocol between a table's slices and Kafka. Deliberately free of Dagster.

One table has one *channel*: a data topic, a single-partition compacted progress topic of its own and
one stable ``transactional.id``. Publishing a slice is:

1. ``init_transactions()``: takes a new producer epoch for the table. Kafka aborts (or finishes) any
   transaction a previous instance left open and fences that instance: its next produce/commit fails.
2. Read the table's committed progress, read_committed. Because (1) came first, no older transaction of
   ours can still change it, and because the progress topic belongs to this table alone, no other
   table's open transaction holds its last stable offset.
3. Progress already at or beyond the slice's ``hi`` -> the slice is committed: publish nothing.
   Progress not equal to the slice's ``lo`` -> an earlier slice is missing: refuse (slices commit in
   watermark order, so a gap can never be skipped).
4. One transaction: every row of the slice in watermark order, flush, then the progress record (with
   the offsets the rows got), then commit. Rows and progress become visible together or not at all.

A crash anywhere before the commit leaves nothing visible; a crash after it leaves the progress record
saying so, and the retry publishes nothing. Kafka, not the orchestrator, is the record of what was sent.
Any error raised while a transaction is open aborts it before it propagates: an open transaction holds the
topic's last stable offset, so every read_committed reader of the topic would wait for it. A commit that gets no
answer is the exception: neither aborted nor called again, its producer is fenced by a fresh one, and the progress
read after that says whether the slice committed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import uuid
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, OffsetSpec

from resources.arrow_produce import RowProducer
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX, progress_topic_name, progress_topic_suffix
from resources.slices import RowSkip, SliceRange, is_timestamp_key, watermark_text

_log = logging.getLogger(__name__)


_ATTEMPT_NUMBERS = re.compile(r"\b\d+ms\b|(?<=#producer-)\d+|(?<=#consumer-)\d+|(?<=#admin-)\d+|\b\d+(?=/\d+ brokers)")


class _RepeatsDropped(logging.Filter):
    """Drops a line that repeats one let through in the last `window_s` (numbers aside). A broker that is away
    made every client log each reconnect attempt: ~390 lines in 11 s before the one error that says what is wrong."""

    def __init__(self, window_s: float = 30.0) -> None:
        super().__init__()
        self.window_s = window_s
        self.seen: dict[str, float] = {}
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        # Numbers that change from one attempt to the next only (a table or host name keeps its digits).
        key = _ATTEMPT_NUMBERS.sub("#", f"{record.name} {record.getMessage()}")
        now = time.monotonic()
        with self.lock:
            if now - self.seen.get(key, float("-inf")) < self.window_s:
                return False
            if len(self.seen) > 1000:  # many distinct lines: forget the old ones
                self.seen = {k: t for k, t in self.seen.items() if now - t < self.window_s}
            self.seen[key] = now
            return True


_log.addFilter(_RepeatsDropped())
# librdkafka's own log lines (connection failures and the like), through Python logging with the same filter: a
# client with an error_cb still logs each failed connect itself.
_librdkafka_log = logging.getLogger("rowrelay.librdkafka")
_librdkafka_log.addFilter(_RepeatsDropped())


class RelayError(Exception):
    """Base class: a slice could not be published. The message says what to do."""


class SliceOutOfOrder(RelayError):
    """The slice does not start where the table's committed progress ends."""

    @classmethod
    def at(cls, table: str, slice_range: SliceRange, committed_hi: int, then: str = "") -> SliceOutOfOrder:
        """Why the slice cannot commit where the progress ends: a gap before it, or progress inside it."""
        at = watermark_text(committed_hi, slice_range.timestamps)
        if committed_hi < slice_range.lo:
            return cls(f"{table}: slice {slice_range} cannot commit yet: committed progress ends at {at}, "
                       f"so the slice ({at}, {watermark_text(slice_range.lo, slice_range.timestamps)}] must commit "
                       f"first{then}")
        return cls(f"{table}: slice {slice_range} can never commit as cut: committed progress ends at {at}, "
                   "inside it (a reset, or a racing cut); the sensor or the next `rowrelay backfill` deletes it and "
                   f"cuts the range again from {at} once no run of the table is active")


class PublisherFenced(RelayError):
    """A newer publisher took over this table's transactional id; this one must stop."""


def skip_advice(entry: str) -> str:
    """How a stop message tells a user to leave a row out: the one place its wording lives (`BadRowError.naming`
    finds it by this text)."""
    return f"leave the row out with skip_watermarks: [{entry}]"


class BadRowError(RelayError):
    """A row cannot be sent (too large, unserializable). Nothing of the slice is visible.

    `entry`: the skip_watermarks entry the message suggests (`skip_advice`), by the row's watermark alone; the
    table's run names the row itself where others share its watermark (`naming`). `value`: the row's message, where
    known (a row too large), so that its tie_break or key can be read from it; `tie`: its tie_break's text, where
    the read that stopped at it named it."""

    def __init__(self, message: str, *, table: str, watermark: int | None, column: str | None = None,
                 entry: str | None = None, value: bytes | None = None, tie: str | None = None) -> None:
        super().__init__(message)
        self.table = table
        self.watermark = watermark
        self.column = column
        self.entry = entry
        self.value = value
        self.tie = tie

    def naming(self, advice: str) -> BadRowError:
        """The same error, its skip advice replaced by `advice` (one that names the row, not only its value)."""
        if self.entry is None or skip_advice(self.entry) not in str(self):
            return self
        return BadRowError(str(self).replace(skip_advice(self.entry), advice), table=self.table,
                           watermark=self.watermark, column=self.column, entry=self.entry, value=self.value,
                           tie=self.tie)


class SliceRowsMismatch(RelayError):
    """The rows read for a slice are not the rows the source counts in it: the read lost or gained rows, so the
    slice is aborted before its progress record. Nothing of it is visible and progress does not move."""


class KafkaUnavailable(RelayError):
    """Transient: the broker did not answer in time. Retrying later is safe."""


class ProducerSettingsError(RelayError):
    """The producer settings (kafka.producer) cannot work; a retry fails the same way until they are changed."""


class KafkaAuthenticationError(ProducerSettingsError):
    """The broker refused the client's login (SASL credentials, mechanism, TLS settings): not transient."""


class TransactionTimedOut(RelayError):
    """The slice's transaction outlived transaction.timeout.ms: Kafka aborted it. Nothing of it is visible."""


class ProgressMissing(RelayError):
    """The table's committed progress is empty, yet its data topic already holds its messages."""

    def __init__(self, message: str, *, table: str, topic_watermark: int) -> None:
        super().__init__(message)
        self.table = table
        self.topic_watermark = topic_watermark  # the highest watermark of the table already in the topic


class SliceMessagesGone(RelayError):
    """A committed slice's recorded offsets hold other messages of its table: its data topic was re-created."""


class BaselineMissing(RelayError):
    """A `start_after: latest` table has no baseline in its progress yet: a slice cut before it (under another
    `start_after`) would send the history `latest` skips."""


class ProgressShared(RelayError):
    """The table's progress moved to another topic and back: two deployments share it under one
    transactional_id_prefix, each skipping the rows the other sent."""


class WatermarkChanged(RelayError):
    """The table's watermark is another column, or another kind of column, than the one its committed progress was
    measured in: the progress value would be read in another sense, sending rows again or skipping rows for good."""


def message_watermark(msg: Any) -> int | None:
    """A published message's watermark, from its `rowrelay.watermark` header; None without one."""
    value = next((v for k, v in msg.headers() or () if k == WATERMARK_HEADER), None)
    return None if value is None else int(value)


@dataclass(frozen=True)
class TableChannel:
    """Where one table's rows and progress go in Kafka."""

    table: str  # "<source>.<schema>.<table>", the table's identity
    topic: str
    progress_topic: str
    transactional_id: str
    start_after: int = 0  # watermark below which nothing is ever published
    topic_partitions: int = 1
    replication_factor: int = -1  # -1: the broker's default
    keyed: bool = True  # the table's messages carry a key (`key:` other than none)
    # `start_after: latest`: nothing is published over empty progress; a baseline is recorded first
    # (`publish_baseline`), and `start_after` (0) means nothing then.
    baseline_required: bool = False
    shared_with: tuple[str, ...] = ()  # the other tables of the deployment that write to `topic`

    @classmethod
    def for_table(cls, table: str, topic: str, *, start_after: int = 0, topic_partitions: int = 1,
                  replication_factor: int = -1, prefix: str = DEFAULT_TRANSACTIONAL_ID_PREFIX, keyed: bool = True,
                  baseline_required: bool = False, shared_with: tuple[str, ...] = ()) -> TableChannel:
        return cls(table=table, topic=topic, progress_topic=progress_topic_name(prefix, table),
                   transactional_id=f"{prefix}.{table}", start_after=start_after,
                   topic_partitions=topic_partitions, replication_factor=replication_factor, keyed=keyed,
                   baseline_required=baseline_required, shared_with=shared_with)


@dataclass(frozen=True)
class OutgoingMessage:
    key: bytes | None
    value: bytes
    watermark: int


_U32 = next(code for code in "IL" if array(code).itemsize == 4)  # an unsigned 32-bit array typecode


# Arrow's variable-size binary layouts: their offsets' type (Spark returns the large ones where
# spark.sql.execution.arrow.useLargeVarTypes is set).
_OFFSET_TYPES = {pa.binary(): np.int32, pa.string(): np.int32, pa.large_binary(): np.int64,
                 pa.large_string(): np.int64}


class SliceDigest:
    """A slice's checksum, fed with its message values batch by batch in watermark order: the sha256 of two sha256
    digests, of the values concatenated and of their lengths (unsigned 32-bit little-endian), so any split of the
    same bytes into other values gives another checksum.

    Two hashes over whole batches, not one per row: hashlib releases the GIL for large inputs and uses the CPU's
    SHA instructions, where a per-row sha256 in Spark cost about a seventh of its CPU per slice."""

    def __init__(self) -> None:
        self._values, self._lengths = hashlib.sha256(), hashlib.sha256()

    def update(self, values: Sequence[bytes]) -> None:
        self._values.update(b"".join(values))
        lengths = array(_U32, map(len, values))
        if sys.byteorder == "big":
            lengths.byteswap()
        self._lengths.update(lengths)

    def update_arrow(self, values: pa.Array) -> None:
        """`update` from an Arrow binary or string array, straight from its buffers where it can (no nulls)."""
        offset_type = _OFFSET_TYPES.get(values.type)
        if offset_type is None or values.null_count:
            self.update(values.to_pylist())  # other layouts (views), or a null value: refused as `update` does
            return
        _, offsets_buffer, data = values.buffers()
        offsets = np.frombuffer(offsets_buffer, dtype=offset_type, count=len(values) + 1,
                                offset=np.dtype(offset_type).itemsize * values.offset)
        if data is not None:
            self._values.update(memoryview(data)[offsets[0]:offsets[-1]])
        self._lengths.update(np.diff(offsets).astype("<u4").tobytes())

    def hexdigest(self) -> str:
        return hashlib.sha256(self._values.digest() + self._lengths.digest()).hexdigest()


def slice_checksum(values: Iterable[bytes]) -> str:
    """The checksum of a slice whose message values, in watermark order, are `values` (what a consumer computes
    to check a slice from its messages alone)."""
    digest = SliceDigest()
    digest.update(list(values))
    return digest.hexdigest()


class MessageBatch:
    """A run of messages in watermark order, as Arrow columns: key (binary; null: no key), value (binary),
    watermark (int64) and watermark_text (binary: the watermark header's value, str(watermark).encode()). The
    publisher produces them from the buffers (resources/arrow_produce.py): no Python object per row, except for
    the few rows it produces through confluent-kafka."""

    def __init__(self, keys: pa.Array, values: pa.Array, watermarks: pa.Array, watermark_texts: pa.Array) -> None:
        self.keys, self.values, self.watermarks, self.watermark_texts = keys, values, watermarks, watermark_texts

    @classmethod
    def of(cls, messages: Sequence[OutgoingMessage]) -> MessageBatch:
        return cls(keys=pa.array([m.key for m in messages], pa.binary()),
                   values=pa.array([m.value for m in messages], pa.binary()),
                   watermarks=pa.array([m.watermark for m in messages], pa.int64()),
                   watermark_texts=pa.array([str(m.watermark).encode() for m in messages], pa.binary()))

    @classmethod
    def from_arrow(cls, batch: pa.RecordBatch) -> MessageBatch:
        column = batch.column
        return cls(column("key"), column("value"), column("watermark"), column("watermark_text"))

    def __len__(self) -> int:
        return len(self.values)

    def watermark_bounds(self) -> tuple[int, int]:
        import pyarrow.compute as pc

        bounds = pc.min_max(self.watermarks).as_py()
        return bounds["min"], bounds["max"]

    def sizes(self) -> np.ndarray:
        """Bytes of each row's key and value (as the producer's message.max.bytes counts them)."""
        import pyarrow.compute as pc

        keys = pc.binary_length(self.keys).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        return keys + pc.binary_length(self.values).to_numpy(zero_copy_only=False).astype(np.int64)

    def rows(self, start: int, stop: int) -> Iterator[tuple[bytes | None, bytes, int, bytes]]:
        """Rows [start, stop) as Python objects (key, value, watermark, watermark text)."""
        n = max(0, stop - start)
        return zip(self.keys.slice(start, n).to_pylist(), self.values.slice(start, n).to_pylist(),
                   self.watermarks.slice(start, n).to_pylist(), self.watermark_texts.slice(start, n).to_pylist(),
                   strict=True)


# Progress records of no range, keyed by these prefixes (`publish_baseline`, `publish_reset`): where a table starts
# sending, not a slice that published rows.
BASELINE_PREFIX, RESET_PREFIX = "baseline-", "reset-"
START_MARK_PREFIXES = (BASELINE_PREFIX, RESET_PREFIX)
START_MARK_KEYS = tuple(prefix.encode() for prefix in START_MARK_PREFIXES)  # as progress messages' keys


@dataclass
class ProgressRecord:
    """What one committed transaction published; the last one is the table's committed progress."""

    table: str
    slice: str
    lo: int
    hi: int
    rows: int
    bytes: int
    checksum: str
    topic: str
    offsets: dict[str, list[int]] = field(default_factory=dict)  # partition -> [first, last]
    transactional_id: str = ""
    committed_at: str = ""
    transaction_s: float = 0.0  # begin of the slice's transaction -> its progress record, just before the commit
    reset_reason: str = ""  # set on a deliberate new baseline (publish_reset) or an accepted schema change
    # The columns the slice was read with ([name, type] pairs) and their fingerprint: how the next run tells a
    # column added, dropped or retyped since (on_schema_change). Empty on records of older versions.
    columns: list[list[str]] = field(default_factory=list)
    schema_fingerprint: str = ""
    # On a reset: the data topic's end offset per partition once the reset had fenced the table's publisher ({}:
    # no topic yet). Messages below them were sent before the reset (`rowrelay verify` leaves those at or below the
    # reset out). None on other records, and on resets recorded by versions before it.
    topic_ends: dict[str, int] | None = None
    # The row filter the slice was read with: `where:` ("" none) and the `skip_watermarks` entries inside it
    # (`RowSkip.to_record`), so that `rowrelay verify` expects each slice's rows as chosen then, not by today's
    # settings; and how many rows those entries left out. None on older records.
    where: str | None = None
    skipped: list[int | dict[str, Any]] | None = None
    skipped_rows: int | None = None
    # The watermark the progress is a value of: its column and kind (integer | timestamp | timestamptz). A value of
    # one column says nothing about another, and a zone-less time is another instant once its column holds instants
    # (`watermark_change`). None on records of older versions, and on a reset made while the source was away.
    watermark: str | None = None
    watermark_kind: str | None = None

    def row_filter(self, where: str | None, skip: Sequence[RowSkip]) -> tuple[str, list[RowSkip]]:
        """The `where:` ("" none) and skipped rows that chose this slice's rows: as recorded, else (a record of an
        older version) today's `where` and the `skip` entries inside the slice."""
        if self.where is not None:
            return self.where, [RowSkip.from_record(v) for v in self.skipped or []]
        return where or "", [s for s in skip if self.lo < s.watermark <= self.hi]

    @property
    def is_start_mark(self) -> bool:
        """A baseline or a reset: where the table starts sending, not a slice."""
        return self.slice.startswith(START_MARK_PREFIXES)

    @property
    def hi_text(self) -> str:
        """The record's upper watermark as a user writes it (`rowrelay reset --after`): an integer or a UTC time."""
        return watermark_text(self.hi, is_timestamp_key(self.slice))

    def to_json(self) -> bytes:
        # A shallow dict: the fields are JSON values already, and `asdict` deep-copied each of them first (a
        # 300k-slice history seed spent about half its time there).
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ProgressRecord:
        # Unknown keys are a newer version's fields: ignored, so records stay readable across versions.
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(raw).items() if k in known})

    @property
    def slice_range(self) -> SliceRange:
        return SliceRange(self.lo, self.hi, timestamps=is_timestamp_key(self.slice))


KIND_TEXTS = {"integer": "an integer column", "timestamp": "a timestamp without time zone",
              "timestamptz": "a timestamp with time zone"}


def recorded_watermark_kind(record: ProgressRecord) -> str | None:
    """The kind of watermark `record`'s progress is a value of: as recorded, else (a record of an older version)
    "integer" or "timestamp" from a slice's key (which of the two timestamp kinds it cannot tell; baselines and
    resets have integer keys either way), else None."""
    if record.watermark_kind is not None:
        return record.watermark_kind
    if record.hi > record.lo and not record.is_start_mark:
        return "timestamp" if is_timestamp_key(record.slice) else "integer"
    return None


def watermark_change(record: ProgressRecord, column: str, kind: str) -> str | None:
    """Why the table's committed progress (`record`) cannot be read as a value of watermark `column` of `kind`, or
    None if it can (the same column and kind, or nothing recorded to compare with)."""
    recorded = recorded_watermark_kind(record)
    moved = record.watermark is not None and record.watermark != column
    # An older record knows integer from timestamp only (by its key), not the two timestamp kinds apart.
    retyped = recorded is not None and recorded != kind and not (
        record.watermark_kind is None and {recorded, kind} <= {"timestamp", "timestamptz"})
    if not (moved or retyped):
        return None
    table, at = record.table, watermark_text(record.hi, (recorded or kind) != "integer")
    fix = f"`rowrelay reset --table {table} --after W`"
    if moved:
        return (f"{table}: its committed progress ({at}) is a value of watermark column {record.watermark!r}, but "
                f"the table's watermark is now {column!r}: a value of one column says nothing about another, so "
                "relaying on would send rows again or skip rows for good. Nothing was cut or sent. Put "
                f"`watermark: {record.watermark}` back, or set where {column!r} stands deliberately with {fix}, W "
                f"being the highest {column} among the rows already sent (those whose {record.watermark} is at most "
                f"{at}): rows with {column} at or below W are then never sent, the rows above it once")
    same = (" (if the database and its writers keep UTC, W is the progress itself)"
            if {recorded, kind} == {"timestamp", "timestamptz"} else "")
    return (f"{table}: its committed progress ({at}) was recorded while watermark column {column!r} was "
            f"{KIND_TEXTS.get(recorded, recorded)}, but it is now {KIND_TEXTS.get(kind, kind)}: the same progress "
            "means another value now (a time without zone written in a zone other than UTC is another instant), "
            "so relaying on could skip rows for good or send them again. Nothing was cut or sent. Check the "
            f"column's values around the progress, then set it deliberately with {fix}, W being the last value "
            f"already sent as the column holds it now{same}")


def refuse_watermark_change(record: ProgressRecord | None, watermark: tuple[str, str]) -> None:
    """Raise WatermarkChanged where the committed progress (`record`; None: none yet) is not a value of `watermark`
    (column, kind): the cut, the publish, `verify` and the lag all stop there, before reading in another sense."""
    if record is not None and (why := watermark_change(record, *watermark)):
        raise WatermarkChanged(why)


def watermark_fields(watermark: tuple[str, str] | None) -> dict[str, str]:
    """A progress record's `watermark` and `watermark_kind` from (column, kind); none when not known."""
    return {} if watermark is None else {"watermark": watermark[0], "watermark_kind": watermark[1]}


class ResetOutcome(NamedTuple):
    record: ProgressRecord  # the reset's own progress record, committed
    replaced: ProgressRecord | None  # the table's progress just before it (None: it had none)


@dataclass
class PublishResult:
    progress: ProgressRecord
    already_committed: bool
    duration_s: float
    attempts: int = 1
    phases: dict[str, float] = field(default_factory=dict)  # read_s, produce_s, flush_s, commit_s (last attempt)

    @property
    def rows_per_s(self) -> float:
        return self.progress.rows / self.duration_s if self.duration_s > 0 and not self.already_committed else 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.progress.bytes / self.duration_s if self.duration_s > 0 and not self.already_committed else 0.0


# The message contract's headers (docs/messages.md; resources/native/produce_rows.c writes the same two, which
# tests/test_arrow_produce.py checks byte for byte), and the mark `rowrelay replay` adds to its copies.
TABLE_HEADER, WATERMARK_HEADER, REPLAY_HEADER = "rowrelay.table", "rowrelay.watermark", "rowrelay.replay"

# A stage hook lets tests pause or crash the publisher at exact points of the protocol.
StageHook = Callable[[str], None]
STAGES = ("initialized", "progress_read", "begun", "rows_produced", "flushed", "before_commit", "committed")


def env_failpoint(stage: str) -> None:
    """Fault injection for crash tests: ROWRELAY_FAILPOINT=<stage> kills this process at that stage;
    ROWRELAY_FAILPOINT=stop:<stage> freezes it there (SIGSTOP) until someone sends SIGCONT: a zombie;
    ROWRELAY_FAILPOINT=sleep:<stage>:<seconds> holds it there (a slow slice)."""
    target = os.environ.get("ROWRELAY_FAILPOINT")
    if not target:
        return
    if target.startswith(f"sleep:{stage}:"):
        time.sleep(float(target.rsplit(":", 1)[1]))
    elif target == stage:
        os.kill(os.getpid(), signal.SIGKILL)
    elif target == f"stop:{stage}":
        os.kill(os.getpid(), signal.SIGSTOP)


DEFAULT_TRANSACTION_TIMEOUT_MS = 600_000
_TRANSACTION_TIMEOUT_RANGE = (1000, 2**31 - 1)  # librdkafka's limits for transaction.timeout.ms


def transaction_timeout_ms(kafka_conf: dict[str, Any]) -> int:
    """The effective transaction.timeout.ms: the producer settings' value, else the default (10 minutes)."""
    raw = kafka_conf.get("transaction.timeout.ms")
    if raw is None:
        return DEFAULT_TRANSACTION_TIMEOUT_MS
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ProducerSettingsError(
            f"kafka.producer: transaction.timeout.ms must be a whole number of milliseconds, got {raw!r}") from None
    low, high = _TRANSACTION_TIMEOUT_RANGE
    if not low <= value <= high:
        raise ProducerSettingsError(
            f"kafka.producer: transaction.timeout.ms is {value}, outside the range {low}..{high} ms")
    return value


_broker_max_timeout_ms: dict[str, int | None] = {}  # bootstrap.servers -> transaction.max.timeout.ms


def broker_max_transaction_timeout_ms(kafka_conf: dict[str, Any], timeout: float = 10.0) -> int | None:
    """The brokers' transaction.max.timeout.ms (read once per process and bootstrap); None if unreadable."""
    bootstrap = str(kafka_conf.get("bootstrap.servers"))
    if bootstrap in _broker_max_timeout_ms:
        return _broker_max_timeout_ms[bootstrap]
    value: int | None = None
    try:
        admin = AdminClient(base_conf(kafka_conf))
        # DescribeCluster names the brokers without a metadata answer for every topic of the cluster.
        nodes = admin.describe_cluster(request_timeout=timeout).result(timeout=timeout).nodes
        broker = ConfigResource(ConfigResource.Type.BROKER, str(min(n.id for n in nodes)))
        entry = admin.describe_configs([broker], request_timeout=timeout)[broker].result(timeout=timeout).get(
            "transaction.max.timeout.ms")
        value = int(entry.value) if entry is not None and entry.value is not None else None
    except Exception:  # noqa: BLE001 - e.g. no DescribeConfigs permission: skip the check, the broker enforces it
        value = None
    _broker_max_timeout_ms[bootstrap] = value
    return value


def _fatal_message(err: KafkaError) -> str:
    return f"{err.name()}: {err.str()}"


def _is_fenced(err: KafkaError) -> bool:
    return err.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH)


def largest_field(value: bytes) -> str | None:
    """The field of a JSON message whose value takes the most bytes: names the column behind a too-large row."""
    try:
        obj = json.loads(value)
    except ValueError:
        return None
    if isinstance(obj, dict) and isinstance(obj.get("data"), dict) and "op" in obj:
        obj = obj["data"]  # envelope
    if not isinstance(obj, dict) or not obj:
        return None
    return max(obj, key=lambda k: len(json.dumps(obj[k])))


def _column_hint(value: bytes | None) -> tuple[str | None, str]:
    column = largest_field(value) if value is not None else None
    return column, (f", mostly column {column!r}" if column else "")


class _AbortAndRedo(Exception):
    """Internal: the transaction must be aborted and the slice sent again."""


class _CommitUnknown(Exception):
    """Internal: commit_transaction failed without telling whether the transaction committed (`outcome_unknown`)."""


# The last refused login per bootstrap address. librdkafka reports a failed SASL/TLS login only to error_cb
# (served by poll()); the call that needed the broker just times out as "Broker transport failure".
_auth_failures: dict[str, str] = {}


def _error_cb(bootstrap: str) -> Callable[[KafkaError], None]:
    def note(err: KafkaError) -> None:
        if err.code() == KafkaError._AUTHENTICATION:
            _auth_failures[bootstrap] = err.str()
        else:  # with an error_cb set librdkafka no longer logs its errors itself
            _log.warning("kafka client at %s: %s", bootstrap, err.str())
    return note


def with_error_cb(conf: dict[str, Any]) -> dict[str, Any]:
    """A client's settings plus the error_cb `unreachable` reads (unless the caller set its own)."""
    return {"error_cb": _error_cb(str(conf.get("bootstrap.servers"))), "logger": _librdkafka_log, **conf}


def unreachable(client: Any, kafka_conf: dict[str, Any], what: str) -> RelayError:
    """The error for a broker call that failed: a refused login names authentication (never the password: the
    message is librdkafka's); anything else is KafkaUnavailable (transient)."""
    bootstrap = str(kafka_conf.get("bootstrap.servers"))
    with contextlib.suppress(Exception):
        client.poll(0)  # serve error_cb
    refused = _auth_failures.pop(bootstrap, None)
    if refused is not None:
        return KafkaAuthenticationError(
            f"Kafka at {bootstrap} refused the login: {refused}. Check kafka.producer security.protocol, "
            "sasl.mechanism, sasl.username, sasl.password and ssl.ca.location")
    return KafkaUnavailable(f"cannot reach Kafka at {bootstrap}: {what}")


def list_topics(client: Any, kafka_conf: dict[str, Any], topic: str | None = None, timeout: float = 10.0) -> Any:
    """client.list_topics(topic), asked in steps of a second: a refused login fails within about a second, not
    after the whole timeout (librdkafka notes it within ~0.3 s, but only to error_cb). Other failures, e.g. a
    broker that is away, still wait out `timeout`."""
    bootstrap = str(kafka_conf.get("bootstrap.servers"))
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.list_topics(topic, timeout=min(1.0, max(0.1, deadline - time.monotonic())))
        except KafkaException as exc:
            # Serve error_cb; never on a consumer with partitions assigned, where poll() would take a message.
            if not isinstance(client, Consumer) or not client.assignment():
                with contextlib.suppress(Exception):
                    client.poll(0)
            if bootstrap in _auth_failures or time.monotonic() >= deadline:
                raise unreachable(client, kafka_conf, exc.args[0].str()) from exc


def base_conf(kafka_conf: dict[str, Any]) -> dict[str, Any]:
    """Client settings shared by producer, consumer and admin (bootstrap, security); producer-only keys dropped."""
    shared_prefixes = ("bootstrap.servers", "security.", "sasl.", "ssl.", "client.", "socket.", "broker.",
                       "metadata.", "reconnect.", "log_level", "debug", "logger")
    return with_error_cb({k: v for k, v in kafka_conf.items() if k.startswith(shared_prefixes)})


def _topic_metadata(admin: AdminClient, kafka_conf: dict[str, Any], topics: list[str], timeout: float
                    ) -> dict[str, Any]:
    """Metadata of `topics` that exist, asked topic by topic: the cost of a whole-cluster answer grows with every
    topic of the cluster (2,500 here after the test suite: ~10 ms of client and broker CPU per answer)."""
    found = {}
    for name in topics:
        topic = list_topics(admin, kafka_conf, name, timeout=timeout).topics.get(name)
        code = topic.error.code() if topic is not None and topic.error is not None else None
        if topic is None or code == KafkaError.UNKNOWN_TOPIC_OR_PART:
            continue  # missing
        if code == KafkaError.TOPIC_AUTHORIZATION_FAILED:
            raise RelayError(f"not authorized to describe topic {name}: {topic.error.str()}")
        found[name] = topic  # present, possibly still without a leader (LEADER_NOT_AVAILABLE)
    return found


class TopicSettingsError(RelayError):
    """A topic that exists with settings the table cannot be relayed with; a retry fails the same way."""


@dataclass(frozen=True)
class TopicsReady:
    """What `ensure_topics` found: the data topic's partition count and, where readable, its max.message.bytes."""

    partitions: int
    max_message_bytes: int | None = None


# Existing topics found fit (and the data topic's max.message.bytes), per process: an early read and the run it
# feeds, seconds apart, check them once.
_TOPICS_FIT: dict[tuple[str, str, str, bool], tuple[float, int | None]] = {}
TOPICS_FIT_TTL_S = 60.0


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
    if hit is not None and time.monotonic() - hit[0] < TOPICS_FIT_TTL_S and len(existing) == 2:
        ready = TopicsReady(partitions, hit[1])
    else:
        ready = TopicsReady(partitions, _check_existing_topics(
            admin, channel, existing, timeout, str(kafka_conf.get("bootstrap.servers", "<broker:port>"))))
        if len(existing) == 2:
            _TOPICS_FIT[memo] = (time.monotonic(), ready.max_message_bytes)
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
FAST_READS = {"fetch.queue.backoff.ms": 10}


def _consumer(kafka_conf: dict[str, Any], isolation_level: str = "read_committed") -> Consumer:
    return Consumer({**base_conf(kafka_conf), "group.id": f"rowrelay-reader-{uuid.uuid4().hex}",
                     "isolation.level": isolation_level, "enable.auto.commit": False,
                     "enable.partition.eof": False, "auto.offset.reset": "earliest",
                     # Short fetch waits: a read ends at a transaction marker, which only a further fetch skips.
                     "fetch.wait.max.ms": 10, **FAST_READS})


READ_BATCH = 5000


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
        # Batches (one call per message is ~10x slower on a long history); a short wait: the position also moves
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
    (its name, its last record), else None. One listing of the cluster's topics (~10 ms with 2,500 topics)."""
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


def live_records(history: Iterable[ProgressRecord]) -> list[ProgressRecord]:
    """The records of `history` (in the progress topic's order) that still stand. A record without a range (a reset
    or baseline to `a`) supersedes every earlier slice whose range ends above `a`: after a reset back, those rows
    are published again under new records (a re-created table's new rows, perhaps cut differently), so the old
    records must never be taken for the range (replay, loading a slice, the parity check). A reset forward, a
    baseline or an accepted schema change supersedes nothing (progress was at or below it)."""
    out: list[ProgressRecord] = []
    for record in history:
        if record.hi <= record.lo:
            out = [r for r in out if r.hi <= record.hi or r.hi <= r.lo]
        out.append(record)
    return out


@dataclass(frozen=True)
class LivePiece:
    """A committed range (lo, hi] still standing: a slice's messages, all of them, or, where a reset back landed
    inside the slice, only those at or below the reset (`hi` below the record's): the rows above were sent again
    by the slices cut after it."""

    record: ProgressRecord
    lo: int
    hi: int

    @property
    def key(self) -> str:
        """The piece as a slice key: the slice's own, or, cut by a reset, the partition the reset kept of it."""
        if self.hi == self.record.hi:
            return self.record.slice
        return SliceRange(self.lo, self.hi, is_timestamp_key(self.record.slice)).key


def live_pieces(history: Iterable[ProgressRecord]) -> list[LivePiece]:
    """`live_records` as ranges (replay serves them): the committed ranges still standing, in the progress topic's
    order. A reset (or baseline) to `a` supersedes the ranges above it, as there, but a slice (lo, hi] with
    lo < a < hi keeps its part (lo, a]: those rows were published by it and count as sent, and no later slice sends
    them again."""
    pieces: list[LivePiece] = []
    for record in history:
        if record.hi > record.lo:
            pieces.append(LivePiece(record, record.lo, record.hi))
            continue
        at = record.hi
        pieces = [p if p.hi <= at else LivePiece(p.record, p.lo, at) for p in pieces if p.lo < at]
    return pieces


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


# -- searching the progress topic: ranges, recent records, the tail tick after tick ---------------------------


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
    (orchestration/history.py `read_windows`). A context manager: its consumer is closed at the end."""

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
    ~60 ms, the largest part of an idle sensor tick. Here the consumer stays connected and the tail is read again
    only when the topic's end offset moved: an idle tick asks Kafka one ListOffsets (~1-2 ms), and between reads
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
        # background, every fetch.wait.max.ms (10 ms) whether anyone polls or not, so one idle sensor's tail kept
        # ~100 fetches a second and ~2 % of a core busy on the broker. The next read assigns again (_read_range).
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


def table_message_watermark(headers: list[tuple[str, bytes]] | None, table: bytes) -> tuple[bool, int | None]:
    """Whether the table's publisher sent the message (its `rowrelay.table` header, and not a `rowrelay replay`
    copy), and its watermark (None without a `rowrelay.watermark` header): one pass over the headers, as this runs
    per message of every read-back."""
    own, wm = False, None
    for key, value in headers or ():
        if key == REPLAY_HEADER:
            return False, None
        if key == TABLE_HEADER:
            own = value == table
        elif key == WATERMARK_HEADER and value:
            wm = int(value)
    return own, wm


def messages_gone(record: ProgressRecord, offset: int, partition: int | str, wm: int) -> SliceMessagesGone:
    return SliceMessagesGone(
        f"{record.table}: the table's message at offset {offset} of {record.topic} partition {partition} has "
        f"watermark {wm}, outside slice {record.slice}, whose progress record names that offset: the topic no longer "
        "holds the slice's messages (deleted and re-created, or its log truncated), so they cannot be read back by "
        "their offsets. Nothing was read for it. `rowrelay verify` compares the topic with the source; to send the "
        "rows again, see docs/operations.md (\"The data topic was deleted\")")


@contextlib.contextmanager
def slice_reader(kafka_conf: dict[str, Any]) -> Iterator[Consumer]:
    """One read_committed consumer for reading back many slices (`read_back_slices`)."""
    consumer = _consumer(kafka_conf)
    try:
        yield consumer
    finally:
        consumer.close()


def read_published_messages(kafka_conf: dict[str, Any], record: ProgressRecord, timeout: float = 30.0,
                            consumer: Consumer | None = None) -> Iterator[Any]:
    """The messages one committed slice published, read_committed, by its recorded offsets. Within those offsets a
    shared partition may also hold other tables' messages, and a replay into the table's own topic its copies:
    only the slice's own messages are yielded. `consumer`: one of `slice_reader`'s (kept open), else its own."""
    table = record.table.encode()
    own = consumer is None
    consumer = _consumer(kafka_conf) if consumer is None else consumer
    try:
        for partition, (first, last) in sorted(record.offsets.items(), key=lambda kv: int(kv[0])):
            tp = TopicPartition(record.topic, int(partition))
            for m in _read_range(consumer, tp, first, last + 1, timeout):
                mine, wm = table_message_watermark(m.headers(), table)
                if not mine:
                    continue
                if wm is not None and not record.lo < wm <= record.hi:
                    raise messages_gone(record, m.offset(), partition, wm)
                yield m
    finally:
        if own:
            consumer.close()


@dataclass(frozen=True)
class PublishedSlice:
    """A committed slice as its consumers see it: its own messages read back by its record's offsets."""

    rows: int
    # Of their values in watermark order (`slice_checksum`); None where that order cannot be told from the topic:
    # one watermark value in several partitions (a tie_break table on a multi-partition topic).
    checksum: str | None


def pieces_in_range(kafka_conf: dict[str, Any], channel: TableChannel, rng: SliceRange,
                    timeout: float = 30.0) -> list[LivePiece]:
    """The committed pieces that tile `rng`, in order; [] if nothing does. Whole slices (`records_in_range`), else,
    where a reset back landed inside a slice, the part of it the reset kept (`live_pieces`: the partition (lo, W]
    the reset left), found by reading the table's progress history: loading such a key failed "not published"."""
    records = records_in_range(kafka_conf, channel, rng, timeout)
    if records:
        return [LivePiece(r, r.lo, r.hi) for r in records]
    tiles, at = [], rng.lo
    for piece in live_pieces(read_progress_history(kafka_conf, channel, timeout)):
        if piece.lo == at and piece.hi <= rng.hi:
            tiles.append(piece)
            at = piece.hi
    return tiles if tiles and at == rng.hi else []


def read_piece_messages(kafka_conf: dict[str, Any], piece: LivePiece, timeout: float = 30.0) -> Iterator[Any]:
    """A piece's messages: its slice's (`read_published_messages`), but those above the piece's end where a reset
    cut the slice (the slices cut after the reset sent those rows again)."""
    for msg in read_published_messages(kafka_conf, piece.record, timeout):
        if piece.hi < piece.record.hi and (wm := message_watermark(msg)) is not None and wm > piece.hi:
            continue
        yield msg


READ_BACK_GAP = 10_000  # offsets of other messages between two slices still read through rather than sought past


def read_back_slices(kafka_conf: dict[str, Any], records: list[ProgressRecord], timeout: float = 30.0
                     ) -> dict[str, PublishedSlice]:
    """Slices' messages read back by their records' offsets, counted and checksummed as `SliceDigest` did while
    publishing, by slice. A slice in one partition is read as a stream (it holds the slice in publish order); slices
    there whose offsets follow each other are read in one pass and split by their records' offsets: read one by one,
    each waited ~25 ms for its fetch (a 1000-slice roll-up key's re-run held the table's pool 27 s in its parity
    check, found by review). Slices over several partitions are gathered one by one (`_gathered_read_back`)."""
    out: dict[str, PublishedSlice] = {}
    runs: dict[tuple[str, int], list[tuple[int, int, ProgressRecord]]] = {}
    with slice_reader(kafka_conf) as consumer:
        for r in records:
            if len(r.offsets) == 1:
                ((partition, (first, last)),) = r.offsets.items()
                runs.setdefault((r.topic, int(partition)), []).append((first, last, r))
            else:
                out[r.slice] = _gathered_read_back(kafka_conf, r, timeout, consumer)
        for (topic, partition), spans in runs.items():
            spans.sort(key=lambda span: span[0])
            if any(b[0] <= a[1] for a, b in zip(spans, spans[1:], strict=False)):  # overlapping: one at a time
                for span in spans:
                    out.update(_read_back_run(consumer, topic, partition, [span], timeout))
                continue
            start = 0
            while start < len(spans):
                end = start + 1
                while end < len(spans) and spans[end][0] <= spans[end - 1][1] + 1 + READ_BACK_GAP:
                    end += 1
                out.update(_read_back_run(consumer, topic, partition, spans[start:end], timeout))
                start = end
    return out


def _read_back_run(consumer: Consumer, topic: str, partition: int, spans: list[tuple[int, int, ProgressRecord]],
                   timeout: float) -> dict[str, PublishedSlice]:
    """Slices of one partition, in offset order, their offsets [first, last] apart: read from the first's first
    offset to the last's last, each message counted and digested for the slice whose offsets hold it."""
    digests = [SliceDigest() for _ in spans]
    rows = [0] * len(spans)
    chunks: list[list[bytes]] = [[] for _ in spans]
    tables = [r.table.encode() for _, _, r in spans]
    at = 0
    for m in _read_range(consumer, TopicPartition(topic, partition), spans[0][0], spans[-1][1] + 1, timeout):
        offset = m.offset()
        while at < len(spans) and spans[at][1] < offset:
            at += 1
        if at == len(spans) or offset < spans[at][0]:
            continue  # between two slices: no record names it
        record = spans[at][2]
        mine, wm = table_message_watermark(m.headers(), tables[at])
        if not mine:
            continue
        if wm is not None and not record.lo < wm <= record.hi:
            raise messages_gone(record, offset, partition, wm)
        chunks[at].append(m.value())
        if len(chunks[at]) >= READ_BATCH:
            digests[at].update(chunks[at])
            rows[at] += len(chunks[at])
            chunks[at] = []
    out = {}
    for i, (_, _, record) in enumerate(spans):
        digests[i].update(chunks[i])
        out[record.slice] = PublishedSlice(rows[i] + len(chunks[i]), digests[i].hexdigest())
    return out


def read_back_slice(kafka_conf: dict[str, Any], record: ProgressRecord, timeout: float = 30.0) -> PublishedSlice:
    """The slice's messages counted and checksummed as `SliceDigest` did while publishing (`read_back_slices`)."""
    return read_back_slices(kafka_conf, [record], timeout)[record.slice]


def _gathered_read_back(kafka_conf: dict[str, Any], record: ProgressRecord, timeout: float, consumer: Consumer
                        ) -> PublishedSlice:
    """A slice over several partitions (or none): its messages gathered and put in watermark order."""
    gathered: list[tuple[int, int, bytes]] = []  # (watermark, partition, value), each partition in publish order
    for msg in read_published_messages(kafka_conf, record, timeout, consumer=consumer):
        wm = message_watermark(msg)
        gathered.append((wm if wm is not None else -1, msg.partition(), msg.value()))
    gathered.sort(key=lambda g: g[0])  # stable: within one partition, publish order
    spread = any(a[0] == b[0] and a[1] != b[1] for a, b in zip(gathered, gathered[1:], strict=False))
    if spread:
        return PublishedSlice(len(gathered), None)
    digest = SliceDigest()
    digest.update([g[2] for g in gathered])
    return PublishedSlice(len(gathered), digest.hexdigest())


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


def table_messages_high_watermark(kafka_conf: dict[str, Any], channel: TableChannel, timeout: float = 30.0
                                  ) -> int | None:
    """The highest `rowrelay.watermark` header among the table's committed messages in its data topic (other
    tables may share the topic; `rowrelay replay` copies are not the table's publishing); None if it holds none.
    Reads headers only, each partition from its end backwards in growing windows (per partition the watermarks
    of a table's own messages only grow), up to the end at call time."""
    table = channel.table.encode()
    consumer = _consumer(kafka_conf)
    try:
        try:
            topic = consumer.list_topics(channel.topic, timeout=timeout).topics.get(channel.topic)
        except KafkaException as exc:
            raise KafkaUnavailable(f"cannot reach Kafka at {kafka_conf.get('bootstrap.servers')}: "
                                   f"{exc.args[0].str()}") from exc
        if topic is None or topic.error is not None:
            return None
        highest: int | None = None
        for partition in sorted(topic.partitions):
            tp = TopicPartition(channel.topic, partition)
            low, end = partition_watermarks(consumer, tp, timeout, kafka_conf)
            window = 64
            while end > low:
                start = max(low, end - window)
                found = [wm for own, wm in (table_message_watermark(m.headers(), table)
                                            for m in _read_range(consumer, tp, start, end, timeout))
                         if own and wm is not None]
                if found:
                    highest = max(found) if highest is None else max(highest, *found)
                    break
                end, window = start, window * 4
        return highest
    finally:
        consumer.close()


def progress_missing(kafka_conf: dict[str, Any], channel: TableChannel, timestamps: bool = False,
                     timeout: float = 30.0) -> ProgressMissing | None:
    """For a table whose committed progress is empty: the refusal if its rows were published all the same (its data
    topic holds its messages, or another transactional_id_prefix's progress topic holds its progress), so that
    publishing would send them again; None if nothing of it was published. `timestamps`: the table's watermark is
    a time, so the remedy names one (`rowrelay reset --after` refuses a time's microseconds)."""
    ch = channel
    in_topic = table_messages_high_watermark(kafka_conf, ch, timeout)
    if in_topic is not None and in_topic > ch.start_after:
        at = watermark_text(in_topic, timestamps)
        return ProgressMissing(
            f"{ch.table}: committed progress is empty (progress topic {ch.progress_topic}, transactional id "
            f"{ch.transactional_id}), but topic {ch.topic} already holds this table's messages up to watermark "
            f"{at}: publishing would send them again. Restore the old transactional_id_prefix if it was "
            f"changed, or run `rowrelay reset --table {ch.table} --after {at}` to set a new baseline "
            f"deliberately ({at} is the last watermark of this table already in the topic; a lower value "
            "sends rows again: only for a re-created table whose ids restarted)",
            table=ch.table, topic_watermark=in_topic)
    if in_topic is None and (elsewhere := progress_under_other_prefix(kafka_conf, ch, timeout)) is not None:
        # The prefix and the topic changed together: the new topic is empty, but the table has committed progress
        # under the old prefix.
        name, record = elsewhere
        at = record.hi_text
        return ProgressMissing(
            f"{ch.table}: committed progress is empty (progress topic {ch.progress_topic}, transactional id "
            f"{ch.transactional_id}), but progress topic {name} holds this table's committed progress up to "
            f"watermark {at} (its rows went to topic {record.topic}): publishing would send them again. "
            "Restore the transactional_id_prefix that wrote it if it was changed, or run `rowrelay reset "
            f"--table {ch.table} --after {at}` to continue from there under this prefix (a lower value, "
            "`--after 0` included, sends rows again deliberately: another deployment of the same table)",
            table=ch.table, topic_watermark=record.hi)
    return None


def progress_recorded_refusal(channel: TableChannel, recorded: SliceRange | None) -> ProgressMissing | None:
    """For a table whose committed progress is empty: the refusal if the orchestrator recorded slices of it as
    committed above `start_after` (`recorded`: the highest, e.g. Dagster's materializations), since publishing would
    send them again (the progress topic deleted after the data topic's messages expired: Kafka shows nothing);
    None otherwise. No Kafka call: the publisher, a dry run, `status` and the lag check all ask this, so they refuse
    alike."""
    ch = channel
    if recorded is None or recorded.hi <= ch.start_after:
        return None
    at = watermark_text(recorded.hi, recorded.timestamps)
    return ProgressMissing(
        f"{ch.table}: committed progress is empty (progress topic {ch.progress_topic}), but the slices of "
        f"this table recorded as committed reach watermark {at} (Dagster's materializations): the progress "
        "topic was deleted or its records expired, and the data topic no longer shows those rows, so "
        f"publishing would send them again. Run `rowrelay reset --table {ch.table} --after {at}` to continue "
        "after them (a lower value, `--after 0` included, sends rows again deliberately: a new cluster or "
        "topic meant to get the whole table); nothing was sent", table=ch.table, topic_watermark=recorded.hi)


def topic_taken_back(channel: TableChannel, committed: ProgressRecord, history: Sequence[ProgressRecord]
                     ) -> ProgressShared | None:
    """The refusal if the table's progress was last written for another topic after earlier records of this
    channel's topic (`history`: the progress records, oldest first, `committed` the newest). A `topic:` change moves
    a table once (the new topic gets the rows after it); progress going back and forth is two deployments (staging
    and production on one cluster) sharing one transactional_id prefix with their own topics: each continued from
    the other's progress and skipped the rows the other had sent, with every backfill exiting 0 (found by review)."""
    ch = channel
    if not committed.topic or committed.topic == ch.topic or not any(r.topic == ch.topic for r in history[:-1]):
        return None
    at = committed.hi_text
    return ProgressShared(
        f"{ch.table}: its committed progress was last written for topic {committed.topic} (slice "
        f"{committed.slice}, committed {committed.committed_at}), after earlier slices of this run's topic "
        f"{ch.topic}: two deployments relaying this table under one transactional id ({ch.transactional_id}) "
        "take turns, each skipping the rows the other sent. Give each deployment its own "
        "kafka.transactional_id_prefix. If `topic:` was moved back on purpose, run `rowrelay reset --table "
        f"{ch.table} --after {at}` to continue in {ch.topic} from there; nothing was sent")


def progress_shared(kafka_conf: dict[str, Any], channel: TableChannel, committed: ProgressRecord,
                    timeout: float = 30.0) -> ProgressShared | None:
    """`topic_taken_back` of the table's committed progress, for the publisher and a cut (`plan_cut`: a dry run
    refuses where the backfill would, and a backfill before it adds partitions). Reads the progress history only
    when the committed progress names another topic than the channel's (between a `topic:` change and the first
    commit after it)."""
    if not committed.topic or committed.topic == channel.topic:
        return None
    return topic_taken_back(channel, committed, read_progress_history(kafka_conf, channel, timeout))


RETRIABLE_CALL_S = 120.0  # how long a transactional call failing with retriable errors is called again


def call_retrying(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, a transactional producer call, called again while it fails with a retriable error that needs no
    abort, for up to RETRIABLE_CALL_S: librdkafka's way to retry one. A commit_transaction that timed out goes on in
    the background, and calling it again awaits its outcome; an abort then would be refused. The last error is
    raised (KafkaException): still retriable, the call's outcome is unknown."""
    deadline = time.monotonic() + RETRIABLE_CALL_S
    while True:
        try:
            return fn(*args)
        except KafkaException as exc:
            err = exc.args[0]
            if err.retriable() and not err.txn_requires_abort() and time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            raise


def outcome_unknown(err: KafkaError) -> bool:
    """Whether a commit_transaction that failed with `err` (after `call_retrying`) may still have committed: not when
    the transaction must be aborted or the producer is fenced or failed (the coordinator aborts it); otherwise (a
    timeout, the coordinator unreachable) the commit may complete in the background."""
    return not (err.txn_requires_abort() or err.fatal() or _is_fenced(err))


class SlicePublisher:
    """Publishes one table's slices through one transactional producer (one epoch)."""

    def __init__(self, channel: TableChannel, kafka_conf: dict[str, Any], *,
                 on_stage: StageHook | None = None, max_attempts: int = 3, init_timeout_s: float = 60.0,
                 flush_timeout_s: float = 300.0, abort_timeout_s: float = 10.0,
                 recorded: SliceRange | None = None, commit_timeout_s: float = 120.0) -> None:
        self.channel = channel
        # The newest slice the orchestrator recorded as committed, where Kafka's progress looked empty to it (None:
        # nothing recorded, or progress was there): see `_refuse_if_progress_missing`.
        self.recorded = recorded
        self.flush_timeout_s = flush_timeout_s
        self.kafka_conf = kafka_conf
        self.on_stage = on_stage or env_failpoint
        self.max_attempts = max_attempts
        self.init_timeout_s = init_timeout_s
        self.abort_timeout_s = abort_timeout_s
        self.commit_timeout_s = commit_timeout_s
        # The user's transaction.timeout.ms (kafka.producer) wins; a slice must commit within it.
        self.transaction_timeout_ms = transaction_timeout_ms(kafka_conf)
        producer_conf = {
            # librdkafka's own retries handle transient broker errors inside a transaction.
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 50,
            "compression.type": "lz4",
            "queue.buffering.max.messages": 500_000,
            "queue.buffering.max.kbytes": 1_048_576,
            "batch.size": 1_000_000,
            **kafka_conf,
            "transactional.id": channel.transactional_id,
            "transaction.timeout.ms": self.transaction_timeout_ms,
        }
        self.max_message_bytes = int(producer_conf.get("message.max.bytes", 1_000_000))
        self._producer_conf = producer_conf
        try:
            self.producer = Producer(with_error_cb(producer_conf))
        except KafkaException as exc:  # e.g. message.timeout.ms over transaction.timeout.ms
            raise ProducerSettingsError(f"kafka.producer: {exc.args[0].str().strip()}") from exc
        self._initialized = False
        self._own_progress: ProgressRecord | None = None
        self._topic_checked = False  # the data topic was checked for this table's messages (empty progress)
        self._topic_checked_back = False  # a topic change was checked for a deployment sharing the progress
        self._data_partitions = channel.topic_partitions
        # A delivery report per row costs a Python Message and a callback per row (a third of the produce loop).
        # With one data partition the first and last row of each batch give the slice's offsets, and a failed row
        # still fails the commit (librdkafka: any permanent delivery failure makes the transaction abortable).
        # After such an abort the slice is redone with a report per row, which names the row that failed.
        self._report_every_row = False
        self.last_phases: dict[str, float] = {}  # seconds per phase of the last transaction (see _transaction)
        # The open transaction: when it began (monotonic; None: none open) and rows produced into it so far.
        self._txn_began: float | None = None
        self._txn_rows = 0

    # -- protocol steps ---------------------------------------------------------------------------

    def init(self) -> None:
        # First: an unreachable broker fails here, clearly.
        ready = ensure_topics(self.kafka_conf, self.channel)
        self._data_partitions = ready.partitions
        self._fit_batches_to(ready.max_message_bytes)
        broker_max = broker_max_transaction_timeout_ms(self.kafka_conf)
        if broker_max is not None and self.transaction_timeout_ms > broker_max:
            raise ProducerSettingsError(self._timeout_over_max(broker_max))
        try:
            self.producer.init_transactions(self.init_timeout_s)
        except KafkaException as exc:
            err = exc.args[0]
            if err.code() == KafkaError.INVALID_TRANSACTION_TIMEOUT:  # the broker's maximum was not readable
                raise ProducerSettingsError(self._timeout_over_max(broker_max)) from exc
            if err.retriable() or err.code() in (KafkaError._TIMED_OUT, KafkaError._TRANSPORT):
                failure = unreachable(self.producer, self.kafka_conf, err.str())
                if isinstance(failure, KafkaAuthenticationError):
                    raise failure from exc
                raise KafkaUnavailable(f"init_transactions for {self.channel.transactional_id}: {err.str()}") from exc
            raise RelayError(f"init_transactions for {self.channel.transactional_id}: {_fatal_message(err)}") from exc
        self._initialized = True
        self.on_stage("initialized")

    def _fit_batches_to(self, topic_max_bytes: int | None) -> None:
        """Batches no larger than the data topic accepts. The broker refuses a whole batch over the topic's
        max.message.bytes, and librdkafka, unlike Kafka's Java producer, does not split it: every slice then failed,
        blaming its largest row however small. Before init_transactions the producer has done nothing: it is made
        again with a batch.size the topic takes (lz4's worst-case growth left aside)."""
        batch = int(self._producer_conf.get("batch.size", 1_000_000))
        if topic_max_bytes is None or batch <= topic_max_bytes:
            return
        fitted = max(1, (topic_max_bytes - 128) * 255 // 256)
        _log.info("%s: batch.size %d is over topic %s's max.message.bytes %d: %d used", self.channel.table, batch,
                  self.channel.topic, topic_max_bytes, fitted)
        self._producer_conf = {**self._producer_conf, "batch.size": fitted}
        self.producer = Producer(with_error_cb(self._producer_conf))

    def _timeout_over_max(self, broker_max: int | None) -> str:
        limit = f"the brokers' transaction.max.timeout.ms ({broker_max} ms)" if broker_max is not None else \
            "the brokers' transaction.max.timeout.ms"
        return (f"{self.channel.table}: the producer's transaction.timeout.ms ({self.transaction_timeout_ms} ms) "
                f"is over {limit}: lower transaction.timeout.ms in kafka.producer to at most that (or raise "
                "transaction.max.timeout.ms on the brokers)")

    def committed_progress(self) -> ProgressRecord | None:
        return read_committed_progress(self.kafka_conf, self.channel)

    def _progress_after_fence(self) -> ProgressRecord | None:
        """The table's committed progress once this publisher has fenced every other (init): final, since no other
        can commit any more. After its own commit it knows it without reading: a newer one would fence it first."""
        if not self._initialized:
            self.init()
        return self._own_progress if self._own_progress is not None else self.committed_progress()

    def publish(self, slice_range: SliceRange,
                batches: Callable[[], Iterable[MessageBatch | Sequence[OutgoingMessage]]], *,
                columns: list[list[str]] | None = None, schema_fingerprint: str = "",
                expected_rows: int | None = None, where: str | None = None,
                skipped: Sequence[RowSkip] | None = None, skipped_rows: int | None = None,
                watermark: tuple[str, str] | None = None) -> PublishResult:
        """Publish the slice's rows exactly once; `batches` re-reads the rows if a retry needs them. `columns` and
        `schema_fingerprint` (the columns the rows were read with) go into the slice's progress record.
        `expected_rows`: the rows the source counts in the slice; a read that yields another number is aborted
        (SliceRowsMismatch) instead of committed. `where` and `skipped`: the row filter the rows were chosen by
        (`where:`, "" for none, and the skip_watermarks entries in the slice, which left out `skipped_rows`), kept in
        the progress record. `watermark`:
        the table's watermark column and kind as read now, kept in the record; progress measured in another one is
        refused (WatermarkChanged)."""
        started = time.monotonic()
        committed = self._progress_after_fence()
        self.on_stage("progress_read")
        if committed is None:
            self._refuse_if_progress_missing(slice_range.timestamps)
            if self.channel.baseline_required:
                # Cut before `start_after` became `latest` (found by review: the whole history was sent).
                raise BaselineMissing(
                    f"{self.channel.table}: start_after is latest, and no baseline is recorded yet: slice "
                    f"{slice_range} was cut before (under another start_after) and would send rows `latest` skips. "
                    "Nothing was sent; the table's sensor (or `rowrelay backfill`) records the baseline at the "
                    "newest final row and deletes such slices")
        else:
            if watermark is not None:
                refuse_watermark_change(committed, watermark)
            self._refuse_topic_taken_back(committed)
        committed_hi = committed.hi if committed else self.channel.start_after
        if committed_hi >= slice_range.hi:
            # A baseline or reset record (lo == hi) is not this slice's record.
            record = committed if committed and (committed.lo, committed.hi) == (slice_range.lo, slice_range.hi) \
                else find_slice_progress(self.kafka_conf, self.channel, slice_range)
            if record is None:  # covered by progress but not a slice of its own (e.g. start_after)
                record = ProgressRecord(self.channel.table, slice_range.key, slice_range.lo, slice_range.hi, 0, 0,
                                        "", self.channel.topic)
            return PublishResult(record, already_committed=True, duration_s=time.monotonic() - started)
        if committed_hi != slice_range.lo:
            raise SliceOutOfOrder.at(self.channel.table, slice_range, committed_hi)
        attempt = 0
        while True:
            attempt += 1
            try:
                record = self._transaction(slice_range, batches(), columns or [], schema_fingerprint,
                                           expected_rows, where, skipped, skipped_rows, watermark)
                self._own_progress = record
                return PublishResult(record, already_committed=False, duration_s=time.monotonic() - started,
                                     attempts=attempt, phases=dict(self.last_phases))
            except _CommitUnknown as exc:
                # Kafka, read once a fresh producer has settled the transaction, tells whether the slice committed:
                # redone blindly, it was in the topic twice when the first commit had landed.
                committed = self._fence_after_unknown_commit()
                if committed is not None and committed.slice == slice_range.key:
                    self._own_progress = committed
                    return PublishResult(committed, already_committed=False, duration_s=time.monotonic() - started,
                                         attempts=attempt, phases=dict(self.last_phases))
                if (committed.hi if committed else self.channel.start_after) != slice_range.lo:
                    # Another publisher moved progress meanwhile: the checks a publish starts with say what stands.
                    return self.publish(slice_range, batches, columns=columns, schema_fingerprint=schema_fingerprint,
                                        expected_rows=expected_rows, where=where, skipped=skipped,
                                        skipped_rows=skipped_rows, watermark=watermark)
                if attempt >= self.max_attempts:
                    raise KafkaUnavailable(f"{self.channel.table}: slice {slice_range}: the commit failed {attempt} "
                                           f"times without an answer (last: {exc}); nothing of it committed") from exc
                _log.warning("%s: the commit of slice %s got no answer (%s) and did not land; sending it again",
                             self.channel.table, slice_range, exc)
            except _AbortAndRedo as exc:
                self._raise_if_timed_out(slice_range, exc)
                self._abort()
                self._report_every_row = True  # the redo names a row that fails delivery
                if attempt >= self.max_attempts:
                    raise KafkaUnavailable(
                        f"{self.channel.table}: slice {slice_range} aborted {attempt} times: {exc}") from exc
                time.sleep(min(2.0 * attempt, 10.0))
            except BadRowError:
                self._abort()
                raise
            except SliceRowsMismatch:  # its own diagnosis, even late in a long transaction (not "timed out")
                self._abort_quietly()
                raise
            except RelayError as exc:  # fenced, fatal: a coordinator abort on timeout also looks like these
                self._raise_if_timed_out(slice_range, exc)
                self._abort_quietly()
                raise
            except BaseException:
                # Anything else (a Spark error in `batches`, the order check, an interrupt, SystemExit): end the
                # transaction now instead of holding every read_committed reader for transaction.timeout.ms.
                self._abort_quietly()
                raise

    def publish_baseline(self, hi: int, watermark: tuple[str, str] | None = None) -> ProgressRecord:
        """The table's first progress, "committed up to `hi`" (start_after: latest), recorded only if the progress
        is still empty once this publisher has fenced every other: another cutter (the sensor, a CLI backfill)
        may have recorded its own baseline or committed slices since it was read. Then that progress stands and is
        returned, and nothing is written: a baseline over it would skip rows (a higher one) or send them again (a
        lower one)."""
        ch = self.channel
        record = ProgressRecord(ch.table, f"{BASELINE_PREFIX}{hi}", hi, hi, 0, 0, "", ch.topic,
                                transactional_id=ch.transactional_id, **watermark_fields(watermark))
        return self.publish_progress_only(record, only_if_empty=True)

    def publish_progress_only(self, record: ProgressRecord, *, reset: bool = False,
                              only_if_empty: bool = False) -> ProgressRecord:
        """Commit a progress record with no rows; returns the table's progress after it. With empty progress
        while the data topic holds the table's messages this refuses (ProgressMissing) unless `reset`: a
        deliberate new baseline. `only_if_empty`: with progress already committed, commit nothing and return it."""
        if not self._initialized:
            self.init()
        if not reset:
            standing = self._progress_after_fence()
            if standing is None:
                self._refuse_if_progress_missing(record.watermark_kind in ("timestamp", "timestamptz"))
            elif only_if_empty:
                return standing
        try:
            self._call(self.producer.begin_transaction)
            self._txn_began, self._txn_rows = time.monotonic(), 0
            self._produce(self.channel.progress_topic, record.slice.encode(), record.to_json(), None, None, None,
                          partition=0)  # read at partition 0 whatever partitions the topic has
            self._commit()
            self._txn_began = None
        except _CommitUnknown as exc:
            standing = self._fence_after_unknown_commit()
            if standing is None or (standing.slice, standing.committed_at) != (record.slice, record.committed_at):
                raise RelayError(f"{self.channel.table}: progress record {record.slice} not committed ({exc}); "
                                 "progress is unchanged, try again") from exc
        except _AbortAndRedo as exc:
            # Not committed. The abort says why when a newer publisher fenced this one meanwhile (a commit racing
            # the fence can fail "Unknown broker error" first); else the caller is told in a RelayError, as for
            # any failed commit, never in this module's private redo signal.
            self._abort()
            raise RelayError(f"{self.channel.table}: progress record {record.slice} not committed ({exc}); "
                             "progress is unchanged, try again") from exc
        except BaseException:
            self._abort_quietly()
            raise
        self._own_progress = record
        return record

    def publish_reset(self, after: int, reason: str, watermark: tuple[str, str] | None = None) -> ResetOutcome:
        """A deliberate new baseline: the table's progress says "committed up to `after`". One transaction with
        only a progress record; taking the table's transactional id, it fences any running publisher of it.
        Returns the record and the progress it replaced, read after the fence: no slice can commit between them.
        `watermark`: the column and kind `after` is a value of (None: the source could not be asked)."""
        if not reason.strip():
            raise RelayError(f"{self.channel.table}: a reset needs a reason (it is kept in the progress record)")
        ch = self.channel
        replaced = self._progress_after_fence()
        # The columns last published carry over: the next slice is checked against them (`on_schema_change`). A
        # reset without them let a re-created table's new columns through unchecked (found by review).
        record = ProgressRecord(table=ch.table, slice=f"{RESET_PREFIX}{after}", lo=after, hi=after, rows=0, bytes=0,
                                checksum="", topic=ch.topic, transactional_id=ch.transactional_id,
                                committed_at=datetime.now(UTC).isoformat(), reset_reason=reason,
                                topic_ends=topic_end_offsets(self.kafka_conf, ch.topic),
                                columns=replaced.columns if replaced else [],
                                schema_fingerprint=replaced.schema_fingerprint if replaced else "",
                                **watermark_fields(watermark))
        self.publish_progress_only(record, reset=True)
        return ResetOutcome(record, replaced)

    def accept_schema(self, columns: list[list[str]], schema_fingerprint: str, reason: str) -> ProgressRecord:
        """Record that a human accepted the table's current columns: the committed progress record again (same
        range, rows and checksum), with the new columns and the reason. Progress does not move."""
        if not reason.strip():
            raise RelayError(f"{self.channel.table}: accepting a schema change needs a reason (kept in progress)")
        committed = self._progress_after_fence()
        if committed is None:
            raise RelayError(f"{self.channel.table}: nothing committed yet: there is no schema to accept a change to")
        record = replace(committed, columns=columns, schema_fingerprint=schema_fingerprint,
                         committed_at=datetime.now(UTC).isoformat(), reset_reason=f"schema accepted: {reason}")
        self.publish_progress_only(record)
        return record

    def close(self) -> None:
        """Best effort: a committed or aborted transaction leaves nothing queued. A fenced (fatal) producer raises
        from flush, and close runs where a publish failed: that error, not this one, must reach the caller."""
        with contextlib.suppress(KafkaException, SystemError):  # SystemError: see `_serve`
            self.producer.flush(5)

    # -- internals ----------------------------------------------------------------------------------

    def _refuse_topic_taken_back(self, committed: ProgressRecord) -> None:
        """Refuse when the table's progress moved to another topic and back (`topic_taken_back`): two deployments
        sharing one transactional_id prefix. Reads the history only when the topics differ, once per publisher."""
        if self._topic_checked_back:
            return
        if (shared := progress_shared(self.kafka_conf, self.channel, committed)) is not None:
            raise shared
        if committed.topic and committed.topic != self.channel.topic:
            self._topic_checked_back = True

    def _refuse_if_overtaken(self) -> None:
        """The empty progress this publisher read is stale when a newer publisher fenced it and committed since
        (this one stalled in between): the messages in the topic are that one's, and this one stops as fenced. Read a
        few times: the commit marker on the progress partition may follow the data partitions' by a moment."""
        for attempt in range(3):
            if (now := self.committed_progress()) is not None:
                break
            if attempt < 2:
                time.sleep(1.0)
        else:
            return
        raise PublisherFenced(
            f"{self.channel.table}: another publisher took over transactional id {self.channel.transactional_id} "
            f"and committed progress up to {now.hi_text} since this one read it; this one stops without publishing")

    def _refuse_if_progress_missing(self, timestamps: bool) -> None:
        """Empty progress but the table's messages already in its data topic (e.g. a new transactional_id_prefix
        gave it a new, empty progress topic), or slices of it recorded committed by the orchestrator (`recorded`:
        the progress topic deleted after the data topic's messages expired): publishing would send them all again.
        Checked once per publisher."""
        if self._topic_checked:
            return
        if (missing := progress_missing(self.kafka_conf, self.channel, timestamps)) is not None:
            self._refuse_if_overtaken()
            raise missing
        if (missing := progress_recorded_refusal(self.channel, self.recorded)) is not None:
            raise missing
        self._topic_checked = True

    def _raise_if_timed_out(self, slice_range: SliceRange, exc: BaseException) -> None:
        """A fenced/epoch/abort error of a transaction open about as long as transaction.timeout.ms is the
        coordinator aborting it on timeout, not another publisher: say so, and what to change."""
        if self._txn_began is None:
            return
        elapsed = time.monotonic() - self._txn_began
        timeout_s = self.transaction_timeout_ms / 1000
        if elapsed < 0.9 * timeout_s:  # 0.9: the coordinator's clock started a little after ours
            return
        self._abort_quietly()
        raise TransactionTimedOut(
            f"{self.channel.table}: the transaction of slice {slice_range} was open {elapsed:.1f} s "
            f"({self._txn_rows} rows produced so far), longer than transaction.timeout.ms "
            f"({self.transaction_timeout_ms} ms), so Kafka aborted it; nothing of the slice is visible. Make "
            "slices smaller (lower slice_max_rows) or raise transaction.timeout.ms in kafka.producer, up to the "
            "brokers' transaction.max.timeout.ms") from exc

    def _abort_quietly(self) -> None:
        """Best effort and bounded: end the open transaction, if any; errors here must not hide the cause."""
        if self._txn_began is None:
            return
        self._txn_began = None
        # Fenced, fatal or broker away: the coordinator ends it (after transaction.timeout.ms at worst).
        with contextlib.suppress(KafkaException):
            self.producer.abort_transaction(self.abort_timeout_s)

    def _transaction(self, slice_range: SliceRange, batches: Iterable[MessageBatch | Sequence[OutgoingMessage]],
                     columns: list[list[str]], schema_fingerprint: str,
                     expected_rows: int | None = None, where: str | None = None,
                     skipped: Sequence[RowSkip] | None = None, skipped_rows: int | None = None,
                     watermark: tuple[str, str] | None = None) -> ProgressRecord:
        ch = self.channel
        offsets: dict[int, list[int]] = {}
        errors: list[tuple[KafkaError, int | None]] = []

        def delivered(err: KafkaError | None, msg: Any) -> None:
            if err is not None:
                errors.append((err, None))
                return
            span = offsets.setdefault(msg.partition(), [msg.offset(), msg.offset()])
            span[0] = min(span[0], msg.offset())
            span[1] = max(span[1], msg.offset())

        digest = SliceDigest()
        rows = nbytes = 0
        # (size, watermark, value): names the culprit if the broker refuses a message as too large.
        largest: tuple[int, int | None, bytes | None] = (0, None, None)
        produce, topic = self.producer.produce, ch.topic
        # Per row only what is per row (each header costs about as much as the produce call itself): the table,
        # for topics that several tables share, and the row's watermark. Which slice a message belongs to is in
        # the progress record (its offsets); the slice's checksum is over the values themselves (SliceDigest).
        table_pair = (TABLE_HEADER, ch.table.encode())

        # Set when librdkafka refuses to produce because the transaction already failed (_STATE): a message sent
        # earlier was refused (too large, say); the flush below asks the producer why (_transaction_failure).
        refused: list[KafkaError] = []

        # Offsets per partition need a report per row (several partitions, or the redo naming a failed row).
        every_row_reports = self._report_every_row or self._data_partitions != 1
        # Otherwise the topic has one partition, named on every row: no partitioner hashing each key to find it,
        # and the offsets of a batch's first and last row span the rows between them even if partitions were
        # added to the topic since init.
        partition = -1 if every_row_reports else 0

        def send(rows: Iterable[tuple[bytes | None, bytes, int, bytes]], report: Callable[..., None] | None) -> None:
            if refused:
                return
            for key, value, wm, wm_text in rows:
                headers = [table_pair, (WATERMARK_HEADER, wm_text)]
                try:  # one C call per row, positional (keyword parsing cost 20 % of the loop):
                    # topic, value, key, partition (-1: the partitioner), callback, on_delivery (its alias),
                    # timestamp, headers
                    produce(topic, value, key, partition, report, None, 0, headers)
                except (BufferError, KafkaException):
                    self._produce(topic, key, value, headers, report, wm, refused, partition)
                    if refused:
                        return

        def send_quietly(batch: MessageBatch, start: int, stop: int) -> None:
            """Rows [start, stop) without a delivery report: from C where it is attached (the hot path), each
            row librdkafka refuses through `send`, which waits out a full queue or says why."""
            if native is None or not native.supports(batch.keys, batch.values, batch.watermark_texts):
                send(batch.rows(start, stop), None)
                return
            while start < stop and not refused:
                done, _ = native.produce(batch.keys, batch.values, batch.watermark_texts, start, stop)
                start += done
                if start < stop:
                    send(batch.rows(start, start + 1), None)
                    start += 1

        native = None if every_row_reports else RowProducer.attach(self.producer, topic, ch.table, partition)
        try:
            self._call(self.producer.begin_transaction)
            self._txn_began, self._txn_rows = time.monotonic(), 0
            self.on_stage("begun")
            # Seconds per phase of this transaction: waiting for rows (read), producing them, flushing, committing.
            phases = self.last_phases = {"read_s": 0.0, "produce_s": 0.0, "flush_s": 0.0, "commit_s": 0.0}
            clock = time.monotonic()
            for batch in batches:
                now = time.monotonic()
                phases["read_s"] += now - clock
                clock = now
                if not isinstance(batch, MessageBatch):
                    batch = MessageBatch.of(batch)
                n = len(batch)
                if not n:
                    continue
                low, high = batch.watermark_bounds()
                if low <= slice_range.lo or high > slice_range.hi:
                    wm = low if low <= slice_range.lo else high
                    raise BadRowError(f"{ch.table}: row with watermark {wm} is outside slice {slice_range}",
                                      table=ch.table, watermark=wm)
                sizes = batch.sizes()
                at = int(sizes.argmax())
                biggest = int(sizes[at])
                if biggest > largest[0]:
                    largest = (biggest, batch.watermarks[at].as_py(), batch.values[at].as_py())
                if biggest > self.max_message_bytes:
                    column, hint = _column_hint(largest[2])
                    named = watermark_text(int(largest[1] or 0), slice_range.timestamps)
                    raise BadRowError(
                        f"{ch.table}: row with watermark {named} is {biggest} bytes as a message{hint}, over the "
                        f"producer's message.max.bytes ({self.max_message_bytes}); raise message.max.bytes on the "
                        f"producer and the topic (max.message.bytes), or {skip_advice(named)} (see docs/operations.md)",
                        table=ch.table, watermark=largest[1], column=column, entry=named, value=largest[2])
                if every_row_reports or n <= 2:
                    send(batch.rows(0, n), delivered)
                else:  # the first and the last row report their offsets, in order around the rest
                    send(batch.rows(0, 1), delivered)
                    send_quietly(batch, 1, n - 1)
                    send(batch.rows(n - 1, n), delivered)
                digest.update_arrow(batch.values)
                rows += n
                self._txn_rows = rows
                nbytes += int(sizes.sum())
                self._serve(self.producer.poll, 0)  # delivery reports so far
                now = time.monotonic()
                phases["produce_s"] += now - clock
                clock = now
                if errors or refused:
                    break
        finally:
            if native is not None:
                native.close()
        phases["read_s"] += time.monotonic() - clock  # the wait for the end of the rows
        clock = time.monotonic()
        self.on_stage("rows_produced")
        # Delivery of every row (uncommitted) before the progress record, so it can carry their offsets.
        # Short flushes: a failed delivery ends the wait at once instead of after the whole timeout.
        deadline = time.monotonic() + self.flush_timeout_s
        failure: KafkaError | None = None
        while True:
            left = 0 if refused else self._serve(self.producer.flush, 1.0)
            # A refused message without a delivery callback fails the transaction silently, and the messages
            # queued behind it then wait out message.timeout.ms: ask the producer instead of waiting.
            failure = self._transaction_failure()
            if failure is not None or errors:
                break
            if refused:  # refused, yet the transaction has not failed: say what was refused
                self._raise_for(refused[0])
            if not left:
                break
            if time.monotonic() > deadline:
                raise _AbortAndRedo(f"messages not delivered within {self.flush_timeout_s:.0f} s")
        phases["flush_s"] = time.monotonic() - clock
        self.on_stage("flushed")
        if failure is not None or errors:
            # The transaction's own error names the cause; a delivery report may only say its message was purged.
            err = failure if failure is not None else errors[0][0]
            if err.code() == KafkaError.INVALID_RECORD:
                raise TopicSettingsError(
                    f"{ch.table}: the broker refused a message of slice {slice_range} as invalid ({err.str()}): a "
                    f"compacted topic refuses messages without a key (is topic {ch.topic} compacted while the table "
                    "has `key: none`?), or a broker-side record check (a timestamp outside "
                    "message.timestamp.*.max.ms) failed. Nothing of the slice is visible; fix the topic's settings "
                    "or the table's `key:`")
            if err.code() in (KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE):
                size, wm, value = largest
                column, hint = _column_hint(value)
                named = watermark_text(int(wm or 0), slice_range.timestamps)
                raise BadRowError(
                    f"{ch.table}: the broker rejected a message as too large ({err.str()}); the largest row of slice "
                    f"{slice_range} has watermark {named} ({size} bytes{hint}). Raise the topic's max.message.bytes "
                    f"(and the producer's message.max.bytes) or {skip_advice(named)} (see docs/operations.md)",
                    table=ch.table, watermark=wm, column=column, entry=named, value=value)
            if _is_fenced(err) or err.fatal():
                raise PublisherFenced(f"{ch.table}: {_fatal_message(err)}")
            raise _AbortAndRedo(_fatal_message(err))
        if expected_rows is not None and rows != expected_rows:
            # The progress record would say "every row up to hi is sent" over rows that were not (or twice): a
            # driver reading a column narrower than the source stores it, a session time zone moving zone-less
            # times out of the range, rows deleted or rewritten in an append-only table. Abort instead.
            raise SliceRowsMismatch(
                f"{ch.table}: slice {slice_range}: the read gave {rows} rows but the source counts {expected_rows} "
                "in it; nothing of the slice is committed and progress has not moved. Likely causes: a column the "
                "JDBC driver reads narrower than the source stores it, a Spark session time zone other than UTC "
                "with zone-less timestamp watermarks, a `where:` whose result depends on the session's time zone "
                "(rowrelay counts in the database's default zone, Spark reads in UTC: write times with their "
                "offset), or rows deleted or changed inside the slice (rowrelay relays append-only tables). Fix "
                "the cause and run the slice again")
        record = ProgressRecord(
            table=ch.table, slice=slice_range.key, lo=slice_range.lo, hi=slice_range.hi, rows=rows, bytes=nbytes,
            checksum=digest.hexdigest(), topic=ch.topic,
            offsets={str(p): span for p, span in sorted(offsets.items())},
            transactional_id=ch.transactional_id, committed_at=datetime.now(UTC).isoformat(),
            transaction_s=round(time.monotonic() - self._txn_began, 3) if self._txn_began is not None else 0.0,
            columns=columns, schema_fingerprint=schema_fingerprint, where=where,
            skipped=None if skipped is None else [s.to_record() for s in skipped], skipped_rows=skipped_rows,
            **watermark_fields(watermark),
        )
        self._produce(ch.progress_topic, slice_range.key.encode(), record.to_json(), None, None, None,
                      partition=0)  # read at partition 0 whatever partitions the topic has
        self.on_stage("before_commit")
        clock = time.monotonic()
        self._commit()
        phases["commit_s"] = time.monotonic() - clock
        self._txn_began = None
        self.on_stage("committed")
        return record

    def _transaction_failure(self) -> KafkaError | None:
        """The error that failed the open transaction, if one did, without waiting. librdkafka has no call that
        reads the transaction's state, but begin_transaction checks it locally and changes nothing when it
        refuses: inside a healthy transaction it refuses with _STATE; once the transaction has failed it
        returns that failure (txn_requires_abort, or fatal)."""
        try:
            self.producer.begin_transaction()
        except KafkaException as exc:
            err = exc.args[0]
            return err if err.txn_requires_abort() or err.fatal() or _is_fenced(err) else None
        raise RelayError(f"{self.channel.table}: a transaction was expected to be open")  # a bug of ours

    def _produce(self, topic: str, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]] | None,
                 callback: Callable[..., None] | None, watermark: int | None,
                 refused: list[KafkaError] | None = None, partition: int = -1) -> None:
        """Produce one message (partition -1: the partitioner's choice), waiting while the local queue is full. With
        `refused`, a produce refused because the transaction already failed (_STATE) is appended to it instead of
        raised: the caller finds out why."""
        while True:
            try:
                self.producer.produce(topic, value, key, partition, headers=headers, on_delivery=callback)
                return
            except BufferError:
                self.producer.poll(0.05)  # local queue full: let deliveries drain
            except KafkaException as exc:
                err = exc.args[0]
                if err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
                    column, hint = _column_hint(value)
                    # The watermark as a number (a time's microseconds, which skip_watermarks reads as that time):
                    # the run names the row as its table writes it (`BadRowError.naming`).
                    raise BadRowError(
                        f"{self.channel.table}: row with watermark {watermark} is too large for Kafka "
                        f"({len(value)} bytes{hint}); raise message.max.bytes or {skip_advice(str(watermark))} (see "
                        "docs/operations.md)", table=self.channel.table, watermark=watermark, column=column,
                        entry=str(watermark), value=value) from exc
                if refused is not None and err.code() == KafkaError._STATE:
                    refused.append(err)
                    return
                self._raise_for(err)

    def _serve(self, fn: Callable[[float], int], timeout: float) -> int:
        """producer.poll / producer.flush. A producer turned fatal (fenced, or its transaction aborted on timeout)
        raises from inside them; confluent-kafka 2.16 then also calls the next delivery callback with that
        exception pending, which surfaces as a SystemError caused by it. Either becomes our error for it."""
        try:
            return fn(timeout)
        except (KafkaException, SystemError) as exc:
            cause = exc if isinstance(exc, KafkaException) else exc.__cause__
            if not isinstance(cause, KafkaException):
                raise
            self._raise_for(cause.args[0])
            raise  # _raise_for always raises

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return call_retrying(fn, *args)
        except KafkaException as exc:
            self._raise_for(exc.args[0])
            raise  # _raise_for always raises

    def _commit(self) -> None:
        """One commit_transaction call, never repeated nor followed by an abort on this producer when its outcome is
        unknown (_CommitUnknown): librdkafka lacks KIP-890's epoch per transaction, so an EndTxn still on its way
        could land on a later transaction of the same producer. `_fence_after_unknown_commit` ends it."""
        try:
            self.producer.commit_transaction(self.commit_timeout_s)
        except KafkaException as exc:
            err = exc.args[0]
            if outcome_unknown(err):
                raise _CommitUnknown(_fatal_message(err)) from exc
            self._raise_for(err)

    def _fence_after_unknown_commit(self) -> ProgressRecord | None:
        """A fresh producer of the table's transactional id in place of the one whose commit got no answer, and the
        progress committed once it is initialized: its init_transactions has the coordinator finish that
        transaction (committed, or aborted) and fences the old producer's requests still on their way, so the
        progress read then says for good whether the commit landed."""
        self._txn_began = None
        self._own_progress = None
        self._initialized = False
        stale, self.producer = self.producer, Producer(with_error_cb(self._producer_conf))
        try:
            self.init()
        finally:
            with contextlib.suppress(KafkaException, SystemError):  # its queue emptied, dropping it waits for nothing
                stale.purge()
        return self.committed_progress()

    def _raise_for(self, err: KafkaError) -> None:
        if err.code() == KafkaError._FATAL and self._txn_began is not None:
            # A produce refused "Local: Fatal error" names no cause; the producer's own fatal error (a fence, most
            # often) is what failed the transaction: reported as that, so a fenced run stops as fenced.
            err = self._transaction_failure() or err
        if _is_fenced(err):
            raise PublisherFenced(
                f"{self.channel.table}: another publisher took over transactional id "
                f"{self.channel.transactional_id} ({err.str()}); this one stops without publishing")
        if err.txn_requires_abort():
            raise _AbortAndRedo(_fatal_message(err))
        if err.fatal():
            raise RelayError(f"{self.channel.table}: fatal Kafka error {_fatal_message(err)}")
        if err.retriable() or err.code() in (KafkaError._TIMED_OUT, KafkaError._TRANSPORT):
            raise _AbortAndRedo(_fatal_message(err))
        raise RelayError(f"{self.channel.table}: Kafka error {_fatal_message(err)}")

    def _abort(self) -> None:
        self._txn_began = None
        deadline = time.monotonic() + 60
        while True:
            try:
                self.producer.abort_transaction(max(1.0, deadline - time.monotonic()))
                return
            except KafkaException as exc:
                err = exc.args[0]
                if _is_fenced(err) or err.fatal():
                    raise PublisherFenced(f"{self.channel.table}: {_fatal_message(err)}") from exc
                # librdkafka: a retriable abort error (a timeout, the coordinator busy) is retried by calling it again.
                if err.retriable() and time.monotonic() < deadline:
                    time.sleep(0.5)
                    continue
                # Not in a transaction, or the broker is away: the transaction times out on its own.
                _log.warning("%s: aborting the transaction failed (%s); the broker aborts it after "
                             "transaction.timeout.ms (%d ms)", self.channel.table, err.str(),
                             self.transaction_timeout_ms)
                return


def publish_slice(channel: TableChannel, kafka_conf: dict[str, Any], slice_range: SliceRange,
                  batches: Callable[[], Iterable[Sequence[OutgoingMessage]]], *,
                  on_stage: StageHook | None = None) -> PublishResult:
    """Publish one slice exactly once: init (fence), check progress, one transaction with rows + progress."""
    publisher = SlicePublisher(channel, kafka_conf, on_stage=on_stage)
    try:
        return publisher.publish(slice_range, batches)
    finally:
        publisher.close()
