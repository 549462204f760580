"""assets/checks.py: the slices a failed run committed before its failure."""

from __future__ import annotations


def test_slices_committed_before_a_failure_are_found_by_their_ranges() -> None:
    """The failure hook's slices: those inside the run's tag `<run>/first...last`, in watermark order, negative
    watermarks (whose keys do not sort as text) included; none without the tag, or with a tag of another run."""
    from assets.checks import committed_before_failure
    from resources.kafka_io_manager import COMMITTED_BEFORE_FAILURE_TAG
    from resources.slices import SliceRange

    keys = [SliceRange(lo, hi).key for lo, hi in [(20, 30), (-10, -5), (-5, 0), (0, 10), (10, 20), (-20, -10)]]
    tag = {COMMITTED_BEFORE_FAILURE_TAG: f"run-a/{SliceRange(-10, -5).key}...{SliceRange(0, 10).key}"}
    assert committed_before_failure(tag, keys, "run-a") == [SliceRange(-10, -5).key, SliceRange(-5, 0).key,
                                                            SliceRange(0, 10).key]
    assert committed_before_failure({}, keys, "run-a") == []
    # Dagster's retry of run-a copies its tags: the retry committed none of those slices.
    assert committed_before_failure(tag, keys, "run-b") == []
