"""SQLite's strategy: its catalog, the types it cannot send, and the values its columns hold that their declared types
cannot carry exactly (`first_misfit`). One writer at a time: the dialect-neutral observe and finality serve it."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from resources.slices import RowSkip
from resources.source_database.dialect import TEXT_REMEDY, Dialect
from resources.source_database.shape import TableShape, skip_sql

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


class SQLite(Dialect):
    text_remedy = TEXT_REMEDY

    def declared_type_query(self, rel: str, schema: str | None, table: str, column: str
                            ) -> tuple[str, dict[str, Any]] | None:
        return ("SELECT type FROM pragma_table_info(:table, :schema) WHERE name = :column",
                {"schema": schema or "main", "table": table, "column": column})

    def cannot_read(self, col_type: Any) -> bool:
        """SQLite has no JSON type and does not check the text, so it could not be spliced into the message as
        JSON."""
        return isinstance(col_type, sa.JSON)


def first_misfit(engine: Engine, shape: TableShape, after: int, upto: int, skip: Sequence[RowSkip] | None = None
                 ) -> tuple[int, str, str, str] | None:
    """The first row in (after, upto] that the table's `where:` admits, not named by `skip`,
    holding a value its column's declared type cannot carry exactly, as (watermark, column, storage class, the
    value as an SQL literal); None if every value fits.

    SQLite keeps any value in any column, and its JDBC driver converts what does not fit the declared type
    silently: 1.5 in an INTEGER column arrived as 1, 'abc' as 0, 123.456 in a DECIMAL(10,2) as 123.46, 'yes' in
    a BOOLEAN as false, a blob in a TEXT column as mangled text."""
    q = engine.dialect.identifier_preparer.quote
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
        conditions.append(skip_sql(engine.dialect, shape, skip))
    columns = ", ".join(f"{q(name)}, CASE WHEN typeof({q(name)}) = 'real' THEN "
                        f"{SQLITE_REAL_TEXT.format(c=q(name))} END AS {q(texts[name])}" for name, _ in rules)
    inner = f"SELECT {wm} AS __rowrelay_wm, {columns} FROM {table} WHERE {' AND '.join(conditions)}"
    # The driver's own statement (qmark parameters): a column name may hold what sa.text reads as a parameter.
    # Not kept with the settled answers: the remedy is to fix a value in place.
    with engine.connect() as conn:
        row = conn.exec_driver_sql(
            f"SELECT __rowrelay_wm, {case(lambda i, c: str(i))}, {case(lambda i, c: f'typeof({c})')}, "
            f"{case(lambda i, c: f'substr(quote({c}), 1, 60)')} FROM ({inner}) "
            f"WHERE {' OR '.join(f'({sql})' for _, sql in rules)} ORDER BY __rowrelay_wm LIMIT 1",
            (after, upto)).first()
    return None if row is None else (int(row[0]), rules[int(row[1])][0], str(row[2]), str(row[3]))
