"""One Ctrl-C stops everything `make run` started (the stack stays up, as documented).

`make run` is `python -m stack.demo setup` and then `stack/run-demo.sh`; the script runs here on a pseudo-terminal
of its own, as a user's terminal, with Ctrl-C typed into it. It runs on a config, a Dagster database, a UI port
and Dagster files of its own (and no demo writer), so a demo already running, or the shared stack, is left alone.
"""

from __future__ import annotations

import fcntl
import os
import select
import socket
import subprocess
import termios
import time
from contextlib import suppress
from pathlib import Path

import pytest
from sqlalchemy import text

from tests.pipeline import ROOT, relay_config
from tests.test_cli import _config_file

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, state, start time) of a process, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[0], fields[19]


def _descendants(root: int) -> dict[int, str]:
    """Every living process below `root`: pid -> start time (a pid reused later is not the same process)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            children.setdefault(stat[0], []).append(int(entry))
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if (stat := _stat(child)) is not None and stat[1] != "Z":
                found[child] = stat[2]
                todo.append(child)
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


def _alive(processes: dict[int, str]) -> list[str]:
    living = []
    for pid, started in processes.items():
        stat = _stat(pid)
        if stat is not None and stat[1] != "Z" and stat[2] == started:
            living.append(f"{pid} {_cmdline(pid)[:120]!r}")
    return living


def _on_terminal() -> None:  # in the child, before exec: the pty (its stdin) becomes its controlling terminal
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def test_one_ctrl_c_stops_everything_make_run_started(services, pg_database, pg_engine, name, tmp_path) -> None:
    with pg_engine.begin() as conn:  # an empty table: the daemon's sensor has nothing to run
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}",
                                                         "watermark": "id"}], spark_remote=True)
    port = _free_port()
    env = {**os.environ, "ROWRELAY_DEMO_CONFIG": _config_file(cfg, tmp_path / "rowrelay.yaml"),
           "ROWRELAY_UI_PORT": str(port), "ROWRELAY_DEMO_RATE": "0", "DAGSTER_PG_DB": pg_database.database,
           "ROWRELAY_DAGSTER_DIR": str(tmp_path / "dagster")}
    env.pop("DAGSTER_HOME", None)
    master, slave = os.openpty()
    proc = subprocess.Popen(["bash", str(ROOT / "stack" / "run-demo.sh")], cwd=ROOT, env=env, stdin=slave,
                            stdout=slave, stderr=slave, preexec_fn=_on_terminal)
    os.close(slave)
    output = bytearray()

    def read_for(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and proc.poll() is None:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    output.extend(os.read(master, 65536))
                except OSError:
                    return

    started: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            read_for(1)
            names = b" ".join(map(_cmdline, _descendants(proc.pid)))
            if b"Serving dagster-webserver" in output and b"_daemon run" in names and b"api grpc" in names:
                break
        else:
            pytest.fail(f"`dagster dev` did not come up: {bytes(output[-3000:])!r}")
        read_for(5)  # the code servers and the daemon's threads settle
        started = {proc.pid: _stat(proc.pid)[2], **_descendants(proc.pid)}  # type: ignore[index]
        os.write(master, b"\x03")  # Ctrl-C, as typed
        typed = time.monotonic()
        while time.monotonic() - typed < 10 and _alive(started):
            read_for(0.5)
        left = _alive(started)
        assert not left, (f"{len(left)} process(es) still running 10 s after Ctrl-C:\n" + "\n".join(left)
                          + f"\n{bytes(output[-2000:])!r}")
        assert proc.wait(1) is not None
    finally:
        for pid in {proc.pid: "", **started, **_descendants(proc.pid)}:
            if _stat(pid) is not None:
                with suppress(ProcessLookupError):
                    os.kill(pid, 9)
        proc.wait(10)
        os.close(master)
