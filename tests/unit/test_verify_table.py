"""resources/verify/table.py: where a verify's comparison starts and ends, and what it counts (no stack)."""

from __future__ import annotations

from types import SimpleNamespace

from resources.exactly_once import ProgressRecord
from resources.verify.compare import ResetSplit
from resources.verify.table import committed_ends, compared_range, counted_messages


def _slice(lo: int, hi: int, topic: str = "t", offsets: dict[str, list[int]] | None = None) -> ProgressRecord:
    return ProgressRecord("src.public.t", f"{lo}-{hi}", lo, hi, hi - lo, 0, "", topic, offsets=offsets or {})


def _table(start_after: int | None = None, topic: str = "t") -> SimpleNamespace:
    return SimpleNamespace(start_after_watermark=start_after, topic_name=topic)


def test_the_comparison_starts_at_the_first_slice_without_a_start_mark() -> None:
    span = compared_range(_table(start_after=5), [_slice(10, 20), _slice(20, 30)])
    assert (span.start, span.hi, span.record, span.reset) == (10, 30, None, None)
    assert compared_range(_table(start_after=5), []).start == 5  # nothing published: start_after
    assert compared_range(_table(start_after=5), []).hi == 5


def test_the_comparison_starts_at_the_newest_reset_and_names_the_older_ones() -> None:
    older = ProgressRecord("src.public.t", "reset-10", 10, 10, 0, 0, "", "t", topic_ends={"0": 4})
    newest = ProgressRecord("src.public.t", "reset-15", 15, 15, 0, 0, "", "t", topic_ends={"0": 9})
    span = compared_range(_table(), [_slice(0, 20), older, _slice(10, 20), newest, _slice(15, 25)])
    assert (span.start, span.hi, span.record) == (15, 25, "reset-15")
    assert span.reset is newest and span.earlier_resets == [older]


def test_slices_sent_to_another_topic_move_the_start_past_them() -> None:
    span = compared_range(_table(topic="new"), [_slice(0, 10, topic="old"), _slice(10, 20, topic="new")])
    assert (span.start, span.record) == (10, "slices up to it went to ['old']")


def test_the_topic_end_must_show_every_committed_slice_of_its_topic() -> None:
    slices = [_slice(0, 10, offsets={"0": [0, 9], "1": [0, 4]}), _slice(10, 20, offsets={"0": [10, 19]}),
              _slice(20, 30, topic="other", offsets={"0": [0, 99]})]
    assert committed_ends(slices, "t") == {0: 20, 1: 5}


def test_messages_are_counted_without_those_committed_meanwhile_and_disorder_within_segments() -> None:
    split = ResetSplit(kept={0: [1, 3, 2, 4], 1: [5, 6]}, segments=[[1, 3], [2, 4], [5, 6]], after_reset=[],
                       before_start=0)
    seen, order = counted_messages(split, range(6, 7))
    assert seen == {1: 1, 2: 1, 3: 1, 4: 1, 5: 1} and order == []  # 3 -> 2 is a seam between segments
    _, order = counted_messages(ResetSplit({0: [3, 2]}, [[3, 2]], [], 0), range(0))
    assert order == [2]
