"""The tags a run's process sets on its run, so sensors and the launcher can tell a dead worker from a busy one."""

import functools
import os
import socket
import time
from pathlib import Path
from typing import Any

from resources.keys import WORKER_HOST_TAG, WORKER_PID_TAG, WORKER_RUN_TAG


@functools.cache  # one process, one host, boot and pid namespace; asked for each run on every sensor tick
def this_host() -> str:
    """This process's host, boot and pid namespace, as WORKER_HOST_TAG records them."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        boot, namespace = "", 0
    return f"{socket.gethostname()} boot:{boot} pidns:{namespace}"


def worker_tags(run_id: str) -> dict[str, str]:
    """The tags a run's process sets on its run when its asset starts."""
    return {WORKER_PID_TAG: str(os.getpid()), WORKER_HOST_TAG: this_host(), WORKER_RUN_TAG: run_id}


def local_worker_pid(run: Any) -> int | None:
    """The pid of the process that ran `run`, where that process set the tags itself (not copied from a parent
    run) and pids name the same processes here (this host, boot and pid namespace); None otherwise."""
    pid = run.tags.get(WORKER_PID_TAG)
    if pid is None or run.tags.get(WORKER_RUN_TAG) != run.run_id or run.tags.get(WORKER_HOST_TAG) != this_host():
        return None
    return int(pid)


def run_start_timings(stats: Any) -> dict[str, float]:
    """launch -> worker executing -> this asset's body (resources built), from Dagster's run stats."""
    out: dict[str, float] = {}
    if stats.launch_time and stats.start_time:
        out["launch_to_worker_s"] = stats.start_time - stats.launch_time
    if stats.start_time:
        out["worker_to_asset_s"] = time.time() - stats.start_time
    return out
