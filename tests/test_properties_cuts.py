"""Properties of the cut (resources/slices.py, the pure parts of orchestration/sensors.py) against a small model:
a table is a sorted list of watermark values (repeats allowed), the database's answers are read off it."""

from __future__ import annotations

import bisect

from hypothesis import example, given
from hypothesis import strategies as st

from orchestration.cutting import known_chain, slice_rows_limit
from resources.exactly_once import ProgressRecord
from resources.slices import SliceRange, WatermarkCandidate, cut_slices, reconcile, settle


class Table:
    """The model: the rows' watermark values, sorted; what `nth_watermark` and `max_watermark` answer."""

    def __init__(self, values: list[int]) -> None:
        self.values = sorted(values)

    def between(self, lo: int, hi: int) -> list[int]:
        """Values in (lo, hi]."""
        return self.values[bisect.bisect_right(self.values, lo):bisect.bisect_right(self.values, hi)]

    def nth(self, lo: int, n: int, upto: int) -> int | None:
        inside = self.between(lo, upto)
        return inside[n - 1] if len(inside) >= n else None

    def max(self, lo: int, upto: int) -> int | None:
        inside = self.between(lo, upto)
        return inside[-1] if inside else None

    def cut(self, after: int, safe_hi: int, max_rows: int, limit: int) -> list[SliceRange]:
        return cut_slices(after, safe_hi, max_rows, self.nth, self.max, limit=limit)


values = st.lists(st.integers(1, 120), max_size=80)


@given(values, st.integers(0, 60), st.integers(1, 80), st.integers(1, 8), st.integers(1, 12))
def test_one_cut_tiles_its_rows_within_the_safe_watermark_and_the_limits(rows, after, above, max_rows, limit):
    table = Table(rows)
    safe_hi = after + above
    slices = table.cut(after, safe_hi, max_rows, limit)
    assert len(slices) <= limit
    position = after
    for s in slices:  # consecutive from `after`: no gap, no overlap
        assert s.lo == position and s.hi <= safe_hi, (slices, safe_hi)
        assert s.hi in table.values, f"{s} ends at no row's watermark"
        inside = table.between(s.lo, s.hi)
        # Exactly max_rows rows, more only where the boundary's value repeats (a value is never split).
        assert inside and len([v for v in inside if v < s.hi]) < max_rows, (s, inside)
        position = s.hi
    for s in slices[:-1]:
        assert len(table.between(s.lo, s.hi)) >= max_rows, (s, slices)
    wanted = table.between(after, safe_hi)
    if len(slices) < limit:  # every final row is cut, up to the last one present
        assert position == (wanted[-1] if wanted else after), (slices, wanted)
    assert sum(len(table.between(s.lo, s.hi)) for s in slices) == len(table.between(after, position))


@st.composite
def arrivals(draw):
    """Ticks: each inserts rows above the previous tick's safe watermark (what finality guarantees), then cuts up to
    a new safe watermark at or above the previous one (rows above it are not final yet)."""
    ticks, safe = [], 0
    for _ in range(draw(st.integers(1, 8))):
        new = draw(st.lists(st.integers(safe + 1, safe + 40), max_size=15))
        safe = draw(st.integers(safe, safe + 40))
        ticks.append((new, safe))
    return ticks


@given(arrivals(), st.integers(1, 6), st.integers(1, 4))
def test_ticks_send_every_row_exactly_once(ticks, max_rows, limit):
    """Tick after tick, the cut continues where the last one ended: every row at or below the last safe watermark
    falls in exactly one slice, and a slice once cut never changes (rows arrive only above the safe watermark)."""
    table, cut = Table([]), []  # cut: (slice, its rows when cut)
    for new, safe in ticks:
        table = Table(table.values + new)
        for s, rows in cut:  # settled: a slice's rows are the same as when it was cut
            assert table.between(s.lo, s.hi) == rows, s
        frontier = cut[-1][0].hi if cut else 0
        cut += [(s, table.between(s.lo, s.hi)) for s in table.cut(frontier, safe, max_rows, limit)]
    last_safe = ticks[-1][1]
    while more := table.cut(cut[-1][0].hi if cut else 0, last_safe, max_rows, limit):
        cut += [(s, table.between(s.lo, s.hi)) for s in more]
    assert all(s.hi <= last_safe for s, _ in cut)
    assert [v for _, rows in cut for v in rows] == table.between(0, last_safe), (cut, table.values)


slice_sets = st.lists(st.tuples(st.integers(0, 30), st.integers(1, 10)).map(lambda t: SliceRange(t[0], t[0] + t[1])),
                      max_size=12, unique=True)


@given(slice_sets, st.integers(0, 30))
def test_reconcile_splits_partitions_into_the_chain_from_progress_and_orphans(slices, committed_hi):
    ledger = reconcile(slices, committed_hi)
    above = {s for s in slices if s.hi > committed_hi}
    assert set(ledger.chain) | set(ledger.orphans) == above
    assert not set(ledger.chain) & set(ledger.orphans)
    position = committed_hi
    for s in ledger.chain:
        assert s.lo == position
        position = s.hi
    assert ledger.frontier == position
    # No orphan could continue the chain where it ends (else the chain would have taken it).
    assert all(s.lo != ledger.frontier for s in ledger.orphans)
    assert known_chain(ledger.chain, committed_hi) == ledger.chain
    if ledger.chain:  # progress moved to a slice's end: the rest continues it; inside a slice: storage is read
        first = ledger.chain[0]
        assert known_chain(ledger.chain, first.hi) == ledger.chain[1:]
        if first.hi - first.lo > 1:
            assert known_chain(ledger.chain, first.lo + 1) is None


candidates = st.lists(st.tuples(st.integers(0, 50), st.booleans()), max_size=10)


@given(candidates)
def test_settle_takes_the_highest_final_candidate_and_keeps_only_those_above(drawn):
    cands = [WatermarkCandidate(w, float(i)) for i, (w, _) in enumerate(drawn)]
    final = {c for c, (_, f) in zip(cands, drawn, strict=True) if f}
    safe, pending = settle(cands, lambda c: c in final)
    assert safe == (max(c.watermark for c in final) if final else None)
    assert pending == [c for c in cands if c not in final and (safe is None or c.watermark > safe)]


@given(st.integers(1, 100_000), st.lists(st.tuples(st.integers(0, 50_000), st.floats(0, 1000)), max_size=8),
       st.integers(1_000, 900_000))
@example(1, [(1000, 2.2250738585e-313)], 1000)  # a rate too large for a float: the tick failed, OverflowError
def test_slice_rows_limit_stays_within_slice_max_rows_and_never_below_a_thousand(max_rows, recent, timeout_ms):
    """A progress record is the product's own (transaction_s rounded to milliseconds) or any JSON a record may hold:
    whatever time it states, the limit is a number of rows within bounds."""
    records = [ProgressRecord("t", SliceRange(0, 1).key, 0, 1, rows, 0, "", "topic", transaction_s=s)
               for rows, s in recent]
    limit = slice_rows_limit(max_rows, records, timeout_ms)
    assert min(max_rows, 1000) <= limit <= max_rows


@given(st.lists(st.integers(1, 5), min_size=1, max_size=30), st.integers(1, 7))
def test_runs_take_at_most_max_slices_per_run_and_every_slice_once_in_order(widths, per_run):
    from orchestration.runs import batched_requests, run_slices

    bounds = [0]
    for w in widths:
        bounds.append(bounds[-1] + w)
    slices = [SliceRange(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]
    requests = batched_requests(slices, per_run)
    covered: list[SliceRange] = []
    for request in requests:
        span = run_slices(request.tags)
        first, last = span if span is not None else (SliceRange.from_key(request.partition_key),) * 2
        taken = slices[slices.index(first):slices.index(last) + 1]
        assert 1 <= len(taken) <= per_run
        covered += taken
    assert covered == slices and len(requests) == -(-len(slices) // per_run)
