"""`rowrelay reset`: a deliberate new baseline for a table (orchestration/reset.py), refused while its runs are
active unless forced, and what it did to the table's partitions, said in one line."""

from __future__ import annotations

import argparse
import sys

from dagster import DagsterInstance

from orchestration.cli.arguments import watermark_kind_error
from orchestration.factory import job_name
from orchestration.instance import table_active_runs
from orchestration.reset import ResetDone, reset_table, reset_watermark
from orchestration.tables import select_tables
from resources.config import RelayConfig


def cmd_reset(config: RelayConfig, args: argparse.Namespace) -> int:
    """Rows at or below --after are never sent again, rows above it once (`reset_table`)."""
    (table,) = select_tables(config, args.table)
    reflected, kind = reset_watermark(config, table)
    wrong = None if kind is None else watermark_kind_error(table.table_id, kind, "--after", args.after)
    if wrong:
        print(f"rowrelay: {wrong}; nothing was reset", file=sys.stderr)
        return 2
    after = int(args.after)  # a plain int from here: Dagster's metadata takes no int subclass
    with DagsterInstance.get() as instance:
        # A Materialize from the UI runs `__ASSET_JOB`: counted too (the reset would fence it, with a stop text
        # telling the user nothing was lost).
        active = table_active_runs(instance, table, job_name(table))
        if active and not args.force:
            print(f"rowrelay: {active} run(s) of {table.table_id} are queued or running; stop the table's sensor and "
                  "let them finish (or pass --force: the reset fences a running publisher)", file=sys.stderr)
            return 1
        done = reset_table(instance, config, table, after, args.reason, reflected, kind)
    print(f"{table.table_id}: {reset_text(done)}", flush=True)
    return 0


def reset_text(done: ResetDone) -> str:
    """What a reset did: where progress stands now and was, and what became of the table's partitions."""
    text, plan = done.text, done.plan
    settled = plan.settled
    if done.before is None:  # Kafka knew nothing: what is said comes from Dagster's materializations
        below_text = ((f"; {len(plan.recorded)} partition(s) at or below it that Dagster records as committed left "
                       "as they are (progress was empty: their rows count as published)" if plan.recorded else "")
                      + (f"; {len(settled)} partition(s) at or below it that Dagster records no materialization of "
                         f"materialized as settled by the reset (rows above {text(done.replaced_hi)} in them never "
                         "sent by a run of theirs)" if settled else ""))
    else:
        below_text = (f"; {len(settled)} uncommitted partition(s) at or below it materialized as settled by the "
                      f"reset (rows above {text(done.replaced_hi)} in them never sent)" if settled else "")
    deleted = (f"{len(plan.dropped)} partition(s) of the previous watermark deleted (above it or never committed), "
               "its committed ones below it kept as its history" if done.moved else
               f"{len(plan.dropped)} partition(s) above it deleted{below_text}")
    where = f" in watermark {done.reflected[0]!r} ({done.reflected[1]})" if done.moved and done.reflected else ""
    return (f"progress reset to {text(done.after)}{where} (was {done.was}); {deleted}; rows after "
            f"{text(done.after)} will be sent")
