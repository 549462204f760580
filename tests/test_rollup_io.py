"""A roll-up key (a range over committed slices) through the Kafka IO manager: loaded back, and re-run."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text

from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from tests.pipeline import Harness, read_topic, relay_config

pytestmark = pytest.mark.integration


def _nine_hundred_rows(services, pg_database, pg_engine, name: str):
    """Ids 1-900 in a PostgreSQL table, relayed in 300-row slices keyed by id: the config."""
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, label text)"))
        conn.execute(text(f"INSERT INTO {name} (label) SELECT 'r' || g FROM generate_series(1, 900) g"))
    return relay_config(services, {"shop": pg_database}, [
        {"source": "shop", "table": f"public.{name}", "watermark": "id", "slice_max_rows": 300, "key": ["id"]}])


def test_rollup_key_loads_every_row_back_and_a_rerun_publishes_nothing(services, pg_database, pg_engine,
                                                                       dagster_instance, spark, name) -> None:
    from dagster import AssetIn, InMemoryIOManager, asset, materialize

    from assets.identity import asset_key, channel_for, partitions_for
    from orchestration.compaction import compact_table
    from resources.exactly_once import records_in_range
    from resources.history import summarize
    from resources.slices import SliceRange

    cfg = _nine_hundred_rows(services, pg_database, pg_engine, name)
    h = Harness(cfg, dagster_instance)
    table = h.table()
    keys = h.drain(table)
    assert len(keys) == 3
    conf = h.defs.resources["kafka_io_manager"].kafka_conf()
    # Two hours on, the three slices are one hour's history: one roll-up key replaces them.
    result = compact_table(dagster_instance, table, conf, PREFIX, now=datetime.now(UTC) + timedelta(hours=2), full=True)
    rollup = SliceRange(0, 900).key
    assert list(dagster_instance.get_dynamic_partitions(partitions_for(table).name)) == [rollup], result.line()

    seen: dict[str, list] = {}

    @asset(partitions_def=partitions_for(table), ins={"published": AssetIn(key=asset_key(table))},
           io_manager_key="memory")
    def downstream(published) -> int:
        seen["rows"] = published.orderBy("offset").collect()
        return len(seen["rows"])

    upstream = h.defs.get_assets_def(asset_key(table))
    loaded = materialize([upstream, downstream], selection=[downstream], partition_key=rollup,
                         instance=dagster_instance, resources={**h.defs.resources, "memory": InMemoryIOManager()})
    assert loaded.success
    assert [r["watermark"] for r in seen["rows"]] == list(range(1, 901))
    assert {r["slice"] for r in seen["rows"]} == {rollup}

    again = h.run(table, rollup)  # a re-run (or backfill) of the roll-up key: committed, so nothing is published
    assert again.success
    meta = h.materialization(table, rollup)
    expected = summarize(records_in_range(conf, channel_for(table, PREFIX), SliceRange(0, 900)))
    assert meta["already_committed"] is True
    assert (meta["rows"], meta["checksum"], meta["watermark_lo"], meta["watermark_hi"]) == (
        900, expected["checksum"], 0, 900)
    assert len(read_topic(services.kafka_bootstrap, table.topic_name)) == 900


@pytest.mark.integration
def test_a_rerun_of_the_part_a_reset_kept_inside_a_rollup_reports_its_rows(services, pg_database, pg_engine,
                                                                           dagster_home, dagster_instance,
                                                                           monkeypatch, name) -> None:
    """A reset back inside a roll-up key keeps its part below as the partition (lo, W]. A run of that partition
    (the UI's Materialize) recorded "rows 0, checksum ''": no slice record tiles it. It now
    counts the messages the reset kept, from the slices' own records."""
    from orchestration.cli import main
    from orchestration.compaction import compact_table
    from resources.slices import SliceRange

    cfg = _nine_hundred_rows(services, pg_database, pg_engine, name)
    harness = Harness(cfg, dagster_instance)
    table = harness.table()
    harness.drain(table)
    conf = harness.defs.resources["kafka_io_manager"].kafka_conf()
    compact_table(dagster_instance, table, conf, PREFIX, now=datetime.now(UTC) + timedelta(hours=2), full=True)
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    path = harness.config_file()
    assert main(["--config", str(path), "reset", "--table", table.table_id, "--after", "450", "--reason", "t"]) == 0
    kept = SliceRange(0, 450).key
    assert harness.materialization(table, kept)["rowrelay/published_up_to"] == 450

    assert harness.run(table, kept).success
    meta = harness.materialization(table, kept)
    assert meta["rows"] == 450 and meta["already_committed"] is True, meta
    assert len(read_topic(services.kafka_bootstrap, table.topic_name)) == 900  # the re-run published nothing
