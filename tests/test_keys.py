"""Message keys that depend on the row only: `hash_row` is the same for a row whichever slice publishes it."""

from __future__ import annotations

import hashlib
import json

import pytest
from sqlalchemy import text

from tests.pipeline import Harness, read_topic, relay_config

pytestmark = pytest.mark.integration


def test_hash_row_key_is_the_same_for_the_same_row_in_different_slices(services, pg_database, pg_engine,
                                                                        dagster_instance, spark, name) -> None:
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, label text, amount numeric(8,2))"))
        conn.execute(text(f"INSERT INTO {name} (label, amount) SELECT 'r' || g, g * 1.5 FROM generate_series(1, 7) g"))
    # The same rows relayed twice (two source names on one database), cut into slices of 2 and of 3 rows, with the
    # envelope on: each row's envelope names another slice in each topic, its key must not change.
    cfg = relay_config(services, {"a": pg_database, "b": pg_database}, [
        {"source": "a", "table": f"public.{name}", "watermark": "id", "slice_max_rows": 2, "key": "hash_row",
         "envelope": True},
        {"source": "b", "table": f"public.{name}", "watermark": "id", "slice_max_rows": 3, "key": "hash_row",
         "envelope": True}])
    h = Harness(cfg, dagster_instance)
    by_topic = []
    for i in (0, 1):
        table = h.table(i)
        h.drain(table)
        msgs = read_topic(services.kafka_bootstrap, table.topic_name)
        by_topic.append({m.value["data"]["id"]: m for m in msgs})
    a, b = by_topic
    assert sorted(a) == sorted(b) == list(range(1, 8))
    assert a[3].value["source"]["slice"] != b[3].value["source"]["slice"]  # different slices, different envelopes
    for row_id in a:
        assert a[row_id].key == b[row_id].key, row_id
        data = json.dumps(a[row_id].value["data"], separators=(",", ":")).encode()
        assert a[row_id].key == hashlib.sha256(data).hexdigest().encode()  # the row's data, nothing else
