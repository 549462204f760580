"""A schedule drawn from a seed: the same seed draws the same steps, in the same order.

A step is a writer's action on one table, the end of a transaction a writer holds open, or a relay step (one
sensor tick of one table and a run of what it requests, perhaps with a fault). The explorer draws steps from one
`random.Random(seed)` only, never from the clock, so `--seed N` replays a failing schedule step for step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from resources.exactly_once import STAGES

# (dialect, watermark kind): the tables every schedule writes to and relays.
TABLES = (("pg", "int"), ("pg", "ts"), ("maria", "int"), ("maria", "ts"))

# What writers do; `ts_only` kinds need a timestamp watermark. Besides these, a `burst` step starts a writer thread
# that commits small transactions, each held 0-2 s, for some seconds beside the schedule (writers.py), and `op`
# steps are an operator's: a column added, `rowrelay replay` of a committed slice, `rowrelay reset` back, a `where:`
# edit (after the table caught up), a bad row then its skip, history compaction, an added column dropped or retyped,
# slice sizing edited with or without a code location reload.
WRITER_KINDS = ("autocommit", "long_txn", "rollback", "batch_now", "whole_second", "client_stamped", "out_of_order")
TS_ONLY = {"batch_now", "whole_second", "client_stamped"}
HELD = {"long_txn", "rollback", "out_of_order", "client_stamped"}  # their transaction stays open over later steps

# The `where:` filters an operator step draws (rows with `v` at least this; None: no filter), `v` drawn in
# [-10**12, 10**12] (bursts: [0, 10**9]): a wide one, one that admits half, one that admits bursts only rarely.
WHERES = (None, -5 * 10**11, 0, 5 * 10**11)

# Writer kinds left out while a defect they hit is open (and fixed elsewhere); each with the open item it hits.
# Drawn anyway with `--include-open`, to see the defect.
KNOWN_OPEN: dict[str, str] = {}

# Faults on a relay step's run: SIGKILLed at a publisher stage; frozen (SIGSTOP) at a stage then taken over by a
# new run and resumed; SIGKILLed a drawn moment after its process starts, before or after RUN_START.
FAULT_KINDS = ("kill", "freeze_takeover", "kill_early")
# With `broker_faults` (a world on a private broker only): the broker SIGKILLed or shut down a drawn moment into the
# run, then started again.
BROKER_FAULT = "broker"
# With `spark_faults` (a world on a private Spark Connect server only): that server SIGKILLed a drawn moment into the
# run, then started again. With `daemon_faults` (a world with a daemon of its own): the relay step is the daemon's,
# and the daemon is SIGKILLed with its run workers a drawn moment into its run of the table, then started again.
SPARK_FAULT = "spark"
# Where a Spark fault may freeze its run instead: at `begun` the slice's rows are read next, from the session the
# fault takes (a small slice's one chunk may have been read ahead already); at `committed` its commit has landed.
SPARK_STAGES = ("begun", "committed")
DAEMON_FAULT = "daemon"


@dataclass(frozen=True)
class Step:
    kind: str  # "write" | "end" | "relay" | "op" (an operator's action)
    table: int  # index into TABLES
    args: dict[str, Any] = field(default_factory=dict)

    def text(self) -> str:
        dialect, wm = TABLES[self.table]
        extra = " ".join(f"{k}={v}" for k, v in sorted(self.args.items()))
        return f"{self.kind} {dialect}/{wm} {extra}".rstrip()


class Schedule:
    """Draws steps one by one from `seed`; `fault_rate` is the chance a relay step's run gets a fault."""

    def __init__(self, seed: int, include_open: bool = False, fault_rate: float = 0.5,
                 tables: tuple[int, ...] = tuple(range(len(TABLES))), broker_faults: bool = False,
                 spark_faults: bool = False, daemon_faults: bool = False) -> None:
        self.seed, self.rng = seed, random.Random(seed)
        self.kinds = [k for k in WRITER_KINDS if include_open or k not in KNOWN_OPEN]
        self.fault_rate, self.tables = fault_rate, tables
        self.faults = (*FAULT_KINDS, *((BROKER_FAULT,) if broker_faults else ()),
                       *((SPARK_FAULT,) if spark_faults else ()), *((DAEMON_FAULT,) if daemon_faults else ()))
        self.open: list[tuple[int, int, int]] = []  # (step it ends at, table, step it began) of each held one
        self.index = 0

    def token(self) -> str:
        """A row's unique mark (its `tok` column), drawn from the seed too."""
        return f"{self.rng.getrandbits(64):016x}"

    def next(self) -> Step:
        self.index += 1
        due = [o for o in self.open if o[0] <= self.index]
        if due:
            self.open.remove(due[0])
            return Step("end", due[0][1], {"txn": due[0][2], "commit": self.rng.random() < 0.8})
        table = self.rng.choice(self.tables)
        draw = self.rng.random()
        held_here = any(o[1] == table for o in self.open)
        if draw < 0.03 and not held_here:  # a held transaction would block the DDL
            return Step("op", table, {"op": "add_column"})
        if draw < 0.06:  # `rowrelay replay` of a committed slice, `pick` choosing which
            return Step("op", table, {"op": "replay", "pick": round(self.rng.random(), 3)})
        if draw < 0.08 and not held_here:  # `rowrelay reset` back to a bound (or a point inside a slice)
            return Step("op", table, {"op": "reset", "pick": round(self.rng.random(), 3),
                                      "at_bound": self.rng.random() < 0.5})
        if draw < 0.10 and not self.open:  # its catch-up first: a held transaction anywhere stalls PostgreSQL's cuts
            return Step("op", table, {"op": "where", "v_min": self.rng.choice(WHERES)})
        if draw < 0.12 and not self.open:  # a bad row, relayed until its run stops, then skipped
            whole = TABLES[table][1] == "ts" and self.rng.random() < 0.5  # the row shares its time with others
            return Step("op", table, {"op": "bad_row", "rows": self.rng.choice((1, 3, 40)),
                                      "at": self.rng.randrange(40), "seed": self.token(),
                                      **({"whole_second": True} if whole else {})})
        if draw < 0.135:  # history compaction, the clock `hours` ahead
            return Step("op", table, {"op": "compact", "hours": self.rng.choice((0, 2, 30, 24 * 100)),
                                      "full": self.rng.random() < 0.3})
        if draw < 0.15 and not held_here:  # an added column dropped or retyped, followed or stopping the table
            policy = "fail" if not self.open and self.rng.random() < 0.4 else "follow"
            return Step("op", table, {"op": "schema", "change": self.rng.choice(("drop", "retype")),
                                      "policy": policy, "seed": self.token()})
        if draw < 0.165:  # slice sizing edited; `reload` False: the sensor keeps the old config, runs read the new
            return Step("op", table, {"op": "config", "slice_max_rows": self.rng.choice((20, 150, 1000)),
                                      "max_slices_per_run": self.rng.choice((1, 3)),
                                      "reload": self.rng.random() < 0.5})
        if draw < 0.215:
            whole = TABLES[table][1] == "ts" and "whole_second" in self.kinds and self.rng.random() < 0.5
            return Step("write", table, {"writer": "burst", "seconds": self.rng.randint(5, 20), "seed": self.token(),
                                         **({"whole_second": True} if whole else {})})
        if draw < 0.6:
            return self._write(table)
        return self._relay(table)

    def _write(self, table: int) -> Step:
        ts = TABLES[table][1] == "ts"
        kind = self.rng.choice([k for k in self.kinds if ts or k not in TS_ONLY])
        args: dict[str, Any] = {"writer": kind, "rows": self.rng.choice((1, 2, 5, 20, 200)), "seed": self.token()}
        if kind in HELD and len(self.open) < 2:
            # Held over at most two later steps: a PostgreSQL transaction held open stalls every cut of the
            # cluster (its xmin), other people's too.
            self.open.append((self.index + self.rng.randint(1, 2), table, self.index))
            args["txn"] = self.index
        return Step("write", table, args)

    def _relay(self, table: int) -> Step:
        args: dict[str, Any] = {}
        if self.rng.random() < self.fault_rate:
            fault = self.rng.choice(self.faults)
            args["fault"] = fault
            if fault == "kill_early":
                args["after_s"] = round(self.rng.uniform(0.5, 6.0), 1)
            elif fault == BROKER_FAULT:
                args.update(after_s=round(self.rng.uniform(1.0, 8.0), 1), kill=self.rng.random() < 0.5,
                            down_s=round(self.rng.uniform(0.0, 5.0), 1))
            elif fault == SPARK_FAULT:  # a drawn moment, or the run frozen at a stage: mid-read, or committed
                args.update(after_s=round(self.rng.uniform(0.5, 8.0), 1), down_s=round(self.rng.uniform(0.0, 5.0), 1))
                if self.rng.random() < 0.5:
                    args["stage"] = self.rng.choice(SPARK_STAGES)
            elif fault == DAEMON_FAULT:  # counted from its run's start: a run takes seconds
                args.update(after_s=round(self.rng.uniform(0.0, 3.0), 1), down_s=round(self.rng.uniform(0.0, 5.0), 1))
            else:
                args["stage"] = self.rng.choice(STAGES)
        return Step("relay", table, args)


def matrix() -> list[Step]:
    """The deterministic matrix: every publisher stage x {SIGKILL, freeze then takeover}, tables in turn."""
    cells = [(stage, fault) for stage in STAGES for fault in ("kill", "freeze_takeover")]
    return [Step("relay", i % len(TABLES), {"fault": fault, "stage": stage, "wait_s": 60})
            for i, (stage, fault) in enumerate(cells)]


def ops_cells(table: int) -> list[Step]:
    """Every operator action once on `table`, in an order where each has something to act on: columns added,
    slice sizing edited without then with a reload, a row relayed to its stop then skipped, a reset back inside a
    slice, a `where:` narrowed then dropped, a column retyped under `follow` and dropped under `fail`, a replay, a
    compaction, and a reset to a slice bound."""
    ts = TABLES[table][1] == "ts"
    write = [Step("write", table, {"writer": "autocommit", "rows": 20, "seed": f"o{n}"}) for n in range(4)]
    return [write[0], Step("op", table, {"op": "add_column"}), Step("op", table, {"op": "add_column"}), write[1],
            Step("op", table, {"op": "config", "slice_max_rows": 20, "max_slices_per_run": 1, "reload": False}),
            Step("relay", table, {"wait_s": 60}),
            Step("op", table, {"op": "config", "slice_max_rows": 1000, "max_slices_per_run": 3, "reload": True}),
            Step("op", table, {"op": "bad_row", "rows": 40, "at": 7, "seed": "ob", **({"whole_second": True}
                                                                                   if ts else {})}),
            Step("op", table, {"op": "reset", "pick": 0.5, "at_bound": False}), Step("relay", table, {"wait_s": 60}),
            Step("op", table, {"op": "where", "v_min": 0}), write[2],
            Step("op", table, {"op": "schema", "change": "retype", "policy": "follow", "seed": "os1"}),
            Step("relay", table, {"wait_s": 60}), Step("op", table, {"op": "where", "v_min": None}),
            Step("op", table, {"op": "schema", "change": "drop", "policy": "fail", "seed": "os2"}), write[3],
            Step("op", table, {"op": "replay", "pick": 0.9}),
            Step("op", table, {"op": "compact", "hours": 24 * 100, "full": True}),
            Step("op", table, {"op": "reset", "pick": 0.3, "at_bound": True})]
