"""Three tables (two PostgreSQL, one MariaDB), 50k rows each, written while the pipeline runs."""

from __future__ import annotations

import threading
import time

import pytest
from dagster import AssetCheckKey
from sqlalchemy import text

from assets.checks import PARITY_CHECK
from assets.identity import asset_key, channel_for
from resources.exactly_once import read_progress_history, read_published_messages, slice_checksum
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from tests.pipeline import Harness, assert_exactly_once, read_topic, relay_config

pytestmark = pytest.mark.integration
ROWS = 50_000
WRITERS = 2  # concurrent writers per table: their transactions commit ids out of order
BATCH = 250


def _writer(engine, table: str, count: int, errors: list[BaseException]) -> None:
    try:
        done = 0
        while done < count:
            n = min(BATCH, count - done)
            with engine.begin() as conn:
                conn.execute(text(f"INSERT INTO {table} (payload, amount) VALUES (:p, :a)"),
                             [{"p": f"row-{done + i}", "a": (done + i) % 1000 / 10} for i in range(n)])
            done += n
    except BaseException as exc:  # surfaced by the test
        errors.append(exc)


def test_three_tables_fifty_thousand_rows_each_exactly_once(services, pg_database, pg_engine, mariadb_database,
                                                            mariadb_engine, dagster_instance, spark, name) -> None:
    pg_a, pg_b, maria = f"{name}_a", f"{name}_b", f"{name}_m"
    with pg_engine.begin() as conn:
        for t in (pg_a, pg_b):
            conn.execute(text(f"CREATE TABLE {t} (id bigserial PRIMARY KEY, payload text, amount numeric(8,1))"))
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {maria} (id bigint AUTO_INCREMENT PRIMARY KEY, payload text, "
                          "amount decimal(8,1))"))
    cfg = relay_config(services, {"pg": pg_database, "maria": mariadb_database}, [
        {"source": "pg", "table": f"public.{pg_a}", "watermark": "id", "slice_max_rows": 10_000},
        {"source": "pg", "table": f"public.{pg_b}", "watermark": "id", "slice_max_rows": 15_000,
         "key": ["id"], "topic_partitions": 3},
        {"source": "maria", "table": maria, "watermark": "id", "slice_max_rows": 10_000, "settle_seconds": 1,
         "envelope": True},
    ])
    h = Harness(cfg, dagster_instance)
    errors: list[BaseException] = []
    writers = [threading.Thread(target=_writer, args=(engine, t, ROWS // WRITERS, errors))
               for engine, t in ((pg_engine, pg_a), (pg_engine, pg_b), (mariadb_engine, maria))
               for _ in range(WRITERS)]
    for w in writers:
        w.start()
    runs = 0  # slices published
    while any(w.is_alive() for w in writers):  # the pipeline works while rows arrive
        for table in cfg.tables:
            for key in h.tick(table):
                assert h.run(table, key).success
                runs += len(h.expand(table, key))  # a backlog runs as one partition-range run
        time.sleep(0.5)
    for w in writers:
        w.join()
    assert not errors, errors
    for table in cfg.tables:
        runs += len(h.drain(table, until_hi=ROWS, timeout=300))
    assert runs >= 3 * 4, "expected several slices per table"

    for table in cfg.tables:
        msgs = read_topic(services.kafka_bootstrap, table.topic_name)
        if table.envelope:
            assert {m.value["op"] for m in msgs} == {"insert"}
            for m in msgs:
                assert m.value["source"]["table"] == table.table_id
                assert m.value["source"]["watermark"] == m.value["data"]["id"] == m.watermark
            ids_view = [type(m)(m.partition, m.offset, m.key, m.value["data"], m.headers) for m in msgs]
        else:
            ids_view = msgs
        assert_exactly_once(ids_view, list(range(1, ROWS + 1)))
        assert h.progress(table).hi == ROWS == h.max_watermark(table)
        assert len({m.partition for m in msgs}) == table.topic_partitions
        for m in msgs[:50]:  # per row only what is per row
            assert set(m.headers) == {"rowrelay.table", "rowrelay.watermark"}
        # A consumer checks each slice from its messages alone: the progress record's offsets bound them, and its
        # checksum is over their values in watermark order (slice_checksum; its formula is pinned in
        # tests/unit/test_exactly_once_batches.py).
        conf = {"bootstrap.servers": services.kafka_bootstrap}
        records = [r for r in read_progress_history(conf, channel_for(table, PREFIX)) if r.rows]
        assert sum(r.rows for r in records) == ROWS
        for record in records:
            published = sorted(read_published_messages(conf, record),
                               key=lambda m: int(dict(m.headers())["rowrelay.watermark"]))
            assert len(published) == record.rows
            assert slice_checksum(m.value() for m in published) == record.checksum
    # Dagster's PostgreSQL storage recorded every slice with its metadata.
    for table in cfg.tables:
        keys = h.instance.get_dynamic_partitions(f"{table.dagster_name}__slices")
        assert sum(h.materialization(table, k)["rows"] for k in keys) == ROWS
        # The last run's slice_parity read its slices back from Kafka (three partitions for one table) and agreed.
        parity = h.instance.get_latest_asset_check_evaluation_record(AssetCheckKey(asset_key(table), PARITY_CHECK))
        assert parity is not None and parity.evaluation.passed, parity
        checked = parity.evaluation.metadata["slices_checked"].value
        assert checked >= 1 and parity.evaluation.metadata["slices_read_back"].value == checked
