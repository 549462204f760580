"""One Dagster asset per configured table, dynamically partitioned into watermark slices: the asset and the
slices its run reads. Its checks, lag, skips and names live beside it (checks.py, lag.py, skips.py, identity.py)."""

import contextlib
import functools
import hashlib
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any

from dagster import AssetExecutionContext, AssetsDefinition, BackfillPolicy, BetaWarning, Failure, asset

from assets.checks import build_parity_after_failure_hook
from assets.identity import asset_key, channel_for, partitions_for, pool_name
from assets.records import last_recorded_slice
from assets.shape import SliceShapes, check_schema, table_shape
from assets.skips import refuse_skips_of_many_rows, skip_advice_for
from assets.worker import run_start_timings, worker_tags
from resources.config import TableConfig
from resources.exactly_once import BadRowError, SliceOutOfOrder, TableChannel, read_committed_progress, skip_advice
from resources.identity import source_resource_key
from resources.kafka_io_manager import channel_metadata
from resources.keys import WATERMARK
from resources.messages import message_columns
from resources.slice_reads import SliceFrame, TableSlices
from resources.slices import SliceRange, watermark_text
from resources.source_database import SourceDatabaseResource, SourceError, TableShape, null_watermark_error
from resources.spark import SparkResource, SparkUnreachable
from resources.stops import StopReason, inherited_stop_cleared, stop_reason, stopped_tags

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["build_table_asset", "build_table_slices", "read_signature", "slices_to_publish", "sqlite_misfit_error"]


def slices_to_publish(channel: TableChannel, slices: list[SliceRange], committed_hi: int) -> list[SliceRange]:
    """The run's slices that are not committed yet; they must continue the committed progress without a gap."""
    todo = [s for s in sorted(slices, key=lambda s: s.lo) if s.hi > committed_hi]
    for before, s in zip([None, *todo], todo, strict=False):
        if before is None and s.lo != committed_hi:
            raise SliceOutOfOrder.at(channel.table, s, committed_hi, then="; the run retries")
        if before is not None and s.lo != before.hi:  # partitions that disagree (a racing cut): healed by the sensor
            raise SliceOutOfOrder(f"{channel.table}: the run's slices {before} and {s} do not follow each other; the "
                                  "sensor or the next `rowrelay backfill` deletes the partitions that do not continue "
                                  "the committed progress once no run of the table is active")
    return todo


def read_signature(source: SourceDatabaseResource, spark: SparkResource, table: TableConfig, channel: TableChannel,
                   shape: TableShape, slice_range: SliceRange, rows: int, first: int | None) -> str:
    """Everything a slice's messages are computed from: two reads with equal signatures read the same rows into the
    same messages (the rows of a cut slice are final, so the same range holds the same rows at any later time)."""
    parts = [source.model_dump_json(), table.model_dump_json(), spark.model_dump_json(), channel.table, channel.topic,
             repr(shape), slice_range.key, str(rows), str(first)]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def build_table_slices(source: SourceDatabaseResource, spark: SparkResource, table: TableConfig,
                       channel: TableChannel, slices: list[SliceRange], committed_hi: int,
                       committed_columns: list[list[str]] | None = None) -> TableSlices:
    """The pure core of a table asset: the run's slices, each read lazily as an ordered Spark DataFrame.

    The table is checked once per run, and its shape taken again for each slice right before and after its read
    (SliceShapes); each slice's rows are read only when its turn comes. `committed_columns`: the columns of the last
    committed slice (its progress record), for on_schema_change.
    """
    todo = slices_to_publish(channel, slices, committed_hi)
    if not todo:
        return TableSlices(channel=channel, slices=sorted(slices, key=lambda s: s.lo), pending=[], read=None)
    shape = table_shape(source, table)
    # A slice cut on the primary and read from a lagging replica would miss rows its count misses too.
    source.refuse_unknowable_finality(shape)
    if source.has_null_watermarks(shape):
        raise null_watermark_error(table.table_id, table.watermark, shape.watermark_text(committed_hi))
    check_schema(table, shape, committed_columns or [])
    shapes = SliceShapes(source, table, committed_columns or shape.schema_columns)
    # Every chunk read with one shape has the same Spark schema: asked of Spark once per shape, not per chunk (a
    # round trip and a JDBC schema query each).
    spark_schema: dict[str, list[Any]] = {}
    refuse_skips_of_many_rows(source, table, shape, SliceRange(committed_hi, max(s.hi for s in todo)))

    def read(slice_range: SliceRange) -> SliceFrame:
        shape = shapes.before_read()
        skipped = table.skip_rows_in(slice_range.lo, slice_range.hi)

        def read_chunk(chunk: SliceRange, expected_rows: int) -> "DataFrame":
            frame = spark.read_slice(source, shape, chunk, expected_rows, skip=skipped)
            schema = spark_schema.get(repr(shape)) or spark_schema.setdefault(repr(shape), frame.schema.fields)
            return message_columns(frame, shape, table.key, table.envelope, table.table_id, slice_range.key,
                                   schema=schema)

        # A cut slice holds settled rows: an early read of it and the run ask the source once.
        rows = source.count_rows(shape, slice_range.lo, slice_range.hi, settled=True)
        misfit = (source.sqlite_misfit(shape, slice_range.lo, slice_range.hi, skipped)
                  if shape.dialect == "sqlite" and rows else None)
        if misfit is not None:  # raised in this slice's own turn, not the one before it (SliceFrame.failing)
            raise sqlite_misfit_error(table, shape, *misfit)
        first = (source.nth_watermark(shape, slice_range.lo, 1, slice_range.hi, settled=True)  # one indexed row
                 if rows else None)
        to_send = (source.count_rows(shape, slice_range.lo, slice_range.hi, skip=skipped, settled=True)
                   if skipped and rows else rows)
        signature = read_signature(source, spark, table, channel, shape, slice_range, rows, first)
        return SliceFrame(channel=channel, slice=slice_range, read_chunk=read_chunk, expected_rows=rows,
                          first_watermark=first, signature=signature, rows_to_send=to_send, skipped=skipped,
                          skipped_rows=rows - to_send, columns=shape.schema_columns,
                          schema_fingerprint=shape.fingerprint,
                          verify=functools.partial(shapes.after_read, shape, slice_range))

    return TableSlices(channel=channel, slices=sorted(slices, key=lambda s: s.lo), pending=todo, read=read,
                       committed_columns=committed_columns or [], where=table.where or "",
                       watermark=shape.watermark_id,
                       name_row=lambda bad: skip_advice_for(source, table, shape, bad))


def sqlite_misfit_error(table: TableConfig, shape: TableShape, at: int, column: str, kind: str, value: str
                        ) -> BadRowError:
    """What a slice holding a SQLite value its column cannot carry stops with (see `sqlite_misfit`)."""
    # A misfit in the watermark itself (5.5 in an INTEGER column) is no watermark skip_watermarks can name.
    skip = "" if column == table.watermark else f", or {skip_advice(shape.watermark_text(at))}"
    return BadRowError(
        f"{table.table_id}: row {shape.watermark_text(at)} ({table.watermark}) holds a {kind} value in column "
        f"{column!r} (reflected as {shape.column(column).type_name}): {value}. SQLite keeps it, but its driver would "
        "convert it (or, beyond the column's precision, the read would fail), so it would not arrive as stored; "
        "nothing of the slice is sent. Fix the value or the column's declared type (REAL for fractions, TEXT for "
        f"text, BLOB for anything){skip}; then re-run the slice.",
        table=table.table_id, watermark=at, column=column, entry=shape.watermark_text(at) if skip else None)


# backfill_policy is a beta parameter: Dagster warns on every definitions load (twice per CLI command), noise for
# users; rowrelay relies on it knowingly (one run per backfill). A filter installed once, not catch_warnings() around
# the definition, which is not thread-safe.
warnings.filterwarnings("ignore", category=BetaWarning, message=".*backfill_policy")


def build_table_asset(table: TableConfig, transactional_id_prefix: str) -> AssetsDefinition:
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
        metadata={**channel_metadata(channel), WATERMARK: table.watermark},
        # A backfill of many slices is one run, not one per slice (worker start dominates small slices).
        backfill_policy=BackfillPolicy.single_run(),
    )
    def relay_table(context: AssetExecutionContext) -> TableSlices:
        # One slice, or a range of slices in one run (a backfill, a sensor's backlog): one worker, one
        # Spark session and one producer epoch for all of them, each slice still its own transaction.
        slices = [SliceRange.from_key(k) for k in context.partition_keys]
        # Lets the table's sensor tell a run whose worker died (SIGKILL, OOM) from one still working.
        # A re-execution of a stopped run starts with its parent's stop tags: cleared, since this run has not stopped.
        context.instance.add_run_tags(context.run_id, {
            **worker_tags(context.run_id),
            **inherited_stop_cleared(context.run.tags, context.instance.run_retries_retry_on_asset_or_op_failure)})
        source: SourceDatabaseResource = getattr(context.resources, source_key)
        timings = run_start_timings(context.instance.get_run_stats(context.run_id))
        step = time.monotonic()
        # Cheap early answer from Kafka before any Spark work; the IO manager re-checks after fencing.
        committed = read_committed_progress(context.resources.kafka_io_manager.kafka_conf(), channel)
        committed_hi = committed.hi if committed else channel.start_after
        timings["progress_read_s"], step = time.monotonic() - step, time.monotonic()
        if max(s.hi for s in slices) > committed_hi:
            # Connect (or start) Spark while the table is reflected and checked: it is the slowest first step.
            def warm_spark(started: float = step) -> None:
                # A server that does not answer is the slice's read's to report (it checks again), failing the run
                # with its one-line message, not a thread's traceback here.
                with contextlib.suppress(SparkUnreachable):
                    context.resources.spark.get_session()
                    timings["spark_session_s"] = time.monotonic() - started  # overlaps the table check

            threading.Thread(target=warm_spark, name="rowrelay-spark-warmup", daemon=True).start()
        try:
            result = build_table_slices(source, context.resources.spark, table, channel, slices, committed_hi,
                                        committed.columns if committed else [])
        except SourceError as exc:
            reason = stop_reason(exc) or StopReason.SOURCE
            context.instance.add_run_tags(context.run_id, stopped_tags(reason))
            raise Failure(description=str(exc), allow_retries=False) from exc
        if committed is None and result.pending:
            result.recorded = last_recorded_slice(context.instance, context.asset_key)
        timings["table_check_s"] = time.monotonic() - step
        result.timings = timings
        if not result.pending:
            at = watermark_text(committed_hi, slices[0].timestamps)
            context.log.info(f"{len(slices)} slice(s) already committed (progress at {at}); nothing to read")
        return result

    # A run that fails at a later slice skips its checks: the hook checks the slices it committed before.
    return relay_table.with_hooks({build_parity_after_failure_hook(table, transactional_id_prefix)})
