"""resources/source_database/shape.py: a table's select list and its schema changes."""

from __future__ import annotations


def test_postgres_renders_dates_and_timestamps_except_watermark_and_tie_break_raw() -> None:
    from resources.source_database import ColumnInfo, TableShape

    def col(name: str, source_text: str = "") -> ColumnInfo:
        return ColumnInfo(name=name, type_name="X", nullable=True, is_json=False, is_integer=False,
                          source_text=source_text)

    shape = TableShape(dialect="postgresql", schema="public", name="t", watermark="at", watermark_kind="timestamp",
                       tie_break="seen", columns=(col("id"), col("at", "timestamp"), col("seen", "timestamptz"),
                                                  col("day", "date")))
    ts = "'YYYY-MM-DD\"T\"HH24:MI:SS.US'"
    expected = [
        '"id"', '"at"', '"seen"',  # the watermark and the tie_break: whole (the read filters and sorts on them)
        """CASE WHEN NOT (isfinite("day") AND "day" >= DATE '0001-01-01') AND isfinite("day") """
        """THEN "day" END AS "day\"""",
        # every finite timestamp rendered: a year from 10000 with its sign (past Spark's range too), a BC one as an
        # astronomical year (44 BC: -0043), as Spark gives a BC timestamptz
        f"""CASE WHEN isfinite("at") THEN CASE WHEN "at" >= TIMESTAMP '10000-01-01' THEN '+' || to_char("at", """
        f"""{ts}) WHEN "at" >= TIMESTAMP '0001-01-01' THEN to_char("at", {ts}) WHEN EXTRACT(YEAR FROM "at") = -1 """
        """THEN to_char("at", '"0000"-MM-DD"T"HH24:MI:SS.US') ELSE '-' || lpad(CAST(-1 - CAST(EXTRACT(YEAR FROM """
        """"at") AS int) AS text), 4, '0') || to_char("at", '-MM-DD"T"HH24:MI:SS.US') END """
        """WHEN NOT isfinite("at") THEN "at"::text END AS "__rowrelay_text_1\"""",
        """CASE WHEN isfinite("seen") AND "seen" >= TIMESTAMPTZ '0001-01-01 00:00:00+00' """
        """THEN CASE WHEN "seen" >= TIMESTAMPTZ '10000-01-01 00:00:00+00' THEN '+' ELSE '' END """
        f"""|| to_char("seen" AT TIME ZONE 'UTC', {ts}) || '+00:00' """
        """WHEN NOT isfinite("seen") THEN "seen"::text END AS "__rowrelay_text_2\"""",
        """CASE WHEN isfinite("day") AND "day" >= DATE '0001-01-01' THEN CASE WHEN "day" >= DATE '10000-01-01' """
        """THEN '+' || CAST("day" AS text) ELSE to_char("day", 'YYYY-MM-DD') END """
        """WHEN NOT isfinite("day") THEN "day"::text END AS "__rowrelay_text_3\"""",
    ]
    assert shape.rendered_select(lambda n: f'"{n}"') == ", ".join(expected)
    assert shape.source_texts == {"at": "__rowrelay_text_1", "seen": "__rowrelay_text_2", "day": "__rowrelay_text_3"}
    plain = TableShape(dialect="postgresql", schema=None, name="t", watermark="id", columns=(col("id"), col("v")))
    assert plain.rendered_select(lambda n: n) is None and plain.source_texts == {}


def test_a_change_of_column_order_is_a_schema_change() -> None:
    """Reordered columns (`columns:` reordered, a MariaDB `ALTER ... AFTER`) change every message's field order
    and a hash_row key for the same data, but passed unnoticed, even with `on_schema_change: fail`."""
    from resources.source_database import schema_change

    before = [["id", "BIGINT"], ["a", "TEXT"], ["b", "TEXT"]]
    assert not schema_change(before, before)
    change = schema_change(before, [["b", "TEXT"], ["a", "TEXT"], ["id", "BIGINT"]])
    assert change and change.describe() == "reordered to b, a, id"
    # Added or dropped columns alone are not a reorder of the rest.
    assert schema_change(before, [["id", "BIGINT"], ["x", "INT"], ["b", "TEXT"]]).describe() == "added x; dropped a"
    assert schema_change(before, [["id", "BIGINT"], ["b", "TEXT"], ["a", "TEXT"], ["c", "INT"]]).describe() == (
        "added c; reordered to id, b, a")
