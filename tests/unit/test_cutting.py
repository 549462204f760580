"""orchestration/cutting.py: the table sensor's cursor."""

from __future__ import annotations

import json

from resources.slices import WatermarkCandidate


def test_sensor_cursor_keeps_a_candidates_log_position_and_reads_cursors_without_it() -> None:
    from orchestration.cutting import SensorState

    state = SensorState([WatermarkCandidate(5, 1.5, ("a|b",), 48132), WatermarkCandidate(9, 2.5)])
    assert SensorState.from_cursor(state.to_cursor()).pending == state.pending
    # A cursor written before log positions were kept: its candidates check the log position at the check.
    old = json.dumps({"pending": [[5, 1.5, ["a|b"]], [9, 2.5]]})
    assert SensorState.from_cursor(old).pending == [WatermarkCandidate(5, 1.5, ("a|b",)), WatermarkCandidate(9, 2.5)]
