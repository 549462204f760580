"""orchestration/cli/reset.py `reset_text` and orchestration/reset.py `ResetDone`: what a reset says it did."""

from __future__ import annotations

from orchestration.cli.reset import reset_text
from orchestration.reset import ResetDone, ResetPartitions
from resources.exactly_once import ProgressRecord
from resources.slices import SliceRange


def _done(before: ProgressRecord | None, plan: ResetPartitions, moved: bool = False) -> ResetDone:
    record = ProgressRecord("src.public.t", "reset-50", 50, 50, 0, 0, "", "t")
    return ResetDone(50, record, before, ("id", "integer"), moved, False, before.hi if before else 0, plan, [], {})


def test_a_reset_back_says_what_it_deleted_and_settled() -> None:
    before = ProgressRecord("src.public.t", "0-100", 0, 100, 100, 0, "", "t")
    plan = ResetPartitions(["0-100"], {"0-100": SliceRange(0, 50)}, ["40-50"])
    done = _done(before, plan)
    assert done.was == "100"
    assert reset_text(done) == (
        "progress reset to 50 (was 100); 1 partition(s) above it deleted; 1 uncommitted partition(s) at or below it "
        "materialized as settled by the reset (rows above 100 in them never sent); rows after 50 will be sent")


def test_a_reset_over_empty_progress_goes_by_dagsters_records() -> None:
    done = _done(None, ResetPartitions([], {}, ["0-10"], ["10-20"]))
    assert done.was == "empty"
    text = reset_text(done)
    assert "1 partition(s) at or below it that Dagster records as committed left as they are" in text
    assert "1 partition(s) at or below it that Dagster records no materialization of materialized" in text


def test_a_reset_that_moves_the_watermark_names_it() -> None:
    before = ProgressRecord("src.public.t", "0-100", 0, 100, 100, 0, "", "t")
    text = reset_text(_done(before, ResetPartitions(["0-100"], {}, []), moved=True))
    assert text.startswith("progress reset to 50 in watermark 'id' (integer) (was 100); 1 partition(s) of the "
                           "previous watermark deleted")
