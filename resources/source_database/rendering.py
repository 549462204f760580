"""How a slice's read selects its columns on each database: the columns the source renders as JSON text itself, the
columns Spark reads as the driver's text, and each database's rules for the select list (`ReadRules`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

# PostgreSQL renders a date or timestamp's JSON text itself (to_char): the same text Spark's date_format gives
# (tests/test_types.py), cheaper than the JDBC driver parsing each value and Spark formatting it again. Years 10000
# and later get ISO 8601's expanded form with its sign, as Spark gives them ("+12345-01-01"), also past Spark's range
# (year 294247), which PostgreSQL passes (294276 for timestamps, 5874897 for dates). +-infinity, which Spark cannot
# hold either, become the strings "infinity" / "-infinity", as NaN and Infinity do for floats. A BC `timestamp` is
# rendered here too, as an astronomical year like Spark's text of a BC timestamptz or date (44 BC: "-0043", 1 BC:
# "0000"): Spark's own text of it has no era. BC `timestamptz` and `date` values still reach Spark raw and are
# rendered there. {c}: the quoted column.
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


def _postgresql_reads_as_text(type_name: str) -> bool:
    """PostgreSQL: decimals beyond Spark's, any numeric (it may hold 'NaN') and real."""
    return exceeds_spark_decimal(type_name) or type_name == "REAL" or DECIMAL_TYPE.match(type_name) is not None


def _never(type_name: str) -> bool:
    return False


@dataclass(frozen=True)
class ReadRules:
    """One database's rules for a slice's select list."""

    # Whether Spark reads a column of this reflected type as the driver's text, to keep it exact (see
    # `custom_schema_for` in resources/spark.py). SQLite columns are read by their affinity instead.
    reads_as_text: Callable[[str], bool] = _never
    # MariaDB/MySQL: a select list naming every column, always: `SELECT *` leaves INVISIBLE columns out, which the
    # reflected columns include.
    names_every_column: bool = False
    # Sorts NULLs first, as Spark does (MariaDB does by default; PostgreSQL would put them last).
    nulls_first: str = ""


READ_RULES: dict[str, ReadRules] = {
    "postgresql": ReadRules(reads_as_text=_postgresql_reads_as_text, nulls_first=" NULLS FIRST"),
    "mysql": ReadRules(reads_as_text=exceeds_spark_decimal, names_every_column=True),
}


def read_rules(dialect: str) -> ReadRules:
    return READ_RULES.get(dialect, ReadRules())


def read_as_text(dialect: str, type_name: str) -> bool:
    """Whether Spark reads a column of this reflected type as the driver's text, to keep it exact (`ReadRules`).
    Such a column's read sorts as text (10 before 9): as `tie_break`, the source numbers the rows in its order
    (`TableShape.tie_order`)."""
    return read_rules(dialect).reads_as_text(type_name)


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
