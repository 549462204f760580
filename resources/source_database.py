"""Source database resource: cheap metadata queries over SQLAlchemy (reflection, watermarks, safety)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import threading
import time
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, TypeVar

import sqlalchemy as sa
from dagster import ConfigurableResource
from pydantic import PrivateAttr
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import NoSuchTableError

from resources.config import ConfigError, SourceConfig, env_names, resolve_url_env
from resources.jdbc import UrlParameterError, jdbc_options
from resources.slices import (
    RowSkip,
    WatermarkCandidate,
    datetime_to_micros,
    micros_sql_text,
    micros_to_datetime,
    watermark_text,
)

# SQLAlchemy type classes rowrelay serializes exactly (see resources/messages.py).
SUPPORTED_TYPES: tuple[type, ...] = (
    sa.Integer, sa.Numeric, sa.Float, sa.Boolean, sa.String, sa.Text, sa.Enum, sa.DateTime, sa.Date,
    sa.types._Binary, sa.JSON, sa.Uuid,
)

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

# Virtual transaction ids of the transactions open now in this database, other than ours. Every transaction
# holds the lock on its own vxid from its start, with or without an xid (pg_locks shows fast-path locks too).
_PG_OPEN_VXIDS = (
    "SELECT l.virtualxid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
    "WHERE l.locktype = 'virtualxid' AND l.granted AND l.pid <> pg_backend_pid() "
    "AND a.datid = (SELECT oid FROM pg_database WHERE datname = current_database())"
)

# A statement that only reads (MariaDB's processlist text, after comments): it writes no row of the table.
_READ_STATEMENT = re.compile(r"^(\s|/\*.*?\*/|--[^\n]*\n|#[^\n]*\n)*(SELECT|WITH|SHOW)\b", re.IGNORECASE | re.DOTALL)
# Taken off a running statement's estimated start: the processlist's elapsed time and NOW(6) come from two clocks.
_STATEMENT_START_MARGIN_S = 0.01

# Reads of innodb_trx, 150 ms apart, until one is known fresh (see `_innodb_trx_open_since`).
INNODB_TRX_READS = 14

# The newest rows whose values tell a timestamp watermark's step (`SourceDatabaseResource._shown_step_sql`).
SHOWN_STEP_ROWS = 16


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

_log = logging.getLogger(__name__)


def _no_pause(point: str, conn: sa.Connection) -> None:
    """`observe_pause` outside tests: nothing."""


# Tests hold `observe` at a named point, on its own connection (the window between two of its reads), to drive another
# session's statements into that window deterministically.
observe_pause: Callable[[str, sa.Connection], None] = _no_pause

# A type the dialect does not know is reflected as NullType with this warning; `table_shape` refuses such a column
# by its database type name, so the warning is noise. Installed once, here: warnings.catch_warnings() around each
# reflection is not thread-safe (the daemon's sensor threads reflect at once).
warnings.filterwarnings("ignore", message="Did not recognize type", category=sa.exc.SAWarning)


_Answer = TypeVar("_Answer", int, int | None)


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
# and the read ask about them cannot change. One `rowrelay backfill` asked the same questions up to three times (its
# early read, its cut, the bar's total, the run's own read): for a 1M-row slice, two scans of a million index
# entries and three counts where one scan and one count give the same answers. Callers pass `settled=True` only for
# ranges at or below the safe watermark; a check that must see the source as it is now (`slice_parity`'s recount)
# never does. One per process: the early read, the cut and the run each hold their own SourceDatabaseResource.
SETTLED_ANSWERS = KeptAnswers()

# MariaDB/MySQL engines whose new rows rowrelay can tell final (`is_final`): InnoDB by its open transactions;
# MyISAM and Aria take the whole table per writing statement, so rows become visible in the order their ids were
# drawn. A view has no engine (NULL): not checked.
_MYSQL_ENGINES_KNOWN = frozenset({"innodb", "myisam", "aria"})

# `refuse_unknowable_finality` on PostgreSQL, one statement. `reached`: the relations a read of the table takes rows
# from (itself, its partitions and inheritance children, what a view's rule reads, recursively), each with its depth (0:
# the table itself). A view's rule is its SELECT rule (ev_type '1'); a rule that writes elsewhere on INSERT reads
# nothing into this table. Then: the recovery flag; a subscription filling any of them; the first foreign table,
# materialized view or UNLOGGED relation among them; among the watermark's sequences (its serial or identity sequence,
# any its DEFAULT calls) in any of them, an UNLOGGED one first (PostgreSQL 15+: `ALTER SEQUENCE ... SET UNLOGGED` behind
# a logged table), else the most caching, with its persistence and the relation it feeds: a child's or a partition's own
# DEFAULT serves inserts made into it directly, and a view's rows take their ids from its base table; and two of those
# sequences, if the watermark takes ids from more than one (`fed`). A reached relation's watermark is its column of the
# same name, and only along relations whose ids the table's can be (`ids`): partitions, children, and the base of a view
# over one relation. A join's other tables have columns of that name too (`customers.id` beside `orders.id`): they are
# not followed (a review found such views refused), nor is a view that renames the column (docs/design.md).
_PG_FINALITY_CATALOG = """
WITH RECURSIVE reached(oid, depth, ids) AS (
    SELECT CAST(CAST(:rel AS regclass) AS oid), 0, true
    UNION
    SELECT x.oid, r.depth + 1, r.ids AND x.single FROM reached r CROSS JOIN LATERAL (
        SELECT i.inhrelid AS oid, true AS single FROM pg_inherits i WHERE i.inhparent = r.oid
        UNION ALL
        SELECT b.oid, b.bases = 1 FROM (
            SELECT v.oid, count(*) OVER () AS bases FROM (
                SELECT DISTINCT d.refobjid AS oid FROM pg_rewrite w
                JOIN pg_depend d ON d.classid = 'pg_rewrite'::regclass AND d.objid = w.oid
                    AND d.refclassid = 'pg_class'::regclass
                WHERE w.ev_class = r.oid AND w.ev_type = '1' AND d.refobjid <> r.oid) v) b) x
    WHERE r.depth < 32),
rel AS (
    SELECT c.oid, c.relkind, c.relpersistence, CAST(CAST(c.oid AS regclass) AS text) AS name,
        min(reached.depth) AS depth, bool_or(reached.ids) AS ids
    FROM reached JOIN pg_class c ON c.oid = reached.oid GROUP BY c.oid, c.relkind, c.relpersistence),
fed AS (
    SELECT q.seq, rel.name, rel.depth FROM rel
    JOIN pg_attribute a ON a.attrelid = rel.oid AND a.attname = :column AND a.attnum > 0 AND NOT a.attisdropped
    CROSS JOIN LATERAL (
        -- its serial or identity sequence (what pg_get_serial_sequence finds)
        SELECT d.objid AS seq FROM pg_depend d WHERE d.classid = 'pg_class'::regclass
            AND d.refclassid = 'pg_class'::regclass AND d.refobjid = rel.oid AND d.refobjsubid = a.attnum
            AND d.deptype IN ('a', 'i')
        UNION
        -- any sequence its DEFAULT calls
        SELECT dep.refobjid FROM pg_attrdef ad
        JOIN pg_depend dep ON dep.classid = 'pg_attrdef'::regclass AND dep.objid = ad.oid
            AND dep.refclassid = 'pg_class'::regclass
        WHERE ad.adrelid = rel.oid AND ad.adnum = a.attnum) q
    JOIN pg_sequence s ON s.seqrelid = q.seq
    WHERE :integer AND rel.ids)
SELECT pg_is_in_recovery(),
    (SELECT ARRAY[s.subname, rel.name, CAST(rel.depth AS text)] FROM pg_subscription_rel sr
        JOIN pg_subscription s ON s.oid = sr.srsubid JOIN rel ON rel.oid = sr.srrelid ORDER BY rel.depth LIMIT 1),
    (SELECT ARRAY[CASE WHEN rel.relkind IN ('f', 'm') THEN CAST(rel.relkind AS text) ELSE 'u' END, rel.name,
                  CAST(rel.depth AS text)]
        FROM rel WHERE rel.relkind IN ('f', 'm') OR rel.relpersistence = 'u'
        ORDER BY rel.relkind IN ('f', 'm') DESC, rel.depth, rel.name LIMIT 1),
    q.seqcache, CAST(CAST(q.seqrelid AS regclass) AS text), q.name, CAST(q.depth AS text), q.unlogged,
    (SELECT ARRAY[CAST(CAST(f.seq AS regclass) AS text), f.name, CAST(f.depth AS text),
                  CAST(CAST(g.seq AS regclass) AS text), g.name, CAST(g.depth AS text)]
        FROM fed f JOIN fed g ON g.seq <> f.seq ORDER BY f.depth, f.name, g.depth, g.name LIMIT 1)
FROM (SELECT 1) one LEFT JOIN LATERAL (
    SELECT s.seqcache, s.seqrelid, fed.name, fed.depth, sc.relpersistence = 'u' AS unlogged FROM fed
    JOIN pg_sequence s ON s.seqrelid = fed.seq JOIN pg_class sc ON sc.oid = fed.seq
    ORDER BY sc.relpersistence = 'u' DESC, s.seqcache DESC, fed.depth, fed.name LIMIT 1) q ON true
"""
# PostgreSQL: the WAL position each finality candidate waits to see flushed, from the first check that found its
# transactions ended, per server start (see `is_final`).
DURABLE_TARGETS = KeptAnswers()


class SourceError(ValueError):
    """A configured table cannot be read as configured; the message says what to change."""


class SchemaChanged(SourceError):
    """Columns changed since the last committed slice and the table's on_schema_change is `fail`."""


class SchemaRaced(RuntimeError):
    """The table's columns changed while a slice was read: which columns its rows were read with is not known, so
    nothing of it is published; read again, it is read (and recorded) with the columns the table has then."""


def null_watermark_error(table_id: str, watermark: str, committed: str | None) -> SourceError:
    """Rows with a NULL watermark are never in any slice. Filling them is only a fix above the committed watermark:
    a value at or below it falls in a slice already published, and the row would still never be sent."""
    fill = ("fill them with values above the table's committed watermark " + committed + " (a row filled at or "
            "below it falls in a slice already published and is never sent either)") if committed else "fill them"
    return SourceError(f"{table_id}: rows with NULL in watermark column {watermark!r} would never be sent; make the "
                       f"column NOT NULL and {fill}")


class InnodbTrxStale(RuntimeError):
    """MariaDB's innodb_trx cache stayed stale past observe's wait, so which transactions are open is unknown
    right now: observe refuses rather than answers wrong, and asking again later (the next tick) is the remedy."""


# PostgreSQL renders a date or timestamp's JSON text itself (to_char): the same text Spark's date_format gives
# (tests/test_types.py), at a fraction of the cost of the JDBC driver parsing each value and Spark formatting it
# again (a 1M-row read: Spark CPU -0.5 s, PostgreSQL +0.3 s). Years 10000 and later get ISO 8601's expanded form
# with its sign, as Spark gives them ("+12345-01-01"); past Spark's range (year 294247) its read failed with a bare
# "long overflow", and PostgreSQL goes on to 294276 (timestamps) and 5874897 (dates). +-infinity, which Spark cannot
# hold either, become the strings "infinity" / "-infinity", as NaN and Infinity do for floats. A BC `timestamp` is
# rendered here too, as an astronomical year like Spark's text of a BC timestamptz or date (44 BC: "-0043", 1 BC:
# "0000"): Spark's text of it dropped the era (44 BC came as "0044-..."). BC `timestamptz` and `date` values still
# reach Spark raw and are rendered there. {c}: the quoted column.
PG_TEXT_RENDERING: dict[str, tuple[str, str]] = {  # kind -> (rendered here, text)
    "timestamp": ("isfinite({c})",
                  "CASE WHEN {c} >= TIMESTAMP '10000-01-01' THEN '+' || to_char({c}, 'YYYY-MM-DD\"T\"HH24:MI:SS.US') "
                  "WHEN {c} >= TIMESTAMP '0001-01-01' THEN to_char({c}, 'YYYY-MM-DD\"T\"HH24:MI:SS.US') "
                  "WHEN EXTRACT(YEAR FROM {c}) = -1 THEN to_char({c}, '\"0000\"-MM-DD\"T\"HH24:MI:SS.US') "
                  "ELSE '-' || lpad(CAST(-1 - CAST(EXTRACT(YEAR FROM {c}) AS int) AS text), 4, '0') "
                  "|| to_char({c}, '-MM-DD\"T\"HH24:MI:SS.US') END"),
    "timestamptz": ("isfinite({c}) AND {c} >= TIMESTAMPTZ '0001-01-01 00:00:00+00'",
                    "CASE WHEN {c} >= TIMESTAMPTZ '10000-01-01 00:00:00+00' THEN '+' ELSE '' END "
                    "|| to_char({c} AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US') || '+00:00'"),
    "date": ("isfinite({c}) AND {c} >= DATE '0001-01-01'",
             # to_char takes a timestamp, whose range ends in 294276: a later date is its own text (the read's
             # DateStyle is ISO: the JDBC driver sets it and refuses any other).
             "CASE WHEN {c} >= DATE '10000-01-01' THEN '+' || CAST({c} AS text) ELSE to_char({c}, 'YYYY-MM-DD') END"),
}

# MariaDB/MySQL render DATE and DATETIME text themselves (DATE_FORMAT), for exactness: through the JDBC driver and
# Spark a date before 1582-10-15 moved ten days (Julian -> Gregorian), a zero-in-date value ('2024-05-00', which
# the default sql_mode accepts) became the day before, and a zero date ('0000-00-00') became null. DATE_FORMAT gives
# the value as stored, in the form Spark's rendering gives the others. A TIMESTAMP is an instant (1970-2038, read
# in UTC through Spark) except its zero value, which the source names. {c}: the quoted column.
MYSQL_TEXT_RENDERING: dict[str, tuple[str, str]] = {  # kind -> (raw value for Spark or NULL, text or NULL)
    "mysql_date": ("CASE WHEN 1 = 0 THEN {c} END", "DATE_FORMAT({c}, '%Y-%m-%d')"),
    "mysql_datetime": ("CASE WHEN 1 = 0 THEN {c} END", "DATE_FORMAT({c}, '%Y-%m-%dT%H:%i:%s.%f')"),
    # The raw column as it is (a CASE would reach the driver as another type); the driver reads the zero as null.
    "mysql_timestamp": ("{c}", "CASE WHEN {c} = 0 THEN '0000-00-00T00:00:00.000000+00:00' END"),
    # A FLOAT (32-bit) reaches the driver as the server's text of 6 significant digits (123456792 as 1.23457e8):
    # as a double instead, whose text is exact, read back as a 32-bit float by Spark (custom_schema_for). No text
    # of the source's own (a string beside it would widen the float to a double in the message: 0.1 as
    # 0.10000000149011612).
    "mysql_float": ("({c} + 0e0)", ""),
}


# Spark's DecimalType holds at most 38 digits with 0 <= scale <= precision; outside that it rounds or fails.
SPARK_MAX_DECIMAL_DIGITS = 38
DECIMAL_TYPE = re.compile(r"^(?:NUMERIC|DECIMAL)(?:\((\d+)(?:,\s*(-?\d+))?\))?(?:\s|$)", re.IGNORECASE)


def exceeds_spark_decimal(type_name: str) -> bool:
    """True for a NUMERIC/DECIMAL type Spark's DecimalType cannot hold exactly (from the reflected type name,
    e.g. "NUMERIC(78, 0)", "DECIMAL(65, 30) UNSIGNED"; an unconstrained "NUMERIC" has no fixed scale)."""
    match = DECIMAL_TYPE.match(type_name.strip())
    if match is None:
        return False
    if match.group(1) is None:
        return True
    precision, scale = int(match.group(1)), int(match.group(2) or 0)
    return precision > SPARK_MAX_DECIMAL_DIGITS or not 0 <= scale <= precision


def base_type(col_type: Any) -> Any:
    """A PostgreSQL domain as its base type (reflected as DOMAIN, it was refused as a type rowrelay cannot read),
    through domains over domains: the driver reads its values as the base type's, and its constraints are the
    database's business."""
    from sqlalchemy.dialects.postgresql import DOMAIN

    while isinstance(col_type, DOMAIN) and col_type.data_type is not None:
        col_type = col_type.data_type
    return col_type


def read_as_text(dialect: str, type_name: str) -> bool:
    """Whether Spark reads a column of this reflected type as the driver's text, to keep it exact (see
    `custom_schema_for` in resources/spark.py): decimals beyond Spark's, PostgreSQL numeric (it may hold 'NaN') and
    real. Such a column's read
    sorts as text (10 before 9): as `tie_break`, the source numbers the rows in its order (`TableShape.tie_order`)."""
    if dialect not in ("postgresql", "mysql"):  # SQLite columns are read by their affinity (custom_schema_for)
        return False
    return exceeds_spark_decimal(type_name) or (dialect == "postgresql" and (
        type_name == "REAL" or DECIMAL_TYPE.match(type_name) is not None))


# Servers (URLs, no password) whose information_schema.CHECK_CONSTRAINTS has no TABLE_NAME (MySQL): the UTF-8 column
# query without its JSON-check part there.
_NO_CHECK_TABLE_NAME: set[str] = set()


def _charset_names(rows: Sequence[Any]) -> dict[str, str]:
    """Column -> charset, from information_schema (a charset's name goes into the read's SQL: only a plain one)."""
    return {name: charset for name, charset, _ in rows if charset and re.fullmatch(r"[a-z0-9_]+", charset)}


# Charsets whose text is not ASCII bytes: a byte 3F is not always '?' there.
WIDE_CHARSETS = {"ucs2", "utf16", "utf16le", "utf32"}


def charset_checked(quoted: str, charset: str) -> str:
    """A MariaDB/MySQL text column in `charset` as its UTF-8 bytes, or X'FF' (no UTF-8 has it: Spark's check then
    stops the read) where the server's conversion put '?' for a byte with no character. The server converts any
    such byte to '?' and nothing else, so text without '?' converted exactly (not a conversion back: cp932 maps two
    codes of one character to one); with '?', each must be one of the column's own. For the UTF-16/32 charsets,
    whose bytes 3F are not only '?', the value must convert back to its bytes instead."""
    utf8 = f"CONVERT({quoted} USING utf8mb4)"
    if charset in WIDE_CHARSETS:
        exact = f"CAST(CONVERT({utf8} USING {charset}) AS BINARY) = CAST({quoted} AS BINARY)"
    else:  # the value's own '?' counted as characters of its charset: a byte 3F inside a character is none
        exact = (f"INSTR({utf8}, '?') = 0 OR CHAR_LENGTH({utf8}) - CHAR_LENGTH(REPLACE({utf8}, '?', '')) = "
                 f"CHAR_LENGTH({quoted}) - CHAR_LENGTH(REPLACE({quoted}, '?', ''))")
    return f"CASE WHEN {quoted} IS NULL OR {exact} THEN CAST({utf8} AS BINARY) ELSE X'FF' END"


def source_rendering(kind: str, quoted: str) -> tuple[str, str]:
    """(the raw column's select expression, its text's) for a column of a PG_/MYSQL_TEXT_RENDERING kind: the
    message takes the text where it is not NULL, else Spark's rendering of the raw value (NULL wherever the text
    serves, so that the JDBC driver skips parsing it)."""
    if kind in MYSQL_TEXT_RENDERING:
        raw, text = MYSQL_TEXT_RENDERING[kind]
        return raw.format(c=quoted), text.format(c=quoted)
    in_range, rendered = (part.format(c=quoted) for part in PG_TEXT_RENDERING[kind])
    return (f"CASE WHEN NOT ({in_range}) AND isfinite({quoted}) THEN {quoted} END",
            f"CASE WHEN {in_range} THEN {rendered} WHEN NOT isfinite({quoted}) THEN {quoted}::text END")


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
        reflected columns include (the read failed on them)."""
        if (not any(c.source_text or c.utf8_bytes or c.utf8_shadow for c in self.columns) and not self.tie_order
                and self.dialect != "mysql"):
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
            # NULLs first, as Spark sorts them (and MariaDB does; PostgreSQL would put them last).
            nulls = " NULLS FIRST" if self.dialect == "postgresql" else ""
            texts.append(f"ROW_NUMBER() OVER (PARTITION BY {quote(self.watermark)} ORDER BY "
                         f"{quote(self.tie_break or '')}{nulls}) AS {quote(self.tie_order)}")
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


class SourceDatabaseResource(ConfigurableResource):
    """One source database. `url` may hold ${VAR} placeholders (resolved only to connect)."""

    url: str
    # A MariaDB server whose replication runs is refused (`refuse_unknowable_finality`) unless the user says the
    # relayed tables are written on it, not by replication (a local table on a server replicating others).
    tables_written_here: bool = False
    _engine: Engine | None = PrivateAttr(default=None)

    @classmethod
    def for_source(cls, source: SourceConfig) -> SourceDatabaseResource:
        return cls(url=source.url, tables_written_here=source.tables_written_here)

    # -- connection ---------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            # The code server evaluates up to eight sensors at once (the daemon's sensor threads), on one source
            # resource per URL: a smaller pool opened and closed connections above it on every burst of ticks.
            self._engine = sa.create_engine(self.sqlalchemy_url, pool_pre_ping=True, pool_size=8, max_overflow=2)
            sa.event.listen(self._engine, "handle_error", self._mark_error)
        return self._engine

    def _mark_error(self, context: sa.engine.ExceptionContext) -> None:
        """Mark the error with the URL as configured (`source_url`): a refused login named neither the source nor
        the variable its password comes from. The error itself is unchanged: callers tell transient ones apart."""
        if context.sqlalchemy_exception is not None:
            context.sqlalchemy_exception.source_url = self.url  # type: ignore[attr-defined]

    @property
    def sqlalchemy_url(self) -> sa.URL:
        url = _parse_source_url(self.url)
        backend = url.get_backend_name()
        # Default drivers that are installed with rowrelay.
        if backend in ("postgresql", "postgres") and "+" not in url.drivername:
            url = url.set(drivername="postgresql+psycopg")
        elif backend in ("mysql", "mariadb", "singlestoredb") and "+" not in url.drivername:
            url = url.set(drivername="mysql+pymysql")
        return url

    @property
    def dialect(self) -> str:
        name = self.sqlalchemy_url.get_backend_name()
        return {"postgres": "postgresql", "mariadb": "mysql", "singlestoredb": "mysql"}.get(name, name)

    @property
    def safe_description(self) -> str:
        """The URL with its password, and any query parameter that may hold a secret (`sslpassword`, a token, a
        key), hidden: for messages and metadata."""
        url = _parse_source_url(self.url)
        hidden = {key: "***" for key in url.query if _SECRET_PARAMETER.search(key)}
        return url.update_query_dict(hidden).render_as_string(hide_password=True).replace("%2A%2A%2A", "***")

    def _asked(self, shape: TableShape, question: tuple[Any, ...], ask: Callable[[], _Answer], settled: bool
               ) -> _Answer:
        """`ask()`, or where `settled` the answer SETTLED_ANSWERS kept for the same question about the same rows:
        the database connected to (its URL, ${VAR}s resolved), the table, its watermark and its `where:`."""
        if not settled:
            return ask()
        scope = (self.engine.url.render_as_string(hide_password=False), shape.schema, shape.name, shape.watermark,
                 shape.where)
        return SETTLED_ANSWERS.answer((*scope, *question), ask)

    def dispose(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    # -- reflection --------------------------------------------------------------------------

    def reflect(self, schema: str | None, table: str) -> sa.Table:
        try:
            return sa.Table(table, sa.MetaData(), schema=schema, autoload_with=self.engine)
        except NoSuchTableError:
            where = f"schema {schema!r} of " if schema else ""
            raise SourceError(f"table {table!r} not found in {where}source {self.safe_description}; "
                              "check `table:` in rowrelay.yaml") from None

    def declared_type(self, t: sa.Table, column: str) -> str:
        """The column's type as the database names it, for a refusal's message: SQLAlchemy names a type its dialect
        does not know (PostgreSQL's xml or point, a column SQLite declared without a type) "NULL", any array
        "ARRAY"; the catalog has the real one ("integer[]"; "" for a SQLite column declared without a type). Best
        effort: SQLAlchemy's name where the lookup fails."""
        reflected = t.c[column].type
        queries = {
            "postgresql": ("SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
                           "WHERE attrelid = CAST(:rel AS regclass) AND attname = :column"),
            "mysql": ("SELECT COLUMN_TYPE FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = "
                      "COALESCE(:schema, DATABASE()) AND TABLE_NAME = :table AND COLUMN_NAME = :column"),
            "sqlite": "SELECT type FROM pragma_table_info(:table, :schema) WHERE name = :column",
        }
        if self.dialect not in queries:
            return str(reflected)
        params = {"rel": self.engine.dialect.identifier_preparer.format_table(t), "schema": t.schema,
                  "table": t.name, "column": column}
        if self.dialect == "sqlite":
            params["schema"] = t.schema or "main"
        try:
            with self.engine.connect() as conn:
                name = conn.execute(sa.text(queries[self.dialect]), params).scalar()
        except sa.exc.SQLAlchemyError:
            return str(reflected)
        if name is None:
            return str(reflected)
        return repr(name) if name else ""

    def _unreadable(self, t: sa.Table, name: str) -> str | None:
        """Why column `name` cannot be sent (its type), None if it can."""
        col_type = base_type(t.c[name].type)
        if not isinstance(col_type, SUPPORTED_TYPES) or isinstance(col_type, sa.ARRAY | sa.Interval):
            declared = self.declared_type(t, name)
            kind = f"type {declared}" if declared else "no declared type"
            return f"column {name!r} has {kind}, which rowrelay cannot serialize exactly"
        if ((self.dialect == "mysql" and isinstance(col_type, sa.Uuid))
                or (self.dialect == "sqlite" and isinstance(col_type, sa.JSON))):
            # MariaDB's UUID is a type Spark's JDBC reader does not know (the read failed); SQLite has no JSON
            # type and does not check the text, so it could not be spliced into the message as JSON.
            return f"column {name!r} has type {col_type}, which rowrelay cannot read from {self.dialect}"
        return None

    def _refuse_unreadable(self, t: sa.Table, label: str, wanted: list[str]) -> None:
        """SourceError naming every column whose type cannot be sent, at once: one at a time, a user left out one
        column per try. The remedy names the `columns:` that leaves them all out."""
        unreadable = {name: why for name in wanted if (why := self._unreadable(t, name)) is not None}
        if not unreadable:
            return
        text = (" (on MariaDB select it as CAST(... AS CHAR) in a view; on SQLite declare it TEXT: sent as a string)"
                if self.dialect in ("mysql", "sqlite") else "")
        if len(unreadable) == 1:
            ((name, why),) = unreadable.items()
            remedy = "select it as text in a view" + text if "cannot read" in why else "cast it in a view"
            raise SourceError(f"{label}: {why}; leave it out with `columns:` or {remedy}")
        keep = ", ".join(c for c in wanted if c not in unreadable)
        raise SourceError(f"{label}: {len(unreadable)} columns cannot be sent: {'; '.join(unreadable.values())}; "
                          f"leave them out with `columns: [{keep}]` or cast or select them as text in a view{text}")

    def table_shape(self, schema: str | None, table: str, watermark: str, columns: list[str] | None = None,
                    where: str | None = None, tie_break: str | None = None, key: list[str] | None = None
                    ) -> TableShape:
        try:  # a URL parameter Spark's JDBC driver cannot honour fails the sensor tick, not only the run
            self.jdbc_options()
        except UrlParameterError as exc:
            raise SourceError(str(exc)) from None
        t = self.reflect(schema, table)
        label = f"{schema}.{table}" if schema else table
        if watermark not in t.c:
            raise SourceError(f"{label}: watermark column {watermark!r} does not exist (columns: {list(t.c.keys())})")
        wm_type = base_type(t.c[watermark].type)
        kind = self._watermark_kind(label, watermark, wm_type)
        if tie_break is not None and tie_break not in t.c:
            raise SourceError(f"{label}: tie_break column {tie_break!r} does not exist (columns: {list(t.c.keys())}); "
                              "fix `tie_break:` in rowrelay.yaml")
        wanted = list(columns) if columns else list(t.c.keys())
        missing = [c for c in wanted if c not in t.c]
        if missing:
            raise SourceError(f"{label}: configured columns {missing} do not exist (columns: {list(t.c.keys())})")
        for needed in (watermark, tie_break):
            if needed is not None and needed not in wanted:
                wanted.append(needed)
        if missing_key := [c for c in key or [] if c not in wanted]:  # a column dropped since (on_schema_change)
            raise SourceError(f"{label}: key columns {missing_key} do not exist (columns: {list(t.c.keys())}); fix "
                              "`key:` in rowrelay.yaml")
        infos = []
        charsets, shadowed = self._text_charsets(schema, table) if self.dialect == "mysql" else ({}, set())
        self._refuse_unreadable(t, label, wanted)
        for name in wanted:
            col_type = base_type(t.c[name].type)
            if "`" in name:
                raise SourceError(f"{label}: column {name!r} has a backtick in its name, which Spark's column "
                                  "references cannot carry; leave it out with `columns:` or rename it in a view")
            if name.lower().startswith(INTERNAL_PREFIX):  # Spark matches names case-insensitively
                raise SourceError(f"{label}: column {name!r} has a name rowrelay gives columns of its own in a "
                                  f"slice's read (names starting with {INTERNAL_PREFIX}: Spark would fail every run "
                                  "with COLUMN_ALREADY_EXISTS); leave it out with `columns:` or rename it in a view")
            # The watermark stays whole: the read filters on it. A tie_break is checked too: its bytes sort as its
            # UTF-8 text does (by code point), as the text the driver gave did.
            checked = (name in charsets and name != watermark and isinstance(col_type, sa.String)
                       and not isinstance(col_type, sa.Enum) and type(col_type).__name__ != "SET")
            charset = charsets[name] if checked and not charsets[name].startswith("utf8") else ""
            shadow = checked and not charset and name in shadowed  # a tie_break too: its text sorts as its bytes
            checked = checked and not shadow
            infos.append(ColumnInfo(name=name, type_name=str(col_type), nullable=bool(t.c[name].nullable),
                                    is_json=isinstance(col_type, sa.JSON),
                                    is_integer=isinstance(col_type, sa.Integer),
                                    source_text=self._source_text(col_type), utf8_bytes=checked, charset=charset,
                                    utf8_shadow=shadow))
        shape = TableShape(dialect=self.dialect, schema=schema, name=table, columns=tuple(infos), watermark=watermark,
                           where=where, watermark_kind=kind, tie_break=tie_break,
                           watermark_unit=self._watermark_unit(wm_type) if kind != "integer" else 1)
        if where is not None:
            self.check_where(shape, label)
        if getattr(wm_type, "unsigned", False) and isinstance(wm_type, sa.BigInteger):
            self.check_watermark_range(shape)  # one indexed max query, only for BIGINT UNSIGNED watermarks
        if self.dialect == "postgresql" and shape.timestamps:
            self.check_watermark_times(shape, label)  # one indexed probe
        if self.dialect == "mysql" and shape.timestamps:
            self.check_mysql_datetime_watermark(shape, label)  # one catalog row
        if self.dialect == "mysql" and not shape.timestamps:
            self.check_mysql_sequence_watermark(shape, label)  # one catalog row (two with a sequence DEFAULT)
        return shape

    def _text_charsets(self, schema: str | None, table: str) -> tuple[dict[str, str], set[str]]:
        """MariaDB/MySQL: the table's text columns whose values must be checked on the way (column -> charset):
        those in a UTF-8 charset (utf8mb3, utf8mb4) and those in a charset with bytes that have no character (all
        but latin1, whose 256 bytes all convert both ways). And those of them to read as text with their bytes beside
        them (`ColumnInfo.utf8_shadow`): columns that may be JSON, which the driver marks as such only while it reads
        them as text (its mark decides how they are sent, as before the check) — a LONGTEXT with a json_valid()
        check (MariaDB's JSON; the catalog cannot tell a declared JSON from a hand-written check) and a view's
        LONGTEXT (no catalog tells). MySQL's JSON type is stored parsed, always valid: not checked."""
        columns = ("SELECT c.COLUMN_NAME, c.CHARACTER_SET_NAME, c.DATA_TYPE = 'longtext' AND ({json} OR EXISTS ("
                   "SELECT 1 FROM information_schema.TABLES v WHERE v.TABLE_SCHEMA = c.TABLE_SCHEMA AND v.TABLE_NAME "
                   "= c.TABLE_NAME AND v.TABLE_TYPE = 'VIEW')) FROM information_schema.COLUMNS c WHERE "
                   "c.TABLE_SCHEMA = COALESCE(:schema, DATABASE()) AND c.TABLE_NAME = :table AND c.DATA_TYPE <> "
                   "'json' AND c.CHARACTER_SET_NAME NOT IN ('latin1', 'binary')")
        json_checks = ("EXISTS (SELECT 1 FROM information_schema.CHECK_CONSTRAINTS k WHERE "
                       "k.CONSTRAINT_SCHEMA = c.TABLE_SCHEMA AND k.TABLE_NAME = c.TABLE_NAME AND "
                       "LOCATE(CONCAT('json_valid(`', c.COLUMN_NAME, '`)'), k.CHECK_CLAUSE) > 0)")
        params = {"schema": schema, "table": table}
        server = self.engine.url.render_as_string(hide_password=True)
        with self.engine.connect() as conn:
            rows = None
            if server not in _NO_CHECK_TABLE_NAME:
                try:
                    rows = conn.execute(sa.text(columns.format(json=json_checks)), params).all()
                except sa.exc.DBAPIError:  # MySQL: CHECK_CONSTRAINTS without TABLE_NAME (or none); JSON is a type
                    conn.rollback()
                    _NO_CHECK_TABLE_NAME.add(server)  # not asked again on every table_shape of this process
            if rows is None:
                rows = conn.execute(sa.text(columns.format(json="FALSE")), params).all()
        return _charset_names(rows), {name for name, _, shadowed in rows if shadowed}

    def _source_text(self, col_type: Any) -> str:
        """The PG_/MYSQL_TEXT_RENDERING kind of a column the source renders as text, or ""."""
        if self.dialect == "mysql":
            return {"DATE": "mysql_date", "DATETIME": "mysql_datetime", "TIMESTAMP": "mysql_timestamp",
                    "FLOAT": "mysql_float"}.get(type(col_type).__name__, "")
        if self.dialect != "postgresql":
            return ""
        if isinstance(col_type, sa.DateTime):
            return "timestamptz" if col_type.timezone else "timestamp"
        return "date" if isinstance(col_type, sa.Date) else ""

    def _watermark_kind(self, label: str, watermark: str, wm_type: Any
                        ) -> Literal["integer", "timestamp", "timestamptz"]:
        """Integer columns, and the timestamp types whose values are exact to the microsecond and never move
        with a session's time zone: PostgreSQL timestamp/timestamptz, MariaDB/MySQL DATETIME."""
        if isinstance(wm_type, sa.Integer):
            return "integer"
        if isinstance(wm_type, sa.DateTime):
            if self.dialect == "postgresql":
                return "timestamptz" if wm_type.timezone else "timestamp"
            if self.dialect == "mysql" and type(wm_type).__name__ == "DATETIME":
                return "timestamp"
            if self.dialect == "mysql":
                raise SourceError(f"{label}: watermark column {watermark!r} has type {wm_type}; a timestamp watermark "
                                  "on MariaDB/MySQL must be DATETIME (ideally DATETIME(6)): TIMESTAMP values are shown "
                                  "in each session's time zone. Use a DATETIME column or a view")
            raise SourceError(f"{label}: watermark column {watermark!r} has type {wm_type}; timestamp watermarks are "
                              f"supported on PostgreSQL and MariaDB/MySQL, not on {self.dialect} (its timestamps are "
                              "text); use an integer watermark")
        raise SourceError(f"{label}: watermark column {watermark!r} has type {wm_type}, but must be an integer column "
                          "that only grows (e.g. an auto-increment id) or a timestamp set when the row is written "
                          "(PostgreSQL timestamp/timestamptz, MariaDB DATETIME)")

    def _watermark_unit(self, wm_type: Any) -> int:
        """Microseconds per step of a timestamp column: its fractional digits are PostgreSQL's precision (unset: 6)
        or MariaDB's fsp (unset: 0)."""
        if self.dialect == "mysql":
            digits = getattr(wm_type, "fsp", None) or 0
        else:
            digits = getattr(wm_type, "precision", None)
            digits = 6 if digits is None else digits
        return 10 ** (6 - min(6, max(0, int(digits))))

    def _table(self, shape: TableShape, *more: str) -> sa.TableClause:
        """The table as SQLAlchemy's clause, with its watermark column and `more` (once each)."""
        return sa.table(shape.name, *(sa.column(c) for c in dict.fromkeys((shape.watermark, *more))),
                        schema=shape.schema)

    @staticmethod
    def filtered(q: sa.Select, shape: TableShape, watermark: sa.ColumnElement | None = None,
                 skip: Sequence[RowSkip] | None = None) -> sa.Select:
        """Counts, cuts, reads and the lag's oldest row see the same rows: the table's `where:` (its own SQL), as
        one predicate, and, given the `watermark` column, none of the rows `skip` names."""
        if shape.where:
            # A literal, not sa.text: a `:word` inside the predicate's strings (`note <> ':draft'`, JSON) is SQL, not a
            # bind parameter (sa.text failed such a predicate with "a value is required for bind parameter").
            q = q.where(sa.literal_column(f"({shape.where})"))
        if skip and watermark is not None:
            q = q.where(sa.not_(skipped_rows_predicate(shape, skip)))
        return q

    def skip_sql(self, shape: TableShape, skip: Sequence[RowSkip]) -> str:
        """`filtered`'s skip as this source's SQL text (literals inline), for the slice read Spark sends."""
        return str(sa.not_(skipped_rows_predicate(shape, skip)).compile(
            dialect=self.engine.dialect, compile_kwargs={"literal_binds": True}))

    def check_where(self, shape: TableShape, label: str) -> None:
        """The filter must run on this source: a predicate that does not parse (or names a missing column) is a
        clear error at the table check, before anything is cut or read."""
        q = self.filtered(sa.select(sa.literal(1)).select_from(self._table(shape)), shape).limit(1)
        # A source that cannot be reached fails at connect, as itself: transient, retried like any read, not a
        # predicate to fix (and stopping the table for it).
        with self.engine.connect() as conn:
            try:
                conn.execute(q).first()
            except sa.exc.DBAPIError as exc:
                if exc.connection_invalidated:  # the connection dropped mid-statement: the same
                    raise
                reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
                raise SourceError(f"{label}: `where: {shape.where}` does not run on source {self.safe_description}: "
                                  f"{reason}; fix the predicate in rowrelay.yaml (it is the source's SQL)") from None

    # -- watermark queries (each one indexed query) ------------------------------------------------

    def max_watermark(self, shape: TableShape, upto: int | None = None, after: int | None = None) -> int | None:
        t = self._table(shape)
        wm = t.c[shape.watermark]
        q = self.filtered(sa.select(sa.func.max(wm)).select_from(t), shape)
        if upto is not None:
            q = q.where(wm <= shape.watermark_param(upto))
        if after is not None:
            q = q.where(wm > shape.watermark_param(after))
        with self.engine.connect() as conn:
            value = conn.execute(q).scalar()
        return None if value is None else shape.watermark_value(value)

    def nth_watermark(self, shape: TableShape, after: int, n: int, upto: int, *, settled: bool = False
                      ) -> int | None:
        """The n-th watermark above `after` among rows up to `upto`. `settled`: see `SETTLED_ANSWERS`."""
        def ask() -> int | None:
            t = self._table(shape)
            wm = t.c[shape.watermark]
            q = self.filtered(sa.select(wm).select_from(t).where(wm > shape.watermark_param(after),
                                                                  wm <= shape.watermark_param(upto)), shape
                               ).order_by(wm).limit(1).offset(n - 1)
            with self.engine.connect() as conn:
                value = conn.execute(q).scalar()
            return None if value is None else shape.watermark_value(value)

        return self._asked(shape, ("nth", after, n, upto), ask, settled)

    def count_rows(self, shape: TableShape, after: int, upto: int, skip: Sequence[RowSkip] | None = None, *,
                   settled: bool = False) -> int:
        """Rows in (after, upto] that the table's `where:` admits, minus the rows `skip` names.
        `settled`: see `SETTLED_ANSWERS` (a check that recounts the source now leaves it off)."""
        def ask() -> int:
            t = self._table(shape)
            wm = t.c[shape.watermark]
            q = self.filtered(sa.select(sa.func.count()).select_from(t)
                              .where(wm > shape.watermark_param(after), wm <= shape.watermark_param(upto)), shape,
                              wm, skip)
            with self.engine.connect() as conn:
                return int(conn.execute(q).scalar())

        return self._asked(shape, ("count", after, upto, tuple(skip or ())), ask, settled)

    def count_skipped(self, shape: TableShape, after: int | None, upto: int, skip: Sequence[RowSkip]) -> int:
        """Rows in (after, upto] (None: from the first) that the table's `where:` admits and `skip` names: the rows
        a skip leaves out, for `rowrelay verify` and `status` to report as skipped."""
        if not skip:
            return 0
        t = self._table(shape)
        wm = t.c[shape.watermark]
        q = self.filtered(sa.select(sa.func.count()).select_from(t).where(wm <= shape.watermark_param(upto)), shape
                          ).where(skipped_rows_predicate(shape, skip))
        if after is not None:
            q = q.where(wm > shape.watermark_param(after))
        with self.engine.connect() as conn:
            return int(conn.execute(q).scalar())

    def iter_watermarks(self, shape: TableShape, after: int | None, upto: int, skip: Sequence[RowSkip] | None = None
                        ) -> Iterator[int]:
        """Every row's watermark in (after, upto] that the table's `where:` admits, minus `skip`, streamed (for
        `rowrelay verify`: the one full pass over the rows, never on the relay path)."""
        t = self._table(shape)
        with self.engine.connect().execution_options(stream_results=True, yield_per=50_000) as conn:
            for (value,) in conn.execute(self._watermark_rows(shape, t, [t.c[shape.watermark]], after, upto, skip)):
                yield shape.watermark_value(value)

    def iter_watermark_ties(self, shape: TableShape, after: int | None, upto: int,
                            skip: Sequence[RowSkip] | None = None, only: Sequence[int] | None = None
                            ) -> Iterator[tuple[int, Any]]:
        """As `iter_watermarks`, each with its row's tie_break value, for the watermarks in `only` if given."""
        assert shape.tie_break is not None
        t = self._table(shape, shape.tie_break)
        q = self._watermark_rows(shape, t, [t.c[shape.watermark], t.c[shape.tie_break]], after, upto, skip)
        if only is not None:
            q = q.where(t.c[shape.watermark].in_([shape.watermark_param(w) for w in only]))
        with self.engine.connect().execution_options(stream_results=True, yield_per=50_000) as conn:
            for value, tie in conn.execute(q):
                yield shape.watermark_value(value), tie

    def _watermark_rows(self, shape: TableShape, t: sa.TableClause, columns: list[Any], after: int | None,
                        upto: int, skip: Sequence[RowSkip] | None) -> sa.Select:
        wm = t.c[shape.watermark]
        q = self.filtered(sa.select(*columns).select_from(t).where(wm <= shape.watermark_param(upto)), shape, wm, skip)
        return q if after is None else q.where(wm > shape.watermark_param(after))

    def has_null_watermarks(self, shape: TableShape) -> bool:
        if not shape.column(shape.watermark).nullable:
            return False
        t = self._table(shape)
        with self.engine.connect() as conn:
            return conn.execute(sa.select(sa.literal(1)).select_from(t)
                                .where(t.c[shape.watermark].is_(None)).limit(1)).first() is not None

    def sqlite_misfit(self, shape: TableShape, after: int, upto: int, skip: Sequence[RowSkip] | None = None
                      ) -> tuple[int, str, str, str] | None:
        """SQLite only: the first row in (after, upto] that the table's `where:` admits, not named by `skip`,
        holding a value its column's declared type cannot carry exactly, as (watermark, column, storage class, the
        value as an SQL literal); None if every value fits.

        SQLite keeps any value in any column, and its JDBC driver converts what does not fit the declared type
        silently: 1.5 in an INTEGER column arrived as 1, 'abc' as 0, 123.456 in a DECIMAL(10,2) as 123.46, 'yes' in
        a BOOLEAN as false, a blob in a TEXT column as mangled text."""
        q = self.engine.dialect.identifier_preparer.quote
        # Each real's text (as the driver reads it) computed once, in an inner query, for the rules to test.
        texts = {c.name: shape.text_column(i) for i, c in enumerate(shape.columns)}
        rules = [(c.name, sql) for c in shape.columns
                 if (sql := _sqlite_misfit_sql(c.type_name.upper(), q(c.name), q(texts[c.name])))]
        if not rules:
            return None

        def case(then: Callable[[int, str], str]) -> str:
            whens = (f"WHEN {sql} THEN {then(i, q(name))}" for i, (name, sql) in enumerate(rules))
            return f"CASE {' '.join(whens)} END"

        wm = q(shape.watermark)
        table = q(shape.name) if not shape.schema else f"{q(shape.schema)}.{q(shape.name)}"
        conditions = [f"{wm} > ?", f"{wm} <= ?"]
        if shape.where:
            conditions.append(f"({shape.where})")
        if skip:
            conditions.append(self.skip_sql(shape, skip))
        columns = ", ".join(f"{q(name)}, CASE WHEN typeof({q(name)}) = 'real' THEN "
                            f"{SQLITE_REAL_TEXT.format(c=q(name))} END AS {q(texts[name])}" for name, _ in rules)
        inner = f"SELECT {wm} AS __rowrelay_wm, {columns} FROM {table} WHERE {' AND '.join(conditions)}"
        # The driver's own statement (qmark parameters): a column name may hold what sa.text reads as a parameter.
        # Not kept with the settled answers: the remedy is to fix a value in place.
        with self.engine.connect() as conn:
            row = conn.exec_driver_sql(
                f"SELECT __rowrelay_wm, {case(lambda i, c: str(i))}, {case(lambda i, c: f'typeof({c})')}, "
                f"{case(lambda i, c: f'substr(quote({c}), 1, 60)')} FROM ({inner}) "
                f"WHERE {' OR '.join(f'({sql})' for _, sql in rules)} ORDER BY __rowrelay_wm LIMIT 1",
                (after, upto)).first()
        return None if row is None else (int(row[0]), rules[int(row[1])][0], str(row[2]), str(row[3]))

    # -- safe high watermark ---------------------------------------------------------------------

    def observe(self, shape: TableShape) -> WatermarkCandidate | None:
        """The current max watermark with what tells, later, when it is final (see `is_final`).

        The transactions it must wait for are read in a second statement, AFTER the max: a transaction that
        took an id <= max before the max was read is, by then, either still open (and listed) or ended.

        A timestamp column whose values are coarser than a microsecond is another case: a transaction that starts
        after this look, so waits for nothing, still writes the max's own value while the database clock is in the
        max's step. Then the candidate stops below that step, and the rows at the max wait for a later look. The step
        is the coarser of the declared one (`watermark_unit`: timestamp(0), DATETIME) and the one the newest values
        show (`_shown_step_sql`): a `timestamptz` or DATETIME(6) written by `date_trunc('second', now())`,
        `CURRENT_TIMESTAMP(0)` or MariaDB's NOW() holds whole seconds whatever its type. The clock is read as the
        writers write: PostgreSQL's session time (the
        server's zone, as `DEFAULT now()` on a `timestamp` stores it; an instant for `timestamptz`), MariaDB's NOW(6)
        in this session's zone (the server's default, as `CURRENT_TIMESTAMP` stores a DATETIME for writers in it; a
        source URL that sets another zone must set the writers').
        """
        t = self._table(shape)
        wm = t.c[shape.watermark]
        earliest: int | None = None  # MariaDB: the start of the earliest writing statement still running
        durable_at: int | None = None
        with self.engine.connect() as conn:
            self.refuse_unknowable_finality(shape, conn)
            if self.dialect == "postgresql":
                # Same statement, same snapshot: the xmax the later xmin must reach. now(): this transaction's
                # start, before every transaction this look does not wait for.
                # The table's incarnation: a candidate of a table since re-created or truncated (ids restarted)
                # must not settle over the new table's open transactions (sensors.settled_watermark).
                incarnation = sa.text(
                    "(SELECT c.oid::text || '/' || c.relfilenode::text FROM pg_class c "
                    "WHERE c.oid = CAST(:rowrelay_rel AS regclass))").bindparams(
                    rowrelay_rel=self.engine.dialect.identifier_preparer.format_table(t))
                row = conn.execute(sa.select(sa.func.max(wm), sa.text("pg_snapshot_xmax(pg_current_snapshot())::text"),
                                             sa.text(("LOCALTIMESTAMP" if shape.watermark_kind == "timestamp"
                                                      else "now()") if shape.timestamps else "NULL"), incarnation,
                                             self._shown_step_sql(shape, t)).select_from(t)).one()
                clock, table_token, shown = row[2], row[3], row[4]
                waits = tuple(conn.execute(sa.text(_PG_OPEN_VXIDS)).scalars()) if row[0] is not None else ()
            elif self.dialect == "mysql":
                # Our own InnoDB transaction, begun before the max is read: innodb_trx lists it, with the statement
                # it ran when the cache was filled (`_innodb_trx_open_since` proves its read fresh by that).
                conn.execute(sa.text("START TRANSACTION WITH CONSISTENT SNAPSHOT"))
                # NOW(6): the wall clock of this session's zone (the server's default unless the URL sets one),
                # which is what writers in that zone store with CURRENT_TIMESTAMP: a DATETIME's own frame. The
                # epoch time only times the settle delay.
                row = conn.execute(sa.select(sa.func.max(wm), sa.text("UNIX_TIMESTAMP(NOW(6))"),
                                             sa.text("CONNECTION_ID()"), sa.text("NOW(6)"),
                                             _mysql_incarnation(shape), self._shown_step_sql(shape, t))
                                   .select_from(t)).one()
                clock, table_token, shown = row[3], row[4], row[5]
                observe_pause("max read", conn)
                # Running statements first, then open transactions, from a cache filled during that second read: a
                # statement that ends before it has touched a row by then, so its transaction, if still open, is
                # listed (the other order, or a cache filled before the first read, missed one that ended in between
                # with its transaction open).
                if row[0] is not None and shape.timestamps:
                    earliest = self._earliest_running_write(conn, datetime_to_micros(row[3]))
                waits = self._innodb_trx_open_since(conn, int(row[2])) if row[0] is not None else ()
                # Every row at or below the max committed before this point of the redo log (see is_final).
                durable_at = _innodb_lsns(conn).get("innodb_lsn_current") if row[0] is not None else None
            else:
                row, waits = (conn.execute(sa.select(sa.func.max(wm)).select_from(t)).scalar(), time.time()), ()
                clock = table_token = shown = None
        if row[0] is None:
            return None
        value = shape.watermark_value(row[0])
        if value > MAX_WATERMARK:
            raise SourceError(self._range_message(shape, value))
        step = max(shape.watermark_unit, int(shown or 1))
        if clock is not None:
            value = below_step_in_reach(value, datetime_to_micros(clock), step)
        if earliest is not None:
            # Its rows carry its start time (CURRENT_TIMESTAMP is the statement's), in the values' step.
            value = min(value, earliest // step * step - 1)
        return WatermarkCandidate(value, float(row[1]), waits, durable_at, table_token)

    def _shown_step_sql(self, shape: TableShape, t: sa.TableClause) -> sa.TextClause:
        """A timestamp watermark's step as its newest values show it, in microseconds, as a scalar subquery to read
        with the max: 1,000,000 if one of the SHOWN_STEP_ROWS newest rows holds a whole second, else 1,000 if one
        holds a whole millisecond, else 1 (one index scan of those rows). Any one such value counts: a table written
        by both whole-second and microsecond writers is held back a second while one of its whole seconds is among
        them (a microsecond writer's value is whole by chance once in a million, and then costs a second's wait).
        Not coarser than a second: a time truncated to the minute or the day is beyond it. NULL for an integer."""
        if not shape.timestamps:
            return sa.text("NULL")
        column = self.engine.dialect.identifier_preparer.quote(shape.watermark)
        fraction = {"postgresql": f"CAST(date_part('microseconds', {column}) AS bigint) % 1000000",
                    "mysql": f"MICROSECOND({column})"}[self.dialect]
        table = self.engine.dialect.identifier_preparer.format_table(t)
        return sa.text(f"(SELECT MAX(CASE WHEN f = 0 THEN 1000000 WHEN MOD(f, 1000) = 0 THEN 1000 ELSE 1 END) FROM ("
                       f"SELECT {fraction} AS f FROM {table} WHERE {column} IS NOT NULL ORDER BY {column} DESC "
                       f"LIMIT {SHOWN_STEP_ROWS}) top_values)")

    def refuse_unknowable_finality(self, shape: TableShape, conn: sa.Connection | None = None) -> None:
        """Refuse a source where `is_final` cannot know when new rows are final, so a cut could skip a row for good:

        - a source that receives the table's rows by replication: a PostgreSQL standby, a table a logical
          replication subscription fills, a MariaDB server whose replication runs. Rows arrive there in the
          primary's commit order, while the transactions still open on the primary — those the safe high watermark
          waits for — are invisible: on a standby the check saw id 3 final while the primary still held id 2 drawn
          and uncommitted;
        - a PostgreSQL UNLOGGED table: a crash empties it and restarts its sequence (not in the WAL, so no flush
          makes its rows durable); and an UNLOGGED sequence the watermark takes its ids from (PostgreSQL 15+, behind
          a logged table too): a crash resets it to its start, and new rows take ids at or below those sent;
        - a PostgreSQL foreign table (its writers' transactions are on another server) or materialized view (its
          rows appear at a refresh, below rows already sent). These and the two above are looked for in every
          relation a read of the table takes rows from: partitions, inheritance children, a view's base relations;
        - a PostgreSQL integer watermark drawn from a sequence with CACHE > 1, in any of those relations: each
          session draws its ids from a cache of its own, so a session can insert id 2 long after another committed
          21, in a transaction that began after the cut (nothing the cut could wait for);
        - a MariaDB/MySQL table in MEMORY (a restart empties it and reuses its ids) or an engine other than InnoDB
          (whose open transactions `is_final` reads), MyISAM and Aria (one writing statement at a time).

        Checked before every cut (`observe`) and every run's read; `verify` and `status` may still read a replica.
        Readable by any role: the recovery flag, the catalogs, MariaDB's Slaves_running status. MySQL's replication
        state needs a privilege rowrelay does not ask for: not checked there (docs/design.md)."""
        label = shape.label
        if conn is None:
            with self.engine.connect() as own:
                return self.refuse_unknowable_finality(shape, own)
        remedy = "point the source's url at the primary and run again; nothing was cut or sent"
        if self.dialect == "postgresql":
            # Any relation a read of the table takes rows from counts: a partition, a child, a view's base table.
            standby, subscription, odd, cache, sequence, fed, fed_depth, unlogged_sequence, two = conn.execute(
                sa.text(_PG_FINALITY_CATALOG), {
                "rel": self.engine.dialect.identifier_preparer.format_table(self._table(shape)),
                "column": shape.watermark, "integer": shape.watermark_kind == "integer"}).one()
            if standby:
                raise SourceError(
                    f"{label}: source {self.safe_description} is a PostgreSQL standby (pg_is_in_recovery()). A "
                    "standby cannot show the primary's open transactions, so rowrelay cannot tell there when new "
                    "rows are final: a row whose id was drawn before a higher one committed could be cut past and "
                    f"never sent; {remedy}")
            if subscription is not None:
                subname, filled, depth = subscription
                what = "the table is" if depth == "0" else f"{filled}, which a read of the table takes rows from, is"
                raise SourceError(
                    f"{label}: {what} filled by logical replication (subscription {subname!r}) on source "
                    f"{self.safe_description}. Its rows arrive in the publisher's commit order and the publisher's "
                    "open transactions are invisible here, so rowrelay cannot tell when new rows are final: a row "
                    "whose id was drawn before a higher one committed could be cut past and never sent; relay the "
                    "table from the publisher (its url) and run again; nothing was cut or sent")
            if odd is not None:
                kind, relation, depth = odd
                what = "the table" if depth == "0" else f"{relation}, which a read of the table takes rows from,"
                if kind == "f":
                    raise SourceError(
                        f"{label}: {what} is a foreign table: its rows live on another server, whose open "
                        "transactions rowrelay cannot see from here, so it cannot tell when new rows are final: a "
                        "row whose id was drawn before a higher one committed could be cut past and never sent. "
                        "Relay the table from the server that holds it (a source with its url) and run again; "
                        "nothing was cut or sent")
                if kind == "m":
                    raise SourceError(
                        f"{label}: {what} is a materialized view: its rows change only when it is refreshed, all at "
                        "once, so a row committed in its base tables after one refresh appears at the next, below "
                        "rows already sent, and would never be sent. Relay the table it is built from and run "
                        "again; nothing was cut or sent")
                raise SourceError(
                    f"{label}: {what} is UNLOGGED: its rows are not in the write-ahead log, so a crash of the "
                    "server empties it: rows already sent vanish from the source, and where the watermark's values "
                    "restart (an UNLOGGED table's own sequence), new rows take them and are never sent. Run "
                    f"`ALTER TABLE {relation} SET LOGGED` (or relay a logged copy) and run again; nothing was cut or "
                    "sent")
            of = "" if fed_depth == "0" else f" of {fed}, which a read of the table takes rows from,"
            if unlogged_sequence:
                raise SourceError(
                    f"{label}: watermark column {shape.watermark!r}{of} takes its ids from sequence {sequence}, which "
                    "is UNLOGGED: it is not in the write-ahead log, so a crash of the server resets it to its start "
                    "while the table keeps its rows, and new rows take ids at or below those already sent and are "
                    f"never sent. Run `ALTER SEQUENCE {sequence} SET LOGGED` and run again; nothing was cut or sent")
            if two is not None:
                first, first_rel, first_depth, other, other_rel, other_depth = two
                whose = ["the table's" if depth == "0" else f"{rel}'s, which a read of the table takes rows from"
                         for rel, depth in ((first_rel, first_depth), (other_rel, other_depth))]
                raise SourceError(
                    f"{label}: watermark column {shape.watermark!r} takes its ids from two sequences: {first} "
                    f"({whose[0]}) and {other} ({whose[1]}). Each counts on its own, so a row inserted through one "
                    "takes an id at or below those the other has already handed out (and rowrelay sent), and would "
                    f"never be sent. Give {other_rel} the same source of ids (`ALTER TABLE {other_rel} ALTER COLUMN "
                    f"{shape.watermark} DROP IDENTITY IF EXISTS, ALTER COLUMN {shape.watermark} SET DEFAULT "
                    f"nextval('{first}')`) and run again; nothing was cut or sent")
            if cache is not None and int(cache) > 1:
                raise SourceError(
                    f"{label}: watermark column {shape.watermark!r}{of} takes its ids from sequence {sequence}, which "
                    f"caches {cache} per session (CACHE {cache}): a session can insert an id from its cache long "
                    "after another session committed a higher one, in a transaction no cut can wait for, and that "
                    f"row would never be sent. Run `ALTER SEQUENCE {sequence} CACHE 1` (ids are then drawn in "
                    "order of asking) and run again; nothing was cut or sent")
        elif self.dialect == "mysql":
            engine = conn.execute(sa.text(
                "SELECT ENGINE FROM information_schema.TABLES WHERE TABLE_SCHEMA = COALESCE(:schema, DATABASE()) "
                "AND TABLE_NAME = :table"), {"schema": shape.schema, "table": shape.name}).scalar()
            if engine is not None and engine.lower() == "memory":
                raise SourceError(
                    f"{label}: the table is ENGINE=MEMORY: a restart of the server empties it and restarts its "
                    "AUTO_INCREMENT, so rows already sent would vanish while new rows took their ids and were never "
                    "sent. Run `ALTER TABLE ... ENGINE=InnoDB` (or relay an InnoDB copy) and run again; nothing was "
                    "cut or sent")
            if engine is not None and engine.lower() not in _MYSQL_ENGINES_KNOWN:
                raise SourceError(
                    f"{label}: the table is ENGINE={engine}. rowrelay knows when new rows are final only in InnoDB "
                    "(whose open transactions it reads) and in MyISAM and Aria (whose writers take the table in "
                    f"turn); in {engine} a row whose id was drawn before a higher one committed, or whose rows live "
                    "on another server, could be cut past and never sent. Relay an InnoDB table (`ALTER TABLE ... "
                    "ENGINE=InnoDB`, or the table on the server that holds it) and run again; nothing was cut or sent")
        if self.dialect == "mysql" and getattr(conn.dialect, "is_mariadb", False):
            running = conn.execute(sa.text("SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS "
                                           "WHERE VARIABLE_NAME = 'SLAVES_RUNNING'")).scalar()
            if running is not None and int(running) > 0 and not self.tables_written_here:
                raise SourceError(
                    f"{label}: source {self.safe_description} is a MariaDB replica (Slaves_running = {running}). On "
                    "a replica rows arrive in the primary's commit order and the primary's open transactions are "
                    "invisible, so rowrelay cannot tell when new rows are final: a row whose id was drawn before a "
                    f"higher one committed could be cut past and never sent; {remedy}. If this table is written on "
                    "this server itself, not by replication, set `tables_written_here: true` on the source")

    def _earliest_running_write(self, conn: sa.Connection, now: int) -> int | None:
        """MariaDB: the start of the earliest statement of another session still running that may write rows, or
        None, in the frame of `now` (NOW(6) of the observe session read as UTC, as a DATETIME watermark is: the
        wall clock its writers store).

        A statement's CURRENT_TIMESTAMP(6) is its start time, but InnoDB lists its transaction only once it first
        touches a row: an `INSERT ... VALUES (f())` whose expression, subquery on a non-InnoDB table or lock wait
        takes seconds writes a time below rows that others commit meanwhile, and innodb_trx does not show it while
        it runs. So a timestamp watermark is final only below every such statement's start. Statements that read
        (SELECT, WITH, SHOW: reports, Spark's own reads) are left out: a report query must not hold the table
        back for its whole length. Not covered: a SELECT whose stored function inserts into the table.
        A statement of the event scheduler runs under COMMAND 'Connect' (a client still logging in has no INFO, and
        is left out with a replica's I/O thread, which has none either); a batch a driver sends in one round trip
        (Connector/J's `executeBatch`, Connector/C's array binding) under 'Bulk_execute'.
        `now`: the database clock read before this look (NOW(6), in microseconds), so each start is estimated no
        later than it was; a second is taken off for MySQL, whose processlist counts whole seconds."""
        running_statement = ("ID <> CONNECTION_ID() AND (COMMAND IN ('Query', 'Execute', 'Bulk_execute') "
                             "OR (COMMAND = 'Connect' AND INFO IS NOT NULL))")
        try:
            rows = conn.execute(sa.text(
                f"SELECT TIME_MS / 1000, INFO FROM information_schema.PROCESSLIST WHERE {running_statement}")).all()
        except sa.exc.OperationalError:  # MySQL: no TIME_MS
            rows = [(float(r[0]) + 1.0, r[1]) for r in conn.execute(sa.text(
                f"SELECT TIME, INFO FROM information_schema.PROCESSLIST WHERE {running_statement}")).all()]
        running = [float(elapsed) for elapsed, info in rows if not _READ_STATEMENT.match(info or "")]
        return now - math.ceil((max(running) + _STATEMENT_START_MARGIN_S) * 1_000_000) if running else None

    def is_final(self, candidate: WatermarkCandidate, settle_seconds: float) -> bool:
        """Whether every row with watermark <= `candidate.watermark` is committed (none can still appear).

        - PostgreSQL: the xmin of a new snapshot has reached the xmax seen with the max (every transaction with
          an xid then has ended) AND none of the virtual transactions open in the table's database when the max
          was seen is still open. The second part covers a `DEFAULT nextval` drawn before its transaction has an
          xid (before BEFORE-ROW triggers run; only 1 in 32 nextval calls writes WAL and takes an xid early).
          pg_locks and the pid/datid of pg_stat_activity are readable by any role. It also waits for unrelated
          transactions open in that database then (a long report query, an idle-in-transaction session).
          PREPARE TRANSACTION releases a vxid, so a prepared transaction of that database whose xid was taken after
          the max was seen also holds it, until COMMIT PREPARED or ROLLBACK PREPARED (pg_prepared_xacts: any role).
          Not covered: client-supplied ids (a watermark sequence with CACHE > 1 is refused:
          `refuse_unknowable_finality`).
        - MariaDB/MySQL: `settle_seconds` have passed on the database clock AND none of the InnoDB transactions
          open when the max was seen is still open. Needs the PROCESS privilege (`SourceError` otherwise).
          A timestamp watermark's candidate also stays below every running writing statement's start
          (`_earliest_running_write`, applied in `observe`).
          Not covered: a transaction that took an auto-increment id but was not yet listed in innodb_trx when the
          max was read (a window of microseconds inside its insert, or between our snapshot and the max read
          under READ COMMITTED), a SELECT whose stored function inserts rows, and client-supplied ids.
        - SQLite: one writer at a time; `settle_seconds` on this host's clock.

        And durable: committed is not enough where commits are acknowledged before the log is on disk
        (PostgreSQL's synchronous_commit=off, MariaDB's innodb_flush_log_at_trx_commit=0 or 2). A crash of the
        server then loses the last commits and gives their ids out again: rows sent would vanish from the source and
        new rows with the same ids would never be sent (measured: three committed rows, visible to every session,
        gone after a crash). So the write-ahead (redo) log must be flushed past the point where all those commits
        lay: PostgreSQL's insert position once the transactions waited for have ended; MariaDB's, seen with the
        max when nothing was waited for, else at the check. The check waits up to DURABLE_WAIT_S for the flush (the
        WAL writer's interval, 0.2 s by default; InnoDB's once a second), then answers False. Not covered: MySQL
        (no such status readable without privileges) and SQLite; a failover to a replica that lags.

        A check that fails (connection lost, server away) answers False: not final, never final by default.
        """
        return self.not_final_because(candidate, settle_seconds) is None

    def not_final_because(self, candidate: WatermarkCandidate, settle_seconds: float) -> str | None:
        """`is_final`, saying why not: None when final, else what still holds the candidate (the transaction that
        is still open, the settle delay, the log flush), for the sensor's skip message. Named from what the check
        reads anyway: the idle path (nothing pending) never gets here, and a pending one costs no query more."""
        if candidate.is_settled:
            # It was final, and durable, when it settled. Asked again, its durability target would be the WAL
            # position now, which can include an open transaction's WAL that the WAL writer leaves in a partly
            # filled page until a later commit: a re-cut after a timed-out slice then waited for unrelated writers.
            return None
        try:
            with self.engine.connect() as conn:
                if self.dialect == "postgresql":
                    # The waited-for transactions still open, with their backend's pid: the same lookup as an
                    # EXISTS, and the skip message can name them.
                    # And the prepared transactions of the table's database (pg_prepared_xacts, readable by any
                    # role), read after the vxids: one that prepared before pg_locks was read is listed here.
                    xmin, still_open, prepared, flushed, inserted, started = conn.execute(sa.text(
                        "SELECT pg_snapshot_xmin(pg_current_snapshot())::text, ARRAY(SELECT virtualxid || ' (pid ' "
                        "|| COALESCE(pid::text, '?') || ')' FROM pg_locks WHERE locktype = 'virtualxid' AND granted "
                        "AND virtualxid = ANY(CAST(:waits AS text[]))), "
                        "ARRAY(SELECT ARRAY[gid, transaction::text, prepared::text, owner::text] "
                        "FROM pg_prepared_xacts WHERE database = current_database() ORDER BY prepared), "
                        "pg_current_wal_flush_lsn()::text, pg_current_wal_insert_lsn()::text, "
                        "pg_postmaster_start_time()"), {"waits": list(candidate.waits)}).one()
                    if int(xmin) < candidate.marker:
                        # xid8 -> the 32-bit xid that pg_stat_activity.backend_xid and pg_prepared_xacts show.
                        return (f"transaction id {int(xmin) & 0xFFFFFFFF}, begun before the max was seen, is still "
                                "open (the oldest on the server, in any database: pg_stat_activity.backend_xid, or "
                                "pg_prepared_xacts if it is a prepared transaction)")
                    # PREPARE TRANSACTION releases the vxid lock ("not meaningful after restart"), so a transaction
                    # waited for by its vxid, that took its xid after the max was seen (at or above the marker: the
                    # xmin above passes it) and prepared, is no longer among `still_open`, though COMMIT PREPARED
                    # may still make rows below the max visible. Those prepared with a lower xid hold the xmin.
                    holding = [_pg_prepared_text(*row) for row in prepared or []
                               if _pg_full_xid(int(row[1]), int(xmin)) >= candidate.marker]
                    if holding:
                        return _first_few(holding)
                    if still_open:
                        return (f"transaction {_first_few(list(still_open), sep=', ')}, open in the table's "
                                "database when the max was seen, is still open (pg_stat_activity by that pid)")
                    # The first position seen once the waits ended is the target, kept: a later one would move
                    # with every write (a WAL writer slower than the check's wait would never be caught up with).
                    # Per server start: after a crash the same candidate can come back (its xids given out again)
                    # over WAL written anew, which a target from before the crash does not cover.
                    key = (str(self.engine.url), started, candidate)
                    target = DURABLE_TARGETS.answer(key, lambda: pg_lsn(inserted))

                    if wal_flushed_to(pg_lsn(flushed), target) or _flushed_within(lambda: wal_flushed_to(pg_lsn(
                            conn.execute(sa.text("SELECT pg_current_wal_flush_lsn()::text")).scalar()), target)):
                        DURABLE_TARGETS.forget(key)
                        return None
                    return _NOT_DURABLE
                if self.dialect == "mysql":
                    now = float(conn.execute(sa.text("SELECT UNIX_TIMESTAMP(NOW(6))")).scalar())
                    if now - candidate.marker < settle_seconds:
                        return _settling(settle_seconds)
                    # A stale cache can only list a transaction that has ended since: never calls one ended too soon.
                    open_now = self._innodb_trx(conn) if candidate.waits else []
                    holding = [row for row in open_now
                               if any(_same_innodb_trx(wait, [row]) for wait in candidate.waits)]
                    if holding:
                        # A detached XA transaction first: it is the one that will not end by itself.
                        holding.sort(key=lambda row: row.trx_mysql_thread_id != 0)
                        return _first_few([_innodb_trx_text(row) for row in holding])
                    lsns = _innodb_lsns(conn)
                    if "innodb_lsn_flushed" not in lsns:  # MySQL: not readable (docstring)
                        return None
                    # InnoDB flushes a lazy log within a second (innodb_flush_log_at_timeout), inside the check's
                    # wait: the position at the check is a target reached in time.
                    target = (candidate.durable_at if candidate.durable_at is not None and not candidate.waits
                              else lsns["innodb_lsn_current"])
                    flushed_in_time = lsns["innodb_lsn_flushed"] >= target or _flushed_within(
                        lambda: _innodb_lsns(conn)["innodb_lsn_flushed"] >= target)
                    return None if flushed_in_time else _NOT_DURABLE
        except sa.exc.DBAPIError as exc:
            # Logged: a check that keeps failing stalls the table, and this says why.
            _log.warning("watermark %s not known final yet: the check failed: %s", candidate.watermark,
                         exc.orig or exc)
            return f"the finality check failed: {exc.orig or exc}"
        return None if time.time() - candidate.marker >= settle_seconds else _settling(settle_seconds)

    def _innodb_trx_open_since(self, conn: sa.Connection, connection_id: int) -> tuple[str, ...]:
        """The other InnoDB transactions open now, from a read of innodb_trx whose cache was filled by that very
        read, so after everything this connection read before it (the max, the running statements). innodb_trx is a
        cache that InnoDB refreshes only when nobody read it for 100 ms; a client reading it often keeps it stale,
        blind to transactions that touched a row since. Our own transaction's row (`connection_id`, in a transaction
        since before the max) carries the statement it ran when the cache was filled: this read's own token there
        proves the fill came with this read. Our row alone would not: a fill by another client after our transaction
        began, but before the running statements were read, lists it too, and misses a statement that ended in
        between, its transaction left open. Otherwise wait past 100 ms and read again."""
        for _ in range(INNODB_TRX_READS):
            token = uuid.uuid4().hex
            rows = self._innodb_trx(conn, token)
            if any(r.trx_mysql_thread_id == connection_id and token in (r.trx_query or "") for r in rows):
                return tuple(_innodb_trx_key(r) for r in rows if r.trx_mysql_thread_id != connection_id)
            time.sleep(0.15)
        raise InnodbTrxStale(f"source {self.safe_description}: information_schema.innodb_trx stayed stale for "
                           f"{INNODB_TRX_READS * 0.15:.1f} s (another client reads it more often than every 100 ms), "
                           "so the transactions still open below the max watermark are unknown; retried next time")

    def _innodb_trx(self, conn: sa.Connection, token: str = "") -> list[sa.Row]:
        """InnoDB's (cached) list of open transactions. `token` opens the statement's text, so that a cache filled by
        this read shows it as our own transaction's trx_query (InnoDB keeps a statement's first 1024 characters)."""
        try:
            return list(conn.execute(sa.text(
                f"/* rowrelay {token} */ SELECT trx_id, trx_mysql_thread_id, trx_started, trx_query "
                "FROM information_schema.innodb_trx")))
        except sa.exc.DBAPIError as exc:
            if _mysql_error_code(exc) in (1227, 1044, 1142):  # access denied: no PROCESS privilege
                user = self.sqlalchemy_url.username or "<user>"
                raise SourceError(
                    f"source {self.safe_description}: user {user!r} cannot read information_schema.innodb_trx, "
                    "which rowrelay needs to know when new rows are final (transactions still open below the max "
                    f"watermark); run `GRANT PROCESS ON *.* TO '{user}'@'<host>'` ({exc.orig})") from None
            raise

    def check_watermark_range(self, shape: TableShape) -> None:
        """Refuse a watermark beyond what rowrelay carries (a signed 64-bit integer): BIGINT UNSIGNED values
        >= 2^63 would wrap when Spark's decimal(20,0) is cast to a long."""
        top = self.max_watermark(shape)
        if top is not None and top > MAX_WATERMARK:
            raise SourceError(self._range_message(shape, top))

    def check_watermark_times(self, shape: TableShape, label: str) -> None:
        """Refuse a PostgreSQL timestamp watermark holding a value after the year 9999 (rowrelay carries it as
        microseconds, within Python's datetime): 'infinity' or year 10000 made every cut fail with the driver's
        "timestamp too large", naming neither table nor column."""
        # Only above: the table's max is read as a time, every cut's too; rows before the year 1 ('-infinity') lie
        # below any progress and are never read (a table holding them relays, with a `start_after`).
        t = self._table(shape)
        bound = sa.literal_column("TIMESTAMPTZ '10000-01-01 00:00:00+00'" if shape.watermark_kind == "timestamptz"
                                  else "TIMESTAMP '10000-01-01'")
        q = self.filtered(sa.select(sa.literal(1)).select_from(t).where(t.c[shape.watermark] >= bound), shape)
        with self.engine.connect() as conn:
            above = conn.execute(q.limit(1)).first()
        if above:
            raise SourceError(
                f"{label}: watermark column {shape.watermark!r} holds times after the year 9999 ('infinity' "
                "included); a timestamp watermark must be a time of the years 1-9999 (rowrelay carries it as "
                "microseconds since 1970), so no slice can be cut. Fix those rows, or leave them out with `where:` "
                f"(for example {shape.watermark} < '10000-01-01'); nothing was sent")

    def check_mysql_datetime_watermark(self, shape: TableShape, label: str) -> None:
        """Refuse a MariaDB/MySQL DATETIME watermark that moves when a row is updated (`ON UPDATE
        CURRENT_TIMESTAMP`: the UPDATE lifted a row sent already above progress, and it was sent again).

        Zero dates and zero months or days ('0000-00-00', '2024-05-00': an sql_mode without NO_ZERO_DATE /
        NO_ZERO_IN_DATE accepts them) are not looked for here: inside a slice they relay as stored, and below a
        `start_after` they are never read; where a cut or check meets one as a bound, `TableShape.watermark_value`
        refuses it (it failed every tick with a bare "invalid literal for int()")."""
        with self.engine.connect() as conn:
            extra = conn.execute(sa.text(
                "SELECT EXTRA FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = COALESCE(:schema, DATABASE()) "
                "AND TABLE_NAME = :table AND COLUMN_NAME = :column"),
                {"schema": shape.schema, "table": shape.name, "column": shape.watermark}).scalar()
            if extra and "on update" in extra.lower():
                raise SourceError(
                    f"{label}: watermark column {shape.watermark!r} is set on every UPDATE ({extra}): an update "
                    "moves a row already sent above progress, and it would be sent again (a duplicate). Drop the "
                    f"clause (`ALTER TABLE {shape.name} MODIFY {shape.watermark} <its type and DEFAULT, without "
                    "ON UPDATE>`) or choose a watermark that is set once, when the row is inserted (an "
                    "AUTO_INCREMENT id, a creation time); nothing was sent")

    def check_mysql_sequence_watermark(self, shape: TableShape, label: str) -> None:
        """Refuse a MariaDB integer watermark whose DEFAULT draws from a SEQUENCE (`DEFAULT NEXTVAL(s)`) on a table
        with a BEFORE INSERT trigger. The id is drawn as the row's defaults are filled, before the trigger runs,
        while InnoDB lists the transaction only once it writes the row: a trigger that takes seconds holds an
        id no cut can wait for, which committed below a cut made meanwhile and was never sent (found by review).
        AUTO_INCREMENT is drawn as the row is written, after the triggers. Triggers are listed only to a role with
        the TRIGGER privilege on the table: without it this is not seen (docs/design.md)."""
        with self.engine.connect() as conn:
            default = conn.execute(sa.text(
                "SELECT COLUMN_DEFAULT FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = "
                "COALESCE(:schema, DATABASE()) AND TABLE_NAME = :table AND COLUMN_NAME = :column"),
                {"schema": shape.schema, "table": shape.name, "column": shape.watermark}).scalar()
            if not default or not re.search(r"\bnextval\s*\(", default, re.IGNORECASE):
                return
            triggers = conn.execute(sa.text(
                "SELECT TRIGGER_NAME FROM information_schema.TRIGGERS WHERE EVENT_OBJECT_SCHEMA = "
                "COALESCE(:schema, DATABASE()) AND EVENT_OBJECT_TABLE = :table AND EVENT_MANIPULATION = 'INSERT' "
                "AND ACTION_TIMING = 'BEFORE' ORDER BY ACTION_ORDER"),
                {"schema": shape.schema, "table": shape.name}).scalars().all()
        if triggers:
            raise SourceError(
                f"{label}: watermark column {shape.watermark!r} takes its ids from a sequence (DEFAULT {default}), "
                f"and BEFORE INSERT trigger(s) {', '.join(triggers)} run after the id is drawn but before InnoDB "
                "lists the inserting transaction: while a trigger runs, no cut can see that id is still to come, "
                "and a row committed below a cut is never sent. Take the ids from AUTO_INCREMENT (drawn as the row "
                "is written, after the triggers); nothing was cut or sent")

    def _range_message(self, shape: TableShape, value: int) -> str:
        label = shape.label
        return (f"{label}: watermark column {shape.watermark!r} holds {value}, above the largest watermark rowrelay "
                f"supports, {MAX_WATERMARK} (2^63 - 1, a signed 64-bit integer); a BIGINT UNSIGNED watermark must "
                "stay below 2^63. Use another watermark column or a view that maps it below 2^63")

    def jdbc_options(self) -> dict[str, Any]:
        """What Spark's JDBC source needs to read this database (see resources/jdbc.py)."""
        return jdbc_options(self.sqlalchemy_url, self.dialect)


# A declared type's (precision[, scale]): the driver reports that scale (0 without one) to Spark.
_SQLITE_PRECISION = re.compile(r"\(\s*(\d+)\s*(?:,\s*(\d+)\s*)?\)")
# The scale Spark reads a SQLite numeric column at when its type names none (NUMERIC, DECIMAL, NUMBER...): its
# DecimalType.SYSTEM_DEFAULT, decimal(38, 18).
SQLITE_DEFAULT_SCALE = 18
# A real as sqlite-jdbc (3.49) reads it into a decimal: its native library's text of a double, 15 significant digits
# (newer SQLite renders 17 by default, so the format is named, not left to CAST). {c}: the quoted column.
SQLITE_REAL_TEXT = "printf('%!.15g', {c})"


SqliteAffinity = Literal["integer", "text", "blob", "real", "date", "boolean", "numeric"]


def sqlite_affinity(declared: str) -> SqliteAffinity:
    """How rowrelay reads a SQLite column of this declared type (upper case): SQLite's affinity rules in their order
    (INT, then CHAR/CLOB/TEXT, BLOB or none, REAL/FLOA/DOUB, else numeric), with two numeric kinds of its own: dates
    and times (SQLite has none; read as their text) and booleans. The read's types (resources/spark.py) and the
    misfit check (`sqlite_misfit`) both follow it."""
    if "INT" in declared:
        return "integer"
    if any(x in declared for x in ("CHAR", "CLOB", "TEXT")):
        return "text"
    if not declared or "BLOB" in declared:
        return "blob"
    if any(x in declared for x in ("REAL", "FLOA", "DOUB")):
        return "real"
    if any(x in declared for x in ("DATE", "TIME")):
        return "date"
    return "boolean" if "BOOL" in declared else "numeric"


def _sqlite_real_fits_sql(c: str, t: str, scale: int) -> str:
    """SQL true where the real in `c`, whose driver text is in `t`, reaches Spark's decimal(p, `scale`) exactly: the
    text must give the stored double back, with at most `scale` decimals (exponent forms such as 1.0e-07 counted;
    trailing zeros not)."""
    mantissa = f"(CASE WHEN instr({t}, 'e') > 0 THEN substr({t}, 1, instr({t}, 'e') - 1) ELSE {t} END)"
    exponent = f"(CASE WHEN instr({t}, 'e') > 0 THEN CAST(substr({t}, instr({t}, 'e') + 1) AS INTEGER) ELSE 0 END)"
    digits = f"rtrim(rtrim({mantissa}, '0'), '.')"
    decimals = (f"((CASE WHEN instr({digits}, '.') > 0 THEN length({digits}) - instr({digits}, '.') ELSE 0 END)"
                f" - {exponent})")
    return f"(CAST({t} AS REAL) = {c} AND {decimals} <= {scale})"


def _sqlite_misfit_sql(declared: str, c: str, t: str) -> str:
    """SQL true where a SQLite value does not fit its column's declared type (`sqlite_affinity`; "": any value is
    read as it is: BLOB and untyped columns, and dates and times, read as their text). `t`: the column of a real's
    driver text (SQLITE_REAL_TEXT)."""
    affinity = sqlite_affinity(declared)
    if affinity == "integer":
        return f"typeof({c}) NOT IN ('integer', 'null')"
    if affinity == "text":
        return f"typeof({c}) NOT IN ('text', 'null')"
    if affinity == "blob":
        return ""
    if affinity == "real":
        return f"typeof({c}) NOT IN ('real', 'integer', 'null')"
    if affinity == "date":
        return f"typeof({c}) = 'blob'"
    if affinity == "boolean":
        return f"NOT (typeof({c}) = 'null' OR (typeof({c}) = 'integer' AND {c} IN (0, 1)))"
    # Numeric, read as a decimal(p, s): integers, or reals its scale holds exactly, below 10^(p - s) (Spark's read
    # of a larger one failed, naming neither row nor column).
    precision = _SQLITE_PRECISION.search(declared)
    digits = min(int(precision.group(1)), 38) if precision else 38
    scale = int(precision.group(2) or 0) if precision else SQLITE_DEFAULT_SCALE
    fits = _sqlite_real_fits_sql(c, t, scale)
    bound = f"1e{max(digits - scale, 0)}"  # not abs(): it overflows on the smallest integer
    return (f"NOT (typeof({c}) = 'null' OR ({c} > -{bound} AND {c} < {bound} AND "
            f"(typeof({c}) = 'integer' OR (typeof({c}) = 'real' AND {fits}))))")


DURABLE_WAIT_S = 1.2  # InnoDB flushes a lazily written log once a second (innodb_flush_log_at_timeout)
_WAL_PAGE = 8192
_WAL_PAGE_HEADERS = (24, 40)  # a page's short header; the long one at a WAL segment's start


def pg_lsn(text: str) -> int:
    """A PostgreSQL LSN ('16/B374D848') as an integer."""
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def wal_flushed_to(flushed: int, target: int) -> bool:
    """Whether WAL flushed up to `flushed` covers everything inserted before `target`. An insert position at a page
    start points past the page's header, which is written only with the next record: a flush that ended at the page
    boundary covers it (else an idle server whose last record ended a page would never look flushed)."""
    offset = target % _WAL_PAGE
    return flushed >= target or (offset in _WAL_PAGE_HEADERS and flushed >= target - offset)


def invalid_datetime_message(label: str, column: str, value: str) -> str:
    """Why a MariaDB/MySQL DATETIME watermark holding a zero date, or a zero month or day, cannot be relayed."""
    return (f"{label}: watermark column {column!r} holds {value!r}, a DATETIME with a zero date, month or day (an "
            "sql_mode without NO_ZERO_DATE and NO_ZERO_IN_DATE accepts them), which is no time rowrelay can carry or "
            "order, so no slice can be cut at it. Fix those rows (UPDATE them to real times), or leave them out: zero "
            "dates lie below every time, so a `start_after` skips them; others, unless one is the table's newest, "
            f"with `where: {column} >= '1000-01-01' AND MONTH({column}) > 0 AND DAYOFMONTH({column}) > 0` in "
            "rowrelay.yaml. Add NO_ZERO_DATE,NO_ZERO_IN_DATE to the server's sql_mode to keep new ones out. Nothing "
            "of such a slice was sent")


# Query parameters of a source URL whose values are not shown (`safe_description`): libpq's sslpassword, tokens,
# keys (a key's file name is hidden too, harmlessly).
_SECRET_PARAMETER = re.compile(r"pass|secret|token|key|credential", re.IGNORECASE)


def _parse_source_url(template: str) -> sa.URL:
    """A source's URL, ${VAR}s resolved each in its part (`resolve_url_env`). A URL that does not parse fails
    naming what to check, never with its text: it may hold a password."""
    try:
        return make_url(resolve_url_env(template))
    except (ValueError, sa.exc.ArgumentError) as exc:
        if isinstance(exc, ConfigError):
            raise
        variables = ", ".join(f"${{{name}}}" for name in env_names(template)) or "none"
        raise SourceError(f"a source url is not a valid database URL ({type(exc).__name__}; its variables: "
                          f"{variables}): check its host, port and database. A password or parameter value given "
                          "through ${VAR} is taken literally and needs no escaping") from None


def _flushed_within(flushed: Callable[[], bool], wait_s: float = DURABLE_WAIT_S) -> bool:
    """Whether `flushed()` turns true within `wait_s`, asked every 10 ms."""
    deadline = time.monotonic() + wait_s
    while not flushed():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _innodb_lsns(conn: sa.Connection) -> dict[str, int]:
    """MariaDB's redo log positions (Innodb_lsn_current, Innodb_lsn_flushed; lower-case keys), readable by any
    user; empty on MySQL, which has no such status variables."""
    rows = conn.execute(sa.text("SHOW GLOBAL STATUS WHERE Variable_name IN "
                                "('Innodb_lsn_current', 'Innodb_lsn_flushed')")).all()
    return {str(name).lower(): int(value) for name, value in rows}


# innodb_trx's trx_id of a transaction that has written: MySQL prints one that has not (read-only so far) as its
# memory address with bit 48 set, an id the next transaction on that connection may show again.
_INNODB_WRITE_TRX_IDS = 2**48


def _mysql_incarnation(shape: TableShape) -> sa.TextClause:
    """MariaDB/MySQL: the table's incarnation, as a scalar subquery to read in the statement that reads its max (the
    statement's metadata lock keeps the table from being dropped in between): its CREATE_TIME in
    information_schema.TABLES, which any user who may read the table may read, as epoch seconds (UNIX_TIMESTAMP:
    the same text in any session time zone; whole seconds, all either server keeps). A DROP and CREATE
    changes it, unless both fall in the old table's creation second; so does an ALTER that rebuilds the table, which
    only drops a pending candidate needlessly (sensors.settled_watermark). TRUNCATE keeps it. MariaDB takes it from
    the .frm file, MySQL 8 from the data dictionary (mysql.tables.created, not the statistics that
    information_schema_stats_expiry caches). NULL (no token, as before) for a view."""
    schema = ":rowrelay_schema" if shape.schema else "DATABASE()"
    clause = sa.text("(SELECT CAST(UNIX_TIMESTAMP(CREATE_TIME) AS CHAR) FROM information_schema.TABLES "
                     f"WHERE TABLE_SCHEMA = {schema} AND TABLE_NAME = :rowrelay_name)")
    # Literal names in the lookup (not COALESCE of a parameter): MariaDB then opens that one table, not every one.
    return clause.bindparams(rowrelay_name=shape.name, **({"rowrelay_schema": shape.schema} if shape.schema else {}))


def _innodb_trx_key(row: sa.Row) -> str:
    """One open InnoDB transaction, as `thread id|trx_started|trx_id` (as InnoDB reports them, so never converted
    between zones). The thread and start tell a transaction while its client is connected; trx_id, once it has
    written (before that it is 0, or an address on MySQL, and it changes at the first write), also after its client
    disconnected from a prepared XA transaction, which MariaDB keeps detached under thread id 0."""
    trx_id = int(row.trx_id) if str(row.trx_id).isdigit() else 0
    return f"{row.trx_mysql_thread_id}|{row.trx_started}|{trx_id if trx_id < _INNODB_WRITE_TRX_IDS else 0}"


def _innodb_trx_text(row: sa.Row) -> str:
    """An open InnoDB transaction, as the skip message names it. Thread id 0 is a prepared XA transaction whose
    client disconnected (`_innodb_trx_key`): unlike any other it never ends by itself, so the text says who must
    end it."""
    if row.trx_mysql_thread_id == 0:
        return (f"a prepared XA transaction (InnoDB trx_id {row.trx_id}, started {row.trx_started}) whose client "
                "disconnected is still open: it will not end on its own; its transaction manager, or an operator, "
                "must XA COMMIT or XA ROLLBACK it (XA RECOVER lists its xid)")
    return (f"InnoDB transaction {row.trx_id} of connection {row.trx_mysql_thread_id} (started {row.trx_started}), "
            "open when the max was seen, is still open")


def _pg_full_xid(xid: int, xmin: int) -> int:
    """A 32-bit xid still running (pg_prepared_xacts.transaction) as the 64-bit xid8 it is: at or above `xmin`, the
    xid8 of a snapshot taken while it runs (the oldest running xid, less than 2^31 below any running one)."""
    return xmin + ((xid - xmin) & 0xFFFFFFFF)


def _pg_prepared_text(gid: str, xid: str, prepared: str, owner: str) -> str:
    """A PostgreSQL prepared transaction that holds a candidate, as the skip message names it: like MariaDB's
    detached XA transaction (`_innodb_trx_text`), it never ends by itself, so the text says who must end it."""
    return (f"prepared transaction {gid!r} (transaction id {xid}, prepared {prepared} by {owner}), which took its "
            "transaction id after the max was seen, may still commit rows below it: it will not end on its own; its "
            "transaction manager, or an operator, must COMMIT PREPARED or ROLLBACK PREPARED it (pg_prepared_xacts "
            "lists its gid)")


def _first_few(texts: list[str], few: int = 2, sep: str = "; ") -> str:
    """The first `few` of what holds a candidate, and how many more: a skip message stays readable."""
    more = f" (and {len(texts) - few} more)" if len(texts) > few else ""
    return sep.join(texts[:few]) + more


def _settling(settle_seconds: float) -> str:
    return f"settle_seconds ({settle_seconds:g} s) have not passed since the max was seen"


_NOT_DURABLE = "their commits are not on disk yet (the server's log is not flushed past them)"


def _same_innodb_trx(key: str, open_now: list[sa.Row]) -> bool:
    """Whether the transaction `key` names is among `open_now`: the same thread and start; or the same trx_id, once
    it has written; or a detached XA transaction (thread 0) of the same start, whose trx_id changed if it first
    wrote after the key was taken (another detached one of that second only makes the cut wait longer). A key
    without trx_id (a sensor cursor written before it was kept) is matched by thread and start."""
    thread, started, *rest = key.split("|")
    trx_id = rest[0] if rest and rest[0] != "0" else None
    for row in open_now:
        now = _innodb_trx_key(row).split("|")
        if now[1] == started and now[0] in (thread, "0"):
            return True
        if trx_id is not None and now[2] == trx_id:
            return True
    return False


def _mysql_error_code(exc: sa.exc.DBAPIError) -> int | None:
    args = getattr(exc.orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None
