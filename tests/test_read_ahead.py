"""Pure logic: the read-ahead that fetches later slices' chunks while a slice is produced (fake Spark frames)."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest

from resources.exactly_once import TableChannel
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.slice_reads import ReadAhead, SliceFrame
from resources.slices import SliceRange

CHANNEL = TableChannel.for_table("src.public.t", "src.public.t", prefix=PREFIX)


class FakeChunk:
    """Stands in for a Spark DataFrame: toArrow() returns the chunk's message columns."""

    def __init__(self, sub: SliceRange, log: list[SliceRange], gate: threading.Event | None = None) -> None:
        self.sub, self.log, self.gate = sub, log, gate

    def toArrow(self) -> pa.Table:  # noqa: N802 - Spark's name
        if self.gate is not None:
            self.gate.wait(5)
        self.log.append(self.sub)
        wms = list(range(self.sub.lo + 1, self.sub.hi + 1))
        values = [b'{"id":%d}' % w for w in wms]
        return pa.table({"key": values, "value": values, "watermark": pa.array(wms, pa.int64()),
                         "watermark_text": [str(w).encode() for w in wms]})


def frames(slices: list[SliceRange], log: list[SliceRange], gate: threading.Event | None = None) -> list[SliceFrame]:
    return [SliceFrame(channel=CHANNEL, slice=s, read_chunk=lambda sub, _rows: FakeChunk(sub, log, gate),
                       expected_rows=s.hi - s.lo) for s in slices]


def test_reads_every_slice_in_order_and_fetches_the_next_slice_ahead() -> None:
    log: list[SliceRange] = []
    slices = [SliceRange(0, 10), SliceRange(10, 20), SliceRange(20, 30)]
    fs = frames(slices, log)
    ahead = ReadAhead(fs, chunk_rows=10, prefetch=2)
    try:
        first = ahead.frame_at_head()
        assert first is fs[0]
        got = [w for b in ahead.batches(fs[0]) for w in b.watermarks.to_pylist()]
        assert got == list(range(1, 11))
        # While slice 1 was produced, slice 2 was already being fetched (one chunk per slice here).
        assert ahead.frame_at_head() is fs[1]
        assert SliceRange(10, 20) in [f.slice for f, _, _ in ahead._ahead]
        assert [w for b in ahead.batches(fs[1]) for w in b.watermarks.to_pylist()] == list(range(11, 21))
        assert [w for b in ahead.batches(fs[2]) for w in b.watermarks.to_pylist()] == list(range(21, 31))
        assert ahead.frame_at_head() is None
    finally:
        ahead.close()
    assert sorted(log, key=lambda s: s.lo) == slices


def test_a_slice_stopped_midway_is_skipped_and_the_next_one_is_whole() -> None:
    log: list[SliceRange] = []
    fs = frames([SliceRange(0, 40), SliceRange(40, 50)], log)
    ahead = ReadAhead(fs, chunk_rows=10, prefetch=2)  # slice 1: four chunks
    try:
        gen = ahead.batches(fs[0])
        assert next(gen).watermarks.to_pylist() == list(range(1, 11))
        gen.close()  # the publisher gave up on slice 1 (e.g. an abort)
        assert ahead.frame_at_head() is fs[1]
        assert [w for b in ahead.batches(fs[1]) for w in b.watermarks.to_pylist()] == list(range(41, 51))
    finally:
        ahead.close()


def test_asking_for_slices_out_of_order_is_an_error() -> None:
    fs = frames([SliceRange(0, 10), SliceRange(10, 20)], [])
    ahead = ReadAhead(fs, chunk_rows=10, prefetch=1)
    try:
        with pytest.raises(RuntimeError, match="read-ahead is not at slice"):
            list(ahead.batches(fs[1]))
    finally:
        ahead.close()


def test_out_of_order_rows_are_refused() -> None:
    class Shuffled(FakeChunk):
        def toArrow(self) -> pa.Table:  # noqa: N802
            t = super().toArrow()
            return t.take(pa.array(list(reversed(range(t.num_rows)))))

    f = SliceFrame(channel=CHANNEL, slice=SliceRange(0, 5), read_chunk=lambda sub, _r: Shuffled(sub, []),
                   expected_rows=5)
    with pytest.raises(RuntimeError, match="out of watermark order"):
        list(f.iter_batches(chunk_rows=5))


def test_chunks_split_evenly_from_the_first_row() -> None:
    """A slice far wider than its rows (a timestamp table's first slice starts in 1970): chunks are split from its
    first row, so the rows spread over them instead of all landing in the last one."""
    wide = SliceFrame(channel=CHANNEL, slice=SliceRange(0, 1_000_100), read_chunk=None, expected_rows=100,
                      first_watermark=1_000_001)
    subs = wide.sub_ranges(chunk_rows=25)
    assert subs[0].lo == 0 and subs[-1].hi == 1_000_100 and len(subs) == 4
    assert all(a.hi == b.lo for a, b in zip(subs, subs[1:], strict=False))  # contiguous: no gap, no overlap
    assert [s.hi - max(s.lo, 1_000_000) for s in subs] == [25, 25, 25, 25]  # 25 watermarks of rows each
    unknown = SliceFrame(channel=CHANNEL, slice=SliceRange(0, 100), read_chunk=None, expected_rows=100)
    assert [(s.lo, s.hi) for s in unknown.sub_ranges(chunk_rows=50)] == [(0, 50), (50, 100)]


def _signed(s: SliceRange, log: list[SliceRange], signature: str, fail: bool = False) -> SliceFrame:
    def read_chunk(sub: SliceRange, _rows: int) -> FakeChunk:
        if fail:
            raise RuntimeError("the early read's connection dropped")
        return FakeChunk(sub, log)

    return SliceFrame(channel=CHANNEL, slice=s, read_chunk=read_chunk, expected_rows=s.hi - s.lo,
                      signature=signature)


def run_read(frames: list[SliceFrame]) -> tuple[list[int], ReadAhead]:
    """A run's read of `frames` through its read-ahead: the watermarks it got, and the (closed) read-ahead."""
    ahead = ReadAhead(frames, chunk_rows=10, prefetch=2)
    try:
        return [w for f in frames for b in ahead.batches(f) for w in b.watermarks.to_pylist()], ahead
    finally:
        ahead.close()


def test_a_run_takes_the_early_chunks_read_for_its_first_slice_and_reads_the_rest() -> None:
    from resources.slice_reads import EARLY_READS

    early_log: list[SliceRange] = []
    assert EARLY_READS.start([_signed(SliceRange(0, 50), early_log, "sig-a")], chunk_rows=10, depth=3) == 3
    run_log: list[SliceRange] = []
    # The run's own frame: same signature, its own reader.
    got, ahead = run_read([_signed(SliceRange(0, 50), run_log, "sig-a")])
    assert got == list(range(1, 51))
    assert sorted(early_log, key=lambda s: s.lo) == [SliceRange(0, 10), SliceRange(10, 20), SliceRange(20, 30)]
    assert sorted(run_log, key=lambda s: s.lo) == [SliceRange(30, 40), SliceRange(40, 50)]  # no chunk read twice
    assert ahead.early_chunks == {SliceRange(0, 50).key: 3}


def test_early_chunks_for_another_slice_or_signature_are_dropped_and_the_run_reads_its_own() -> None:
    from resources.slice_reads import EARLY_READS

    # (A signature covers the slice: another slice is another signature.)
    for early_frame in (_signed(SliceRange(0, 30), [], "sig-b"),     # the cut turned out another slice
                        _signed(SliceRange(0, 20), [], "sig-old")):  # same range, read differently (e.g. a column)
        EARLY_READS.start([early_frame], chunk_rows=10, depth=3)
        run_log: list[SliceRange] = []
        got, ahead = run_read([_signed(SliceRange(0, 20), run_log, "sig-a")])
        assert got == list(range(1, 21))
        assert sorted(run_log, key=lambda s: s.lo) == [SliceRange(0, 10), SliceRange(10, 20)]
        assert ahead.early_chunks == {}
    # The registry was emptied by the first claim: a later run finds nothing.
    assert EARLY_READS.claim(_signed(SliceRange(0, 30), [], "sig-a")) == {}


def test_a_failed_early_chunk_is_read_again_by_the_run() -> None:
    from resources.slice_reads import EARLY_READS

    EARLY_READS.start([_signed(SliceRange(0, 20), [], "sig-a", fail=True)], chunk_rows=10, depth=3)
    run_log: list[SliceRange] = []
    got, _ = run_read([_signed(SliceRange(0, 20), run_log, "sig-a")])
    assert got == list(range(1, 21))
    assert sorted(run_log, key=lambda s: s.lo) == [SliceRange(0, 10), SliceRange(10, 20)]


def test_a_frame_without_signature_never_shares_chunks() -> None:
    from resources.slice_reads import EARLY_READS

    assert EARLY_READS.start([_signed(SliceRange(0, 20), [], "")], chunk_rows=10, depth=3) == 0
    EARLY_READS.start([_signed(SliceRange(0, 20), [], "sig-a")], chunk_rows=10, depth=3)
    assert EARLY_READS.claim(_signed(SliceRange(0, 20), [], "")) == {}


def test_early_chunks_span_consecutive_slices_smaller_than_a_chunk() -> None:
    from resources.slice_reads import EARLY_READS

    early_log: list[SliceRange] = []
    slices = [SliceRange(0, 10), SliceRange(10, 20), SliceRange(20, 30), SliceRange(30, 40)]
    asked: list[SliceRange] = []

    def early_frames():
        for i, s in enumerate(slices):
            asked.append(s)
            yield _signed(s, early_log, f"sig-{i}")

    assert EARLY_READS.start(early_frames(), chunk_rows=10, depth=3) == 3
    assert asked == slices[:3]  # the fourth slice's frame (its count queries) was never built
    run_log: list[SliceRange] = []
    got, ahead = run_read([_signed(s, run_log, f"sig-{i}") for i, s in enumerate(slices)])
    assert got == list(range(1, 41))
    assert sorted(early_log, key=lambda s: s.lo) == slices[:3]
    assert run_log == [SliceRange(30, 40)]
    assert ahead.early_chunks == {s.key: 1 for s in slices[:3]}


def test_each_chunk_is_verified_after_its_read_and_a_failed_read_says_the_columns_changed() -> None:
    """A slice's `verify` (the table's shape taken again) is asked after each of its chunks is read; where the
    columns changed, the slice fails with SchemaRaced, also where the read itself failed (a dropped column)."""
    from resources.source_database import SchemaRaced

    asked: list[int] = []
    log: list[SliceRange] = []
    s = SliceRange(0, 20)
    frame = SliceFrame(channel=CHANNEL, slice=s, read_chunk=lambda sub, _r: FakeChunk(sub, log), expected_rows=20,
                       verify=lambda: asked.append(len(log)))
    assert [w for b in frame.iter_batches(chunk_rows=10) for w in b.watermarks.to_pylist()] == list(range(1, 21))
    assert len(asked) == 2 and min(asked) >= 1  # once per chunk, each after a chunk was read

    def changed() -> None:
        raise SchemaRaced("src.public.t: the table's columns changed while slice (0, 20] was read (dropped b)")

    def dropped(_sub: SliceRange, _rows: int) -> FakeChunk:
        raise RuntimeError('ERROR: column "b" does not exist')

    for read_chunk in (lambda sub, _r: FakeChunk(sub, []), dropped):
        raced = SliceFrame(channel=CHANNEL, slice=s, read_chunk=read_chunk, expected_rows=20, verify=changed)
        with pytest.raises(SchemaRaced, match="dropped b"):
            list(raced.iter_batches(chunk_rows=10))
