"""A slice's messages read from the source: one watermark sub-range (chunk) at a time, in bounded Arrow batches,
read ahead of the producer across slice boundaries (and, for a CLI backfill, before its run starts)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from math import ceil
from typing import TYPE_CHECKING

from resources.errors import RowrelayError
from resources.exactly_once import BadRowError, MessageBatch, TableChannel
from resources.row_checks import bad_json_error, bad_utf8_error
from resources.slices import RowSkip, SliceRange

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

ChunkReader = Callable[[SliceRange, int], "DataFrame"]


class SourceReadError(RowrelayError, RuntimeError):
    """Spark could not read a slice from the source; the message carries the JDBC driver's own reason."""


def jvm_cause(exc: BaseException) -> str | None:
    """The JDBC driver's (or other non-Spark) reason behind a Spark error, from its JVM stack trace.

    Spark's FAILED_JDBC.CONNECTION says only "Couldn't connect to the database"; the reason a user can act on
    (a certificate problem, a refused login) is a "Caused by:" line: classic PySpark keeps the trace in
    `_stackTrace`, Spark Connect in `getStackTrace()`.
    """
    get_trace = getattr(exc, "getStackTrace", None)
    trace = get_trace() if callable(get_trace) else getattr(exc, "_stackTrace", None)
    if not isinstance(trace, str):
        return None
    causes = [line.strip().removeprefix("Caused by: ") for line in trace.splitlines()
              if line.strip().startswith("Caused by: ")]
    own = [c for c in causes if not c.startswith(("org.apache.spark.", "java.util.concurrent."))]
    return (own or causes or [None])[0]


@dataclass
class SliceFrame:
    """One slice to publish: its messages, read from the source one watermark sub-range (chunk) at a time.

    `read_chunk(sub_range, expected_rows)` returns the chunk's lazy message DataFrame (key, value, watermark,
    watermark_text); each chunk is its own JDBC read, split over Spark partitions by watermark.
    """

    channel: TableChannel
    slice: SliceRange
    read_chunk: ChunkReader | None  # None: already committed
    expected_rows: int
    first_watermark: int | None = None  # the slice's lowest watermark, if known
    # The rows the slice must publish (in (lo, hi], admitted by `where:`, minus the skipped rows), checked before
    # its commit; None: not known, not checked.
    rows_to_send: int | None = None
    # The skip_watermarks entries inside the slice (their rows left out of its read) and how many rows they left
    # out, recorded with its progress.
    skipped: list[RowSkip] = field(default_factory=list)
    skipped_rows: int = 0
    # What the read depends on (source, table settings, reflected shape, Spark settings, slice, rows): chunks
    # fetched under the same signature are the same rows in the same messages (see EarlyRead). "": not shareable.
    signature: str = ""
    # The columns the slice is read with ([name, type]) and their fingerprint, recorded with its progress.
    columns: list[list[str]] = field(default_factory=list)
    schema_fingerprint: str = ""
    # Raises SchemaRaced where the table's columns are no longer those the slice is read with; asked after each of
    # its chunks is read (or fails to read), so every chunk is proven read with `columns`.
    verify: Callable[[], None] | None = None

    @classmethod
    def failing(cls, channel: TableChannel, slice_range: SliceRange, error: Exception) -> SliceFrame:
        """A slice whose preparation failed with `error`: raised when its rows are fetched, in its own turn. The
        read-ahead prepares the next slice while one publishes; a failure there (a row that cannot be sent, the
        source away) must stop that slice, not the one before it."""
        def refuse(*_: object) -> DataFrame:
            raise error
        return cls(channel=channel, slice=slice_range, read_chunk=refuse, expected_rows=0)

    def sub_ranges(self, chunk_rows: int) -> list[SliceRange]:
        """Split the slice into watermark sub-ranges of about `chunk_rows` rows each, evenly from its first row:
        a slice far wider than its rows (a time table's first slice starts in 1970) would otherwise put every row
        in its last chunk, in memory at once."""
        chunks = max(1, ceil(self.expected_rows / max(1, chunk_rows)))
        lo, hi = self.slice.lo, self.slice.hi
        base = lo if self.first_watermark is None else min(max(lo, self.first_watermark - 1), hi - 1)
        width = max(1, ceil((hi - base) / chunks))
        bounds = [lo] + list(range(base + width, hi, width)) + [hi]
        return [self.slice.span(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]

    def fetch(self, sub: SliceRange, expected_rows: int) -> pa.Table:
        assert self.read_chunk is not None
        try:
            table = self.read_chunk(sub, expected_rows).toArrow()
        except Exception as exc:
            if self.verify is not None:  # a read that failed because the columns changed (one dropped) says so
                self.verify()
            bad = (bad_utf8_error(self.channel.table, str(exc), sub.timestamps)
                   or bad_json_error(self.channel.table, str(exc), sub.timestamps))
            if bad is not None:
                raise bad from exc
            cause = jvm_cause(exc)
            summary = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if cause is None or cause in summary:
                raise
            raise SourceReadError(f"{self.channel.table}: reading watermarks {sub} from the source failed: "
                                  f"{summary}; caused by {cause}") from exc
        if self.verify is not None:
            self.verify()
        return table

    def iter_batches(self, chunk_rows: int, prefetch: int = 2) -> Iterator[MessageBatch]:
        """Stream the slice in watermark order, one Arrow batch of one sub-range at a time (flat memory).

        Up to `prefetch` later sub-ranges are fetched while the current one is produced, so Spark's task slots
        and the producer work at the same time; at most `prefetch + 1` sub-ranges are in memory.
        """
        ahead = ReadAhead([self], chunk_rows, prefetch)
        try:
            yield from ahead.batches(self)
        finally:
            ahead.close()

    def chunks(self, chunk_rows: int) -> list[tuple[SliceRange, int]]:
        """The slice's sub-ranges with the rows each is expected to hold."""
        if self.read_chunk is None:
            raise RuntimeError(f"{self.channel.table}: slice {self.slice} was read as committed but is not")
        subs = self.sub_ranges(chunk_rows)
        per_chunk = ceil(self.expected_rows / len(subs))
        return [(sub, per_chunk) for sub in subs]


def to_message_batches(frame: SliceFrame, table: pa.Table, after: int) -> tuple[list[MessageBatch], int]:
    """An Arrow chunk as produce-ready batches (one per Arrow record batch, no copy), after checking its rows
    follow watermark `after` in order."""
    import pyarrow.compute as pc  # for start-up time: loaded on first use

    wms = table.column("watermark")
    # Vectorised order check: Spark sorted each partition; partitions must come back in order.
    if pc.min(wms).as_py() < after or (table.num_rows > 1 and not pc.all(pc.greater_equal(
            wms.slice(1), wms.slice(0, table.num_rows - 1))).as_py()):
        raise RuntimeError(f"{frame.channel.table}: rows of slice {frame.slice} out of watermark order")
    batches = [MessageBatch.from_arrow(b) for b in table.select(["key", "value", "watermark", "watermark_text"])
               .to_batches() if b.num_rows]
    return batches, pc.max(wms).as_py()


class ReadAhead:
    """Reads the chunks of consecutive slices ahead of the producer, across slice boundaries.

    A run's slices are read in order; fetching slice k+1's first chunks while slice k is flushed and committed
    keeps Spark busy through every commit (with one chunk per slice, nothing would overlap otherwise).
    Reading ahead is only reading: a slice that fails leaves nothing behind but discarded chunks. At most
    `prefetch` chunks are in flight plus the one being produced.
    """

    def __init__(self, frames: Iterable[SliceFrame], chunk_rows: int, prefetch: int = 2) -> None:
        self._tasks: Iterator[tuple[SliceFrame, SliceRange, int, bool]] = (
            (frame, sub, rows, i == len(chunks) - 1)
            for frame in frames for chunks in [frame.chunks(chunk_rows)] for i, (sub, rows) in enumerate(chunks))
        self._depth = max(1, prefetch)
        self._pool = ThreadPoolExecutor(max_workers=self._depth, thread_name_prefix="rowrelay-fetch")
        self._ahead: deque[tuple[SliceFrame, bool, Future[pa.Table]]] = deque()
        self._next: tuple[SliceFrame, SliceRange, int, bool] | None = None
        self._early: dict[tuple[str, SliceRange, int], Future[pa.Table]] | None = None
        self.convert_s = 0.0  # the order check and the split into batches, for the run's per-phase timings
        self.early_chunks: dict[str, int] = {}  # per slice key: chunks taken from an EarlyRead

    def _peek(self) -> tuple[SliceFrame, SliceRange, int, bool] | None:
        if self._next is None:
            self._next = next(self._tasks, None)
        return self._next

    def _fill(self) -> None:
        while len(self._ahead) < self._depth and self._peek() is not None:
            frame, sub, rows, last = self._next  # type: ignore[misc]
            self._next = None
            if self._early is None:  # the first frame: take the chunks an early read fetched for it, if any
                self._early = EARLY_READS.claim(frame)
            early = self._early.pop((frame.signature, sub, rows), None)
            if early is not None:
                self.early_chunks[frame.slice.key] = self.early_chunks.get(frame.slice.key, 0) + 1
            future = (self._pool.submit(_early_or_fetch, early, frame, sub, rows) if early is not None
                      else self._pool.submit(frame.fetch, sub, rows))
            self._ahead.append((frame, last, future))

    def batches(self, frame: SliceFrame) -> Iterator[MessageBatch]:
        """`frame`'s batches in watermark order; frames must be asked for in the order they were given."""
        after, done = frame.slice.lo, False
        try:
            while not done:
                self._fill()
                if not self._ahead or self._ahead[0][0] is not frame:
                    raise RuntimeError(f"{frame.channel.table}: read-ahead is not at slice {frame.slice}")
                _, done, future = self._ahead.popleft()
                table = future.result()
                self._fill()  # keep the fetch threads busy while this chunk is produced
                if table.num_rows == 0:
                    continue
                started = time.monotonic()
                batches, after = to_message_batches(frame, table, after)
                self.convert_s += time.monotonic() - started
                del table
                yield from batches
        finally:
            if not done:
                self._skip(frame)

    def frame_at_head(self) -> SliceFrame | None:
        """The slice whose chunks come next (None: no slice left)."""
        self._fill()
        return self._ahead[0][0] if self._ahead else None

    def skip(self, frame: SliceFrame) -> None:
        """Move past a slice that will not be read (already committed)."""
        self._skip(frame)

    def _skip(self, frame: SliceFrame) -> None:
        """Drop what is left of `frame` (it failed or stopped early): later slices keep their chunks."""
        while self._ahead and self._ahead[0][0] is frame:
            self._ahead.popleft()[2].cancel()
        while (task := self._peek()) is not None and task[0] is frame:
            self._next = None

    def close(self) -> None:
        for _, _, future in self._ahead:
            future.cancel()
        self._ahead.clear()
        for future in (self._early or {}).values():
            future.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)


def _early_or_fetch(early: Future[pa.Table], frame: SliceFrame, sub: SliceRange, rows: int) -> pa.Table:
    """An early read's chunk; if that read failed, the chunk is read again now (the run's own read decides)."""
    try:
        return early.result()
    except Exception:
        return frame.fetch(sub, rows)


class EarlyRead:
    """The first chunks a run is about to publish, fetched before the run starts.

    `rowrelay backfill` knows the slices it will publish first while Dagster is still loading and creating the
    run; on two cores Spark would idle through that second. A run's read-ahead takes the chunks only if its first
    frame has the signature of the first frame read early (same source, table settings, reflected shape, Spark
    settings, slice and row count: the same rows in the same messages), and each chunk only for a frame of its own
    signature. Anything else is dropped. Reading is only reading: nothing here publishes or records progress, and
    the run's own checks (order, slice bounds, fencing) apply to these chunks as to any. In memory: at most the
    chunks of one read-ahead.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunks: dict[tuple[str, SliceRange, int], Future[pa.Table]] = {}
        self._first = ""  # the signature of the first frame read early
        self._pool: ThreadPoolExecutor | None = None

    def start(self, frames: Iterable[SliceFrame], chunk_rows: int, depth: int) -> int:
        """Fetch the first `depth` chunks of `frames` (consecutive slices, in order) in the background; returns how
        many were started. A frame is only asked for its chunks (its count queries) while chunks are wanted."""
        with self._lock:
            self._drop()
            self._pool = ThreadPoolExecutor(max_workers=max(1, depth - 1), thread_name_prefix="rowrelay-early")
            for frame in frames:
                if not frame.signature:
                    break
                self._first = self._first or frame.signature
                for sub, rows in frame.chunks(chunk_rows)[:depth - len(self._chunks)]:
                    self._chunks[(frame.signature, sub, rows)] = self._pool.submit(frame.fetch, sub, rows)
                if len(self._chunks) >= depth:
                    break
            return len(self._chunks)

    def claim(self, frame: SliceFrame) -> dict[tuple[str, SliceRange, int], Future[pa.Table]]:
        """The early chunks, if the first was read for `frame` (a run's first); the registry is emptied either way."""
        with self._lock:
            chunks, first, self._chunks, self._first = self._chunks, self._first, {}, ""
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)  # its queued chunks still run; the claimer waits on their futures
        if not frame.signature or first != frame.signature:
            for future in chunks.values():
                future.cancel()
            return {}
        return chunks

    def discard(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        for future in self._chunks.values():
            future.cancel()
        self._chunks, self._first = {}, ""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


EARLY_READS = EarlyRead()  # one per process: a CLI backfill and the in-process runs it executes


@dataclass
class TableSlices:
    """What a table asset hands to the Kafka IO manager: its run's slices in watermark order.

    `pending` are the slices not yet committed when the run started; `read` builds one's messages lazily.
    """

    channel: TableChannel
    slices: list[SliceRange]
    pending: list[SliceRange]
    read: Callable[[SliceRange], SliceFrame] | None
    # Seconds per step of the run before publishing (launch -> worker, progress read, table check, Spark session):
    # reported with each slice's metadata, so a user sees where a run's time went.
    timings: dict[str, float] = field(default_factory=dict)
    # The columns of the last committed slice when the run started ([] none recorded): each slice's own columns
    # (its SliceFrame's, which may change during the run) are described against the slice before it.
    committed_columns: list[list[str]] = field(default_factory=list)
    where: str = ""  # the table's `where:` ("" none), recorded with each slice's progress
    watermark: tuple[str, str] | None = None  # the watermark column and its kind, as reflected by the run
    # With Kafka's progress empty: the highest slice Dagster recorded as committed (`last_recorded_slice`), which
    # the publisher refuses to send again (a progress topic deleted after the data topic's messages expired).
    recorded: SliceRange | None = None
    # The skip advice for a row that stopped the run (`BadRowError.naming`): by the row itself where others share
    # its watermark. None: the message's own advice.
    name_row: Callable[[BadRowError], str] | None = None
