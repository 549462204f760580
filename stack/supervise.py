"""Run a command so that one Ctrl-C (or SIGTERM, SIGHUP) stops it and every process it started, within seconds.

    python -m stack.supervise -- dagster dev ...

`make run`'s `dagster dev` starts a webserver, a daemon and code servers (and the daemon's run workers); on Ctrl-C
it asks them to stop and waits, and they did not all stop: a second Ctrl-C and SIGTERM to the group left them
running. The command runs in a process group of its own, away from the terminal's signals, and on the first signal
the whole group is asked to stop (SIGINT: dagster dev's own shutdown), then told to (SIGTERM), then killed
(SIGKILL), STOP_S in all; a second signal kills it at once. The same when the command ends by itself and leaves
processes behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

# Seconds the group is given after SIGINT, then after SIGTERM, before SIGKILL: well within the 10 s a user waits.
ASK_S = 4.0
TELL_S = 2.5
STOP_S = ASK_S + TELL_S


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)


def stop_group(proc: subprocess.Popen[bytes], again: threading.Event) -> None:
    """SIGINT, SIGTERM, SIGKILL to the command's process group, each once the one before has had its time (or at
    once when `again` is set: a second Ctrl-C). `proc` is reaped as it ends, so a group of one zombie is empty."""
    pgid = proc.pid
    for signum, wait_s in ((signal.SIGINT, ASK_S), (signal.SIGTERM, TELL_S)):
        signal_group(pgid, signum)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not again.is_set():
            proc.poll()
            if not group_alive(pgid):
                return
            time.sleep(0.1)
        if again.is_set():
            break
    signal_group(pgid, signal.SIGKILL)
    proc.wait()


def supervise(argv: list[str]) -> int:
    """Run `argv` in a process group of its own until it ends or a signal comes; return its exit code (128 + the
    signal if one stopped it)."""
    stopping, again = threading.Event(), threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        (again if stopping.is_set() else stopping).set()
        received.append(signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, process_group=0)
    while proc.poll() is None and not stopping.wait(0.2):
        pass
    if stopping.is_set():
        print(f"\nstopping {os.path.basename(argv[0])} and everything it started (at most {STOP_S:g} s; again to "
              "stop at once)", file=sys.stderr, flush=True)
    stop_group(proc, again)  # also what an ending command left behind
    return 128 + received[0] if received else proc.returncode


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m stack.supervise -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    return supervise(args)


if __name__ == "__main__":
    sys.exit(main())
