"""assets/relay.py: the run's slices to publish."""

from __future__ import annotations

import pytest

from resources.exactly_once import SliceOutOfOrder
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.slices import SliceRange


def test_a_run_whose_slices_do_not_follow_each_other_says_so() -> None:
    """Within a run, the slice before is the run's previous slice, not the committed progress the message named."""
    from assets.relay import slices_to_publish
    from resources.exactly_once import TableChannel

    channel = TableChannel.for_table("s.p.t", "t", prefix=PREFIX)
    assert slices_to_publish(channel, [SliceRange(5, 8), SliceRange(0, 5)], 0) == [SliceRange(0, 5), SliceRange(5, 8)]
    with pytest.raises(SliceOutOfOrder, match=r"slices \(0, 5\] and \(3, 8\] do not follow each other"):
        slices_to_publish(channel, [SliceRange(0, 5), SliceRange(3, 8)], 0)
    with pytest.raises(SliceOutOfOrder, match=r"\(2, 3\] must commit first; the run retries"):
        slices_to_publish(channel, [SliceRange(3, 8)], 2)
