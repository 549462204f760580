"""Watermark slices and how new ones are cut. Pure logic: no Dagster, no Kafka, no database."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

KEY_DIGITS = 12
_KEY = re.compile(r"^(-?\d+)-(-?\d+)$")
# A timestamp watermark's key: two UTC times to the microsecond, fixed width, so keys sort as their ranges do.
_TIME = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z"
_TIME_KEY = re.compile(rf"^({_TIME})_({_TIME})$")
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICRO = timedelta(microseconds=1)


def micros_to_datetime(micros: int) -> datetime:
    """A timestamp watermark (microseconds since 1970-01-01 UTC) as an aware UTC datetime, exactly."""
    return EPOCH + timedelta(microseconds=micros)


def datetime_to_micros(value: datetime) -> int:
    """Microseconds since 1970-01-01 UTC, exactly (integer arithmetic). A naive value is read as UTC: rowrelay
    never converts a zone-less timestamp between zones (see docs/configuration.md, timestamp watermarks)."""
    aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    return (aware - EPOCH) // _MICRO


def micros_sql_text(micros: int, separator: str = " ") -> str:
    """2026-11-23 07:29:56.123456: a timestamp watermark as SQL and Spark parse it, the year always four digits
    (glibc's strftime("%Y") writes year 500 as "500", which neither the key pattern nor the databases read)."""
    d = micros_to_datetime(micros)
    return f"{d.year:04d}-{d.month:02d}-{d.day:02d}{separator}{d:%H:%M:%S.%f}"


def micros_text(micros: int) -> str:
    """2026-11-23T07:29:56.123456Z: a timestamp watermark as a key part (fixed width for years 1-9999)."""
    return micros_sql_text(micros, "T") + "Z"


def watermark_text(value: int, timestamps: bool) -> str:
    """A watermark as a user reads and writes it: the integer, or the UTC time a timestamp watermark stands for."""
    return micros_text(value) if timestamps else str(value)


def parse_watermark(text: str) -> int:
    """A watermark as a user writes it (CLI, runbook): an integer, or for a timestamp watermark an ISO-8601 time
    (2026-11-23T07:00:00Z; a time without an offset is read as UTC)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return datetime_to_micros(datetime.fromisoformat(text))
    except ValueError:
        raise ValueError(f"{text!r} is neither an integer watermark nor an ISO-8601 time "
                         "(e.g. 2026-11-23T07:00:00.000000Z)") from None


def is_timestamp_key(key: str) -> bool:
    return _TIME_KEY.match(key) is not None


def _parse_micros_text(text: str) -> int:
    return datetime_to_micros(datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ"))


@dataclass(frozen=True, order=True)
class SliceRange:
    """The half-open watermark range (lo, hi]: rows with lo < watermark <= hi.

    `timestamps`: the watermark is a timestamp, carried as microseconds since 1970-01-01 UTC; only the key's
    text differs (readable times). It does not take part in equality or order.
    """

    lo: int
    hi: int
    timestamps: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if self.hi <= self.lo:
            raise ValueError(f"empty slice: hi {self.hi} must exceed lo {self.lo}")

    @property
    def key(self) -> str:
        """Dagster partition key: zero-padded so keys sort as their ranges do (up to 10**12); for a timestamp
        watermark, two UTC times (2026-11-23T07:00:00.000000Z_2026-11-23T07:00:05.250000Z)."""
        if self.timestamps:
            return f"{micros_text(self.lo)}_{micros_text(self.hi)}"
        return f"{self.lo:0{KEY_DIGITS}d}-{self.hi:0{KEY_DIGITS}d}"

    @classmethod
    def from_key(cls, key: str) -> SliceRange:
        m = _KEY.match(key)
        if m:
            return cls(int(m.group(1)), int(m.group(2)))
        t = _TIME_KEY.match(key)
        if t:
            return cls(_parse_micros_text(t.group(1)), _parse_micros_text(t.group(2)), timestamps=True)
        raise ValueError(f"not a slice partition key: {key!r} (expected LO-HI, e.g. 000000000000-000000100000, "
                         "or two UTC times, e.g. 2026-11-23T07:00:00.000000Z_2026-11-23T07:00:05.000000Z)")

    def span(self, lo: int, hi: int) -> SliceRange:
        """Another range of the same watermark kind (same key format)."""
        return replace(self, lo=lo, hi=hi)

    def __str__(self) -> str:
        if self.timestamps:
            return f"({micros_text(self.lo)}, {micros_text(self.hi)}]"
        return f"({self.lo}, {self.hi}]"


# The n-th watermark value above `after` (n >= 1), among rows with watermark <= `upto`; None if fewer rows.
NthWatermark = Callable[[int, int, int], int | None]
# The largest watermark in (after, upto]; None if no rows.
MaxWatermark = Callable[[int, int], int | None]


def cut_slices(after: int, safe_hi: int, max_rows: int, nth_watermark: NthWatermark,
               max_watermark: MaxWatermark, limit: int = 500, timestamps: bool = False) -> list[SliceRange]:
    """Cut the rows in (after, safe_hi] into consecutive slices of at most `max_rows` rows.

    Boundaries are real watermark values, so slices hold exactly `max_rows` rows (more only when one
    watermark value repeats across the boundary) and the last slice ends at the last row present.
    At most `limit` slices per call keep one sensor tick short; the rest come on the next tick.
    With a timestamp watermark a slice never splits one timestamp: rows sharing it all fall in one slice.
    """
    if max_rows < 1:
        raise ValueError("max_rows must be >= 1")
    slices: list[SliceRange] = []
    lo = after
    while lo < safe_hi and len(slices) < limit:
        boundary = nth_watermark(lo, max_rows, safe_hi)
        if boundary is None:
            last = max_watermark(lo, safe_hi)
            if last is not None and last > lo:
                slices.append(SliceRange(lo, last, timestamps))
            break
        slices.append(SliceRange(lo, boundary, timestamps))
        lo = boundary
    return slices


@dataclass(frozen=True)
class WatermarkCandidate:
    """A max watermark seen at one moment, with what must be true later for it to be final.

    `marker` is database specific: for PostgreSQL the xmax of the snapshot it was seen in (every
    transaction with a smaller id must have ended); for MariaDB/SQLite the database clock in seconds.
    `waits` names the transactions (database-specific ids) that were open when the max was seen: one of
    them may hold a lower watermark it has not committed yet, so all must have ended first.
    `durable_at`: MariaDB, the redo log position when the max was seen; with no `waits`, every row at or below the
    max is durable once the log is flushed that far (None: not known; the position at the check is used).
    `table`: which incarnation of the table it was seen in (PostgreSQL: its oid and relfilenode, which a re-creation
    or a TRUNCATE changes; MariaDB/MySQL: its CREATE_TIME, which a re-creation changes; None: not known, a view on
    MariaDB). A candidate is about that table's ids only.
    """

    watermark: int
    marker: float
    waits: tuple[str, ...] = ()
    durable_at: int | None = None
    table: str | None = field(default=None, compare=False)  # not part of its identity: `is_final` keys on it

    @classmethod
    def settled(cls, watermark: int) -> WatermarkCandidate:
        """A value already known final (and durable): a safe watermark kept for a later tick, a re-cut's end."""
        return cls(watermark, float("-inf"))

    @property
    def is_settled(self) -> bool:
        return self.marker == float("-inf")


def settle(candidates: list[WatermarkCandidate], is_final: Callable[[WatermarkCandidate], bool]
           ) -> tuple[int | None, list[WatermarkCandidate]]:
    """Split pending candidates into the highest one now final and those still pending."""
    safe: int | None = None
    pending: list[WatermarkCandidate] = []
    for cand in candidates:
        if is_final(cand):
            safe = cand.watermark if safe is None else max(safe, cand.watermark)
        else:
            pending.append(cand)
    if safe is not None:
        pending = [c for c in pending if c.watermark > safe]
    return safe, pending


@dataclass(frozen=True)
class SliceLedger:
    """A table's partitions read against its committed progress in Kafka.

    `chain` are the uncommitted slices that continue the committed progress without a gap, in order: only they
    can ever commit (the publisher accepts a slice only where progress ends). `orphans` are uncommitted slices
    off that chain (cut by a racing cutter, from an older baseline or `start_after`): they can never commit and
    would stall the table, so they are deleted and the range re-cut. `frontier` is where new slices start.
    """

    committed_hi: int
    chain: list[SliceRange]
    orphans: list[SliceRange]

    @property
    def frontier(self) -> int:
        return self.chain[-1].hi if self.chain else self.committed_hi


def reconcile(slices: list[SliceRange], committed_hi: int) -> SliceLedger:
    """Split partitions above committed progress into the chain that continues it and the orphans."""
    open_slices = sorted((s for s in slices if s.hi > committed_hi), key=lambda s: (s.lo, s.hi))
    chain: list[SliceRange] = []
    position = committed_hi
    for s in open_slices:  # sorted by lo: the first slice starting at `position` continues the chain
        if s.lo == position:
            chain.append(s)
            position = s.hi
    on_chain = set(chain)
    return SliceLedger(committed_hi, chain, [s for s in open_slices if s not in on_chain])


@dataclass(frozen=True)
class RowSkip:
    """One `skip_watermarks` entry: the rows at `watermark` whose `match` columns hold those values (compared as
    the source renders them as text). A bare value has no `match`: it stands for every row at its watermark, so it
    is refused where it matches more than one (one row is what a skip leaves out)."""

    watermark: int
    match: tuple[tuple[str, str], ...] = ()

    @property
    def bare(self) -> bool:
        return not self.match

    def to_record(self) -> int | dict[str, object]:
        """As a progress record keeps it: a bare value as the integer (as records have always kept it), a row as
        its watermark and columns."""
        return self.watermark if self.bare else {"watermark": self.watermark, "match": dict(self.match)}

    @classmethod
    def from_record(cls, value: int | dict[str, object]) -> RowSkip:
        if isinstance(value, dict):
            match = value.get("match") or {}
            assert isinstance(match, dict)
            return cls(int(value["watermark"]), tuple(sorted((str(c), str(v)) for c, v in match.items())))  # type: ignore[call-overload]
        return cls(int(value))

    def entry(self, timestamps: bool, tie_break: str | None) -> str:
        """The entry as a user writes it in rowrelay.yaml (YAML flow style): the bare value, or a mapping naming
        the row by its tie_break or its key columns."""
        at = watermark_text(self.watermark, timestamps)
        if self.bare:
            return at
        if tie_break is not None and [c for c, _ in self.match] == [tie_break]:
            return f"{{watermark: {at}, tie_break: {_yaml_scalar(self.match[0][1])}}}"
        key = ", ".join(f"{c}: {_yaml_scalar(v)}" for c, v in self.match)
        return f"{{watermark: {at}, key: {{{key}}}}}"


def _yaml_scalar(text: str) -> str:
    """A column's value as YAML reads back the same text: an integer bare, anything else quoted."""
    if re.fullmatch(r"-?[1-9][0-9]*|0", text):
        return text
    return "'" + text.replace("'", "''") + "'"
