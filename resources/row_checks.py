"""Rows that cannot be sent as stored, caught inside Spark: text that is not valid UTF-8 (or not the column's
charset) and JSON columns whose text is not JSON. Each stops the read naming the row and the column, and the error
Spark raises is turned back into a BadRowError here."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from resources.exactly_once import BadRowError, skip_advice
from resources.slices import watermark_text

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame
    from pyspark.sql.types import StructField

    from resources.source_database import TableShape

JSON_CLIENT_TYPES = {"json", "jsonb"}


def is_json_field(field: StructField, json_columns: set[str]) -> bool:
    return field.name in json_columns or (field.metadata or {}).get("jdbcClientType", "").lower() in JSON_CLIENT_TYPES


# How a row whose text is not valid UTF-8 stops the read (raise_error in Spark), for SliceFrame.fetch to name it.
BAD_UTF8 = "rowrelay-bad-utf8"
# A stopped row's mark: its watermark and, where the table has one, its tie_break as {"t": text} (JSON) to tell
# it from the rows sharing its watermark.
_ROW_MARK = r"(-?\d+)(?: tie (\{(?:[^\"}]|\"(?:[^\"\\]|\\.)*\")*\}))?"
_BAD_UTF8_AT = re.compile(BAD_UTF8 + r"\[" + _ROW_MARK + r"\] column (\"(?:[^\"\\]|\\.)*\")(?: charset ([a-z0-9_]+))?")


def row_mark(shape: TableShape) -> Column:
    """The text a read stopped at a row names it by (`_ROW_MARK`), computed per row in Spark."""
    from pyspark.sql import functions as F  # for start-up time: pyspark loads on first use

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
    from pyspark.sql import functions as F  # for start-up time: pyspark loads on first use
    from pyspark.sql.types import StringType, StructField  # for start-up time: pyspark loads on first use

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
    from pyspark.sql import functions as F  # for start-up time: pyspark loads on first use

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
    which takes 1., -, 1e, "\\x41" (and a session with check_constraint_checks=0 skips it: any text): unchecked, the
    message would not be JSON and its slice would commit. PostgreSQL parses json strictly on input: not checked (no
    cost). Only the JSON columns' values pay, per row; a table without one runs an unchanged plan."""
    from pyspark.sql import functions as F  # for start-up time: pyspark loads on first use

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
