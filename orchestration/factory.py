"""Builds Dagster Definitions from a RelayConfig: per table an asset, a job and a sensor."""

from __future__ import annotations

from dagster import Definitions, define_asset_job, in_process_executor

from assets.relay import asset_key, build_table_asset, partitions_for, source_resource_key
from orchestration.sensors import build_slice_sensor
from resources.config import RelayConfig, TableConfig
from resources.kafka_io_manager import KafkaIOManager
from resources.source_database import SourceDatabaseResource
from resources.spark import SparkResource


def job_name(table: TableConfig) -> str:
    return f"relay_{table.dagster_name}"


def build_definitions(config: RelayConfig) -> Definitions:
    assets, jobs, sensors = [], [], []
    for table in config.tables:
        assets.append(build_table_asset(table, config.kafka.transactional_id_prefix))
        # In-process: one Spark session per run instead of one JVM per step.
        job = define_asset_job(job_name(table), selection=[asset_key(table)], partitions_def=partitions_for(table),
                               executor_def=in_process_executor)
        jobs.append(job)
        sensors.append(build_slice_sensor(table, job))
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
    return Definitions(assets=assets, jobs=jobs, sensors=sensors, resources=resources, executor=in_process_executor)
