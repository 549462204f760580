"""The table asset's checks: slice parity (progress record = source = Kafka) and lag, and the failure hook that
checks the slices a failed run committed."""

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from dagster import (
    AssetCheckEvaluation,
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetChecksDefinition,
    AssetCheckSeverity,
    HookContext,
    HookDefinition,
    asset_check,
    failure_hook,
)

from assets.identity import asset_key, channel_for, partitions_for
from assets.lag import CHECK_KAFKA_TIMEOUT_S, TableLag, measure_lag
from assets.records import last_recorded_slice
from assets.shape import table_shape
from resources.config import TableConfig
from resources.exactly_once import (
    ProgressMissing,
    ProgressRecord,
    PublishedSlice,
    read_back_slices,
    read_committed_progress,
    tiles_by_range,
)
from resources.identity import DagsterNames
from resources.keys import COMMITTED_BEFORE_FAILURE_TAG, RUN_FAILED_LATER
from resources.slices import SliceRange
from resources.source_database import SourceDatabaseResource

PARITY_CHECK = "slice_parity"
LAG_CHECK = "lag"


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
        # (a long-lived table has hundreds of thousands: reading them all would cost seconds per run).
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
    names = DagsterNames.of(table)
    source_key = names.source_resource_key

    @failure_hook(name=names.parity_hook,
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
    source_key = DagsterNames.of(table).source_resource_key
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
