"""Errors of the source database: what cannot be read as configured, and what to do about it."""

from __future__ import annotations

from resources.errors import RowrelayError


class SourceError(RowrelayError, ValueError):
    """A configured table cannot be read as configured; the message says what to change."""


class SchemaChanged(SourceError):
    """Columns changed since the last committed slice and the table's on_schema_change is `fail`."""


class SchemaRaced(RowrelayError, RuntimeError):
    """The table's columns changed while a slice was read: which columns its rows were read with is not known, so
    nothing of it is published; read again, it is read (and recorded) with the columns the table has then."""


def null_watermark_error(table_id: str, watermark: str, committed: str | None) -> SourceError:
    """Rows with a NULL watermark are never in any slice. Filling them is only a fix above the committed watermark:
    a value at or below it falls in a slice already published, and the row would still never be sent."""
    fill = ("fill them with values above the table's committed watermark " + committed + " (a row filled at or "
            "below it falls in a slice already published and is never sent either)") if committed else "fill them"
    return SourceError(f"{table_id}: rows with NULL in watermark column {watermark!r} would never be sent; make the "
                       f"column NOT NULL and {fill}")


class InnodbTrxStale(RowrelayError, RuntimeError):
    """MariaDB's innodb_trx cache stayed stale past observe's wait, so which transactions are open is unknown
    right now: observe refuses rather than answers wrong, and asking again later (the next tick) is the remedy."""


def invalid_datetime_message(label: str, column: str, value: str) -> str:
    """Why a MariaDB/MySQL DATETIME watermark holding a zero date, or a zero month or day, cannot be relayed."""
    return (f"{label}: watermark column {column!r} holds {value!r}, a DATETIME with a zero date, month or day (an "
            "sql_mode without NO_ZERO_DATE and NO_ZERO_IN_DATE accepts them), which is no time rowrelay can carry or "
            "order, so no slice can be cut at it. Fix those rows (UPDATE them to real times), or leave them out: zero "
            "dates lie below every time, so a `start_after` skips them; others, unless one is the table's newest, "
            f"with `where: {column} >= '1000-01-01' AND MONTH({column}) > 0 AND DAYOFMONTH({column}) > 0` in "
            "rowrelay.yaml. Add NO_ZERO_DATE,NO_ZERO_IN_DATE to the server's sql_mode to keep new ones out. Nothing "
            "of such a slice was sent")

