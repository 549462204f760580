"""The progress a `rowrelay backfill` shows while its runs execute: a live bar on a terminal, else a line per
committed slice."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

from resources.exactly_once import ProgressTail, live_records, read_progress_history, records_in_range
from resources.slices import SliceRange, watermark_text


class BackfillProgress:
    """Slices and rows a backfill has committed, from Kafka's progress (the authority), polled in a thread while
    the runs execute, so the display advances per slice, not per run. A live rich bar on a TTY (slices, rows,
    rows/s, ETA); otherwise one plain line per committed slice."""

    def __init__(self, table_id: str, kafka: dict[str, Any], channel: Any, slices: list[Any], committed_hi: int,
                 total_rows: int, tty: bool, poll_s: float = 0.5) -> None:
        self.table_id, self.kafka, self.channel = table_id, kafka, channel
        self.slices, self.start_hi, self.total_rows = slices, committed_hi, max(total_rows, 1)
        self.tty, self.poll_s = tty, poll_s
        self.seen_hi, self.rows = committed_hi, 0
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rowrelay-backfill-progress", daemon=True)
        self._bar: Any = None
        self._task: Any = None
        self._term: Any = None

    def __enter__(self) -> BackfillProgress:
        if self.tty:
            # Runs execute in this process, and Dagster's compute-log capture points fds 1 and 2 at the run's log
            # files while a step runs: rich would see no terminal and stop drawing. Draw on a duplicate of the
            # terminal's fd, taken now.
            self._term = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
            console = Console(file=self._term, width=shutil.get_terminal_size().columns)
            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                                 TextColumn("{task.fields[slices]} slices"), TextColumn("{task.fields[rows]} rows"),
                                 TextColumn("{task.fields[rate]} rows/s"), TextColumn("ETA"), TimeRemainingColumn(),
                                 console=console)
            self._bar.start()
            self._task = self._bar.add_task(self.table_id, total=self.total_rows, **self._fields())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._advance()  # the last slices, committed since the previous poll
        if self._bar is not None:
            self._bar.stop()
            self._term.close()

    def _fields(self) -> dict[str, str]:
        done = sum(1 for s in self.slices if s.hi <= self.seen_hi)
        return {"slices": f"{done}/{len(self.slices)}", "rows": f"{self.rows:,}/{self.total_rows:,}",
                "rate": f"{self.rows / max(time.monotonic() - self.started, 1e-3):,.0f}"}

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with contextlib.suppress(Exception):  # a failed poll only delays the display, never the backfill
                self._advance()

    def _advance(self) -> None:
        # One long-lived reader, re-read only when the topic moved: polling costs the backfill next to nothing.
        progress = ProgressTail.for_channel(self.kafka, self.channel).read(timeout=10)
        if progress is None or progress.hi <= self.seen_hi:
            return
        # Only on a change: the new slices' own row counts, found by search (not a read of all history).
        new = records_in_range(self.kafka, self.channel, SliceRange(self.seen_hi, progress.hi), timeout=10)
        if not new:  # not tiled by slices (a reset in between): read the history
            new = [r for r in live_records(read_progress_history(self.kafka, self.channel, timeout=10))
                   if r.hi > r.lo and self.seen_hi < r.hi <= progress.hi]
        self.seen_hi = progress.hi
        self.rows += sum(r.rows for r in {r.slice: r for r in new}.values())
        fields = self._fields()
        if self._bar is not None:
            self._bar.update(self._task, completed=min(self.rows, self.total_rows), **fields)
            return
        elapsed = time.monotonic() - self.started
        rate = self.rows / max(elapsed, 1e-3)
        eta = (self.total_rows - self.rows) / rate if rate > 0 else float("nan")
        upto = watermark_text(self.seen_hi, bool(self.slices) and self.slices[0].timestamps)
        print(f"{self.table_id}: committed up to {upto}: {fields['slices']} slices, {fields['rows']} rows "
              f"({100 * self.rows / self.total_rows:.0f}%), {fields['rate']} rows/s, ETA {eta:.0f} s", flush=True)
