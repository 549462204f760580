"""One Dagster asset per configured table, dynamically partitioned into watermark slices."""

import os
import socket
import threading
from typing import TYPE_CHECKING

from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    BackfillPolicy,
    DynamicPartitionsDefinition,
    Failure,
    asset,
)

from resources.config import TableConfig
from resources.exactly_once import SliceOutOfOrder, TableChannel, read_committed_progress
from resources.kafka_io_manager import STOPPED_TAG, channel_metadata
from resources.messages import SliceFrame, TableSlices, message_columns
from resources.slices import SliceRange
from resources.source_database import SourceDatabaseResource, SourceError, TableShape
from resources.spark import SparkResource

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

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


def slices_to_publish(channel: TableChannel, slices: list[SliceRange], committed_hi: int) -> list[SliceRange]:
    """The run's slices that are not committed yet; they must continue the committed progress without a gap."""
    todo = [s for s in sorted(slices, key=lambda s: s.lo) if s.hi > committed_hi]
    expected = committed_hi
    for s in todo:
        if s.lo != expected:
            raise SliceOutOfOrder(f"{channel.table}: slice {s} cannot commit yet: the slice ({expected}, {s.lo}] "
                                  "must commit first; the run retries")
        expected = s.hi
    return todo


def build_table_slices(source: SourceDatabaseResource, spark: SparkResource, table: TableConfig,
                       channel: TableChannel, slices: list[SliceRange], committed_hi: int) -> TableSlices:
    """The pure core of a table asset: the run's slices, each read lazily as an ordered Spark DataFrame.

    The table is reflected and checked once per run; each slice's rows are read only when its turn comes.
    """
    todo = slices_to_publish(channel, slices, committed_hi)
    if not todo:
        return TableSlices(channel=channel, slices=sorted(slices, key=lambda s: s.lo), pending=[], read=None)
    shape = table_shape(source, table)
    if source.has_null_watermarks(shape):
        raise SourceError(f"{table.table_id}: rows with NULL in watermark column {table.watermark!r} would never be "
                          "sent; make the column NOT NULL or fill it")

    def read(slice_range: SliceRange) -> SliceFrame:
        def read_chunk(chunk: SliceRange, expected_rows: int) -> "DataFrame":
            frame = spark.read_slice(source, shape, chunk, expected_rows)
            if table.skip_watermarks:
                from pyspark.sql import functions as F

                frame = frame.where(~F.col(f"`{shape.watermark}`").isin(table.skip_watermarks))
            return message_columns(frame, shape, table.key, table.envelope, table.table_id, slice_range.key)

        rows = source.count_rows(shape, slice_range.lo, slice_range.hi)
        return SliceFrame(channel=channel, slice=slice_range, read_chunk=read_chunk, expected_rows=rows)

    return TableSlices(channel=channel, slices=sorted(slices, key=lambda s: s.lo), pending=todo, read=read)


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
        # A backfill of many slices is one run, not one per slice (worker start dominates small slices).
        backfill_policy=BackfillPolicy.single_run(),
    )
    def relay_table(context: AssetExecutionContext) -> TableSlices:
        # One slice, or a range of slices in one run (a backfill, a sensor's backlog): one worker, one
        # Spark session and one producer epoch for all of them, each slice still its own transaction.
        slices = [SliceRange.from_key(k) for k in context.partition_keys]
        # Lets the table's sensor tell a run whose worker died (SIGKILL, OOM) from one still working.
        context.instance.add_run_tags(context.run_id, {WORKER_PID_TAG: str(os.getpid()),
                                                       WORKER_HOST_TAG: socket.gethostname()})
        source: SourceDatabaseResource = getattr(context.resources, source_key)
        # Cheap early answer from Kafka before any Spark work; the IO manager re-checks after fencing.
        committed = read_committed_progress(context.resources.kafka_io_manager.kafka_conf(), channel)
        committed_hi = committed.hi if committed else channel.start_after
        if max(s.hi for s in slices) > committed_hi:
            # Connect (or start) Spark while the table is reflected and checked: it is the slowest first step.
            threading.Thread(target=context.resources.spark.get_session, name="rowrelay-spark-warmup",
                             daemon=True).start()
        try:
            result = build_table_slices(source, context.resources.spark, table, channel, slices, committed_hi)
        except SourceError as exc:
            context.instance.add_run_tags(context.run_id, {STOPPED_TAG: "source"})
            raise Failure(description=str(exc), allow_retries=False) from exc
        if not result.pending:
            context.log.info(f"{len(slices)} slice(s) already committed (progress at {committed_hi}); nothing to read")
        return result

    return relay_table
