"""orchestration/reset.py: the partitions a reset keeps, cuts and drops."""

from __future__ import annotations

from resources.slices import SliceRange


def test_reset_partitions_settle_below_cut_above_and_leave_a_changed_watermarks_history() -> None:
    from orchestration.reset import reset_partitions

    def keyed(*spans: tuple[int, int]) -> dict[str, SliceRange]:
        return {SliceRange(lo, hi).key: SliceRange(lo, hi) for lo, hi in spans}

    three = keyed((0, 10), (10, 20), (20, 30))
    back = reset_partitions(three, 15, 20, moved=False)  # back inside (10, 20]: its part below stays
    assert back.dropped == [SliceRange(10, 20).key, SliceRange(20, 30).key] and back.settled == []
    assert back.kept_below == {SliceRange(10, 20).key: SliceRange(10, 15)}
    forward = reset_partitions(three, 25, 10, moved=False)  # (10, 20] was cut, never committed: settled
    assert forward.settled == [SliceRange(10, 20).key] and forward.kept_below == {SliceRange(20, 30).key:
                                                                                   SliceRange(20, 25)}
    # A changed watermark: the old ranges are another column's. Committed ones below W stay as its history; none is
    # cut at W or settled (a statement in the wrong column); above W or never committed, they go.
    ids = keyed((0, 50), (50, 80), (80, 90))
    assert reset_partitions(ids, 1080, 80, moved=True) == type(back)([SliceRange(80, 90).key], {}, [])
    seqs = keyed((1000, 1080))
    assert reset_partitions(seqs, 50, 1080, moved=True).dropped == [SliceRange(1000, 1080).key]
    assert reset_partitions(seqs, 50, 1080, moved=False).kept_below == {}  # lo above W: nothing kept below
