"""The shape of a relayed table, dialect-neutral: its reflected columns and watermark (`TableShape`), how the columns
read differ from the last committed slice's (`schema_change`), and the predicates every query of its rows shares."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import sqlalchemy as sa

from resources.slices import RowSkip, datetime_to_micros, micros_sql_text, micros_to_datetime, watermark_text
from resources.source_database.errors import SourceError, invalid_datetime_message
from resources.source_database.rendering import charset_checked, read_as_text, read_rules, source_rendering

# Watermarks travel as signed 64-bit integers (Spark longs, slice keys, Kafka headers).
MAX_WATERMARK = 2**63 - 1
# The range of a timestamp watermark (Python's datetime: years 1 to 9999), in microseconds since 1970 UTC.
MIN_MICROS = datetime_to_micros(datetime.min)
MAX_MICROS = datetime_to_micros(datetime.max)
# The names of rowrelay's own columns beside a slice's (FRAME_WATERMARK, `TableShape.text_column`, `tie_order`,
# `utf8_shadows`): a source column may not take one.
INTERNAL_PREFIX = "__rowrelay_"
# A timestamp watermark's microseconds since 1970 UTC, computed in Spark next to the slice's columns.
FRAME_WATERMARK = f"{INTERNAL_PREFIX}watermark"



def below_step_in_reach(value: int, clock: int, step: int) -> int:
    """A timestamp candidate `value` kept below what a transaction starting at `clock` (microseconds, in the
    values' frame) may still write, where writers write times in steps of `step` microseconds (truncated, or rounded
    up to the next step: PostgreSQL's CURRENT_TIMESTAMP(0)): nothing from the start of the step `value` lies in, if
    that is at or past the clock's step. A value of whole steps stops one microsecond below itself; a finer value in
    the clock's step (a microsecond writer's, beside whole-second ones) below the step's start. A step of 1: as it
    is."""
    if step > 1 and value >= clock // step * step:
        return value // step * step - 1
    return value


@dataclass(frozen=True)
class ColumnInfo:
    name: str
    type_name: str
    nullable: bool
    is_json: bool
    is_integer: bool
    source_text: str = ""  # a PG_/MYSQL_TEXT_RENDERING kind: the source renders the column's JSON text
    # MariaDB/MySQL text in a UTF-8 charset, read as its bytes and checked in Spark (messages.py): the JDBC driver
    # replaced bytes that are not valid UTF-8 (an encoded surrogate, which MariaDB accepts) with U+FFFD, silently.
    utf8_bytes: bool = False
    # MariaDB/MySQL text in another charset that has bytes with no character (ascii above 7F, greek, sjis...; a
    # binary connection stores them as they come): the server converted them to '?' for the driver, silently. Read
    # as its UTF-8 bytes where it converted exactly, else as a byte no UTF-8 has (`charset_checked`; utf8_bytes then
    # stops the read).
    charset: str = ""
    # A MariaDB LONGTEXT column in a UTF-8 charset that may be JSON (a json_valid() check, or a view's), which the
    # driver marks as such only while the column is read as text: read as text, with its bytes beside it
    # (`TableShape.utf8_shadows`) checked in its place.
    utf8_shadow: bool = False


@dataclass(frozen=True)
class TableShape:
    """The reflected columns rowrelay will read, in order, with the watermark among them."""

    dialect: str
    schema: str | None
    name: str
    columns: tuple[ColumnInfo, ...]
    watermark: str
    where: str | None = None  # the table's row filter (rowrelay.yaml `where:`), in the source's SQL
    # integer: the value itself. timestamp (zone-less: PostgreSQL timestamp, MariaDB DATETIME) / timestamptz: carried
    # as microseconds since 1970-01-01 UTC, a zone-less value read as UTC (never shifted between zones).
    watermark_kind: Literal["integer", "timestamp", "timestamptz"] = "integer"
    tie_break: str | None = None  # orders rows that share one watermark value
    # The timestamp watermark's declared step in microseconds: 1 for 6 fractional digits, 1,000,000 for whole seconds
    # (PostgreSQL timestamp(0), MariaDB DATETIME). A coarser column lets a transaction that starts after the max was
    # seen write that same max (see `observe`, which also takes the step its values show).
    watermark_unit: int = 1

    @property
    def timestamps(self) -> bool:
        return self.watermark_kind != "integer"

    @property
    def label(self) -> str:
        """[schema.]table, as messages name the table."""
        return f"{self.schema}.{self.name}" if self.schema else self.name

    @property
    def watermark_id(self) -> tuple[str, str]:
        """(column, kind): what a progress record says its value is of (`watermark_change`)."""
        return self.watermark, self.watermark_kind

    @property
    def frame_watermark(self) -> str:
        """The watermark's column in a slice's Spark frame: a timestamp's microseconds are a column of their own."""
        return FRAME_WATERMARK if self.timestamps else self.watermark

    def watermark_sql_literal(self, value: int) -> str:
        """A watermark as an SQL literal: the integer, or a timestamp as the source reads it whatever its session's
        zone."""
        if self.watermark_kind == "integer":
            return str(int(value))
        text = micros_sql_text(value)
        if self.watermark_kind == "timestamptz":
            return f"TIMESTAMPTZ '{text}+00:00'"
        return f"TIMESTAMP '{text}'"

    def watermark_param(self, value: int) -> int | datetime:
        """A watermark as the database compares it: a datetime of the column's own kind for a timestamp."""
        if self.watermark_kind == "integer":
            return value
        moment = micros_to_datetime(min(max(value, MIN_MICROS), MAX_MICROS))  # datetime's range: years 1-9999
        return moment if self.watermark_kind == "timestamptz" else moment.replace(tzinfo=None)

    def watermark_value(self, value: Any) -> int:
        """A watermark as the database returned it (an int, a Decimal, a datetime), as rowrelay carries it."""
        if isinstance(value, datetime):
            return datetime_to_micros(value)
        if isinstance(value, str) and self.timestamps:  # pymysql's text of a DATETIME no datetime holds
            raise SourceError(invalid_datetime_message(self.label, self.watermark, value))
        return int(value)

    def watermark_text(self, value: int) -> str:
        """For error messages: the value, or the time a timestamp watermark stands for (as in keys and the CLI)."""
        return watermark_text(value, self.timestamps)

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    def text_column(self, index: int) -> str:
        """The name of the source-rendered text of the column at `index` (by position: a name built from the
        column's own name could pass PostgreSQL's 63-byte identifier limit)."""
        return f"__rowrelay_text_{index}"

    @property
    def tie_order(self) -> str | None:
        """The column of each row's place among the rows of its watermark value in `tie_break` order, where the
        tie_break itself is read as text (`read_as_text`: sorted in Spark it would put 10 before 9); None where
        Spark sorts the tie_break as the source does."""
        if self.tie_break is None or not read_as_text(self.dialect, self.column(self.tie_break).type_name):
            return None
        return "__rowrelay_tie_order"

    @property
    def utf8_shadows(self) -> dict[str, str]:
        """Column name -> the column of its bytes, for the columns read as text whose bytes are checked
        (`ColumnInfo.utf8_shadow`)."""
        return {c.name: f"__rowrelay_bytes_{i}" for i, c in enumerate(self.columns) if c.utf8_shadow}

    @property
    def source_texts(self) -> dict[str, str]:
        """Column name -> its source-rendered text column, for the columns the source renders."""
        return {c.name: self.text_column(i) for i, c in enumerate(self.columns) if c.source_text
                and source_rendering(c.source_text, "")[1]}

    def rendered_select(self, quote: Callable[[str], str]) -> str | None:
        """The select list of a slice read where the source renders some columns' text (None: none does).

        Each rendered column also comes raw where its text does not serve (`source_rendering`), so the JDBC driver
        skips parsing the others; the watermark and tie_break stay whole (the read filters and sorts on them).
        MariaDB/MySQL: always a select list, naming every column: `SELECT *` leaves INVISIBLE columns out, which the
        reflected columns include."""
        rules = read_rules(self.dialect)
        if (not any(c.source_text or c.utf8_bytes or c.utf8_shadow for c in self.columns) and not self.tie_order
                and not rules.names_every_column):
            return None
        whole = {self.watermark, self.tie_break}
        rendered = self.source_texts
        shadows = self.utf8_shadows
        items: list[str] = []
        texts: list[str] = []
        for c in self.columns:
            q = quote(c.name)
            if c.utf8_shadow:
                items.append(q)
                texts.append(f"CAST({q} AS BINARY) AS {quote(shadows[c.name])}")
                continue
            if c.utf8_bytes and c.charset:  # never the watermark (table_shape)
                items.append(f"{charset_checked(q, c.charset)} AS {q}")
                continue
            if c.utf8_bytes:
                items.append(f"CAST({q} AS BINARY) AS {q}")
                continue
            if not c.source_text:
                items.append(q)
                continue
            raw, text = source_rendering(c.source_text, q)
            # A kept-whole column's raw select must still sort as the column: a FLOAT's exact double does (and is the
            # only exact text it has), the date and time kinds' raw selects are NULL wherever their text serves.
            items.append(q if c.name in whole and c.source_text != "mysql_float" else f"{raw} AS {q}")
            if c.name in rendered:  # else the source renders no text of its own, only the raw value
                texts.append(f"{text} AS {quote(rendered[c.name])}")
        if self.tie_order:  # whole watermark values are in one chunk and one Spark partition: numbered within
            # NULLs first, as Spark sorts them.
            texts.append(f"ROW_NUMBER() OVER (PARTITION BY {quote(self.watermark)} ORDER BY "
                         f"{quote(self.tie_break or '')}{rules.nulls_first}) AS {quote(self.tie_order)}")
        return ", ".join(items + texts)

    @property
    def json_columns(self) -> list[str]:
        return [c.name for c in self.columns if c.is_json]

    def column(self, name: str) -> ColumnInfo:
        return next(c for c in self.columns if c.name == name)

    @property
    def schema_columns(self) -> list[list[str]]:
        """[name, type] of each column read, in order: what a slice's progress record keeps."""
        return [[c.name, c.type_name] for c in self.columns]

    @property
    def fingerprint(self) -> str:
        return schema_fingerprint(self.schema_columns)


def schema_fingerprint(columns: list[list[str]]) -> str:
    """A short, stable digest of the columns read ([name, type] pairs, in order)."""
    return hashlib.sha256(json.dumps(columns, separators=(",", ":")).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class SchemaChange:
    """How the columns read differ from the last committed slice's."""

    added: list[str]
    dropped: list[str]
    retyped: list[str]  # "name: OLD -> NEW"
    # The columns both have, in their new order, where it changed (`columns:` reordered, a MariaDB `ALTER ...
    # AFTER`): each message's fields come in column order, and a hash_row key hashes them as they come.
    reordered: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.dropped or self.retyped or self.reordered)

    def describe(self) -> str:
        parts = [f"{label} {', '.join(names)}" for label, names in
                 (("added", self.added), ("dropped", self.dropped), ("retyped", self.retyped),
                  ("reordered to", self.reordered)) if names]
        return "; ".join(parts)


def schema_change(before: list[list[str]], after: list[list[str]]) -> SchemaChange:
    """Columns added, dropped, retyped or reordered from `before` to `after` ([name, type] pairs)."""
    old, new = dict((n, t) for n, t in before), dict((n, t) for n, t in after)
    kept_before, kept_after = [n for n in old if n in new], [n for n in new if n in old]
    return SchemaChange(added=[n for n in new if n not in old], dropped=[n for n in old if n not in new],
                        retyped=[f"{n}: {old[n]} -> {t}" for n, t in new.items() if n in old and old[n] != t],
                        reordered=kept_after if kept_after != kept_before else [])


def skipped_rows_predicate(shape: TableShape, skip: Sequence[RowSkip]) -> sa.ColumnElement[bool]:
    """The rows `skip` names: those at a bare entry's watermark, and each row whose watermark and named columns
    hold an entry's values (a column compared as the source renders it as text; a NULL matches no value). The
    watermarks as the source's own literals, so that the same predicate runs as a query and inside Spark's read."""
    wm = sa.column(shape.watermark)

    def at(w: int) -> sa.ColumnElement[Any]:
        return sa.literal_column(shape.watermark_sql_literal(w))

    bare = sorted({s.watermark for s in skip if s.bare})
    parts: list[sa.ColumnElement[bool]] = [wm.in_([at(w) for w in bare])] if bare else []
    for s in skip:
        if not s.bare:
            parts.append(sa.and_(wm == at(s.watermark), *(
                sa.and_(sa.column(c).is_not(None), sa.cast(sa.column(c), sa.String) == sa.literal(v, sa.String))
                for c, v in s.match)))
    return sa.or_(*parts)



def table_clause(shape: TableShape, *more: str) -> sa.TableClause:
    """The table as SQLAlchemy's clause, with its watermark column and `more` (once each)."""
    return sa.table(shape.name, *(sa.column(c) for c in dict.fromkeys((shape.watermark, *more))), schema=shape.schema)


def filtered(q: sa.Select, shape: TableShape, watermark: sa.ColumnElement | None = None,
             skip: Sequence[RowSkip] | None = None) -> sa.Select:
    """Counts, cuts, reads and the lag's oldest row see the same rows: the table's `where:` (its own SQL), as one
    predicate, and, given the `watermark` column, none of the rows `skip` names."""
    if shape.where:
        # A literal, not sa.text: a `:word` inside the predicate's strings (`note <> ':draft'`, JSON) is SQL, not a
        # bind parameter.
        q = q.where(sa.literal_column(f"({shape.where})"))
    if skip and watermark is not None:
        q = q.where(sa.not_(skipped_rows_predicate(shape, skip)))
    return q


def skip_sql(dialect: sa.Dialect, shape: TableShape, skip: Sequence[RowSkip]) -> str:
    """`filtered`'s skip as the source's SQL text (literals inline), for the slice read Spark sends."""
    return str(sa.not_(skipped_rows_predicate(shape, skip)).compile(
        dialect=dialect, compile_kwargs={"literal_binds": True}))
