"""Kafka IO manager: publishes a slice exactly once (resources/exactly_once.py) and loads it back by offsets."""


import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dagster import AssetMaterialization, ConfigurableIOManager, Failure, InputContext, MetadataValue, OutputContext
from pydantic import Field

from resources.config import resolve_env
from resources.exactly_once import (
    WATERMARK_HEADER,
    BadRowError,
    MessageBatch,
    ProgressMissing,
    ProgressRecord,
    PublishResult,
    SlicePublisher,
    TableChannel,
    pieces_in_range,
    read_piece_messages,
    tiles_by_range,
)
from resources.history import summarize
from resources.keys import (
    CHANNEL_METADATA,
    CHANNEL_PROGRESS_TOPIC,
    CHANNEL_START_AFTER,
    CHANNEL_TABLE,
    CHANNEL_TOPIC,
    CHANNEL_TRANSACTIONAL_ID,
    COMMITTED_BEFORE_FAILURE_TAG,
    RUN_FAILED_LATER,
)
from resources.keys import STOPPED_TAG as STOPPED_TAG
from resources.slice_reads import ReadAhead, SliceFrame, TableSlices
from resources.slices import SliceRange
from resources.source_database import SchemaRaced, schema_change
from resources.spark import SparkResource
from resources.stops import RETRY_ON_FAILURE_TAG as RETRY_ON_FAILURE_TAG
from resources.stops import STOPPING_ERRORS, StopReason, stop_reason, stopped_tags

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

def named_row(obj: TableSlices, bad: BadRowError) -> BadRowError:
    """`bad` with skip advice that names its row (`TableSlices.name_row`); as it was where that cannot be asked (the
    source away: the stop itself must still be said)."""
    if obj.name_row is None or bad.entry is None:
        return bad
    try:
        return bad.naming(obj.name_row(bad))
    except Exception:  # noqa: BLE001 - the advice is a courtesy; the stop is the message
        return bad


def progress_metadata(p: ProgressRecord) -> dict[str, Any]:
    """A committed slice's materialization metadata from its progress record: what it published, and where."""
    return {"rows": p.rows, "bytes": p.bytes, "topic": p.topic, "offsets": MetadataValue.json(p.offsets),
            "watermark_lo": p.lo, "watermark_hi": p.hi, "checksum": p.checksum,
            "transactional_id": p.transactional_id, "committed_at": p.committed_at,
            # Rows `skip_watermarks` left out of the slice: skipped, not missing.
            **({"skipped_rows": p.skipped_rows} if p.skipped_rows else {})}


def channel_metadata(channel: TableChannel) -> dict[str, Any]:
    """Definition metadata an asset carries so load_input can find its channel."""
    return {CHANNEL_TABLE: channel.table, CHANNEL_TOPIC: channel.topic,
            CHANNEL_PROGRESS_TOPIC: channel.progress_topic,
            CHANNEL_TRANSACTIONAL_ID: channel.transactional_id,
            CHANNEL_START_AFTER: channel.start_after}


@dataclass
class RunReport:
    """What a run's output reports per slice key: its publish result and expected rows; for the slices this run
    published, seconds per step of the run and per phase (read, convert, produce, flush, commit), chunks read early
    and how its columns changed from the slice before it."""

    records: dict[str, tuple[PublishResult, int]] = field(default_factory=dict)
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    phase_times: dict[str, dict[str, float]] = field(default_factory=dict)
    early_chunks: dict[str, int] = field(default_factory=dict)
    changes: dict[str, str] = field(default_factory=dict)


class KafkaIOManager(ConfigurableIOManager):
    """Stores a table asset's partition (one watermark slice) as messages of one Kafka transaction."""

    bootstrap_servers: str
    producer: dict[str, str] = Field(default_factory=dict, description="extra librdkafka settings; ${VAR} allowed")
    # The deployment's `kafka.transactional_id_prefix`: every table's transactional id and progress topic are named
    # under it, so it is always handed over, never assumed.
    transactional_id_prefix: str
    chunk_rows: int = Field(100_000, description="rows fetched from Spark per Arrow batch while streaming a slice")
    prefetch_chunks: int = Field(2, ge=1, le=8, description="chunks fetched ahead while one is produced")
    spark: SparkResource

    def kafka_conf(self) -> dict[str, Any]:
        conf: dict[str, Any] = {k: resolve_env(str(v)) for k, v in self.producer.items()}
        conf["bootstrap.servers"] = resolve_env(self.bootstrap_servers)
        return conf

    def publisher(self, channel: TableChannel, recorded: SliceRange | None = None) -> SlicePublisher:
        return SlicePublisher(channel, self.kafka_conf(), recorded=recorded)

    def handle_output(self, context: OutputContext, obj: TableSlices) -> None:
        """Publish each pending slice in its own transaction, in watermark order, with one producer epoch.

        Each slice's materialization carries its own progress record (partition-scoped metadata). If slice k
        fails, slices before it stay committed in Kafka (and are reported as materializations of their partitions)
        and the retry starts at k.
        """
        if not isinstance(obj, TableSlices):
            raise TypeError(f"KafkaIOManager stores TableSlices outputs, got {type(obj).__name__}")
        report = RunReport()
        pending = {s.key for s in obj.pending}
        committed = [s for s in obj.slices if s.key not in pending]
        if committed:  # committed before this run (a re-run, a roll-up key): report what they published
            tiles = tiles_by_range(self.kafka_conf(), obj.channel, committed)  # one search for a run's keys
            for s in committed:
                record = (self.committed_record(obj.channel, s, tiles[s]) if tiles[s]
                          else self.kept_by_reset(obj.channel, s))
                report.records[s.key] = (PublishResult(record, already_committed=True, duration_s=0.0), 0)
        if obj.pending:
            self._publish_pending(context, obj, report)
        self._add_slice_metadata(context, obj, report)

    def _publish_pending(self, context: OutputContext, obj: TableSlices, report: RunReport) -> None:
        """Publish the run's pending slices in order, read ahead across slice boundaries; on a failure, report
        the slices committed before it."""
        assert obj.read is not None
        read = obj.read
        publisher: SlicePublisher | None = None
        counts: dict[str, float] = {}

        def frames_in_order() -> Iterator[SliceFrame]:
            for s in obj.pending:  # each slice's count query runs when the read-ahead reaches it
                began = time.monotonic()
                try:
                    frame = read(s)
                except Exception as exc:  # noqa: BLE001 - raised in the slice's own turn (SliceFrame.failing)
                    frame = SliceFrame.failing(obj.channel, s, exc)
                counts[s.key] = time.monotonic() - began
                yield frame

        ahead = ReadAhead(frames_in_order(), self.chunk_rows, self.prefetch_chunks)
        completed = False
        try:
            publisher = self.publisher(obj.channel, obj.recorded)
            before = obj.committed_columns
            for slice_range in obj.pending:
                steps = {**obj.timings, "count_s": counts.get(slice_range.key, 0.0)}
                before = self._publish_next(context, publisher, obj, ahead, slice_range, steps, before, report)
            completed = True
        except STOPPING_ERRORS as exc:  # a retry of the run cannot help: later slices wait behind this one
            raise self._stopped(context, obj, exc) from exc
        finally:
            report.early_chunks.update(ahead.early_chunks)
            ahead.close()
            if publisher is not None:
                publisher.close()
            if not completed:
                self._record_committed_before_failure(context, obj, report.records)

    def _publish_next(self, context: OutputContext, publisher: SlicePublisher, obj: TableSlices, ahead: ReadAhead,
                      slice_range: SliceRange, steps: dict[str, float], before: list[list[str]], report: RunReport
                      ) -> list[list[str]]:
        """Publish `slice_range`, the slice at the read-ahead's head, into `report`; returns the columns the next
        slice's are described against (`before`: those of the slice before this one)."""
        assert obj.read is not None
        frame = ahead.frame_at_head()
        if frame is None or frame.slice != slice_range:
            raise RuntimeError(f"{obj.channel.table}: read-ahead lost its place at slice {slice_range}")
        publish_started = time.monotonic()
        convert_before = ahead.convert_s
        first_call = [True]

        def batches(f: SliceFrame = frame) -> Iterator[MessageBatch]:
            # The first attempt streams from the read-ahead; a redo (after an abort) reads the slice again on its own.
            source = ahead.batches(f) if first_call[0] else f.iter_batches(self.chunk_rows, self.prefetch_chunks)
            first_call[0] = False
            for batch in source:
                steps.setdefault("first_batch_s", time.monotonic() - publish_started)  # fencing + first read
                yield batch

        result, frame = self._publish_read_once_more(context, publisher, obj, frame, batches, obj.read)
        if first_call[0]:  # published nothing (already committed): the read-ahead moves past it
            ahead.skip(frame)
        steps["transaction_s"] = result.progress.transaction_s
        steps["publish_s"] = result.duration_s
        convert = ahead.convert_s - convert_before
        phases = dict(result.phases)
        if "read_s" in phases:  # the order check and split happen while the producer waits for rows
            phases["read_s"] = max(0.0, phases["read_s"] - convert)
            phases["convert_s"] = convert
        key = slice_range.key
        report.timings[key] = steps
        report.phase_times[key] = phases
        report.records[key] = (result, frame.expected_rows)
        if not result.already_committed:
            report.changes[key] = schema_change(before, frame.columns).describe() if before else ""
            before = frame.columns
        if report.changes.get(key):
            context.log.warning(f"{obj.channel.table}: columns changed before slice {slice_range}: "
                                f"{report.changes[key]} (on_schema_change: follow)")
        context.log.info(f"{obj.channel.table}: slice {slice_range} committed: {result.progress.rows} "
                         f"rows in {result.duration_s:.1f} s")
        return before

    def _add_slice_metadata(self, context: OutputContext, obj: TableSlices, report: RunReport) -> None:
        """Each slice's materialization metadata, and the run's figures."""
        for key, (result, _) in report.records.items():
            metadata = self.slice_metadata(obj, result)
            if key in report.timings:
                metadata["timings_s"] = MetadataValue.json({k: round(v, 3) for k, v in report.timings[key].items()})
            if key in report.early_chunks:  # chunks read before the run started (EarlyRead: a backfill's first)
                metadata["chunks_read_early"] = report.early_chunks[key]
            if report.phase_times.get(key):
                metadata["phases_s"] = MetadataValue.json({k: round(v, 3) for k, v in report.phase_times[key].items()})
            if result.progress.schema_fingerprint:
                metadata["schema_fingerprint"] = result.progress.schema_fingerprint
                metadata["columns"] = MetadataValue.json(result.progress.columns)
            if report.changes.get(key):  # published by this run, with columns that changed from the slice before
                metadata["schema_change"] = MetadataValue.text(report.changes[key])
            context.step_context.add_asset_metadata(metadata, partition_key=key)
        # The run's figures: Dagster adds output metadata to each partition's materialization, so they are named
        # as the run's ("slices" is a roll-up's own count).
        context.add_output_metadata({"run_slices": len(obj.slices), "run_slices_published": len(obj.pending),
                                     "run_rows_published": sum(r.progress.rows for r, _ in report.records.values()
                                                               if not r.already_committed)})

    def kept_by_reset(self, channel: TableChannel, rng: SliceRange) -> ProgressRecord:
        """What a committed key that no slice record tiles published: where a reset back landed inside a slice, the
        part it kept (`pieces_in_range`: the partition (lo, W] the reset left) holds that slice's messages up to W,
        counted here. Else nothing."""
        pieces = pieces_in_range(self.kafka_conf(), channel, rng)
        if not pieces:
            return self.committed_record(channel, rng, [])
        rows = sum(1 for piece in pieces for _ in read_piece_messages(self.kafka_conf(), piece))
        summary = summarize([piece.record for piece in pieces])
        return ProgressRecord(channel.table, rng.key, rng.lo, rng.hi, rows, 0, "", summary["topic"],
                              offsets=summary["offsets"], transactional_id=channel.transactional_id,
                              committed_at=summary["last_committed_at"])

    @staticmethod
    def committed_record(channel: TableChannel, rng: SliceRange, tiles: list[ProgressRecord]) -> ProgressRecord:
        """What a committed key published, from the records tiling it: its slice's progress record, or for a
        roll-up key (a range over several committed slices, resources/history.py) their records summed; a range
        covered by progress without slices of its own (below start_after, a baseline) published nothing."""
        if len(tiles) == 1:
            return tiles[0]
        if not tiles:
            return ProgressRecord(channel.table, rng.key, rng.lo, rng.hi, 0, 0, "", channel.topic)
        summary = summarize(tiles)
        return ProgressRecord(channel.table, rng.key, rng.lo, rng.hi, summary["rows"], summary["bytes"],
                              summary["checksum"], summary["topic"], offsets=summary["offsets"],
                              transactional_id=channel.transactional_id, committed_at=summary["last_committed_at"])

    def _record_committed_before_failure(self, context: OutputContext, obj: TableSlices,
                                         records: dict[str, tuple[PublishResult, int]]) -> None:
        """A run that fails at slice k records no output, so slices it committed before k (in Kafka for good) would
        have no materialization: their rows, offsets and checksum would not show until a roll-up. Reported here, as
        materializations of their partitions outside the failing step (Dagster drops the events an IO manager logs
        when `handle_output` raises)."""
        step = context.step_context
        committed = [key for key, (result, _) in records.items() if not result.already_committed]
        if committed:
            try:
                step.instance.add_run_tags(step.run_id,
                                           {COMMITTED_BEFORE_FAILURE_TAG:
                                            f"{step.run_id}/{committed[0]}...{committed[-1]}"})
            except Exception as exc:  # noqa: BLE001 - as below: the run's own failure is what must surface
                context.log.warning(f"{obj.channel.table}: could not tag the run with its committed slices: {exc}")
        for key in committed:  # not those committed before this run: their own materializations exist
            metadata = {**self.slice_metadata(obj, records[key][0]), RUN_FAILED_LATER: step.run_id}
            try:
                step.instance.report_runless_asset_event(AssetMaterialization(
                    asset_key=context.asset_key, partition=key, metadata=metadata,
                    description=f"slice {key} committed by run {step.run_id}, which failed at a later slice"))
            except Exception as exc:  # noqa: BLE001 - the run's own failure is what must surface (storage down?)
                context.log.warning(f"{obj.channel.table}: could not record committed slice {key}: {exc}")

    def _publish_read_once_more(self, context: OutputContext, publisher: SlicePublisher, obj: TableSlices,
                                frame: SliceFrame, batches: Callable[[], Iterator[MessageBatch]],
                                read: Callable[[SliceRange], SliceFrame]) -> tuple[PublishResult, SliceFrame]:
        """Publish `frame`'s slice. Where the table's columns changed while it was read (SchemaRaced; its
        transaction aborted, nothing visible), it is read once more with the columns the table has now,
        on_schema_change applied to them, and that read is published. Returns the result and the frame published."""
        try:
            return self._publish(publisher, obj, frame, batches), frame
        except SchemaRaced as exc:
            context.log.warning(f"{exc}; reading it again with the table's columns now")
        again = read(frame.slice)
        return self._publish(publisher, obj, again,
                             lambda: again.iter_batches(self.chunk_rows, self.prefetch_chunks)), again

    @staticmethod
    def _publish(publisher: SlicePublisher, obj: TableSlices, frame: SliceFrame,
                 batches: Callable[[], Iterator[MessageBatch]]) -> PublishResult:
        return publisher.publish(frame.slice, batches, columns=frame.columns,
                                 schema_fingerprint=frame.schema_fingerprint, expected_rows=frame.rows_to_send,
                                 where=obj.where, skipped=frame.skipped, skipped_rows=frame.skipped_rows,
                                 watermark=obj.watermark)

    @staticmethod
    def _stopped(context: OutputContext, obj: TableSlices, exc: Exception) -> Failure:
        """The run's failure for an error a retry cannot fix, its run tagged so the table's sensor backs off."""
        reason = stop_reason(exc) or StopReason.SOURCE
        step = context.step_context
        step.instance.add_run_tags(step.run_id, stopped_tags(reason))
        if isinstance(exc, BadRowError):  # the slice stays unpublished until the row is fixed or skipped
            exc = named_row(obj, exc)
            return Failure(description=str(exc), allow_retries=False,
                           metadata={"table": exc.table, "watermark": exc.watermark, "column": exc.column or ""})
        metadata: dict[str, Any] = {"table": obj.channel.table, "reason": reason.value}
        if isinstance(exc, ProgressMissing):
            metadata["topic_watermark"] = exc.topic_watermark
        return Failure(description=str(exc), allow_retries=False, metadata=metadata)

    @staticmethod
    def slice_metadata(obj: TableSlices, result: PublishResult) -> dict[str, Any]:
        return {
            "already_committed": result.already_committed,
            "status": MetadataValue.text("already committed: published nothing" if result.already_committed
                                         else "published"),
            **progress_metadata(result.progress),
            "duration_s": round(result.duration_s, 3),
            "rows_per_s": round(result.rows_per_s, 1),
            "bytes_per_s": round(result.bytes_per_s, 1),
            "transactional_id": obj.channel.transactional_id,
        }

    def load_input(self, context: InputContext) -> "DataFrame":
        """The published messages of the upstream slice(s), read_committed and bounded by recorded offsets."""
        import pandas as pd  # for start-up time: loaded on first use

        upstream = context.upstream_output
        meta = upstream.definition_metadata if upstream is not None else {}
        missing = [k for k in CHANNEL_METADATA if k not in meta]
        if missing:
            raise Failure(f"upstream asset has no rowrelay channel metadata {missing}")
        channel = TableChannel(table=meta[CHANNEL_TABLE], topic=meta[CHANNEL_TOPIC],
                               progress_topic=meta[CHANNEL_PROGRESS_TOPIC],
                               transactional_id=meta[CHANNEL_TRANSACTIONAL_ID],
                               start_after=int(meta[CHANNEL_START_AFTER]))
        keys = context.asset_partition_keys if context.has_asset_partitions else []
        if not keys:
            raise Failure("load_input reads published slices: select at least one partition")
        rows: list[dict[str, Any]] = []
        conf = self.kafka_conf()
        for key in keys:
            # A slice's own record, or for a roll-up key the records of the slices it spans, in order; the part of a
            # slice a reset back kept, for the partition the reset left.
            tiles = pieces_in_range(conf, channel, SliceRange.from_key(key))
            if not tiles:
                raise Failure(f"{channel.table}: slice {key} has not been published (no progress record)")
            for tile in tiles:
                for msg in read_piece_messages(conf, tile):
                    headers = dict(msg.headers() or [])
                    rows.append({"slice": key, "partition": msg.partition(), "offset": msg.offset(),
                                 "key": msg.key().decode() if msg.key() is not None else None,
                                 "value": msg.value().decode(),
                                 "watermark": int(headers[WATERMARK_HEADER])})
        frame = pd.DataFrame(rows, columns=["slice", "partition", "offset", "key", "value", "watermark"])
        return self.spark.get_session().createDataFrame(frame)
