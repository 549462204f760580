"""Faults on a relay step's run, each recorded: which stage of which run it hit, and whether it disrupted anything.

A run is `dagster asset materialize` of the slice (tests/pipeline.py Harness.cli_command), the run worker in a
process of its own; the publisher's failpoints (resources/exactly_once.py env_failpoint) stop it at a stage.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from orchestration.launcher import process_start_ticks
from resources.config import TableConfig
from tests.pipeline import ROOT, Harness


@dataclass
class FaultRecord:
    table: str
    run: str  # the slice key (or range) of the run the fault hit
    fault: str
    stage: str  # the publisher stage it was injected at, or where an early kill found the run
    outcome: str  # what happened to the faulted run
    disrupted: bool  # False: the fault changed nothing (its run had already committed, or never got that far)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# A publisher frozen at these stages holds a fenced epoch and a stale view of progress: resumed after a newer one
# took over, it must stop as fenced (at `initialized` it reads progress only after resuming and finds the slice
# committed; at `committed` its own commit had landed).
MUST_STOP_FENCED = ("progress_read", "begun", "rows_produced", "flushed", "before_commit")


def record_name(args: dict[str, Any]) -> str:
    """What the record of a drawn fault calls it, injected or not."""
    fault = args["fault"]
    if fault == "broker":
        return "broker_kill" if args["kill"] else "broker_restart"
    return {"spark": "spark_kill", "daemon": "daemon_kill"}.get(fault, fault)


def committed_hi(h: Harness, table: TableConfig) -> int:
    progress = h.progress(table)
    return progress.hi if progress else 0


def slice_hi(key: str) -> int:
    from resources.slices import SliceRange

    return SliceRange.from_key(key.split("...")[-1]).hi


def ended_within(proc: subprocess.Popen, timeout: float) -> bool:
    """Waits for `proc`; SIGKILLs it if it has not ended within `timeout` s. True if it ended on its own."""
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False


def frozen(proc: subprocess.Popen, timeout: float = 300) -> bool | None:
    """Waits until `proc` stops itself (SIGSTOP, at a `stop:` failpoint): True, or False if it ended first; None
    (it is SIGKILLed) if neither happened within `timeout` s."""
    deadline = time.monotonic() + timeout
    while (state := process_start_ticks(proc.pid)) and state[1] != "T" and proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            return None
        time.sleep(0.1)
    return proc.poll() is None


def kill_at_stage(h: Harness, table: TableConfig, key: str, stage: str) -> FaultRecord:
    """The run SIGKILLs itself at `stage`."""
    result = h.run_cli(table, key, env={"ROWRELAY_FAILPOINT": stage})
    committed = committed_hi(h, table) >= slice_hi(key)
    if result.returncode != -signal.SIGKILL:
        return FaultRecord(table.table_id, key, "kill", stage, f"stage not reached (exit {result.returncode})",
                           False)
    return FaultRecord(table.table_id, key, "kill", stage,
                       "killed after its commit landed" if committed else "killed; slice left uncommitted",
                       not committed)


def freeze_then_takeover(h: Harness, table: TableConfig, key: str, stage: str) -> tuple[FaultRecord, list[str]]:
    """The run freezes itself (SIGSTOP) at `stage`; a new run of the same slice takes over and must succeed; the
    frozen one resumes and must not publish again. Returns the record and any problem seen."""
    log = h.instance.root_directory + f"/zombie-{time.monotonic_ns()}.log"
    with open(log, "wb") as out:  # a file, not a pipe: a full pipe would block the zombie early
        zombie = subprocess.Popen(h.cli_command(table, key), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                  env=h.cli_env({"ROWRELAY_FAILPOINT": f"stop:{stage}"}))
    if frozen(zombie) is None:
        return FaultRecord(table.table_id, key, "freeze_takeover", stage, "never froze in 300 s", True), [
            f"run {key} neither froze at {stage} nor ended in 300 s"]
    if zombie.poll() is not None:
        return FaultRecord(table.table_id, key, "freeze_takeover", stage,
                           f"stage not reached (exit {zombie.returncode})", False), []
    committed_before = committed_hi(h, table) >= slice_hi(key)
    newer = h.run_cli(table, key)
    problems = [] if newer.success else [f"takeover run of {key} failed: {newer.output[-1500:]}"]
    os.kill(zombie.pid, signal.SIGCONT)
    if not ended_within(zombie, 300):
        problems.append(f"frozen run of {key} did not end within 300 s of its SIGCONT")
    text = Path(log).read_text(errors="replace")
    fenced = "fenced" in text.lower() or "another publisher took over" in text or "PRODUCER_FENCED" in text
    if stage in MUST_STOP_FENCED and not (zombie.returncode != 0 and fenced):
        problems.append(f"run of {key} frozen at {stage}, resumed after a takeover, did not stop as fenced "
                        f"(exit {zombie.returncode}): {text[-1500:]}")
    outcome = (f"frozen, taken over, resumed: exit {zombie.returncode}{' (fenced)' if fenced else ''}"
               + ("; its commit had landed before the freeze" if committed_before else ""))
    return FaultRecord(table.table_id, key, "freeze_takeover", stage, outcome, not committed_before), problems


def kill_early(h: Harness, table: TableConfig, key: str, after_s: float) -> FaultRecord:
    """The run's process SIGKILLed `after_s` seconds after it started: before RUN_START or after it, as it falls;
    the record says which (the run's status in the Dagster instance when it was killed)."""
    from dagster import RunsFilter

    before = {r.run_id for r in h.instance.get_runs(limit=20)}
    proc = subprocess.Popen(h.cli_command(table, key), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=h.cli_env())
    try:
        proc.wait(timeout=after_s)
        return FaultRecord(table.table_id, key, "kill_early", "ended before the kill", f"exit {proc.returncode}",
                           False)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    new = [r for r in h.instance.get_runs(RunsFilter(), limit=20) if r.run_id not in before]
    started = new and new[0].status.value not in ("NOT_STARTED", "STARTING", "QUEUED")
    stage = (f"{'after' if started else 'before'} RUN_START (run {new[0].status.value})" if new
             else "before RUN_START (no run record yet)")
    committed = committed_hi(h, table) >= slice_hi(key)
    return FaultRecord(table.table_id, key, "kill_early", stage,
                       f"killed {after_s} s after its start", not committed)


def restart_broker(broker: Any, kill: bool, down_s: float) -> None:
    """The private broker stopped (SIGKILL, or SIGTERM: a clean shutdown) and started again on its data directory
    after `down_s` seconds; waits until it answers. Never the shared stack's broker."""
    from stack.local import kafka_classpath, kafka_ready
    from tests.private_kafka import JVM_OPTIONS

    process = broker.process
    process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
    ended_within(process, 60)
    time.sleep(down_s)
    base = broker.log.parent  # private_kafka keeps its properties beside its log
    with open(broker.log, "ab") as out:
        broker.process = subprocess.Popen(
            ["java", *JVM_OPTIONS, f"-Dlog4j2.configurationFile={base / 'log4j2.properties'}", "-cp",
             kafka_classpath(), "kafka.Kafka", str(base / "server.properties")],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180
    while not kafka_ready(broker.port):
        assert broker.process.poll() is None, f"the private broker did not restart:\n{broker.log_tail()}"
        assert time.monotonic() < deadline, f"the private broker not ready 180 s after its restart:\n" \
                                            f"{broker.log_tail()}"
        time.sleep(0.5)


def broker_mid_run(h: Harness, table: TableConfig, key: str, broker: Any, after_s: float, kill: bool,
                   down_s: float) -> tuple[FaultRecord, list[str]]:
    """The run started; `after_s` later the broker is stopped (SIGKILL or SIGTERM), `down_s` after that started
    again."""
    return service_mid_run(h, table, key, "broker_kill" if kill else "broker_restart", after_s, down_s,
                           lambda: restart_broker(broker, kill, down_s))


def service_mid_run(h: Harness, table: TableConfig, key: str, fault: str, after_s: float, down_s: float,
                    disrupt: Callable[[], None], stage: str | None = None) -> tuple[FaultRecord, list[str]]:
    """The run started; `after_s` later (or, given a publisher `stage`, once the run froze itself there) `disrupt`
    stops a service it uses and starts it again (then a frozen run resumes). The run may fail or ride it out;
    either way nothing may be lost or doubled (the oracle's check). The record says whether the run was still
    before its commit when the service went."""
    log = h.instance.root_directory + f"/{fault}-{time.monotonic_ns()}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(h.cli_command(table, key), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env=h.cli_env({"ROWRELAY_FAILPOINT": f"stop:{stage}"} if stage else None))
    if stage is not None and not frozen(proc):
        return FaultRecord(table.table_id, key, fault, f"at {stage}", f"stage not reached (exit {proc.returncode})",
                           False), []
    if stage is None:
        try:
            proc.wait(timeout=after_s)
            return FaultRecord(table.table_id, key, fault, "ended before the service stopped",
                               f"exit {proc.returncode}", False), []
        except subprocess.TimeoutExpired:
            pass
    committed_before = committed_hi(h, table) >= slice_hi(key)
    disrupt()
    if stage is not None:
        os.kill(proc.pid, signal.SIGCONT)
    problems = [] if ended_within(proc, 300) else [f"run of {key} did not end within 300 s of the {fault}"]
    where = f"frozen at {stage}" if stage else f"{after_s} s in"
    when = "after its commit" if committed_before else "mid-run, before its commit"
    return FaultRecord(table.table_id, key, fault, f"{when} ({where})", f"down {down_s} s; the run's exit "
                       f"{proc.returncode}", not committed_before), problems
