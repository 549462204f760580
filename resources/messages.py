"""Rows -> Kafka messages, computed inside Spark (JVM), and streamed to Python in bounded Arrow batches.

Value: a JSON object of the selected columns, exact for common types: integers as numbers, decimals as
strings with their scale, floats as numbers, timestamps ISO-8601 (with offset when the column has a time
zone), dates, binary as base64, JSON columns embedded, NULL as null.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from math import ceil
from typing import TYPE_CHECKING

from resources.exactly_once import BadRowError, MessageBatch, TableChannel, skip_advice
from resources.slices import RowSkip, SliceRange, watermark_text

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import Column, DataFrame
    from pyspark.sql.types import StructField

    from resources.source_database import TableShape

KeyPolicy = list[str] | str  # column names | "hash_row" | "none"
JSON_OPTIONS = {"ignoreNullFields": "false"}


JSON_CLIENT_TYPES = {"json", "jsonb"}
TS_FORMAT = "yyyy-MM-dd'T'HH:mm:ss.SSSSSS"


def is_json_field(field: StructField, json_columns: set[str]) -> bool:
    return field.name in json_columns or (field.metadata or {}).get("jdbcClientType", "").lower() in JSON_CLIENT_TYPES


def column_to_json_expr(field: StructField) -> Column:
    """A Spark expression whose to_json rendering is the exact JSON form of a (non-JSON) column's values.

    Verified against psycopg/pymysql reads (see tests/test_types.py): decimals keep their scale as
    strings, timestamps keep microseconds, an offset only where the column has a time zone.
    """
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    col = F.col(f"`{field.name}`")
    dt = field.dataType
    client_type = (field.metadata or {}).get("jdbcClientType", "")
    if client_type == "float4" and isinstance(dt, T.StringType):
        return col.cast("double")  # read as PostgreSQL's text: Java 17's Float.toString is not shortest
    if isinstance(dt, T.DecimalType):
        if dt.scale == 0 and client_type.upper().startswith("BIGINT"):
            return col  # BIGINT UNSIGNED (Spark's decimal(20,0)) is an integer: a JSON number
        return col.cast("string")  # "12.30": exact, scale kept, never exponent notation
    if isinstance(dt, T.TimestampNTZType):
        return F.date_format(col, TS_FORMAT)
    if isinstance(dt, T.TimestampType):
        if client_type.upper() == "DATETIME":  # MariaDB DATETIME, read as an instant in a UTC session
            return F.date_format(col, TS_FORMAT)
        return F.date_format(col, TS_FORMAT + "xxx")  # xxx prints +00:00 (XXX would print Z)
    if isinstance(dt, T.DateType):
        return F.date_format(col, "yyyy-MM-dd")
    if isinstance(dt, T.BinaryType):
        return F.base64(col)  # needs spark.sql.chunkBase64String.enabled=false (no line breaks)
    return col


def json_object_expr(fields: list[StructField], json_columns: set[str], texts: dict[str, str] | None = None
                     ) -> Column:
    """One JSON object per row, fields in column order, computed in the JVM.

    JSON columns are spliced in verbatim (PostgreSQL's are valid JSON; MariaDB's are checked first, `json_checked`):
    Spark's VARIANT would re-sort keys and drop decimal scale (1.10 -> 1.1), which is not exact. `texts`: column -> the
    column of its text as the source rendered it (NULL where the source left the value to Spark; see
    TableShape.rendered_select).
    """
    from pyspark.sql import functions as F

    texts = texts or {}

    def value(f: StructField) -> Column:
        if f.name in texts:
            return F.coalesce(F.col(f"`{texts[f.name]}`"), column_to_json_expr(f))
        return column_to_json_expr(f)

    def plain(group: list[StructField]) -> Column:
        return F.to_json(F.struct(*[value(f).alias(f.name) for f in group]), JSON_OPTIONS)

    if not any(is_json_field(f, json_columns) for f in fields):
        return plain(fields)
    parts: list[Column] = []
    group: list[StructField] = []
    for f in fields + [None]:  # type: ignore[list-item]
        if f is not None and not is_json_field(f, json_columns):
            group.append(f)
            continue
        if group:  # {"a":1,"b":2} -> "a":1,"b":2
            # (?s): to_json leaves U+0085, U+2028 and U+2029 unescaped, and Java's "." matches none of them
            # without DOTALL: the match failed and the group's columns vanished from the message.
            parts.append(F.regexp_extract(plain(group), r"(?s)^\{(.*)\}$", 1))
            group = []
        if f is not None:
            name = json.dumps(f.name)
            parts.append(F.concat(F.lit(f"{name}:"), F.coalesce(F.col(f"`{f.name}`").cast("string"), F.lit("null"))))
    return F.concat(F.lit("{"), F.concat_ws(",", *parts), F.lit("}"))


# How a row whose text is not valid UTF-8 stops the read (raise_error in Spark), for SliceFrame.fetch to name it.
BAD_UTF8 = "rowrelay-bad-utf8"
# A stopped row's mark: its watermark and, where the table has one, its tie_break as {"t": text} (JSON) to tell
# it from the rows sharing its watermark.
_ROW_MARK = r"(-?\d+)(?: tie (\{(?:[^\"}]|\"(?:[^\"\\]|\\.)*\")*\}))?"
_BAD_UTF8_AT = re.compile(BAD_UTF8 + r"\[" + _ROW_MARK + r"\] column (\"(?:[^\"\\]|\\.)*\")(?: charset ([a-z0-9_]+))?")


def row_mark(shape: TableShape) -> Column:
    """The text a read stopped at a row names it by (`_ROW_MARK`), computed per row in Spark."""
    from pyspark.sql import functions as F

    wm = F.col(f"`{shape.frame_watermark}`").cast("long").cast("string")
    if shape.tie_break is None:
        return wm
    tie = F.to_json(F.struct(F.col(f"`{shape.tie_break}`").cast("string").alias("t")))
    return F.concat(wm, F.lit(" tie "), tie)


def _marked_row(found: re.Match[str]) -> tuple[int, str | None]:
    """The watermark and the tie_break text (None: none, or NULL) of a row a read stopped at."""
    tie = json.loads(found.group(2)).get("t") if found.group(2) else None
    return int(found.group(1)), tie


def utf8_checked(df: DataFrame, fields: dict[str, StructField], shape: TableShape
                 ) -> tuple[DataFrame, dict[str, StructField]]:
    """The columns read as bytes (`ColumnInfo.utf8_bytes`) as text, checked: bytes that are not valid UTF-8 stop
    the read naming the row and the column (BAD_UTF8), where the JDBC driver replaced them with U+FFFD (or, for a
    column in another charset, `ColumnInfo.charset`, the server with '?')."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType, StructField

    wm = row_mark(shape)
    checked = {}
    shadows = shape.utf8_shadows
    for c in shape.columns:
        if (c.utf8_bytes or c.utf8_shadow) and c.name in fields:
            # The bytes as they are: no decoding, no replacement. A shadowed column keeps the driver's text (and the
            # driver's JSON mark) where its bytes are valid: then the two are the same.
            raw = F.col(f"`{shadows[c.name] if c.utf8_shadow else c.name}`").cast("string")
            text = F.col(f"`{c.name}`") if c.utf8_shadow else raw
            charset = f" charset {c.charset}" if c.charset else ""
            stop = F.raise_error(F.concat(F.lit(f"{BAD_UTF8}["), wm, F.lit(f"] column {json.dumps(c.name)}{charset}")))
            checked[c.name] = F.when(raw.isNull() | F.is_valid_utf8(raw), text).otherwise(stop)
    if not checked:
        return df, fields
    return df.withColumns(checked), {**fields, **{n: StructField(n, StringType(), fields[n].nullable)
                                                 for n in checked if n not in shadows}}


def bad_utf8_error(table: str, message: str, timestamps: bool) -> BadRowError | None:
    """The BadRowError for a read stopped by `utf8_checked`, from the error's message; None for any other."""
    found = _BAD_UTF8_AT.search(message)
    if found is None:
        return None
    (at, tie), column, charset = _marked_row(found), json.loads(found.group(3)), found.group(4)
    row = watermark_text(at, timestamps)
    if charset:
        what = (f"bytes that are not {charset} text in column {column!r} (a connection with the binary charset "
                "stores any bytes, such as E9 in an ascii column); the server would send each as '?'")
    else:
        what = (f"text that is not valid UTF-8 in column {column!r} (MariaDB accepts an encoded surrogate such as "
                "the bytes ED A0 80 in a utf8 column); the JDBC driver would replace it with U+FFFD")
    return BadRowError(
        f"{table}: row {row} holds {what}, so it would not arrive as stored; nothing of the slice is sent. Fix the "
        f"value, or {skip_advice(row)}; then re-run the slice.", table=table, watermark=at, column=column, entry=row,
        tie=tie)


# How a row whose JSON column holds text that is not JSON stops the read (raise_error in Spark), for SliceFrame.fetch.
BAD_JSON = "rowrelay-bad-json"
_BAD_JSON_AT = re.compile(BAD_JSON + r"\[" + _ROW_MARK + r"\] column (\"(?:[^\"\\]|\\.)*\")")

# A JSON text is reduced to its bare structure, then parsed. The reductions, left to right: each valid escape to a
# plain character, each string (no control character, no other backslash) to "", each number (RFC 8259's grammar,
# standing alone) to 0. What was not valid stays as it was, and fails below. Possessive quantifiers only: no
# backtracking, no recursion per character (a long string would overflow Java's regex stack).
_JSON_ESCAPE = r'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})'
_JSON_STRING = r'"[^"\\\x00-\x1f]*+"'
_JSON_NUMBER = r'(?<![\w.+\-])-?+(?:0|[1-9][0-9]*+)(?:\.[0-9]++)?+(?:[eE][+\-]?+[0-9]++)?+(?![\w.+\-])'


def is_json_text(col: Column) -> Column:
    """True where `col` (not NULL) is one JSON text (RFC 8259), duplicate keys allowed; False, never NULL, otherwise.

    Spark has no strict validator: try_parse_json ignores text after the first value ({"a":1}x), rejects duplicate
    keys (by a session setting) and lone surrogate escapes; Spark's JSON functions take single quotes and raw control
    characters in strings, and their Jackson limits numbers (1000 characters), names and nesting. So the text is
    parsed by Jackson twice, as an array's only element and as the first of two: each parse ignores what follows the
    array's closing bracket, and no text passes both but one value. A short text without a single quote or a
    control character is parsed as it is (the common case: no regex pass). Any other text first has its strings and
    numbers checked by regex and reduced (no length limit applies to them then), and fails for a quote left (not
    a string) or a single quote. Jackson's one limit left: 999 levels of nesting (MariaDB's json_valid() takes 31).
    """
    from pyspark.sql import functions as F

    def one_value(text: Column) -> Column:
        # [text] has one element: a single value, or one closed early ("1]x"); [text,0] then has one, not two.
        alone = F.json_array_length(F.concat(F.lit("["), text, F.lit("]"))).eqNullSafe(1)
        first = F.json_array_length(F.concat(F.lit("["), text, F.lit(",0]"))).eqNullSafe(2)
        return alone & first

    reduced = F.regexp_replace(F.regexp_replace(F.regexp_replace(col, _JSON_ESCAPE, "x"), _JSON_STRING, '""'),
                               _JSON_NUMBER, "0")
    stray_quote = F.regexp_replace(reduced, '""', "").rlike("[\"']")
    # At most 1000 characters (no number, name or string beyond Jackson's limits) and nothing Spark's lenient
    # Jackson takes that JSON does not (a single quote, a raw control character): parsed as it is.
    plain = (F.length(col) <= 1000) & ~col.rlike("['\\x00-\\x1f]")
    return F.when(plain, one_value(col)).otherwise(~stray_quote & one_value(reduced))


def json_checked(df: DataFrame, fields: dict[str, StructField], shape: TableShape) -> DataFrame:
    """MariaDB/MySQL JSON columns, checked: a value that is not JSON stops the read naming the row and the column
    (BAD_JSON), since it is spliced into the message as it is. MariaDB's JSON is text with a json_valid() check,
    which takes 1., -, 1e, "\\x41" (and a session with check_constraint_checks=0 skips it: any text): the message
    was not JSON and its slice committed. PostgreSQL parses json strictly on input: not checked (no cost). Only the
    JSON columns' values pay, per row; a table without one runs the same plan as before."""
    from pyspark.sql import functions as F

    if shape.dialect != "mysql":
        return df
    json_cols = set(shape.json_columns)
    names = [c for c in shape.column_names if c in fields and is_json_field(fields[c], json_cols)]
    if not names:
        return df
    wm = row_mark(shape)
    checked = {}
    for name in names:
        col = F.col(f"`{name}`")
        stop = F.raise_error(F.concat(F.lit(f"{BAD_JSON}["), wm, F.lit(f"] column {json.dumps(name)}")))
        checked[name] = F.when(col.isNull() | is_json_text(col), col).otherwise(stop)
    return df.withColumns(checked)


def bad_json_error(table: str, message: str, timestamps: bool) -> BadRowError | None:
    """The BadRowError for a read stopped by `json_checked`, from the error's message; None for any other."""
    found = _BAD_JSON_AT.search(message)
    if found is None:
        return None
    (at, tie), column = _marked_row(found), json.loads(found.group(3))
    row = watermark_text(at, timestamps)
    return BadRowError(
        f"{table}: row {row} holds text that is not JSON in column {column!r} (MariaDB's json_valid() accepts some, "
        "such as 1. or -, and any text with check_constraint_checks=0; or JSON nested deeper than 999 levels), so "
        f"its message would not be JSON; nothing of the slice is sent. Fix the value, or {skip_advice(row)}; then "
        "re-run the slice.", table=table, watermark=at, column=column, entry=row, tie=tie)


def message_columns(df: DataFrame, shape: TableShape, key: KeyPolicy, envelope: bool, table: str,
                    slice_key: str, schema: list[StructField] | None = None) -> DataFrame:
    """key, value, watermark and its text per row, in the input's order (pure Spark; no Python per row).

    `schema`: `df`'s fields if already known (asking Spark is a round trip and a JDBC schema query)."""
    from pyspark.sql import functions as F

    json_cols = set(shape.json_columns)
    fields = {f.name: f for f in (schema if schema is not None else df.schema.fields)}
    df, fields = utf8_checked(df, fields, shape)
    df = json_checked(df, fields, shape)  # after the UTF-8 check: a JSON value's bad bytes are named as such
    texts = {name: text for name, text in shape.source_texts.items() if text in fields}
    data = json_object_expr([fields[c] for c in shape.column_names], json_cols, texts)
    if envelope:
        source = F.to_json(F.struct(F.lit(table).alias("table"), F.col(f"`{shape.frame_watermark}`").alias("watermark"),
                                    F.lit(slice_key).alias("slice")))
        value = F.concat(F.lit('{"op":"insert","data":'), data, F.lit(',"source":'), source, F.lit("}"))
    else:
        value = data
    if isinstance(key, list):
        key_col = json_object_expr([fields[c] for c in key], json_cols, texts)
    elif key == "hash_row":
        # The row's data only (the JSON object of its columns), never the envelope: the same row gets the same key
        # whichever slice (or replay) publishes it.
        key_col = F.sha2(data, 256)
    else:
        key_col = F.lit(None).cast("string")
    # Bytes, not strings, leave the JVM: Python then hands them to the producer without encoding per row.
    return df.select(key_col.alias("key"), value.alias("value"),
                     F.col(f"`{shape.frame_watermark}`").cast("long").alias("watermark")
                     ).select(F.col("key").cast("binary").alias("key"), F.col("value").cast("binary").alias("value"),
                              "watermark", F.col("watermark").cast("string").cast("binary").alias("watermark_text"))


ChunkReader = Callable[[SliceRange, int], "DataFrame"]


class SourceReadError(RuntimeError):
    """Spark could not read a slice from the source; the message carries the JDBC driver's own reason."""


def jvm_cause(exc: BaseException) -> str | None:
    """The JDBC driver's (or other non-Spark) reason behind a Spark error, from its JVM stack trace.

    Spark's FAILED_JDBC.CONNECTION says only "Couldn't connect to the database"; the reason a user can act on
    (a certificate problem, a refused login) is a "Caused by:" line: classic PySpark keeps the trace in
    `_stackTrace`, Spark Connect in `getStackTrace()`.
    """
    get_trace = getattr(exc, "getStackTrace", None)
    trace = get_trace() if callable(get_trace) else getattr(exc, "_stackTrace", None)
    if not isinstance(trace, str):
        return None
    causes = [line.strip().removeprefix("Caused by: ") for line in trace.splitlines()
              if line.strip().startswith("Caused by: ")]
    own = [c for c in causes if not c.startswith(("org.apache.spark.", "java.util.concurrent."))]
    return (own or causes or [None])[0]


@dataclass
class SliceFrame:
    """One slice to publish: its messages, read from the source one watermark sub-range (chunk) at a time.

    `read_chunk(sub_range, expected_rows)` returns the chunk's lazy message DataFrame (key, value, watermark,
    watermark_text); each chunk is its own JDBC read, split over Spark partitions by watermark.
    """

    channel: TableChannel
    slice: SliceRange
    read_chunk: ChunkReader | None  # None: already committed
    expected_rows: int
    first_watermark: int | None = None  # the slice's lowest watermark, if known
    # The rows the slice must publish (in (lo, hi], admitted by `where:`, minus the skipped rows), checked before
    # its commit; None: not known, not checked.
    rows_to_send: int | None = None
    # The skip_watermarks entries inside the slice (their rows left out of its read) and how many rows they left
    # out, recorded with its progress.
    skipped: list[RowSkip] = field(default_factory=list)
    skipped_rows: int = 0
    # What the read depends on (source, table settings, reflected shape, Spark settings, slice, rows): chunks
    # fetched under the same signature are the same rows in the same messages (see EarlyRead). "": not shareable.
    signature: str = ""
    # The columns the slice is read with ([name, type]) and their fingerprint, recorded with its progress.
    columns: list[list[str]] = field(default_factory=list)
    schema_fingerprint: str = ""
    # Raises SchemaRaced where the table's columns are no longer those the slice is read with; asked after each of
    # its chunks is read (or fails to read), so every chunk is proven read with `columns`.
    verify: Callable[[], None] | None = None

    @classmethod
    def failing(cls, channel: TableChannel, slice_range: SliceRange, error: Exception) -> SliceFrame:
        """A slice whose preparation failed with `error`: raised when its rows are fetched, in its own turn. The
        read-ahead prepares the next slice while one publishes; a failure there (a row that cannot be sent, the
        source away) must stop that slice, not the one before it."""
        def refuse(*_: object) -> DataFrame:
            raise error
        return cls(channel=channel, slice=slice_range, read_chunk=refuse, expected_rows=0)

    def sub_ranges(self, chunk_rows: int) -> list[SliceRange]:
        """Split the slice into watermark sub-ranges of about `chunk_rows` rows each, evenly from its first row:
        a slice far wider than its rows (a time table's first slice starts in 1970) would otherwise put every row
        in its last chunk, in memory at once."""
        chunks = max(1, ceil(self.expected_rows / max(1, chunk_rows)))
        lo, hi = self.slice.lo, self.slice.hi
        base = lo if self.first_watermark is None else min(max(lo, self.first_watermark - 1), hi - 1)
        width = max(1, ceil((hi - base) / chunks))
        bounds = [lo] + list(range(base + width, hi, width)) + [hi]
        return [self.slice.span(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]

    def fetch(self, sub: SliceRange, expected_rows: int) -> pa.Table:
        assert self.read_chunk is not None
        try:
            table = self.read_chunk(sub, expected_rows).toArrow()
        except Exception as exc:
            if self.verify is not None:  # a read that failed because the columns changed (one dropped) says so
                self.verify()
            bad = (bad_utf8_error(self.channel.table, str(exc), sub.timestamps)
                   or bad_json_error(self.channel.table, str(exc), sub.timestamps))
            if bad is not None:
                raise bad from exc
            cause = jvm_cause(exc)
            summary = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if cause is None or cause in summary:
                raise
            raise SourceReadError(f"{self.channel.table}: reading watermarks {sub} from the source failed: "
                                  f"{summary}; caused by {cause}") from exc
        if self.verify is not None:
            self.verify()
        return table

    def iter_batches(self, chunk_rows: int, prefetch: int = 2) -> Iterator[MessageBatch]:
        """Stream the slice in watermark order, one Arrow batch of one sub-range at a time (flat memory).

        Up to `prefetch` later sub-ranges are fetched while the current one is produced, so Spark's task slots
        and the producer work at the same time; at most `prefetch + 1` sub-ranges are in memory.
        """
        ahead = ReadAhead([self], chunk_rows, prefetch)
        try:
            yield from ahead.batches(self)
        finally:
            ahead.close()

    def chunks(self, chunk_rows: int) -> list[tuple[SliceRange, int]]:
        """The slice's sub-ranges with the rows each is expected to hold."""
        if self.read_chunk is None:
            raise RuntimeError(f"{self.channel.table}: slice {self.slice} was read as committed but is not")
        subs = self.sub_ranges(chunk_rows)
        per_chunk = ceil(self.expected_rows / len(subs))
        return [(sub, per_chunk) for sub in subs]


def to_message_batches(frame: SliceFrame, table: pa.Table, after: int) -> tuple[list[MessageBatch], int]:
    """An Arrow chunk as produce-ready batches (one per Arrow record batch, no copy), after checking its rows
    follow watermark `after` in order."""
    import pyarrow.compute as pc

    wms = table.column("watermark")
    # Vectorised order check: Spark sorted each partition; partitions must come back in order.
    if pc.min(wms).as_py() < after or (table.num_rows > 1 and not pc.all(pc.greater_equal(
            wms.slice(1), wms.slice(0, table.num_rows - 1))).as_py()):
        raise RuntimeError(f"{frame.channel.table}: rows of slice {frame.slice} out of watermark order")
    batches = [MessageBatch.from_arrow(b) for b in table.select(["key", "value", "watermark", "watermark_text"])
               .to_batches() if b.num_rows]
    return batches, pc.max(wms).as_py()


class ReadAhead:
    """Reads the chunks of consecutive slices ahead of the producer, across slice boundaries.

    A run's slices are read in order; fetching slice k+1's first chunks while slice k is flushed and committed
    keeps Spark busy through every commit (with 100k-row slices and 100k-row chunks nothing overlapped before).
    Reading ahead is only reading: a slice that fails leaves nothing behind but discarded chunks. At most
    `prefetch` chunks are in flight plus the one being produced.
    """

    def __init__(self, frames: Iterable[SliceFrame], chunk_rows: int, prefetch: int = 2) -> None:
        self._tasks: Iterator[tuple[SliceFrame, SliceRange, int, bool]] = (
            (frame, sub, rows, i == len(chunks) - 1)
            for frame in frames for chunks in [frame.chunks(chunk_rows)] for i, (sub, rows) in enumerate(chunks))
        self._depth = max(1, prefetch)
        self._pool = ThreadPoolExecutor(max_workers=self._depth, thread_name_prefix="rowrelay-fetch")
        self._ahead: deque[tuple[SliceFrame, bool, Future[pa.Table]]] = deque()
        self._next: tuple[SliceFrame, SliceRange, int, bool] | None = None
        self._early: dict[tuple[str, SliceRange, int], Future[pa.Table]] | None = None
        self.convert_s = 0.0  # the order check and the split into batches, for the run's per-phase timings
        self.early_chunks: dict[str, int] = {}  # per slice key: chunks taken from an EarlyRead

    def _peek(self) -> tuple[SliceFrame, SliceRange, int, bool] | None:
        if self._next is None:
            self._next = next(self._tasks, None)
        return self._next

    def _fill(self) -> None:
        while len(self._ahead) < self._depth and self._peek() is not None:
            frame, sub, rows, last = self._next  # type: ignore[misc]
            self._next = None
            if self._early is None:  # the first frame: take the chunks an early read fetched for it, if any
                self._early = EARLY_READS.claim(frame)
            early = self._early.pop((frame.signature, sub, rows), None)
            if early is not None:
                self.early_chunks[frame.slice.key] = self.early_chunks.get(frame.slice.key, 0) + 1
            future = (self._pool.submit(_early_or_fetch, early, frame, sub, rows) if early is not None
                      else self._pool.submit(frame.fetch, sub, rows))
            self._ahead.append((frame, last, future))

    def batches(self, frame: SliceFrame) -> Iterator[MessageBatch]:
        """`frame`'s batches in watermark order; frames must be asked for in the order they were given."""
        after, done = frame.slice.lo, False
        try:
            while not done:
                self._fill()
                if not self._ahead or self._ahead[0][0] is not frame:
                    raise RuntimeError(f"{frame.channel.table}: read-ahead is not at slice {frame.slice}")
                _, done, future = self._ahead.popleft()
                table = future.result()
                self._fill()  # keep the fetch threads busy while this chunk is produced
                if table.num_rows == 0:
                    continue
                started = time.monotonic()
                batches, after = to_message_batches(frame, table, after)
                self.convert_s += time.monotonic() - started
                del table
                yield from batches
        finally:
            if not done:
                self._skip(frame)

    def frame_at_head(self) -> SliceFrame | None:
        """The slice whose chunks come next (None: no slice left)."""
        self._fill()
        return self._ahead[0][0] if self._ahead else None

    def skip(self, frame: SliceFrame) -> None:
        """Move past a slice that will not be read (already committed)."""
        self._skip(frame)

    def _skip(self, frame: SliceFrame) -> None:
        """Drop what is left of `frame` (it failed or stopped early): later slices keep their chunks."""
        while self._ahead and self._ahead[0][0] is frame:
            self._ahead.popleft()[2].cancel()
        while (task := self._peek()) is not None and task[0] is frame:
            self._next = None

    def close(self) -> None:
        for _, _, future in self._ahead:
            future.cancel()
        self._ahead.clear()
        for future in (self._early or {}).values():
            future.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)


def _early_or_fetch(early: Future[pa.Table], frame: SliceFrame, sub: SliceRange, rows: int) -> pa.Table:
    """An early read's chunk; if that read failed, the chunk is read again now (the run's own read decides)."""
    try:
        return early.result()
    except Exception:
        return frame.fetch(sub, rows)


class EarlyRead:
    """The first chunks a run is about to publish, fetched before the run starts.

    `rowrelay backfill` knows the slices it will publish first while Dagster is still loading and creating the
    run; on two cores Spark would idle through that second. A run's read-ahead takes the chunks only if its first
    frame has the signature of the first frame read early (same source, table settings, reflected shape, Spark
    settings, slice and row count: the same rows in the same messages), and each chunk only for a frame of its own
    signature. Anything else is dropped. Reading is only reading: nothing here publishes or records progress, and
    the run's own checks (order, slice bounds, fencing) apply to these chunks as to any. In memory: at most the
    chunks of one read-ahead.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunks: dict[tuple[str, SliceRange, int], Future[pa.Table]] = {}
        self._first = ""  # the signature of the first frame read early
        self._pool: ThreadPoolExecutor | None = None

    def start(self, frames: Iterable[SliceFrame], chunk_rows: int, depth: int) -> int:
        """Fetch the first `depth` chunks of `frames` (consecutive slices, in order) in the background; returns how
        many were started. A frame is only asked for its chunks (its count queries) while chunks are wanted."""
        with self._lock:
            self._drop()
            self._pool = ThreadPoolExecutor(max_workers=max(1, depth - 1), thread_name_prefix="rowrelay-early")
            for frame in frames:
                if not frame.signature:
                    break
                self._first = self._first or frame.signature
                for sub, rows in frame.chunks(chunk_rows)[:depth - len(self._chunks)]:
                    self._chunks[(frame.signature, sub, rows)] = self._pool.submit(frame.fetch, sub, rows)
                if len(self._chunks) >= depth:
                    break
            return len(self._chunks)

    def claim(self, frame: SliceFrame) -> dict[tuple[str, SliceRange, int], Future[pa.Table]]:
        """The early chunks, if the first was read for `frame` (a run's first); the registry is emptied either way."""
        with self._lock:
            chunks, first, self._chunks, self._first = self._chunks, self._first, {}, ""
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)  # its queued chunks still run; the claimer waits on their futures
        if not frame.signature or first != frame.signature:
            for future in chunks.values():
                future.cancel()
            return {}
        return chunks

    def discard(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        for future in self._chunks.values():
            future.cancel()
        self._chunks, self._first = {}, ""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


EARLY_READS = EarlyRead()  # one per process: a CLI backfill and the in-process runs it executes


@dataclass
class TableSlices:
    """What a table asset hands to the Kafka IO manager: its run's slices in watermark order.

    `pending` are the slices not yet committed when the run started; `read` builds one's messages lazily.
    """

    channel: TableChannel
    slices: list[SliceRange]
    pending: list[SliceRange]
    read: Callable[[SliceRange], SliceFrame] | None
    # Seconds per step of the run before publishing (launch -> worker, progress read, table check, Spark session):
    # reported with each slice's metadata, so a user sees where a run's time went.
    timings: dict[str, float] = field(default_factory=dict)
    # The columns of the last committed slice when the run started ([] none recorded): each slice's own columns
    # (its SliceFrame's, which may change during the run) are described against the slice before it.
    committed_columns: list[list[str]] = field(default_factory=list)
    where: str = ""  # the table's `where:` ("" none), recorded with each slice's progress
    watermark: tuple[str, str] | None = None  # the watermark column and its kind, as reflected by the run
    # With Kafka's progress empty: the highest slice Dagster recorded as committed (`last_recorded_slice`), which
    # the publisher refuses to send again (a progress topic deleted after the data topic's messages expired).
    recorded: SliceRange | None = None
    # The skip advice for a row that stopped the run (`BadRowError.naming`): by the row itself where others share
    # its watermark. None: the message's own advice.
    name_row: Callable[[BadRowError], str] | None = None
