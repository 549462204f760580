"""How a `rowrelay` command ends: its exit codes, and a process end that no library's thread or exit hook can hold.

    0    done: what was asked was done (or there was nothing to do, as for a backfill of a table up to date)
    1    failed or refused: an error a message names (a server away, a table missing, a run failed), nothing more
         was done than it says
    2    usage: a bad command line, rowrelay.yaml or DAGSTER_HOME (argparse's own code); nothing was done
    3    not final yet: a backfill found rows to send, but none final within --settle-timeout (an open
         transaction, settle_seconds): nothing was cut; run it again once they are
    130  interrupted by Ctrl-C (SIGINT), 143 by SIGTERM (128 + the signal, as a shell reports it)
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

OK = 0
FAILED = 1
USAGE = 2
NOT_FINAL = 3
INTERRUPTED = 128 + signal.SIGINT

# After Ctrl-C or SIGTERM, and after a command returns: how long the process may take to end. PySpark's Connect
# client retries a server that is gone for many minutes (its exit hook releasing the session, the session-release
# thread, a read under way), and Dagster defers an interrupt during a step; neither may keep the process alive.
END_GRACE_S = 6.0

_signalled: list[int] = []


def interrupted_code(code: int) -> int:
    """The exit code for `code` once a signal interrupted the command: 128 + that signal (SIGTERM arrives as
    Dagster's KeyboardInterrupt, which would otherwise report 130)."""
    return 128 + _signalled[0] if _signalled and code == INTERRUPTED else code


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def bound_process_end(command: str) -> None:
    """Installed by the `rowrelay` process itself (not by a caller of `main` in its own process): SIGTERM ends a
    command as Ctrl-C does, and from the first of the two the process ends within END_GRACE_S whatever holds it
    (a second one ends it at once). The watch reads the signal wakeup fd in a thread of its own: Python runs signal
    handlers only when the main thread runs Python code, and a main thread blocked in a gRPC call never does."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, _raise_interrupt)

    def watch() -> None:
        while True:
            for signum in os.read(read_fd, 64):
                if signum not in (signal.SIGINT, signal.SIGTERM):
                    continue
                if _signalled:
                    os._exit(128 + _signalled[0])
                _signalled.append(signum)
                threading.Thread(target=end_within, args=(END_GRACE_S, 128 + signum, f"rowrelay: {command} "
                                 f"interrupted ({signal.Signals(signum).name}) and still held after {END_GRACE_S:g} "
                                 "s (a server that does not answer): ending now; what committed stays committed"),
                                 daemon=True, name="rowrelay-end").start()

    threading.Thread(target=watch, daemon=True, name="rowrelay-signals").start()


def end_within(seconds: float, code: int, message: str | None = None) -> None:
    """Sleep `seconds`, then end the process with `code` (after flushing its output), whatever still runs."""
    time.sleep(seconds)
    if message:
        print(message, file=sys.stderr, flush=True)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def finish(code: int) -> int:
    """`code` for the process to exit with, the exit bounded: the exit hooks (PySpark's, Dagster's) get
    END_GRACE_S, then the process ends anyway with the same code."""
    code = interrupted_code(code)
    threading.Thread(target=end_within, args=(END_GRACE_S, code), daemon=True, name="rowrelay-exit").start()
    return code
