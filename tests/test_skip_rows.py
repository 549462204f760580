"""`skip_watermarks` leaves out one row, never every row that shares its watermark, on the real stack."""

from __future__ import annotations

import re

import pytest
import yaml
from sqlalchemy import text

from tests.pipeline import Harness, assert_exactly_once, read_topic, relay_config
from tests.test_errors import failure_text

pytestmark = pytest.mark.integration

# The producer's message.max.bytes: the big row's message is over it, every other row far under it.
SMALL_LIMIT = 100_000


def _suggested_skip(said: str, watermark: str) -> object:
    """The skip_watermarks entry the stop message suggests, as YAML reads it; a message that names only the
    row's time is followed as a user would, with that time (`watermark`)."""
    found = re.search(r"skip_watermarks: \[(.+?)\](?:;|\s|$)", said)
    return yaml.safe_load(f"[{found.group(1)}]")[0] if found is not None else watermark


def test_a_skipped_row_leaves_the_rows_sharing_its_time_to_be_published(services, pg_database, pg_engine,
                                                                         dagster_instance, spark, name) -> None:
    """A `timestamptz DEFAULT now()` watermark with `tie_break: uid`; one transaction writes 1,000 rows, one of
    them too large for the producer. The run stops naming the row; following its advice, the next run publishes
    the other 999 (a skip by value left out all 1,000, with `verify` OK), and verify and status count the one
    row as skipped."""
    from orchestration.status import table_status
    from orchestration.verify import verify_table

    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (uid bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT now(), "
                          "v text)"))
        # Random hex: compression cannot shrink the big row under the limit.
        conn.execute(text(f"INSERT INTO {name} (v) SELECT CASE WHEN g = 500 THEN (SELECT string_agg("
                          "md5(random()::text), '') FROM generate_series(1, 8000)) ELSE 'ok' END "
                          "FROM generate_series(1, 1000) g ORDER BY g"))
    base = {"source": "src", "table": f"public.{name}", "watermark": "at", "tie_break": "uid", "key": ["uid"]}
    producer = {"message.max.bytes": SMALL_LIMIT}
    h = Harness(relay_config(services, {"src": pg_database}, [base], producer=producer), dagster_instance)
    table = h.table()
    (key,) = h.cut(table)
    result = h.run(table, key, raise_on_error=False)
    said = failure_text(result)
    assert not result.success and "message.max.bytes" in said, said[-3000:]
    assert read_topic(services.kafka_bootstrap, table.topic_name, timeout=3.0) == []
    with pg_engine.connect() as conn:
        big_at = conn.execute(text(f"SELECT at FROM {name} WHERE uid = 500")).scalar()
    entry = _suggested_skip(said, big_at.isoformat())

    cfg = relay_config(services, {"src": pg_database}, [{**base, "skip_watermarks": [entry]}], producer=producer)
    skipping = Harness(cfg, dagster_instance)
    table = skipping.table()
    skipping.drain(table)
    sent = read_topic(services.kafka_bootstrap, table.topic_name)
    assert len(sent) == 999, f"{len(sent)} of 999 rows published after skip_watermarks: [{entry}]"
    assert_exactly_once(sent, [i for i in range(1, 1001) if i != 500], id_field="uid")
    assert skipping.progress(table).skipped_rows == 1

    report = verify_table(cfg, table)
    assert report.ok and report.messages == report.source_rows == 999, report
    assert report.skipped_rows == 1, report
    lag = table_status(cfg, table)
    assert lag.lag_rows == 0 and lag.skipped_rows == 1, lag
    # The stop message named THE row (its tie_break), not only the time every row shares.
    assert isinstance(entry, dict) and entry.get("tie_break") == 500, (entry, said[-3000:])


def test_a_bare_skip_of_a_shared_integer_watermark_is_refused_naming_the_count(
        services, mariadb_database, mariadb_engine, dagster_instance, spark, name) -> None:
    """A non-unique integer watermark (a batch number) on MariaDB: `skip_watermarks: [2]` matches 40 rows. It is
    refused before anything is published, naming the table, the value, the count and the entry form to use, and
    progress does not move."""
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint PRIMARY KEY AUTO_INCREMENT, batch bigint NOT NULL, "
                          "v varchar(20), KEY (batch))"))
        conn.execute(text(f"INSERT INTO {name} (batch, v) SELECT 1 + (seq div 40), 'ok' FROM seq_0_to_119"))
    base = {"source": "src", "table": name, "watermark": "batch", "tie_break": "id", "settle_seconds": 0}
    h = Harness(relay_config(services, {"src": mariadb_database}, [{**base, "skip_watermarks": [2]}]),
                dagster_instance)
    table = h.table()
    (key,) = h.cut(table)
    result = h.run(table, key, raise_on_error=False)
    said = failure_text(result) if not result.success else ""
    assert read_topic(services.kafka_bootstrap, table.topic_name, timeout=3.0) == []
    assert h.progress(table) is None
    assert not result.success
    assert f"{table.table_id}: skip_watermarks entry 2 matches 40 rows" in said, said[-3000:]
    assert "{watermark: 2, tie_break:" in said, said[-3000:]
    # The row named as the message says: the other 39 rows of the batch are published, the one skipped.
    from orchestration.verify import verify_table

    cfg = relay_config(services, {"src": mariadb_database},
                       [{**base, "skip_watermarks": yaml.safe_load("[{watermark: 2, tie_break: 45}]")}])
    named = Harness(cfg, dagster_instance)
    table = named.table()
    named.drain(table)
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), [i for i in range(1, 121) if i != 45])
    assert named.progress(table).skipped_rows == 1
    report = verify_table(cfg, table)
    assert report.ok and report.source_rows == 119 and report.skipped_rows == 1, report


def test_a_row_a_read_stops_at_is_named_by_its_tie_break(services, mariadb_database, mariadb_engine,
                                                          dagster_instance, spark, name) -> None:
    """A MariaDB JSON value that is not JSON, in a batch of 30 rows sharing one watermark: the stop message names
    the row by its tie_break (the read's own mark), and that entry publishes the batch's other 29 rows."""
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint PRIMARY KEY AUTO_INCREMENT, batch bigint NOT NULL, "
                          "j JSON, KEY (batch))"))
        conn.execute(text(f"INSERT INTO {name} (batch, j) SELECT 1 + (seq div 30), '[1]' FROM seq_0_to_59"))
        conn.execute(text(f"UPDATE {name} SET j = '{{\"a\":-}}' WHERE id = 44"))  # json_valid() takes it
    base = {"source": "src", "table": name, "watermark": "batch", "tie_break": "id", "settle_seconds": 0}
    h = Harness(relay_config(services, {"src": mariadb_database}, [base]), dagster_instance)
    table = h.table()
    (key,) = h.cut(table)
    result = h.run(table, key, raise_on_error=False)
    said = failure_text(result)
    assert not result.success and "skip_watermarks: [{watermark: 2, tie_break: 44}]" in said, said[-3000:]
    entry = _suggested_skip(said, "")
    named = Harness(relay_config(services, {"src": mariadb_database}, [{**base, "skip_watermarks": [entry]}]),
                    dagster_instance)
    named.drain(named.table())
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), [i for i in range(1, 61) if i != 44])
