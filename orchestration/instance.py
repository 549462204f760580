"""The Dagster-instance calls about runs and pools: run queries and verdicts (cancel, fail), the tables' pools, job
names and first runs. The sensors, the compaction and the CLI ask the instance through here; the partition keys'
storage calls (private Dagster APIs among them) and the compaction note are orchestration/compaction.py's."""

import os
import socket
import time
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from dagster import DagsterInstance, DagsterRun, DagsterRunStatus, RunsFilter

from assets.identity import asset_key
from assets.worker import local_worker_pid
from orchestration.runs import ACTIVE, run_slices
from resources.cache import KeptAnswers
from resources.config import TableConfig
from resources.identity import DagsterNames
from resources.slices import SliceRange, watermark_text


def job_name(table: TableConfig) -> str:
    return DagsterNames.of(table).job


def queued_or_running(instance: DagsterInstance, job_name: str | None) -> list[DagsterRun]:
    """The queued or running runs of a job (None: of every job)."""
    return list(instance.get_runs(RunsFilter(job_name=job_name, statuses=ACTIVE)))


def queued_or_running_count(instance: DagsterInstance, job_name: str) -> int:
    return instance.get_runs_count(RunsFilter(job_name=job_name, statuses=ACTIVE))


def runs_of_slice(instance: DagsterInstance, job_name: str, first: SliceRange) -> list[Any]:
    """Recent run records (newest first) whose slices include `first`."""
    return [r for r in instance.get_run_records(RunsFilter(job_name=job_name), limit=200)
            if (span := run_slices(dict(r.dagster_run.tags))) is not None and span[0].lo <= first.lo <= span[1].lo]


def cancel_committed_runs(instance: DagsterInstance, job_name: str, committed_hi: int) -> list[str]:
    """Cancel queued sensor runs (and their retries) whose slices Kafka already has: they would publish nothing
    but still cost a worker start each, serialized by the table's pool. Backfills and UI launches are left
    alone: someone asked for them."""
    canceled = []
    for run in instance.get_runs(RunsFilter(job_name=job_name, statuses=[DagsterRunStatus.QUEUED])):
        span = run_slices(dict(run.tags))
        if span is None or "dagster/sensor_name" not in run.tags or "dagster/backfill" in run.tags:
            continue
        if span[1].hi <= committed_hi:
            upto = watermark_text(committed_hi, span[1].timestamps)
            instance.report_run_canceled(run, f"slices up to {upto} are already committed in Kafka; "
                                              "canceled by the table's sensor (nothing to publish)")
            canceled.append(run.run_id)
    return canceled


def fail_dead_runs(instance: DagsterInstance, job_name: str, active: list[Any] | None = None) -> list[str]:
    """Mark STARTED runs whose worker process is gone as failed, so run retries and the sensor move on.

    Only for a run launcher with no worker health check (Dagster's DefaultRunLauncher): there a worker killed by
    SIGKILL or the OOM killer would leave its run STARTED forever and hold the table's pool. rowrelay's
    WarmRunLauncher (and Dagster's container launchers) report worker health, and Dagster's run monitoring
    fails such runs itself. Only workers on this host are judged.
    """
    if instance.run_launcher.supports_check_run_worker_health:
        return []
    failed: list[str] = []
    host = socket.gethostname()
    started = ([r for r in active if r.status == DagsterRunStatus.STARTED] if active is not None else
               instance.get_runs(RunsFilter(job_name=job_name, statuses=[DagsterRunStatus.STARTED])))
    for run in started:
        pid = local_worker_pid(run)  # a retry's pid copied from its parent, or another namespace's: not judged
        if pid is None or pid_alive(pid):
            continue
        instance.report_run_failed(run, f"run worker pid {pid} is gone (killed?); marked failed by {host}")
        failed.append(run.run_id)
    return failed


def cancel_unstartable_runs(instance: DagsterInstance, partitions_name: str, active: list[Any], grace_s: float
                            ) -> list[str]:
    """Cancel runs left NOT_STARTED past `grace_s` whose slices no longer exist.

    Dagster's retry of a run whose slices were deleted (by hand in the UI, or cut again by this sensor when they
    no longer continued Kafka's progress) is created but can never be queued ("Nonexistent partition keys"); run
    monitoring failed it only after its start timeout (120 s), the next retry the same way, five times: the table
    counted them as active and waited ~10 minutes. A canceled run is not retried; the sensor
    requests the slices as they are now under new runs."""
    unstarted = [r.run_id for r in active if r.status == DagsterRunStatus.NOT_STARTED]
    if not unstarted:
        return []
    canceled = []
    for record in instance.get_run_records(RunsFilter(run_ids=unstarted)):
        run = record.dagster_run
        span = run_slices(dict(run.tags))
        if span is None or time.time() - record.create_timestamp.timestamp() < grace_s:
            continue
        gone = [s.key for s in dict.fromkeys(span)
                if not instance.has_dynamic_partition(partitions_name, s.key)]
        if gone:
            instance.report_run_canceled(
                run, f"slice(s) {gone} of this run no longer exist (deleted by hand, or cut again from Kafka's "
                     "progress): it can never start; canceled by the table's sensor, which requests the table's "
                     "slices as they are now under new runs")
            canceled.append(run.run_id)
    return canceled


def has_key(instance: DagsterInstance, partitions_name: str, key: str) -> bool:
    return instance.has_dynamic_partition(partitions_name, key)


def delete_key(instance: DagsterInstance, partitions_name: str, key: str) -> None:
    instance.delete_dynamic_partition(partitions_name, key)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by another user
    return True


POOL_CHECK_S = 600.0
_POOLS_SEEN: KeptAnswers[tuple[str, str], bool] = KeptAnswers(ttl_s=POOL_CHECK_S)


def ensure_pool(instance: DagsterInstance, pool: str, *, cached: bool = False) -> None:
    """Give the table's pool its limit of 1 before any run of it is queued.

    Dagster creates a pool's default limit lazily, in the same pass that first sees its queued runs, and
    that pass does not enforce it: two runs of one table could start together.
    `cached`: checked at most every POOL_CHECK_S per process and storage (the check is ~35 ms, a third of an idle
    tick); the pool is made before the table's first cut, and a limit once set stays.
    """
    storage = instance.event_log_storage
    key = (repr(instance.get_ref().event_storage_data), pool)
    if cached and _POOLS_SEEN.get(key):
        return
    if pool not in storage.get_concurrency_keys():
        storage.set_concurrency_slots(pool, 1)
    _POOLS_SEEN.keep(key, True)


def table_active_runs(instance: DagsterInstance, table: TableConfig, job_name: str) -> int:
    """The table's queued or running runs: of its job, or any run whose asset selection holds the table's asset
    (the UI's Materialize launches `__ASSET_JOB`)."""
    return len(runs_of_table(instance.get_runs(RunsFilter(statuses=ACTIVE)), table, job_name))


def runs_of_table(runs: Iterable[DagsterRun], table: TableConfig, job_name: str) -> list[DagsterRun]:
    """The runs among `runs` that materialize the table: of its job, or whose asset selection holds its asset."""
    key = asset_key(table)
    return [run for run in runs if run.job_name == job_name or key in (run.asset_selection or ())]


def table_runs_active(instance: DagsterInstance, table: TableConfig, job_name: str) -> bool:
    """Whether a run of the table is queued or running (`table_active_runs`). A roll-up deletes the keys such a run
    targets."""
    return table_active_runs(instance, table, job_name) > 0


def first_run_at(instance: DagsterInstance, table: TableConfig) -> datetime | None:
    """When the table's first run was created: a table that never committed has had rows waiting since (at
    least) then. None without runs."""
    records = instance.get_run_records(RunsFilter(job_name=job_name(table)), limit=1, ascending=True)
    return records[0].create_timestamp if records else None


