"""A Spark Connect server that cannot be reached, or that stops answering, must not hold `rowrelay backfill`.

A wrong URL (the README's example port where the stack serves another) printed nothing for ten minutes, then cut a
slice and started a run anyway; a backfill stuck in Spark ignored SIGTERM, and after Ctrl-C PySpark's exit hook kept
the process retrying the dead server for twenty minutes. The CLI runs in a subprocess, as a user runs it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from assets.identity import partitions_for
from tests.pipeline import ROOT, relay_config
from tests.test_cli import _config_file, _serial_table

pytestmark = pytest.mark.integration


def _backfill(services, pg_database, pg_engine, dagster_home, name: str, tmp_path: Path, remote: str, rows: int
              ) -> tuple[object, list[str], dict[str, str]]:
    _serial_table(pg_engine, name, rows)
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}",
                                                         "watermark": "id", "slice_max_rows": 10,
                                                         "max_slices_per_run": 2, "settle_seconds": 0}],
                       spark_remote=True)
    cfg = cfg.model_copy(update={"spark": cfg.spark.model_copy(update={"remote": remote})})
    argv = [sys.executable, "-m", "orchestration.cli", "--config", _config_file(cfg, tmp_path / "rowrelay.yaml"),
            "backfill", "--table", cfg.tables[0].table_id]
    return cfg, argv, {**os.environ, "DAGSTER_HOME": str(dagster_home)}


@contextmanager
def _closed_port() -> Iterator[int]:
    """A port nothing listens on: connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    yield port


@contextmanager
def _black_hole() -> Iterator[int]:
    """A port that takes connections (the kernel's backlog) and never says a word: a firewall or a wrong service."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield s.getsockname()[1]


class FreezableProxy:
    """A TCP forwarder to the stack's Spark Connect server that can be frozen: it then forwards nothing and accepts
    nothing more, its connections held open, as a server that hangs."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.frozen = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.sockets: list[socket.socket] = [self.server]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with suppress(OSError):
            while True:
                client, _ = self.server.accept()
                upstream = socket.create_connection(self.target)
                self.sockets += [client, upstream]
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        with suppress(OSError):
            while data := a.recv(65536):
                while self.frozen.is_set():
                    time.sleep(0.1)
                b.sendall(data)

    def close(self) -> None:
        for s in self.sockets:
            with suppress(OSError):
                s.close()


@pytest.mark.parametrize("server", ["refused", "silent"])
def test_an_unreachable_spark_connect_url_fails_the_backfill_within_seconds(
        services, pg_database, pg_engine, dagster_home, dagster_instance, name, tmp_path, server) -> None:
    """One line naming the URL and what to check, a non-zero exit, within seconds, and nothing cut."""
    with (_closed_port() if server == "refused" else _black_hole()) as port:
        remote = f"sc://127.0.0.1:{port}"
        cfg, argv, env = _backfill(services, pg_database, pg_engine, dagster_home, name, tmp_path, remote, 30)
        started = time.monotonic()
        try:
            done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"backfill still running after 90 s with {remote}: {exc.stderr!r}"[-3000:])
        elapsed = time.monotonic() - started
    table = cfg.tables[0]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr[-3000:]
    assert elapsed < 30, (elapsed, done.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("rowrelay: ") and remote in lines[0], done.stderr[-3000:]
    assert "spark.remote" in lines[0], lines[0]
    assert "cut" not in done.stdout and "to publish" not in done.stdout, done.stdout
    assert dagster_instance.get_dynamic_partitions(partitions_for(table).name) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_backfill_stuck_in_spark_ends_within_seconds_of_a_signal(
        services, pg_database, pg_engine, dagster_home, dagster_instance, name, tmp_path, signum) -> None:
    """Spark stops answering in the middle of a backfill: SIGTERM or Ctrl-C ends the process within 10 s, saying
    the backfill was interrupted."""
    if not services.spark_remote:
        pytest.skip("no Spark Connect server in this test environment")
    host, port = services.spark_remote.removeprefix("sc://").split("/")[0].split(";")[0].rsplit(":", 1)
    proxy = FreezableProxy(host, int(port))
    remote = f"sc://127.0.0.1:{proxy.port}"
    _, argv, env = _backfill(services, pg_database, pg_engine, dagster_home, name, tmp_path, remote, 60)
    env["ROWRELAY_FAILPOINT"] = "sleep:begun:1.5"
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            if "to publish" in line:
                break
        proxy.frozen.set()  # Spark hangs from here on
        time.sleep(4)
        assert proc.poll() is None, "the backfill ended before Spark was frozen under it"
        proc.send_signal(signum)
        signalled = time.monotonic()
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 60 s after {signum.name}")
        ended = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proxy.close()
    assert ended < 10, (ended, err[-3000:])
    assert proc.returncode == 128 + signum, err[-3000:]
    assert "backfill interrupted" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]



def test_a_run_on_an_unreachable_spark_connect_url_fails_within_seconds_naming_it(
        services, pg_database, pg_engine, dagster_instance, name, tmp_path) -> None:
    """The daemon's path: a sensor tick cuts (no Spark there), and the run it requests fails its table check within
    seconds, naming the URL, instead of PySpark's client retrying the server for ten minutes."""
    from assets.identity import asset_key
    from tests.pipeline import Harness

    with _closed_port() as port:
        remote = f"sc://127.0.0.1:{port}"
        cfg, _, _ = _backfill(services, pg_database, pg_engine, tmp_path, name, tmp_path, remote, 30)
        h = Harness(cfg, dagster_instance)
        key = h.cut(h.table())[0]  # the first run the tick requests
        argv = [sys.executable, "-m", "dagster", "asset", "materialize", "--select",
                "/".join(asset_key(h.table()).path), "--partition-range" if "..." in key else "--partition", key,
                "-m", "orchestration.definitions"]
        env = {**os.environ, "DAGSTER_HOME": dagster_instance.root_directory, "ROWRELAY_CONFIG": str(h.config_file())}
        started = time.monotonic()
        try:
            result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run was still trying {remote} after 120 s")
        elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert remote in output and "spark.remote" in output, output[-3000:]
    assert elapsed < 60, (elapsed, output[-3000:])
