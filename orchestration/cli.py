"""`rowrelay` command line: verify a topic against its source table, show progress, set up pools.

    rowrelay verify [--table ID] [--json]   # duplicates, missing, extra, order violations; exit 1 on any
    rowrelay status [--table ID] [--json]   # committed progress, source max, lag (rows, seconds), active runs
    rowrelay pools [--table ID]             # create each table's pool (limit 1) on the Dagster instance
    rowrelay backfill --table ID            # cut the backlog into slices and run them now, in this process
    rowrelay reset --table ID --after W     # deliberate new baseline: rows after W are sent, the rest never
    rowrelay replay --table ID --from A --to B [--topic T]
                                            # republish committed slices (A, B] once more, marked rowrelay.replay
    rowrelay history compact [--table ID] [--full]
                                            # roll up old committed slices now (hour, then day): fewer partitions
    rowrelay schema accept --table ID --reason TEXT
                                            # accept a table's changed columns (on_schema_change: fail stopped it)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import uuid
from array import array
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from math import ceil, isfinite
from typing import TYPE_CHECKING, Any

# numpy's OpenBLAS starts a thread per core at import, and they spin: ~0.1 CPU-s of a backfill on two cores for
# linear algebra rowrelay never does. Before anything imports numpy (the publisher does, below).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from confluent_kafka import Consumer, TopicPartition  # noqa: E402

from orchestration.exits import (  # noqa: E402
    FAILED,
    INTERRUPTED,
    NOT_FINAL,
    OK,
    USAGE,
    bound_process_end,
    finish,
)
from resources.config import ConfigError, RelayConfig, TableConfig, load_config, resolve_env  # noqa: E402
from resources.exactly_once import (  # noqa: E402
    RESET_PREFIX,
    WATERMARK_HEADER,
    KafkaUnavailable,
    LivePiece,
    ProgressRecord,
    live_pieces,
    live_records,
    message_watermark,
    progress_missing,
    read_committed_progress,
    read_progress_history,
    recorded_watermark_kind,
    refuse_watermark_change,
    watermark_change,
)
from resources.keys import (  # noqa: E402
    BACKFILL_TAG,
    BEFORE_RESET_OF,
    PUBLISHED_UP_TO,
    REPLAY_ID,
    RESET_AFTER,
    RUN_FAILED_LATER,
)
from resources.slices import (  # noqa: E402
    RowSkip,
    SliceRange,
    is_timestamp_key,
    micros_text,
    parse_watermark,
    watermark_text,
)

if TYPE_CHECKING:
    from assets.relay import TableLag


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


def kafka_conf(config: RelayConfig) -> dict[str, Any]:
    conf = {k: resolve_env(str(v)) for k, v in config.kafka.producer.items()}
    conf["bootstrap.servers"] = resolve_env(config.kafka.bootstrap_servers)
    return conf


@dataclass
class TopicWatermarks:
    """The watermark header of each committed message of one table in its topic, per partition in offset order;
    and how many messages were not the table's own: replay copies, other tables' or other producers'."""

    partitions: dict[int, list[int]] = field(default_factory=dict)
    offsets: dict[int, list[int]] = field(default_factory=dict)  # each of those messages' offset, alike
    # With `shared` asked for: each message's `tie_hash` where its watermark is shared (0 elsewhere), alike.
    tie_hashes: dict[int, array[int]] = field(default_factory=dict)
    # (partition, index in `partitions[p]`) -> the message's `tie_text` (None: it has no tie_break field), for
    # `collect`'s watermarks.
    ties: dict[tuple[int, int], str | None] = field(default_factory=dict)
    ends: dict[int, int] = field(default_factory=dict)  # the offset each partition was read up to
    replayed: int = 0
    other_messages: int = 0


ENVELOPE_FIELDS = {"op", "data", "source"}
NULL_TIE = "\x00NULL\x00"  # a NULL tie_break: no text a column holds is this
HASH_MASK = (1 << 64) - 1


def tie_text(value: Any) -> str | None:
    """A tie_break value as `rowrelay verify` compares it, the same from the source's driver and from the message's
    JSON: integers, text and UUIDs (a JSON string), NULL; None for another type (its JSON text is not Python's)."""
    if value is None:
        return NULL_TIE
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str):
        return value
    if isinstance(value, uuid.UUID):
        return str(value)
    return None


def tie_hash(text: str | None) -> int:
    """One row's part of its watermark value's fingerprint (the sum of its rows' parts, modulo 2**64): Python's
    hash of the tie text, the same for the source's rows and the messages within one verify."""
    return hash(text) & HASH_MASK


def message_tie(value: bytes | None, tie_break: str) -> str | None:
    """The `tie_text` of a message's tie_break field, None if it has none. An envelope is told by its shape (the
    table's `envelope:` may have changed since the message was sent): its three fields, its row under `data`."""
    try:
        doc = json.loads(value or b"")
    except ValueError:
        return None
    if isinstance(doc, dict) and doc.keys() == ENVELOPE_FIELDS and isinstance(doc["data"], dict):
        doc = doc["data"]
    if not isinstance(doc, dict) or tie_break not in doc:
        return None
    return tie_text(doc[tie_break])


class TopicHeldOpen(KafkaUnavailable):
    """Another producer's transaction is open in the topic below the table's committed messages: read_committed,
    no consumer sees past it until it ends (Kafka aborts it at its transaction timeout at the latest)."""


def held_open_text(tp: TopicPartition, stable: int, needed: int) -> str:
    return (f"{tp.topic}[{tp.partition}] is readable (read_committed) only up to offset {stable}, below the "
            f"committed messages it must show (to offset {needed - 1}): a transaction of another producer is open "
            "there (a table sharing the topic, a `rowrelay replay` into it), and until it ends no consumer of the "
            "topic sees what was committed after it began. Nothing can be told missing yet: try again once it ends "
            "(Kafka aborts it at its transaction.timeout.ms at the latest)")


def topic_watermarks(conf: dict[str, Any], topic: str, table: str, timeout: float = 60.0,
                     tie_break: str | None = None, shared: Container[int] = (), collect: Container[int] = (),
                     ends: dict[int, int] | None = None, committed_ends: dict[int, int] | None = None
                     ) -> TopicWatermarks:
    """Read the topic to its end (or each partition up to `ends`: what an earlier read saw): the table's own
    messages' watermarks (`TopicWatermarks`); with a `tie_break`, the `tie_hash` of the messages whose watermark is
    in `shared` and the `tie_text` of those in `collect` (their JSON parsed only for that). `committed_ends`: per
    partition, the offset the table's committed slices reach (exclusive); an end read below it is another
    producer's open transaction, waited for up to `timeout`, then `TopicHeldOpen` (it was reported as missing
    rows, found by review)."""
    from resources.exactly_once import (
        FAST_READS,
        REPLAY_HEADER,
        TABLE_HEADER,
        base_conf,
        partition_watermarks,
        topic_end_offsets,
    )

    consumer = Consumer({**base_conf(conf), "group.id": f"rowrelay-verify-{uuid.uuid4().hex}",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "auto.offset.reset": "earliest", **FAST_READS})
    out = TopicWatermarks()
    own = table.encode()
    hashing = tie_break is not None and bool(shared)
    try:
        md = consumer.list_topics(topic, timeout=timeout)
        meta = md.topics.get(topic)
        if meta is None or meta.error is not None:
            return out
        log_ends: dict[str, int] | None = None  # uncommitted messages included, asked once if needed
        for p in sorted(meta.partitions):
            tp = TopicPartition(topic, p)
            low, high = partition_watermarks(consumer, tp, timeout, conf)  # a new topic's leader may still move
            needed, waited = (committed_ends or {}).get(p, 0), time.monotonic() + timeout
            if high < needed and ends is None:
                log_ends = topic_end_offsets(conf, topic, timeout) if log_ends is None else log_ends
                # Only where the log holds those offsets (not a topic re-created or truncated since: then they are
                # gone, and the comparison says which rows are missing).
                while high < needed <= log_ends.get(str(p), 0):
                    if time.monotonic() > waited:
                        raise TopicHeldOpen(held_open_text(tp, high, needed))
                    time.sleep(0.5)
                    low, high = partition_watermarks(consumer, tp, timeout, conf)
            if ends is not None:
                high = min(high, ends.get(p, low))
            out.ends[p] = high
            wms, offsets = out.partitions.setdefault(p, []), out.offsets.setdefault(p, [])
            hashes = out.tie_hashes.setdefault(p, array("Q")) if hashing else None
            if high <= low:
                continue
            consumer.assign([TopicPartition(topic, p, low)])
            deadline = time.monotonic() + timeout
            while consumer.position([tp])[0].offset < high:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{topic}[{p}] could not be read to offset {high} (open transaction?)")
                msg = consumer.poll(0.5)
                if msg is None or msg.error():
                    continue
                if msg.offset() >= high:  # written since the end was taken (past a commit marker)
                    break
                deadline = time.monotonic() + timeout
                headers = dict(msg.headers() or [])
                if headers.get(TABLE_HEADER) != own or WATERMARK_HEADER not in headers:
                    out.other_messages += 1
                elif REPLAY_HEADER in headers:
                    out.replayed += 1
                else:
                    wm = int(headers[WATERMARK_HEADER])
                    wms.append(wm)
                    offsets.append(msg.offset())
                    if tie_break is None:
                        continue
                    text = message_tie(msg.value(), tie_break) if wm in shared or wm in collect else None
                    if hashes is not None:
                        hashes.append(tie_hash(text) if wm in shared else 0)
                    if wm in collect:
                        out.ties[(p, len(wms) - 1)] = text
    finally:
        consumer.close()
    return out


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


@contextlib.contextmanager
def source_pieces(config: RelayConfig, table: TableConfig, start: int | None, upto: int,
                  slices: list[ProgressRecord] | None) -> Iterator[tuple[Any, str, list[tuple[Any, FilterPiece]]]]:
    """The table's source, its watermark kind and (start, upto] in pieces, each with the table shape of the row
    filter its slices were published with (`filter_pieces`)."""
    from dataclasses import replace

    from assets.relay import table_shape
    from resources.source_database import SourceDatabaseResource

    source = SourceDatabaseResource.for_source(config.sources[table.source])
    try:
        shape = table_shape(source, table)
        yield source, shape.watermark_kind, [
            (replace(shape, where=piece.where or None), piece)
            for piece in filter_pieces(start, upto, slices or [], table.where, table.skip_rows)]
    finally:
        source.dispose()


def source_watermarks(config: RelayConfig, table: TableConfig, start: int | None, upto: int,
                      slices: list[ProgressRecord] | None = None) -> SourceRows:
    """The source's rows in (start, upto], each slice's by the row filter it was published with: counted per
    watermark, and fingerprinted by tie_break where they share one (`SourceRows`)."""
    with source_pieces(config, table, start, upto, slices) as (source, kind, pieces):
        skipped = sum(source.count_skipped(shape, piece.lo, piece.hi, piece.skip) for shape, piece in pieces)
        if table.tie_break is None:
            counts: Counter[int] = Counter()
            for shape, piece in pieces:
                counts.update(source.iter_watermarks(shape, piece.lo, piece.hi, skip=list(piece.skip)))
            return SourceRows(counts, kind, skipped=skipped)
        found = tie_fingerprints((row for shape, piece in pieces
                                  for row in source.iter_watermark_ties(shape, piece.lo, piece.hi, list(piece.skip))),
                                 table.tie_break)
        found.watermark_kind, found.skipped = kind, skipped
        return found


def source_ties(config: RelayConfig, table: TableConfig, start: int | None, upto: int,
                slices: list[ProgressRecord] | None, values: Sequence[int]) -> dict[int, Counter[str]]:
    """The rows of the watermark `values` (those whose fingerprints differed) by tie_break text, read with bounded
    IN lists, each from the pieces it falls in."""
    ties: dict[int, Counter[str]] = {}
    wanted = sorted(values)
    with source_pieces(config, table, start, upto, slices) as (source, _, pieces):
        for chunk in (wanted[i:i + 1000] for i in range(0, len(wanted), 1000)):
            for shape, piece in pieces:
                if (piece.lo is not None and chunk[-1] <= piece.lo) or chunk[0] > piece.hi:
                    continue
                for w, tie in source.iter_watermark_ties(shape, piece.lo, piece.hi, list(piece.skip), only=chunk):
                    text = tie_text(tie)
                    ties.setdefault(w, Counter())[text if text is not None else repr(tie)] += 1
    return ties


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


def verify_table(config: RelayConfig, table: TableConfig) -> VerifyReport:
    """Compare the topic with the source rows up to the table's committed progress."""
    from assets.relay import channel_for
    from resources.exactly_once import progress_recorded_refusal

    conf = kafka_conf(config)
    channel = channel_for(table, config.kafka.transactional_id_prefix)
    history = read_progress_history(conf, channel)  # oldest first: the last record is the committed progress
    progress = history[-1] if history else None
    if progress is not None:  # a comparison in another column's (or kind's) sense would be meaningless
        refuse_watermark_change(progress, reflect_table(config, table).watermark_id)
    elif (missing := progress_missing(conf, channel, reflect_table(config, table).timestamps)) is not None:
        raise missing  # its rows were published under progress this table no longer reads: nothing to compare
    elif os.environ.get("DAGSTER_HOME"):  # verify needs no Dagster instance otherwise: then Kafka alone
        # Empty progress and an empty topic, but Dagster may record committed slices: the progress topic lost after
        # the data topic's messages expired. Comparing from start_after to start_after found nothing and said OK
        # while every run refuses; the run's refusal, with its remedy, says what happened.
        from dagster import DagsterInstance

        from assets.relay import asset_key, last_recorded_slice

        with DagsterInstance.get() as instance:
            recorded = last_recorded_slice(instance, asset_key(table))
        if (refused := progress_recorded_refusal(channel, recorded)) is not None:
            raise refused
    # The newest baseline or reset in progress, if any, is where the table starts; else its first slice (where the
    # publisher started: `start_after` as it was then, whatever the file says now), else `start_after`.
    start_at = next((r for r in reversed(history) if r.is_start_mark), None)
    slices = [r for r in live_records(history) if r.hi > r.lo]
    start = start_at.hi if start_at else slices[0].lo if slices else table.start_after_watermark
    # Slices published to another topic (`topic:` changed since): this topic holds the rows after the last of them.
    moved = [r for r in slices if r.topic != table.topic_name and r.hi > (start or 0)]
    record = start_at.slice if start_at else None
    if moved:
        start, record = moved[-1].hi, f"slices up to it went to {sorted({r.topic for r in moved})}"
    hi = progress.hi if progress else (start or 0)
    report = VerifyReport(table=table.table_id, topic=table.topic_name, committed_hi=progress.hi if progress else None,
                          compared_from=start or 0, compared_from_record=record)
    source = source_watermarks(config, table, start, hi, slices)
    report.watermark_kind, report.tie_break_unchecked = source.watermark_kind, source.unchecked
    # The topic's end must show every committed slice of the table (another producer's open transaction can hold
    # read_committed readers below them).
    committed_ends: dict[int, int] = {}
    for r in slices:
        if r.topic == table.topic_name:
            for part, (_, last) in r.offsets.items():
                committed_ends[int(part)] = max(committed_ends.get(int(part), 0), last + 1)
    reading = topic_watermarks(conf, table.topic_name, channel.table, tie_break=table.tie_break,
                               shared=source.fingerprints, committed_ends=committed_ends)
    report.replayed, report.other_messages = reading.replayed, reading.other_messages
    # Slices committed while the source and the topic were read (a live pipeline): their rows are above `hi` and
    # came with their progress record, so they are left out of the comparison, not reported as extra. A row above
    # the progress read again now has no progress record at all: that one is extra.
    resets = [r for r in history if r.slice.startswith(RESET_PREFIX)]
    reset = start_at if start_at and start_at.slice.startswith(RESET_PREFIX) else None
    earlier_resets = [r for r in resets if r is not start_at]
    split = split_at_reset(reading, reset, earlier_resets)
    report.before_start = split.before_start
    # Only a message written after the newest reset can belong to a slice committed since the progress was read.
    later_hi = progress_after_reading(lambda: read_committed_progress(conf, channel),
                                      max(split.after_reset, default=None), hi)
    committed_meanwhile = range(hi + 1, later_hi + 1)  # empty unless progress moved on
    seen: Counter[int] = Counter()
    order: list[int] = []
    for wms in split.kept.values():
        seen.update(w for w in wms if w not in committed_meanwhile)
    for wms in split.segments:
        order += [b for a, b in zip(wms, wms[1:], strict=False) if b < a]
    # Rows sharing a value: their fingerprints first; the values whose fingerprints differ are read again, from
    # both sides, and compared row by row.
    seen_sums: dict[int, int] = {}
    for p, i, w in kept_messages(split, committed_meanwhile, source.fingerprints):
        seen_sums[w] = (seen_sums.get(w, 0) + reading.tie_hashes[p][i]) & HASH_MASK
    differ = sorted(w for w, f in source.fingerprints.items() if seen[w] != source.counts[w] or seen_sums.get(w) != f)
    # Past a bound, by count: the second reads' memory grows with the messages of the values read again.
    differ, by_count = differ[:MAX_RECHECKED_VALUES], differ[MAX_RECHECKED_VALUES:]
    rows: dict[int, Counter[str]] = {}
    seen_ties: dict[int, Counter[str | None]] = {}
    ends = reading.ends  # the second read sees what the first did, not messages written since
    del reading, split  # the topic is read again: not two copies of its watermarks
    if differ:
        rows = source_ties(config, table, start, hi, slices, differ)
        again = topic_watermarks(conf, table.topic_name, channel.table, tie_break=table.tie_break, collect=set(differ),
                                 ends=ends)
        for p, i, w in kept_messages(split_at_reset(again, reset, earlier_resets), committed_meanwhile, rows):
            seen_ties.setdefault(w, Counter())[again.ties.get((p, i))] += 1
    diff = compare_rows(source.counts, seen, rows, seen_ties)
    diff.by_count += by_count
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
    return report


def _tables(config: RelayConfig, table_id: str | None) -> list[TableConfig]:
    tables = [t for t in config.tables if table_id in (None, t.table_id)]
    if not tables:
        raise ConfigError(f"no configured table {table_id!r}; tables: {[t.table_id for t in config.tables]}")
    return tables


def each_table(config: RelayConfig, tables: list[TableConfig], work: Callable[[TableConfig], Any], failing: str
               ) -> tuple[list[Any], int]:
    """`work` for each table, and how many failed: one table's error a user can act on (`user_error`) is printed
    and must not hide the other tables' results; any other error is a defect and raised."""
    results, failed = [], 0
    for table in tables:
        try:
            results.append(work(table))
        except Exception as exc:
            message = user_error(exc, config)
            if message is None:
                raise
            print(f"rowrelay: {table.table_id} {failing}: {message}", file=sys.stderr)
            failed += 1
    return results, failed


def cmd_verify(config: RelayConfig, args: argparse.Namespace) -> int:
    reports, failed = each_table(config, _tables(config, args.table), lambda t: verify_table(config, t), "not verified")
    if args.json:
        print(json.dumps([{**asdict(r), "ok": r.ok} for r in reports], indent=2))
    else:
        for r in reports:
            print(f"{r.table} -> {r.topic}: committed up to {r.text(r.committed_hi)}, {r.source_rows} source rows, "
                  f"{r.messages} messages; duplicates {r.duplicates}, missing {r.missing}, extra {r.extra}, "
                  f"order violations {r.order_violations} [{'OK' if r.ok else 'FAIL'}]")
            if r.compared_from_record:
                print(f"  compared from {r.text(r.compared_from)} ({r.compared_from_record}); {r.before_start} "
                      "messages at or below it left out")
            if r.skipped_rows:
                print(f"  {r.skipped_rows} source rows skipped (skip_watermarks, as each slice recorded): not sent, "
                      "by design")
            if r.rows_by_tie_break:
                print(f"  {r.rows_by_tie_break} source rows share a watermark value: compared by tie_break too "
                      "(a fingerprint per value; row by row where one differs)")
            if r.tie_break_unchecked:
                print(f"  rows sharing a watermark value compared by count only: {r.tie_break_unchecked}")
            if r.replayed or r.other_messages:
                print(f"  left out: {r.replayed} replayed copies, {r.other_messages} messages of other tables or "
                      "producers")
            for kind, values in r.examples.items():
                shown = values if r.watermark_kind == "integer" else ", ".join(map(r.text, values))
                print(f"  {kind}: e.g. watermarks {shown}")
    return 0 if all(r.ok for r in reports) and not failed else 1


def _active_runs(tables: list[TableConfig]) -> dict[str, int] | None:
    """Queued or running runs per table on the Dagster instance, of its job or the UI's Materialize (as `reset`
    counts them; `status` counted only its job's); None without DAGSTER_HOME."""
    import os

    if not os.environ.get("DAGSTER_HOME"):
        return None
    from dagster import DagsterInstance, RunsFilter

    from orchestration.factory import job_name
    from orchestration.instance import runs_of_table
    from orchestration.runs import ACTIVE

    with DagsterInstance.get() as instance:
        active = instance.get_runs(RunsFilter(statuses=ACTIVE))
        return {t.table_id: len(runs_of_table(active, t, job_name(t))) for t in tables}


def table_status(config: RelayConfig, table: TableConfig) -> TableLag:
    from assets.relay import asset_key, channel_for, last_recorded_slice, measure_lag
    from resources.exactly_once import progress_recorded_refusal
    from resources.source_database import SourceDatabaseResource

    channel = channel_for(table, config.kafka.transactional_id_prefix)
    progress = read_committed_progress(kafka_conf(config), channel)
    first_run = recorded = None
    if progress is None and os.environ.get("DAGSTER_HOME"):  # as the lag check measures a table never committed
        from dagster import DagsterInstance

        from orchestration.factory import first_run_at

        with DagsterInstance.get() as instance:
            first_run = first_run_at(instance, table)
            # Slices Dagster recorded as committed over empty progress: the run refuses, so status says why.
            recorded = last_recorded_slice(instance, asset_key(table))
        if table.start_after == "latest" and (refused := progress_recorded_refusal(channel, recorded)) is not None:
            # measure_lag counts no lag before a `latest` baseline; over those slices the cut refuses it (`plan_cut`).
            raise refused
    source = SourceDatabaseResource.for_source(config.sources[table.source])
    try:
        # Progress missing over rows already published is raised, as `verify` does: the next run refuses too.
        return measure_lag(source, table, progress, channel.start_after, first_run,
                           published=(kafka_conf(config), channel), recorded=recorded)
    finally:
        source.dispose()


def cmd_status(config: RelayConfig, args: argparse.Namespace) -> int:
    tables = _tables(config, args.table)
    lags, failed = each_table(config, tables, lambda t: table_status(config, t), "no status")
    if not lags:
        return 1
    rows = [lag.as_dict() for lag in lags]
    active = _active_runs(tables)
    for row in rows:
        row["active_runs"] = active.get(row["table"]) if active is not None else None
    for lag in lags:
        if (behind := lag.source_behind) is not None:
            print(f"rowrelay: warning: {behind}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 1 if failed else 0
    from rich.console import Console
    from rich.table import Table

    view = Table(title="rowrelay status", title_justify="left")
    for column in ("table", "committed", "source max", "lag rows", "skipped rows", "lag s", "lag measured as",
                   "last commit", "active runs"):
        view.add_column(column, justify="right" if column in ("committed", "source max", "lag rows", "skipped rows",
                                                             "lag s", "active runs") else "left",
                        no_wrap=column in ("committed", "source max"))  # a time watermark reads whole
    basis = {"oldest_unpublished_row": "age of oldest unpublished row", "since_last_commit": "time since last commit",
             "caught_up": "caught up", "unknown": "rows wait, nothing committed yet",
             "awaiting_baseline": "start_after: latest, baseline not recorded yet",
             "since_first_run": "nothing committed; since the table's first run"}

    def cell(value: Any) -> str:
        return "-" if value is None else str(value)

    def mark(row: dict[str, Any], value: int | None) -> str:  # a timestamp watermark as its UTC time
        timestamps = row.get("watermark_kind", "integer") != "integer"
        return cell(value) if value is None else watermark_text(value, timestamps)

    for row in rows:
        view.add_row(row["table"], mark(row, row["committed_hi"]), mark(row, row["source_max"]),
                     cell(row["lag_rows"]), cell(row["skipped_rows"]), cell(row["lag_seconds"]),
                     basis[row["lag_basis"]], cell(row["last_commit_at"]), cell(row["active_runs"]))
    Console(width=max(160, Console().width)).print(view)
    return 1 if failed else 0


def cmd_pools(config: RelayConfig, args: argparse.Namespace) -> int:
    from dagster import DagsterInstance

    from assets.relay import pool_name
    from orchestration.instance import ensure_pool

    with DagsterInstance.get() as instance:
        for t in _tables(config, args.table):
            ensure_pool(instance, pool_name(t))
            print(f"pool {pool_name(t)}: limit {instance.event_log_storage.get_concurrency_info(pool_name(t)).limit}")
    return 0


class BackfillProgress:
    """Slices and rows a backfill has committed, from Kafka's progress (the authority), polled in a thread while
    the runs execute, so the display advances per slice, not per run. A live rich bar on a TTY (slices, rows,
    rows/s, ETA); otherwise one plain line per committed slice."""

    def __init__(self, table_id: str, kafka: dict[str, Any], channel: Any, slices: list[Any], committed_hi: int,
                 total_rows: int, tty: bool, poll_s: float = 0.5) -> None:
        self.table_id, self.kafka, self.channel = table_id, kafka, channel
        self.slices, self.start_hi, self.total_rows = slices, committed_hi, max(total_rows, 1)
        self.tty, self.poll_s = tty, poll_s
        self.seen_hi, self.rows = committed_hi, 0
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rowrelay-backfill-progress", daemon=True)
        self._bar: Any = None
        self._task: Any = None
        self._term: Any = None

    def __enter__(self) -> BackfillProgress:
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

            # Runs execute in this process, and Dagster's compute-log capture points fds 1 and 2 at the run's log
            # files while a step runs: rich would see no terminal and stop drawing. Draw on a duplicate of the
            # terminal's fd, taken now.
            self._term = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
            console = Console(file=self._term, width=shutil.get_terminal_size().columns)
            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                                 TextColumn("{task.fields[slices]} slices"), TextColumn("{task.fields[rows]} rows"),
                                 TextColumn("{task.fields[rate]} rows/s"), TextColumn("ETA"), TimeRemainingColumn(),
                                 console=console)
            self._bar.start()
            self._task = self._bar.add_task(self.table_id, total=self.total_rows, **self._fields())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._advance()  # the last slices, committed since the previous poll
        if self._bar is not None:
            self._bar.stop()
            self._term.close()

    def _fields(self) -> dict[str, str]:
        done = sum(1 for s in self.slices if s.hi <= self.seen_hi)
        return {"slices": f"{done}/{len(self.slices)}", "rows": f"{self.rows:,}/{self.total_rows:,}",
                "rate": f"{self.rows / max(time.monotonic() - self.started, 1e-3):,.0f}"}

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with contextlib.suppress(Exception):  # a failed poll only delays the display, never the backfill
                self._advance()

    def _advance(self) -> None:
        from resources.exactly_once import ProgressTail, live_records, read_progress_history, records_in_range

        # One long-lived reader, re-read only when the topic moved: polling costs the backfill next to nothing.
        progress = ProgressTail.for_channel(self.kafka, self.channel).read(timeout=10)
        if progress is None or progress.hi <= self.seen_hi:
            return
        # Only on a change: the new slices' own row counts, found by search (not a read of all history).
        new = records_in_range(self.kafka, self.channel, SliceRange(self.seen_hi, progress.hi), timeout=10)
        if not new:  # not tiled by slices (a reset in between): read the history
            new = [r for r in live_records(read_progress_history(self.kafka, self.channel, timeout=10))
                   if r.hi > r.lo and self.seen_hi < r.hi <= progress.hi]
        self.seen_hi = progress.hi
        self.rows += sum(r.rows for r in {r.slice: r for r in new}.values())
        fields = self._fields()
        if self._bar is not None:
            self._bar.update(self._task, completed=min(self.rows, self.total_rows), **fields)
            return
        elapsed = time.monotonic() - self.started
        rate = self.rows / max(elapsed, 1e-3)
        eta = (self.total_rows - self.rows) / rate if rate > 0 else float("nan")
        upto = watermark_text(self.seen_hi, bool(self.slices) and self.slices[0].timestamps)
        print(f"{self.table_id}: committed up to {upto}: {fields['slices']} slices, {fields['rows']} rows "
              f"({100 * self.rows / self.total_rows:.0f}%), {fields['rate']} rows/s, ETA {eta:.0f} s", flush=True)


def keep_storage_connections(instance: Any) -> None:
    """Hold one connection per Dagster storage for this process instead of one per storage call.

    Dagster's PostgreSQL storages default to NullPool: every call opens a connection (a backend fork and a SCRAM
    handshake on each side). A CLI backfill that records whole runs in its own process made 121 of them for one
    1M-row slice. `optimize_for_webserver` is how Dagster gives its one long-lived process (the webserver) pooled
    storages (pool_size 1); it is not named for CLI use, so it is called only here. statement_timeout 0: none, as
    with NullPool. A connection the database dropped (a restart) fails one call and is replaced on the next.
    rowrelay's own `PooledPostgresStorage` (dagster.yaml) pools already, with pre-ping: it is left as it is.
    """
    from orchestration.storage import PooledRunStorage

    if isinstance(instance.run_storage, PooledRunStorage):
        return
    instance.optimize_for_webserver(statement_timeout=0, pool_recycle=3600, max_overflow=2)


EARLY_READ_WAIT_S = 10.0


def end_of_startup() -> None:
    """Collect garbage again, now that startup is over, without walking what startup built.

    Importing Dagster, PySpark and pandas and loading the definitions and the instance create ~300k long-lived
    objects, and each full collection meanwhile walks all of them: ~0.3 s of the one busy core before Spark reads
    (`backfill` runs with the collector off until here). gc.freeze moves them out of every later collection.
    Cyclic garbage made meanwhile (a traceback, the cut's polls while the newest rows settle) is frozen with
    them: a little memory for the process's life, against a full walk of the heap to find it.
    """
    gc.freeze()
    gc.enable()


def start_early_read(config: RelayConfig, table: TableConfig, io_manager: Any, started: threading.Event) -> None:
    """Work out the slice a backfill will publish first and start reading its first chunks (EarlyRead), while the
    main thread loads Dagster and creates the run. The same cut as the real one (`plan_cut`, up to the safe
    watermark) from Kafka's progress alone: the run takes the chunks only if its first slice turns out the same.
    Best effort: any error here is the real cut's or the run's to report. `started` is set once the early read is
    registered or given up."""
    from assets.relay import build_table_slices, channel_for
    from orchestration.cutting import SensorState, plan_cut
    from resources.exactly_once import broker_max_transaction_timeout_ms, ensure_topics
    from resources.messages import EARLY_READS
    from resources.source_database import SourceDatabaseResource

    with contextlib.suppress(Exception), contextlib.ExitStack() as finish:
        finish.callback(started.set)  # on every way out: the backfill never waits for a read that gave up
        source = SourceDatabaseResource.for_source(config.sources[table.source])
        finish.callback(source.dispose)  # its pooled connections; the chunks' JDBC reads are Spark's own
        channel = channel_for(table, io_manager.transactional_id_prefix)
        progress = read_committed_progress(io_manager.kafka_conf(), channel)
        if progress is None and table.start_after == "latest":
            return  # the real cut records a baseline first; nothing to guess here
        # As many slices as the early chunks may span (one, unless slices are smaller than chunks).
        depth = io_manager.prefetch_chunks + 1
        plan = plan_cut(table, source, io_manager, progress, [], SensorState(), heal=False, cut_while_pending=True,
                        limit=max(1, min(depth, ceil(depth * io_manager.chunk_rows / table.slice_max_rows))),
                        batch=False)
        slices = build_table_slices(source, io_manager.spark, table, channel, plan.add, plan.committed_hi,
                                    progress.columns if progress else [])
        if plan.add and slices.read is not None and slices.pending == plan.add:
            EARLY_READS.start(map(slices.read, plan.add), io_manager.chunk_rows, depth)
        started.set()  # registered: the run may start
        # The run's publisher would create the table's topics (and read the brokers' transaction limit, cached per
        # process) before its first message: done here, its fencing is then a round trip.
        ensure_topics(io_manager.kafka_conf(), channel)
        broker_max_transaction_timeout_ms(io_manager.kafka_conf())


NO_DAGSTER_HOME = ("set DAGSTER_HOME to the directory holding rowrelay's dagster.yaml (this checkout): the command "
                   "records on the Dagster instance; nothing was done")


def dagster_home_set() -> bool:
    """True if DAGSTER_HOME is set; else says so (`NO_DAGSTER_HOME`) for a command that records on the instance."""
    if os.environ.get("DAGSTER_HOME"):
        return True
    print(f"rowrelay: {NO_DAGSTER_HOME}", file=sys.stderr)
    return False


def cmd_backfill(config: RelayConfig, args: argparse.Namespace) -> int:
    """Cut the table's backlog (up to its safe high watermark) into slices, add them as partitions and run every
    uncommitted slice in this process: one run per `max_slices_per_run` slices, recorded on the Dagster instance
    like any run. The cut is the sensor's (`plan_cut`); fencing and the order check make it safe next to the
    daemon's runs, and partitions a racing cut left off Kafka's progress are healed by the next cut."""
    from dagster import DagsterInstance, RunsFilter
    from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

    from assets.relay import asset_key, channel_for, last_recorded_slice, partitions_for, pool_name
    from orchestration.compaction import open_keys
    from orchestration.cutting import SensorState, cached_table_shape, plan_cut
    from orchestration.factory import build_definitions, job_name
    from orchestration.instance import ensure_pool
    from orchestration.runs import ACTIVE
    from resources.exactly_once import RelayError
    from resources.kafka_io_manager import KafkaIOManager
    from resources.messages import EARLY_READS
    from resources.source_database import InnodbTrxStale, SourceDatabaseResource, SourceError

    (table,) = _tables(config, args.table)
    if not dagster_home_set():  # before the early read: it would create the table's topics
        return 1
    defs = build_definitions(config)
    io_manager: KafkaIOManager = defs.resources["kafka_io_manager"]  # type: ignore[assignment]
    early_started = threading.Event()
    if not args.dry_run:
        # A Spark Connect server that does not answer fails here, in seconds, before anything is cut.
        io_manager.spark.check_server()
        # Spark first: the first slice's first chunks are read (EarlyRead) while Dagster's storage loads and the
        # run is created, on a core that would otherwise idle. The slice is worked out meanwhile (Kafka, the source).
        threading.Thread(target=start_early_read, args=(config, table, io_manager, early_started), daemon=True,
                         name="rowrelay-early-read").start()
        with contextlib.suppress(Exception):  # a Spark that fails now fails the run, with its own message
            io_manager.spark.get_session()
    partitions = partitions_for(table)
    source = SourceDatabaseResource.for_source(config.sources[table.source])
    started = time.monotonic()
    with DagsterInstance.get() as instance:
        keep_storage_connections(instance)
        if not args.dry_run:
            ensure_pool(instance, pool_name(table))
        active = instance.get_runs_count(RunsFilter(job_name=job_name(table), statuses=ACTIVE))
        state = SensorState()
        deadline = time.monotonic() + table.settle_seconds + args.settle_timeout
        try:
            while True:  # the newest rows count once they are final (open transactions, settle delay)
                progress = read_committed_progress(io_manager.kafka_conf(), channel_for(table,
                                                   io_manager.transactional_id_prefix))
                # Only the uncommitted keys matter to a cut: read from the newest end, not all of history.
                keys = open_keys(instance, partitions.name, progress.hi if progress else
                                 channel_for(table, io_manager.transactional_id_prefix).start_after)
                # Refused as the run's publisher would refuse, before a partition is added (and by the dry run):
                # over empty progress, the slices Dagster recorded as committed count too, as in the run.
                recorded = last_recorded_slice(instance, asset_key(table)) if progress is None else None
                # batch=False: a backfill publishes every final row now; holding a few back for `min_slice_rows`
                # (trickle batching) is the sensor's cost control. It waited them out, then called them "not final".
                plan = plan_cut(table, source, io_manager, progress, keys, state, heal=not active,
                                cut_while_pending=True, limit=100_000, write=not args.dry_run, refuse=True,
                                recorded=recorded, batch=False)
                # Only rows not final yet are worth waiting for: a settled candidate is final, held by the cut's limit.
                if plan.add or not plan.state.unsettled or time.monotonic() > deadline:
                    break
                state = plan.state
                time.sleep(0.5)
            # One indexed count for the bar's total, on the cut's connection and shape (reflected moments ago).
            total_rows = (source.count_rows(cached_table_shape(source, table), plan.committed_hi, plan.chain[-1].hi,
                                            table.skip_rows_in(plan.committed_hi, plan.chain[-1].hi) or None,
                                            settled=True)
                          if plan.chain and not args.dry_run else 0)
        except (SourceError, RelayError, InnodbTrxStale) as exc:  # any other error keeps its traceback
            print(f"rowrelay: {exc}", file=sys.stderr)
            return 1
        finally:
            source.dispose()
        # A dry run changes nothing: it says what a backfill would delete, cut and publish.
        would = "would be " if args.dry_run else ""
        if not args.dry_run:
            for orphan in plan.delete:
                instance.delete_dynamic_partition(partitions.name, orphan.key)
            if plan.add:
                instance.add_dynamic_partitions(partitions.name, [s.key for s in plan.add])
        if plan.delete:
            print(f"{table.table_id}: {'would delete' if args.dry_run else 'deleted'} partitions "
                  f"{[s.key for s in plan.delete]}: they do not continue Kafka's progress "
                  f"({plan.text(plan.committed_hi)}) and could never commit", flush=True)
        todo = plan.chain
        print(f"{table.table_id}: committed up to {plan.text(plan.committed_hi)}; {len(plan.add)} new slice(s) "
              f"{would}cut; {len(todo)} slice(s) {'would be published' if args.dry_run else 'to publish'}"
              + (f" ({plan.waiting})" if plan.waiting else ""), flush=True)
        if args.dry_run and plan.add:
            print(f"{table.table_id}: slices {plan.add[0].key} ... {plan.add[-1].key} (dry run: nothing cut, "
                  "added or sent)", flush=True)
        frontier = plan.chain[-1].hi if plan.chain else plan.committed_hi
        if unsettled := plan.state.unsettled:  # rows above what was cut are not final yet
            newest = max(c.watermark for c in unsettled)
            if plan.add:  # cut what was final at once; the newer rows were still settling
                print(f"{table.table_id}: rows above {plan.text(frontier)} (up to {plan.text(newest)}) were not "
                      "final yet (a transaction that may write below them was open): the sensor or the next backfill "
                      "sends them", flush=True)
            else:  # the wait ran out. Not a failure: the rest waits for the next backfill or tick
                print(f"rowrelay: warning: {table.table_id}: rows above {plan.text(frontier)} (up to "
                      f"{plan.text(newest)}) are not final after {args.settle_timeout:g} s: a transaction that may "
                      "still write below them is open (or settle_seconds has not passed), so they were not cut. Run "
                      "backfill again once it ends, or raise --settle-timeout", file=sys.stderr, flush=True)
        elif final := [c.watermark for c in plan.state.pending if c.watermark > frontier]:
            # Final rows beyond the cut's limit of slices: not waiting for anything, only for the next cut.
            print(f"{table.table_id}: rows above {plan.text(frontier)} (up to {plan.text(max(final))}) are final "
                  "but beyond this backfill's slices: the sensor or the next backfill sends them", flush=True)
        if args.dry_run:
            return OK
        if not todo:  # nothing to publish: up to date (done), or the rows there are are not final yet
            return NOT_FINAL if plan.state.unsettled else OK
        job = defs.resolve_job_def(job_name(table))
        end_of_startup()
        early_started.wait(EARLY_READ_WAIT_S)  # a run takes early chunks only once they are registered
        step = table.max_slices_per_run
        channel = channel_for(table, io_manager.transactional_id_prefix)
        tty = sys.stdout.isatty()
        # The bar (or, without a terminal, a line per run) and a failed run's `rowrelay:` line with its cause tell
        # the story; Dagster's step-by-step lines and a failure's stack traces stay in the run's event log (UI).
        run_config = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
        interrupted = False
        try:
            with BackfillProgress(table.table_id, io_manager.kafka_conf(), channel, todo, plan.committed_hi,
                                  total_rows, tty=tty), contextlib.ExitStack() as cleanup:
                cleanup.callback(EARLY_READS.discard)  # chunks no run took (its first slice was another)
                for group in (todo[i:i + step] for i in range(0, len(todo), step)):
                    wait_for_running_runs(instance, job_name(table), table.table_id, on_dead=partial(
                        record_slices_of_dead_run, instance, table, io_manager.kafka_conf(), channel))
                    tags = {ASSET_PARTITION_RANGE_START_TAG: group[0].key,
                            ASSET_PARTITION_RANGE_END_TAG: group[-1].key, BACKFILL_TAG: "cli"}
                    result = job.execute_in_process(run_config=run_config, instance=instance, tags=tags,
                                                    raise_on_error=False)
                    if not result.success and run_interrupted(result):
                        interrupted = True  # Dagster turned the Ctrl-C into a failed run: not a failure to explain
                        break
                    if not result.success:
                        print(f"rowrelay: run {result.run_id} for slices {group[0].key}...{group[-1].key} failed: "
                              f"{run_failure_text(instance, result)}", file=sys.stderr)
                        return 1
                    print(f"slices {group[0].key}...{group[-1].key}: committed (run {result.run_id})", flush=True)
        except KeyboardInterrupt:  # between runs, outside Dagster's handler
            interrupted = True
        if interrupted:
            progress = read_committed_progress(io_manager.kafka_conf(), channel)
            upto = progress.hi if progress is not None else plan.committed_hi
            print(f"rowrelay: {interrupted_text(table.table_id, todo, upto, plan.text)}", file=sys.stderr, flush=True)
            return INTERRUPTED  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped (143 for SIGTERM)
    print(f"{table.table_id}: backfill done in {time.monotonic() - started:.1f} s", flush=True)
    return 0


def wait_for_running_runs(instance: Any, job: str, table_id: str, poll_s: float = 1.0,
                          on_dead: Callable[[Any], list[str]] | None = None) -> None:
    """Wait until no run of the table is starting or running. A backfill executes its runs in its own process,
    outside the run queue where the table's pool (limit 1) is enforced: this is its part of the pool. A run that
    starts meanwhile is still kept exactly once by fencing and the order check (one of the two stops as fenced)."""
    from dagster import DagsterRunStatus, RunsFilter

    from orchestration.launcher import in_process_worker_gone

    running = [DagsterRunStatus.STARTING, DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]
    told = False
    while runs := instance.get_runs(RunsFilter(job_name=job, statuses=running)):
        alive = []
        for run in runs:  # a run of an earlier backfill whose process died would be waited for forever
            if (gone := in_process_worker_gone(run)) is not None:
                instance.report_run_failed(run, f"{gone}; marked failed by rowrelay backfill")
                recorded = on_dead(run) if on_dead is not None else []
                slices = f"; {len(recorded)} slice(s) it committed recorded" if recorded else ""
                print(f"{table_id}: run {run.run_id} was left running by a process that is gone: marked failed"
                      f"{slices}", flush=True)
            else:
                alive.append(run.run_id)
        if not alive:
            return
        if not told:
            print(f"{table_id}: waiting for run(s) {', '.join(alive)} of the table to finish (one at a time per "
                  "table)", flush=True)
            told = True
        time.sleep(poll_s)


def record_slices_of_dead_run(instance: Any, table: TableConfig, conf: dict[str, Any], channel: Any, run: Any
                              ) -> list[str]:
    """The slices a run committed before its process died (SIGKILL, OOM) have no materialization: the run recorded
    none, and no retry of it comes (a backfill executes its runs in its own process; the next backfill cuts on from
    Kafka's progress). Recorded now from their progress records, as a failed range run's are
    (`rowrelay/run_failed_later`). Returns the keys recorded."""
    from dagster import AssetMaterialization, AssetRecordsFilter

    from assets.relay import asset_key, partitions_for
    from orchestration.runs import run_slices
    from resources.exactly_once import tiles_by_range
    from resources.kafka_io_manager import progress_metadata

    span = run_slices(dict(run.tags))
    if span is None:
        return []
    ranges = {k: r for k in instance.get_dynamic_partitions(partitions_for(table).name)
              if span[0].lo <= (r := SliceRange.from_key(k)).lo <= span[1].lo}
    tiles = tiles_by_range(conf, channel, list(ranges.values())) if ranges else {}
    committed = {k: tiles[r][0] for k, r in ranges.items() if len(tiles.get(r, [])) == 1}
    if not committed:
        return []
    known = instance.fetch_materializations(AssetRecordsFilter(asset_key=asset_key(table),
                                                                asset_partitions=list(committed)), limit=1000).records
    recorded = {r.asset_materialization.partition for r in known if r.asset_materialization is not None}
    for key, p in committed.items():
        if key in recorded:
            continue
        instance.report_runless_asset_event(AssetMaterialization(
            asset_key=asset_key(table), partition=key,
            description=f"slice {key} committed by run {run.run_id}, whose process died before recording it",
            metadata={**progress_metadata(p), RUN_FAILED_LATER: run.run_id}))
    return [k for k in committed if k not in recorded]


INTERRUPTS = {"DagsterExecutionInterruptedError", "KeyboardInterrupt"}


def run_interrupted(result: Any) -> bool:
    """Whether an in-process run failed because this process was interrupted (Ctrl-C): Dagster records the
    interrupt as the failure of the step it stopped (DagsterExecutionInterruptedError), or of the run."""
    for event in result.all_events:
        error = getattr(event.event_specific_data, "error", None)  # a step's failure, the run's, an engine event's
        while error is not None:
            if error.cls_name in INTERRUPTS:
                return True
            error = error.cause or error.context
    return False


def interrupted_text(table_id: str, slices: Sequence[SliceRange], committed_hi: int,
                     text: Callable[[int], str]) -> str:
    """What an interrupted backfill says: where the table's progress stands and how to go on. Slices commit one
    transaction each, so what committed stays; an open slice's transaction is aborted, none of it visible."""
    done = sum(1 for s in slices if s.hi <= committed_hi)
    return (f"{table_id}: backfill interrupted: committed up to {text(committed_hi)} ({done}/{len(slices)} slices "
            "of this backfill); nothing of a slice that had not committed is visible. Run `rowrelay backfill "
            f"--table {table_id}` again to continue")


def run_failure_text(instance: Any, result: Any) -> str:
    """Why a backfill's run failed (its first step failure's message) and what to do next."""
    from orchestration.runs import NEXT_STEP
    from resources.kafka_io_manager import STOPPED_TAG

    error = next((e.step_failure_data.error for e in result.all_events
                  if e.is_step_failure and e.step_failure_data and e.step_failure_data.error), None)
    # Past Dagster's wrappers ("Error occurred while executing op ..."): the first error below them names the
    # problem (rowrelay's own says what to change; the librdkafka or driver error under it, less).
    while error is not None and error.cause is not None and error.cls_name.startswith("Dagster"):
        error = error.cause
    reason = re.sub(r"^[\w.]+: ", "", error.message.strip()) if error is not None else "see its events"
    run = instance.get_run_by_id(result.run_id)
    stopped = run.tags.get(STOPPED_TAG) if run is not None else None
    step = NEXT_STEP.get(stopped or "", "slices before it stay committed; run backfill again to continue")
    step = step.replace("run it again", "run backfill again")
    return f"{reason.splitlines()[0]} (details in the Dagster UI). Next: {step}"


def reflect_table(config: RelayConfig, table: TableConfig) -> Any:
    """The table's shape (TableShape), reflected on a source connection of its own; a SourceError says why not."""
    from assets.relay import table_shape
    from resources.source_database import SourceDatabaseResource

    source = SourceDatabaseResource.for_source(config.sources[table.source])
    try:
        return table_shape(source, table)
    finally:
        source.dispose()


def reflected_watermark(config: RelayConfig, table: TableConfig) -> tuple[str, str] | None:
    """The table's watermark column and kind (integer, timestamp, timestamptz) as the source reflects them; None
    where it cannot (a dropped table, the source away)."""
    try:
        shape = reflect_table(config, table)
    except Exception:  # noqa: BLE001 - a reset must stay possible with the table gone
        return None
    return shape.watermark_id


def watermark_is_timestamp(config: RelayConfig, table: TableConfig, reflected: tuple[str, str] | None
                           ) -> bool | None:
    """Whether the table's watermark is a timestamp: from the source's columns (`reflected_watermark`), or where the
    source cannot say from the newest slice in its progress (resets and baselines have integer keys either way);
    None when neither can tell."""
    if reflected is not None:
        return reflected[1] != "integer"
    from assets.relay import channel_for

    with contextlib.suppress(Exception):
        history = read_progress_history(kafka_conf(config), channel_for(table, config.kafka.transactional_id_prefix))
        newest = next((r for r in reversed(history) if r.hi > r.lo), None)
        return None if newest is None else is_timestamp_key(newest.slice)
    return None


def reset_outcome(part: SliceRange, replaced_hi: int, after_text: str, text: Callable[[int], str]
                  ) -> tuple[int, str]:
    """What became of the rows of a partition part (lo, hi] at or below a reset's watermark (`after_text`): those up
    to the progress the reset replaced were published, the rest skipped by it. (watermark published up to, what)."""
    sent_to = min(max(replaced_hi, part.lo), part.hi)
    if sent_to == part.hi:
        return sent_to, f"published before rowrelay reset after {after_text}"
    if sent_to == part.lo:
        return sent_to, f"never sent: skipped by rowrelay reset after {after_text}"
    return sent_to, f"published up to {text(sent_to)} before rowrelay reset after {after_text}, the rest skipped"


@dataclass(frozen=True)
class ResetPartitions:
    """What a reset to W does to a table's partitions (`reset_partitions`)."""

    dropped: list[str]  # deleted
    kept_below: dict[str, SliceRange]  # of those, a straddling one's part (lo, W], materialized without a run
    settled: list[str]  # uncommitted, wholly at or below W: materialized without a run
    # Over empty progress: partitions wholly at or below W that Dagster records as materialized (`recorded`), left
    # as they are (their rows count as published, as the run's refusal counted them).
    recorded: list[str] = field(default_factory=list)


def reset_partitions(ranges: dict[str, SliceRange], after: int, replaced_hi: int, moved: bool,
                     recorded: Container[str] = ()) -> ResetPartitions:
    """The partitions above W are cut again from W, one straddling W keeps its part (lo, W], and uncommitted ones
    wholly at or below W (a reset forward) are settled: no run could ever commit them. `moved`: the reset also says
    where a changed watermark (another column or kind) stands, so the partitions are ranges of the old one: those
    above W or never committed are deleted (read as the new one's ranges they would be orphans, a settled part a
    false statement), the committed ones below stay as the old watermark's history. `recorded`: where the reset
    replaced empty progress (a changed transactional_id_prefix, a lost progress topic), Kafka cannot tell which
    partitions committed: those Dagster holds a materialization of are not settled (they were, or were recorded as,
    published: "never sent" would be false; found by review)."""
    if moved:
        return ResetPartitions([k for k, r in ranges.items() if r.hi > after or r.hi > replaced_hi], {}, [])
    dropped = [k for k, r in ranges.items() if r.hi > after]
    kept = {k: ranges[k].span(ranges[k].lo, after) for k in dropped if ranges[k].lo < after}
    below = [k for k, r in ranges.items() if replaced_hi < r.hi <= after]
    return ResetPartitions(dropped, kept, [k for k in below if k not in recorded],
                           [k for k in below if k in recorded])


def cmd_reset(config: RelayConfig, args: argparse.Namespace) -> int:
    """A deliberate new baseline: the table's progress says "committed up to W", recorded in Kafka (a progress
    record with the reason) and on the Dagster instance (an observation of the table's asset). Rows at or below W
    are then never sent again; rows above W are sent once, whatever the topic already holds. Partitions above W
    are deleted (they are cut again from W); one that straddles W (a slice or roll-up (lo, hi] with lo < W) keeps its
    part below W as the partition (lo, W], materialized: those rows were published before the reset, or, above the
    old progress (a reset forward), skipped by it. Uncommitted partitions entirely at or below W (a reset forward
    over slices cut but not published) are materialized alike: no run could ever commit them. Committed partitions
    at or below W are left as they are."""
    from dagster import AssetMaterialization, AssetObservation, DagsterInstance, MetadataValue

    from assets.relay import asset_key, channel_for, partitions_for, recorded_published
    from orchestration.compaction import keys_version, replace_keys
    from orchestration.factory import job_name
    from orchestration.instance import table_active_runs
    from resources.exactly_once import SlicePublisher

    (table,) = _tables(config, args.table)
    channel = channel_for(table, config.kafka.transactional_id_prefix)
    conf = kafka_conf(config)
    # Asked once: the refusal below, the texts after the reset, and the watermark the reset's value is one of.
    reflected = reflected_watermark(config, table)
    kind = watermark_is_timestamp(config, table, reflected)
    prior = read_committed_progress(conf, channel) if reflected is None else None
    if prior is not None and prior.watermark == table.watermark and prior.watermark_kind:
        # The source away (or the table gone), the column unchanged: the reset keeps the watermark its progress is
        # of, so the next cut still compares it (a record without one would compare nothing from then on).
        reflected = (prior.watermark, prior.watermark_kind)
    wrong = None if kind is None else watermark_kind_error(table.table_id, kind, "--after", args.after)
    if wrong:
        print(f"rowrelay: {wrong}; nothing was reset", file=sys.stderr)
        return 2
    args.after = int(args.after)  # a plain int from here: Dagster's metadata takes no int subclass
    with DagsterInstance.get() as instance:
        # A Materialize from the UI runs `__ASSET_JOB`: counted too (the reset would fence it, with a stop text
        # telling the user nothing was lost).
        active = table_active_runs(instance, table, job_name(table))
        if active and not args.force:
            print(f"rowrelay: {active} run(s) of {table.table_id} are queued or running; stop the table's sensor and "
                  "let them finish (or pass --force: the reset fences a running publisher)", file=sys.stderr)
            return 1
        publisher = SlicePublisher(channel, conf)
        try:
            # `before`: the progress the reset replaced, read by the publisher after it fenced every other (read
            # here first, a run's slice could commit between the read and the fence, and go unreported).
            record, before = publisher.publish_reset(args.after, args.reason, reflected)
        finally:
            publisher.close()
        partitions = partitions_for(table)
        while True:  # read again when a history compaction replaced the keys between this read and the replacement
            version = keys_version(instance, partitions.name)  # before the keys are read, as a compaction takes it
            keys = instance.get_dynamic_partitions(partitions.name)
            # The reset also says where a changed watermark stands: the config's column against the progress's (the
            # source away), or the reflected column and kind.
            moved = before is not None and (watermark_change(before, *reflected) is not None if reflected is not None
                                            else before.watermark is not None and before.watermark != table.watermark)
            # A timestamp watermark's slices have times as keys: the texts below then name times, as --after takes them.
            timestamps = any(map(is_timestamp_key, keys)) or (before is not None and is_timestamp_key(before.slice))
            if moved or (not keys and (before is None or before.hi == before.lo)):  # the source's column tells
                timestamps = bool(kind)

            replaced_hi = before.hi if before else channel.start_after
            was = "empty" if before is None else watermark_text(before.hi, (recorded_watermark_kind(before) or (
                "timestamp" if timestamps else "integer")) != "integer")
            ranges = {key: SliceRange.from_key(key) for key in keys}
            # Empty progress says nothing of what was published (a new prefix, a lost progress topic): Dagster's own
            # record of each partition at or below W does (the run's refusal went by it too), not "never sent".
            published = {} if before is not None else recorded_published(
                instance, asset_key(table), [k for k, r in ranges.items() if r.hi > replaced_hi and r.lo < args.after])

            plan = reset_partitions(ranges, args.after, replaced_hi, moved, published)
            dropped, settled = plan.dropped, plan.settled
            # One transaction: killed between a delete and its add, (lo, W] was left without a partition for good.
            kept = [(key, below) for key in dropped if (below := plan.kept_below.get(key)) is not None]
            if replace_keys(instance, partitions.name, version, list(dropped), [below.key for _, below in kept]):
                break

        def text(value: int) -> str:
            return watermark_text(value, timestamps)

        def settle(key: str, part: SliceRange) -> None:
            """Materialize `part` (of partition `key`) without a run, saying what became of its rows."""
            sent_to, what = reset_outcome(part, max(replaced_hi, published.get(key, replaced_hi)), text(args.after),
                                          text)
            of = f" of {key}" if part.key != key else ""
            instance.report_runless_asset_event(AssetMaterialization(
                asset_key=asset_key(table), partition=part.key, description=f"rows {part}{of}, {what}",
                metadata={BEFORE_RESET_OF: key, PUBLISHED_UP_TO: sent_to,
                          "reason": args.reason}))

        for key, below in kept:  # else (lo, W] would have no partition
            settle(key, below)
        for key in settled:
            settle(key, SliceRange.from_key(key))
        instance.report_runless_asset_event(AssetObservation(
            asset_key=asset_key(table), description=f"rowrelay reset: new baseline after watermark {text(args.after)}",
            metadata={RESET_AFTER: args.after, "reason": args.reason,
                      "previous_progress": before.hi if before else MetadataValue.null(),
                      "partitions_deleted": len(dropped), "partitions_settled": len(settled),
                      "partitions_recorded_committed": len(plan.recorded), "committed_at": record.committed_at}))
    if before is None:  # Kafka knew nothing: what is said comes from Dagster's materializations
        below_text = ((f"; {len(plan.recorded)} partition(s) at or below it that Dagster records as committed left "
                       "as they are (progress was empty: their rows count as published)" if plan.recorded else "")
                      + (f"; {len(settled)} partition(s) at or below it that Dagster records no materialization of "
                         f"materialized as settled by the reset (rows above {text(replaced_hi)} in them never sent "
                         "by a run of theirs)" if settled else ""))
    else:
        below_text = (f"; {len(settled)} uncommitted partition(s) at or below it materialized as settled by the "
                      f"reset (rows above {text(replaced_hi)} in them never sent)" if settled else "")
    deleted = (f"{len(dropped)} partition(s) of the previous watermark deleted (above it or never committed), its "
               "committed ones below it kept as its history" if moved else
               f"{len(dropped)} partition(s) above it deleted{below_text}")
    where = f" in watermark {reflected[0]!r} ({reflected[1]})" if moved and reflected else ""
    print(f"{table.table_id}: progress reset to {text(args.after)}{where} (was {was}); {deleted}; rows after "
          f"{text(args.after)} will be sent", flush=True)
    return 0


class ReplayError(ValueError):
    """A replay request that cannot be served as asked; the message says what to fix. Nothing was produced."""


def replay_records(history: list[Any], committed_hi: int | None, table_id: str, lo: int, hi: int
                   ) -> list[LivePiece]:
    """The committed pieces (slices, or a slice's part below a reset inside it) that exactly cover (lo, hi], in
    order, or a ReplayError. For a timestamp watermark (the slices' keys are times) the errors name UTC times, as
    --from and --to take them."""
    # Resets (lo == hi) carry no messages, and a reset back supersedes the slices above it (live_pieces): after a
    # table was re-created and reset, the old table's slices are not the range's, even where their bounds fit.
    pieces = {(p.lo, p.hi): p for p in live_pieces(history)}
    timestamps = any(is_timestamp_key(p.record.slice) for p in pieces.values())

    def text(value: int) -> str:
        return watermark_text(value, timestamps)

    if pieces and (wrong := next(filter(None, (watermark_kind_error(table_id, timestamps, flag, value)
                                                for flag, value in (("--from", lo), ("--to", hi)))), None)):
        raise ReplayError(wrong)
    if hi <= lo:
        raise ReplayError(f"--to ({text(hi)}) must be greater than --from ({text(lo)})")
    if committed_hi is None or hi > committed_hi:
        raise ReplayError(f"{table_id}: range ({text(lo)}, {text(hi)}] is not fully committed: committed progress "
                          f"ends at {text(committed_hi) if committed_hi is not None else 'nothing yet'}")
    los, his = sorted({a for a, _ in pieces}), sorted({b for _, b in pieces})
    bad = ([f"--from {text(lo)}"] if lo not in los else []) + ([f"--to {text(hi)}"] if hi not in his else [])
    if bad:
        def near(values: list[int], v: int) -> str:
            return ", ".join(map(text, sorted(sorted(values, key=lambda x: abs(x - v))[:5])))
        raise ReplayError(f"{table_id}: {' and '.join(f'{b} is not a slice bound' for b in bad)}; slice lower "
                          f"bounds near --from: [{near(los, lo)}], upper bounds near --to: [{near(his, hi)}]")
    chain, at = [], lo
    while at < hi:
        nxt = [p for (a, b), p in pieces.items() if a == at and b <= hi]
        if not nxt:
            raise ReplayError(f"{table_id}: no committed slice starts at {text(at)} within ({text(lo)}, {text(hi)}] "
                              "(progress records compacted away or a reset in between); pick bounds inside one run "
                              "of slices")
        piece = max(nxt, key=lambda p: p.hi)
        chain.append(piece)
        at = piece.hi
    return chain


def replay_range(config: RelayConfig, table: TableConfig, lo: int, hi: int, topic: str | None) -> dict[str, Any]:
    """Republish the committed messages of the slices covering (lo, hi] to `topic` (default: the table's) in one
    transaction of the replay's own transactional id, each with its original headers plus `rowrelay.replay`. Reads
    the data topic by the recorded offsets, never the source; never writes the table's progress."""
    from confluent_kafka import KafkaException, Producer
    from confluent_kafka.admin import AdminClient

    from assets.relay import channel_for
    from resources.exactly_once import (
        REPLAY_HEADER,
        base_conf,
        call_retrying,
        outcome_unknown,
        read_progress_history,
        read_published_messages,
        transaction_timeout_ms,
    )

    channel = channel_for(table, config.kafka.transactional_id_prefix)
    conf = kafka_conf(config)
    target = topic or table.topic_name
    history = read_progress_history(conf, channel)
    committed = read_committed_progress(conf, channel)
    records = replay_records(history, committed.hi if committed else None, table.table_id, lo, hi)
    meta = AdminClient(base_conf(conf)).list_topics(target, timeout=30).topics.get(target)
    if meta is None or meta.error is not None or not meta.partitions:
        raise ReplayError(f"topic {target!r} does not exist; create it first (rowrelay never creates a replay "
                          "target) or pass an existing --topic")
    needed = max((int(p) for piece in records for p in piece.record.offsets), default=0)
    if needed >= len(meta.partitions):
        raise ReplayError(f"topic {target!r} has {len(meta.partitions)} partition(s); the range's messages are in "
                          f"partition {needed} of {channel.topic}: give --topic a topic with at least {needed + 1}")
    replay_id = f"replay-{uuid.uuid4().hex[:12]}"
    # The publisher's transaction timeout (the user's, else 10 minutes), not librdkafka's 60 s: a replay of a large
    # range is one transaction, and the broker aborted it after a minute with a bare KafkaException (found by review).
    timeout_ms = transaction_timeout_ms(conf)
    producer = Producer({"queue.buffering.max.messages": 500_000, **conf,
                         "transactional.id": f"{config.kafka.transactional_id_prefix}.replay.{table.table_id}",
                         "enable.idempotence": True, "transaction.timeout.ms": timeout_ms})
    marker = (REPLAY_HEADER, replay_id.encode())
    rows = 0
    began = time.monotonic()
    committing = False

    def produce(msg: Any) -> None:
        # Same partition as the original: per partition, consumers see watermark order again.
        while True:
            try:
                producer.produce(target, msg.value(), msg.key(), partition=msg.partition(),
                                 headers=[*(msg.headers() or []), marker])
                return
            except BufferError:  # the local queue is full: let deliveries drain it, then produce the message
                producer.poll(0.5)

    try:
        producer.init_transactions(60)  # fences an earlier replay of this table that is still open
        producer.begin_transaction()
        try:
            for piece in records:
                read = 0
                for msg in read_published_messages(conf, piece.record):
                    read += 1  # the whole slice is read, a piece cut by a reset too: its count checks the read
                    wm = message_watermark(msg) if piece.hi < piece.record.hi else None
                    if wm is not None and wm > piece.hi:
                        continue  # above a reset inside the slice: sent again by a later slice, not this range's
                    produce(msg)
                    rows += 1
                    producer.poll(0)
                if read != piece.record.rows:
                    raise ReplayError(f"{table.table_id}: read {read} messages of slice {piece.record.slice}, but "
                                      f"its progress record says {piece.record.rows}; nothing was replayed")
            committing = True
            # Called again on a retriable error (a timeout: the commit goes on in the background), as the publisher
            # does. It was aborted at once instead, which librdkafka refuses then, and the replay said "nothing was
            # replayed, run the replay again" while the commit could still complete (found by review).
            call_retrying(producer.commit_transaction, REPLAY_COMMIT_TIMEOUT_S)
        except BaseException as exc:
            if committing and isinstance(exc, KafkaException) and outcome_unknown(exc.args[0]):
                raise ReplayError(replay_unknown_text(table.table_id, rows, exc.args[0].str(), target,
                                                      replay_id)) from None
            with contextlib.suppress(KafkaException):
                producer.abort_transaction(30)
            if isinstance(exc, KafkaException):
                elapsed = time.monotonic() - began
                cause = (f"it was open {elapsed:.0f} s, past transaction.timeout.ms ({timeout_ms} ms), so Kafka "
                         "aborted it: replay the range in parts (--from/--to), or raise kafka.producer "
                         "transaction.timeout.ms up to the brokers' transaction.max.timeout.ms"
                         if elapsed * 1000 >= 0.9 * timeout_ms else "run the replay again")
                raise ReplayError(f"{table.table_id}: the replay's transaction ({rows} messages produced) failed: "
                                  f"{exc.args[0].str() if exc.args else exc}; nothing was replayed, {cause}") from None
            raise
    finally:
        with contextlib.suppress(KafkaException):
            producer.flush(5)
    return {"table": table.table_id, "replay_id": replay_id, "from": int(lo), "to": int(hi), "rows": rows,
            "topic": target,
            "slices": [piece.key for piece in records]}


REPLAY_COMMIT_TIMEOUT_S = 60  # one commit_transaction call of a replay; retried (call_retrying) while retriable


def replay_unknown_text(table_id: str, rows: int, error: str, target: str, replay_id: str) -> str:
    """A replay whose commit still failed with a retriable error after its retries: it may have committed."""
    return (f"{table_id}: the replay's transaction ({rows} messages produced) did not confirm its commit ({error}): "
            "outcome unknown, the commit may still complete in the background. Check topic "
            f"{target} for messages with header rowrelay.replay={replay_id} before running the replay again (if "
            "they are there, the range was replayed, and running it again sends it twice)")


def cmd_replay(config: RelayConfig, args: argparse.Namespace) -> int:
    """An explicit, recorded republish of a committed range, for a consumer that lost data."""

    from resources.exactly_once import RelayError

    (table,) = _tables(config, args.table)
    if not dagster_home_set():
        return 1
    from dagster import AssetObservation, DagsterInstance

    from assets.relay import asset_key

    with DagsterInstance.get() as instance:
        try:
            done = replay_range(config, table, args.from_, args.to, args.topic)
        except (ReplayError, RelayError) as exc:
            print(f"rowrelay: {exc}", file=sys.stderr)
            return 1
        timestamps = any(map(is_timestamp_key, done["slices"]))
        span = f"({watermark_text(args.from_, timestamps)}, {watermark_text(args.to, timestamps)}]"
        instance.report_runless_asset_event(AssetObservation(
            asset_key=asset_key(table),
            description=f"rowrelay replay {done['replay_id']}: {span} republished to {done['topic']}",
            metadata={REPLAY_ID: done["replay_id"], "from": int(args.from_), "to": int(args.to),
                      "rows": done["rows"], "topic": done["topic"], "slices": len(done["slices"])}))
    if args.json:
        print(json.dumps(done, indent=2))
    else:
        print(f"{table.table_id}: replayed {span} = {len(done['slices'])} slice(s), "
              f"{done['rows']} messages to {done['topic']} with header rowrelay.replay={done['replay_id']}; "
              "progress unchanged", flush=True)
    return 0


def cmd_history(config: RelayConfig, args: argparse.Namespace) -> int:
    """`history compact`: apply the slice-history policy now (the history sensor does it every few minutes).
    `--full` reads the whole progress topic (what the sensor does on a table's first compaction)."""
    from dagster import DagsterInstance

    from orchestration.compaction import iter_compact

    tables = _tables(config, args.table)
    with DagsterInstance.get() as instance:
        results = []
        for result in iter_compact(instance, tables, kafka_conf(config), config.kafka.transactional_id_prefix,
                                   full=args.full):
            results.append(result)
            if not args.json:
                print(result.line(), flush=True)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    return 0


def cmd_schema(config: RelayConfig, args: argparse.Namespace) -> int:
    """`schema accept`: a human accepts the table's current columns after a change stopped it (on_schema_change:
    fail). Recorded in Kafka's progress (the same committed range, the new columns, the reason); progress does not
    move, and the sensor's next retry of the waiting slice publishes with the new columns."""
    from assets.relay import channel_for
    from resources.exactly_once import RelayError, SlicePublisher
    from resources.source_database import SourceError, schema_change

    (table,) = _tables(config, args.table)
    try:
        shape = reflect_table(config, table)
    except SourceError as exc:
        print(f"rowrelay: {exc}", file=sys.stderr)
        return 1
    channel = channel_for(table, config.kafka.transactional_id_prefix)
    committed = read_committed_progress(kafka_conf(config), channel)
    if committed is not None and [list(c) for c in committed.columns] == shape.schema_columns:
        # Nothing stops the table for its columns (a run compares these), so a record would only add noise to its
        # progress. Exit 0: what the command is for holds, the current columns are the accepted ones.
        print(f"{table.table_id}: nothing to accept: the table's columns are those of its committed progress (up to "
              f"{shape.watermark_text(committed.hi)}); nothing was recorded", flush=True)
        return 0
    publisher = SlicePublisher(channel, kafka_conf(config))
    try:
        before = committed.columns if committed else []
        record = publisher.accept_schema(shape.schema_columns, shape.fingerprint, args.reason)
    except RelayError as exc:
        print(f"rowrelay: {exc}", file=sys.stderr)
        return 1
    finally:
        publisher.close()
    change = schema_change(before, shape.schema_columns).describe() or "no change"
    print(f"{table.table_id}: columns accepted ({change}); fingerprint {record.schema_fingerprint}; progress stays "
          f"at {shape.watermark_text(record.hi)}", flush=True)
    return 0


class WatermarkArg(int):
    """A watermark given on the command line, remembering whether it was written as a time: `--after 2026-01-01`
    on an integer watermark is a mistake to refuse, not the integer 1767225600000000 (after which no row would ever
    be sent), and `--after 1764547200` on a timestamp watermark is not 1970-01-01T00:29:24.547200Z."""

    text: str
    is_time: bool


def watermark(text: str) -> WatermarkArg:
    """argparse type: an integer watermark or an ISO-8601 time (its error message names both)."""
    try:
        value = WatermarkArg(parse_watermark(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    value.text, value.is_time = text, not _is_integer(text)
    return value


def seconds(text: str) -> float:
    """argparse type: a duration in seconds, 0 or more and finite (a negative wait has no meaning; NaN and
    infinity never end one)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds >= 0")
    return value


def _is_integer(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def watermark_kind_error(table_id: str, timestamps: bool, flag: str, value: int) -> str | None:
    """The refusal for a watermark written as the other kind than the table's (a time for an integer watermark, an
    integer for a timestamp one); None when it matches, or when it was not given on the command line."""
    if not isinstance(value, WatermarkArg) or value.is_time == timestamps:
        return None
    if timestamps:
        try:
            meaning = f"would be {micros_text(value)}"
        except (OverflowError, ValueError):
            meaning = "is past any time"
        return (f"{table_id}: {flag} {value.text} is an integer, but the table's watermark is a timestamp: give a "
                f"time such as 2026-11-23T07:00:00Z (read as microseconds since 1970, {value.text} {meaning})")
    return (f"{table_id}: {flag} {value.text} is a time, but the table's watermark is an integer: give an integer "
            f"(the time would be read as {int(value)})")


def source_error_text(exc: Any, config: RelayConfig | None) -> str:
    """A source database that cannot be reached or refuses the login: which source, and the setting and variables
    its URL takes (SourceDatabaseResource marks the error with the URL as configured)."""
    from resources.source_database import SourceDatabaseResource

    cause = (str(exc.orig).strip().splitlines() or ["no detail"])[0]
    url = getattr(exc, "source_url", None)
    names = [n for n, src in (config.sources.items() if config else []) if src.url == url]
    if url is None or not names:
        return f"a database could not be reached or refused the request: {cause}"
    where = SourceDatabaseResource(url=url).sqlalchemy_url.render_as_string(hide_password=True)
    variables = re.findall(r"\$\{(\w+)", url)
    takes = f" and the environment variable{'s' if len(variables) > 1 else ''} it reads ({', '.join(variables)})" \
        if variables else ""
    return (f"source {names[0]!r} ({where}) could not be reached or refused the login: {cause}; check "
            f"sources.{names[0]}.url in rowrelay.yaml{takes}")


def dagster_storage_text(exc: BaseException) -> str:
    """dagster-postgres's `too many retries for DB connection`: the database it tried, and the settings to check."""
    cause = str(exc.__cause__ or exc).strip().splitlines()
    env = {k: os.environ.get(f"DAGSTER_PG_{k}", "?") for k in ("DB", "HOST", "PORT", "USER")}
    return (f"the Dagster storage database {env['DB']!r} on {env['HOST']}:{env['PORT']} (user {env['USER']}) could "
            f"not be reached: {cause[0] if cause else exc}; check the DAGSTER_PG_DB, DAGSTER_PG_HOST, DAGSTER_PG_PORT, "
            "DAGSTER_PG_USER and DAGSTER_PG_PASSWORD settings rowrelay's dagster.yaml reads (in DAGSTER_HOME="
            f"{os.environ.get('DAGSTER_HOME', '')}); `make stack` writes the local stack's to stack.env")


def dagster_home_problem() -> str | None:
    """DAGSTER_HOME set to a directory without a dagster.yaml: Dagster would keep runs and records in SQLite files of
    its own there, out of the daemon's sight, and say nothing."""
    home = os.environ.get("DAGSTER_HOME")
    if not home or os.path.isfile(os.path.join(home, "dagster.yaml")):
        return None
    return (f"DAGSTER_HOME={home} holds no dagster.yaml: set DAGSTER_HOME to the directory holding rowrelay's "
            "dagster.yaml (the checkout), or copy it there; nothing was done")


class _StorageRetryLines(logging.Filter):
    """dagster-postgres logs each retry of its storage connection on the root logger (`WARNING:root:Retrying failed
    database connection`): noise before the one line that says what failed and what to check."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Retrying failed database")


STORAGE_RETRY_LINES = _StorageRetryLines()


def user_error(exc: BaseException, config: RelayConfig | None = None) -> str | None:
    """The message for an error a user causes or fixes (a database or Kafka away, a table missing, DAGSTER_HOME
    unset, a run's slices changed under it), instead of a traceback; None for anything else. Imported only here,
    once something failed: the happy path does not import these modules for it."""
    import sqlalchemy as sa
    from dagster import DagsterInvalidInvocationError
    from dagster._core.errors import DagsterHomeNotSetError  # not exported publicly; what DagsterInstance.get raises

    from resources.exactly_once import RelayError
    from resources.source_database import InnodbTrxStale, SourceError
    from resources.spark import SparkUnreachable

    if isinstance(exc, SourceError | RelayError | InnodbTrxStale | SparkUnreachable):
        return str(exc)
    if isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError):
        return source_error_text(exc, config)
    if type(exc).__name__ == "DagsterPostgresException":  # dagster-postgres gave up connecting to its storage
        return dagster_storage_text(exc)
    if isinstance(exc, DagsterHomeNotSetError):
        return NO_DAGSTER_HOME
    if isinstance(exc, DagsterInvalidInvocationError) and "partition" in str(exc).lower():
        return ("the table's slices changed while this command ran (a `rowrelay reset` or another cut deleted "
                f"them): {str(exc).splitlines()[0]}; what committed stays committed: run the command again")
    return None


COMMAND_SUMMARIES = {
    "verify": "compare a topic with its source table: duplicates, missing, extra, order; exit 1 on any",
    "status": "committed progress, source max, lag and active runs of each table",
    "pools": "create each table's pool (limit 1) on the Dagster instance",
    "backfill": "cut the backlog into slices and run them now, in this process",
    "reset": "set a deliberate new baseline: rows after it are sent, the rest never",
    "replay": "republish committed slices once more, marked rowrelay.replay",
    "history": "roll up old committed slices now: fewer partitions",
    "schema": "accept a table's changed columns after on_schema_change: fail stopped it",
}


def main(argv: list[str] | None = None) -> int:
    """The `rowrelay` command; called without `argv` it is the process (the entry point, `python -m`), whose end it
    bounds (exits.bound_process_end, exits.finish); a caller passing `argv` keeps its own process as it is."""
    own_process = argv is None
    if own_process:
        bound_process_end(next((a for a in sys.argv[1:] if a in COMMAND_SUMMARIES), "rowrelay"))
    code = run_command(argv)
    return finish(code) if own_process else code


def run_command(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="rowrelay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="rowrelay.yaml (default: $ROWRELAY_CONFIG or ./rowrelay.yaml)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, summary in COMMAND_SUMMARIES.items():
        p = sub.add_parser(name, help=summary, description=summary)
        if name == "schema":
            p.add_argument("action", choices=["accept"], help="accept: record the table's current columns after a "
                           "change stopped it (on_schema_change: fail)")
            p.add_argument("--table", required=True, help="<source>.<schema>.<table>")
            p.add_argument("--reason", required=True, help="why the change is fine (kept in the progress record)")
        elif name == "history":
            p.add_argument("action", choices=["compact"], help="compact: roll up old committed slices now")
            p.add_argument("--table", help="<source>.<schema>.<table> (default: all)")
            p.add_argument("--full", action="store_true", help="read the whole progress topic (first compaction "
                           "of an existing deployment); default: the last few days")
        elif name == "replay":
            p.add_argument("--table", required=True, help="<source>.<schema>.<table>")
            p.add_argument("--from", dest="from_", metavar="FROM", required=True, type=watermark,
                           help="lower bound (exclusive): a committed slice's lower bound (a time for a timestamp "
                           "watermark, e.g. 2026-11-23T07:00:00Z)")
            p.add_argument("--to", required=True, type=watermark,
                           help="upper bound (inclusive): a committed slice's upper bound")
            p.add_argument("--topic", help="an existing topic to replay to (default: the table's topic)")
        elif name == "reset":
            p.add_argument("--table", required=True, help="<source>.<schema>.<table>")
            p.add_argument("--after", required=True, type=watermark, help="the new baseline: rows with watermark > "
                           "AFTER are sent, rows at or below it never (a time for a timestamp watermark)")
            p.add_argument("--reason", default="manual reset", help="recorded with the reset")
            p.add_argument("--force", action="store_true", help="reset even while runs of the table are active")
        elif name == "backfill":
            p.add_argument("--table", required=True, help="<source>.<schema>.<table>")
            p.add_argument("--dry-run", action="store_true",
                           help="say what would be cut and published; change nothing (no partition, no baseline)")
            p.add_argument("--settle-timeout", type=seconds, default=60.0,
                           help="seconds to wait, beyond the table's settle_seconds, for the newest rows to become "
                           "final (open transactions end); default 60")
        else:
            p.add_argument("--table", help="<source>.<schema>.<table> (default: all)")
        if name in ("verify", "status", "replay", "history"):
            p.add_argument("--json", action="store_true", help="machine-readable output for scripts")
    args = parser.parse_args(argv)
    collecting = gc.isenabled()
    if args.cmd == "backfill":
        gc.disable()  # until its startup is over (end_of_startup)
    config = None
    logging.getLogger().addFilter(STORAGE_RETRY_LINES)  # once: the same filter object is not added twice
    try:
        config = load_config(args.config)
        if (problem := dagster_home_problem()) is not None:
            raise ConfigError(problem)
        commands = {"verify": cmd_verify, "status": cmd_status, "pools": cmd_pools, "backfill": cmd_backfill,
                    "reset": cmd_reset, "replay": cmd_replay, "history": cmd_history, "schema": cmd_schema}
        return commands[args.cmd](config, args)
    except KeyboardInterrupt:  # Ctrl-C: not a defect, no traceback (a backfill's runs say what committed)
        print(f"rowrelay: {args.cmd} interrupted", file=sys.stderr)
        return INTERRUPTED
    except ConfigError as exc:
        print(f"rowrelay: {exc}", file=sys.stderr)
        return USAGE
    except Exception as exc:
        message = user_error(exc, config)
        if message is None:
            raise  # a defect: its traceback is what to report
        print(f"rowrelay: {message}", file=sys.stderr)
        return FAILED
    finally:
        if collecting:  # a backfill that ended before its runs (an error, --dry-run, nothing to do)
            gc.enable()


if __name__ == "__main__":
    sys.exit(main())
