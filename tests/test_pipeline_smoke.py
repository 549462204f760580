"""First end-to-end: one PostgreSQL table through sensor ticks and in-process runs on a PG-backed instance."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from tests.pipeline import Harness, assert_exactly_once, read_topic, relay_config

pytestmark = pytest.mark.integration


def test_postgres_table_reaches_kafka_exactly_once(services, pg_database, pg_engine, dagster_instance, spark, name):
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, label text, amount numeric(12,2))"))
        conn.execute(text(f"INSERT INTO {name} (label, amount) "
                          "SELECT 'r' || g, g / 100.0 FROM generate_series(1, 2500) g"))
    cfg = relay_config(services, {"shop": pg_database}, [
        {"source": "shop", "table": f"public.{name}", "watermark": "id", "slice_max_rows": 1000, "key": ["id"]}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    keys = h.drain(table)
    assert keys == ["000000000000-000000001000", "000000001000-000000002000", "000000002000-000000002500"]
    msgs = read_topic(services.kafka_bootstrap, table.topic_name)
    assert_exactly_once(msgs, list(range(1, 2501)))
    assert msgs[0].value == {"id": 1, "label": "r1", "amount": "0.01"}
    assert msgs[0].key == b'{"id":1}'
    assert h.progress(table).hi == 2500
    meta = h.materialization(table, keys[0])
    assert meta["rows"] == 1000 and meta["already_committed"] is False
    # Where the run's time went, per step (the run stats' launch time is unset for an in-process run).
    steps = meta["timings_s"]
    assert {"worker_to_asset_s", "progress_read_s", "table_check_s", "count_s", "first_batch_s", "transaction_s",
            "publish_s"} <= set(steps), steps
    assert 0 < steps["first_batch_s"] <= steps["publish_s"] and 0 < steps["transaction_s"] <= steps["publish_s"]
    again = h.run(table, keys[0])
    assert again.success
    meta_again = h.materialization(table, keys[0])  # the newest one
    assert meta_again["already_committed"] is True and meta_again["status"].startswith("already committed")
    assert "timings_s" not in meta_again  # nothing was published: no steps to report
    assert len(read_topic(services.kafka_bootstrap, table.topic_name)) == 2500


def test_downstream_asset_loads_a_published_slice_back(services, pg_database, pg_engine, dagster_instance, spark,
                                                       name) -> None:
    from dagster import AssetIn, InMemoryIOManager, asset, materialize

    from assets.identity import asset_key, partitions_for

    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, label text)"))
        conn.execute(text(f"INSERT INTO {name} (label) SELECT 'r' || g FROM generate_series(1, 1200) g"))
    cfg = relay_config(services, {"shop": pg_database}, [
        {"source": "shop", "table": f"public.{name}", "watermark": "id", "slice_max_rows": 500, "key": ["id"]}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    keys = h.drain(table)
    assert len(keys) == 3
    seen: dict[str, list] = {}

    @asset(partitions_def=partitions_for(table), ins={"published": AssetIn(key=asset_key(table))},
           io_manager_key="memory")
    def downstream(published) -> int:  # a Spark DataFrame read back from Kafka
        rows = published.orderBy("offset").collect()
        seen["rows"] = rows
        return len(rows)

    upstream = h.defs.get_assets_def(asset_key(table))
    result = materialize([upstream, downstream], selection=[downstream], partition_key=keys[1],
                         instance=dagster_instance, resources={**h.defs.resources, "memory": InMemoryIOManager()})
    assert result.success
    rows = seen["rows"]
    assert [r["watermark"] for r in rows] == list(range(501, 1001))
    assert rows[0]["key"] == '{"id":501}' and '"label":"r501"' in rows[0]["value"]
    assert {r["slice"] for r in rows} == {keys[1]}
