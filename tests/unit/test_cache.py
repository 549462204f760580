"""rowrelay's one cache type (resources/cache.py): kept answers, a time to live, a bound."""

from __future__ import annotations

import pytest

from resources.cache import KeptAnswers


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_answer_is_trusted_for_its_time_to_live_only() -> None:
    clock = _Clock()
    kept: KeptAnswers[str, bool] = KeptAnswers(ttl_s=60.0, clock=clock)
    kept.keep("t", True)
    clock.now += 59.9
    assert kept.get("t") is True
    clock.now += 0.1  # 60 s after it was kept: asked again, as the hand-written caches did
    assert kept.get("t") is None
    assert len(kept) == 0  # an expired answer is dropped when found


def test_without_a_time_to_live_an_answer_is_kept_for_good() -> None:
    clock = _Clock()
    kept: KeptAnswers[str, int] = KeptAnswers(clock=clock)
    kept.keep("t", 1)
    clock.now += 10**9
    assert kept.get("t") == 1


def test_get_tells_a_kept_none_from_no_answer_by_its_default() -> None:
    kept: KeptAnswers[str, int | None] = KeptAnswers()
    missing = object()
    assert kept.get("t", missing) is missing
    kept.keep("t", None)
    assert kept.get("t", missing) is None


def test_answer_asks_once_until_the_answer_expires_or_is_forgotten() -> None:
    clock, asked = _Clock(), []
    kept: KeptAnswers[tuple[str, int], str] = KeptAnswers(ttl_s=10.0, clock=clock)

    def ask() -> str:
        asked.append(1)
        return f"shape {len(asked)}"

    assert kept.answer(("t", 1), ask) == "shape 1"
    assert kept.answer(("t", 1), ask) == "shape 1"
    clock.now += 10.0
    assert kept.answer(("t", 1), ask) == "shape 2"
    kept.forget(("t", 1))
    assert kept.answer(("t", 1), ask) == "shape 3"
    kept.clear()
    assert kept.answer(("t", 1), ask) == "shape 4"


def test_answer_keeps_nothing_when_asking_raises() -> None:
    kept: KeptAnswers[str, int] = KeptAnswers()

    def refuse() -> int:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        kept.answer("t", refuse)
    assert kept.get("t") is None and len(kept) == 0


def test_keep_new_keeps_only_an_unknown_or_expired_key_and_leaves_the_first_time() -> None:
    clock = _Clock()
    kept: KeptAnswers[str, bool] = KeptAnswers(ttl_s=30.0, clock=clock)
    assert kept.keep_new("line", True)
    clock.now += 20.0
    assert not kept.keep_new("line", True)  # does not restart the window
    clock.now += 10.0
    assert kept.keep_new("line", True)


def test_over_the_limit_expired_answers_go_first_then_the_least_recently_used() -> None:
    clock = _Clock()
    kept: KeptAnswers[str, int] = KeptAnswers(limit=2, ttl_s=30.0, clock=clock)
    kept.keep("old", 0)
    clock.now += 30.0
    kept.keep("a", 1)
    kept.keep("b", 2)  # "old" has expired: it goes, not "a"
    assert kept.get("a") == 1 and kept.get("b") == 2
    assert kept.get("a") == 1  # used last: "b" is now the least recently used
    kept.keep("c", 3)
    assert kept.get("b") is None and kept.get("a") == 1 and kept.get("c") == 3
