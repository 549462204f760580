"""WarmRunLauncher (orchestration/launcher.py) on a real Dagster instance on PostgreSQL, with a real
`dagster-daemon` dequeuing runs, running monitoring and forking workers from its fork server. The code location
is a tiny test-only module under tmp_path (no rowrelay table: fast)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import create_engine, text

from orchestration.launcher import WORKER_TAG, process_start_ticks
from tests.conftest import Services, unique

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
LOCATION = "warm_launcher_test"
POLL_INTERVAL_S = 1  # run monitoring

JOBS = '''
import os
import time
from pathlib import Path

from dagster import Definitions, in_process_executor, job, op

OUT = Path({out!r})
VERSION = {version!r}


@op
def record_version(context) -> None:
    """What the test reads: which code ran, in which process."""
    (OUT / f"{{context.run_id}}.json").write_text(
        '{{"version": "%s", "pid": %d}}' % (VERSION, os.getpid()))


@op
def wait_for_release(context) -> None:
    """Runs until the test creates <run_id>.release (at most 60 s), so it can be killed or terminated."""
    (OUT / f"{{context.run_id}}.pid").write_text(str(os.getpid()))
    deadline = time.monotonic() + 60
    while not (OUT / f"{{context.run_id}}.release").exists():
        assert time.monotonic() < deadline, "never released"
        time.sleep(0.1)


@job
def quick():
    record_version()


@job
def slow():
    wait_for_release()


# In-process, as rowrelay's jobs: the ops run in the run worker itself.
defs = Definitions(jobs=[quick, slow], executor=in_process_executor)
'''


def dagster_yaml(services: Services, db: str, launcher: dict[str, Any] | None, queued: bool = True) -> str:
    config: dict[str, Any] = {
        "storage": services.dagster_storage(db),
        "run_monitoring": {"enabled": True, "start_timeout_seconds": 30, "poll_interval_seconds": POLL_INTERVAL_S},
        "telemetry": {"enabled": False},
    }
    # Queued: the daemon launches. Otherwise submit_run launches in the submitting process (measurements).
    config["run_coordinator"] = (
        {"module": "dagster.core.run_coordinator", "class": "QueuedRunCoordinator",
         "config": {"dequeue_interval_seconds": 1}} if queued else
        {"module": "dagster.core.run_coordinator", "class": "DefaultRunCoordinator"})
    if launcher is not None:
        config["run_launcher"] = launcher
    return yaml.safe_dump(config)


WARM_LAUNCHER = {"module": "orchestration.launcher", "class": "WarmRunLauncher",
                 # Only what the test location needs: keeps the fork server's warm-up short.
                 "config": {"preload_modules": ["dagster"]}}


@dataclass
class LauncherHome:
    """A DAGSTER_HOME with its PostgreSQL storage, the test code location and (optionally) a daemon."""

    home: Path
    out: Path
    module_file: Path
    db: str
    daemon: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "DAGSTER_HOME": str(self.home), "PYTHONPATH": str(ROOT)}

    def write_code(self, version: str) -> None:
        self.module_file.write_text(JOBS.format(out=str(self.out), version=version))

    def start_daemon(self) -> None:
        log = open(self.home / "daemon.log", "ab")  # noqa: SIM115 - owned by the daemon process
        self.daemon = subprocess.Popen([sys.executable, "-m", "dagster._daemon", "run", "-w",
                                        str(self.home / "workspace.yaml")], cwd=ROOT, env=self.env,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop_daemon(self) -> None:
        if self.daemon is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.daemon.pid, signal.SIGTERM)
        try:
            self.daemon.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.daemon.pid, signal.SIGKILL)
            self.daemon.wait(10)

    def log_tail(self) -> str:
        path = self.home / "daemon.log"
        return path.read_text()[-3000:] if path.exists() else ""


@contextlib.contextmanager
def launcher_home(services: Services, root: Path, launcher: dict[str, Any] | None,
                  queued: bool = True) -> Iterator[LauncherHome]:
    db = unique("dagster")
    admin = create_engine(services.pg_url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{db}"'))
    home, out, code = root / "home", root / "out", root / "code"
    for d in (home, out, code):
        d.mkdir(parents=True, exist_ok=True)
    module = unique("warm_jobs_")  # unique: a module cached by name in some process can never be mistaken
    h = LauncherHome(home, out, code / f"{module}.py", db)
    h.write_code("v1")
    (home / "dagster.yaml").write_text(dagster_yaml(services, db, launcher, queued))
    (home / "workspace.yaml").write_text(yaml.safe_dump({"load_from": [{"python_module": {
        "module_name": module, "working_directory": str(code), "location_name": LOCATION}}]}))
    try:
        yield h
    finally:
        h.stop_daemon()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
        admin.dispose()


class Client:
    """Creates and submits runs the way `dagster job launch` does, from a workspace of this test process."""

    def __init__(self, h: LauncherHome) -> None:
        from dagster import DagsterInstance
        from dagster._core.workspace.context import WorkspaceProcessContext
        from dagster._core.workspace.load_target import WorkspaceFileTarget

        self.h = h
        self._stack = contextlib.ExitStack()
        self.instance = self._stack.enter_context(DagsterInstance.from_config(str(h.home)))
        self.workspace = self._stack.enter_context(WorkspaceProcessContext(
            self.instance, WorkspaceFileTarget(paths=[str(h.home / "workspace.yaml")])))

    def close(self) -> None:
        self._stack.close()

    def submit(self, job: str) -> str:
        from dagster._cli.job import _create_run  # what `dagster job launch` calls to build a run

        ctx = self.workspace.create_request_context()
        location = ctx.get_code_location(LOCATION)
        repo = location.get_repository("__repository__")
        run = _create_run(instance=self.instance, code_location=location, remote_repo=repo,
                          remote_job=repo.get_full_job(job), run_config={}, tags=None, op_selection=None,
                          run_id=None)
        self.instance.submit_run(run.run_id, ctx)
        return run.run_id

    def wait(self, run_id: str, statuses: set[str], timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            run = self.instance.get_run_by_id(run_id)
            if run is not None and run.status.value in statuses:
                return run
            assert time.monotonic() < deadline, (
                f"run {run_id} is {run.status.value if run else None}, not {statuses}, after {timeout}s\n"
                f"{self.events(run_id)}\n{self.h.log_tail()}")
            time.sleep(0.2)

    def wait_for_file(self, path: Path, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while not path.exists() or not path.read_text():
            assert time.monotonic() < deadline, f"{path} not written in {timeout}s\n{self.h.log_tail()}"
            time.sleep(0.1)
        return path.read_text()

    def events(self, run_id: str) -> list[str]:
        return [f"{e.dagster_event.event_type_value if e.dagster_event else ''}: {e.message}"
                for e in self.instance.all_logs(run_id)]

    def launch_to_start_s(self, run_id: str) -> float:
        """From the launch (RUN_STARTING, reported just before launch_run) to the worker executing (RUN_START)."""
        from dagster import DagsterEventType

        stamps = {e.dagster_event.event_type: e.timestamp for e in self.instance.all_logs(run_id)
                  if e.dagster_event is not None}
        return stamps[DagsterEventType.RUN_START] - stamps[DagsterEventType.RUN_STARTING]


def worker_of(client: Client, run_id: str) -> dict[str, Any]:
    run = client.instance.get_run_by_id(run_id)
    assert run is not None and WORKER_TAG in run.tags, f"no {WORKER_TAG} tag on {run_id}: {run and run.tags}"
    return json.loads(run.tags[WORKER_TAG])


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not {what} within {timeout}s"
        time.sleep(0.1)


def pid_gone(pid: int) -> bool:
    found = process_start_ticks(pid)
    return found is None or found[1] in ("Z", "X")


@pytest.fixture(scope="module")
def warm(services: Services, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    with launcher_home(services, tmp_path_factory.mktemp("warm"), WARM_LAUNCHER) as h:
        h.start_daemon()
        client = Client(h)
        try:
            yield client
        finally:
            # Release any run a failed test left waiting, then stop.
            for pid_file in h.out.glob("*.pid"):
                (h.out / f"{pid_file.stem}.release").touch()
            client.close()


def test_daemon_launches_run_in_a_forked_warm_worker(warm: Client) -> None:
    run_id = warm.submit("quick")
    warm.wait(run_id, {"SUCCESS"})
    worker = worker_of(warm, run_id)
    ran = json.loads(warm.wait_for_file(warm.h.out / f"{run_id}.json"))
    # The op ran in the recorded worker, which the fork server forked (not the code server).
    assert ran == {"version": "v1", "pid": worker["pid"]}
    assert worker["server_pid"] != worker["pid"] and worker["host"]
    events = warm.events(run_id)
    assert any("Forked run worker (pid " in e for e in events), events
    assert not any("falls back" in e for e in events), events
    print(f"warm launch -> RUN_START: {warm.launch_to_start_s(run_id):.2f}s")


def test_sigkilled_worker_is_failed_by_run_monitoring(warm: Client) -> None:
    run_id = warm.submit("slow")
    pid = int(warm.wait_for_file(warm.h.out / f"{run_id}.pid"))
    assert pid == worker_of(warm, run_id)["pid"]
    warm.wait(run_id, {"STARTED"})
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    warm.wait(run_id, {"FAILURE"}, timeout=POLL_INTERVAL_S + 15)
    assert time.monotonic() - killed <= POLL_INTERVAL_S + 15
    events = warm.events(run_id)
    # Failed by run monitoring from our health check (gone, or a zombie until init reaps it).
    assert any(e.startswith("PIPELINE_FAILURE: Detected run worker status FAILED") and f"run worker (pid {pid})" in e
               for e in events), "\n".join(events)


def test_fork_server_death_loses_no_run(warm: Client) -> None:
    in_flight = warm.submit("slow")
    warm.wait_for_file(warm.h.out / f"{in_flight}.pid")
    worker = worker_of(warm, in_flight)
    os.kill(worker["server_pid"], signal.SIGKILL)
    wait_until(lambda: pid_gone(worker["server_pid"]), 10, "fork server gone")
    # The next launch re-creates the fork server and succeeds.
    next_run = warm.submit("quick")
    warm.wait(next_run, {"SUCCESS"})
    assert worker_of(warm, next_run)["server_pid"] != worker["server_pid"]
    # The worker forked by the dead server was not its child: it is still running, and finishes its run.
    assert not pid_gone(worker["pid"])
    # It stays in the daemon's process group, as the code server's workers do (a group kill still reaches it).
    assert warm.h.daemon is not None and os.getpgid(worker["pid"]) == warm.h.daemon.pid
    (warm.h.out / f"{in_flight}.release").touch()
    warm.wait(in_flight, {"SUCCESS"})


@pytest.mark.parametrize("released", [False, True], ids=["before_the_go", "after_the_go"])
def test_a_fork_server_dying_between_fork_and_go_executes_the_run_once(
        services: Services, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, released: bool) -> None:
    """The fork server dies after the fork and the worker's tag, while the launcher waits for the go's answer.
    Before the go, the worker reads EOF and exits: the launch fell back to the code server, but the run's tag still
    named the exited worker, and run monitoring would fail the run the code server executes. After the go, the
    worker runs: the fallback launched the run a second time (here Dagster ignored that worker, the run having
    finished; beside a longer run it executes it again). Now: a worker that got its go is the run's worker,
    and one that did not names none. Launched in this process (no queue), so the launcher's
    request to the fork server can be cut here."""
    from orchestration.launcher import ForkServer, ForkServerUnavailable, WarmWorker, close_fork_servers

    original = ForkServer.request

    def go_answer_lost(self: ForkServer, message: Any, timeout: float = 30.0) -> dict[str, Any]:
        if message.get("op") != "go":
            return original(self, message, timeout)
        if released:
            assert original(self, message, timeout).get("ok")  # the worker has its go
        os.kill(self.pid, signal.SIGKILL)
        wait_until(lambda: self.process.poll() is not None, 10, "fork server gone")
        raise ForkServerUnavailable("fork server exited")

    monkeypatch.setattr(ForkServer, "request", go_answer_lost)
    with launcher_home(services, tmp_path, WARM_LAUNCHER, queued=False) as h:
        client = Client(h)
        try:
            run_id = client.submit("quick")
            run = client.wait(run_id, {"SUCCESS", "FAILURE"})
            events = client.events(run_id)
            assert run.status.value == "SUCCESS", "\n".join(events)
            ran = json.loads(client.wait_for_file(h.out / f"{run_id}.json"))
            tagged = json.loads(run.tags[WORKER_TAG])
            starts = [e for e in events if e.startswith(("PIPELINE_START:", "RUN_START:"))]
            assert len(starts) == 1, "\n".join(events)  # executed once
            # The executing process's last event: nothing writes to the instance's database after this test.
            wait_until(lambda: any("Process for run exited" in e for e in client.events(run_id)), 20,
                       "the run's process ended")
            if released:
                assert ran["pid"] == tagged["pid"] and WarmWorker.from_run(run) is not None
                assert not any("falls back" in e for e in events), "\n".join(events)
            else:
                assert ran["pid"] != tagged["pid"], "the worker that never got its go ran the op"
                assert WarmWorker.from_run(run) is None, run.tags  # run monitoring judges no exited worker
                assert any("falls back to the code server" in e for e in events), "\n".join(events)
        finally:
            client.close()
            close_fork_servers()


def test_terminate_stops_the_worker_and_cancels_the_run(warm: Client) -> None:
    run_id = warm.submit("slow")
    pid = int(warm.wait_for_file(warm.h.out / f"{run_id}.pid"))
    warm.wait(run_id, {"STARTED"})
    # What the UI's Terminate button calls, on an instance of this test process (not the daemon).
    assert warm.instance.run_launcher.terminate(run_id) is True
    warm.wait(run_id, {"CANCELED"}, timeout=20)
    wait_until(lambda: pid_gone(pid), 10, f"worker {pid} gone")
    # It stopped on the signal, not by finishing: its step never succeeded.
    assert not any(e.startswith("STEP_SUCCESS") for e in warm.events(run_id)), warm.events(run_id)
    assert warm.instance.run_launcher.terminate(run_id) is False  # a finished run: nothing to terminate


def test_code_change_runs_new_code(warm: Client) -> None:
    first = warm.submit("quick")
    warm.wait(first, {"SUCCESS"})
    before = worker_of(warm, first)["server_pid"]
    warm.h.write_code("v2")
    changed = warm.submit("quick")
    warm.wait(changed, {"SUCCESS"})
    assert json.loads(warm.wait_for_file(warm.h.out / f"{changed}.json"))["version"] == "v2"
    assert worker_of(warm, changed)["server_pid"] != before  # rebuilt, not re-imported in place


def test_a_worker_tag_copied_from_another_run_names_no_worker() -> None:
    """Dagster's retry copies its parent's tags: a retry that never launched named its parent's worker (pid and
    all) in its 'timed out to start' failure. A tag names its own run; tags of earlier releases name none."""
    from dagster import DagsterRun

    from orchestration.launcher import WarmWorker

    worker = WarmWorker(4242, "host", 17, 99, "parent")
    assert WarmWorker.from_run(DagsterRun(job_name="j", run_id="parent", tags={WORKER_TAG: worker.to_tag()})) == worker
    assert WarmWorker.from_run(DagsterRun(job_name="j", run_id="retry", tags={WORKER_TAG: worker.to_tag()})) is None
    earlier = json.dumps({"pid": 4242, "host": "host", "start": 17, "server_pid": 99})
    assert WarmWorker.from_run(DagsterRun(job_name="j", run_id="any", tags={WORKER_TAG: earlier})).pid == 4242


SWALLOWED_TERMINATE = """
import os, signal, sys, time, weakref
from dagster._core.errors import DagsterExecutionInterruptedError
from dagster._utils.interrupts import raise_interrupts_as, setup_interrupt_handlers
from orchestration.launcher import worker_signals

if sys.argv[1] == "redeliver":
    worker_signals()  # what _run_worker sets up
else:  # Dagster's own worker
    signal.signal(signal.SIGINT, signal.default_int_handler)
    setup_interrupt_handlers()


class ModuleLock:
    pass


def callback(_ref):  # as importlib's module-lock callback: Python only prints what it raises
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(10_000):  # the handler runs at one of these bytecodes, inside the callback
        pass


with raise_interrupts_as(DagsterExecutionInterruptedError):  # as during a step
    try:
        lock = ModuleLock()
        ref = weakref.ref(lock, callback)
        del lock
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            time.sleep(0.05)
        print("not interrupted")
    except DagsterExecutionInterruptedError:
        print("interrupted")
"""


@pytest.mark.parametrize("mode", ["as_dagster", "redeliver"])
def test_a_terminate_swallowed_inside_a_callback_is_sent_again(mode: str) -> None:
    """A Terminate whose interrupt Python swallowed (raised inside an import's module-lock callback) left the run
    CANCELING until run monitoring's timeout (seen once in CI). Here the first SIGTERM is swallowed in both modes
    (the "Exception ignored" print shows it); a warm worker sends it again, and the step is interrupted."""
    proc = subprocess.run([sys.executable, "-c", SWALLOWED_TERMINATE, mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "Exception ignored" in proc.stderr and "DagsterExecutionInterruptedError" in proc.stderr, proc.stderr
    assert proc.stdout.strip() == ("not interrupted" if mode == "as_dagster" else "interrupted"), proc.stderr


SESSION_END = """
import os, sys
from resources.spark import SparkResource

session = SparkResource(remote=sys.argv[1]).get_session()
session.range(1).collect()
print(session.session_id, flush=True)
if sys.argv[2] == "released":
    from resources.spark import release_sessions

    release_sessions()
elif sys.argv[2] == "warm_worker_end":  # a forked worker's end: its run failed here, then os._exit
    import orchestration.launcher as launcher

    go_read, go_write = os.pipe()
    os.write(go_write, b"1")
    launcher._run_worker(go_read, [], "not a run")
elif sys.argv[2] == "os_exit":
    os._exit(0)
"""


SESSION_OPEN = """
import sys
from pyspark.sql import SparkSession

again = SparkSession.builder.remote(sys.argv[1] + "/;session_id=" + sys.argv[2]).create()
try:
    print("open" if again.range(3).count() == 3 else "wrong count")
except Exception as exc:
    print(str(exc).splitlines()[0][:300])
finally:
    again.client.close()  # not stop(): that would release the session looked at
"""


@pytest.mark.parametrize("end", ["os_exit", "released", "normal_exit", "warm_worker_end"])
def test_a_process_releases_its_spark_connect_session(services: Services, end: str) -> None:
    """A Connect session lives on the server until released or idle for the server's timeout (60 min by
    default). No run released its own: a table relayed every few seconds kept hundreds of sessions there. A
    process now releases its session when it exits, and a warm worker (which ends with os._exit, running no
    atexit hook) as it ends; `os_exit`: a session nobody releases is not closed. Each in a process of its
    own (a Connect session made in this one would turn later local sessions into Connect ones)."""
    if not services.spark_remote:
        pytest.skip("no Spark Connect server in this test environment")

    def python(code: str, *args: str) -> str:
        proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, text=True, capture_output=True,
                              timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.stdout.strip(), proc.stderr[-2000:]
        return proc.stdout.strip()

    session_id = python(SESSION_END, services.spark_remote, end).split()[0]
    seen = python(SESSION_OPEN, services.spark_remote, session_id)
    if end == "os_exit":
        assert seen == "open"
    else:
        assert "SESSION_CLOSED" in seen, seen


def test_the_fork_server_records_the_files_read_while_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the fork server adds to its fingerprint besides imported modules: every file opened for reading while it
    loads (a relative path, as `./rowrelay.yaml` with ROWRELAY_CONFIG unset, made absolute), not one written, a
    pseudo-file or a directory."""
    from orchestration.launcher import recording_reads

    for name in ("rowrelay.yaml", "secret", "written"):
        (tmp_path / name).write_text("x")
    monkeypatch.chdir(tmp_path)
    with recording_reads() as read:
        Path("rowrelay.yaml").read_text()
        os.close(os.open(tmp_path / "secret", os.O_RDONLY))
        (tmp_path / "written").write_text("y")
        with open(tmp_path / "written", "a"):
            pass
        Path("/proc/self/stat").read_text()
        os.close(os.open(tmp_path, os.O_RDONLY))
    Path("after").write_text("z")
    Path("after").read_text()
    assert read == {str(tmp_path / "rowrelay.yaml"), str(tmp_path / "secret")}
