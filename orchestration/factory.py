"""Builds Dagster Definitions from a RelayConfig: per table an asset, a job and a sensor."""

from __future__ import annotations

import json
import time
from typing import Any

from dagster import (
    AssetCheckEvaluation,
    AssetCheckSeverity,
    DagsterInstance,
    DefaultSensorStatus,
    Definitions,
    SensorDefinition,
    SensorEvaluationContext,
    SkipReason,
    define_asset_job,
    in_process_executor,
    sensor,
)

from assets.checks import LAG_CHECK, build_table_checks, lag_result, unmeasured_lag
from assets.identity import asset_key, channel_for, partitions_for
from assets.lag import CHECK_KAFKA_TIMEOUT_S, measure_lag
from assets.records import last_recorded_slice
from assets.relay import build_table_asset
from orchestration.compaction import build_history_sensor
from orchestration.instance import first_run_at, job_name
from orchestration.sensors import build_group_slice_sensor, build_slice_sensor
from resources.config import RelayConfig, TableConfig
from resources.exactly_once import TableChannel, read_progress_tail
from resources.identity import DagsterNames, source_resource_key
from resources.kafka_io_manager import KafkaIOManager
from resources.source_database import SourceDatabaseResource
from resources.spark import SparkResource

# The lag sensor records the lag check when its outcome changes, else at most this often (lag over time in the
# Checks tab without flooding the event log).
LAG_RECORD_EVERY_S = 300.0
LAG_SENSOR_INTERVAL_S = 60


def lag_sensor_name(table: TableConfig) -> str:
    return DagsterNames.of(table).lag_sensor


def lag_tick(instance: DagsterInstance, table: TableConfig, channel: TableChannel, source: SourceDatabaseResource,
             kafka_conf: dict[str, Any], last: dict[str, Any], now: float) -> tuple[dict[str, Any], str]:
    """One table's lag check between runs: recorded (a runless check evaluation) when its outcome changed or
    LAG_RECORD_EVERY_S passed. Returns (the table's new cursor, what happened)."""
    measured = ""
    try:
        # The process's long-lived progress reader (a new consumer per table and minute is ~60 ms each).
        progress = read_progress_tail(kafka_conf, channel, timeout=CHECK_KAFKA_TIMEOUT_S)
        # Empty progress over slices Dagster recorded as committed (the progress topic lost after the data topic's
        # messages expired): every run refuses, so the check between runs says why, as the in-run check does, not
        # a lag "since_first_run". Asked only where progress is empty: one storage query per tick then.
        recorded = last_recorded_slice(instance, asset_key(table)) if progress is None else None
        result = lag_result(table, measure_lag(source, table, progress, channel.start_after,
                                               None if progress else first_run_at(instance, table),
                                               published=(kafka_conf, channel), recorded=recorded))
    except Exception as exc:  # noqa: BLE001 - a lag that cannot be measured is a WARN, not a green check
        result, measured = unmeasured_lag(table, exc), " unmeasured"
    # Its own outcome: a WARN "not measured" after a measured WARN (or back) is a change to record.
    outcome = ("passed" if result.passed else str(result.severity.value)) + measured
    if last.get("outcome") == outcome and now - float(last.get("at", 0)) < LAG_RECORD_EVERY_S:
        return last, f"lag unchanged: {result.description}"
    instance.report_runless_asset_event(AssetCheckEvaluation(
        asset_key=asset_key(table), check_name=LAG_CHECK, passed=result.passed,
        severity=result.severity or AssetCheckSeverity.ERROR, description=result.description,
        metadata=result.metadata))
    return {"outcome": outcome, "at": now}, f"lag recorded: {result.description}"


def build_lag_sensor(table: TableConfig, transactional_id_prefix: str) -> SensorDefinition:
    """Evaluates the table's lag check between runs (the table's own sensor may be stopped, its runs failing):
    a runless check evaluation, recorded when it changes (pass / WARN / ERROR) or every LAG_RECORD_EVERY_S."""
    channel = channel_for(table, transactional_id_prefix)
    source_key = source_resource_key(table.source)

    @sensor(name=lag_sensor_name(table), minimum_interval_seconds=LAG_SENSOR_INTERVAL_S,
            required_resource_keys={source_key, "kafka_io_manager"}, default_status=DefaultSensorStatus.RUNNING,
            description=f"Evaluates the lag check of {table.table_id} while no run does.")
    def lag_sensor(context: SensorEvaluationContext) -> SkipReason:
        last = json.loads(context.cursor) if context.cursor else {}
        cursor, note = lag_tick(context.instance, table, channel, getattr(context.resources, source_key),
                                context.resources.kafka_io_manager.kafka_conf(), last, time.time())
        if cursor is not last:
            context.update_cursor(json.dumps(cursor))
        return SkipReason(note)

    return lag_sensor


def build_group_lag_sensor(name: str, tables: list[TableConfig], transactional_id_prefix: str
                           ) -> SensorDefinition:
    """The lag checks of a group of tables in one sensor (see orchestration/sensors.py build_group_slice_sensor)."""

    @sensor(name=name, minimum_interval_seconds=LAG_SENSOR_INTERVAL_S,
            required_resource_keys={source_resource_key(t.source) for t in tables} | {"kafka_io_manager"},
            default_status=DefaultSensorStatus.RUNNING,
            description=f"Evaluates the lag checks of {len(tables)} tables while no run does.")
    def group_lag_sensor(context: SensorEvaluationContext) -> SkipReason:
        cursors: dict[str, Any] = json.loads(context.cursor) if context.cursor else {}
        conf = context.resources.kafka_io_manager.kafka_conf()
        notes = []
        for table in tables:
            try:
                cursors[table.table_id], note = lag_tick(
                    context.instance, table, channel_for(table, transactional_id_prefix),
                    getattr(context.resources, source_resource_key(table.source)), conf,
                    cursors.get(table.table_id, {}), time.time())
            except Exception as exc:  # one table's failure must not stop the others' checks
                context.log.error(f"{table.table_id}: lag not measured: {type(exc).__name__}: {exc}")
                note = f"{table.table_id}: {exc}"
            notes.append(note)
        context.update_cursor(json.dumps(cursors))
        return SkipReason(f"{len(tables)} tables: " + "; ".join(notes)[:1500])

    return group_lag_sensor


# Beyond this many tables, tables without a `sensor_group` share sensors, GROUP_SIZE per sensor: the daemon
# ticks each sensor with a fixed cost of its own, and 100 sensors every 5 s do not fit a small machine.
AUTO_GROUP_OVER = 20
GROUP_SIZE = 25


def sensor_groups(tables: list[TableConfig]) -> dict[str | None, list[TableConfig]]:
    """Tables per sensor group name; None: each table its own sensors. Explicit `sensor_group` first; with more
    than AUTO_GROUP_OVER tables the rest are grouped by sensor interval, GROUP_SIZE per group, in config order."""
    groups: dict[str | None, list[TableConfig]] = {}
    loose = [t for t in tables if t.sensor_group is None]
    for t in tables:
        if t.sensor_group is not None:
            groups.setdefault(t.sensor_group, []).append(t)
    if len(tables) <= AUTO_GROUP_OVER:
        groups[None] = loose
        return groups
    by_interval: dict[int, list[TableConfig]] = {}
    for t in loose:
        by_interval.setdefault(t.sensor_interval_seconds, []).append(t)
    for interval, members in by_interval.items():
        for k in range(0, len(members), GROUP_SIZE):
            groups[f"auto_{interval}s_{k // GROUP_SIZE + 1}"] = members[k:k + GROUP_SIZE]
    return groups


def build_definitions(config: RelayConfig) -> Definitions:
    assets, checks, jobs, sensors = [], [], [], []
    prefix = config.kafka.transactional_id_prefix
    job_of = {}
    for table in config.tables:
        assets.append(build_table_asset(table, prefix))
        checks.extend(build_table_checks(table, prefix))
        # In-process: one Spark session per run instead of one JVM per step. Selecting the asset selects its
        # checks too: slice_parity and lag are evaluated in every run, after the publish.
        job = define_asset_job(job_name(table), selection=[asset_key(table)], partitions_def=partitions_for(table),
                               executor_def=in_process_executor)
        jobs.append(job)
        job_of[table.table_id] = job
    for group, members in sensor_groups(config.tables).items():
        if group is None:
            for table in members:
                sensors.append(build_lag_sensor(table, prefix))
                sensors.append(build_slice_sensor(table, job_of[table.table_id]))
        else:
            sensors.append(build_group_lag_sensor(f"lag_{group}", members, prefix))
            sensors.append(build_group_slice_sensor(f"slices_{group}", members,
                                                    [job_of[t.table_id] for t in members]))
    # One sensor rolls up every table's old slices (a slow cadence, a time budget per tick): partitions stay few.
    sensors.append(build_history_sensor(config.tables, config.kafka.transactional_id_prefix))
    spark = SparkResource(master=config.spark.master, remote=config.spark.remote, conf=config.spark.conf)
    resources = {
        "spark": spark,
        "kafka_io_manager": KafkaIOManager(bootstrap_servers=config.kafka.bootstrap_servers,
                                           producer={k: str(v) for k, v in config.kafka.producer.items()},
                                           transactional_id_prefix=config.kafka.transactional_id_prefix,
                                           spark=spark),
        **{source_resource_key(name): SourceDatabaseResource.for_source(src) for name, src in config.sources.items()},
    }
    # In-process for every job, the implicit asset job of `dagster asset materialize` included.
    return Definitions(assets=assets, asset_checks=checks, jobs=jobs, sensors=sensors, resources=resources,
                       executor=in_process_executor)
