"""python -m tests.explorer --seed N --minutes M [--matrix]: explore the real stack with a seeded schedule.

The seed is printed first; the same seed replays the same schedule (`--steps` stops it at the step a failing run
reached). Needs the local stack's settings in the environment (make explore loads them)."""

from __future__ import annotations

import argparse
import json
import random
import sys

from tests.conftest import _local_stack
from tests.explorer.runner import explore, private_world, run_matrix
from tests.explorer.schedule import KNOWN_OPEN, TABLES, Schedule, matrix


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tests.explorer", description=__doc__)
    ap.add_argument("--seed", type=int, default=None, help="the schedule's seed (default: a fresh one)")
    ap.add_argument("--minutes", type=float, default=2.0, help="explore this long (then a last check)")
    ap.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    ap.add_argument("--matrix", action="store_true", help="the deterministic matrix: every publisher stage x "
                    "{SIGKILL, freeze then takeover}, exactly-once checked after each (before the schedule)")
    ap.add_argument("--include-open", action="store_true", help=f"draw writer kinds of open defects too: {KNOWN_OPEN}")
    ap.add_argument("--broker-faults", action="store_true", help="also stop and restart the broker mid-run: the world "
                    "then runs on a private broker of its own (tests/private_kafka.py), never the stack's")
    ap.add_argument("--spark-faults", action="store_true", help="also SIGKILL the Spark Connect server mid-run and "
                    "start it again: the world then runs on a private Spark Connect server of its own")
    ap.add_argument("--daemon-faults", action="store_true", help="also relay steps by a Dagster daemon of the world's "
                    "own, SIGKILLed (with its run workers) mid-run and started again")
    ap.add_argument("--tables", default=",".join(f"{d}/{w}" for d, w in TABLES),
                    help="which of the tables to use, e.g. pg/int,maria/ts")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**9)
    print(f"explorer seed {seed}", flush=True)
    chosen = tuple(i for i, t in enumerate(TABLES) if "/".join(t) in args.tables.split(","))
    results = {}
    with private_world(_local_stack(), chosen, broker=args.broker_faults, spark=args.spark_faults,
                       daemon=args.daemon_faults) as w:
        if args.matrix:
            results["matrix"] = run_matrix(w, [s for s in matrix() if s.table in chosen])
        if args.minutes > 0 and not w.problems:
            schedule = Schedule(seed, include_open=args.include_open, tables=chosen, broker_faults=args.broker_faults,
                                spark_faults=args.spark_faults, daemon_faults=args.daemon_faults)
            results["explore"] = explore(w, schedule, args.minutes, max_steps=args.steps)
        results["fault_records"] = [r.as_dict() for r in w.records]
        ok = not w.problems
    print("explorer result " + json.dumps({"seed": seed, "ok": ok, **results}), flush=True)
    flags = "".join(f" {name}=1" for name, on in (("BROKER_FAULTS", args.broker_faults),
                                                   ("SPARK_FAULTS", args.spark_faults),
                                                   ("DAEMON_FAULTS", args.daemon_faults)) if on)
    print(f"explorer seed {seed}: {'OK' if ok else 'FAILED'} (replay: make explore SEED={seed}{flags})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
