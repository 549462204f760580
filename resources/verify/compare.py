"""What `rowrelay verify` compares and how: the source's rows per watermark value (and tie_break fingerprints),
the row filter each slice was published with, the topic's messages cut at resets, and the comparison itself."""

from __future__ import annotations

import time
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from resources.exactly_once import ProgressRecord
from resources.slices import RowSkip, watermark_text
from resources.verify.topic import HASH_MASK, TopicWatermarks, tie_hash, tie_text


@dataclass
class VerifyReport:
    table: str
    topic: str
    committed_hi: int | None
    source_rows: int = 0
    messages: int = 0
    duplicates: int = 0
    missing: int = 0
    extra: int = 0
    order_violations: int = 0
    # Left out of the comparison: copies `rowrelay replay` made into this topic, and messages of other tables (or
    # other producers) sharing it.
    replayed: int = 0
    other_messages: int = 0
    # Where the comparison starts: `start_after`, or the newest baseline (start_after: latest) or `rowrelay reset`
    # in the table's progress (rows at or below it are never sent); messages at or below a reset written before
    # the reset's recorded position are left out too (`before_start`), while one at or below a baseline, or at or
    # below a reset but written after it, is still extra.
    compared_from: int = 0
    compared_from_record: str | None = None
    before_start: int = 0
    examples: dict[str, list[int]] = field(default_factory=dict)
    # Rows sharing a watermark value (a `tie_break` table) compared one by one, by their tie_break value: a row sent
    # twice beside a row of the same value never sent is then a duplicate and a missing row, not an even count.
    rows_by_tie_break: int = 0
    tie_break_unchecked: str | None = None  # why rows sharing a value were compared by count only, if they were
    # Source rows the slices' skip_watermarks entries left out: skipped on purpose, neither expected nor missing.
    skipped_rows: int = 0
    # integer, or timestamp / timestamptz: the watermarks above are then microseconds since 1970 UTC, and the text
    # report shows them as UTC times (as keys, `rowrelay status` and the CLI's arguments do).
    watermark_kind: str = "integer"

    def text(self, value: int | None) -> str:
        return "nothing" if value is None else watermark_text(value, self.watermark_kind != "integer")

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.missing or self.extra or self.order_violations)


@dataclass(frozen=True)
class FilterPiece:
    """A watermark range (lo, hi] whose rows were chosen by one row filter: `where` ("": none) and the
    rows `skip` left out."""

    lo: int | None
    hi: int
    where: str
    skip: tuple[RowSkip, ...]


def filter_pieces(start: int | None, upto: int, slices: list[ProgressRecord], where: str | None,
                  skip: list[RowSkip]) -> list[FilterPiece]:
    """(start, upto] in pieces by the row filter that chose their rows: each slice's as its progress record says
    (`where`, `skipped`: a `where:` or `skip_watermarks` changed since must not make its rows look extra or
    missing), consecutive ones with one `where` merged; a slice recorded before rowrelay kept its filter, and any
    range no slice covers, by today's (`where`, `skip`). `slices`: the live slice records, oldest first."""
    pieces: list[FilterPiece] = []

    def add(lo: int | None, hi: int, piece_where: str, piece_skip: list[RowSkip]) -> None:
        if lo is not None and hi <= lo:
            return
        inside = tuple(s for s in piece_skip if (lo is None or s.watermark > lo) and s.watermark <= hi)
        last = pieces[-1] if pieces else None
        if last is not None and last.hi == lo and last.where == piece_where:
            pieces[-1] = FilterPiece(last.lo, hi, last.where, last.skip + inside)
        else:
            pieces.append(FilterPiece(lo, hi, piece_where, inside))

    today = where or ""
    at = start
    for record in sorted(slices, key=lambda r: r.lo):
        if (at is not None and record.hi <= at) or record.lo >= upto:
            continue  # before the compared range, or after it
        if at is None or record.lo > at:
            add(at, record.lo, today, skip)  # a gap no slice covers: today's filter
        lo, hi = record.lo if at is None else max(record.lo, at), min(record.hi, upto)
        add(lo, hi, *record.row_filter(where, skip))
        at = hi
    add(at, upto, today, skip)
    return pieces


@dataclass
class SourceRows:
    """The source's rows `rowrelay verify` expects: a count per watermark value and, where rows share a value and
    the table has a `tie_break`, a fingerprint of those rows' tie_break values."""

    counts: Counter[int]
    watermark_kind: str = "integer"
    # value with two rows or more -> the sum of its rows' `tie_hash` (modulo 2**64)
    fingerprints: dict[int, int] = field(default_factory=dict)
    unchecked: str | None = None  # why shared values are compared by count only (then no fingerprints)
    skipped: int = 0  # rows the slices' skip_watermarks entries left out: not expected in the topic, by design


def tie_fingerprints(rows: Iterable[tuple[int, Any]], tie_break: str) -> SourceRows:
    """`SourceRows` from the source's (watermark, tie_break value) rows: per row a hash, per value a sum and a
    count, so memory grows with the values, as for a count alone."""
    counts: Counter[int] = Counter()
    sums: dict[int, int] = {}
    unchecked = None
    for w, tie in rows:
        counts[w] += 1
        if unchecked is None:
            text = tie_text(tie)
            if text is None:  # e.g. a timestamp: its JSON text is not Python's
                unchecked = (f"tie_break {tie_break!r} holds {type(tie).__name__} values, which verify cannot "
                             "match with the messages' JSON")
                sums = {}
            else:
                sums[w] = (sums.get(w, 0) + tie_hash(text)) & HASH_MASK
    return SourceRows(counts, fingerprints={w: f for w, f in sums.items() if counts[w] > 1}, unchecked=unchecked)


def reset_position(reset: Any, partition: int) -> int | None:
    """Where a reset found the data topic's partition ending once it had fenced the table's publisher (messages
    below it were written before the reset); None for a reset recorded before rowrelay kept it (`topic_ends`
    None). A partition missing from a recorded `topic_ends` (or a topic that did not exist yet: {}) was added
    since: all of it came after."""
    if reset is None or reset.topic_ends is None:
        return None
    return int(reset.topic_ends.get(str(partition), 0))


def sent_before_reset(watermarks: list[int], offsets: list[int], reset_hi: int, end: int | None) -> list[bool]:
    """Which of a partition's messages `rowrelay verify` leaves out as sent before a reset at `reset_hi`: those at
    or below it, written before the reset's position (`end`; None: unknown, by watermark alone)."""
    return [w <= reset_hi and (end is None or o < end) for w, o in zip(watermarks, offsets, strict=True)]


@dataclass
class ResetSplit:
    """A topic's messages around the newest reset, per partition in offset order."""

    kept: dict[int, list[int]]  # the watermarks compared with the source: all but those sent before the reset
    segments: list[list[int]]  # the same, cut at the reset's position: watermarks only grow within each
    after_reset: list[int]  # kept watermarks written after the reset's position (all of them without one)
    before_start: int  # messages left out as sent before the reset
    kept_index: dict[int, list[int]] = field(default_factory=dict)  # where `kept`'s messages are in the reading


def split_at_reset(reading: TopicWatermarks, reset: Any, earlier_resets: Sequence[Any] = ()) -> ResetSplit:
    """What verify compares when the table's newest start is `reset` (a reset's progress record; None: none).
    After a reset back, the re-sent rows follow higher ones sent before it: that seam is not an order violation,
    at `reset` nor at any of `earlier_resets` (the table's older resets, whose positions cut the segments too)."""
    split = ResetSplit({}, [], [], 0)
    for p, wms in reading.partitions.items():
        offsets, end = reading.offsets[p], reset_position(reset, p)
        index = list(range(len(wms)))
        if reset is not None:  # sent before the reset, at or below it: not extra
            before = sent_before_reset(wms, offsets, reset.hi, end)
            split.before_start += sum(before)
            wms, offsets, index = ([x for x, b in zip(xs, before, strict=True) if not b]
                                   for xs in (wms, offsets, index))
        split.kept[p], split.kept_index[p] = wms, index
        later = [w for w, o in zip(wms, offsets, strict=True) if end is None or o >= end]
        split.after_reset += later
        seams = sorted({e for e in (reset_position(r, p) for r in (*earlier_resets, reset)) if e is not None})
        split.segments += [[w for w, o in zip(wms, offsets, strict=True) if bisect_right(seams, o) == i]
                           for i in range(len(seams) + 1)]
    return split


def progress_after_reading(read: Callable[[], Any], highest_seen: int | None, floor: int, tries: int = 5,
                           pause_s: float = 0.3) -> int:
    """The table's committed progress once its topic was read (`floor` if none). A commit's markers reach the data
    topic and the progress topic one after the other, so for a moment a slice's rows can be visible before its
    progress record: while the topic shows a message above the progress, read it again a few times before that
    message counts as extra."""
    hi = floor
    for attempt in range(tries):
        if attempt:
            time.sleep(pause_s)
        record = read()
        hi = record.hi if record is not None else floor
        if highest_seen is None or highest_seen <= hi:
            break
    return hi


@dataclass
class RowDifference:
    """What the topic holds against the source, per watermark value: rows sent more than once, rows never sent,
    messages no source row explains; and the shared values compared by count only, as some of their messages
    have no tie_break field (sent before a `columns:` or schema change)."""

    duplicates: Counter[int] = field(default_factory=Counter)
    missing: Counter[int] = field(default_factory=Counter)
    extra: Counter[int] = field(default_factory=Counter)
    by_count: list[int] = field(default_factory=list)


def compare_rows(counts: Counter[int], seen: Counter[int], source_ties: dict[int, Counter[str]],
                 seen_ties: dict[int, Counter[str | None]]) -> RowDifference:
    """The topic's messages (`seen` per watermark; `seen_ties`: by tie_break text, for the values in
    `source_ties`) against the source's rows (`counts`). A value in `source_ties` is compared row by row: a message
    whose tie_break no row of its value has is extra."""
    diff = RowDifference()
    for w, n in seen.items():
        if w not in counts:
            diff.extra[w] = n
    for w, n in counts.items():
        messages = seen_ties.get(w, Counter())
        if w not in source_ties or None in messages:
            if w in source_ties:
                diff.by_count.append(w)
            if seen[w] > n:
                diff.duplicates[w] = seen[w] - n
            elif seen[w] < n:
                diff.missing[w] = n - seen[w]
            continue
        rows = source_ties[w]
        for tie, k in messages.items():
            if tie not in rows:
                diff.extra[w] += k
            elif k > rows[tie]:
                diff.duplicates[w] += k - rows[tie]
        if unsent := sum((rows - messages).values()):  # type: ignore[operator]
            diff.missing[w] = unsent
    return diff


def kept_messages(split: ResetSplit, skip: Container[int], wanted: Container[int]) -> Iterator[tuple[int, int, int]]:
    """(partition, index in the reading, watermark) of the compared messages (`split.kept`) whose watermark is in
    `wanted` and not in `skip` (slices committed while verify read)."""
    for p, wms in split.kept.items():
        for w, i in zip(wms, split.kept_index[p], strict=True):
            if w in wanted and w not in skip:
                yield p, i, w


MAX_RECHECKED_VALUES = 100_000  # shared values whose fingerprints differ, compared row by row; the rest by count
