"""`rowrelay backfill`: the table's backlog cut into slices and run now, in this process
(orchestration/backfill.py), with what was cut, the runs' progress and how it ended said as it goes."""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from typing import Any

from dagster import DagsterInstance, Definitions

from assets.identity import channel_for
from orchestration.backfill import (
    EARLY_READ_WAIT_S,
    apply_cut,
    cut_backlog,
    end_of_startup,
    execute_slices,
    interrupted_text,
    keep_storage_connections,
    run_failure_text,
    run_interrupted,
    start_backfill,
)
from orchestration.cli.errors import dagster_home_set
from orchestration.cli.progress import BackfillProgress
from orchestration.exits import INTERRUPTED, NOT_FINAL, OK
from orchestration.factory import job_name
from orchestration.tables import select_tables
from resources.config import RelayConfig, TableConfig
from resources.errors import RowrelayError
from resources.exactly_once import read_committed_progress
from resources.kafka_io_manager import KafkaIOManager
from resources.slice_reads import EARLY_READS
from resources.source_database import SourceDatabaseResource


def cmd_backfill(config: RelayConfig, args: argparse.Namespace) -> int:
    """Cut the table's backlog (up to its safe high watermark) into slices, add them as partitions and run every
    uncommitted slice in this process: one run per `max_slices_per_run` slices, recorded on the Dagster instance
    like any run (`cut_backlog`, `execute_slices`)."""
    (table,) = select_tables(config, args.table)
    if not dagster_home_set():  # before the early read: it would create the table's topics
        return 1
    defs, io_manager, early_started = start_backfill(config, table, args.dry_run)
    source = SourceDatabaseResource.for_source(config.sources[table.source])
    started = time.monotonic()
    with DagsterInstance.get() as instance:
        keep_storage_connections(instance)
        try:
            cut = cut_backlog(instance, table, io_manager, source, args.dry_run, args.settle_timeout)
        except RowrelayError as exc:  # any other error keeps its traceback
            print(f"rowrelay: {exc}", file=sys.stderr)
            return 1
        finally:
            source.dispose()
        plan = cut.plan
        if not args.dry_run:  # a dry run changes nothing: it says what a backfill would delete, cut and publish
            apply_cut(instance, table, plan)
        say_cut(table, plan, args)
        if args.dry_run:
            return OK
        if not plan.chain:  # nothing to publish: up to date (done), or the rows there are are not final yet
            return NOT_FINAL if plan.state.unsettled else OK
        code = run_backfill(instance, defs, table, io_manager, plan, cut.total_rows, early_started)
        if code is not None:
            return code
    print(f"{table.table_id}: backfill done in {time.monotonic() - started:.1f} s", flush=True)
    return 0


def say_cut(table: TableConfig, plan: Any, args: argparse.Namespace) -> None:
    """What the cut deleted and cut, what is to be published, and the rows left for later (and why)."""
    would = "would be " if args.dry_run else ""
    if plan.delete:
        print(f"{table.table_id}: {'would delete' if args.dry_run else 'deleted'} partitions "
              f"{[s.key for s in plan.delete]}: they do not continue Kafka's progress "
              f"({plan.text(plan.committed_hi)}) and could never commit", flush=True)
    print(f"{table.table_id}: committed up to {plan.text(plan.committed_hi)}; {len(plan.add)} new slice(s) "
          f"{would}cut; {len(plan.chain)} slice(s) {'would be published' if args.dry_run else 'to publish'}"
          + (f" ({plan.waiting})" if plan.waiting else ""), flush=True)
    if args.dry_run and plan.add:
        print(f"{table.table_id}: slices {plan.add[0].key} ... {plan.add[-1].key} (dry run: nothing cut, "
              "added or sent)", flush=True)
    frontier = plan.chain[-1].hi if plan.chain else plan.committed_hi
    if unsettled := plan.state.unsettled:  # rows above what was cut are not final yet
        newest = max(c.watermark for c in unsettled)
        if plan.add:  # cut what was final at once; the newer rows were still settling
            print(f"{table.table_id}: rows above {plan.text(frontier)} (up to {plan.text(newest)}) were not "
                  "final yet (a transaction that may write below them was open): the sensor or the next backfill "
                  "sends them", flush=True)
        else:  # the wait ran out. Not a failure: the rest waits for the next backfill or tick
            print(f"rowrelay: warning: {table.table_id}: rows above {plan.text(frontier)} (up to "
                  f"{plan.text(newest)}) are not final after {args.settle_timeout:g} s: a transaction that may "
                  "still write below them is open (or settle_seconds has not passed), so they were not cut. Run "
                  "backfill again once it ends, or raise --settle-timeout", file=sys.stderr, flush=True)
    elif final := [c.watermark for c in plan.state.pending if c.watermark > frontier]:
        # Final rows beyond the cut's limit of slices: not waiting for anything, only for the next cut.
        print(f"{table.table_id}: rows above {plan.text(frontier)} (up to {plan.text(max(final))}) are final "
              "but beyond this backfill's slices: the sensor or the next backfill sends them", flush=True)


def run_backfill(instance: DagsterInstance, defs: Definitions, table: TableConfig, io_manager: KafkaIOManager,
                 plan: Any, total_rows: int, early_started: threading.Event) -> int | None:
    """Run the cut's slices, showing their progress (the bar, or without a terminal a line per run); a failed or
    interrupted backfill's exit code, None once every run committed."""
    todo = plan.chain
    job = defs.resolve_job_def(job_name(table))
    end_of_startup()
    early_started.wait(EARLY_READ_WAIT_S)  # a run takes early chunks only once they are registered
    channel = channel_for(table, io_manager.transactional_id_prefix)
    interrupted = False
    try:
        with BackfillProgress(table.table_id, io_manager.kafka_conf(), channel, todo, plan.committed_hi,
                              total_rows, tty=sys.stdout.isatty()), contextlib.ExitStack() as cleanup:
            cleanup.callback(EARLY_READS.discard)  # chunks no run took (its first slice was another)
            for group, result in execute_slices(instance, job, table, io_manager.kafka_conf(), channel, todo):
                if not result.success and run_interrupted(result):
                    interrupted = True  # Dagster turned the Ctrl-C into a failed run: not a failure to explain
                    break
                if not result.success:
                    print(f"rowrelay: run {result.run_id} for slices {group[0].key}...{group[-1].key} failed: "
                          f"{run_failure_text(instance, result)}", file=sys.stderr)
                    return 1
                print(f"slices {group[0].key}...{group[-1].key}: committed (run {result.run_id})", flush=True)
    except KeyboardInterrupt:  # between runs, outside Dagster's handler
        interrupted = True
    if not interrupted:
        return None
    progress = read_committed_progress(io_manager.kafka_conf(), channel)
    upto = progress.hi if progress is not None else plan.committed_hi
    print(f"rowrelay: {interrupted_text(table.table_id, todo, upto, plan.text)}", file=sys.stderr, flush=True)
    return INTERRUPTED  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped (143 for SIGTERM)
