"""A Spark standalone cluster from the PySpark distribution the stack already installs: a master and N workers
(`bin/spark-class` with Spark's `deploy.master.Master` and `deploy.worker.Worker`), for the Spark Connect server to
run its executors on instead of `local[2]`.

`ROWRELAY_SPARK_WORKERS=2 make stack` starts one under ~/.cache/rowrelay/spark-cluster with the stack's Connect
server attached; the default stays `local[2]`. Tests start private clusters with the same functions.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stack.local import free_ports, log, read_pid, spark_home, start_spark_connect, stop_pidfile, wait_until

WORKER_CORES = 1
WORKER_MEMORY = "1g"


def workers_wanted() -> int:
    return int(os.environ.get("ROWRELAY_SPARK_WORKERS", "0") or 0)


@dataclass(frozen=True)
class ClusterPorts:
    master: int
    master_ui: int
    worker_ui_base: int  # worker i serves its UI on worker_ui_base + i; 0: any free port

    def worker_ui(self, i: int) -> int:
        return self.worker_ui_base + i if self.worker_ui_base else 0

    @classmethod
    def from_env(cls) -> ClusterPorts:
        return cls(master=int(os.environ.get("ROWRELAY_SPARK_MASTER_PORT", 17077)),
                   master_ui=int(os.environ.get("ROWRELAY_SPARK_MASTER_UI_PORT", 18080)),
                   worker_ui_base=int(os.environ.get("ROWRELAY_SPARK_WORKER_UI_PORT", 18081)))


@dataclass(frozen=True)
class Cluster:
    base: Path
    ports: ClusterPorts
    workers: int

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.ports.master}"

    def worker_pids(self) -> list[int]:
        return [pid for i in range(self.workers) if (pid := read_pid(self.base / f"worker-{i}.pid"))]


def executor_conf(workers: int) -> dict[str, str]:
    """One executor per worker, each with the worker's core: a read of N partitions spreads over all of them."""
    return {"spark.executor.cores": str(WORKER_CORES), "spark.executor.memory": WORKER_MEMORY,
            "spark.cores.max": str(workers * WORKER_CORES)}


def _spawn(base: Path, name: str, args: list[str]) -> subprocess.Popen:
    logfile = base / f"{name}.log"
    env = {**os.environ, "SPARK_HOME": str(spark_home()), "SPARK_LOCAL_IP": "127.0.0.1",
           "SPARK_LOG_DIR": str(base), "SPARK_WORKER_DIR": str(base / "work")}
    with open(logfile, "ab") as out:
        proc = subprocess.Popen([str(spark_home() / "bin" / "spark-class"), *args], cwd=base, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    (base / f"{name}.pid").write_text(str(proc.pid))
    return proc


def master_state(ui_port: int) -> dict[str, Any] | None:
    """The master's JSON status (its workers and applications), or None while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=5) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


def alive_workers(ui_port: int) -> int:
    state = master_state(ui_port)
    return sum(1 for w in (state or {}).get("workers", []) if w.get("state") == "ALIVE")


def cluster_up(base: Path, workers: int, ports: ClusterPorts) -> Cluster:
    """A master and `workers` workers (one core, 1 GiB each), all on 127.0.0.1; waits until every worker has
    registered. Reuses a running master of this `base`."""
    base.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(base, ports, workers)
    if alive_workers(ports.master_ui) >= workers:
        log(f"spark cluster: reusing {cluster.master_url} with {workers} worker(s)")
        return cluster
    log(f"spark cluster: starting a master on {cluster.master_url} and {workers} worker(s) (logs in {base})")
    master = _spawn(base, "master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                                     "--port", str(ports.master), "--webui-port", str(ports.master_ui)])
    wait_until(lambda: master_state(ports.master_ui) is not None, 120, "spark master", base / "master.log",
               master.pid)
    for i in range(workers):
        _spawn(base, f"worker-{i}", ["org.apache.spark.deploy.worker.Worker", cluster.master_url,
                                     "--host", "127.0.0.1", "--cores", str(WORKER_CORES), "--memory", WORKER_MEMORY,
                                     "--webui-port", str(ports.worker_ui(i)),
                                     "--work-dir", str(base / f"work-{i}")])
    wait_until(lambda: alive_workers(ports.master_ui) >= workers, 120, f"{workers} spark worker(s)",
               base / "master.log", master.pid)
    return cluster


def cluster_down(base: Path) -> None:
    """Stops the workers (and the executors they started), then the master."""
    for pidfile in sorted(base.glob("worker-*.pid")):
        stop_pidfile(f"spark {pidfile.stem}", pidfile)
    stop_pidfile("spark master", base / "master.pid")


@dataclass(frozen=True)
class AttachedCluster:
    """A private cluster with a Spark Connect server of its own on it, whose application's REST API says where
    tasks ran."""
    cluster: Cluster
    remote: str
    ui_port: int

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/api/v1{path}", timeout=10) as resp:
            return json.loads(resp.read())

    def executors(self) -> list[dict[str, Any]]:
        """Every executor the Connect server's application has had, the driver left out."""
        app = self.get("/applications")[0]["id"]
        return [e for e in self.get(f"/applications/{app}/allexecutors") if e["id"] != "driver"]

    def tasks_by_executor(self) -> dict[str, int]:
        """Tasks each executor has run so far."""
        return {e["id"]: e["totalTasks"] for e in self.executors()}

    def running_tasks(self) -> int:
        app = self.get("/applications")[0]["id"]
        return sum(s.get("numActiveTasks", 0) for s in self.get(f"/applications/{app}/stages?status=active"))


@contextlib.contextmanager
def attached_cluster(base: Path, workers: int) -> Iterator[AttachedCluster]:
    """A master, `workers` workers and a Connect server on them, all on free ports under `base` (tests, the
    bench): never the stack's own."""
    master, master_ui, connect_port, ui_port = free_ports(4)
    cluster = cluster_up(base / "cluster", workers, ClusterPorts(master, master_ui, 0))
    try:
        start_spark_connect(base / "connect", connect_port, cluster.master_url, {
            **executor_conf(workers), "spark.ui.enabled": "true", "spark.ui.port": str(ui_port)})
        try:
            yield AttachedCluster(cluster, f"sc://127.0.0.1:{connect_port}", ui_port)
        finally:
            stop_pidfile("spark connect", base / "connect" / "spark-connect.pid")
    finally:
        cluster_down(base / "cluster")
