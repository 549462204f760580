"""A warm run launcher: each run's worker is forked from a parent that has already imported Dagster, the
libraries and the code location, instead of a fresh interpreter (Dagster's code server hard-codes
multiprocessing "spawn", so every run re-imports everything, ~3 s on two cores).

Configured in rowrelay's dagster.yaml (delete the stanza for Dagster's default launcher):

    run_launcher:
      module: orchestration.launcher
      class: WarmRunLauncher

Design:
- The *fork server* is a separate process the launcher starts on demand (one per launching process — the
  daemon, or the webserver for UI launches without a queue — and code location). It imports the preload modules,
  loads the code location's definitions, records a fingerprint of every module file it imported, every file it
  read meanwhile (the config file, whichever chose it: an audit hook sees the opens) and the files named by
  `watch_env_files` / `watch_paths`, and then waits for requests on its stdin/stdout pipes. It exits when the
  launching process closes its stdin (or dies).
- A launch computes the fingerprint again (one stat per file); a different one replaces the fork server, so a
  changed code location never runs stale code. Modules imported only later, in the worker, are read fresh anyway.
- The fork server double-forks: the worker is not its child, so it survives the fork server's death (and is
  reaped by init). The worker stays in the launching process's process group, like the code server's workers.
- The worker waits for a "go" until the launcher has tagged the run with its pid, host and process start time:
  no worker runs unrecorded. Then it runs the body of `dagster api execute_run` (the same click callback), so
  events, run status, failure handling and SIGTERM-as-interrupt are Dagster's own.
- Health: run monitoring asks `check_run_worker_health`; a worker whose pid is gone (or reused, or a zombie)
  while its run is still STARTED is FAILED, so Dagster fails the run and run retries take over. Run monitoring
  asks only about STARTED runs (a STARTING one waits for `start_timeout_seconds`), so the launching process
  watches each worker it forked itself: one gone while its run is still STARTING fails the run at once.
- Fork safety: before warming and before each fork the fork server checks that it has no Python thread but the
  main one and no socket; otherwise it refuses and the launch falls back. Native threads started by imports
  (numpy's OpenBLAS pool, pyarrow's jemalloc background thread) register pthread_atfork handlers.
- Fallback: when fork is unavailable or the fork server cannot start or refuses, the run is launched the way
  DefaultRunLauncher does (through the code server), with an engine event saying why (`fallback: false` fails
  the launch instead).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from dagster import (
    DagsterInstance,
    DagsterRunStatus,
    DefaultRunLauncher,
    Field,
    MetadataValue,
    Noneable,
    deserialize_value,
    serialize_value,
)
from dagster import _check as check

# Private Dagster APIs, all in one place. Dagster exposes no public way to write a run launcher or to run a
# run's worker body, so these are what its own launchers and `dagster api execute_run` use (1.13.27):
from dagster._cli.api import execute_run_command  # the worker body: click command behind `dagster api execute_run`
from dagster._core.errors import (
    DagsterExecutionInterruptedError,  # what Dagster's SIGTERM handler raises in a step
    DagsterLaunchFailedError,  # what a launcher raises when it cannot launch
)
from dagster._core.events import EngineEventData  # metadata on the launch's engine event
from dagster._core.launcher import (  # the run launcher interface (RunLauncher is @public, not exported at top)
    CheckRunHealthResult,
    LaunchRunContext,
    RunLauncher,
    WorkerStatus,
)
from dagster._core.origin import RepositoryPythonOrigin  # a run's code origin (executable + code pointer)
from dagster._core.storage.dagster_run import DagsterRun  # the run record type
from dagster._core.storage.tags import GRPC_INFO_TAG  # marks a run DefaultRunLauncher launched (our fallback)
from dagster._grpc.types import ExecuteRunArgs  # the argument of `dagster api execute_run`
from dagster._serdes import ConfigurableClass, ConfigurableClassData  # dagster.yaml-configurable classes
from dagster._utils.hosted_user_process import recon_repository_from_origin  # loads a code origin's definitions
from dagster._utils.interrupts import setup_interrupt_handlers  # SIGTERM -> interrupt, as Dagster's workers

from assets.worker import local_worker_pid  # the worker tags' reader: stdlib only, cheap for the daemon to load
from resources.keys import WARM_WORKER_TAG

WORKER_TAG = WARM_WORKER_TAG
DEFAULT_PRELOAD = ("dagster", "pandas", "pyarrow", "confluent_kafka", "sqlalchemy", "pyspark.sql.connect.session")
ROOT = Path(__file__).resolve().parents[1]
RELEASE_WAIT_S = 2.0  # how long a worker whose go's answer was lost is watched (`WarmRunLauncher._released`)
START_WATCH_INTERVAL_S = 1.0  # how often the workers of runs not yet started are looked at (`StartingRunWatch`)
START_WATCH_RETRIES = 30  # storage errors tolerated failing one run before run monitoring's start timeout does it
# The fork server's command: this module from this checkout, whatever the code location's sys.path
# (`-c`, not `-m` or PYTHONPATH, so workers inherit the launching process's environment unchanged).
BOOTSTRAP = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import orchestration.launcher as m; m.serve(sys.argv[1:])"


class ForkServerUnavailable(Exception):
    """The fork server could not start or refused a fork: the launch falls back (or fails)."""


# ---------------------------------------------------------------------------------------------- both sides


def process_start_ticks(pid: int) -> tuple[int, str] | None:
    """(start time in clock ticks since boot, state letter) of a live process, None when it does not exist.
    The start time tells a reused pid from the worker's."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may contain spaces and parentheses
    return int(fields[19]), fields[0]


def in_process_worker_gone(run: DagsterRun) -> str | None:
    """Why a run executed in-process (`rowrelay backfill`, `dagster asset materialize`) has no live worker, or None.

    Such a run's process tags it with its pid and host when the asset starts (assets/worker.py). If that process
    died (kill -9, OOM, a closed terminal), the run stayed STARTED for good: no launcher tracks it, so run
    monitoring never failed it, and it held the table's pool (every later run of the table queued behind it). Only
    processes on this host are judged; a pid reused since by another process keeps the run (judged alive)."""
    if WORKER_TAG in run.tags or GRPC_INFO_TAG in run.tags:
        # Launched by this launcher or through a code server: their own health checks judge it.
        return None
    pid = local_worker_pid(run)  # its own process's pid, in this host's pid namespace; else not judged
    if pid is None:
        return None
    seen = process_start_ticks(pid)
    if seen is not None and seen[1] != "Z":
        return None
    return f"the process that ran it in-process (pid {pid} on {socket.gethostname()}) is gone"


def file_signatures(paths: Sequence[str]) -> dict[str, list[int]]:
    """(mtime_ns, size) per file; [-1, -1] for one that is missing (its appearance changes the fingerprint)."""
    out: dict[str, list[int]] = {}
    for path in paths:
        try:
            st = os.stat(path)
            out[path] = [st.st_mtime_ns, st.st_size]
        except OSError:
            out[path] = [-1, -1]
    return out


# ---------------------------------------------------------------------------------------------- fork server


_files_read: set[str] | None = None  # what `_audit_open` records, while `recording_reads` runs
_audit_hooked = False
_PSEUDO_FILES = ("/proc/", "/sys/", "/dev/")


def _audit_open(event: str, args: tuple[Any, ...]) -> None:
    """Audit hook: records each file opened for reading (open(), os.open, pathlib, ...) while recording."""
    if _files_read is None or event != "open":
        return
    with contextlib.suppress(Exception):  # an exception here would fail the open itself
        path, mode, flags = args
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else flags & os.O_ACCMODE != os.O_RDONLY
        if not writes and not isinstance(path, int):
            _files_read.add(os.path.abspath(os.fsdecode(path)))


@contextlib.contextmanager
def recording_reads() -> Iterator[set[str]]:
    """The files read inside the block, but pseudo-files, directories and bytecode caches (their sources are
    imported files). An audit hook cannot be removed: it stays, inert, in this process and its forks."""
    global _files_read, _audit_hooked
    if not _audit_hooked:
        sys.addaudithook(_audit_open)
        _audit_hooked = True
    read: set[str] = set()
    _files_read = read
    found: set[str] = set()
    try:
        yield found
    finally:
        _files_read = None
        found.update(p for p in read if not p.startswith(_PSEUDO_FILES) and "__pycache__" not in p
                     and not os.path.isdir(p))


def _imported_files() -> list[str]:
    files = set()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and os.path.isfile(path):
            files.add(os.path.abspath(path))
    return sorted(files)


def fork_hazards() -> list[str]:
    """What would make fork unsafe here: Python threads besides this one, open sockets (a gRPC channel,
    a Kafka or database connection would be shared by every worker)."""
    hazards = [f"thread {t.name}" for t in threading.enumerate() if t is not threading.main_thread()]
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                hazards.append(f"socket fd {fd}")
    return hazards


@dataclass
class _PendingWorker:
    pid: int
    go_fd: int


@dataclass
class _ForkServerState:
    requests: IO[str]
    responses: IO[str]
    pending: dict[str, _PendingWorker] = field(default_factory=dict)

    def fds(self) -> list[int]:
        return [self.requests.fileno(), self.responses.fileno(), *(p.go_fd for p in self.pending.values())]


def redeliver_lost_interrupts(delay_s: float = 0.5) -> None:
    """Send SIGTERM again when Python swallowed the interrupt a SIGTERM raised.

    Python runs a signal handler between bytecodes wherever the main thread is. When that is inside a callback
    whose exceptions the interpreter only prints (an import's module-lock weakref callback, a `__del__`), the
    interrupt Dagster's handler raises goes to `sys.unraisablehook` ("Exception ignored in: ...") and is lost:
    the run stayed CANCELING until run monitoring's cancel timeout (seen in CI, a Terminate landing on an import
    at a step's start). Only a lost interrupt is sent again, from a timer outside the callback; one that was
    delivered is never repeated, so the cleanup it starts is not interrupted in turn."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        previous(unraisable)  # printed as before
        if isinstance(unraisable.exc_value, (KeyboardInterrupt, DagsterExecutionInterruptedError)):
            timer = threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGTERM))
            timer.daemon = True
            timer.start()

    sys.unraisablehook = hook


def worker_signals() -> None:
    """A warm worker's signals, as Dagster's own workers have them: SIGINT and SIGTERM interrupt the run (and
    execute_run's capture_interrupts maps them again the same way); a lost interrupt is sent again."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    setup_interrupt_handlers()
    redeliver_lost_interrupts()


def _run_worker(go_fd: int, close_fds: list[int], execute_run_args: str) -> None:
    """In the forked worker: wait for the launcher's go, then run exactly what `dagster api execute_run` runs."""
    code = 1
    try:
        for fd in close_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        go = os.read(go_fd, 1)
        os.close(go_fd)
        if go != b"1":  # the launch was aborted or the fork server died before recording us
            code = 0
            return
        worker_signals()
        relay = sys.modules.get("resources.exactly_once")  # the code location's own, if it is rowrelay's
        if relay is not None:
            relay.env_failpoint("worker_released")  # tests: a worker held (or killed) between its go and RUN_START
        try:
            execute_run_command.callback(input_json=execute_run_args, compressed_input_json=None)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - the worker must end with os._exit, never return into the server loop
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):  # a late Terminate must not cut the release and flush below short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        spark = sys.modules.get("resources.spark")  # the code location's own, if its run used Spark
        if spark is not None:
            with contextlib.suppress(Exception):
                spark.release_sessions()  # os._exit runs no atexit hook: the run's Spark Connect session, released
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _fork_worker(state: _ForkServerState, run_id: str, execute_run_args: str) -> dict[str, Any]:
    hazards = fork_hazards()
    if hazards:
        return {"ok": False, "error": f"fork server is no longer fork-safe: {', '.join(hazards)}"}
    go_read, go_write = os.pipe()
    pid_read, pid_write = os.pipe()
    try:
        child = os.fork()
    except OSError as exc:  # EAGAIN/ENOMEM: refuse this launch, keep serving
        for fd in (go_read, go_write, pid_read, pid_write):
            os.close(fd)
        return {"ok": False, "error": f"fork failed: {exc}"}
    if child == 0:  # intermediate child: fork the worker and exit, so the worker is not the fork server's child
        try:
            os.close(pid_read)
            os.close(go_write)
            worker = os.fork()
            if worker == 0:
                os.close(pid_write)
                _run_worker(go_read, state.fds(), execute_run_args)
            os.write(pid_write, str(worker).encode())
        finally:
            os._exit(0)
    os.close(go_read)
    os.close(pid_write)
    os.waitpid(child, 0)
    with os.fdopen(pid_read, "rb") as f:
        raw = f.read()
    if not raw:
        os.close(go_write)
        return {"ok": False, "error": "fork failed in the intermediate child"}
    pid = int(raw)
    started = process_start_ticks(pid)
    state.pending[run_id] = _PendingWorker(pid, go_write)
    return {"ok": True, "pid": pid, "start": started[0] if started else None}


def _release_worker(state: _ForkServerState, run_id: str, go: bool) -> dict[str, Any]:
    pending = state.pending.pop(run_id, None)
    if pending is None:
        return {"ok": False, "error": f"no pending worker for run {run_id}"}
    try:
        if go:
            os.write(pending.go_fd, b"1")
    except BrokenPipeError:  # the worker died (e.g. terminated) before its go
        return {"ok": False, "error": f"worker {pending.pid} is gone"}
    finally:
        os.close(pending.go_fd)
    return {"ok": True}


def _warm_up(repository_origin: RepositoryPythonOrigin, preload: Sequence[str]) -> list[str]:
    """Import and load; the files read meanwhile (the code location's config file, wherever it was found, and
    whatever else it reads at load time): a change to one of them must replace the fork server as a code change
    does, or runs would keep the config their fork server loaded."""
    import importlib

    with recording_reads() as read:
        for name in preload:
            importlib.import_module(name)
        # Loading the definitions builds assets, sensors and resource *configs* only (rowrelay's resources open
        # connections lazily, in the run); fork_hazards() below verifies that nothing opened a socket or thread.
        recon_repository_from_origin(repository_origin).get_definition()
    return sorted(read)


def serve(argv: Sequence[str]) -> None:
    """Fork server main: warm up, report the fingerprint, then serve fork/go/abort requests until stdin closes."""
    options = json.loads(argv[0])
    requests = os.fdopen(os.dup(0), "r")
    responses = os.fdopen(os.dup(1), "w")
    # Workers inherit fds 0-2: no protocol pipe there; their output goes where the launching process's does.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    state = _ForkServerState(requests, responses)

    def reply(message: dict[str, Any]) -> None:
        responses.write(json.dumps(message) + "\n")
        responses.flush()

    started_ns = time.time_ns()
    try:
        read = _warm_up(deserialize_value(options["repository_origin"], RepositoryPythonOrigin), options["preload"])
        hazards = fork_hazards()
        if hazards:
            raise ForkServerUnavailable(f"warming up left {', '.join(hazards)}; refusing to fork")
        watched = _imported_files() + read + [p for p in options["watch_files"] if p]
        signatures = file_signatures(watched)
        # A file written while it was being imported may be half old, half new: import again, from scratch.
        changed = [p for p, (mtime, _) in signatures.items() if mtime >= started_ns - 50_000_000]
        restarts = int(os.environ.get("ROWRELAY_FORK_SERVER_RESTARTS", "0"))
        if changed and restarts < 3:
            os.environ["ROWRELAY_FORK_SERVER_RESTARTS"] = str(restarts + 1)
            os.dup2(requests.fileno(), 0)
            os.dup2(responses.fileno(), 1)
            os.execv(sys.executable, [sys.executable, "-c", BOOTSTRAP, *argv])
        os.environ.pop("ROWRELAY_FORK_SERVER_RESTARTS", None)
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, which falls back
        reply({"ready": False, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})
        return
    reply({"ready": True, "pid": os.getpid(), "fingerprint": signatures,
           "warm_up_s": round((time.time_ns() - started_ns) / 1e9, 3)})
    try:
        for line in requests:
            request = json.loads(line)
            op = request["op"]
            if op == "fork":
                reply(_fork_worker(state, request["run_id"], request["execute_run_args"]))
            elif op in ("go", "abort"):
                reply(_release_worker(state, request["run_id"], go=op == "go"))
            else:
                reply({"ok": False, "error": f"unknown op {op!r}"})
    except KeyboardInterrupt:  # Ctrl-C of `dagster dev` reaches the whole process group
        pass


# ---------------------------------------------------------------------------------------------- launcher side


@dataclass
class WarmWorker:
    pid: int
    host: str
    start: int | None
    server_pid: int

    run_id: str | None = None  # the run it was forked for (None in tags of earlier releases)

    def to_tag(self, released: bool = True) -> str:
        """`released=False`: forked but never released (the fork server died before its go): names no worker."""
        return json.dumps({"pid": self.pid, "host": self.host, "start": self.start, "server_pid": self.server_pid,
                           "run": self.run_id, **({} if released else {"released": False})})

    @classmethod
    def from_run(cls, run: DagsterRun) -> WarmWorker | None:
        """The run's worker; None when it has none, or when the tag was copied from another run (Dagster's retry
        copies its parent's tags: a retry never launched named its parent's worker in its failure)."""
        raw = run.tags.get(WORKER_TAG)
        if raw is None:
            return None
        data = json.loads(raw)
        if data.get("run") not in (None, run.run_id) or data.get("released") is False:
            return None
        return cls(int(data["pid"]), str(data["host"]), data.get("start"), int(data.get("server_pid", 0)),
                   data.get("run"))

    def status(self) -> tuple[WorkerStatus, str]:
        if self.host != socket.gethostname():
            return WorkerStatus.UNKNOWN, f"worker pid {self.pid} runs on host {self.host}, not {socket.gethostname()}"
        found = process_start_ticks(self.pid)
        if found is None:
            return WorkerStatus.FAILED, f"run worker (pid {self.pid}) is gone"
        start, state = found
        if self.start is not None and start != self.start:
            return WorkerStatus.FAILED, f"run worker (pid {self.pid}) is gone (pid reused)"
        if state in ("Z", "X"):
            return WorkerStatus.FAILED, f"run worker (pid {self.pid}) has exited"
        return WorkerStatus.RUNNING, f"run worker (pid {self.pid}) is alive"


class ForkServer:
    """The launcher's handle on one fork server process."""

    def __init__(self, repository_origin: RepositoryPythonOrigin, preload: Sequence[str],
                 watch_files: Sequence[str], start_timeout: float) -> None:
        options = json.dumps({"repository_origin": serialize_value(repository_origin), "preload": list(preload),
                              "watch_files": list(watch_files)})
        executable = repository_origin.executable_path or sys.executable
        try:
            self.process = subprocess.Popen([executable, "-c", BOOTSTRAP, options], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True, close_fds=True)
        except OSError as exc:
            raise ForkServerUnavailable(f"cannot start the fork server with {executable}: {exc}") from exc
        assert self.process.stdin is not None and self.process.stdout is not None
        self._stdin: IO[str] = self.process.stdin
        self._stdout: IO[str] = self.process.stdout
        ready = self._read(start_timeout)
        if not ready.get("ready"):
            self.close()
            raise ForkServerUnavailable(f"fork server failed to warm up: {ready.get('error')}")
        self.pid: int = ready["pid"]
        self.fingerprint: dict[str, list[int]] = ready["fingerprint"]
        self.warm_up_s: float = ready["warm_up_s"]

    def _read(self, timeout: float) -> dict[str, Any]:
        readable, _, _ = select.select([self._stdout], [], [], timeout)
        line = self._stdout.readline() if readable else ""
        if not line:
            alive = self.process.poll() is None
            self.close()
            raise ForkServerUnavailable("fork server did not answer within "
                                        f"{timeout:.0f}s" if alive else "fork server exited")
        return json.loads(line)

    def request(self, message: Mapping[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        try:
            self._stdin.write(json.dumps(message) + "\n")
            self._stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as exc:
            self.close()
            raise ForkServerUnavailable(f"fork server is gone: {exc}") from exc
        return self._read(timeout)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stale_files(self) -> list[str]:
        current = file_signatures(list(self.fingerprint))
        return [p for p, sig in current.items() if sig != self.fingerprint[p]]

    def close(self) -> None:
        """Closing its stdin ends the fork server; workers it forked keep running."""
        with contextlib.suppress(OSError, ValueError):
            self._stdin.close()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        with contextlib.suppress(OSError, ValueError):
            self._stdout.close()


# One registry per launching process, whatever the number of DagsterInstance objects in it.
_SERVERS: dict[str, ForkServer] = {}
_SERVERS_LOCK = threading.Lock()


def fail_unstarted_run(instance: DagsterInstance, run_id: str, why: str) -> bool:
    """Fail a run whose worker is gone if the run is still STARTING (nothing will ever start it); a STARTED run is
    run monitoring's to judge, a finished one is left alone. Whether it was failed."""
    run = instance.get_run_by_id(run_id)
    if run is None or run.status != DagsterRunStatus.STARTING:
        return False
    instance.report_run_failed(run, f"Run worker exited before the run started ({why}): nothing will start it.\n"
                                    f"WarmRunLauncher worker: {run.tags.get(WORKER_TAG)}")
    return True


@dataclass
class _Watched:
    worker: WarmWorker
    instance: DagsterInstance
    errors: int = 0


class StartingRunWatch:
    """Fails a run whose worker died before the run started, within about `interval_s` of the death.

    Run monitoring asks `check_run_worker_health` only for STARTED runs: a run whose worker died while it was
    STARTING waited for `start_timeout_seconds` (120 s in rowrelay's dagster.yaml), holding its table's pool, though
    the launching process knows its worker from the fork on. One thread per launching process looks at each worker
    it forked (one /proc read) until the worker ends; only then is the run read from storage."""

    def __init__(self, interval_s: float = START_WATCH_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._watched: dict[str, _Watched] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, instance: DagsterInstance, run_id: str, worker: WarmWorker) -> None:
        with self._lock:
            self._watched[run_id] = _Watched(worker, instance)
            if self._thread is None:  # started by the first launch: never in the fork server, which forks no thread
                self._thread = threading.Thread(target=self._loop, name="rowrelay-starting-runs", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            time.sleep(self.interval_s)
            self.check()

    def check(self) -> None:
        with self._lock:
            watched = list(self._watched.items())
        for run_id, entry in watched:
            status, message = entry.worker.status()
            if status == WorkerStatus.RUNNING:
                continue
            try:
                if status == WorkerStatus.FAILED:
                    fail_unstarted_run(entry.instance, run_id, message)
            except Exception:  # noqa: BLE001 - storage away for a moment: the worker stays gone, look again
                entry.errors += 1
                if entry.errors < START_WATCH_RETRIES:
                    continue
                logging.getLogger(__name__).exception("cannot judge run %s; run monitoring will", run_id)
            with self._lock:
                self._watched.pop(run_id, None)


_STARTING_RUNS = StartingRunWatch()


class WarmRunLauncher(RunLauncher, ConfigurableClass):
    """Launches each run's worker by forking it from a warm fork server; see the module docstring."""

    def __init__(self, inst_data: ConfigurableClassData | None = None,
                 preload_modules: Sequence[str] | None = None,
                 watch_env_files: Sequence[str] | None = None,
                 watch_paths: Sequence[str] | None = None,
                 fallback: bool = True,
                 start_timeout_seconds: float = 120.0) -> None:
        self._inst_data = inst_data
        self.preload_modules = list(DEFAULT_PRELOAD if preload_modules is None else preload_modules)
        self.watch_env_files = list(("ROWRELAY_CONFIG",) if watch_env_files is None else watch_env_files)
        self.watch_paths = list(watch_paths or [])
        self.fallback = fallback
        self.start_timeout_seconds = start_timeout_seconds
        self._code_server_launcher = DefaultRunLauncher()
        super().__init__()

    # -- ConfigurableClass

    @property
    def inst_data(self) -> ConfigurableClassData | None:
        return self._inst_data

    @classmethod
    def config_type(cls) -> dict[str, Field]:
        return {
            "preload_modules": Field(Noneable([str]), is_required=False,
                                     description="Modules the fork server imports before forking workers."),
            "watch_env_files": Field(Noneable([str]), is_required=False,
                                     description="Env vars naming more files whose change rebuilds the fork "
                                                 "server (default ROWRELAY_CONFIG; the files read while loading "
                                                 "the code location are watched anyway)."),
            "watch_paths": Field([str], is_required=False, default_value=[],
                                 description="More files whose change rebuilds the fork server."),
            "fallback": Field(bool, is_required=False, default_value=True,
                              description="Launch through the code server when the fork server is unavailable "
                                          "(false: fail the launch)."),
            "start_timeout_seconds": Field(float, is_required=False, default_value=120.0,
                                           description="How long the fork server may take to warm up."),
        }

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData, config_value: Mapping[str, Any]) -> WarmRunLauncher:
        return cls(inst_data=inst_data, **config_value)

    def register_instance(self, instance: Any) -> None:
        super().register_instance(instance)
        self._code_server_launcher.register_instance(instance)

    # -- launching

    def _watch_files(self) -> list[str]:
        named = [os.environ.get(var, "") for var in self.watch_env_files]
        return [os.path.abspath(p) for p in [*named, *self.watch_paths] if p]

    def _server_for(self, origin: RepositoryPythonOrigin) -> ForkServer:
        """A live fork server for this code origin whose imported files are unchanged; rebuilt otherwise.
        Called with _SERVERS_LOCK held."""
        watch = self._watch_files()
        key = serialize_value(origin) + json.dumps([self.preload_modules, watch])
        server = _SERVERS.get(key)
        if server is not None and (not server.alive() or server.stale_files()):
            _SERVERS.pop(key)
            server.close()
            server = None
        if server is None:
            server = ForkServer(origin, self.preload_modules, watch, self.start_timeout_seconds)
            _SERVERS[key] = server
        return server

    def _fork(self, run: DagsterRun, origin: RepositoryPythonOrigin, execute_run_args: str) -> WarmWorker:
        with _SERVERS_LOCK:
            for attempt in (1, 2):  # a fork server that died since the last launch is replaced once
                server = self._server_for(origin)
                try:
                    answer = server.request({"op": "fork", "run_id": run.run_id,
                                             "execute_run_args": execute_run_args})
                    break
                except ForkServerUnavailable:
                    if attempt == 2:
                        raise
            if not answer.get("ok"):
                raise ForkServerUnavailable(answer.get("error", "fork refused"))
            worker = WarmWorker(answer["pid"], socket.gethostname(), answer.get("start"), server.pid, run.run_id)
            try:
                # Recorded before the worker may start: health checks and terminate always find it.
                self._instance.add_run_tags(run.run_id, {WORKER_TAG: worker.to_tag()})
            except BaseException:
                with contextlib.suppress(ForkServerUnavailable):
                    server.request({"op": "abort", "run_id": run.run_id})
                raise
            try:
                go = server.request({"op": "go", "run_id": run.run_id})
            except ForkServerUnavailable:
                # The fork server died (or stopped answering) between the fork and the go: the worker got its go
                # or not. Falling back would execute a released worker's run a second time; not falling back
                # would leave an unreleased run unlaunched, its tag naming a worker that exited (run monitoring
                # then failed the run the code server executes).
                if self._released(run.run_id, worker):
                    return worker
                self._instance.add_run_tags(run.run_id, {WORKER_TAG: worker.to_tag(released=False)})
                raise
            if not go.get("ok"):
                raise DagsterLaunchFailedError(f"run worker {worker.pid} did not start: {go.get('error')}")
            return worker

    def _released(self, run_id: str, worker: WarmWorker, wait_s: float = RELEASE_WAIT_S) -> bool:
        """Whether a worker whose go's answer was lost got the go: its run left STARTING (the worker reports
        RUN_START first), or it is still alive after `wait_s` (without a go it reads EOF and exits at once; one that
        is only slow to exit is judged gone by run monitoring, and the run retried, never executed twice)."""
        deadline = time.monotonic() + wait_s
        while True:
            gone = worker.status()[0] == WorkerStatus.FAILED
            run = self._instance.get_run_by_id(run_id)
            if run is not None and run.status not in (DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED,
                                                      DagsterRunStatus.STARTING):
                return True
            if gone:
                return False
            if time.monotonic() >= deadline:
                return True
            time.sleep(0.05)

    def launch_run(self, context: LaunchRunContext) -> None:
        run = context.dagster_run
        check.inst_param(run, "run", DagsterRun)
        origin = run.job_code_origin
        if origin is None:
            raise DagsterLaunchFailedError(f"run {run.run_id} has no code origin to execute")
        if not hasattr(os, "fork") or not Path("/proc/self/stat").exists():
            return self._launch_through_code_server(context, "fork or /proc is not available on this platform")
        args = ExecuteRunArgs(job_origin=origin, run_id=run.run_id, instance_ref=self._instance.get_ref())
        started = time.monotonic()
        try:
            worker = self._fork(run, origin.repository_origin, serialize_value(args))
        except ForkServerUnavailable as exc:
            if not self.fallback:
                raise DagsterLaunchFailedError(f"WarmRunLauncher cannot launch run {run.run_id}: {exc}") from exc
            return self._launch_through_code_server(context, str(exc))
        _STARTING_RUNS.add(self._instance, run.run_id, worker)
        self._instance.report_engine_event(
            f"Forked run worker (pid {worker.pid}) from the warm fork server (pid {worker.server_pid}).",
            run,
            EngineEventData(metadata={"pid": MetadataValue.int(worker.pid),
                                      "host": MetadataValue.text(worker.host),
                                      "fork_server_pid": MetadataValue.int(worker.server_pid),
                                      "launch_s": MetadataValue.float(round(time.monotonic() - started, 3))}),
            cls=self.__class__,
        )

    def _launch_through_code_server(self, context: LaunchRunContext, reason: str) -> None:
        self._instance.report_engine_event(
            f"WarmRunLauncher falls back to the code server for this run: {reason}", context.dagster_run,
            cls=self.__class__)
        self._code_server_launcher.launch_run(context)

    # -- health and termination

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: DagsterRun) -> CheckRunHealthResult:
        worker = WarmWorker.from_run(run)
        if worker is None:
            # Executed in-process (`rowrelay backfill`, `dagster asset materialize`): failed once its process is
            # gone. Launched through the code server (fallback): not ours to judge, as with Dagster's default.
            gone = in_process_worker_gone(run)
            if gone is not None:
                return CheckRunHealthResult(WorkerStatus.FAILED, gone)
            return CheckRunHealthResult(WorkerStatus.RUNNING, "not launched by WarmRunLauncher; not tracked")
        status, message = worker.status()
        return CheckRunHealthResult(status, message, run_worker_id=str(worker.pid))

    def get_run_worker_debug_info(self, run: DagsterRun, include_container_logs: bool | None = True) -> str | None:
        worker = WarmWorker.from_run(run)
        return None if worker is None else f"WarmRunLauncher worker: {worker.to_tag()}"

    def terminate(self, run_id: str) -> bool:
        check.str_param(run_id, "run_id")
        if not self.has_instance:
            return False
        run = self._instance.get_run_by_id(run_id)
        if not run or run.is_finished:
            return False
        worker = WarmWorker.from_run(run)
        if worker is None:
            if GRPC_INFO_TAG in run.tags:
                return self._code_server_launcher.terminate(run_id)
            self._instance.report_engine_event("WarmRunLauncher has no worker recorded for this run to terminate.",
                                               run, cls=self.__class__)
            return False
        self._instance.report_run_canceling(run)
        status, message = worker.status()
        if status == WorkerStatus.RUNNING:
            # The worker's execute_run maps SIGTERM to an interrupt: it stops and marks the run canceled.
            os.kill(worker.pid, signal.SIGTERM)
            return True
        self._instance.report_engine_event(f"Cannot send the termination request: {message}.", run,
                                           cls=self.__class__)
        current = self._instance.get_run_by_id(run_id)
        if status == WorkerStatus.FAILED and current is not None and not current.is_finished:
            # Nothing runs this run any more: nobody else would end it before run monitoring's cancel timeout.
            self._instance.report_run_canceled(current, f"Run canceled: {message}.")
        return False

    def dispose(self) -> None:
        """Fork servers belong to the process, not to one instance: they end with the process (stdin EOF)."""

    def join(self, timeout: int = 30) -> None:
        self._code_server_launcher.join(timeout)


def close_fork_servers() -> None:
    """End this process's fork servers (tests; a process's exit does it too). Running workers are not touched."""
    with _SERVERS_LOCK:
        while _SERVERS:
            _SERVERS.popitem()[1].close()
