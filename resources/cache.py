"""rowrelay's one cache type: answers kept for the process, bounded, for a time only if given one, safe across
threads. Dagster-free, so every layer (and the exactly-once protocol) keeps its answers in it."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar, overload

_Key = TypeVar("_Key", bound=Hashable)
_Answer = TypeVar("_Answer")
_Default = TypeVar("_Default")


class KeptAnswers(Generic[_Key, _Answer]):
    """Answers kept for the process: a bounded map (least recently used out), each answer trusted for `ttl_s`
    seconds after it was kept (None: for good). `clock` is for tests; by default `time.monotonic`, looked up at
    each call, so a test that patches it moves every cache's clock too."""

    def __init__(self, limit: int = 4096, ttl_s: float | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self._answers: OrderedDict[_Key, tuple[float, _Answer]] = OrderedDict()
        self._limit = limit
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()

    def _now(self) -> float:
        return self._clock() if self._clock is not None else time.monotonic()

    def _fresh(self, key: _Key, now: float) -> tuple[float, _Answer] | None:
        """The kept (time, answer) for `key` if still trusted, an expired one dropped. Called under the lock."""
        kept = self._answers.get(key)
        if kept is None:
            return None
        if self._ttl_s is not None and now - kept[0] >= self._ttl_s:
            del self._answers[key]
            return None
        self._answers.move_to_end(key)
        return kept

    def _keep(self, key: _Key, value: _Answer, now: float) -> None:
        """Keep `value` for `key` as of `now`; over the limit, expired answers go first, then the least recently
        used. Called under the lock."""
        self._answers[key] = (now, value)
        self._answers.move_to_end(key)
        if len(self._answers) > self._limit and self._ttl_s is not None:
            ttl_s = self._ttl_s
            for stale in [k for k, (at, _) in self._answers.items() if now - at >= ttl_s]:
                del self._answers[stale]
        while len(self._answers) > self._limit:
            self._answers.popitem(last=False)

    @overload
    def get(self, key: _Key) -> _Answer | None: ...

    @overload
    def get(self, key: _Key, default: _Default) -> _Answer | _Default: ...

    def get(self, key: _Key, default: object = None) -> object:
        """The answer kept for `key` and still trusted, else `default`."""
        with self._lock:
            kept = self._fresh(key, self._now())
        return default if kept is None else kept[1]

    def keep(self, key: _Key, value: _Answer) -> None:
        """Keep `value` for `key`, trusted for `ttl_s` from now."""
        with self._lock:
            self._keep(key, value, self._now())

    def keep_new(self, key: _Key, value: _Answer) -> bool:
        """Keep `value` for `key` unless an answer for it is still trusted (that one stays, its time unchanged);
        True if kept. One step under the lock: of two threads keeping the same key, one wins."""
        with self._lock:
            now = self._now()
            if self._fresh(key, now) is not None:
                return False
            self._keep(key, value, now)
            return True

    def answer(self, key: _Key, ask: Callable[[], _Answer]) -> _Answer:
        """The answer kept for `key`, else `ask()`'s (asked outside the lock: it is a query), then kept as of the
        moment it was asked."""
        with self._lock:
            now = self._now()
            kept = self._fresh(key, now)
        if kept is not None:
            return kept[1]
        value = ask()
        with self._lock:
            self._keep(key, value, now)
        return value

    def forget(self, key: _Key) -> None:
        with self._lock:
            self._answers.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._answers.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._answers)
