"""One sensor per table (or per group of tables): cut new slices up to the safe high watermark, add them as
partitions, request their runs in order. The tick asks the instance (orchestration/instance.py) and the cut planner
(orchestration/cutting.py), and turns their answers into Dagster's run and partition requests; its cursor is the
cut planner's `SensorState`."""

import json
import time
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from confluent_kafka import KafkaException
from dagster import (
    DagsterInstance,
    DefaultSensorStatus,
    DynamicPartitionsDefinition,
    RunRequest,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    sensor,
)
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

from assets.identity import asset_key, channel_for, partitions_for, pool_name
from assets.records import last_recorded_slice
from orchestration.compaction import open_keys
from orchestration.cutting import (
    SENSOR,
    CutInputs,
    CutPlan,
    SensorState,
    cached_table_shape,
    cut,
    forget_table_shape,
    known_chain,
    shared_source,
    trickle_text,
)
from orchestration.instance import (
    cancel_committed_runs,
    cancel_unstartable_runs,
    delete_key,
    ensure_pool,
    fail_dead_runs,
    has_key,
    queued_or_running,
    queued_or_running_count,
    runs_of_slice,
)
from orchestration.runs import batched_requests, runs_verdict
from resources.config import TableConfig
from resources.exactly_once import KafkaUnavailable, ProgressRecord, read_progress_tail
from resources.identity import DagsterNames, source_resource_key
from resources.kafka_io_manager import KafkaIOManager
from resources.slices import SliceRange, reconcile
from resources.source_database import InnodbTrxStale, SourceDatabaseResource

# The sensor daemon evaluates sensors in a loop every 5 s (MIN_INTERVAL_LOOP_TIME in dagster/_daemon/sensor.py)
# and skips a sensor while the time since its last tick's *start* is under its minimum interval. A tick starts a
# moment after its loop began, so an interval equal to the loop's is missed by that moment at the next loop and
# becomes 10 s at the daemon's pace.
DAEMON_LOOP_S = 5


def daemon_min_interval(interval_s: int) -> int:
    """The minimum interval to declare so ticks come every `interval_s` seconds (at the daemon loop's pace)."""
    return interval_s - 1 if interval_s > 1 and interval_s % DAEMON_LOOP_S == 0 else interval_s


UNSTARTED_GRACE_S = 30.0  # a run leaves NOT_STARTED within a second when it is queued or executed in-process


@dataclass
class TableTick:
    """One table's share of a sensor tick."""

    run_requests: list[RunRequest]
    partition_requests: list[Any]
    cursor: str
    skip_reason: str | None = None


def tick_table(context: SensorEvaluationContext, table: TableConfig, job_name: str, cursor: str | None,
               source: SourceDatabaseResource, io_manager: KafkaIOManager, active_runs: list[Any] | None = None,
               group: bool = False) -> TableTick:
    """What one sensor tick does for one table: its own sensor, or one table of a group sensor's loop.
    `active_runs`: the table's queued/running runs if the caller fetched them already (a group sensor: one query
    for all its tables). `group`: run requests name their job and run keys carry it (a sensor's run keys are one
    namespace)."""
    try:
        return _tick_table(context, table, job_name, cursor, source, io_manager, active_runs, group)
    except (sa.exc.ProgrammingError, sa.exc.OperationalError):
        # A statement on the cached shape failed (the table dropped or renamed, a column gone: PostgreSQL says
        # ProgrammingError, SQLite and MariaDB's unknown column OperationalError): reflect afresh, so the tick
        # fails with the table check's own message and remedy, not the driver's, for up to a minute. A source
        # that is down fails the reflection too, with its own error.
        forget_table_shape(source, table)
        cached_table_shape(source, table)
        raise


@dataclass
class _Standing:
    """Where a table stands at the start of a tick: Kafka's committed progress, and the uncommitted slices that
    continue it (`state.chain`). `stored`: the table's uncommitted partition keys, when they were read."""

    progress: ProgressRecord | None
    committed_hi: int
    state: SensorState
    stored: list[str] | None

    @property
    def chain(self) -> list[SliceRange]:
        return self.state.chain or []


def _standing(instance: DagsterInstance, table: TableConfig, io_manager: KafkaIOManager,
              partitions: DynamicPartitionsDefinition, cursor: str | None) -> _Standing:
    channel = channel_for(table, io_manager.transactional_id_prefix)
    # Kafka's progress through the process's long-lived reader: re-read only when the topic's end moved.
    progress = read_progress_tail(io_manager.kafka_conf(), channel)
    committed_hi = progress.hi if progress else channel.start_after
    state = SensorState.from_cursor(cursor)
    # Flat ticks: the uncommitted slices come from the cursor, checked against storage by one key; the
    # partitions are read (their newest end only) when the cursor disagrees with Kafka or the key is gone.
    chain = known_chain(state.chain, committed_hi)
    stored: list[str] | None = None
    if chain is None or (chain and not has_key(instance, partitions.name, chain[0].key)):
        stored = open_keys(instance, partitions.name, committed_hi)
        chain = reconcile([SliceRange.from_key(k) for k in stored], committed_hi).chain
    if progress is None and table.start_after == "latest" and chain:
        # Cut under another `start_after` before the first commit: no chain until the baseline is recorded
        # (`cut` records it and deletes them), never resumed.
        stored = open_keys(instance, partitions.name, committed_hi) if stored is None else stored
        chain = []
    return _Standing(progress, committed_hi, SensorState(state.pending, chain, state.waiting_since, state.table),
                     stored)


def _table_runs(instance: DagsterInstance, job_name: str, partitions_name: str, runs: list[Any] | None) -> int:
    """How many runs of the table are queued or running, once dead and unstartable ones are marked so. One query
    for the table's active runs serves the dead-worker check and the count (each storage query is a new PostgreSQL
    connection: ~10 ms of an idle tick)."""
    if runs is None:
        runs = queued_or_running(instance, job_name)
    if runs and (fail_dead_runs(instance, job_name, runs)
                 or cancel_unstartable_runs(instance, partitions_name, runs, UNSTARTED_GRACE_S)):
        runs = queued_or_running(instance, job_name)
    return len(runs)


def _cut(instance: DagsterInstance, table: TableConfig, source: SourceDatabaseResource, io_manager: KafkaIOManager,
         partitions_name: str, at: _Standing, resplit: bool) -> CutPlan:
    """The tick's cut. A `latest` table with empty progress is about to record its
    baseline: not over slices Dagster recorded as committed (its progress topic lost after the data topic's messages
    expired), which would skip every row since (`cut` refuses). Asked only then: one storage query, not one per idle
    tick. Other tables' runs refuse."""
    stored = at.stored
    keys = stored if stored is not None else [s.key for s in at.chain]
    recorded = (last_recorded_slice(instance, asset_key(table))
                if at.progress is None and table.start_after == "latest" else None)
    plan = cut(CutInputs(table, source, io_manager, at.progress, keys, at.state, resplit, recorded), SENSOR)
    if plan.add and stored is None:
        # About to add partitions: another cutter (`rowrelay backfill`) may have cut slices this cursor does
        # not know. Check the newest keys (cheap: only uncommitted ones are read) and plan again if so.
        stored = open_keys(instance, partitions_name, at.committed_hi)
        if set(stored) - set(keys):
            plan = cut(CutInputs(table, source, io_manager, at.progress, stored, at.state, resplit, recorded),
                       SENSOR)
    return plan


def _partition_requests(instance: DagsterInstance, partitions: DynamicPartitionsDefinition, plan: CutPlan
                        ) -> list[Any]:
    """The plan's deletes and adds. A re-cut can give a deleted slice again (the same range). Dagster refuses one
    key deleted and added by one tick, and a kept key would keep its old place in the partitions' order, breaking a
    range run over the new ones: such keys are deleted now, and added back in their new place."""
    requests: list[Any] = []
    again = {s.key for s in plan.delete} & {s.key for s in plan.add}
    for key in again:
        delete_key(instance, partitions.name, key)
    if deleted := [s.key for s in plan.delete if s.key not in again]:
        requests.append(partitions.build_delete_request(deleted))
    if plan.add:
        requests.append(partitions.build_add_request([s.key for s in plan.add]))
    return requests


def _tick_table(context: SensorEvaluationContext, table: TableConfig, job_name: str, cursor: str | None,
                source: SourceDatabaseResource, io_manager: KafkaIOManager, runs: list[Any] | None,
                group: bool) -> TableTick:
    partitions = partitions_for(table)
    instance = context.instance
    ensure_pool(instance, pool_name(table), cached=True)
    active = _table_runs(instance, job_name, partitions.name, runs)
    cached_table_shape(source, table)  # a broken table or config fails the tick with its reason, every tick
    at = _standing(instance, table, io_manager, partitions, cursor)
    chain, job_label = at.chain, job_name if group else None

    def skip(reason: str) -> TableTick:
        return TableTick([], [], at.state.to_cursor(), reason)

    if active and cancel_committed_runs(instance, job_name, at.committed_hi):
        active = queued_or_running_count(instance, job_name)
    # One query for the first uncommitted slice's runs serves every use in the verdict.
    slice_runs = runs_of_slice(instance, job_name, chain[0]) if chain else []
    verdict = runs_verdict(table, chain, at.committed_hi, active, slice_runs, job_label)
    if verdict.resume is not None:
        return TableTick([verdict.resume], [], at.state.to_cursor())
    if verdict.wait is not None:
        return skip(verdict.wait)
    try:
        plan = _cut(instance, table, source, io_manager, partitions.name, at, verdict.resplit)
    except InnodbTrxStale as exc:
        # Not a failed tick: which transactions are open is unknown this tick (other clients of the server keep
        # MariaDB's cache stale); nothing is cut and the next tick asks again.
        return skip(str(exc))
    if plan.delete:
        context.log.warning(f"{table.table_id}: partitions {[s.key for s in plan.delete]} do not continue Kafka's "
                            f"progress ({plan.text(plan.committed_hi)}) and can never commit: deleted, range cut again")
    requests = batched_requests(plan.add, table.max_slices_per_run, job_label=job_label)
    partition_requests = _partition_requests(instance, partitions, plan)
    after = SensorState(plan.state.pending, plan.chain, plan.state.waiting_since, plan.state.table).to_cursor()
    waiting = (plan.held_text() or plan.waiting or trickle_text(plan, table, time.time())) if not requests else None
    if waiting is not None:
        waiting = f"{table.table_id}: {waiting}"
    return TableTick(requests, partition_requests, after, waiting)


def build_slice_sensor(table: TableConfig, job: UnresolvedAssetJobDefinition) -> SensorDefinition:
    """The table's own sensor (a deployment of a few tables: each can be stopped on its own in the UI)."""
    source_key = source_resource_key(table.source)

    @sensor(
        name=DagsterNames.of(table).slice_sensor,
        job=job,
        minimum_interval_seconds=daemon_min_interval(table.sensor_interval_seconds),
        required_resource_keys={source_key, "kafka_io_manager"},
        default_status=DefaultSensorStatus.RUNNING,
        description=f"Cuts new watermark slices of {table.table_id} and requests their runs in order.",
    )
    def slice_sensor(context: SensorEvaluationContext) -> SensorResult:
        tick = tick_table(context, table, job.name, context.cursor,
                          shared_source(getattr(context.resources, source_key)), context.resources.kafka_io_manager)
        return SensorResult(run_requests=tick.run_requests, dynamic_partitions_requests=tick.partition_requests,
                            cursor=tick.cursor, skip_reason=tick.skip_reason if not tick.run_requests else None)

    return slice_sensor


KAFKA_DOWN: tuple[type[BaseException], ...] = (KafkaUnavailable, KafkaException, TimeoutError)


def build_group_slice_sensor(name: str, tables: list[TableConfig], jobs: list[UnresolvedAssetJobDefinition]
                             ) -> SensorDefinition:
    """One sensor for many tables (a large deployment): one daemon tick, one code-server call and one runs query
    serve all of them, instead of a tick each; the daemon cannot tick 100 sensors every 5 s on a small machine
    (each tick costs the daemon time of its own on top of the table's work). Per-table cursors in
    one JSON; one table's error is logged and leaves the others' cuts intact (its lag check shows it)."""
    by_name = {job.name: (table, job) for table, job in zip(tables, jobs, strict=True)}
    interval = min(t.sensor_interval_seconds for t in tables)

    @sensor(
        name=name,
        jobs=jobs,
        minimum_interval_seconds=daemon_min_interval(interval),
        required_resource_keys={source_resource_key(t.source) for t in tables} | {"kafka_io_manager"},
        default_status=DefaultSensorStatus.RUNNING,
        description=f"Cuts new watermark slices of {len(tables)} tables and requests their runs in order.",
    )
    def group_sensor(context: SensorEvaluationContext) -> SensorResult:
        cursors: dict[str, str] = json.loads(context.cursor) if context.cursor else {}
        active: dict[str, list[Any]] = {n: [] for n in by_name}
        for run in queued_or_running(context.instance, None):
            if run.job_name in active:
                active[run.job_name].append(run)
        requests: list[RunRequest] = []
        partition_requests: list[Any] = []
        notes: list[str] = []
        errors: list[str] = []
        for job_name, (table, _) in by_name.items():
            try:
                tick = tick_table(context, table, job_name, cursors.get(table.table_id),
                                  shared_source(getattr(context.resources, source_resource_key(table.source))),
                                  context.resources.kafka_io_manager, active_runs=active[job_name], group=True)
            except Exception as exc:  # one table's failure must not stop the others' cuts
                context.log.error(f"{table.table_id}: {type(exc).__name__}: {exc}")
                errors.append(f"{table.table_id}: {exc}")
                if isinstance(exc, KAFKA_DOWN):  # every table needs Kafka: waiting for each in turn helps none
                    errors.append("Kafka unreachable: the remaining tables wait for the next tick")
                    break
                continue
            cursors[table.table_id] = tick.cursor
            requests.extend(tick.run_requests)
            partition_requests.extend(tick.partition_requests)
            if tick.skip_reason and not tick.run_requests:
                notes.append(tick.skip_reason)
        skip = None if requests else ("; ".join(errors + notes)[:2000] or "no new rows")
        return SensorResult(run_requests=requests, dynamic_partitions_requests=partition_requests,
                            cursor=json.dumps(cursors), skip_reason=skip)

    return group_sensor
