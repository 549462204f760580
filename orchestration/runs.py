"""Runs of slices: the run requests a cut makes (one partition or a range), the slices a run targets (its tags), and
what a run's stop reason asks of the operator."""

import time
from dataclasses import dataclass
from typing import Any

from dagster import DagsterRunStatus, RunRequest
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
    PARTITION_NAME_TAG,
)

from resources.config import TableConfig
from resources.keys import RESUME_TAG, STOPPED_TAG
from resources.slices import SliceRange, watermark_text
from resources.stops import ADVICE, StopReason

# The statuses of a run that still holds its table: queued or running.
ACTIVE = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
          DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]

def run_slices(tags: dict[str, str]) -> tuple[SliceRange, SliceRange] | None:
    """The first and last slice a run targets, from its partition tags (one partition or a range)."""
    if PARTITION_NAME_TAG in tags:
        only = SliceRange.from_key(tags[PARTITION_NAME_TAG])
        return only, only
    if ASSET_PARTITION_RANGE_START_TAG in tags and ASSET_PARTITION_RANGE_END_TAG in tags:
        return (SliceRange.from_key(tags[ASSET_PARTITION_RANGE_START_TAG]),
                SliceRange.from_key(tags[ASSET_PARTITION_RANGE_END_TAG]))
    return None


def slices_request(slices: list[SliceRange], run_key: str | None, tags: dict[str, str] | None = None,
                   job_label: str | None = None) -> RunRequest:
    """One run for consecutive slices: a single partition, or a partition range (one worker for all).
    `job_label`: the job, for a sensor of several tables (its run keys then carry the job too)."""
    tags = {**slice_tags(slices[0]), **(tags or {})}
    if job_label is not None and run_key is not None:
        run_key = f"{job_label}:{run_key}"
    if len(slices) == 1:
        return RunRequest(partition_key=slices[0].key, run_key=run_key, tags=tags, job_name=job_label)
    return RunRequest(run_key=run_key, job_name=job_label, tags={**tags, ASSET_PARTITION_RANGE_START_TAG: slices[0].key,
                                                                 ASSET_PARTITION_RANGE_END_TAG: slices[-1].key})


def batched_requests(slices: list[SliceRange], max_per_run: int, job_label: str | None = None) -> list[RunRequest]:
    groups = [slices[i:i + max_per_run] for i in range(0, len(slices), max_per_run)]
    return [slices_request(g, run_key=g[0].key if len(g) == 1 else f"{g[0].key}...{g[-1].key}", job_label=job_label)
            for g in groups]


def stalled_slice(records: list[Any], chain: list[SliceRange], committed_hi: int, max_per_run: int = 1,
                  job_label: str | None = None) -> RunRequest | None:
    """Self-healing: re-request the first uncommitted slice (and the ones after it, up to `max_per_run`) if no
    run covering it is active (retries exhausted, worker lost, daemon restarted). `chain`: the uncommitted
    slices that continue Kafka's progress, in order (resources/slices.py `reconcile`); `records`: the recent runs
    of its first slice (`runs_of_slice`)."""
    if not chain or chain[0].lo != committed_hi:
        return None
    group = chain[:max_per_run]
    if any(r.dagster_run.status in ACTIVE for r in records):
        return None
    ended = max((r.end_time or 0.0 for r in records), default=0.0)
    # A slice stopped by bad input (a row too large, a source error, fenced) is retried with a growing backoff,
    # capped at a minute so the table recovers soon after the cause is fixed; one that failed transiently
    # (worker killed, broker away, retries exhausted) is resumed soon.
    stopped = sum(1 for r in records if r.dagster_run.tags.get(STOPPED_TAG))  # empty: a cleared copy
    # 15 s: time for the run-retry daemon to queue its own retry, which would make a resume a wasted run.
    wait = min(60.0, 5.0 * 2 ** min(stopped - 1, 4)) if stopped else 15.0
    if records and time.time() - ended < wait:
        return None
    return slices_request(group, run_key=f"{group[0].key}#resume-{len(records)}", tags={RESUME_TAG: "true"},
                          job_label=job_label)


def slice_tags(slice_range: SliceRange) -> dict[str, str]:
    """Lower slices first in the run queue; a retried run keeps its tags, so it keeps its place."""
    return {"dagster/priority": str(-slice_range.lo)}


def last_stop_reason(records: list[Any]) -> str | None:
    """Why the latest of a slice's runs (`runs_of_slice`) was stopped (STOPPED_TAG), if it was."""
    return (records[0].dagster_run.tags.get(STOPPED_TAG) or None) if records else None




@dataclass
class RunsVerdict:
    """What a table's runs mean for its tick: a resume to request, a reason to wait (no cut), or neither (cut).
    `resplit`: the first uncommitted slice timed out, so the cut deletes and re-cuts the uncommitted slices."""

    resume: RunRequest | None = None
    wait: str | None = None
    resplit: bool = False


def runs_verdict(table: TableConfig, chain: list[SliceRange], committed_hi: int, active: int, slice_runs: list[Any],
                 job_label: str | None) -> RunsVerdict:
    """The tick's decision from the table's runs: `active` queued or running, `slice_runs` the recent runs of the
    first uncommitted slice (`chain[0]`)."""
    resplit = bool(chain) and not active and last_stop_reason(slice_runs) == StopReason.TIMED_OUT
    # Self-healing: the first uncommitted slice has no run (retries exhausted, worker lost) while later ones
    # may be queued; without this they would fail "out of order" and retry forever.
    resume = None if resplit else stalled_slice(slice_runs, chain, committed_hi, table.max_slices_per_run,
                                                job_label=job_label)
    if resume is not None:
        return RunsVerdict(resume=resume)
    if active > 1 or (active and chain):
        # Cut only when the table's runs have drained: slices then grow (up to slice_max_rows) to fill the
        # time a run takes, instead of the queue growing without bound. One run whose slices Kafka already
        # has is only finishing (its checks): the next slice may queue behind it in the table's pool.
        return RunsVerdict(wait=f"{active} run(s) of {table.table_id} still queued or running")
    if chain and not resplit:
        # Slices cut earlier are not committed yet (a retry about to be queued, a slice stopped by bad
        # input): new slices would only fail "out of order" behind them.
        waiting = (f"{table.table_id}: slices after {watermark_text(committed_hi, chain[0].timestamps)} are not "
                   "committed yet")
        reason = last_stop_reason(slice_runs)
        if reason is None:
            return RunsVerdict(wait=f"{waiting}; waiting for their runs (or a resume)")
        return RunsVerdict(wait=f"{waiting}: run {slice_runs[0].dagster_run.run_id} stopped ({reason}); "
                                f"{ADVICE.get(reason, 'see the run')}. Resumed with a backoff (up to a minute)")
    return RunsVerdict(resplit=resplit)
