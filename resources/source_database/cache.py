"""The one cache type of the source database: answers kept for the process, bounded, safe across threads."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

_Answer = TypeVar("_Answer")


class KeptAnswers:
    """Answers kept for the process: a bounded map (least recently used out), safe across threads."""

    def __init__(self, limit: int = 4096) -> None:
        self._answers: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def answer(self, key: tuple[Any, ...], ask: Callable[[], _Answer]) -> _Answer:
        """The answer kept for `key`, else `ask()`'s (asked outside the lock: it is a query), then kept."""
        with self._lock:
            if key in self._answers:
                self._answers.move_to_end(key)
                return self._answers[key]
        value = ask()
        with self._lock:
            self._answers[key] = value
            self._answers.move_to_end(key)
            while len(self._answers) > self._limit:
                self._answers.popitem(last=False)
        return value

    def forget(self, key: tuple[Any, ...]) -> None:
        with self._lock:
            self._answers.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._answers.clear()


# Answers about settled rows. Rows at or below a table's safe high watermark are final (rowrelay's premise:
# append-only tables, and no transaction that could still insert below that watermark is open), so what the cut
# and the read ask about them cannot change. A `rowrelay backfill` asks the same questions several times (its early
# read, its cut, the bar's total, the run's own read): each is answered once. Callers pass `settled=True` only for
# ranges at or below the safe watermark; a check that must see the source as it is now (`slice_parity`'s recount)
# never does. One per process: the early read, the cut and the run each hold their own SourceDatabaseResource.
SETTLED_ANSWERS = KeptAnswers()
