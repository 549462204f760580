"""One Dagster asset per configured table, dynamically partitioned into watermark slices."""

import os
import socket

from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    DynamicPartitionsDefinition,
    Failure,
    asset,
)

from orchestration.config import TableConfig
from resources.exactly_once import SliceOutOfOrder, TableChannel, read_committed_progress
from resources.kafka_io_manager import channel_metadata
from resources.messages import SliceFrame, message_columns
from resources.slices import SliceRange
from resources.source_database import SourceDatabaseResource, SourceError, TableShape
from resources.spark import SparkResource

WORKER_PID_TAG = "rowrelay/worker_pid"
WORKER_HOST_TAG = "rowrelay/worker_host"


def source_resource_key(source: str) -> str:
    return f"source_{source}"


def pool_name(table: TableConfig) -> str:
    return f"rowrelay-{table.dagster_name}"


def asset_key(table: TableConfig) -> AssetKey:
    return AssetKey([table.source, table.schema_name or "default", table.table_name])


def partitions_for(table: TableConfig) -> DynamicPartitionsDefinition:
    return DynamicPartitionsDefinition(name=f"{table.dagster_name}__slices")


def channel_for(table: TableConfig, transactional_id_prefix: str = "rowrelay") -> TableChannel:
    start = table.start_after if isinstance(table.start_after, int) else 0
    return TableChannel.for_table(table.table_id, table.topic_name, start_after=start,
                                  topic_partitions=table.topic_partitions, prefix=transactional_id_prefix)


def table_shape(source: SourceDatabaseResource, table: TableConfig) -> TableShape:
    return source.table_shape(table.schema_name, table.table_name, table.watermark, table.columns)


def build_slice_frame(source: SourceDatabaseResource, spark: SparkResource, table: TableConfig,
                      channel: TableChannel, slice_range: SliceRange) -> SliceFrame:
    """The pure core of a table asset: the slice's messages as a lazy, ordered Spark DataFrame."""
    shape = table_shape(source, table)
    if source.has_null_watermarks(shape):
        raise SourceError(f"{table.table_id}: rows with NULL in watermark column {table.watermark!r} would never be "
                          "sent; make the column NOT NULL or fill it")
    rows = source.count_rows(shape, slice_range.lo, slice_range.hi)
    frame = spark.read_slice(source, shape, slice_range, rows)
    if table.skip_watermarks:
        from pyspark.sql import functions as F

        frame = frame.where(~F.col(f"`{shape.watermark}`").isin(table.skip_watermarks))
    messages = message_columns(frame, shape, table.key, table.envelope, table.table_id, slice_range.key)
    return SliceFrame(channel=channel, slice=slice_range, messages=messages, expected_rows=rows)


def build_table_asset(table: TableConfig, transactional_id_prefix: str = "rowrelay") -> AssetsDefinition:
    channel = channel_for(table, transactional_id_prefix)
    source_key = source_resource_key(table.source)

    @asset(
        key=asset_key(table),
        partitions_def=partitions_for(table),
        pool=pool_name(table),
        io_manager_key="kafka_io_manager",
        required_resource_keys={"spark", source_key, "kafka_io_manager"},
        group_name=table.source,
        kinds={"spark", "kafka"},
        description=f"Rows of {table.table} (source {table.source}) -> Kafka topic {channel.topic}, "
                    f"one partition per watermark slice of {table.watermark}.",
        metadata={**channel_metadata(channel), "rowrelay/watermark": table.watermark},
    )
    def relay_table(context: AssetExecutionContext) -> SliceFrame:
        slice_range = SliceRange.from_key(context.partition_key)
        # Lets the table's sensor tell a run whose worker died (SIGKILL, OOM) from one still working.
        context.instance.add_run_tags(context.run_id, {WORKER_PID_TAG: str(os.getpid()),
                                                       WORKER_HOST_TAG: socket.gethostname()})
        source: SourceDatabaseResource = getattr(context.resources, source_key)
        # Cheap early answer from Kafka before any Spark work; the IO manager re-checks after fencing.
        committed = read_committed_progress(context.resources.kafka_io_manager.kafka_conf(), channel)
        committed_hi = committed.hi if committed else channel.start_after
        if committed_hi >= slice_range.hi:
            context.log.info(f"slice {slice_range} is already committed; nothing to read")
            return SliceFrame(channel=channel, slice=slice_range, messages=None, expected_rows=0)
        if committed_hi != slice_range.lo:
            raise SliceOutOfOrder(f"{channel.table}: slice {slice_range} cannot commit yet: the slice "
                                  f"({committed_hi}, {slice_range.lo}] must commit first; the run retries")
        try:
            return build_slice_frame(source, context.resources.spark, table, channel, slice_range)
        except SourceError as exc:
            raise Failure(description=str(exc), allow_retries=False) from exc

    return relay_table
