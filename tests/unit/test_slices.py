"""resources/slices.py: slice keys, cutting slices by row count, settling watermarks."""

from __future__ import annotations

import bisect
from datetime import UTC, datetime

import pytest

from resources.slices import SliceRange, WatermarkCandidate, cut_slices, settle


def test_slice_key_round_trip_and_sorts_like_ranges() -> None:
    slices = [SliceRange(0, 100), SliceRange(100, 2_000), SliceRange(2_000, 10_000_000)]
    assert [SliceRange.from_key(s.key) for s in slices] == slices
    assert sorted(s.key for s in slices) == [s.key for s in slices]
    assert SliceRange(0, 100).key == "000000000000-000000000100"
    with pytest.raises(ValueError):
        SliceRange(5, 5)
    with pytest.raises(ValueError, match="not a slice partition key"):
        SliceRange.from_key("2024-01-01")


def test_timestamp_keys_before_the_year_1000_are_fixed_width_and_read_back() -> None:
    """glibc's strftime("%Y") writes year 500 as "500": such a key was refused as "not a slice partition key" by
    every run and tick, and the times messages suggested for `start_after` did not parse."""
    from resources.slices import datetime_to_micros, micros_text, parse_watermark

    first = datetime_to_micros(datetime(1, 1, 1, tzinfo=UTC))
    year_500 = datetime_to_micros(datetime(500, 3, 14, 1, 2, 3, 4, tzinfo=UTC))
    now = datetime_to_micros(datetime(2026, 11, 29, tzinfo=UTC))
    assert micros_text(first) == "0001-01-01T00:00:00.000000Z"
    assert micros_text(year_500) == "0500-03-14T01:02:03.000004Z"
    slices = [SliceRange(first, year_500, timestamps=True), SliceRange(year_500, now, timestamps=True)]
    assert [SliceRange.from_key(s.key) for s in slices] == slices
    assert sorted(s.key for s in slices) == [s.key for s in slices]
    assert parse_watermark(micros_text(year_500)) == year_500


def _table(ids: list[int]):
    ids = sorted(ids)

    def nth(after: int, n: int, upto: int) -> int | None:
        i = bisect.bisect_right(ids, after) + n - 1
        return ids[i] if i < len(ids) and ids[i] <= upto else None

    def mx(after: int, upto: int) -> int | None:
        within = [i for i in ids if after < i <= upto]
        return max(within) if within else None

    return nth, mx


def test_cut_slices_by_row_count_with_gaps() -> None:
    ids = [1, 2, 3, 10, 11, 50, 51, 52, 53, 1000]
    nth, mx = _table(ids)
    slices = cut_slices(0, 1000, 3, nth, mx)
    assert slices == [SliceRange(0, 3), SliceRange(3, 50), SliceRange(50, 53), SliceRange(53, 1000)]
    # Every id lands in exactly one slice.
    assert sorted(i for s in slices for i in ids if s.lo < i <= s.hi) == ids


def test_cut_slices_stops_at_safe_watermark_and_limit() -> None:
    nth, mx = _table(list(range(1, 101)))
    assert cut_slices(0, 45, 10, nth, mx) == [SliceRange(0, 10), SliceRange(10, 20), SliceRange(20, 30),
                                               SliceRange(30, 40), SliceRange(40, 45)]
    assert cut_slices(0, 100, 10, nth, mx, limit=2) == [SliceRange(0, 10), SliceRange(10, 20)]
    assert cut_slices(100, 100, 10, nth, mx) == []
    assert cut_slices(100, 150, 10, nth, mx) == []  # safe but no rows above 100


def test_settle_keeps_unfinished_candidates() -> None:
    cands = [WatermarkCandidate(10, 1.0), WatermarkCandidate(20, 2.0), WatermarkCandidate(30, 3.0)]
    safe, pending = settle(cands, lambda c: c.marker <= 2.0)
    assert safe == 20
    assert pending == [WatermarkCandidate(30, 3.0)]
    assert settle(cands, lambda c: False) == (None, cands)
