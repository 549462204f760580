"""The randomized schedule explorer (tests/explorer) as part of the fault suite: the deterministic matrix (every
publisher stage x {SIGKILL, freeze then takeover}, exactly-once checked after each), every operator action once on
a timestamp table (a bad row then its skip, resets, `where:` edits, columns retyped and dropped, replay,
compaction), and one round of a schedule drawn from a fresh seed, printed first so a failure replays with
`make explore SEED=<seed>`. Beside them, unit tests of the schedule: which fault kinds it draws under which flags."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from tests.conftest import Services
from tests.explorer.runner import explore, run_matrix, run_ops, world
from tests.explorer.schedule import (
    BROKER_FAULT,
    DAEMON_FAULT,
    FAULT_KINDS,
    SPARK_FAULT,
    TABLES,
    Schedule,
    matrix,
    ops_cells,
)

ALL = tuple(range(len(TABLES)))
FAULT_SUITE = [pytest.mark.faults, pytest.mark.integration]


def fault_suite(test: Any) -> Any:
    for mark in FAULT_SUITE:
        test = mark(test)
    return test


def drawn_faults(seed: int, steps: int = 3000, **flags: bool) -> list[dict[str, Any]]:
    schedule = Schedule(seed, **flags)
    return [s.args for s in (schedule.next() for _ in range(steps)) if "fault" in s.args]


def test_service_faults_are_drawn_only_under_their_flags() -> None:
    kinds = {a["fault"] for a in drawn_faults(7)}
    assert kinds == set(FAULT_KINDS)
    assert {a["fault"] for a in drawn_faults(7, spark_faults=True)} == {*FAULT_KINDS, SPARK_FAULT}
    assert {a["fault"] for a in drawn_faults(7, daemon_faults=True)} == {*FAULT_KINDS, DAEMON_FAULT}
    every = {a["fault"] for a in drawn_faults(7, broker_faults=True, spark_faults=True, daemon_faults=True)}
    assert every == {*FAULT_KINDS, BROKER_FAULT, SPARK_FAULT, DAEMON_FAULT}


def test_service_faults_carry_their_drawn_moments() -> None:
    for args in drawn_faults(11, spark_faults=True, daemon_faults=True):
        if args["fault"] in (SPARK_FAULT, DAEMON_FAULT):
            assert {"fault", "after_s", "down_s"} <= set(args) <= {"fault", "after_s", "down_s", "stage"}, args
            assert args.get("stage", "begun") in ("begun", "committed") and args["fault"] == SPARK_FAULT \
                or "stage" not in args, args
            assert 0.0 <= args["after_s"] <= 8.0 and 0.0 <= args["down_s"] <= 5.0, args


def test_a_seed_replays_its_service_faults() -> None:
    flags = {"spark_faults": True, "daemon_faults": True}
    assert drawn_faults(104, 500, **flags) == drawn_faults(104, 500, **flags)
    assert drawn_faults(104, 500, **flags) != drawn_faults(105, 500, **flags)


def _require_spark_remote(services: Services) -> None:
    if not services.spark_remote:
        pytest.skip("the explorer needs the stack's Spark Connect server")


@fault_suite
def test_every_publisher_stage_killed_or_frozen_then_taken_over(services: Services) -> None:
    _require_spark_remote(services)
    with world(services, ALL) as w:
        result = run_matrix(w, matrix())
        print(json.dumps({"matrix": result, "faults": [r.as_dict() for r in w.records]}))
        assert not w.problems, "\n".join(w.problems)
        cells = {(r.fault, r.stage) for r in w.records}
        assert len(cells) == len(matrix()), f"cells not exercised: {sorted(cells)}"


@fault_suite
def test_every_operator_action_on_a_timestamp_table(services: Services) -> None:
    _require_spark_remote(services)
    pg_ts = TABLES.index(("pg", "ts"))
    with world(services, (pg_ts,)) as w:
        result = run_ops(w, ops_cells(pg_ts))
        print(json.dumps({"ops": result, "records": [r.as_dict() for r in w.records]}))
        assert not w.problems, "\n".join(w.problems)


@fault_suite
def test_short_randomized_schedule(services: Services) -> None:
    """One round (12 steps, then the check): the operator actions' cells above took the rest of its time."""
    _require_spark_remote(services)
    seed = random.SystemRandom().randrange(10**9)
    print(f"explorer seed {seed} (replay: make explore SEED={seed})")
    with world(services, ALL) as w:
        result = explore(w, Schedule(seed), minutes=0.5)
        print(json.dumps({"seed": seed, **result, "faults": [r.as_dict() for r in w.records]}))
        assert not w.problems, f"seed {seed}:\n" + "\n".join(w.problems)
        assert result["rounds"] >= 1


def test_a_drawn_fault_is_recorded_under_one_name_injected_or_not() -> None:
    from tests.explorer.faults import record_name

    assert record_name({"fault": SPARK_FAULT}) == "spark_kill"
    assert record_name({"fault": DAEMON_FAULT}) == "daemon_kill"
    assert record_name({"fault": BROKER_FAULT, "kill": False}) == "broker_restart"
    assert record_name({"fault": "kill", "stage": "begun"}) == "kill"
