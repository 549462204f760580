"""The source database's kept answers; their type, `KeptAnswers`, is rowrelay's one cache type (resources/cache.py)."""

from __future__ import annotations

from typing import Any

from resources.cache import KeptAnswers

__all__ = ["SETTLED_ANSWERS", "KeptAnswers"]


# Answers about settled rows. Rows at or below a table's safe high watermark are final (rowrelay's premise:
# append-only tables, and no transaction that could still insert below that watermark is open), so what the cut
# and the read ask about them cannot change. A `rowrelay backfill` asks the same questions several times (its early
# read, its cut, the bar's total, the run's own read): each is answered once. Callers pass `settled=True` only for
# ranges at or below the safe watermark; a check that must see the source as it is now (`slice_parity`'s recount)
# never does. One per process: the early read, the cut and the run each hold their own SourceDatabaseResource.
SETTLED_ANSWERS: KeptAnswers[tuple[Any, ...], Any] = KeptAnswers()
