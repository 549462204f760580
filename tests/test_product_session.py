"""A relay on the product's own Spark session, as a deployment runs it: `rowrelay backfill` in a process of its own
whose zone is not UTC, its SparkSession built by resources/spark.py from the config's `spark:` (no test fixture
session, whose settings would hide the product's). Times around New York's clock changes, on the day its standard
time began, and on dates that differ between New York and UTC arrive exactly as the source holds them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from tests.pipeline import ROOT, read_topic, relay_config
from tests.test_cli import _config_file
from tests.test_types import _expected

pytestmark = pytest.mark.integration

ZONE = "America/New_York"

PG_ROWS = [  # (timestamp, timestamptz, date)
    ("2026-03-08 02:30:00.123456", "2026-03-08 07:30:00+00", "2026-03-08"),  # no such wall time in New York
    ("2026-11-01 01:30:00", "2026-11-01 05:30:00.5+00", "2026-11-01"),  # twice in New York
    ("1883-11-18 12:03:57", "1883-11-18 16:59:59.999999+00", "1883-11-18"),  # New York's local mean time ends
    ("2024-01-02 23:30:00", "2024-01-03 02:00:00+00", "2024-01-03"),  # another day in New York
    ("1969-12-31 23:59:59.999999", "1970-01-01 00:00:00+00", "1969-12-31"),
    (None, None, None),
]
MARIADB_ROWS = [  # (DATETIME(6) watermark, TIMESTAMP(6) written in UTC, DATE)
    ("1883-11-18 12:03:57.000001", None, "1883-11-18"),
    ("2024-01-02 23:30:00", "2024-01-03 02:00:00", "2024-01-03"),
    ("2026-03-08 02:30:00.123456", "2026-03-08 07:30:00.5", "2026-03-08"),
    ("2026-11-01 01:30:00", "2026-11-01 05:30:00", "2026-11-01"),
]


def backfill_in_zone(cfg, table_id: str, dagster_home: Path, tmp_path: Path) -> None:
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home), "TZ": ZONE}
    zone = subprocess.run([sys.executable, "-c", "import time; print(time.strftime('%Z', time.localtime(0)))"],
                          env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert zone == "EST", f"the backfill's process is not in {ZONE}: {zone}"
    done = subprocess.run([sys.executable, "-m", "orchestration.cli", "--config",
                           _config_file(cfg, tmp_path / f"{table_id}.yaml"), "backfill", "--table", table_id],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


@pytest.mark.parametrize("spark_mode", ["local", "connect"])
def test_a_backfill_on_the_products_own_session_in_new_york_sends_times_exactly(
        services, pg_database, mariadb_database, dagster_home, name, tmp_path, spark_mode) -> None:
    pg = create_engine(pg_database)
    maria = create_engine(mariadb_database, connect_args={"init_command": "SET time_zone = '+00:00'"})
    try:
        with pg.begin() as conn:
            conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, c_ts timestamp, c_tstz timestamptz, "
                              "c_date date)"))
            for row in PG_ROWS:
                conn.execute(text(f"INSERT INTO {name} (c_ts, c_tstz, c_date) VALUES (:a, :b, :c)"),
                             dict(zip("abc", row, strict=True)))
        with maria.begin() as conn:
            conn.execute(text(f"CREATE TABLE {name} (n INT PRIMARY KEY, at DATETIME(6) NOT NULL, ts TIMESTAMP(6) "
                              "NULL, d DATE, INDEX (at))"))
            for n, row in enumerate(MARIADB_ROWS, 1):
                conn.execute(text(f"INSERT INTO {name} VALUES (:n, :a, :b, :c)"),
                             {"n": n, **dict(zip("abc", row, strict=True))})
        with pg.connect() as conn:
            conn.execute(text("SET TIME ZONE 'UTC'"))
            pg_rows = [dict(r._mapping) for r in conn.execute(text(f"SELECT * FROM {name} ORDER BY id"))]
        with maria.connect() as conn:
            maria_rows = [dict(r._mapping) for r in conn.execute(text(f"SELECT * FROM {name} ORDER BY at"))]
    finally:
        pg.dispose()
        maria.dispose()
    cfg = relay_config(services, {"pg": pg_database, "maria": mariadb_database}, [
        {"source": "pg", "table": f"public.{name}", "watermark": "id", "settle_seconds": 0},
        {"source": "maria", "table": name, "watermark": "at", "key": ["n"], "settle_seconds": 0,
         "start_after": "1800-01-01T00:00:00.000000Z"}],
        spark_remote=spark_mode == "connect")
    if spark_mode == "local":  # the product's local session: its JVM starts in this zone, with the stack's drivers
        cfg = cfg.model_copy(update={"spark": cfg.spark.model_copy(update={"master": "local[1]"})})
    for table in cfg.tables:
        backfill_in_zone(cfg, table.table_id, dagster_home, tmp_path)
    pg_got = [m.value for m in read_topic(services.kafka_bootstrap, cfg.tables[0].topic_name)]
    assert pg_got == [{col: _expected(v) for col, v in row.items()} for row in pg_rows]
    maria_got = [m.value for m in read_topic(services.kafka_bootstrap, cfg.tables[1].topic_name)]
    assert maria_got == [{"n": row["n"], "at": _expected(row["at"]), "d": _expected(row["d"]),
                          "ts": row["ts"].strftime("%Y-%m-%dT%H:%M:%S.%f+00:00") if row["ts"] else None}
                         for row in maria_rows]
