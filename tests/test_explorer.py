"""The randomized schedule explorer (tests/explorer) as part of the fault suite: the deterministic matrix (every
publisher stage x {SIGKILL, freeze then takeover}, exactly-once checked after each), every operator action once on
a timestamp table (a bad row then its skip, resets, `where:` edits, columns retyped and dropped, replay,
compaction), and one round of a schedule drawn from a fresh seed, printed first so a failure replays with
`make explore SEED=<seed>`."""

from __future__ import annotations

import json
import random

import pytest

from tests.conftest import Services
from tests.explorer.runner import explore, run_matrix, run_ops, world
from tests.explorer.schedule import TABLES, Schedule, matrix, ops_cells

pytestmark = [pytest.mark.faults, pytest.mark.integration]
ALL = tuple(range(len(TABLES)))


def _require_spark_remote(services: Services) -> None:
    if not services.spark_remote:
        pytest.skip("the explorer needs the stack's Spark Connect server")


def test_every_publisher_stage_killed_or_frozen_then_taken_over(services: Services) -> None:
    _require_spark_remote(services)
    with world(services, ALL) as w:
        result = run_matrix(w, matrix())
        print(json.dumps({"matrix": result, "faults": [r.as_dict() for r in w.records]}))
        assert not w.problems, "\n".join(w.problems)
        cells = {(r.fault, r.stage) for r in w.records}
        assert len(cells) == len(matrix()), f"cells not exercised: {sorted(cells)}"


def test_every_operator_action_on_a_timestamp_table(services: Services) -> None:
    _require_spark_remote(services)
    pg_ts = TABLES.index(("pg", "ts"))
    with world(services, (pg_ts,)) as w:
        result = run_ops(w, ops_cells(pg_ts))
        print(json.dumps({"ops": result, "records": [r.as_dict() for r in w.records]}))
        assert not w.problems, "\n".join(w.problems)


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
