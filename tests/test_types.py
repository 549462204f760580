"""Each common type round-trips exactly, PostgreSQL and MariaDB: source row -> Kafka JSON -> same value."""

from __future__ import annotations

import base64
import contextlib
import json
from datetime import UTC, date, datetime
from decimal import Decimal

import pytest
from sqlalchemy import text

from tests.pipeline import Harness, assert_exactly_once, read_topic, relay_config

pytestmark = pytest.mark.integration

PG_DDL = """CREATE TABLE {t} (
  id bigserial PRIMARY KEY, c_small smallint, c_int integer, c_big bigint,
  c_num numeric(12,2), c_hp numeric(38,10), c_numu numeric, c_f4 real, c_f8 double precision, c_bool boolean,
  c_text text, c_vc varchar(50), c_ts timestamp, c_tstz timestamptz, c_date date, c_bytea bytea,
  c_json json, c_jsonb jsonb, c_uuid uuid)"""

PG_ROWS = [
    "(-32768, 2147483647, 9223372036854775807, 12.30, 1234567890123456789012345678.0123456789, 1.50, 0.1, 0.1,"
    " true, E'h\\u00e9llo \"quoted\" \\\\ back \\n \\u2028\\u2029\\u0085', 'Z\\u00fcrich',"
    " '2024-01-02 03:04:05.123456', '2024-01-02 03:04:05.123456+02', '2024-01-02', '\\x00ff10616263',"
    " '{\"b\": 1.10, \"a\": [1, 2.50]}',"
    " '{\"a\": 12345678901234567890123, \"n\": null}', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11')",
    "(0, 0, 0, 'NaN', -0.0000000001, 0, 3.4e38, 1e23, false, '', '', '0001-01-01 00:00:00',"
    " '9999-12-31 23:59:59.999999+00', '9999-12-31', '\\x', '[]', '{}', '00000000-0000-0000-0000-000000000000')",
    "(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)",
]
PG_COLS = ("c_small, c_int, c_big, c_num, c_hp, c_numu, c_f4, c_f8, c_bool, c_text, c_vc, c_ts, c_tstz, c_date, "
           "c_bytea, c_json, c_jsonb, c_uuid")


def _expected(value: object) -> object:
    """The JSON form rowrelay promises for a value as the Python driver returns it."""
    if isinstance(value, Decimal):
        return format(value, "f")  # plain notation, scale kept
    if isinstance(value, datetime):
        if value.tzinfo is not None:
            return value.astimezone(UTC).replace(tzinfo=None).isoformat(timespec="microseconds") + "+00:00"
        return value.isoformat(timespec="microseconds")
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, bytes | memoryview):
        return base64.b64encode(bytes(value)).decode()
    if hasattr(value, "hex") and type(value).__name__ == "UUID":
        return str(value)
    return value


def _run_table(services, url, dagster_instance, table: str, rows: int, spark_remote: bool = False) -> list[dict]:
    cfg = relay_config(services, {"src": url}, [{"source": "src", "table": table, "watermark": "id",
                                                 "settle_seconds": 0.5}], spark_remote=spark_remote)
    h = Harness(cfg, dagster_instance)
    h.drain(h.table(), until_hi=rows)
    return [m.value for m in read_topic(services.kafka_bootstrap, h.table().topic_name)]


# Spark Connect runs go through a `dagster asset materialize` process, as the daemon's workers would.
@pytest.mark.parametrize("spark_remote", [False, True], ids=["local-spark", "spark-connect"])
def test_postgres_types_round_trip(services, pg_database, pg_engine, dagster_instance, spark, name,
                                   spark_remote: bool) -> None:
    with pg_engine.begin() as conn:
        conn.execute(text(PG_DDL.format(t=name)))
        for row in PG_ROWS:
            conn.execute(text(f"INSERT INTO {name} ({PG_COLS}) VALUES {row}".replace(":", "\\:")))
    with pg_engine.connect() as conn:
        conn.execute(text("SET TIME ZONE 'UTC'"))
        rows = conn.execute(text(f"SELECT id, c_json::text, c_jsonb::text FROM {name}"))
        raw_json = {r[0]: (r[1], r[2]) for r in rows}
        expected_rows = [dict(r._mapping) for r in conn.execute(text(f"SELECT * FROM {name} ORDER BY id"))]
    got = _run_table(services, pg_database, dagster_instance, f"public.{name}", 3, spark_remote)
    assert [g["id"] for g in got] == [1, 2, 3]
    for exp, value in zip(expected_rows, got, strict=True):
        assert list(value) == list(exp), "fields in column order"
        for col, v in exp.items():
            if col in ("c_json", "c_jsonb"):
                continue
            want = _expected(v)
            if col == "c_numu" and v is not None:
                want = format(v, "f")
            assert value[col] == want, f"{col}: {value[col]!r} != {want!r}"
        # JSON columns are embedded, not strings, exactly as the database renders them.
        json_text, jsonb_text = raw_json[exp["id"]]
        for col, source_text in (("c_json", json_text), ("c_jsonb", jsonb_text)):
            if source_text is None:
                assert value[col] is None
            else:
                assert value[col] == json.loads(source_text)
    first = got[0]
    assert first["c_num"] == "12.30" and first["c_hp"] == "1234567890123456789012345678.0123456789"
    assert first["c_tstz"] == "2024-01-02T01:04:05.123456+00:00"
    assert first["c_ts"] == "2024-01-02T03:04:05.123456"
    assert first["c_bytea"] == "AP8QYWJj"
    assert first["c_json"] == {"b": 1.1, "a": [1, 2.5]}
    assert first["c_f4"] == pytest.approx(0.1, rel=1e-7) and first["c_f8"] == 0.1
    assert got[2]["c_text"] is None and "c_text" in got[2]
    # U+2028, U+2029 and U+0085 in a table with a JSON column: to_json leaves them unescaped, and the columns
    # before the JSON column vanished from the message (an invalid JSON text, committed).
    assert first["c_text"].endswith(" \u2028\u2029\u0085") and first["id"] == 1
    # NaN in a numeric(12,2): the driver could not make a BigDecimal of it and every read of the slice failed.
    assert got[1]["c_num"] == "NaN" and got[1]["c_hp"] == "-0.0000000001"


def test_postgres_dates_and_timestamps_rendered_by_the_source_at_the_edges(services, pg_database, pg_engine,
                                                                          dagster_instance, spark, name) -> None:
    """PostgreSQL renders dates and timestamps (to_char, TableShape.rendered_select) as Spark renders them, a year
    10000 or later (also one reached only in UTC) with its sign, up to PostgreSQL's last values, beyond Spark's
    range (the read failed there); NULL stays null: no value is lost or changed at the edges."""
    from resources.slices import SliceRange
    from resources.source_database import SourceDatabaseResource
    from resources.spark import SparkResource
    from tests.pipeline import source_url

    rows = [("0001-01-01 00:00:00", "0001-01-01 00:00:00+00", "0001-01-01"),
            ("0099-03-04 05:06:07.5", "0099-03-04 05:06:07.5+00", "0099-03-04"),
            ("1582-10-04 23:59:59.999999", "1582-10-04 23:59:59.999999+00", "1582-10-04"),
            ("1883-11-18 12:00:00", "1883-11-18 12:00:00+05:30", "1883-11-18"),
            ("9999-12-31 23:59:59.999999", "9999-12-31 22:59:59.999999-01", "9999-12-31"),
            (None, None, None),
            ("12345-01-01 01:02:03.5", "12345-01-01 01:02:03.5+00", "12345-01-01"),
            ("9999-12-31 23:00:00", "9999-12-31 23:59:59.999999-01", "9999-12-31"),
            # Days the Julian calendar lacks: JDBC's java.sql types shifted them by ten days before.
            ("1582-10-10 12:00:00", "1582-10-10 12:00:00+00", "1582-10-14"),
            ("-infinity", "infinity", "infinity"),
            (None, "0044-03-15 12:00:00+00 BC", "0044-03-15 BC"),
            # PostgreSQL's last values, past Spark's range (year 294247): the read failed, "long overflow".
            ("294276-12-31 23:59:59.999999", "294276-12-31 23:59:59.999999+00", "5874897-12-31")]
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, c_ts timestamp, c_tstz timestamptz, "
                          "c_date date)"))
        for row in rows:
            conn.execute(text(f"INSERT INTO {name} (c_ts, c_tstz, c_date) VALUES (:a, :b, :c)"),
                         dict(zip("abc", row, strict=True)))
    with pg_engine.connect() as conn:  # Python's datetime has years 1-9999 only, and no infinity
        conn.execute(text("SET TIME ZONE 'UTC'"))
        readable = conn.execute(text(f"SELECT * FROM {name} WHERE id NOT IN (7, 8, 10, 11, 12)"))
        expected = {r.id: dict(r._mapping) for r in readable}
    source = SourceDatabaseResource(url=source_url(pg_database))
    try:
        shape = source.table_shape("public", name, "id")
        reader = SparkResource(master="local[2]", jars=services.jdbc_jars)
        frame = reader.read_slice(source, shape, SliceRange(0, 12), 12)
        assert {"__rowrelay_text_1", "__rowrelay_text_2", "__rowrelay_text_3"} <= set(frame.columns)
    finally:
        source.dispose()
    got = _run_table(services, pg_database, dagster_instance, f"public.{name}", 12)
    assert [value["id"] for value in got] == list(range(1, 13))
    for value in got:
        if value["id"] in expected:
            assert value == {col: _expected(v) for col, v in expected[value["id"]].items()}
    assert got[8] == {"id": 9, "c_ts": "1582-10-10T12:00:00.000000", "c_tstz": "1582-10-10T12:00:00.000000+00:00",
                      "c_date": "1582-10-14"}
    # Spark holds no infinity (its read failed, "long overflow"): PostgreSQL's own text, as for NaN and Infinity.
    assert got[9] == {"id": 10, "c_ts": "-infinity", "c_tstz": "infinity", "c_date": "infinity"}
    # BC, as Spark renders it: astronomical years (44 BC is -0043).
    assert got[10] == {"id": 11, "c_ts": None, "c_tstz": "-0043-03-15T12:00:00.000000+00:00", "c_date": "-0043-03-15"}
    assert got[1]["c_ts"] == "0099-03-04T05:06:07.500000" and got[3]["c_tstz"] == "1883-11-18T06:30:00.000000+00:00"
    assert got[4]["c_tstz"] == "9999-12-31T23:59:59.999999+00:00"
    assert got[5] == {"id": 6, "c_ts": None, "c_tstz": None, "c_date": None}
    # Beyond year 9999, as Spark renders it (ISO 8601's expanded years, with their sign).
    assert got[6] == {"id": 7, "c_ts": "+12345-01-01T01:02:03.500000", "c_tstz": "+12345-01-01T01:02:03.500000+00:00",
                      "c_date": "+12345-01-01"}
    assert got[7] == {"id": 8, "c_ts": "9999-12-31T23:00:00.000000", "c_tstz": "+10000-01-01T00:59:59.999999+00:00",
                      "c_date": "9999-12-31"}
    assert got[11] == {"id": 12, "c_ts": "+294276-12-31T23:59:59.999999",
                       "c_tstz": "+294276-12-31T23:59:59.999999+00:00", "c_date": "+5874897-12-31"}


def test_postgres_json_text_is_spliced_verbatim(services, pg_database, pg_engine, dagster_instance, spark, name):
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, doc json)"))
        conn.execute(text(f"""INSERT INTO {name} (doc) VALUES ('{{"b": 1.10, "a": 12345678901234567890123456}}')"""))
    cfg = relay_config(services, {"src": pg_database},
                       [{"source": "src", "table": f"public.{name}", "watermark": "id"}])
    h = Harness(cfg, dagster_instance)
    h.drain(h.table(), until_hi=1)
    msgs = read_topic(services.kafka_bootstrap, h.table().topic_name)
    # Key order and decimal scale are the source's own (VARIANT would give {"a":...,"b":1.1}).
    raw = json.loads(json.dumps(msgs[0].value))
    assert list(raw["doc"]) == ["b", "a"]
    assert raw["doc"]["a"] == 12345678901234567890123456


MARIA_DDL = """CREATE TABLE {t} (
  id bigint AUTO_INCREMENT PRIMARY KEY, c_tiny tinyint, c_tiny1 tinyint(1), c_small smallint, c_int int,
  c_big bigint, c_num decimal(12,2), c_hp decimal(38,10), c_d double, c_text text, c_vc varchar(50),
  c_dt datetime(6), c_ts timestamp(6) NULL, c_date date, c_blob blob, c_vb varbinary(10), c_json json,
  c_enum enum('a','bcd'), c_set set('a','b','c'), c_char char(5))"""


def test_mariadb_types_round_trip(services, mariadb_database, mariadb_engine, dagster_instance, spark, name) -> None:
    with mariadb_engine.begin() as conn:
        conn.execute(text("SET time_zone = '+00:00'"))
        conn.execute(text(MARIA_DDL.format(t=name)))
        conn.execute(text(
            f"INSERT INTO {name} (c_tiny, c_tiny1, c_small, c_int, c_big, c_num, c_hp, c_d, c_text, c_vc, c_dt, c_ts,"
            " c_date, c_blob, c_vb, c_json, c_enum, c_set, c_char) VALUES (-128, 5, -32768, 2147483647,"
            " 9223372036854775807, 12.30, 1234567890123456789012345678.0123456789, 0.1,"
            " 'h\u00e9llo \"q\" \\\\ \\n \u2028\u2029\u0085', 'Z\u00fcrich',"
            " '1000-01-01 00:00:00.000001', '2024-01-02 03:04:05.123456', '2024-01-02', x'00ff10616263', x'00ff',"
            " '{\"b\": 1.10, \"a\": [1, 2.50]}', 'a', 'a,c', ' ab ')"))
        conn.execute(text(f"INSERT INTO {name} (c_tiny) VALUES (NULL)"))
    with mariadb_engine.connect() as conn:
        conn.execute(text("SET time_zone = '+00:00'"))
        expected_rows = [dict(r._mapping) for r in conn.execute(text(f"SELECT * FROM {name} ORDER BY id"))]
    got = _run_table(services, mariadb_database, dagster_instance, name, 2)
    assert [g["id"] for g in got] == [1, 2]
    for exp, value in zip(expected_rows, got, strict=True):
        assert list(value) == list(exp)
        for col, v in exp.items():
            if col == "c_json":
                assert value[col] == (json.loads(v) if v is not None else None)
            elif col == "c_ts" and v is not None:
                assert value[col] == v.strftime("%Y-%m-%dT%H:%M:%S.%f+00:00")
            else:
                assert value[col] == _expected(v), f"{col}: {value[col]!r} != {_expected(v)!r}"
    assert got[0]["c_tiny1"] == 5 and got[0]["c_num"] == "12.30"
    assert got[0]["c_dt"] == "1000-01-01T00:00:00.000001"
    assert got[0]["c_blob"] == "AP8QYWJj"
    # Spark padded CHAR(n) as it read (ENUM and SET reach it as CHAR): "a  ", "a,c  ", " ab  ".
    assert (got[0]["c_enum"], got[0]["c_set"], got[0]["c_char"]) == ("a", "a,c", " ab")
    assert got[0]["c_text"].endswith("\u2028\u2029\u0085") and got[0]["id"] == 1


# Decimals beyond Spark's DecimalType (precision 38, 0 <= scale <= precision) must still arrive exactly.
PG_WIDE_DDL = """CREATE TABLE {t} (id bigserial PRIMARY KEY, c_n78 numeric(78,0), c_n60 numeric(60,30),
  c_frac numeric(5,7), c_negscale numeric(5,-2), c_num numeric(12,2))"""
PG_WIDE_ROWS = [
    "(123456789012345678901234567890123456789012345678901234567890123456789012345678,"
    " 123456789012345678901234567890.123456789012345678901234567891, 0.0012345, 1234567, 12.30)",
    f"(-{'9' * 78}, -0.000000000000000000000000000001, -0.0099999, -9999900, -0.01)",
    "(0, 0.5, 0, 0, 0)",
    "(NULL, NULL, NULL, NULL, NULL)",
]


def _assert_decimals_exact(expected_rows: list[dict], got: list[dict]) -> None:
    assert [g["id"] for g in got] == [e["id"] for e in expected_rows]
    for exp, value in zip(expected_rows, got, strict=True):
        assert list(value) == list(exp), "fields in column order"
        for col, v in exp.items():
            assert value[col] == _expected(v), f"row {exp['id']} {col}: {value[col]!r} != {_expected(v)!r}"


@pytest.mark.parametrize("spark_remote", [False, True], ids=["local-spark", "spark-connect"])
def test_postgres_wide_decimals_are_exact(services, pg_database, pg_engine, dagster_instance, spark, name,
                                          spark_remote: bool) -> None:
    with pg_engine.begin() as conn:
        conn.execute(text(PG_WIDE_DDL.format(t=name)))
        for row in PG_WIDE_ROWS:
            conn.execute(text(f"INSERT INTO {name} (c_n78, c_n60, c_frac, c_negscale, c_num) VALUES {row}"))
    with pg_engine.connect() as conn:
        expected_rows = [dict(r._mapping) for r in conn.execute(text(f"SELECT * FROM {name} ORDER BY id"))]
    got = _run_table(services, pg_database, dagster_instance, f"public.{name}", len(PG_WIDE_ROWS), spark_remote)
    _assert_decimals_exact(expected_rows, got)
    assert got[0]["c_n78"] == "123456789012345678901234567890123456789012345678901234567890123456789012345678"
    assert got[1]["c_n78"] == "-" + "9" * 78
    assert got[2]["c_n60"] == "0.500000000000000000000000000000"
    assert got[0]["c_negscale"] == "1234600"  # numeric(5,-2) rounds on insert; the stored value is sent


MARIA_WIDE_DDL = """CREATE TABLE {t} (id bigint AUTO_INCREMENT PRIMARY KEY, c_d65 decimal(65,30),
  c_d65u decimal(65,30) unsigned, c_d40 decimal(40,0), c_d20u decimal(20,0) unsigned, c_bu bigint unsigned,
  c_num decimal(12,2))"""
MARIA_WIDE_ROWS = [
    "(123456789012345678901234567890123.123456789012345678901234567891,"
    " 99999999999999999999999999999999999.999999999999999999999999999999,"
    " 1234567890123456789012345678901234567890, 99999999999999999999, 18446744073709551615, 12.30)",
    "(0.5, 0.5, -1234567890123456789012345678901234567890, 0, 0, -0.01)",
    "(-99999999999999999999999999999999999.999999999999999999999999999999, 0, 0, 1, 1, 0)",
    "(NULL, NULL, NULL, NULL, NULL, NULL)",
]


@pytest.mark.parametrize("spark_remote", [False, True], ids=["local-spark", "spark-connect"])
def test_mariadb_wide_decimals_are_exact(services, mariadb_database, mariadb_engine, dagster_instance, spark, name,
                                         spark_remote: bool) -> None:
    with mariadb_engine.begin() as conn:
        conn.execute(text(MARIA_WIDE_DDL.format(t=name)))
        for row in MARIA_WIDE_ROWS:
            conn.execute(text(f"INSERT INTO {name} (c_d65, c_d65u, c_d40, c_d20u, c_bu, c_num) VALUES {row}"))
    with mariadb_engine.connect() as conn:
        expected_rows = [dict(r._mapping) for r in conn.execute(text(f"SELECT * FROM {name} ORDER BY id"))]
    got = _run_table(services, mariadb_database, dagster_instance, name, len(MARIA_WIDE_ROWS), spark_remote)
    _assert_decimals_exact(expected_rows, got)
    assert got[0]["c_d65"] == "123456789012345678901234567890123.123456789012345678901234567891"
    assert got[1]["c_d65"] == "0.500000000000000000000000000000"
    assert got[0]["c_bu"] == 18446744073709551615  # BIGINT UNSIGNED stays a JSON number
    assert got[0]["c_d20u"] == "99999999999999999999"  # a DECIMAL, even unsigned with scale 0, is a string


def test_mariadb_invisible_column_is_sent_like_the_others(services, mariadb_database, mariadb_engine,
                                                          dagster_instance, spark, name) -> None:
    """An INVISIBLE column is in the table's reflected columns, but `SELECT *` leaves it out: a table whose read
    needed no select list of its own (no date, time, float or UTF-8 text column) failed every run with Spark's
    "cannot be resolved", while one with such a column sent it. Its value is sent, always."""
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id BIGINT AUTO_INCREMENT PRIMARY KEY, a INT, b INT INVISIBLE, "
                          "g INT AS (a + 1) VIRTUAL)"))
        conn.execute(text(f"INSERT INTO {name} (a, b) VALUES (1, 2), (3, NULL)"))
    got = _run_table(services, mariadb_database, dagster_instance, name, 2)
    assert got == [{"id": 1, "a": 1, "b": 2, "g": 2}, {"id": 2, "a": 3, "b": None, "g": 4}]


@pytest.mark.parametrize("spark_remote", [False, True], ids=["local-spark", "spark-connect"])
def test_mariadb_dates_arrive_as_stored(services, mariadb_database, mariadb_engine, dagster_instance, spark, name,
                                        spark_remote: bool) -> None:
    """Through the JDBC driver and Spark a date before 1582-10-15 moved ten days (Julian -> Gregorian), a
    zero-in-date value ('2024-05-00') became the day before and a zero date null, all silently; MariaDB's default
    sql_mode accepts each of them. MariaDB renders DATE and DATETIME text itself now, and names a zero TIMESTAMP."""
    with mariadb_engine.begin() as conn:
        conn.execute(text("SET SESSION sql_mode = '', time_zone = '+00:00'"))
        conn.execute(text(f"CREATE TABLE {name} (id bigint AUTO_INCREMENT PRIMARY KEY, d date, dt datetime(6), "
                          "dt0 datetime, ts timestamp NULL DEFAULT NULL)"))
        conn.execute(text(
            f"INSERT INTO {name} (d, dt, dt0, ts) VALUES "
            "('1582-10-10', '1582-10-10 12\\:00\\:00.000001', '1582-10-10 12\\:00\\:00', '2024-01-02 03\\:04\\:05'), "
            "('2024-05-00', '2024-05-00 10\\:00\\:00.5', '2024-05-00 10\\:00\\:00', 0), "
            "('0000-00-00', '0000-00-00 00\\:00\\:00', '0000-00-00 00\\:00\\:00', NULL)"))
    got = _run_table(services, mariadb_database, dagster_instance, name, 3, spark_remote)
    assert [(g["d"], g["dt"], g["dt0"], g["ts"]) for g in got] == [
        ("1582-10-10", "1582-10-10T12:00:00.000001", "1582-10-10T12:00:00.000000", "2024-01-02T03:04:05.000000+00:00"),
        ("2024-05-00", "2024-05-00T10:00:00.500000", "2024-05-00T10:00:00.000000", "0000-00-00T00:00:00.000000+00:00"),
        ("0000-00-00", "0000-00-00T00:00:00.000000", "0000-00-00T00:00:00.000000", None),
    ]


@pytest.mark.parametrize("spark_remote", [False, True], ids=["local-spark", "spark-connect"])
def test_mariadb_float_arrives_as_stored(services, mariadb_database, mariadb_engine, dagster_instance, spark, name,
                                         spark_remote: bool) -> None:
    """A MariaDB FLOAT reached the driver as the server's text of 6 significant digits: 123456789 (stored as
    123456792) arrived as 1.23457E8, 1.0000001 as 1.0, all silently. Each now arrives as the 32-bit float stored."""
    import numpy as np

    values = [("123456789", "1234567.891"), ("16777217", "0.001"), ("1.0000001", "9999999.999"),
              ("3.4e38", "-0.5"), ("1.4e-45", "1"), ("-2.5", "2.25"), ("0.1", "0.1"), ("NULL", "NULL")]
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint AUTO_INCREMENT PRIMARY KEY, f FLOAT, "
                          "f3 FLOAT(10,3), d DOUBLE)"))
        for v, v3 in values:
            conn.execute(text(f"INSERT INTO {name} (f, f3, d) VALUES ({v}, {v3}, {v})"))
    with mariadb_engine.connect() as conn:  # the stored 32-bit values, exactly, as doubles
        stored = [tuple(r) for r in conn.execute(text(f"SELECT f + 0e0, f3 + 0e0, d FROM {name} ORDER BY id"))]
    got = _run_table(services, mariadb_database, dagster_instance, name, len(values), spark_remote)
    for row, (f, f3, d) in zip(got, stored, strict=True):
        for column, want in (("f", f), ("f3", f3)):
            sent = row[column]
            assert (sent is None) == (want is None), (column, sent, want)
            if want is not None:
                assert isinstance(sent, float) and np.float32(sent) == np.float32(want), (column, sent, want)
        assert row["d"] == d  # a DOUBLE was exact already
    # As a 32-bit float's text (Java's Float.toString, as PostgreSQL's real arrives): 0.1 as 0.1, not the widened
    # double 0.10000000149011612 (a string column beside it in the read made Spark widen the float).
    assert (got[6]["f"], got[6]["f3"], got[2]["f"], got[1]["f3"], got[5]["f"]) == (0.1, 0.1, 1.0000001, 0.001, -2.5)


def _stored_as_bytes(engine, name: str, columns: str, insert: str) -> None:
    """A MariaDB table `name` (id AUTO_INCREMENT, `columns`) whose rows `insert` writes through a connection with
    the binary charset and no strict mode: the server stores the bytes as they come, as a client that sends bytes
    would have it."""
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint AUTO_INCREMENT PRIMARY KEY, {columns})"))
        conn.execute(text("SET SESSION sql_mode = ''"))
        conn.execute(text("SET NAMES binary"))
        conn.execute(text(f"INSERT INTO {name} {insert}"))


@pytest.mark.parametrize("spark_remote", [False, True], ids=["local-spark", "spark-connect"])
def test_mariadb_text_that_is_not_utf8_stops_its_slice(services, mariadb_database, mariadb_engine, dagster_instance,
                                                       spark, name, spark_remote: bool) -> None:
    """MariaDB accepts an encoded surrogate (ED A0 80) in a utf8 column; the JDBC driver replaced it with U+FFFD and
    the slice committed, silently. Now the slice stops as bad_row naming the row and the column, nothing sent;
    with the row in `skip_watermarks` the rest arrive exactly (emoji, latin1 text included)."""
    from resources.kafka_io_manager import STOPPED_TAG
    from tests.test_errors import failure_text

    _stored_as_bytes(mariadb_engine, name, "s VARCHAR(20) CHARACTER SET utf8mb4, m TEXT CHARACTER SET utf8mb3, "
                     "l VARCHAR(20) CHARACTER SET latin1",
                     "(s, m, l) VALUES (X'6F6BC3A9', X'C3A9', X'E9'), (X'61EDA080', X'6D', X'61'), "
                     "(X'F09F9880', NULL, X'80')")
    base = {"source": "src", "table": name, "watermark": "id", "settle_seconds": 0.5}
    h = Harness(relay_config(services, {"src": mariadb_database}, [base], spark_remote=spark_remote),
                dagster_instance)
    table = h.table()
    (key,) = h.cut(table)
    result = h.run(table, key, raise_on_error=False)
    assert not result.success
    said = result.output if spark_remote else failure_text(result)
    assert f"{table.table_id}: row 2 holds text that is not valid UTF-8 in column 's'" in said, said[-3000:]
    assert "skip_watermarks: [2]" in said, said[-3000:]
    if not spark_remote:
        assert dagster_instance.get_run_by_id(result.run_id).tags.get(STOPPED_TAG) == "bad_row"
    assert read_topic(services.kafka_bootstrap, table.topic_name, timeout=3.0) == []
    assert h.progress(table) is None
    skipping = Harness(relay_config(services, {"src": mariadb_database}, [{**base, "skip_watermarks": [2]}],
                                    spark_remote=spark_remote), dagster_instance)
    skipping.drain(skipping.table(), until_hi=3)
    got = [m.value for m in read_topic(services.kafka_bootstrap, table.topic_name)]
    assert got == [{"id": 1, "s": "ok\u00e9", "m": "\u00e9", "l": "\u00e9"},
                   {"id": 3, "s": "\U0001f600", "m": None, "l": "\u20ac"}]  # latin1 0x80 is the euro sign


def test_mariadb_text_its_charset_has_no_character_for_stops_its_slice(services, mariadb_database, mariadb_engine,
                                                                     dagster_instance, spark, name) -> None:
    """A connection with the binary charset stores any bytes in a text column: E9 in an ascii column, AE (no
    character in ISO 8859-7) in a greek one. The server sent each to the driver as '?' and the slice committed,
    silently. Now each stops its slice as bad_row naming the row, the column and its charset, nothing sent; with
    both rows skipped the rest arrive exactly (greek, sjis and ascii text, a '?' of the value's own, cp932's NEC
    character whose code does not convert back to itself, NULLs, latin1 untouched)."""
    _stored_as_bytes(mariadb_engine, name, "a VARCHAR(20) CHARACTER SET ascii, g CHAR(4) CHARACTER SET greek, "
                     "j TEXT CHARACTER SET sjis, k TEXT CHARACTER SET cp932, l VARCHAR(20) CHARACTER SET latin1",
                     "(a, g, j, k, l) VALUES ('ok?', X'E1E2', X'82A0', X'8790', X'E9'), "
                     "(X'61E9', X'E1', NULL, 'k', 'x'), ('fine', X'AE', 'x', 'k', 'y'), "
                     "(NULL, NULL, NULL, NULL, X'80')")
    base = {"source": "src", "table": name, "watermark": "id", "settle_seconds": 0.5}
    said, key = [], None
    for skip in ([], [2]):  # the same slice, run again with row 2 left out
        h = Harness(relay_config(services, {"src": mariadb_database}, [{**base, "skip_watermarks": skip}],
                                 spark_remote=True), dagster_instance)
        table = h.table()
        key = key or h.cut(table)[0]
        result = h.run(table, key, raise_on_error=False)
        assert not result.success
        said.append(result.output)
        assert read_topic(services.kafka_bootstrap, table.topic_name, timeout=3.0) == []
        assert h.progress(table) is None
    assert (f"{table.table_id}: row 2 holds bytes that are not ascii text in column 'a'" in said[0]
            and "skip_watermarks: [2]" in said[0]), said[0][-3000:]
    assert f"{table.table_id}: row 3 holds bytes that are not greek text in column 'g'" in said[1], said[1][-3000:]
    skipping = Harness(relay_config(services, {"src": mariadb_database}, [{**base, "skip_watermarks": [2, 3]}],
                                    spark_remote=True), dagster_instance)
    skipping.drain(skipping.table(), until_hi=4)
    got = [m.value for m in read_topic(services.kafka_bootstrap, table.topic_name)]
    assert got == [{"id": 1, "a": "ok?", "g": "\u03b1\u03b2", "j": "\u3042", "k": "\u2252", "l": "\u00e9"},
                   {"id": 4, "a": None, "g": None, "j": None, "k": None, "l": "\u20ac"}]


def test_mariadb_uuid_column_is_refused_at_the_table_check(mariadb_database, mariadb_engine, name) -> None:
    """MariaDB's UUID type (10.7+) passed the table check and failed every read in Spark ("Unrecognized SQL type");
    it is refused by name before anything is cut, with the remedy."""
    from resources.source_database import SourceDatabaseResource, SourceError

    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint AUTO_INCREMENT PRIMARY KEY, u uuid)"))
    source = SourceDatabaseResource(url=mariadb_database.render_as_string(hide_password=False))
    try:
        with pytest.raises(SourceError, match=r"column 'u' has type .*which rowrelay cannot read from mysql.*"
                                              r"CAST\(\.\.\. AS CHAR\)"):
            source.table_shape(None, name, "id")
    finally:
        source.dispose()


def test_a_type_sqlalchemy_does_not_know_is_refused_by_its_database_name(pg_database, pg_engine, mariadb_database,
                                                                         mariadb_engine, name, tmp_path) -> None:
    """A type SQLAlchemy's dialect does not know is reflected as NullType, and the refusal used to say "has type
    NULL"; it names the database's own type (PostgreSQL's xml and point, MariaDB's INET6), and a SQLite column
    declared without a type says so."""
    import sqlite3

    from resources.source_database import SourceDatabaseResource, SourceError

    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, doc xml, spot point, n int, ids int[])"))
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint AUTO_INCREMENT PRIMARY KEY, addr inet6)"))
    lite = tmp_path / "lite.db"
    with contextlib.closing(sqlite3.connect(lite)) as conn:
        conn.execute(f"CREATE TABLE {name} (id INTEGER PRIMARY KEY, anything)")
        conn.commit()
    cases = [(pg_database.render_as_string(hide_password=False), "public", "doc", r"has type 'xml', which"),
             (pg_database.render_as_string(hide_password=False), "public", "spot", r"has type 'point', which"),
             (pg_database.render_as_string(hide_password=False), "public", "ids", r"has type 'integer\[\]', which"),
             (mariadb_database.render_as_string(hide_password=False), None, "addr", r"has type 'inet6', which"),
             (f"sqlite:///{lite}", None, "anything", r"has no declared type, which")]
    for url, schema, column, says in cases:
        source = SourceDatabaseResource(url=url)
        try:
            with pytest.raises(SourceError, match=rf"column '{column}' {says} rowrelay cannot serialize exactly; "
                                                  r"leave it out with `columns:`"):
                source.table_shape(schema, name, "id", columns=[column])
            # a known column of the same table still passes
            if column == "doc":
                assert [c.name for c in source.table_shape(schema, name, "id", columns=["n"]).columns] == ["n", "id"]
        finally:
            source.dispose()


def test_a_key_column_the_table_no_longer_has_is_refused_at_the_table_check(pg_database, pg_engine, name) -> None:
    """A `key:` column dropped from the table (on_schema_change: follow) failed every run with a bare KeyError,
    retried forever; the table check names it and the remedy."""
    from assets.shape import table_shape
    from resources.config import TableConfig
    from resources.source_database import SourceDatabaseResource, SourceError

    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, b text, c text)"))
    table = TableConfig(source="src", table=f"public.{name}", watermark="id", key=["b"])
    source = SourceDatabaseResource(url=pg_database.render_as_string(hide_password=False))
    try:
        assert [c.name for c in table_shape(source, table).columns] == ["id", "b", "c"]
        with pg_engine.begin() as conn:
            conn.execute(text(f"ALTER TABLE {name} DROP COLUMN b"))
        with pytest.raises(SourceError, match=r"key columns \['b'\] do not exist \(columns: \['id', 'c'\]\); fix "
                                              "`key:` in rowrelay.yaml"):
            table_shape(source, table)
    finally:
        source.dispose()


def test_mariadb_tie_break_and_json_columns_arrive_as_stored_or_stop_their_slice(services, mariadb_database,
                                                                                 mariadb_engine, dagster_instance,
                                                                                 spark, name) -> None:
    """Three ways a MariaDB value changed silently, now exact or stopped: a FLOAT `tie_break` reached the driver as
    6 significant digits (123456792 as 1.23457E8: the tie_break skipped the FLOAT's exact read), a `tie_break`
    text column and a JSON column holding an encoded surrogate (ED A0 80) arrived with U+FFFD (both skipped the
    UTF-8 check). Rows sharing a time still go out in the FLOAT's order, JSON still spliced as JSON."""
    from tests.test_errors import failure_text

    at = "'2026-11-27 10:00:00.000001'"
    _stored_as_bytes(mariadb_engine, name, "at DATETIME(6) NOT NULL, f FLOAT, t VARCHAR(20) CHARACTER SET utf8mb4, "
                     "j JSON", f"(at, f, t, j) VALUES ({at}, 123456792, 'b', '{{\"a\": 1.50}}'), "
                     f"({at}, 1.0000001, X'61EDA080', '{{\"b\": [1, \"x\"]}}'), "
                     f"({at}, 16777216, 'c', X'7B2263223A202278EDA080227D')")  # {"c": "x<ED A0 80>"}
    by_float = relay_config(services, {"src": mariadb_database}, [
        {"source": "src", "table": name, "watermark": "at", "tie_break": "f", "settle_seconds": 0.5}])
    h = Harness(by_float, dagster_instance)
    table = h.table()
    (key,) = h.cut(table)
    # Rows in the FLOAT's order: row 2 (1.0000001) stops first, at its text, then row 3 (16777216) at its JSON.
    result = h.run(table, key, raise_on_error=False)
    assert not result.success and "UTF-8 in column 't'" in failure_text(result), failure_text(result)[-2000:]
    with mariadb_engine.begin() as conn:  # nothing was sent: the row may still be fixed
        conn.execute(text(f"UPDATE {name} SET t = 'a' WHERE id = 2"))
    result = h.run(table, key, raise_on_error=False)
    assert not result.success and "UTF-8 in column 'j'" in failure_text(result), failure_text(result)[-2000:]
    assert read_topic(services.kafka_bootstrap, table.topic_name, timeout=3.0) == [] and h.progress(table) is None
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"UPDATE {name} SET j = '{{\"c\": \"x\"}}' WHERE id = 3"))
    assert h.run(table, key).success
    got = read_topic(services.kafka_bootstrap, table.topic_name)
    assert [(m.value["f"], m.value["t"], m.value["j"]) for m in got] == [
        (1.0000001, "a", {"b": [1, "x"]}), (16777216.0, "c", {"c": "x"}), (123456792.0, "b", {"a": 1.5})]

    # A text tie_break: rows sharing a time go out by its code points, the check applies to it as to any column.
    other = f"{name}_t"
    _stored_as_bytes(mariadb_engine, other, "at DATETIME(6) NOT NULL, t VARCHAR(20) CHARACTER SET utf8mb4",
                     f"(at, t) VALUES ({at}, 'b'), ({at}, X'61EDA080'), ({at}, 'a')")
    h = Harness(relay_config(services, {"src": mariadb_database}, [
        {"source": "src", "table": other, "watermark": "at", "tie_break": "t", "settle_seconds": 0.5}]),
        dagster_instance)
    (key,) = h.cut(h.table())
    result = h.run(h.table(), key, raise_on_error=False)
    assert not result.success and "text that is not valid UTF-8 in column 't'" in failure_text(result)
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"UPDATE {other} SET t = 'ab' WHERE id = 2"))
    assert h.run(h.table(), key).success
    assert [m.value["t"] for m in read_topic(services.kafka_bootstrap, h.table().topic_name)] == ["a", "ab", "b"]


def test_mariadb_json_through_a_view_stays_json_and_is_checked(services, mariadb_database, mariadb_engine,
                                                               dagster_instance, spark, name) -> None:
    """A view's JSON column is LONGTEXT with no json_valid() check to tell it is JSON: read as checked bytes, it
    lost the driver's JSON mark and arrived as a JSON string ("{\"a\": 1.50}"), although the README suggests views.
    It is read as text (JSON spliced as JSON, text as text) with its bytes beside it, and those are checked."""
    from tests.test_errors import failure_text

    _stored_as_bytes(mariadb_engine, name, "j JSON, t LONGTEXT CHARACTER SET utf8mb4",
                     "(j, t) VALUES ('{\"a\": 1.50}', '{\"not\": \"json\"}'), ('[1, 2]', X'61EDA080')")
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE VIEW {name}_v AS SELECT id, j, t FROM {name}"))
    h = Harness(relay_config(services, {"src": mariadb_database}, [
        {"source": "src", "table": f"{name}_v", "watermark": "id", "settle_seconds": 0.5}]), dagster_instance)
    table = h.table()
    (key,) = h.cut(table)
    result = h.run(table, key, raise_on_error=False)
    assert not result.success and "row 2 holds text that is not valid UTF-8 in column 't'" in failure_text(result)
    assert read_topic(services.kafka_bootstrap, table.topic_name, timeout=3.0) == []
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"UPDATE {name} SET t = 'ok' WHERE id = 2"))
    assert h.run(table, key).success
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": services.kafka_bootstrap, "group.id": name,
                         "isolation.level": "read_committed", "enable.auto.commit": False})
    consumer.assign([TopicPartition(table.topic_name, 0, 0)])
    raw = [consumer.poll(10).value() for _ in range(2)]
    consumer.close()
    assert raw == [b'{"id":1,"j":{"a": 1.50},"t":"{\\"not\\": \\"json\\"}"}', b'{"id":2,"j":[1, 2],"t":"ok"}']


def test_postgres_watermark_and_tie_break_edges(services, pg_database, pg_engine, dagster_instance, spark,
                                                name) -> None:
    """A tie_break rowrelay reads as text (numeric beyond 38 digits, real) sorted 10 before 9: rows sharing a time
    now go out in the source's order of it. A timestamp watermark at 'infinity' made every cut fail with the
    driver's "timestamp too large", naming nothing: refused naming the column, and `where:` leaves such rows out
    ('-infinity' lies below any progress: not refused). A slice ending at the largest watermark (2^63 - 1) read in
    partitions overflowed Spark's bound; columns "Name" and name were one to Spark."""
    from resources.source_database import SourceDatabaseResource, SourceError

    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint PRIMARY KEY, at timestamptz NOT NULL, n numeric, r real, "
                          "\"Name\" text, name text)"))
        conn.execute(text(f"INSERT INTO {name} SELECT 9223372036854775807 - 60000 + g, now(), g, g, 'N' || g, "
                          "'n' || g FROM generate_series(1, 60000) g"))
        conn.execute(text(f"INSERT INTO {name} VALUES (1, 'infinity', 1, 1, 'x', 'y'), (2, '-infinity', 1, 1, 'x', "
                          "'y')"))
        for column in ("n", "r", "p"):  # a table each: one table id has one progress
            conn.execute(text(f"CREATE TABLE {name}_{column} (id bigserial PRIMARY KEY, at timestamptz NOT NULL, "
                              "n numeric, r real, p numeric(38, 2))"))
            conn.execute(text(f"INSERT INTO {name}_{column} (at, n, r, p) SELECT '2026-11-27 10:00+00', v, v, v FROM "
                              "unnest(ARRAY[100, 9, 1e30, 10, 9.5, NULL]) v"))
    source = SourceDatabaseResource(url=pg_database.render_as_string(hide_password=False))
    try:
        with pytest.raises(SourceError, match=r"watermark column 'at' holds times after the year 9999 \('infinity'"):
            source.table_shape("public", name, "at")
        source.table_shape("public", name, "at", where="at < 'infinity'")
    finally:
        source.dispose()
    for column in ("n", "r", "p"):  # NULL first, as Spark sorts the tie_breaks it reads itself
        h = Harness(relay_config(services, {"src": pg_database}, [
            {"source": "src", "table": f"public.{name}_{column}", "watermark": "at", "tie_break": column}]),
            dagster_instance)
        h.drain(h.table())
        sent = [m.value[column] for m in read_topic(services.kafka_bootstrap, h.table().topic_name)]
        assert [v if v is None else float(v) for v in sent] == [None, 9, 9.5, 10, 100, 1e30], sent
    # '-infinity' lies below any progress, but with `start_after` unset the check for rows below 1970 read it: the
    # driver's bare "timestamp too small"; now it says to set `start_after`.
    unset = Harness(relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "at", "where": "at < 'infinity'"}]),
        dagster_instance)
    with pytest.raises(Exception, match=r"times before the year 1 \('-infinity' included\).*Set `start_after"):
        unset.tick(unset.table())
    h = Harness(relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "id", "start_after": 9223372036854775807 - 60000,
         "slice_max_rows": 100_000}]), dagster_instance)
    h.drain(h.table())
    got = read_topic(services.kafka_bootstrap, h.table().topic_name)
    assert_exactly_once(got, list(range(9223372036854775807 - 59999, 9223372036854775807 + 1)))
    assert (got[-1].value["Name"], got[-1].value["name"]) == ("N60000", "n60000")


def test_postgres_domains_are_read_as_their_base_types(services, pg_database, pg_engine, dagster_instance, spark,
                                                       name) -> None:
    """A column of a domain type (a base type with a check) was refused as "type DOMAIN", though its values are the
    base type's to every reader: relayed as the base type, a domain over bigint as the watermark too."""
    with pg_engine.begin() as conn:
        for domain, base in (("posid", "bigint CHECK (VALUE > 0)"), ("code", "varchar(8)"),
                             ("money2", "numeric(7,2)"), ("instant", "timestamptz")):
            conn.execute(text(f"CREATE DOMAIN {name}_{domain} AS {base}"))
        conn.execute(text(f"CREATE TABLE {name} (id {name}_posid PRIMARY KEY, c {name}_code, m {name}_money2, "
                          f"at {name}_instant)"))
        conn.execute(text(f"INSERT INTO {name} VALUES (1, 'ab', 1.50, '2026-11-27 10:00:00.123456+00'), "
                          "(2, NULL, -0.01, NULL)"))
    got = _run_table(services, pg_database, dagster_instance, f"public.{name}", 2)
    assert got == [{"id": 1, "c": "ab", "m": "1.50", "at": "2026-11-27T10:00:00.123456+00:00"},
                   {"id": 2, "c": None, "m": "-0.01", "at": None}]


# Text MariaDB's json_valid() (so a JSON column's CHECK) takes that is not JSON; JSON at its edges that it takes.
MARIA_NOT_JSON = ['{"a":-}', "[1.]", '{"a":1e}', '{"x":"\\x41"}', "1.e5", '"\\a"', "[1.5E-]", '{"a":"\\U0041"}']
JSON_EDGES = [
    '{"b": 1.10, "a": [1, 2.50], "b": {"c": 1, "c": 2}}',  # duplicate keys, key order and number text kept
    "[" * 30 + '{"deep": true}' + "]" * 30,  # 31 levels: json_valid()'s most
    "[12345678901234567890123456789012345678901234567890, -0, 1E400, -1.5e-400, 0.1000000000000000000000000001]",
    "1" * 1500,  # longer than Jackson's 1000-digit numbers
    '{"\\u0000": "a\\u0000b \\"\\\\\\/\\b\\f\\n\\r\\t \\uD83D\\uDE00 \u00e9 \U0001f600 \u2028\u2029\u0085 \x7f"}',
    ' \n\t[ "x" , {} , [ ] , null , true , false ]\r\n ',
    '"only a string"', "null", "-0.0e-0",
]
# JSON that json_valid() refuses, kept by a session with check_constraint_checks=0.
JSON_UNCHECKED = ["[" * 200 + "{}" + "]" * 200, '["\\ud800", "\\udc00 \\uDBFF"]']


def test_json_check_tells_json_from_any_other_text(spark) -> None:
    """`is_json_text` against a strict parser: what MariaDB's json_valid() takes but is not JSON, and what Spark's
    own JSON functions would take (text after the value, single quotes, raw control characters) are refused; JSON
    with duplicate keys, lone surrogate escapes, long strings, names and numbers, deep nesting is not."""
    from resources.row_checks import is_json_text

    def strict(s: str) -> bool:
        def refuse(constant: str) -> None:
            raise ValueError(constant)
        try:
            json.loads(s, parse_constant=refuse, parse_int=str, parse_float=str)  # NaN, Infinity are not JSON
        except (ValueError, RecursionError):
            return False
        return True

    not_json = MARIA_NOT_JSON + [
        "", " ", "{'a':1}", '["\\\'"]', "NaN", "[Infinity]", "01", ".5", "+1", '{"a":1,}', "[1,,2]", '{"a":1}x',
        '{"a":1}{"b":2}', "[1]]", "{}}", "1],[2", "1,2", '{"a":1},{"b":2', "true false", "[1]//c", '{"a" 1}',
        '{"a":"x\ty"}', '"a\x00b"', '"\x1f"', "[1]\x00", "\ufeff[]", "[]\u2028", '"\\ud8', '"\\"', '"a', "[1.5.5]",
        "[--1]", "[1-2]", "[0x10]", "{a:1}", "[tru]", '{1:2}', '["\\u00e"]', '{"a":"\\\\\\"}', '"\\\\"\\""']
    long_ones = ['"' + "\\n" * 200_000 + '"', '{"' + "k" * 60_000 + '": 1}', "[" * 900 + "]" * 900,
                 "[" + ",".join(['"\\u00e9", 1.5e3'] * 50_000) + "]"]
    json_texts = JSON_EDGES + JSON_UNCHECKED + long_ones
    texts = json_texts + not_json
    assert [strict(s) for s in texts] == [True] * len(json_texts) + [False] * len(not_json)
    frame = spark.createDataFrame([(i, s) for i, s in enumerate(texts)], "i int, s string")
    got = [r.ok for r in frame.select(is_json_text(frame["s"]).alias("ok")).orderBy(frame["i"]).collect()]
    wrong = [(s[:60], ok) for s, ok in zip(texts, got, strict=True) if ok != strict(s)]
    assert not wrong, wrong


def _raw_values(bootstrap: str, topic: str, count: int) -> list[bytes]:
    """The first `count` message values of partition 0, as bytes, read_committed."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"raw-{topic}",
                         "isolation.level": "read_committed", "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        values = []
        while len(values) < count and (msg := consumer.poll(10)) is not None:
            if not msg.error():
                values.append(msg.value())
        return values
    finally:
        consumer.close()


@pytest.mark.parametrize("spark_remote", [False, True], ids=["local-spark", "spark-connect"])
def test_mariadb_json_that_is_not_json_stops_its_slice(services, mariadb_database, mariadb_engine, dagster_instance,
                                                       spark, name, spark_remote: bool) -> None:
    """MariaDB's json_valid() takes `{"a":-}`, `[1.]`, `"\\x41"` (and a session with check_constraint_checks=0 any
    text): spliced in as it was, the message was not JSON and the slice committed. Now such a value stops its slice
    as bad_row naming the row and the column (nothing visible, progress unchanged); with the rows left out the rest
    arrive byte for byte as stored: duplicate keys, nesting, long numbers, escapes, whitespace, scalars, SQL NULL,
    and JSON json_valid() refuses (200 levels deep, lone surrogate escapes)."""
    from resources.kafka_io_manager import STOPPED_TAG
    from tests.test_errors import failure_text

    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint AUTO_INCREMENT PRIMARY KEY, j JSON, n int)"))
        insert = text(f"INSERT INTO {name} (j, n) VALUES (:j, :n)")
        for value in JSON_EDGES[:2]:
            conn.execute(insert, {"j": value, "n": 7})
        conn.execute(insert, {"j": '{"a":-}', "n": 7})  # row 3: json_valid() takes it
        for value in JSON_EDGES[2:] + [None]:
            conn.execute(insert, {"j": value, "n": 7})
        conn.execute(text("SET SESSION check_constraint_checks = 0"))  # the CHECK is skipped: any text is kept
        conn.execute(insert, {"j": "{'a': 1} x", "n": 7})  # row 12
        for value in JSON_UNCHECKED:
            conn.execute(insert, {"j": value, "n": 7})
        stored = dict(conn.execute(text(f"SELECT id, j FROM {name} ORDER BY id")).all())
    assert len(stored) == 14
    base = {"source": "src", "table": name, "watermark": "id", "settle_seconds": 0.5}
    said, key = [], None
    for skip in ([], [3]):  # the same slice, run again with row 3 left out
        h = Harness(relay_config(services, {"src": mariadb_database}, [{**base, "skip_watermarks": skip}],
                                 spark_remote=spark_remote), dagster_instance)
        table = h.table()
        key = key or h.cut(table)[0]
        result = h.run(table, key, raise_on_error=False)
        assert not result.success
        said.append(result.output if spark_remote else failure_text(result))
        if not spark_remote:
            assert dagster_instance.get_run_by_id(result.run_id).tags.get(STOPPED_TAG) == "bad_row"
        assert read_topic(services.kafka_bootstrap, table.topic_name, timeout=3.0) == []
        assert h.progress(table) is None
    assert (f"{table.table_id}: row 3 holds text that is not JSON in column 'j'" in said[0]
            and "skip_watermarks: [3]" in said[0]), said[0][-3000:]
    assert (f"{table.table_id}: row 12 holds text that is not JSON in column 'j'" in said[1]
            and "skip_watermarks: [12]" in said[1]), said[1][-3000:]
    skipping = Harness(relay_config(services, {"src": mariadb_database}, [{**base, "skip_watermarks": [3, 12]}],
                                    spark_remote=spark_remote), dagster_instance)
    skipping.drain(skipping.table(), until_hi=14)
    sent = [i for i in stored if i not in (3, 12)]
    want = [b'{"id":%d,"j":%s,"n":7}' % (i, b"null" if stored[i] is None else stored[i].encode()) for i in sent]
    got = _raw_values(services.kafka_bootstrap, table.topic_name, len(want))
    assert got == want
    assert [json.loads(v)["id"] for v in got] == sent  # each one JSON


def test_mariadb_json_that_is_not_json_after_a_sent_chunk_leaves_nothing_visible(services, mariadb_database,
                                                                                  mariadb_engine, dagster_instance,
                                                                                  spark, name) -> None:
    """The bad value in the slice's second chunk: the first chunk's messages were already produced in the slice's
    transaction, which is aborted: nothing is visible, progress stays. Fixed, the slice then arrives exactly once."""
    from tests.conftest import partition_ends
    from tests.test_errors import failure_text

    rows = 100_005
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint AUTO_INCREMENT PRIMARY KEY, j JSON)"))
        conn.execute(text(f"INSERT INTO {name} (j) SELECT CONCAT('{{\"k\": [', seq, ', 1.50]}}') FROM seq_1_to_{rows}"))
        conn.execute(text(f"UPDATE {name} SET j = '[1.]' WHERE id = {rows - 2}"))
    h = Harness(relay_config(services, {"src": mariadb_database}, [
        {"source": "src", "table": name, "watermark": "id", "settle_seconds": 0.5, "slice_max_rows": 200_000}]),
        dagster_instance)
    table = h.table()
    (key,) = h.cut(table)
    assert "..." not in key  # one slice, two chunks
    result = h.run(table, key, raise_on_error=False)
    assert not result.success
    said = failure_text(result)
    assert f"{table.table_id}: row {rows - 2} holds text that is not JSON in column 'j'" in said, said[-3000:]
    # The first chunk (~50,000 rows) was being produced when the second failed: what reached the log is aborted.
    assert partition_ends(services.kafka_bootstrap, table.topic_name, 0)[1] > 0
    assert read_topic(services.kafka_bootstrap, table.topic_name, timeout=3.0) == []
    assert h.progress(table) is None
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"UPDATE {name} SET j = '[1.0]' WHERE id = {rows - 2}"))
    assert h.run(table, key).success
    got = read_topic(services.kafka_bootstrap, table.topic_name)
    assert_exactly_once(got, list(range(1, rows + 1)))
    assert got[rows - 3].value == {"id": rows - 2, "j": [1.0]} and got[0].value == {"id": 1, "j": {"k": [1, 1.5]}}
