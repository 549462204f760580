"""`rowrelay verify` finds duplicates, gaps, extras and order violations (and passes a clean topic)."""

from __future__ import annotations

import pytest
from confluent_kafka import Producer
from sqlalchemy import text

from orchestration.cli import main, verify_table
from tests.pipeline import Harness, relay_config

pytestmark = pytest.mark.integration


def _inject(bootstrap: str, topic: str, watermark: int) -> None:
    p = Producer({"bootstrap.servers": bootstrap})
    p.produce(topic, value=b'{"id": %d}' % watermark, headers=[("rowrelay.watermark", str(watermark).encode())])
    p.flush(10)


def test_verify_reports_each_kind_of_defect(services, pg_database, pg_engine, dagster_instance, spark, name,
                                            tmp_path, capsys) -> None:
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} SELECT g, 'v' FROM generate_series(1, 300) g WHERE g <> 150"))
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}", "watermark": "id",
                                                         "slice_max_rows": 100}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    h.drain(table, until_hi=300)
    clean = verify_table(cfg, table)
    assert clean.ok and clean.source_rows == clean.messages == 299 and clean.committed_hi == 300

    config_file = tmp_path / "rowrelay.yaml"
    import yaml

    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    assert main(["--config", str(config_file), "verify"]) == 0
    assert "[OK]" in capsys.readouterr().out

    with pg_engine.begin() as conn:  # a row appearing below committed progress: a gap in the topic
        conn.execute(text(f"INSERT INTO {name} VALUES (150, 'late')"))
    _inject(services.kafka_bootstrap, table.topic_name, 42)     # a duplicate, and out of order
    _inject(services.kafka_bootstrap, table.topic_name, 99999)  # a message no source row explains
    report = verify_table(cfg, table)
    assert (report.duplicates, report.missing, report.extra) == (1, 1, 1)
    assert report.order_violations == 1
    assert report.examples["missing"] == [150] and report.examples["duplicates"] == [42]
    assert main(["--config", str(config_file), "verify", "--json"]) == 1
