"""`skip_watermarks` entries that would leave out more than one row, and the advice that names one row."""

import contextlib
import json
from typing import Any

from resources.config import TableConfig
from resources.exactly_once import BadRowError, skip_advice
from resources.slices import RowSkip, SliceRange
from resources.source_database import SourceDatabaseResource, TableShape
from resources.stops import SkipOfManyRows


def refuse_skips_of_many_rows(source: SourceDatabaseResource, table: TableConfig, shape: TableShape,
                              span: SliceRange) -> None:
    """Before anything of `span` (the run's slices) is read: a skip_watermarks entry inside it that matches more
    than one row (a bare value shared by several, or a tie_break or key that does not tell them apart) is refused,
    naming the table, the entry, the count and the entry form that names one row."""
    for skip in table.skip_rows_in(span.lo, span.hi):
        if (n := source.count_skipped(shape, skip.watermark - 1, skip.watermark, [skip])) > 1:
            at = shape.watermark_text(skip.watermark)
            what = ("every row at that watermark" if skip.bare else "its columns do not tell them apart") + (
                ", within `where:`" if shape.where else "")
            raise SkipOfManyRows(
                f"{table.table_id}: skip_watermarks entry {skip.entry(shape.timestamps, table.tie_break)} matches {n} "
                f"rows ({what}), and a skip leaves out one row; nothing is published and progress stays. Name the "
                f"row: {one_row_form(table, at)}")


def one_row_form(table: TableConfig, at: str) -> str:
    """The entry form that names one row at watermark text `at`, for a user to fill in."""
    if table.tie_break is not None:
        return f"skip_watermarks: [{{watermark: {at}, tie_break: <its {table.tie_break}>}}]"
    key = ", ".join(f"{c}: <its {c}>" for c in table.key) if isinstance(table.key, list) else "<column>: <value>"
    return f"skip_watermarks: [{{watermark: {at}, key: {{{key}}}}}]"


def skip_advice_for(source: SourceDatabaseResource, table: TableConfig, shape: TableShape, bad: BadRowError) -> str:
    """The skip advice for the row `bad` stopped at: its watermark where no other row shares it, else the row named
    by its tie_break (or its key columns), read from its message; where neither can be read, the form to fill in
    and how many rows a bare value would leave out."""
    at = int(bad.watermark or 0)
    rows = source.count_rows(shape, at - 1, at)
    if rows <= 1:
        return skip_advice(shape.watermark_text(at))
    named = message_fields(bad.value, table.envelope)
    if table.tie_break is not None and bad.tie is not None:
        named[table.tie_break] = bad.tie
    for columns in ([table.tie_break] if table.tie_break else [], table.key if isinstance(table.key, list) else []):
        if columns and all(named.get(c) is not None for c in columns):
            row = RowSkip(at, tuple(sorted((c, str(named[c])) for c in columns)))
            return skip_advice(row.entry(shape.timestamps, table.tie_break))
    return (f"leave the row out by naming it ({rows} rows share its watermark, and a bare value is refused): "
            f"{one_row_form(table, shape.watermark_text(at))}")


def message_fields(value: bytes | None, envelope: bool) -> dict[str, Any]:
    """A row's columns from its message (`envelope`: under "data"), {} where unknown or not an object."""
    if value is None:
        return {}
    with contextlib.suppress(ValueError):
        row = json.loads(value)
        row = row.get("data") if envelope and isinstance(row, dict) else row
        if isinstance(row, dict):
            return {k: v for k, v in row.items() if isinstance(v, int | str) and not isinstance(v, bool)}
    return {}
