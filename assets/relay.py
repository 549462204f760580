"""One Dagster asset per configured table, dynamically partitioned into watermark slices."""

import contextlib
import functools
import hashlib
import json
import os
import socket
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from dagster import (
    AssetCheckEvaluation,
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetChecksDefinition,
    AssetCheckSeverity,
    AssetExecutionContext,
    AssetKey,
    AssetRecordsFilter,
    AssetsDefinition,
    BackfillPolicy,
    BetaWarning,
    DagsterInstance,
    DynamicPartitionsDefinition,
    Failure,
    HookContext,
    HookDefinition,
    asset,
    asset_check,
    failure_hook,
)

from resources.config import TableConfig
from resources.exactly_once import (
    BadRowError,
    ProgressMissing,
    ProgressRecord,
    PublishedSlice,
    SliceOutOfOrder,
    TableChannel,
    progress_missing,
    progress_recorded_refusal,
    read_back_slices,
    read_committed_progress,
    refuse_watermark_change,
    skip_advice,
    tiles_by_range,
)
from resources.kafka_io_manager import (
    COMMITTED_BEFORE_FAILURE_TAG,
    channel_metadata,
    inherited_stop_cleared,
    stopped_tags,
)
from resources.keys import PUBLISHED_UP_TO, RUN_FAILED_LATER, WATERMARK, WORKER_HOST_TAG, WORKER_PID_TAG, WORKER_RUN_TAG
from resources.messages import SliceFrame, TableSlices, message_columns
from resources.slices import RowSkip, SliceRange, watermark_text
from resources.source_database import (
    SchemaChanged,
    SchemaRaced,
    SourceDatabaseResource,
    SourceError,
    TableShape,
    null_watermark_error,
    schema_change,
)
from resources.spark import SparkResource, SparkUnreachable

if TYPE_CHECKING:
    from pyspark.sql import DataFrame



@functools.cache  # one process, one host, boot and pid namespace; asked for each run on every sensor tick
def this_host() -> str:
    """This process's host, boot and pid namespace, as WORKER_HOST_TAG records them."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        boot, namespace = "", 0
    return f"{socket.gethostname()} boot:{boot} pidns:{namespace}"


def worker_tags(run_id: str) -> dict[str, str]:
    """The tags a run's process sets on its run when its asset starts."""
    return {WORKER_PID_TAG: str(os.getpid()), WORKER_HOST_TAG: this_host(), WORKER_RUN_TAG: run_id}


def local_worker_pid(run: Any) -> int | None:
    """The pid of the process that ran `run`, where that process set the tags itself (not copied from a parent
    run) and pids name the same processes here (this host, boot and pid namespace); None otherwise."""
    pid = run.tags.get(WORKER_PID_TAG)
    if pid is None or run.tags.get(WORKER_RUN_TAG) != run.run_id or run.tags.get(WORKER_HOST_TAG) != this_host():
        return None
    return int(pid)


def run_start_timings(stats: Any) -> dict[str, float]:
    """launch -> worker executing -> this asset's body (resources built), from Dagster's run stats."""
    out: dict[str, float] = {}
    if stats.launch_time and stats.start_time:
        out["launch_to_worker_s"] = stats.start_time - stats.launch_time
    if stats.start_time:
        out["worker_to_asset_s"] = time.time() - stats.start_time
    return out


def source_resource_key(source: str) -> str:
    return f"source_{source}"


def pool_name(table: TableConfig) -> str:
    return f"rowrelay-{table.dagster_name}"


def asset_key(table: TableConfig) -> AssetKey:
    # <source>/<schema>/<table>, a part Dagster refuses (a space, non-ASCII) mapped: see TableConfig.asset_path.
    return AssetKey(table.asset_path)


def partitions_for(table: TableConfig) -> DynamicPartitionsDefinition:
    return DynamicPartitionsDefinition(name=f"{table.dagster_name}__slices")


def channel_for(table: TableConfig, transactional_id_prefix: str) -> TableChannel:
    start = table.start_after_watermark or 0
    return TableChannel.for_table(table.table_id, table.topic_name, start_after=start,
                                  topic_partitions=table.topic_partitions, prefix=transactional_id_prefix,
                                  keyed=table.key != "none", baseline_required=table.start_after == "latest",
                                  shared_with=table.topic_shared_with)


def table_shape(source: SourceDatabaseResource, table: TableConfig) -> TableShape:
    return source.table_shape(table.schema_name, table.table_name, table.watermark, table.columns, table.where,
                              table.tie_break, table.key if isinstance(table.key, list) else None)


@dataclass(frozen=True)
class TableLag:
    """How far a table's committed progress is behind its source, for `rowrelay status` and the lag check."""

    table: str
    committed_hi: int | None  # None: nothing committed yet
    source_max: int | None  # None: the source table is empty
    lag_rows: int  # source rows above committed progress
    lag_seconds: float | None  # None: nothing to measure it from (rows wait, nothing committed, no timestamp)
    lag_basis: str  # oldest_unpublished_row | since_last_commit | since_first_run | caught_up | unknown |
    # awaiting_baseline
    last_commit_at: str | None
    watermark_kind: str = "integer"  # integer | timestamp | timestamptz: the watermarks are then UTC microseconds
    # The newest row's watermark whatever `where:` says, where committed progress ends at a published slice (a
    # baseline or reset may rightly sit above every row); else None: nothing to compare.
    newest_row: int | None = None
    newest_checked: bool = False
    # Source rows the table's skip_watermarks entries name: left out on purpose, never sent and never lag.
    skipped_rows: int = 0

    def as_dict(self) -> dict[str, Any]:
        """`rowrelay status --json`'s fields (the newest-row check speaks through `source_behind`)."""
        out = asdict(self)
        del out["newest_row"], out["newest_checked"]
        return out

    @property
    def source_behind(self) -> str | None:
        """Why the source's newest row is below committed progress, if it is: in an append-only table that means
        it was re-created (ids restarted) or emptied, and its new rows up to the progress would count as sent."""
        newest = self.newest_row
        if not self.newest_checked or self.committed_hi is None or (newest is not None and newest >= self.committed_hi):
            return None

        def text(value: int) -> str:
            return watermark_text(value, self.watermark_kind != "integer")

        top = "the source table is empty" if newest is None else \
            f"the source's newest row ({text(newest)}) is below committed progress"
        return (f"{self.table}: {top} ({text(self.committed_hi)}): was the table re-created or its rows deleted? "
                "Its new rows up to the progress would count as sent and never be published: see the runbook, "
                "\"A table dropped and re-created\" (`rowrelay reset`)")


def _oldest_unpublished_age(source: SourceDatabaseResource, table: TableConfig, shape: TableShape, after: int
                            ) -> float | None:
    """Seconds since the oldest row above `after` was written, on the database's clock (None: no such row); from
    `lag_timestamp_column`, else from a timestamp watermark itself."""
    column = table.lag_timestamp_column or shape.watermark
    t = source.reflect(table.schema_name, table.table_name)
    if column not in t.c:
        raise SourceError(f"{table.table_id}: lag_timestamp_column {column!r} does not exist "
                          f"(columns: {list(t.c.keys())}); fix `lag_timestamp_column:` in rowrelay.yaml")
    ts = t.c[column]
    if not isinstance(ts.type, sa.DateTime):
        raise SourceError(f"{table.table_id}: lag_timestamp_column {column!r} has type {ts.type}, not a timestamp; "
                          "fix `lag_timestamp_column:` in rowrelay.yaml")
    # "now" cast to the column's own type: naive columns compare in the session's time zone, aware ones in UTC.
    now = sa.cast(sa.func.current_timestamp(), ts.type)
    wm = t.c[table.watermark]
    # Only rows that will be sent: the table's `where:` and `skip_watermarks` apply, as to the rows counted (a
    # draft row the filter leaves out sat above progress for good and made every later lag look hours old).
    q = source.filtered(sa.select(sa.func.min(ts), now).where(wm > shape.watermark_param(after)), shape, wm,
                        table.skip_rows)
    with source.engine.connect() as conn:
        oldest, current = conn.execute(q).one()
    if oldest is None:
        return None
    return max(0.0, (current - oldest).total_seconds())


# Tables found not missing their progress, and when (monotonic): the lag sensor asks every minute, and each answer
# reads the data topic's tail (a shared topic: back until the table's newest message) and lists every topic.
_PROGRESS_NOT_MISSING: dict[tuple[str, str, str], float] = {}
PROGRESS_NOT_MISSING_TTL_S = 600.0


def raise_if_progress_missing(kafka_conf: dict[str, Any], channel: TableChannel, timestamps: bool) -> None:
    """`progress_missing`'s refusal, raised; a "not missing" answer is trusted for PROGRESS_NOT_MISSING_TTL_S per
    process (a change of prefix or a deleted progress topic comes with a new code location, or is seen then)."""
    key = (str(kafka_conf.get("bootstrap.servers")), channel.progress_topic, channel.topic)
    if time.monotonic() - _PROGRESS_NOT_MISSING.get(key, -PROGRESS_NOT_MISSING_TTL_S) < PROGRESS_NOT_MISSING_TTL_S:
        return
    if (missing := progress_missing(kafka_conf, channel, timestamps, timeout=CHECK_KAFKA_TIMEOUT_S)) is not None:
        _PROGRESS_NOT_MISSING.pop(key, None)
        raise missing
    _PROGRESS_NOT_MISSING[key] = time.monotonic()


def measure_lag(source: SourceDatabaseResource, table: TableConfig, progress: ProgressRecord | None,
                start_after: int = 0, first_run_at: datetime | None = None,
                published: tuple[dict[str, Any], TableChannel] | None = None,
                recorded: SliceRange | None = None) -> TableLag:
    """Rows above the committed progress and how long they have waited: the age of the oldest of them when the
    table has `lag_timestamp_column`, else the time since the last commit (an upper bound only while rows wait);
    with nothing ever committed, the time since the table's first run (`first_run_at`, a lower bound: its rows
    have waited at least that long), else unknown.

    `published` (Kafka's settings and the table's channel): with no committed progress but rows to send (or a
    baseline to record), ask whether the table's rows were published all the same (its progress topic deleted, or
    its transactional_id_prefix changed) and raise that `ProgressMissing`: every run refuses until a human resolves
    it, so "nothing committed yet, rows wait" would hide why nothing moves. Not asked of a table with nothing to
    send (an empty table is never refused, and the lag sensor asks every minute: ~a Kafka consumer per ask).
    `recorded`: the highest slice Dagster recorded as committed (`last_recorded_slice`, asked by callers that have
    the instance where progress is empty): over rows to send it is the run's own refusal (the progress topic lost
    after the data topic's messages expired), raised here too."""
    shape = table_shape(source, table)
    refuse_watermark_change(progress, shape.watermark_id)  # a lag in another column's sense would be wrong
    hi = progress.hi if progress else start_after
    top = source.max_watermark(shape)
    # `start_after: latest` before its baseline: the rows there now are never sent, so none of them is lag.
    awaiting_baseline = progress is None and table.start_after == "latest"
    rows = (source.count_rows(shape, hi, top, table.skip_rows)
            if top is not None and top > hi and not awaiting_baseline else 0)
    if progress is None and published is not None and (rows or awaiting_baseline):
        raise_if_progress_missing(published[0], published[1], shape.timestamps)
        # As the run: asked where it has slices to publish, and before a `latest` table's baseline, which is refused
        # over Dagster's record as well (`plan_cut`): the check said "awaiting_baseline" over the gap.
        if (missing := progress_recorded_refusal(published[1], recorded)) is not None:
            raise missing
    last = progress.committed_at if progress and progress.committed_at else None
    seconds: float | None
    if awaiting_baseline:
        seconds, basis = 0.0, "awaiting_baseline"
    elif rows == 0:
        seconds, basis = 0.0, "caught_up"
    elif table.lag_timestamp_column or shape.timestamps:
        seconds, basis = _oldest_unpublished_age(source, table, shape, hi), "oldest_unpublished_row"
    elif last is not None:
        seconds = max(0.0, (datetime.now(UTC) - datetime.fromisoformat(last)).total_seconds())
        basis = "since_last_commit"
    elif first_run_at is not None:
        seconds, basis = max(0.0, (datetime.now(UTC) - first_run_at).total_seconds()), "since_first_run"
    else:
        seconds, basis = None, "unknown"
    # Progress at a published slice, yet the newest row below it: the table was re-created or emptied. Every row
    # counts here (`where:` aside: a row it leaves out still exists), so one more query only where it filters.
    checked = progress is not None and progress.hi > progress.lo and progress.rows > 0
    newest = (top if not shape.where else source.max_watermark(replace(shape, where=None))) if checked else None
    skipped = source.count_skipped(shape, None, top, table.skip_rows) if table.skip_rows and top is not None else 0
    return TableLag(table=table.table_id, committed_hi=progress.hi if progress else None, source_max=top,
                    lag_rows=rows, lag_seconds=None if seconds is None else round(seconds, 1), lag_basis=basis,
                    last_commit_at=last, watermark_kind=shape.watermark_kind, newest_row=newest,
                    newest_checked=checked, skipped_rows=skipped)


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


def check_schema(table: TableConfig, shape: TableShape, committed_columns: list[list[str]]) -> str:
    """The change of columns since the last committed slice, described ("" if none, or nothing to compare with:
    a first slice, a record from an older version). With `on_schema_change: fail` a change stops the table."""
    if not committed_columns:
        return ""
    change = schema_change(committed_columns, shape.schema_columns)
    if change and table.on_schema_change == "fail":
        raise SchemaChanged(
            f"{table.table_id}: columns changed since the last committed slice ({change.describe()}) and "
            "on_schema_change is fail: nothing is published until a human accepts the new columns with "
            f"`rowrelay schema accept --table {table.table_id} --reason ...` (see docs/operations.md)")
    return change.describe() if change else ""


@dataclass(frozen=True)
class SliceShapes:
    """The table's shape for each slice of a run: taken from the catalog right before the slice's read (a column
    added, dropped, retyped or moved during a run applies from the next slice read), and taken again after each of
    its chunks is read, which must find it unchanged. A DDL waits for the reads of the table before it (PostgreSQL's
    ACCESS EXCLUSIVE lock, MariaDB's metadata lock), so equal shapes on both sides prove every statement of the read
    ran on that shape. Spark's JDBC reads use connections of their own: the catalog cannot be asked in their
    snapshot, hence the check on both sides."""

    source: SourceDatabaseResource
    table: TableConfig
    # What `on_schema_change: fail` holds each slice to: the last committed slice's columns (on a table's first
    # run, the columns it started with).
    accepted: list[list[str]]

    def before_read(self) -> TableShape:
        """The shape to read the next slice with (on_schema_change applied: `fail` raises SchemaChanged)."""
        shape = table_shape(self.source, self.table)
        check_schema(self.table, shape, self.accepted)
        return shape

    def after_read(self, shape: TableShape, slice_range: SliceRange) -> None:
        """Raise SchemaRaced where the table's columns are no longer `shape`'s (a DDL landed during the read)."""
        now = table_shape(self.source, self.table)
        if now.columns != shape.columns:
            change = schema_change(shape.schema_columns, now.schema_columns).describe() or "column details changed"
            raise SchemaRaced(f"{self.table.table_id}: the table's columns changed while slice {slice_range} was "
                              f"read ({change}): nothing of it is published from that read")


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


class SkipOfManyRows(SourceError):
    """A `skip_watermarks` entry matches more than one row: a skip leaves out one row, never its neighbours."""


def refuse_skips_of_many_rows(source: SourceDatabaseResource, table: TableConfig, shape: TableShape,
                              span: SliceRange) -> None:
    """Before anything of `span` (the run's slices) is read: a skip_watermarks entry inside it that matches more
    than one row (a bare value shared by several, or a tie_break or key that does not tell them apart) is refused,
    naming the table, the entry, the count and the entry form that names one row."""
    for skip in table.skip_rows_in(span.lo, span.hi):
        if (n := source.count_skipped(shape, skip.watermark - 1, skip.watermark, [skip])) > 1:
            at = shape.watermark_text(skip.watermark)
            what = ("every row at that watermark" if skip.bare else "its columns do not tell them apart") + (
                ", within `where:`" if shape.where else "")
            raise SkipOfManyRows(
                f"{table.table_id}: skip_watermarks entry {skip.entry(shape.timestamps, table.tie_break)} matches {n} "
                f"rows ({what}), and a skip leaves out one row; nothing is published and progress stays. Name the "
                f"row: {one_row_form(table, at)}")


def one_row_form(table: TableConfig, at: str) -> str:
    """The entry form that names one row at watermark text `at`, for a user to fill in."""
    if table.tie_break is not None:
        return f"skip_watermarks: [{{watermark: {at}, tie_break: <its {table.tie_break}>}}]"
    key = ", ".join(f"{c}: <its {c}>" for c in table.key) if isinstance(table.key, list) else "<column>: <value>"
    return f"skip_watermarks: [{{watermark: {at}, key: {{{key}}}}}]"


def skip_advice_for(source: SourceDatabaseResource, table: TableConfig, shape: TableShape, bad: BadRowError) -> str:
    """The skip advice for the row `bad` stopped at: its watermark where no other row shares it, else the row named
    by its tie_break (or its key columns), read from its message; where neither can be read, the form to fill in
    and how many rows a bare value would leave out."""
    at = int(bad.watermark or 0)
    rows = source.count_rows(shape, at - 1, at)
    if rows <= 1:
        return skip_advice(shape.watermark_text(at))
    named = message_fields(bad.value, table.envelope)
    if table.tie_break is not None and bad.tie is not None:
        named[table.tie_break] = bad.tie
    for columns in ([table.tie_break] if table.tie_break else [], table.key if isinstance(table.key, list) else []):
        if columns and all(named.get(c) is not None for c in columns):
            row = RowSkip(at, tuple(sorted((c, str(named[c])) for c in columns)))
            return skip_advice(row.entry(shape.timestamps, table.tie_break))
    return (f"leave the row out by naming it ({rows} rows share its watermark, and a bare value is refused): "
            f"{one_row_form(table, shape.watermark_text(at))}")


def message_fields(value: bytes | None, envelope: bool) -> dict[str, Any]:
    """A row's columns from its message (`envelope`: under "data"), {} where unknown or not an object."""
    if value is None:
        return {}
    with contextlib.suppress(ValueError):
        row = json.loads(value)
        row = row.get("data") if envelope and isinstance(row, dict) else row
        if isinstance(row, dict):
            return {k: v for k, v in row.items() if isinstance(v, int | str) and not isinstance(v, bool)}
    return {}


RECORDED_LOOKBACK = 1000  # materializations read back: a roll-up stored after newer slices is among them


def last_recorded_slice(instance: DagsterInstance, key: AssetKey) -> SliceRange | None:
    """The highest slice Dagster recorded as committed (a materialization), if any: asked only where Kafka's
    progress is empty, so that a progress topic lost after its data topic's messages expired does not send the
    table again (the publisher refuses: `recorded`). The highest of the recent ones, not the latest: a roll-up is
    recorded as a new materialization, after slices above it."""
    records = instance.fetch_materializations(AssetRecordsFilter(asset_key=key), limit=RECORDED_LOOKBACK).records
    ranges = []
    for record in records:
        partition = record.asset_materialization.partition if record.asset_materialization else None
        with contextlib.suppress(ValueError):  # not a slice key
            ranges.append(SliceRange.from_key(partition or ""))
    return max(ranges, key=lambda r: r.hi, default=None)


RECORDED_KEYS_PER_QUERY = 500  # partition keys per materializations query (an SQL IN list)


def recorded_published(instance: DagsterInstance, key: AssetKey, partition_keys: list[str]) -> dict[str, int]:
    """Of `partition_keys`, those Dagster holds a materialization of, each with the watermark its rows are
    recorded as published up to, by its latest materialization: its end for a committed slice (a run's, a roll-up's,
    one recorded for a run that failed or died later), else what a reset recorded (`rowrelay/published_up_to`).
    For `rowrelay reset` over empty progress (a changed transactional_id_prefix, a lost progress topic), where Kafka
    cannot say which partitions were published: a partition missing here was never materialized."""
    out: dict[str, int] = {}
    for i in range(0, len(partition_keys), RECORDED_KEYS_PER_QUERY):
        wanted = set(partition_keys[i:i + RECORDED_KEYS_PER_QUERY])
        cursor = None
        while wanted:
            page = instance.fetch_materializations(AssetRecordsFilter(asset_key=key, asset_partitions=list(wanted)),
                                                   limit=RECORDED_LOOKBACK, cursor=cursor)
            for record in page.records:  # newest first: a key's first record is its latest
                m = record.asset_materialization
                if m is None or m.partition not in wanted:
                    continue
                wanted.discard(m.partition)
                upto = m.metadata.get(PUBLISHED_UP_TO)
                out[m.partition] = int(upto.value) if upto is not None else SliceRange.from_key(m.partition).hi
            if not page.has_more:
                break
            cursor = page.cursor
    return out


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
            reason = ("schema_change" if isinstance(exc, SchemaChanged) else "skip_of_many_rows"
                      if isinstance(exc, SkipOfManyRows) else "source")
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


# -- asset checks: slice parity and lag ---------------------------------------------------------------------------

PARITY_CHECK = "slice_parity"
LAG_CHECK = "lag"
# Kafka reads of a check are bounded: a check must never hold up (or hang) the run it is part of.
CHECK_KAFKA_TIMEOUT_S = 15.0


def parity_result(table: TableConfig, source: SourceDatabaseResource, records: list[ProgressRecord],
                  published: Mapping[str, PublishedSlice | None]) -> AssetCheckResult:
    """Each slice's progress record against the source recounted now (rows in (lo, hi] minus skip_watermarks) and
    against its messages read back from Kafka (`published`, by slice; None: not read back, over
    parity_read_back_max_rows): as many as the record says, with its checksum. One indexed count per slice."""
    shape = table_shape(source, table)
    mismatches: list[dict[str, Any]] = []
    read_back = 0
    for r in records:
        # By the row filter the slice was published with (`where:` or skip_watermarks changed since must not make
        # an old slice look wrong).
        where, skipped = r.row_filter(table.where, table.skip_rows)
        counted = source.count_rows(replace(shape, where=where or None), r.lo, r.hi, skip=skipped)
        if counted != r.rows:
            mismatches.append({"slice": r.slice, "what": "rows", "progress_record": r.rows, "source_now": counted})
        kafka = published.get(r.slice)
        if kafka is None:
            continue
        read_back += 1
        if kafka.rows != r.rows:
            mismatches.append({"slice": r.slice, "what": "messages", "progress_record": r.rows,
                               "in_kafka": kafka.rows})
        elif kafka.checksum is not None and r.checksum and kafka.checksum != r.checksum:
            mismatches.append({"slice": r.slice, "what": "checksum", "progress_record": r.checksum,
                               "in_kafka": kafka.checksum})
    checked = [r.slice for r in records]
    summary = {"slices_checked": len(checked), "slices_read_back": read_back, "rows": sum(r.rows for r in records)}
    if not mismatches:
        return AssetCheckResult(check_name=PARITY_CHECK, passed=True, metadata={
            **summary, "slices": ", ".join(checked) or "-"})
    first = mismatches[0]
    where_found = {"rows": ("source_now", "in the source now"), "messages": ("in_kafka", "messages in Kafka"),
                   "checksum": ("in_kafka", "over its messages in Kafka")}[first["what"]]
    figures = f"{first['progress_record']} in the progress record vs {first[where_found[0]]} {where_found[1]}"
    return AssetCheckResult(
        check_name=PARITY_CHECK, passed=False, severity=AssetCheckSeverity.ERROR,
        description=f"{table.table_id}: slice {first['slice']}: {first['what']} differ: {figures}",
        metadata={**summary, "mismatches": mismatches,
                  f"{first['what']}_progress_record": first["progress_record"],
                  f"{first['what']}_{where_found[0]}": first[where_found[0]]})


def lag_result(table: TableConfig, lag: TableLag) -> AssetCheckResult:
    """WARN above warn_lag_seconds, ERROR above error_lag_seconds; rows waiting with no age known pass (said so)."""
    seconds = lag.lag_seconds
    metadata: dict[str, Any] = {"lag_rows": lag.lag_rows, "lag_seconds": seconds if seconds is not None else -1.0,
                                "lag_measured_as": lag.lag_basis, "committed_hi": lag.committed_hi or 0,
                                "source_max": lag.source_max or 0, "warn_lag_seconds": table.warn_lag_seconds,
                                "error_lag_seconds": table.error_lag_seconds}
    summary = f"{table.table_id}: {lag.lag_rows} row(s) waiting, lag {seconds} s ({lag.lag_basis})"
    if (behind := lag.source_behind) is not None:
        return AssetCheckResult(check_name=LAG_CHECK, passed=False, severity=AssetCheckSeverity.WARN,
                                description=behind, metadata=metadata)
    if seconds is None or seconds <= table.warn_lag_seconds:
        return AssetCheckResult(check_name=LAG_CHECK, passed=True, description=summary, metadata=metadata)
    severity = AssetCheckSeverity.ERROR if seconds > table.error_lag_seconds else AssetCheckSeverity.WARN
    limit = table.error_lag_seconds if severity == AssetCheckSeverity.ERROR else table.warn_lag_seconds
    return AssetCheckResult(check_name=LAG_CHECK, passed=False, severity=severity,
                            description=f"{summary} > {limit} s", metadata=metadata)


def evaluate_parity(table: TableConfig, source: SourceDatabaseResource, kafka_conf: dict[str, Any],
                    slice_keys: list[str] | None,
                    transactional_id_prefix: str) -> AssetCheckResult:
    """slice_parity of the given slices (a run's), or of the last committed slice (the check run on its own)."""
    channel = channel_for(table, transactional_id_prefix)
    if slice_keys:
        # The run's slices are one span of the chain: one search over the progress topic finds their records
        # (a long-lived table has hundreds of thousands; reading them all cost seconds per run).
        wanted = [SliceRange.from_key(k) for k in slice_keys]
        # Right after a commit its marker may not be on the progress partition yet: asked again for a while
        # before a slice without a record is reported.
        deadline = time.monotonic() + CHECK_KAFKA_TIMEOUT_S
        while True:
            tiles = tiles_by_range(kafka_conf, channel, wanted, timeout=CHECK_KAFKA_TIMEOUT_S)
            unseen = [s.key for s in wanted if not tiles[s]]
            if not unseen or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if unseen:
            return AssetCheckResult(check_name=PARITY_CHECK, passed=False, severity=AssetCheckSeverity.WARN,
                                    description=f"{table.table_id}: could not be evaluated: no committed progress "
                                                f"record found for slice(s) {', '.join(unseen)}",
                                    metadata={"slices_without_record": ", ".join(unseen)})
        records = [r for s in wanted for r in tiles[s]]  # a slice's own record, or each record of a roll-up
    elif slice_keys is None:
        last = read_committed_progress(kafka_conf, channel, timeout=CHECK_KAFKA_TIMEOUT_S)
        if last is None or last.hi <= last.lo:
            return AssetCheckResult(check_name=PARITY_CHECK, passed=True,
                                    description=f"{table.table_id}: no committed slice yet: nothing to compare",
                                    metadata={"slices_checked": 0})
        records = [last]
    else:
        records = []
    published = read_back_slices(kafka_conf, [r for r in records if r.hi > r.lo
                                              and r.rows <= table.parity_read_back_max_rows],
                                 timeout=CHECK_KAFKA_TIMEOUT_S)
    return parity_result(table, source, records, published)


def committed_before_failure(tags: Mapping[str, str], partition_keys: list[str], run_id: str) -> list[str]:
    """The slices run `run_id` committed before its failure (its COMMITTED_BEFORE_FAILURE_TAG,
    `<run id>/<first>...<last>`), among the table's partition keys, in watermark order; none when it committed
    nothing (a tag a retry copied from the run it retries names that run, not this one)."""
    owner, _, span = tags.get(COMMITTED_BEFORE_FAILURE_TAG, "").partition("/")
    if owner != run_id or not span:
        return []
    first, last = (SliceRange.from_key(k) for k in span.split("..."))
    within = [r for r in map(SliceRange.from_key, partition_keys) if first.lo <= r.lo and r.hi <= last.hi]
    return [r.key for r in sorted(within)]


def build_parity_after_failure_hook(table: TableConfig, transactional_id_prefix: str) -> HookDefinition:
    """slice_parity of the slices a failed run committed before the slice it failed at (Dagster skips the checks
    of a failed step), reported as a runless evaluation naming the run."""
    source_key = source_resource_key(table.source)

    @failure_hook(name=f"{table.dagster_name}_parity_after_failure",
                  required_resource_keys={source_key, "kafka_io_manager"})
    def parity_after_failure(context: HookContext) -> None:
        run = context.instance.get_run_by_id(context.run_id)
        keys = committed_before_failure(run.tags if run else {},
                                        context.instance.get_dynamic_partitions(partitions_for(table).name),
                                        context.run_id)
        if not keys:
            return
        try:
            result = evaluate_parity(table, getattr(context.resources, source_key),
                                     context.resources.kafka_io_manager.kafka_conf(), keys, transactional_id_prefix)
        except Exception as exc:  # noqa: BLE001 - reported as the check's outcome
            result = _unevaluated(PARITY_CHECK, exc)
        context.instance.report_runless_asset_event(AssetCheckEvaluation(
            asset_key=asset_key(table), check_name=PARITY_CHECK, passed=result.passed,
            severity=result.severity or AssetCheckSeverity.ERROR,
            description=result.description or f"{table.table_id}: {len(keys)} slice(s) committed by run "
                                              f"{context.run_id} before it failed at a later slice",
            metadata={**result.metadata, RUN_FAILED_LATER: context.run_id}))

    return parity_after_failure


def _unevaluated(check_name: str, exc: Exception) -> AssetCheckResult:
    # A check that cannot be evaluated (broker away, source down) says so; it must not fail the run that published.
    return AssetCheckResult(check_name=check_name, passed=False, severity=AssetCheckSeverity.WARN,
                            description=f"could not be evaluated: {exc}", metadata={"error": str(exc)[:2000]})


def unmeasured_lag(table: TableConfig, exc: Exception) -> AssetCheckResult:
    """The lag check when the lag cannot be measured (the source or Kafka away, the table gone): a WARN saying
    why, not the last outcome left standing. Progress missing over rows already published is an ERROR: no run can
    publish until a human resolves it (its message says how), so the lag only grows."""
    if isinstance(exc, ProgressMissing):
        return AssetCheckResult(check_name=LAG_CHECK, passed=False, severity=AssetCheckSeverity.ERROR,
                                description=str(exc), metadata={"lag_measured_as": "progress_missing",
                                                                "error": str(exc)[:2000]})
    result = _unevaluated(LAG_CHECK, exc)
    return AssetCheckResult(check_name=LAG_CHECK, passed=False, severity=AssetCheckSeverity.WARN,
                            description=f"{table.table_id}: lag {result.description}", metadata=result.metadata)


def build_table_checks(table: TableConfig, transactional_id_prefix: str) -> list[AssetChecksDefinition]:
    """slice_parity (the run's slices, or the last committed one when run alone) and lag, in each run of the
    table's job; lag is also evaluated between runs by the table's lag sensor (orchestration/factory.py)."""
    channel = channel_for(table, transactional_id_prefix)
    source_key = source_resource_key(table.source)
    key = asset_key(table)

    @asset_check(asset=key, name=PARITY_CHECK, required_resource_keys={source_key, "kafka_io_manager"},
                 description="Per slice: rows in the progress record = rows in (lo, hi] of the source now (minus "
                             "skip_watermarks) = its messages read back from Kafka, and its checksum = theirs. "
                             "ERROR with both figures on a mismatch.")
    def slice_parity(context: AssetCheckExecutionContext) -> AssetCheckResult:
        op_context = context.op_execution_context
        try:
            return evaluate_parity(table, getattr(context.resources, source_key),
                                   context.resources.kafka_io_manager.kafka_conf(),
                                   op_context.partition_keys if op_context.has_partitions else None,
                                   transactional_id_prefix)
        except Exception as exc:  # noqa: BLE001 - reported as the check's outcome
            return _unevaluated(PARITY_CHECK, exc)

    @asset_check(asset=key, name=LAG_CHECK, required_resource_keys={source_key, "kafka_io_manager"},
                 description=f"Rows above committed progress and their age: WARN above {table.warn_lag_seconds} s, "
                             f"ERROR above {table.error_lag_seconds} s (warn_lag_seconds / error_lag_seconds).")
    def lag(context: AssetCheckExecutionContext) -> AssetCheckResult:
        try:
            conf = context.resources.kafka_io_manager.kafka_conf()
            progress = read_committed_progress(conf, channel, timeout=CHECK_KAFKA_TIMEOUT_S)
            # Empty progress over slices Dagster recorded as committed: the run refuses, so the check says why.
            recorded = last_recorded_slice(context.instance, key) if progress is None else None
            return lag_result(table, measure_lag(getattr(context.resources, source_key), table, progress,
                                                 channel.start_after, published=(conf, channel), recorded=recorded))
        except ProgressMissing as exc:
            return unmeasured_lag(table, exc)
        except Exception as exc:  # noqa: BLE001 - reported as the check's outcome
            return _unevaluated(LAG_CHECK, exc)

    return [slice_parity, lag]
