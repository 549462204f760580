"""Builds Dagster Definitions from a RelayConfig: per table an asset, a job and a sensor."""

from __future__ import annotations

import json
import time

from dagster import (
    AssetCheckEvaluation,
    AssetCheckSeverity,
    DefaultSensorStatus,
    Definitions,
    SensorDefinition,
    SensorEvaluationContext,
    SkipReason,
    define_asset_job,
    in_process_executor,
    sensor,
)

from assets.relay import (
    CHECK_KAFKA_TIMEOUT_S,
    LAG_CHECK,
    asset_key,
    build_table_asset,
    build_table_checks,
    channel_for,
    lag_result,
    measure_lag,
    partitions_for,
    source_resource_key,
)
from orchestration.history import build_history_sensor
from orchestration.sensors import build_slice_sensor
from resources.config import RelayConfig, TableConfig
from resources.exactly_once import read_committed_progress
from resources.kafka_io_manager import KafkaIOManager
from resources.source_database import SourceDatabaseResource
from resources.spark import SparkResource


def job_name(table: TableConfig) -> str:
    return f"relay_{table.dagster_name}"


# The lag sensor records the lag check when its outcome changes, else at most this often (lag over time in the
# Checks tab without flooding the event log).
LAG_RECORD_EVERY_S = 300.0
LAG_SENSOR_INTERVAL_S = 60


def lag_sensor_name(table: TableConfig) -> str:
    return f"{table.dagster_name}_lag"


def build_lag_sensor(table: TableConfig, transactional_id_prefix: str = "rowrelay") -> SensorDefinition:
    """Evaluates the table's lag check between runs (the table's own sensor may be stopped, its runs failing):
    a runless check evaluation, recorded when it changes (pass / WARN / ERROR) or every LAG_RECORD_EVERY_S."""
    channel = channel_for(table, transactional_id_prefix)
    source_key = source_resource_key(table.source)

    @sensor(name=lag_sensor_name(table), minimum_interval_seconds=LAG_SENSOR_INTERVAL_S,
            required_resource_keys={source_key, "kafka_io_manager"}, default_status=DefaultSensorStatus.RUNNING,
            description=f"Evaluates the lag check of {table.table_id} while no run does.")
    def lag_sensor(context: SensorEvaluationContext) -> SkipReason:
        progress = read_committed_progress(context.resources.kafka_io_manager.kafka_conf(), channel,
                                           timeout=CHECK_KAFKA_TIMEOUT_S)
        result = lag_result(table, measure_lag(getattr(context.resources, source_key), table, progress,
                                               channel.start_after))
        outcome = "passed" if result.passed else str(result.severity.value)
        last = json.loads(context.cursor) if context.cursor else {}
        now = time.time()
        if last.get("outcome") == outcome and now - float(last.get("at", 0)) < LAG_RECORD_EVERY_S:
            return SkipReason(f"lag unchanged: {result.description}")
        context.instance.report_runless_asset_event(AssetCheckEvaluation(
            asset_key=asset_key(table), check_name=LAG_CHECK, passed=result.passed,
            severity=result.severity or AssetCheckSeverity.ERROR, description=result.description,
            metadata=result.metadata))
        context.update_cursor(json.dumps({"outcome": outcome, "at": now}))
        return SkipReason(f"lag recorded: {result.description}")

    return lag_sensor


def build_definitions(config: RelayConfig) -> Definitions:
    assets, checks, jobs, sensors = [], [], [], []
    for table in config.tables:
        assets.append(build_table_asset(table, config.kafka.transactional_id_prefix))
        checks.extend(build_table_checks(table, config.kafka.transactional_id_prefix))
        sensors.append(build_lag_sensor(table, config.kafka.transactional_id_prefix))
        # In-process: one Spark session per run instead of one JVM per step. Selecting the asset selects its
        # checks too: slice_parity and lag are evaluated in every run, after the publish.
        job = define_asset_job(job_name(table), selection=[asset_key(table)], partitions_def=partitions_for(table),
                               executor_def=in_process_executor)
        jobs.append(job)
        sensors.append(build_slice_sensor(table, job))
    # One sensor rolls up every table's old slices (a slow cadence, a time budget per tick): partitions stay few.
    sensors.append(build_history_sensor(config.tables, config.kafka.transactional_id_prefix))
    spark = SparkResource(master=config.spark.master, remote=config.spark.remote, conf=config.spark.conf)
    resources = {
        "spark": spark,
        "kafka_io_manager": KafkaIOManager(bootstrap_servers=config.kafka.bootstrap_servers,
                                           producer={k: str(v) for k, v in config.kafka.producer.items()},
                                           transactional_id_prefix=config.kafka.transactional_id_prefix,
                                           spark=spark),
        **{source_resource_key(name): SourceDatabaseResource(url=src.url) for name, src in config.sources.items()},
    }
    # In-process for every job, the implicit asset job of `dagster asset materialize` included.
    return Definitions(assets=assets, asset_checks=checks, jobs=jobs, sensors=sensors, resources=resources,
                       executor=in_process_executor)
