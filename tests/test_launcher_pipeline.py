"""The warm run launcher (orchestration/launcher.py) under a real `dagster-daemon` on the real pipeline: one
PostgreSQL table relayed to Kafka by runs forked from its fork server (tests/test_faults.py's pipeline, with a
daemon of the test's own settings)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import text

from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from tests.conftest import Services
from tests.pipeline import read_topic
from tests.test_faults import FaultPipeline, fault_pipeline

pytestmark = pytest.mark.integration
HOLD_S = 10  # how long each worker is held between its go and RUN_START (ROWRELAY_FAILPOINT)
FAIL_WITHIN_S = 15  # issue 45: a run whose worker died before it started is failed within this


def wait_for(predicate: Any, timeout: float, what: str, log: Path | None) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert time.monotonic() < deadline, f"not {what} within {timeout}s; see {log}"
        time.sleep(0.2)
    return found


def committed_hi(p: FaultPipeline) -> int:
    from assets.identity import channel_for
    from resources.exactly_once import read_committed_progress

    progress = read_committed_progress({"bootstrap.servers": p.services.kafka_bootstrap},
                                       channel_for(p.config.tables[0], PREFIX))
    return progress.hi if progress else 0


def test_a_worker_killed_before_its_run_started_fails_the_run_at_once(
        services: Services, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Run monitoring asks a launcher about its workers only for STARTED runs: a worker SIGKILLed while its run was
    STARTING left the run (and the table's pool) to `start_timeout_seconds`, 120 s. The launcher watches the workers
    it forked: the run fails within seconds of the kill, and its retry publishes the slice once."""
    from dagster import DagsterInstance

    with fault_pipeline(services, tmp_path_factory, ("orders",), start=False) as p:
        dagster_yaml = p.home / "dagster.yaml"
        settings = yaml.safe_load(dagster_yaml.read_text())
        settings["run_monitoring"]["start_timeout_seconds"] = 120  # rowrelay's dagster.yaml: it must not be the one
        dagster_yaml.write_text(yaml.safe_dump(settings))
        p.start_daemon(env={**p.env, "ROWRELAY_FAILPOINT": f"sleep:worker_released:{HOLD_S}"})
        for w in p.writers:
            w.resume()
        worker = wait_for(lambda: p.warm_workers("STARTING"), 120, "a worker held before RUN_START", p.log)[0]
        for w in p.writers:
            w.pause_writes(settle=False)
        os.kill(worker["pid"], signal.SIGKILL)
        killed = time.monotonic()
        with DagsterInstance.from_config(str(p.home)) as instance:
            run = wait_for(lambda: (r := instance.get_run_by_id(worker["run_id"])) and r.is_finished and r,
                           FAIL_WITHIN_S + 5, f"run {worker['run_id']} failed after its worker's kill", p.log)
            failed_after = time.monotonic() - killed
            events = [e.message for e in instance.all_logs(worker["run_id"])]
        print(f"run failed {failed_after:.1f}s after its worker's kill")
        assert run.status.value == "FAILURE", events
        assert failed_after <= FAIL_WITHIN_S, f"failed {failed_after:.1f}s after the kill"
        assert any(e.startswith("Run worker exited before the run started") and f"(pid {worker['pid']})" in e
                   for e in events), events
        p.catch_up_and_verify("run worker SIGKILLed before its run started", faults=1)


def test_a_change_to_the_config_file_found_in_the_working_directory_reaches_the_next_run(
        services: Services, tmp_path_factory: pytest.TempPathFactory) -> None:
    """With ROWRELAY_CONFIG unset, the code location reads ./rowrelay.yaml, and the launcher watched only the file
    ROWRELAY_CONFIG names: runs kept the `where:` their fork server had loaded until the daemon restarted. The fork
    server now watches every file the code location read while loading."""
    with fault_pipeline(services, tmp_path_factory, ("orders",), start=False) as p:
        config = yaml.safe_load(p.config_file.read_text())
        config["tables"][0]["where"] = "v % 2 = 0"
        p.config_file.write_text(yaml.safe_dump(config))
        assert p.config_file == p.home / "rowrelay.yaml"
        p.start_daemon(cwd=p.home, env={k: v for k, v in p.env.items() if k != "ROWRELAY_CONFIG"})
        topic = p.config.tables[0].topic_name

        def insert_and_relay() -> list[int]:
            """20 rows (v 1..20): the ids of those relayed, once the table's progress covers them."""
            with p.engines["pg"].begin() as conn:
                ids = conn.execute(text("INSERT INTO orders (v) SELECT g FROM generate_series(1, 20) g "
                                        "RETURNING id")).scalars().all()
            wait_for(lambda: committed_hi(p) >= max(ids), 180, f"rows up to {max(ids)} relayed", p.log)
            return sorted(m.value["id"] for m in read_topic(services.kafka_bootstrap, topic) if m.value["id"] in ids)

        first = insert_and_relay()
        assert len(first) == 10, first  # v even only
        del config["tables"][0]["where"]  # widened: every row
        p.config_file.write_text(yaml.safe_dump(config))
        second = insert_and_relay()
        assert len(second) == 20, f"the run after the change still had the old `where:`: {second}"
