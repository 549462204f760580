"""Properties of resets and history roll-ups (resources/exactly_once.py `live_records`, `live_pieces`, `tiling`;
resources/history.py `plan_rollups`; orchestration/cli.py `reset_partitions`) against a small model: a table's
progress topic as a list of operations, each watermark unit (u - 1, u] owned by the record that last sent it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import event, given
from hypothesis import strategies as st

from orchestration.reset import reset_outcome, reset_partitions
from resources.exactly_once import ProgressRecord, live_pieces, live_records, tiling
from resources.history import HistoryPolicy, plan_rollups
from resources.slices import SliceRange

NOW = datetime(2026, 6, 15, 12, 0, tzinfo=UTC)


def slice_record(lo: int, hi: int, at: datetime | None = None) -> ProgressRecord:
    return ProgressRecord("t", SliceRange(lo, hi).key, lo, hi, hi - lo, 0, f"c{lo}-{hi}", "topic",
                          committed_at=(at or NOW).isoformat())


def reset_record(after: int) -> ProgressRecord:
    return ProgressRecord("t", f"reset-{after}", after, after, 0, 0, "", "topic", reset_reason="test")


@st.composite
def histories(draw):
    """A progress topic: slices that continue progress, and resets back or forward; (records, owner) where owner
    maps each unit u (the watermark range (u - 1, u]) to the record that sent it and stands."""
    records: list[ProgressRecord] = []
    owner: dict[int, ProgressRecord] = {}
    progress = 0
    for _ in range(draw(st.integers(1, 12))):
        if draw(st.integers(0, 3)) == 0:  # a reset to anywhere up to a little above progress
            after = draw(st.integers(0, progress + 5))
            owner = {u: r for u, r in owner.items() if u <= after}
            record = reset_record(after)
            progress = after
        else:
            hi = progress + draw(st.integers(1, 6))
            record = slice_record(progress, hi)
            owner.update({u: record for u in range(progress + 1, hi + 1)})
            progress = hi
        records.append(record)
    return records, owner


@given(histories())
def test_live_pieces_are_what_each_unit_was_last_sent_by(history):
    records, owner = history
    pieces = live_pieces(records)
    units = [(u, p.record) for p in pieces for u in range(p.lo + 1, p.hi + 1)]
    assert len({u for u, _ in units}) == len(units), "two live pieces overlap"
    assert dict(units) == owner
    assert all(p.record.lo <= p.lo < p.hi <= p.record.hi for p in pieces)


@given(histories())
def test_live_records_are_the_slices_no_later_reset_cut_into(history):
    records, _ = history
    model = [r for i, r in enumerate(records)
             if r.hi <= r.lo or not any(x.hi <= x.lo and x.hi < r.hi for x in records[i + 1:])]
    assert live_records(records) == model
    standing = [r for r in live_records(records) if r.hi > r.lo]
    for a, b in zip(standing, standing[1:], strict=False):  # what stands never overlaps
        assert a.hi <= b.lo or b.hi <= a.lo, (a.slice, b.slice)


@given(st.lists(st.integers(1, 5), min_size=1, max_size=8), st.integers(0, 3), st.integers(0, 3),
       st.sets(st.integers(0, 7)))
def test_tiling_is_exact_cover_of_the_key(widths, cut_lo, cut_hi, dropped):
    """Consecutive slices, some left out: the records tile a key iff none inside it is missing."""
    bounds = [0]
    for w in widths:
        bounds.append(bounds[-1] + w)
    records = [slice_record(lo, hi) for i, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False))
               if i not in dropped]
    lo_i, hi_i = min(cut_lo, len(widths) - 1), max(len(widths) - cut_hi, min(cut_lo, len(widths) - 1) + 1)
    key = SliceRange(bounds[lo_i], bounds[hi_i])
    inside = [r for r in records if key.lo <= r.lo and r.hi <= key.hi]
    complete = {i for i in range(lo_i, hi_i)}.isdisjoint(dropped)
    assert tiling(key, records) == (inside if complete else None)
    # A key whose bound falls inside a record is never tiled by it.
    if key.hi - 1 > key.lo and key.hi - 1 not in bounds:
        assert tiling(SliceRange(key.lo, key.hi - 1), records) is None


@st.composite
def committed_keys(draw):
    """A table's partition keys over committed slices (some already rolled up), with commit times from minutes to
    months old, and uncommitted keys above progress; (keys, records)."""
    records, keys, position = [], [], 0
    for _ in range(draw(st.integers(1, 14))):
        widths = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))  # one key, one or more slices
        age = timedelta(seconds=draw(st.sampled_from([60, 3_000, 4_000, 7_300, 90_000, 200_000, 9_000_000])))
        key_lo = position
        for w in widths:
            records.append(slice_record(position, position + w, NOW - age))
            position += w
        keys.append(SliceRange(key_lo, position))
    for _ in range(draw(st.integers(0, 2))):  # cut, not committed
        keys.append(SliceRange(position, position + 3))
        position += 3
    if draw(st.booleans()):  # `schema accept`: the committed progress's slice recorded again, newer
        last = records[-1]
        records.append(ProgressRecord("t", last.slice, last.lo, last.hi, last.rows, 0, last.checksum, "topic",
                                      committed_at=NOW.isoformat(), reset_reason="schema accepted"))
    if draw(st.booleans()):  # a reset back inside history
        back = draw(st.integers(0, position))
        records.append(reset_record(back))
    return keys, records, position


def replace_keys(keys: list[SliceRange], rollups) -> list[SliceRange]:
    rolled = {k for r in rollups for k in r.keys}
    return sorted([k for k in keys if k not in rolled] + [r.range for r in rollups], key=lambda k: (k.lo, k.hi))


@given(committed_keys())
def test_rollups_replace_consecutive_covered_keys_and_keys_still_tile(drawn):
    keys, records, top = drawn
    policy = HistoryPolicy()
    rollups = plan_rollups(keys, records, NOW, policy)
    event(f"roll-ups: {min(len(rollups), 2)}")
    standing = [r for r in live_records(records) if r.hi > r.lo]
    used: set[SliceRange] = set()
    for r in rollups:
        assert len(r.keys) > 1 and r.range == SliceRange(r.keys[0].lo, r.keys[-1].hi)
        for a, b in zip(r.keys, r.keys[1:], strict=False):
            assert a.hi == b.lo, r
        assert not used & set(r.keys), "a key in two roll-ups"
        used |= set(r.keys)
        # Covered exactly by records still standing, all of one bucket.
        assert tiling(r.range, sorted(standing, key=lambda x: x.lo)) == r.records, r
        buckets = {policy.bucket(max(datetime.fromisoformat(x.committed_at) for x in covered), NOW)
                   for k in r.keys if (covered := tiling(k, standing))}
        assert buckets == {r.bucket}, (r, buckets)
    after = replace_keys(keys, rollups)
    position = 0
    for k in after:  # the keys still tile what they tiled: no gap, no overlap
        assert k.lo == position, after
        position = k.hi
    assert position == top


@st.composite
def partitions(draw):
    """Consecutive partition keys from 0; progress (replaced by the reset) at a key boundary; the reset's W."""
    bounds = [0]
    for w in draw(st.lists(st.integers(1, 5), min_size=1, max_size=8)):
        bounds.append(bounds[-1] + w)
    ranges = {SliceRange(lo, hi).key: SliceRange(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)}
    replaced_hi = draw(st.sampled_from(bounds))
    after = draw(st.integers(0, bounds[-1] + 3))
    recorded = draw(st.sets(st.sampled_from(sorted(ranges))))
    return ranges, replaced_hi, after, recorded


@given(partitions())
def test_a_reset_leaves_keys_that_tile_up_to_its_watermark(drawn):
    ranges, replaced_hi, after, recorded = drawn
    plan = reset_partitions(ranges, after, replaced_hi, moved=False, recorded=recorded)
    assert set(plan.dropped) == {k for k, r in ranges.items() if r.hi > after}
    kept = [r for k, r in ranges.items() if k not in plan.dropped] + list(plan.kept_below.values())
    position = 0
    for k in sorted(kept, key=lambda r: r.lo):
        assert k.lo == position and k.hi <= after, kept
        position = k.hi
    top = max(r.hi for r in ranges.values())
    assert position == min(after, top)  # up to W (where the rows above are cut again from W)
    # Wholly at or below W and above the replaced progress: settled, or left as Dagster recorded them.
    below = {k for k, r in ranges.items() if replaced_hi < r.hi <= after}
    assert set(plan.settled) | set(plan.recorded) == below and not set(plan.settled) & set(plan.recorded)
    assert set(plan.recorded) <= set(recorded) and not set(plan.settled) & set(recorded)


@given(st.integers(0, 20), st.integers(1, 10), st.integers(0, 40))
def test_reset_outcome_splits_a_part_at_the_progress_it_replaced(lo, width, replaced_hi):
    part = SliceRange(lo, lo + width)
    sent_to, what = reset_outcome(part, replaced_hi, "W", str)
    assert part.lo <= sent_to <= part.hi and sent_to == min(max(replaced_hi, part.lo), part.hi)
    assert ("never sent" in what) == (sent_to == part.lo)
    assert what.startswith("published before") == (sent_to == part.hi)
