"""`rowrelay verify` of one table's channel: its topic against its source rows up to its committed progress."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from resources.config import TableConfig
from resources.exactly_once import (
    RESET_PREFIX,
    ProgressRecord,
    TableChannel,
    live_records,
    read_committed_progress,
)
from resources.verify.compare import (
    MAX_RECHECKED_VALUES,
    ResetSplit,
    RowDifference,
    SourceRows,
    VerifyReport,
    compare_rows,
    kept_messages,
    progress_after_reading,
    split_at_reset,
)
from resources.verify.source import source_ties, source_watermarks
from resources.verify.topic import HASH_MASK, TopicWatermarks, topic_watermarks

# Opens the table's source for one read: its SourceDatabaseResource and reflected TableShape, disposed on exit.
OpenSource = Callable[[], AbstractContextManager[tuple[Any, Any]]]


@dataclass
class ComparedRange:
    """Where the comparison starts and ends, the live slices in between and the resets that cut the topic."""

    start: int | None
    hi: int
    record: str | None  # what set `start`, when not the first slice or start_after
    slices: list[ProgressRecord]
    reset: ProgressRecord | None  # the newest start, if it is a reset
    earlier_resets: list[ProgressRecord]


def compared_range(table: TableConfig, history: list[ProgressRecord]) -> ComparedRange:
    """The newest baseline or reset in progress, if any, is where the table starts; else its first slice (where the
    publisher started: `start_after` as it was then, whatever the file says now), else `start_after`."""
    progress = history[-1] if history else None
    start_at = next((r for r in reversed(history) if r.is_start_mark), None)
    slices = [r for r in live_records(history) if r.hi > r.lo]
    start = start_at.hi if start_at else slices[0].lo if slices else table.start_after_watermark
    # Slices published to another topic (`topic:` changed since): this topic holds the rows after the last of them.
    moved = [r for r in slices if r.topic != table.topic_name and r.hi > (start or 0)]
    record = start_at.slice if start_at else None
    if moved:
        start, record = moved[-1].hi, f"slices up to it went to {sorted({r.topic for r in moved})}"
    resets = [r for r in history if r.slice.startswith(RESET_PREFIX)]
    reset = start_at if start_at and start_at.slice.startswith(RESET_PREFIX) else None
    return ComparedRange(start, progress.hi if progress else (start or 0), record, slices, reset,
                         [r for r in resets if r is not start_at])


def committed_ends(slices: list[ProgressRecord], topic: str) -> dict[int, int]:
    """Per partition, the offset the table's committed slices in `topic` reach (exclusive): the topic's end must
    show them (another producer's open transaction can hold read_committed readers below them)."""
    ends: dict[int, int] = {}
    for r in slices:
        if r.topic == topic:
            for part, (_, last) in r.offsets.items():
                ends[int(part)] = max(ends.get(int(part), 0), last + 1)
    return ends


def counted_messages(split: ResetSplit, skip: range) -> tuple[Counter[int], list[int]]:
    """The compared messages per watermark, and the order violations within each segment."""
    seen: Counter[int] = Counter()
    order: list[int] = []
    for wms in split.kept.values():
        seen.update(w for w in wms if w not in skip)
    for wms in split.segments:
        order += [b for a, b in zip(wms, wms[1:], strict=False) if b < a]
    return seen, order


def differing_values(split: ResetSplit, reading: TopicWatermarks, skip: range, source: SourceRows,
                     seen: Counter[int]) -> list[int]:
    """The shared watermark values whose messages' fingerprints (or counts) differ from the source's rows'."""
    seen_sums: dict[int, int] = {}
    for p, i, w in kept_messages(split, skip, source.fingerprints):
        seen_sums[w] = (seen_sums.get(w, 0) + reading.tie_hashes[p][i]) & HASH_MASK
    return sorted(w for w, f in source.fingerprints.items() if seen[w] != source.counts[w] or seen_sums.get(w) != f)


def rows_by_tie(conf: dict[str, Any], channel: TableChannel, table: TableConfig, span: ComparedRange,
                open_source: OpenSource, differ: list[int], ends: dict[int, int], skip: range
                ) -> tuple[dict[int, Counter[str]], dict[int, Counter[str | None]]]:
    """The `differ` values read again from both sides, by tie_break text: the topic up to `ends` (what the first
    read saw, not messages written since)."""
    with open_source() as (source, shape):
        rows = source_ties(source, shape, table, span.start, span.hi, span.slices, differ)
    again = topic_watermarks(conf, table.topic_name, channel.table, tie_break=table.tie_break, collect=set(differ),
                             ends=ends)
    seen_ties: dict[int, Counter[str | None]] = {}
    for p, i, w in kept_messages(split_at_reset(again, span.reset, span.earlier_resets), skip, rows):
        seen_ties.setdefault(w, Counter())[again.ties.get((p, i))] += 1
    return rows, seen_ties


def fill_report(report: VerifyReport, table: TableConfig, source: SourceRows, seen: Counter[int],
                diff: RowDifference, order: list[int]) -> None:
    report.source_rows = sum(source.counts.values())
    report.skipped_rows = source.skipped
    report.messages = sum(seen.values())
    report.rows_by_tie_break = sum(source.counts[w] for w in source.fingerprints)
    if diff.by_count:
        report.tie_break_unchecked = (f"{len(diff.by_count)} such value(s) whose fingerprints differ: their messages "
                                      f"have no {table.tie_break!r} field (sent before a `columns:` or schema "
                                      f"change?) or there were over {MAX_RECHECKED_VALUES:,} of them, e.g. "
                                      f"{', '.join(map(report.text, sorted(diff.by_count)[:3]))}")
    report.duplicates, report.missing, report.extra = (sum(c.values()) for c in (diff.duplicates, diff.missing,
                                                                                   diff.extra))
    report.order_violations = len(order)
    found = {"duplicates": list(diff.duplicates), "missing": list(diff.missing), "extra": list(diff.extra),
             "order": order}
    report.examples = {k: sorted(v)[:10] for k, v in found.items() if v}


def verify_channel(conf: dict[str, Any], channel: TableChannel, table: TableConfig, history: list[ProgressRecord],
                   open_source: OpenSource) -> VerifyReport:
    """Compare the topic with the source rows up to the committed progress (the last record of `history`, its
    progress records oldest first). The caller has refused what makes a comparison meaningless."""
    progress = history[-1] if history else None
    span = compared_range(table, history)
    report = VerifyReport(table=table.table_id, topic=table.topic_name, committed_hi=progress.hi if progress else None,
                          compared_from=span.start or 0, compared_from_record=span.record)
    with open_source() as (source_db, shape):
        source = source_watermarks(source_db, shape, table, span.start, span.hi, span.slices)
    report.watermark_kind, report.tie_break_unchecked = source.watermark_kind, source.unchecked
    reading = topic_watermarks(conf, table.topic_name, channel.table, tie_break=table.tie_break,
                               shared=source.fingerprints, committed_ends=committed_ends(span.slices, table.topic_name))
    report.replayed, report.other_messages = reading.replayed, reading.other_messages
    split = split_at_reset(reading, span.reset, span.earlier_resets)
    report.before_start = split.before_start
    # Slices committed while the source and the topic were read (a live pipeline): their rows are above `hi` and
    # came with their progress record, so they are left out of the comparison, not reported as extra. A row above
    # the progress read again now has no progress record at all: that one is extra. Only a message written after
    # the newest reset can belong to a slice committed since the progress was read.
    later_hi = progress_after_reading(lambda: read_committed_progress(conf, channel),
                                      max(split.after_reset, default=None), span.hi)
    committed_meanwhile = range(span.hi + 1, later_hi + 1)  # empty unless progress moved on
    seen, order = counted_messages(split, committed_meanwhile)
    # Rows sharing a value: their fingerprints first; the values whose fingerprints differ are read again, from
    # both sides, and compared row by row. Past a bound, by count: the second reads' memory grows with the
    # messages of the values read again.
    differ = differing_values(split, reading, committed_meanwhile, source, seen)
    differ, by_count = differ[:MAX_RECHECKED_VALUES], differ[MAX_RECHECKED_VALUES:]
    ends = reading.ends
    del reading, split  # the topic is read again: not two copies of its watermarks
    rows, seen_ties = (rows_by_tie(conf, channel, table, span, open_source, differ, ends, committed_meanwhile)
                       if differ else ({}, {}))
    diff = compare_rows(source.counts, seen, rows, seen_ties)
    diff.by_count += by_count
    fill_report(report, table, source, seen, diff, order)
    return report
