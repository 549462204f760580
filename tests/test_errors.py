"""Bad input gets a clear error and loses nothing: nothing visible in Kafka, progress unchanged."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.slices import SliceRange
from tests.pipeline import Harness, read_topic, relay_config

pytestmark = pytest.mark.integration


def failure_text(result) -> str:
    """Every error message (and cause) of a failed run, as a user would read them in the UI."""
    parts = []
    for event in result.all_events:
        if event.is_step_failure or event.is_failure:
            err = event.event_specific_data.error if hasattr(event.event_specific_data, "error") else None
            while err is not None:
                parts.append(err.message)
                err = err.cause
    return "\n".join(parts)


def _assert_nothing_published(h: Harness, services) -> None:
    table = h.table()
    assert read_topic(services.kafka_bootstrap, table.topic_name) == []
    assert h.progress(table) is None


def _run_manual_slice(h: Harness, key: str = "000000000000-000000000010"):
    h.instance.add_dynamic_partitions(f"{h.table().dagster_name}__slices", [key])
    return h.run(h.table(), key, raise_on_error=False)


@pytest.mark.parametrize(("ddl", "table_cfg", "message"), [
    ("CREATE TABLE {t} (id bigserial PRIMARY KEY, v text)", {"table": "public.{t}_nope"},
     "table '{t}_nope' not found"),
    ("CREATE TABLE {t} (id bigserial PRIMARY KEY, v text)", {"watermark": "seq"},
     "watermark column 'seq' does not exist"),
    ("CREATE TABLE {t} (id text PRIMARY KEY, v text)", {},
     "watermark column 'id' has type TEXT, but must be an integer"),
    ("CREATE TABLE {t} (id bigserial PRIMARY KEY, v text)", {"columns": ["id", "missing"]},
     "configured columns ['missing'] do not exist"),
    ("CREATE TABLE {t} (id bigserial PRIMARY KEY, v interval)", {},
     "column 'v' has type 'interval', which rowrelay cannot serialize"),
])
def test_bad_table_config_is_a_clear_error(services, pg_database, pg_engine, dagster_instance, spark, name,
                                           ddl, table_cfg, message) -> None:
    with pg_engine.begin() as conn:
        conn.execute(text(ddl.format(t=name)))
    cfg_table = {"source": "src", "table": f"public.{name}", "watermark": "id"}
    cfg_table.update({k: (v.format(t=name) if isinstance(v, str) else v) for k, v in table_cfg.items()})
    h = Harness(relay_config(services, {"src": pg_database}, [cfg_table]), dagster_instance)
    expected = message.format(t=name)
    with pytest.raises(Exception, match=None) as info:
        h.tick(h.table())
    assert expected in str(info.value)
    result = _run_manual_slice(h)
    assert not result.success
    assert expected in failure_text(result)
    _assert_nothing_published(h, services)


def test_null_watermarks_are_refused(services, pg_database, pg_engine, dagster_instance, spark, name) -> None:
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (seq bigint, v text)"))
        conn.execute(text(f"INSERT INTO {name} VALUES (1, 'a'), (NULL, 'lost?'), (2, 'b')"))
    h = Harness(relay_config(services, {"src": pg_database},
                             [{"source": "src", "table": f"public.{name}", "watermark": "seq"}]), dagster_instance)
    with pytest.raises(Exception, match="NULL in watermark column 'seq'"):
        h.tick(h.table())
    result = _run_manual_slice(h)
    assert not result.success and "NULL in watermark column 'seq'" in failure_text(result)
    _assert_nothing_published(h, services)


def _two_slices_with_an_oversized_row(services, pg_database, pg_engine, dagster_instance, name: str, at: int
                                     ) -> tuple[Harness, str]:
    """Ids 1-20 in two 10-row slices cut as one run (the backlog), id `at` a ~2 MB row: the producer would accept
    5 MB, the broker's default message.max.bytes (1 MB) refuses it."""
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        # Random hex: lz4 cannot shrink it below the broker's limit (the limit applies to compressed batches).
        conn.execute(text(f"INSERT INTO {name} (v) SELECT CASE WHEN g = {at} THEN (SELECT string_agg("
                          "md5(random()::text), '') FROM generate_series(1, 60000)) ELSE 'ok' END "
                          "FROM generate_series(1, 20) g"))
    cfg = relay_config(services, {"src": pg_database},
                       [{"source": "src", "table": f"public.{name}", "watermark": "id", "slice_max_rows": 10}],
                       producer={"message.max.bytes": 5_000_000})
    h = Harness(cfg, dagster_instance)
    (both,) = h.cut(h.table())
    assert both == f"{SliceRange(0, 10).key}...{SliceRange(10, 20).key}"
    return h, both


def test_slices_a_failed_run_committed_before_its_failure_are_materialized(services, pg_database, pg_engine,
                                                                           dagster_instance, spark, name) -> None:
    """A run of two slices whose second holds a row the broker refuses: the first slice is committed in Kafka for
    good, but the failed run recorded no materialization for it (rows, offsets, checksum), and the next run starts
    at the second. It is now reported as a materialization of its partition, naming the run."""
    from assets.identity import asset_key

    h, both = _two_slices_with_an_oversized_row(services, pg_database, pg_engine, dagster_instance, name, at=15)
    table = h.table()
    result = h.run(table, both, raise_on_error=False)
    assert not result.success and "watermark 15" in failure_text(result)
    assert h.progress(table).hi == 10
    assert len(read_topic(services.kafka_bootstrap, table.topic_name)) == 10
    records = dagster_instance.fetch_materializations(asset_key(table), limit=10).records
    recorded = {r.asset_materialization.partition: r.asset_materialization.metadata for r in records}
    assert set(recorded) == {SliceRange(0, 10).key}, recorded
    metadata = recorded[SliceRange(0, 10).key]
    assert metadata["rows"].value == 10 and metadata["rowrelay/run_failed_later"].value == result.run_id
    assert metadata["checksum"].value == h.progress(table).checksum
    # Dagster skipped the run's checks (its step failed); the asset's failure hook checked the committed slice.
    from dagster import AssetCheckKey

    from assets.checks import PARITY_CHECK

    assert dagster_instance.get_run_by_id(result.run_id).tags["rowrelay/committed_before_failure"] == \
        f"{result.run_id}/{SliceRange(0, 10).key}...{SliceRange(0, 10).key}"
    check = dagster_instance.get_latest_asset_check_evaluation_record(AssetCheckKey(asset_key(table), PARITY_CHECK))
    assert check is not None and check.evaluation.passed, check
    assert check.evaluation.metadata["slices"].value == SliceRange(0, 10).key
    assert check.evaluation.metadata["rowrelay/run_failed_later"].value == result.run_id


def test_a_run_fenced_between_its_slices_still_records_the_slices_it_committed(services, pg_database, pg_engine,
                                                                             dagster_instance, spark, name,
                                                                             monkeypatch) -> None:
    """A run of two slices fenced after its first commit (a `rowrelay reset --force`, a second publisher): closing
    the fenced producer raised a KafkaError of its own in the IO manager's `finally`, which replaced the fence's
    error and skipped recording the committed slice, so no materialization ever told of it."""
    import threading

    from confluent_kafka import Producer

    from assets.identity import asset_key, channel_for
    from tests.pipeline import polled

    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        # A second slice large enough to be producing still when the fence's refusal arrives.
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' || g FROM generate_series(1, 100010) g"))
    cfg = relay_config(services, {"src": pg_database},
                       [{"source": "src", "table": f"public.{name}", "watermark": "id"}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    small, large = SliceRange(0, 10), SliceRange(10, 100_010)
    dagster_instance.add_dynamic_partitions(f"{table.dagster_name}__slices", [small.key, large.key])
    both = f"{small.key}...{large.key}"
    channel = channel_for(table, PREFIX)

    def fence_after_first_commit() -> None:
        polled(lambda: h.progress(table), lambda p: p is not None and p.hi == 10, timeout=60)
        newer = Producer({"bootstrap.servers": services.kafka_bootstrap, "transactional.id": channel.transactional_id})
        newer.init_transactions(30)  # a newer epoch: the run's producer is fenced
        newer.flush(5)

    fencer = threading.Thread(target=fence_after_first_commit, daemon=True)
    fencer.start()
    monkeypatch.setenv("ROWRELAY_FAILPOINT", "sleep:begun:4")  # hold each slice once its transaction began
    result = h.run(table, both, raise_on_error=False)
    monkeypatch.delenv("ROWRELAY_FAILPOINT")
    fencer.join(5)
    assert not result.success
    assert "another publisher" in failure_text(result) or "fenced" in failure_text(result).lower()
    assert dagster_instance.get_run_by_id(result.run_id).tags.get("rowrelay/stopped") == "fenced"
    assert h.progress(table).hi == 10 and len(read_topic(services.kafka_bootstrap, table.topic_name)) == 10
    records = dagster_instance.fetch_materializations(asset_key(table), limit=10).records
    recorded = {r.asset_materialization.partition: r.asset_materialization.metadata for r in records}
    assert set(recorded) == {SliceRange(0, 10).key}, recorded
    assert recorded[SliceRange(0, 10).key]["rowrelay/run_failed_later"].value == result.run_id


def test_row_larger_than_broker_limit_stops_slice_and_later_slices(services, pg_database, pg_engine,
                                                                  dagster_instance, spark, name) -> None:
    h, both = _two_slices_with_an_oversized_row(services, pg_database, pg_engine, dagster_instance, name, at=7)
    first = h.run(h.table(), both, raise_on_error=False)
    assert not first.success
    text_ = failure_text(first)
    assert "watermark 7" in text_ and "column 'v'" in text_ and "max.message.bytes" in text_ and name in text_
    second = h.run(h.table(), SliceRange(10, 20).key, raise_on_error=False)
    assert not second.success and "must commit first" in failure_text(second)
    _assert_nothing_published(h, services)


def test_row_larger_than_producer_limit(services, pg_database, pg_engine, dagster_instance, spark, name) -> None:
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES ('ok'), (repeat('y', 2000000)), ('ok')"))
    h = Harness(relay_config(services, {"src": pg_database},
                             [{"source": "src", "table": f"public.{name}", "watermark": "id"}]), dagster_instance)
    (key,) = h.cut(h.table())
    result = h.run(h.table(), key, raise_on_error=False)
    assert not result.success and "watermark 2" in failure_text(result) and "column 'v'" in failure_text(result)
    _assert_nothing_published(h, services)


def test_unreachable_broker_fails_clearly(services, pg_database, pg_engine, dagster_instance, spark, name) -> None:
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES ('a'), ('b')"))
    cfg = relay_config(services, {"src": pg_database},
                       [{"source": "src", "table": f"public.{name}", "watermark": "id"}])
    dead = cfg.model_copy(update={"kafka": cfg.kafka.model_copy(update={"bootstrap_servers": "127.0.0.1:1"})})
    h = Harness(dead, dagster_instance)
    result = _run_manual_slice(h, SliceRange(0, 2).key)
    assert not result.success
    assert "cannot reach Kafka at 127.0.0.1:1" in failure_text(result)
    good = Harness(cfg, dagster_instance)
    _assert_nothing_published(good, services)


def test_broker_refusal_named_while_rows_are_still_produced(services, pg_database, pg_engine, dagster_instance,
                                                            spark, name) -> None:
    """The broker refuses row 7 while the slice's later rows are still being produced: librdkafka then refuses
    every further produce ('Erroneous state'). The error must still name the row, not the refused produce."""
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT CASE WHEN g = 7 THEN (SELECT string_agg(md5(random()::text),"
                          " '') FROM generate_series(1, 60000)) ELSE 'ok' END FROM generate_series(1, 300000) g"))
    cfg = relay_config(services, {"src": pg_database},
                       [{"source": "src", "table": f"public.{name}", "watermark": "id"}],
                       producer={"message.max.bytes": 5_000_000})
    h = Harness(cfg, dagster_instance)
    (key,) = h.cut(h.table())
    result = h.run(h.table(), key, raise_on_error=False)
    assert not result.success
    text_ = failure_text(result)
    assert "watermark 7" in text_ and "column 'v'" in text_ and "max.message.bytes" in text_, text_[-600:]
    _assert_nothing_published(h, services)
