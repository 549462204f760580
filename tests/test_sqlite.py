"""SQLite as a source: a table in a database file, relayed exactly once (local Spark and the Connect server)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from tests.pipeline import Harness, assert_exactly_once, read_topic, relay_config

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("spark_remote", [False, True], ids=["local-spark", "spark-connect"])
def test_sqlite_table_reaches_kafka_exactly_once(services, dagster_instance, spark, name, tmp_path: Path,
                                                 spark_remote: bool) -> None:
    path = tmp_path / f"{name}.db"
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.execute(text("PRAGMA journal_mode=WAL"))  # readers (Spark's JDBC) alongside a writer
        conn.execute(text(f"CREATE TABLE {name} (id INTEGER PRIMARY KEY AUTOINCREMENT, label TEXT, amount REAL)"))
        conn.execute(text(f"INSERT INTO {name} (label, amount) VALUES " +
                          ", ".join(f"('r{i}', {i}.5)" for i in range(1, 251))))
    cfg = relay_config(services, {"lite": make_url(f"sqlite:///{path}")}, [
        {"source": "lite", "table": name, "watermark": "id", "slice_max_rows": 100, "key": ["id"],
         "settle_seconds": 0.2}], spark_remote=spark_remote)
    h = Harness(cfg, dagster_instance)
    table = h.table()
    h.drain(table)
    with engine.begin() as conn:  # more rows after the first cut
        conn.execute(text(f"INSERT INTO {name} (label, amount) VALUES ('late', 0.25)"))
    h.drain(table, until_hi=251)
    msgs = read_topic(services.kafka_bootstrap, table.topic_name)
    assert_exactly_once(msgs, list(range(1, 252)))
    assert msgs[0].value == {"id": 1, "label": "r1", "amount": 1.5} and msgs[0].key == b'{"id":1}'
    assert msgs[-1].value == {"id": 251, "label": "late", "amount": 0.25}
    engine.dispose()
