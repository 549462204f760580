"""The cut planner's pure parts (orchestration/cutting.py), the sensor's run decisions (orchestration/runs.py) and
the sensors' cursors, without a source, Kafka or a Dagster instance."""

import json
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from orchestration.compaction import HistoryCursor
from orchestration.cutting import (
    SENSOR,
    CutMode,
    CutPlan,
    SensorState,
    backfill,
    early_read,
    known_chain,
    trickle,
    trickle_text,
)
from orchestration.runs import ACTIVE, RunsVerdict, last_stop_reason, runs_verdict, stalled_slice
from orchestration.sensors import daemon_min_interval
from resources.config import parse_config
from resources.keys import STOPPED_TAG
from resources.slices import SliceRange, WatermarkCandidate
from resources.stops import StopReason

CONFIG = {
    "sources": {"shop": {"url": "postgresql://u:p@h/db"}},
    "tables": [{"source": "shop", "table": "public.orders", "watermark": "id", "min_slice_rows": 100,
                "max_slice_delay_seconds": 30}],
    "kafka": {"bootstrap_servers": "k:9092"},
}


def _table() -> Any:
    return parse_config(CONFIG).tables[0]


def test_modes_name_what_each_caller_cuts() -> None:
    assert CutMode(heal=True, cut_while_pending=False, limit=500, write=True, refuse=False, batch=True) == SENSOR
    assert backfill(heal=False) == CutMode(heal=False, cut_while_pending=True, limit=100_000, write=True,
                                           refuse=True, batch=False)
    assert not backfill(heal=True, dry_run=True).write
    assert early_read(3) == CutMode(heal=False, cut_while_pending=True, limit=3, batch=False)


def test_cursor_format_is_kept() -> None:
    state = SensorState([WatermarkCandidate(7, 1.0, ("x",))], [SliceRange(0, 5), SliceRange(5, 9)], 12.5, "t1")
    assert json.loads(state.to_cursor()) == {"pending": [[7, 1.0, ["x"]]], "chain": [[0, 5], [5, 9]],
                                             "waiting_since": 12.5, "table": "t1"}
    back = SensorState.from_cursor(state.to_cursor())
    assert (back.pending, back.chain, back.waiting_since, back.table) == (state.pending, state.chain, 12.5, "t1")
    assert SensorState.from_cursor(None) == SensorState()


def test_known_chain_continues_progress_or_is_unknown() -> None:
    chain = [SliceRange(0, 5), SliceRange(5, 9), SliceRange(9, 12)]
    assert known_chain(None, 0) is None
    assert known_chain(chain, 5) == chain[1:]
    assert known_chain(chain, 12) == []
    assert known_chain(chain, 7) is None  # progress inside a slice: storage decides


def test_trickle_holds_a_small_cut_until_enough_rows_or_the_delay() -> None:
    table, slices = _table(), [SliceRange(0, 10)]
    assert trickle(slices, table, None, 100.0, lambda: 5) == (100.0, [])
    assert trickle(slices, table, 100.0, 120.0, lambda: 5) == (100.0, [])
    assert trickle(slices, table, 100.0, 130.0, lambda: 5) == (None, slices)
    assert trickle(slices, table, 100.0, 101.0, lambda: 100) == (None, slices)


def test_trickle_text_says_when_the_held_rows_go() -> None:
    table = _table()
    held = CutPlan(10, [], [], [], SensorState([WatermarkCandidate.settled(20)], waiting_since=100.0))
    assert trickle_text(held, table, 110.0) == (
        "final rows above 10 are held by trickle batching: they are cut once min_slice_rows (100) wait, or "
        "max_slice_delay_seconds (30 s) after the first was seen (in 20 s)")
    assert trickle_text(CutPlan(10, [], [], [], SensorState()), table, 110.0) is None


@dataclass
class _Run:
    status: Any
    tags: dict[str, str] = field(default_factory=dict)


def _record(status: Any, end_time: float | None, **tags: str) -> Any:
    return SimpleNamespace(dagster_run=_Run(status, tags), end_time=end_time)


def test_stalled_slice_resumes_the_first_uncommitted_slice_only_when_no_run_holds_it() -> None:
    chain = [SliceRange(10, 20), SliceRange(20, 30)]
    assert stalled_slice([], chain, 0) is None  # does not continue progress
    assert stalled_slice([_record(ACTIVE[0], None)], chain, 10) is None
    resume = stalled_slice([], chain, 10, max_per_run=2, job_label="relay_t")
    assert resume is not None and resume.run_key == f"relay_t:{chain[0].key}#resume-0"
    assert stalled_slice([_record("FAILURE", 1e18)], chain, 10) is None  # ended just now: retries come first


def test_last_stop_reason_is_the_newest_runs() -> None:
    assert last_stop_reason([]) is None
    assert last_stop_reason([_record("FAILURE", 0.0, **{STOPPED_TAG: StopReason.TIMED_OUT})]) == StopReason.TIMED_OUT


def test_daemon_interval_meets_the_loop() -> None:
    assert [daemon_min_interval(s) for s in (1, 5, 10, 7)] == [1, 4, 9, 7]


def test_history_cursor_format_is_kept() -> None:
    assert HistoryCursor.from_cursor(None).last == {}
    cursor = HistoryCursor({"public.orders": 12.5}).to_cursor()
    assert json.loads(cursor) == {"last": {"public.orders": 12.5}}
    assert HistoryCursor.from_cursor(cursor).last == {"public.orders": 12.5}


def test_runs_verdict_waits_for_runs_resplits_a_timed_out_slice_or_lets_the_cut_go() -> None:
    table, chain = _table(), [SliceRange(10, 20)]
    assert runs_verdict(table, [], 10, 0, [], None) == RunsVerdict()
    assert runs_verdict(table, [], 10, 2, [], None).wait == "2 run(s) of shop.public.orders still queued or running"
    assert runs_verdict(table, chain, 10, 1, [_record(ACTIVE[0], None)], None).wait == (
        "1 run(s) of shop.public.orders still queued or running")
    timed_out = [_record("FAILURE", 1e18, **{STOPPED_TAG: StopReason.TIMED_OUT})]
    assert runs_verdict(table, chain, 10, 0, timed_out, None) == RunsVerdict(resplit=True)
    held = runs_verdict(table, chain, 10, 0, [_record("FAILURE", 1e18)], None)
    assert held.wait == ("shop.public.orders: slices after 10 are not committed yet; waiting for their runs "
                         "(or a resume)")
