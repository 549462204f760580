"""`rowrelay backfill`'s engine: cut a table's backlog as the sensor would (`cut`) and execute its slices'
runs in this process, recorded on the Dagster instance like any run; plus what a backfill's startup overlaps (the
first slice's early read) and what it says of a run that failed, was interrupted or died."""

from __future__ import annotations

import contextlib
import gc
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from math import ceil
from typing import Any

from dagster import (
    AssetMaterialization,
    AssetRecordsFilter,
    DagsterInstance,
    DagsterRunStatus,
    Definitions,
    RunsFilter,
)
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from assets.identity import asset_key, channel_for, partitions_for, pool_name
from assets.records import last_recorded_slice
from assets.relay import build_table_slices
from orchestration.compaction import open_keys
from orchestration.cutting import CutInputs, SensorState, backfill, cached_table_shape, cut, early_read
from orchestration.factory import build_definitions, job_name
from orchestration.instance import ensure_pool
from orchestration.launcher import in_process_worker_gone
from orchestration.runs import ACTIVE, run_slices
from orchestration.storage import PooledRunStorage
from resources.config import RelayConfig, TableConfig
from resources.exactly_once import (
    TableChannel,
    broker_max_transaction_timeout_ms,
    ensure_topics,
    read_committed_progress,
    tiles_by_range,
)
from resources.kafka_io_manager import STOPPED_TAG, KafkaIOManager, progress_metadata
from resources.keys import BACKFILL_TAG, RUN_FAILED_LATER
from resources.slice_reads import EARLY_READS
from resources.slices import SliceRange
from resources.source_database import SourceDatabaseResource
from resources.stops import ADVICE


def keep_storage_connections(instance: Any) -> None:
    """Hold one connection per Dagster storage for this process instead of one per storage call.

    Dagster's PostgreSQL storages default to NullPool: every call opens a connection (a backend fork and a SCRAM
    handshake on each side), and a CLI backfill that records whole runs in its own process makes over a hundred of
    them per slice. `optimize_for_webserver` is how Dagster gives its one long-lived process (the webserver) pooled
    storages (pool_size 1); it is not named for CLI use, so it is called only here. statement_timeout 0: none, as
    with NullPool. A connection the database dropped (a restart) fails one call and is replaced on the next.
    rowrelay's own `PooledPostgresStorage` (dagster.yaml) pools already, with pre-ping: it is left as it is.
    """
    if isinstance(instance.run_storage, PooledRunStorage):
        return
    instance.optimize_for_webserver(statement_timeout=0, pool_recycle=3600, max_overflow=2)


EARLY_READ_WAIT_S = 10.0


def end_of_startup() -> None:
    """Collect garbage again, now that startup is over, without walking what startup built.

    Importing Dagster, PySpark and pandas and loading the definitions and the instance create hundreds of
    thousands of long-lived objects, and each full collection meanwhile walks all of them on the one busy core
    before Spark reads (`backfill` runs with the collector off until here). gc.freeze moves them out of every
    later collection. Cyclic garbage made meanwhile (a traceback, the cut's polls while the newest rows settle) is
    frozen with them: a little memory for the process's life, against a full walk of the heap to find it.
    """
    gc.freeze()
    gc.enable()


def start_early_read(config: RelayConfig, table: TableConfig, io_manager: Any, started: threading.Event) -> None:
    """Work out the slice a backfill will publish first and start reading its first chunks (EarlyRead), while the
    main thread loads Dagster and creates the run. The same cut as the real one (`cut`, up to the safe
    watermark) from Kafka's progress alone: the run takes the chunks only if its first slice turns out the same.
    Best effort: any error here is the real cut's or the run's to report. `started` is set once the early read is
    registered or given up."""
    with contextlib.suppress(Exception), contextlib.ExitStack() as finish:
        finish.callback(started.set)  # on every way out: the backfill never waits for a read that gave up
        source = SourceDatabaseResource.for_source(config.sources[table.source])
        finish.callback(source.dispose)  # its pooled connections; the chunks' JDBC reads are Spark's own
        channel = channel_for(table, io_manager.transactional_id_prefix)
        progress = read_committed_progress(io_manager.kafka_conf(), channel)
        if progress is None and table.start_after == "latest":
            return  # the real cut records a baseline first; nothing to guess here
        # As many slices as the early chunks may span (one, unless slices are smaller than chunks).
        depth = io_manager.prefetch_chunks + 1
        plan = cut(CutInputs(table, source, io_manager, progress, [], SensorState()),
                   early_read(max(1, min(depth, ceil(depth * io_manager.chunk_rows / table.slice_max_rows)))))
        slices = build_table_slices(source, io_manager.spark, table, channel, plan.add, plan.committed_hi,
                                    progress.columns if progress else [])
        if plan.add and slices.read is not None and slices.pending == plan.add:
            EARLY_READS.start(map(slices.read, plan.add), io_manager.chunk_rows, depth)
        started.set()  # registered: the run may start
        # The run's publisher would create the table's topics (and read the brokers' transaction limit, cached per
        # process) before its first message: done here, its fencing is then a round trip.
        ensure_topics(io_manager.kafka_conf(), channel)
        broker_max_transaction_timeout_ms(io_manager.kafka_conf())


def start_backfill(config: RelayConfig, table: TableConfig, dry_run: bool
                   ) -> tuple[Definitions, KafkaIOManager, threading.Event]:
    """The definitions and the table's IO manager; unless `dry_run`, Spark checked and the first slice's early read
    started. The event is set once the early read is registered or given up."""
    defs = build_definitions(config)
    io_manager: KafkaIOManager = defs.resources["kafka_io_manager"]  # type: ignore[assignment]
    early_started = threading.Event()
    if not dry_run:
        # A Spark Connect server that does not answer fails here, in seconds, before anything is cut.
        io_manager.spark.check_server()
        # Spark first: the first slice's first chunks are read (EarlyRead) while Dagster's storage loads and the
        # run is created, on a core that would otherwise idle. The slice is worked out meanwhile (Kafka, the source).
        threading.Thread(target=start_early_read, args=(config, table, io_manager, early_started), daemon=True,
                         name="rowrelay-early-read").start()
        with contextlib.suppress(Exception):  # a Spark that fails now fails the run, with its own message
            io_manager.spark.get_session()
    return defs, io_manager, early_started


@dataclass
class BackfillCut:
    """What a backfill's cut decided (`cut`'s plan) and the rows of the slices it is to publish."""

    plan: Any
    total_rows: int


def cut_backlog(instance: DagsterInstance, table: TableConfig, io_manager: KafkaIOManager,
                source: SourceDatabaseResource, dry_run: bool, settle_timeout: float) -> BackfillCut:
    """Cut the table's backlog (up to its safe high watermark) into slices, as the sensor does, waiting up to
    `settle_timeout` beyond `settle_seconds` for the newest rows to become final. The cut is the sensor's
    (`cut`); fencing and the order check make it safe next to the daemon's runs, and partitions a racing cut
    left off Kafka's progress are healed by the next cut. Nothing is written with `dry_run`."""
    partitions = partitions_for(table)
    channel = channel_for(table, io_manager.transactional_id_prefix)
    if not dry_run:
        ensure_pool(instance, pool_name(table))
    active = instance.get_runs_count(RunsFilter(job_name=job_name(table), statuses=ACTIVE))
    state = SensorState()
    deadline = time.monotonic() + table.settle_seconds + settle_timeout
    while True:  # the newest rows count once they are final (open transactions, settle delay)
        progress = read_committed_progress(io_manager.kafka_conf(), channel)
        # Only the uncommitted keys matter to a cut: read from the newest end, not all of history.
        keys = open_keys(instance, partitions.name, progress.hi if progress else channel.start_after)
        # Refused as the run's publisher would refuse, before a partition is added (and by the dry run): over empty
        # progress, the slices Dagster recorded as committed count too, as in the run.
        recorded = last_recorded_slice(instance, asset_key(table)) if progress is None else None
        # A backfill publishes every final row now; holding a few back for `min_slice_rows` (trickle batching) is
        # the sensor's cost control, and waiting them out would call them "not final" (`backfill` mode).
        plan = cut(CutInputs(table, source, io_manager, progress, keys, state, recorded=recorded),
                   backfill(heal=not active, dry_run=dry_run))
        # Only rows not final yet are worth waiting for: a settled candidate is final, held by the cut's limit.
        if plan.add or not plan.state.unsettled or time.monotonic() > deadline:
            break
        state = plan.state
        time.sleep(0.5)
    # One indexed count for the bar's total, on the cut's connection and shape (reflected moments ago).
    total_rows = (source.count_rows(cached_table_shape(source, table), plan.committed_hi, plan.chain[-1].hi,
                                    table.skip_rows_in(plan.committed_hi, plan.chain[-1].hi) or None, settled=True)
                  if plan.chain and not dry_run else 0)
    return BackfillCut(plan, total_rows)


def apply_cut(instance: DagsterInstance, table: TableConfig, plan: Any) -> None:
    """The cut's partitions on the instance: orphans deleted, new slices added."""
    partitions = partitions_for(table)
    for orphan in plan.delete:
        instance.delete_dynamic_partition(partitions.name, orphan.key)
    if plan.add:
        instance.add_dynamic_partitions(partitions.name, [s.key for s in plan.add])


# Dagster's step-by-step lines and a failure's stack traces stay in the run's event log (UI): the caller tells the
# story (a progress bar, a line per run, a failed run's cause).
QUIET_RUN_CONFIG = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


def execute_slices(instance: DagsterInstance, job: Any, table: TableConfig, kafka: dict[str, Any],
                   channel: TableChannel, todo: list[SliceRange]) -> Iterator[tuple[list[SliceRange], Any]]:
    """Run every slice of `todo` in this process, one run per `max_slices_per_run` slices, each after the table's
    other runs ended (`wait_for_running_runs`): (the run's slices, its result), run by run, as the caller asks.
    `job`: the table's job, resolved from the definitions."""
    step = table.max_slices_per_run
    for group in (todo[i:i + step] for i in range(0, len(todo), step)):
        wait_for_running_runs(instance, job_name(table), table.table_id,
                              on_dead=partial(record_slices_of_dead_run, instance, table, kafka, channel))
        tags = {ASSET_PARTITION_RANGE_START_TAG: group[0].key, ASSET_PARTITION_RANGE_END_TAG: group[-1].key,
                BACKFILL_TAG: "cli"}
        yield group, job.execute_in_process(run_config=QUIET_RUN_CONFIG, instance=instance, tags=tags,
                                            raise_on_error=False)


def wait_for_running_runs(instance: Any, job: str, table_id: str, poll_s: float = 1.0,
                          on_dead: Callable[[Any], list[str]] | None = None) -> None:
    """Wait until no run of the table is starting or running. A backfill executes its runs in its own process,
    outside the run queue where the table's pool (limit 1) is enforced: this is its part of the pool. A run that
    starts meanwhile is still kept exactly once by fencing and the order check (one of the two stops as fenced)."""

    running = [DagsterRunStatus.STARTING, DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]
    told = False
    while runs := instance.get_runs(RunsFilter(job_name=job, statuses=running)):
        alive = []
        for run in runs:  # a run of an earlier backfill whose process died would be waited for forever
            if (gone := in_process_worker_gone(run)) is not None:
                instance.report_run_failed(run, f"{gone}; marked failed by rowrelay backfill")
                recorded = on_dead(run) if on_dead is not None else []
                slices = f"; {len(recorded)} slice(s) it committed recorded" if recorded else ""
                print(f"{table_id}: run {run.run_id} was left running by a process that is gone: marked failed"
                      f"{slices}", flush=True)
            else:
                alive.append(run.run_id)
        if not alive:
            return
        if not told:
            print(f"{table_id}: waiting for run(s) {', '.join(alive)} of the table to finish (one at a time per "
                  "table)", flush=True)
            told = True
        time.sleep(poll_s)


def record_slices_of_dead_run(instance: Any, table: TableConfig, conf: dict[str, Any], channel: Any, run: Any
                              ) -> list[str]:
    """The slices a run committed before its process died (SIGKILL, OOM) have no materialization: the run recorded
    none, and no retry of it comes (a backfill executes its runs in its own process; the next backfill cuts on from
    Kafka's progress). Recorded now from their progress records, as a failed range run's are
    (`rowrelay/run_failed_later`). Returns the keys recorded."""
    span = run_slices(dict(run.tags))
    if span is None:
        return []
    ranges = {k: r for k in instance.get_dynamic_partitions(partitions_for(table).name)
              if span[0].lo <= (r := SliceRange.from_key(k)).lo <= span[1].lo}
    tiles = tiles_by_range(conf, channel, list(ranges.values())) if ranges else {}
    committed = {k: tiles[r][0] for k, r in ranges.items() if len(tiles.get(r, [])) == 1}
    if not committed:
        return []
    known = instance.fetch_materializations(AssetRecordsFilter(asset_key=asset_key(table),
                                                                asset_partitions=list(committed)), limit=1000).records
    recorded = {r.asset_materialization.partition for r in known if r.asset_materialization is not None}
    for key, p in committed.items():
        if key in recorded:
            continue
        instance.report_runless_asset_event(AssetMaterialization(
            asset_key=asset_key(table), partition=key,
            description=f"slice {key} committed by run {run.run_id}, whose process died before recording it",
            metadata={**progress_metadata(p), RUN_FAILED_LATER: run.run_id}))
    return [k for k in committed if k not in recorded]


INTERRUPTS = {"DagsterExecutionInterruptedError", "KeyboardInterrupt"}


def run_interrupted(result: Any) -> bool:
    """Whether an in-process run failed because this process was interrupted (Ctrl-C): Dagster records the
    interrupt as the failure of the step it stopped (DagsterExecutionInterruptedError), or of the run."""
    for event in result.all_events:
        error = getattr(event.event_specific_data, "error", None)  # a step's failure, the run's, an engine event's
        while error is not None:
            if error.cls_name in INTERRUPTS:
                return True
            error = error.cause or error.context
    return False


def interrupted_text(table_id: str, slices: Sequence[SliceRange], committed_hi: int,
                     text: Callable[[int], str]) -> str:
    """What an interrupted backfill says: where the table's progress stands and how to go on. Slices commit one
    transaction each, so what committed stays; an open slice's transaction is aborted, none of it visible."""
    done = sum(1 for s in slices if s.hi <= committed_hi)
    return (f"{table_id}: backfill interrupted: committed up to {text(committed_hi)} ({done}/{len(slices)} slices "
            "of this backfill); nothing of a slice that had not committed is visible. Run `rowrelay backfill "
            f"--table {table_id}` again to continue")


def run_failure_text(instance: Any, result: Any) -> str:
    """Why a backfill's run failed (its first step failure's message) and what to do next."""
    error = next((e.step_failure_data.error for e in result.all_events
                  if e.is_step_failure and e.step_failure_data and e.step_failure_data.error), None)
    # Past Dagster's wrappers ("Error occurred while executing op ..."): the first error below them names the
    # problem (rowrelay's own says what to change; the librdkafka or driver error under it, less).
    while error is not None and error.cause is not None and error.cls_name.startswith("Dagster"):
        error = error.cause
    reason = re.sub(r"^[\w.]+: ", "", error.message.strip()) if error is not None else "see its events"
    run = instance.get_run_by_id(result.run_id)
    stopped = run.tags.get(STOPPED_TAG) if run is not None else None
    step = ADVICE.get(stopped or "", "slices before it stay committed; run backfill again to continue")
    step = step.replace("run it again", "run backfill again")
    return f"{reason.splitlines()[0]} (details in the Dagster UI). Next: {step}"
