"""A table's channel and its progress records: START marks, watermark kinds, live pieces and tilings."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from resources.exactly_once.errors import WatermarkChanged
from resources.names import progress_topic_name
from resources.slices import RowSkip, SliceRange, is_timestamp_key, watermark_text


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
    def for_table(cls, table: str, topic: str, *, prefix: str, start_after: int = 0, topic_partitions: int = 1,
                  replication_factor: int = -1, keyed: bool = True, baseline_required: bool = False,
                  shared_with: tuple[str, ...] = ()) -> TableChannel:
        """`prefix`: the deployment's transactional_id_prefix, always given: a default would let a caller that
        forgets it read and write another deployment's progress."""
        return cls(table=table, topic=topic, progress_topic=progress_topic_name(prefix, table),
                   transactional_id=f"{prefix}.{table}", start_after=start_after,
                   topic_partitions=topic_partitions, replication_factor=replication_factor, keyed=keyed,
                   baseline_required=baseline_required, shared_with=shared_with)


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
