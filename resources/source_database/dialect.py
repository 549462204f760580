"""The hooks one database fills for the dialect-neutral source (resources/source_database/source.py): how it names a
column's declared type and which types it cannot read, its timestamp watermarks, the checks of a table's shape, the
look at its max watermark (`observe`), what makes its new rows unknowable final, and when they are final.

`Dialect` itself is the behaviour of a database rowrelay has no strategy for: no catalog lookups, integer
watermarks only, final after `settle_seconds` on this host's clock."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from resources.slices import WatermarkCandidate
from resources.source_database.errors import SourceError
from resources.source_database.shape import TableShape

# The newest rows whose values tell a timestamp watermark's step (`Dialect.shown_step_sql`).
SHOWN_STEP_ROWS = 16

# How a refusal of a replica tells the user to go on.
PRIMARY_REMEDY = "point the source's url at the primary and run again; nothing was cut or sent"

# How a refusal of a column type the database cannot read tells the user to send it as text.
TEXT_REMEDY = " (on MariaDB select it as CAST(... AS CHAR) in a view; on SQLite declare it TEXT: sent as a string)"

WatermarkKind = Literal["integer", "timestamp", "timestamptz"]


class Source(Protocol):
    """What a dialect's hooks use of the source they serve."""

    url: str
    tables_written_here: bool

    @property
    def engine(self) -> Engine: ...

    @property
    def sqlalchemy_url(self) -> sa.URL: ...

    @property
    def safe_description(self) -> str: ...


@dataclass(frozen=True)
class Seen:
    """One look at a table's max watermark (`Dialect.observe`), before the source turns it into a candidate."""

    max: Any  # as the database returned it; None: the table has no rows
    marker: Any  # what `is_final` compares with later: a transaction id, or a time in epoch seconds
    waits: tuple[str, ...] = ()  # the transactions the candidate waits for
    clock: Any = None  # the database clock as the writers write (a datetime), for timestamp watermarks
    table_token: str | None = None  # the table's incarnation
    shown_step: Any = None  # the step the newest values show (`Dialect.shown_step_sql`)
    earliest: int | None = None  # the start of the earliest writing statement still running
    durable_at: int | None = None  # the log position that covers every commit at or below the max


def settling(settle_seconds: float) -> str:
    return f"settle_seconds ({settle_seconds:g} s) have not passed since the max was seen"


NOT_DURABLE = "their commits are not on disk yet (the server's log is not flushed past them)"

DURABLE_WAIT_S = 1.2  # InnoDB flushes a lazily written log once a second (innodb_flush_log_at_timeout)


def flushed_within(flushed: Callable[[], bool], wait_s: float = DURABLE_WAIT_S) -> bool:
    """Whether `flushed()` turns true within `wait_s`, asked every 10 ms."""
    deadline = time.monotonic() + wait_s
    while not flushed():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def first_few(texts: list[str], few: int = 2, sep: str = "; ") -> str:
    """The first `few` of what holds a candidate, and how many more: a skip message stays readable."""
    more = f" (and {len(texts) - few} more)" if len(texts) > few else ""
    return sep.join(texts[:few]) + more


class Dialect:
    """One database's hooks; this base is the behaviour of a database without a strategy of its own."""

    # What a refusal of an unreadable column adds to its remedy (`TEXT_REMEDY` where a view can send it as text).
    text_remedy = ""

    def __init__(self, name: str) -> None:
        self.name = name

    # -- reflection ----------------------------------------------------------------------------------

    def base_type(self, col_type: Any) -> Any:
        """The type the driver reads a reflected column's values as."""
        return col_type

    def declared_type_query(self, rel: str, schema: str | None, table: str, column: str
                            ) -> tuple[str, dict[str, Any]] | None:
        """The catalog query of a column's declared type with its parameters (`rel`: the quoted table), or None."""
        return None

    def cannot_read(self, col_type: Any) -> bool:
        """Whether a type SQLAlchemy reflects as one rowrelay serializes is still one this database cannot send."""
        return False

    def text_charsets(self, source: Source, schema: str | None, table: str) -> tuple[dict[str, str], set[str]]:
        """The text columns whose values are checked on the way (`ColumnInfo.charset`, `utf8_shadow`)."""
        return {}, set()

    def source_text(self, col_type: Any) -> str:
        """The PG_/MYSQL_TEXT_RENDERING kind of a column the source renders as text, or ""."""
        return ""

    def timestamp_kind(self, label: str, watermark: str, wm_type: Any) -> WatermarkKind:
        """The kind of a timestamp watermark column, or a SourceError saying why it cannot be one."""
        raise SourceError(f"{label}: watermark column {watermark!r} has type {wm_type}; timestamp watermarks are "
                          f"supported on PostgreSQL and MariaDB/MySQL, not on {self.name} (its timestamps are "
                          "text); use an integer watermark")

    def fractional_digits(self, wm_type: Any) -> int:
        """A timestamp column's fractional digits: its precision, unset: 6."""
        digits = getattr(wm_type, "precision", None)
        return 6 if digits is None else int(digits)

    def check_shape(self, source: Source, shape: TableShape, label: str) -> None:
        """The database's own checks of a table's shape, after the dialect-neutral ones."""

    # -- the safe high watermark -----------------------------------------------------------------

    def observe(self, source: Source, conn: sa.Connection, shape: TableShape, t: sa.TableClause) -> Seen:
        """The max watermark, with what tells later when it is final: here only the time it was seen."""
        return Seen(max=conn.execute(sa.select(sa.func.max(t.c[shape.watermark])).select_from(t)).scalar(),
                    marker=time.time())

    def fraction_sql(self, column: str) -> str:
        """SQL of a timestamp value's microseconds within its second (`column`: the quoted column)."""
        raise NotImplementedError(f"no timestamp watermarks on {self.name}")

    def shown_step_sql(self, source: Source, shape: TableShape, t: sa.TableClause) -> sa.TextClause:
        """A timestamp watermark's step as its newest values show it, in microseconds, as a scalar subquery to read
        with the max: 1,000,000 if one of the SHOWN_STEP_ROWS newest rows holds a whole second, else 1,000 if one
        holds a whole millisecond, else 1 (one index scan of those rows). Any one such value counts: a table written
        by both whole-second and microsecond writers is held back a second while one of its whole seconds is among
        them (a microsecond writer's value is whole by chance once in a million, and then costs a second's wait).
        Not coarser than a second: a time truncated to the minute or the day is beyond it. NULL for an integer."""
        if not shape.timestamps:
            return sa.text("NULL")
        preparer = source.engine.dialect.identifier_preparer
        column = preparer.quote(shape.watermark)
        return sa.text(f"(SELECT MAX(CASE WHEN f = 0 THEN 1000000 WHEN MOD(f, 1000) = 0 THEN 1000 ELSE 1 END) FROM ("
                       f"SELECT {self.fraction_sql(column)} AS f FROM {preparer.format_table(t)} WHERE {column} IS NOT "
                       f"NULL ORDER BY {column} DESC LIMIT {SHOWN_STEP_ROWS}) top_values)")

    def refuse_unknowable_finality(self, source: Source, shape: TableShape, conn: sa.Connection) -> None:
        """SourceError where `is_final` cannot know when the table's new rows are final (see the source's)."""

    def not_final_because(self, source: Source, conn: sa.Connection, candidate: WatermarkCandidate,
                          settle_seconds: float) -> str | None:
        """Why `candidate` is not final yet, None when it is: here once `settle_seconds` passed on this host."""
        return None if time.time() - candidate.marker >= settle_seconds else settling(settle_seconds)
