"""Points where tests hold the source's work: `observe_pause` holds `observe` on its own connection (the window between
two of its reads), to drive another session's statements into that window deterministically. Set it on the package
(`resources.source_database.observe_pause`), which forwards it here."""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa


def _no_pause(point: str, conn: sa.Connection) -> None:
    """`observe_pause` outside tests: nothing."""


observe_pause: Callable[[str, sa.Connection], None] = _no_pause
