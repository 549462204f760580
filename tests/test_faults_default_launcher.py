"""The fault scenarios that do not depend on rowrelay's warm launcher, run under Dagster's DefaultRunLauncher:
each run in a fresh process started by the code server, nothing shared with the daemon's process. Kubernetes,
Docker and ECS launchers follow the same model (a run per pod or container), so this is the pass that says the
exactly-once guarantee does not lean on the warm launcher.

The daemon starts its own code server from `workspace.yaml`, so a killed daemon takes the code server and its
run workers with it, as a lost node would.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import yaml

from tests.conftest import Services
from tests.test_faults import (
    FaultPipeline,
    fault_pipeline,
    kill_daemon_mid_run,
    kill_workers_in_a_loop,
    restart_broker_mid_publish,
)

pytestmark = [pytest.mark.faults, pytest.mark.integration]


@pytest.fixture(scope="module")
def pipeline(services: Services, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultPipeline]:
    # Two tables, PostgreSQL and MariaDB: a fresh process per run costs seconds of imports on two cores, and
    # the warm pass covers SQLite and the timestamp watermark under the same faults.
    with fault_pipeline(services, tmp_path_factory, ("orders", "clicks"), launcher="default") as p:
        yield p


def test_the_instance_runs_on_dagsters_default_launcher(pipeline: FaultPipeline) -> None:
    settings = yaml.safe_load((pipeline.home / "dagster.yaml").read_text())
    assert "run_launcher" not in settings  # Dagster's DefaultRunLauncher
    pid = pipeline.wait_for_worker(timeout=180)
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read().replace(b"\0", b" ").decode()
    # Dagster's code server starts each run in a spawned interpreter; the warm launcher's workers are forks.
    assert "spawn_main" in cmdline, cmdline
    assert not pipeline.warm_workers(), "a run carries the warm launcher's record"


def test_run_workers_sigkilled_in_a_loop_under_the_default_launcher(pipeline: FaultPipeline) -> None:
    kill_workers_in_a_loop(pipeline, 6)


def test_broker_restarted_mid_publish_under_the_default_launcher(pipeline: FaultPipeline) -> None:
    restart_broker_mid_publish(pipeline)


def test_daemon_killed_and_restarted_under_the_default_launcher(pipeline: FaultPipeline) -> None:
    kill_daemon_mid_run(pipeline)
