"""Faults on the services a relay step's runs depend on, each in a world with one of its own, never the shared
stack's: the Spark Connect server SIGKILLed mid-run and started again (a private server, stack/local.py's command
on a free port and a scratch directory), and the Dagster daemon SIGKILLed with its process group (its code server
and the run workers it forked) mid-run and started again (the world's own daemon, on the world's instance: a relay
step then is the daemon's, its table's sensor cutting and its launcher running)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from resources.config import TableConfig
from tests.explorer.faults import FaultRecord, committed_hi, service_mid_run, slice_hi
from tests.pipeline import ROOT, Harness
from tests.private_servers import free_port


@dataclass
class PrivateSpark:
    """A Spark Connect server of the world's own: executors on local[2], its state and log under `base`."""

    base: Path
    port: int
    process: subprocess.Popen | None = None

    @property
    def remote(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    def start(self) -> None:
        from stack.local import start_spark_connect

        self.process = start_spark_connect(self.base, self.port, "local[2]")

    def kill(self) -> None:
        """SIGKILL its process group (spark-submit and the JVM it runs): as a crash, nothing shut down."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(60)
        self.process = None


@contextlib.contextmanager
def private_spark() -> Iterator[PrivateSpark]:
    base = Path(tempfile.mkdtemp(prefix="rowrelay-spark-"))
    spark = PrivateSpark(base, free_port())
    try:
        spark.start()
        yield spark
    finally:
        spark.kill()
        shutil.rmtree(base, ignore_errors=True)


def spark_mid_run(h: Harness, table: TableConfig, key: str, spark: PrivateSpark, after_s: float, down_s: float,
                  stage: str | None = None) -> tuple[FaultRecord, list[str]]:
    """The run started; `after_s` later (or while it is frozen at publisher `stage`, see schedule.SPARK_STAGES) the
    private Spark Connect server is SIGKILLed, and `down_s` after that started again on the same port. The run may
    fail (the explorer's retry runs it again) or ride it out."""
    def restart() -> None:
        spark.kill()
        time.sleep(down_s)
        spark.start()

    return service_mid_run(h, table, key, "spark_kill", after_s, down_s, restart, stage)


def daemon_instance_settings(storage: dict[str, Any]) -> str:
    """The world's dagster.yaml when a daemon runs on it: the fault suite's (queued runs, run retries, run
    monitoring, a pool per table, rowrelay's warm launcher)."""
    from tests.test_faults import DAGSTER_YAML, LAUNCHERS

    return DAGSTER_YAML.format(storage=yaml.safe_dump({"storage": storage}), launcher=LAUNCHERS["warm"])


def write_workspace(home: Path) -> None:
    (home / "workspace.yaml").write_text(yaml.safe_dump({"load_from": [{"python_module": {
        "module_name": "orchestration.definitions", "working_directory": str(ROOT)}}]}))


def _daemon(h: Harness) -> Any:
    """The fault suite's daemon handle (tests/test_faults.py FaultPipeline) on the world's instance and config."""
    from tests.test_faults import FaultPipeline

    home = Path(h.instance.root_directory)
    return FaultPipeline(None, h.config, home, h.config_file(), {})  # type: ignore[arg-type]


def _run_key(run: Any) -> str:
    from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, PARTITION_NAME_TAG

    return run.tags.get(PARTITION_NAME_TAG) or run.tags.get(ASSET_PARTITION_RANGE_END_TAG, "-")


def _table_worker(h: Harness, daemon: Any, table: TableConfig, timeout: float) -> Any:
    """A STARTED run of `table`'s job whose warm worker is alive, waited for up to `timeout` s; None if none."""
    from orchestration.factory import job_name

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for worker in daemon.warm_workers():
            run = h.instance.get_run_by_id(worker["run_id"])
            if run is not None and run.job_name == job_name(table):
                return run
        time.sleep(0.2)
    return None


def daemon_mid_run(h: Harness, table: TableConfig, top: int, after_s: float, down_s: float,
                   catch_up_s: float = 90.0) -> tuple[FaultRecord, list[str]]:
    """The world's daemon started; `after_s` into the first run of `table` it launches, its process group is
    SIGKILLed, and `down_s` later it is started again and given `catch_up_s` to bring the table's committed progress
    up to `top`; then stopped (the explorer's own relay steps, and its check, go on from wherever it got)."""
    if committed_hi(h, table) >= top:
        return FaultRecord(table.table_id, "-", "daemon_kill", "-", "not injected: nothing to relay", False), []
    daemon = _daemon(h)
    daemon.start_daemon()
    try:
        run = _table_worker(h, daemon, table, 60)
        if run is None:
            return FaultRecord(table.table_id, "-", "daemon_kill", "-",
                               f"not injected: the daemon started no run of the table in 60 s ({daemon.log})",
                               False), []
        key = _run_key(run)
        time.sleep(after_s)
        committed_before = key != "-" and committed_hi(h, table) >= slice_hi(key)
        status = h.instance.get_run_by_id(run.run_id).status.value  # type: ignore[union-attr]
        daemon.kill_daemon()
        time.sleep(down_s)
        daemon.start_daemon()
        started = time.monotonic()
        while committed_hi(h, table) < top and time.monotonic() - started < catch_up_s:
            time.sleep(1)
        caught = committed_hi(h, table) >= top
        stage = ("after its commit" if committed_before else "mid-run, before its commit") + f" (run {status})"
        outcome = (f"daemon down {down_s} s; {'caught the table up' if caught else 'had not caught the table up'} "
                   f"in {round(time.monotonic() - started)} s after its restart")
        return FaultRecord(table.table_id, key, "daemon_kill", stage, outcome,
                           not committed_before and status == "STARTED"), []
    finally:
        daemon.stop_daemon()
