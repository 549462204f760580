"""Rows -> Kafka messages, computed inside Spark (JVM): key, value, watermark and its text per row (read in chunks
by resources/slice_reads.py; rows that cannot be sent as stored are caught by resources/row_checks.py).

Value: a JSON object of the selected columns, exact for common types: integers as numbers, decimals as
strings with their scale, floats as numbers, timestamps ISO-8601 (with offset when the column has a time
zone), dates, binary as base64, JSON columns embedded, NULL as null.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from resources.row_checks import is_json_field, json_checked, utf8_checked

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame
    from pyspark.sql.types import StructField

    from resources.source_database import TableShape

KeyPolicy = list[str] | str  # column names | "hash_row" | "none"
JSON_OPTIONS = {"ignoreNullFields": "false"}

TS_FORMAT = "yyyy-MM-dd'T'HH:mm:ss.SSSSSS"


def column_to_json_expr(field: StructField) -> Column:
    """A Spark expression whose to_json rendering is the exact JSON form of a (non-JSON) column's values.

    Verified against psycopg/pymysql reads (see tests/test_types.py): decimals keep their scale as
    strings, timestamps keep microseconds, an offset only where the column has a time zone.
    """
    from pyspark.sql import functions as F  # for start-up time: pyspark loads on first use
    from pyspark.sql import types as T  # for start-up time: pyspark loads on first use

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
    from pyspark.sql import functions as F  # for start-up time: pyspark loads on first use

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
            # without DOTALL: the match would fail and the group's columns vanish from the message.
            parts.append(F.regexp_extract(plain(group), r"(?s)^\{(.*)\}$", 1))
            group = []
        if f is not None:
            name = json.dumps(f.name)
            parts.append(F.concat(F.lit(f"{name}:"), F.coalesce(F.col(f"`{f.name}`").cast("string"), F.lit("null"))))
    return F.concat(F.lit("{"), F.concat_ws(",", *parts), F.lit("}"))


def message_columns(df: DataFrame, shape: TableShape, key: KeyPolicy, envelope: bool, table: str,
                    slice_key: str, schema: list[StructField] | None = None) -> DataFrame:
    """key, value, watermark and its text per row, in the input's order (pure Spark; no Python per row).

    `schema`: `df`'s fields if already known (asking Spark is a round trip and a JDBC schema query)."""
    from pyspark.sql import functions as F  # for start-up time: pyspark loads on first use

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
