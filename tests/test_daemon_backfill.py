"""`dagster job backfill` through the daemon's queue, on the same daemon-driven pipeline as the fault suite
(tests/test_faults.py). Not a fault, so it runs in `make test` and keeps the fault suite's time for faults."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from tests.conftest import Services
from tests.test_faults import ROOT, FaultPipeline, fault_pipeline

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pipeline(services: Services, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultPipeline]:
    """The fault suite's daemon-driven pipeline with the one table this test backfills: the other three tables'
    sensors, runs and writers only added work beside the other pytest worker."""
    with fault_pipeline(services, tmp_path_factory, ("orders",)) as p:
        yield p


def test_cli_backfill_keeps_order_and_respects_the_pool(pipeline: FaultPipeline) -> None:
    """`dagster job backfill` over a table's last slices, through the daemon's queue: runs never overlap
    (pool limit 1) and re-running committed slices publishes nothing."""
    from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter

    from assets.identity import channel_for
    from orchestration.factory import job_name
    from resources.exactly_once import read_committed_progress
    from resources.slices import SliceRange
    from tests.pipeline import polled

    table = pipeline.config.tables[0]
    with DagsterInstance.from_config(str(pipeline.home)) as instance:
        if len(instance.get_dynamic_partitions(f"{table.dagster_name}__slices")) < 2:  # run alone: make slices
            time.sleep(10)
            pipeline.catch_up_and_verify("before backfill", faults=0)
    for w in pipeline.writers:
        w.pause_writes()
    with DagsterInstance.from_config(str(pipeline.home)) as instance:
        keys = list(instance.get_dynamic_partitions(f"{table.dagster_name}__slices"))[-2:]
    # Both committed before the backfill (the last may still be the sensor's run in flight): re-runs of them.
    conf = {"bootstrap.servers": pipeline.services.kafka_bootstrap}
    last = SliceRange.from_key(keys[-1])
    progress = polled(lambda: read_committed_progress(conf, channel_for(table, PREFIX)),
                      lambda p: p is not None and p.hi >= last.hi, 120)
    assert progress is not None and progress.hi >= last.hi, (progress, last)
    with DagsterInstance.from_config(str(pipeline.home)) as instance:
        before = {r.run_id for r in instance.get_runs(RunsFilter(job_name=job_name(table)))}
    res = subprocess.run([sys.executable, "-m", "dagster", "job", "backfill", "-j", job_name(table), "--from", keys[0],
                          "--to", keys[-1], "--noprompt", "-w", str(pipeline.home / "workspace.yaml")],
                         cwd=ROOT, env=pipeline.env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    deadline = time.monotonic() + 240
    with DagsterInstance.from_config(str(pipeline.home)) as instance:
        while True:
            records = [r for r in instance.get_run_records(RunsFilter(job_name=job_name(table)))
                       if r.dagster_run.run_id not in before and "dagster/backfill" in r.dagster_run.tags]
            finished = [r for r in records if r.end_time is not None]
            if len(records) >= len(keys) and len(finished) == len(records):
                break
            states = [r.dagster_run.status for r in records]
            assert time.monotonic() < deadline, f"backfill runs did not finish: {states}"
            time.sleep(2)
        spans = sorted((r.start_time, r.end_time) for r in records)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), f"runs overlapped: {spans}"
        assert {r.dagster_run.tags["dagster/partition"] for r in records} == set(keys)
        assert all(r.dagster_run.status == DagsterRunStatus.SUCCESS for r in records), \
            [r.dagster_run.status for r in records]
        # Each re-run found its slice committed and published nothing (not: published it again, deduplicated).
        for r in records:
            mats = [e.asset_materialization for e in instance.get_records_for_run(
                r.dagster_run.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records]
            assert mats and all(m.metadata["already_committed"].value is True for m in mats if m is not None), mats
    pipeline.catch_up_and_verify("CLI backfill of committed slices (publishes nothing)", faults=0)
