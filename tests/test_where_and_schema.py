"""Row filters (`where:`) and the schema drift policy (`on_schema_change`), on the real stack."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from resources.config import ConfigError, parse_config
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from tests.pipeline import Harness, assert_exactly_once, read_topic, relay_config, topic_names
from tests.test_errors import failure_text

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("mark", ["", ":"], ids=["plain", "colon_in_a_string"])
def test_where_filter_publishes_exactly_the_matching_rows(services, pg_database, pg_engine, dagster_instance, spark,
                                                          name, mark) -> None:
    """`colon_in_a_string`: `where: status <> ':draft'` failed every count with SQLAlchemy's "a value is required
    for bind parameter 'draft'" (the predicate went through sa.text), as a traceback."""
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, status text, v int)"))
        conn.execute(text(f"INSERT INTO {name} (status, v) SELECT CASE WHEN g % 3 = 0 THEN :draft ELSE :final END, g "
                          "FROM generate_series(1, 900) g"), {"draft": f"{mark}draft", "final": f"{mark}final"})
    cfg = relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "id", "slice_max_rows": 200,
         "where": f"status <> '{mark}draft'", "key": ["id"]}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    keys = h.drain(table, until_hi=899)  # 900 is a draft: the last matching row is 899
    wanted = [i for i in range(1, 901) if i % 3]
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), wanted)
    # Slices are cut by matching rows (200 each), and each slice's record counts only those: the parity check too.
    rows = [h.materialization(table, k)["rows"] for k in keys]
    assert sum(rows) == len(wanted) and max(rows) == 200
    assert h.progress(table).hi == 899


def test_verify_expects_each_slice_by_the_filter_it_was_published_with(services, pg_database, pg_engine,
                                                                       dagster_instance, spark, name) -> None:
    """`rowrelay verify` applied today's `where:` and `skip_watermarks` to all history: a filter added later made
    the rows sent before it "extra" (FAIL on a correct topic), a skip removed again made its row "missing". Each
    slice's rows are now expected by the filter in its progress record."""
    from orchestration.verify import verify_table

    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, status text)"))
        conn.execute(text(f"INSERT INTO {name} (status) SELECT CASE WHEN g % 3 = 0 THEN 'draft' ELSE 'final' END "
                          "FROM generate_series(1, 30) g"))
    base = {"source": "src", "table": f"public.{name}", "watermark": "id", "slice_max_rows": 12}

    def drain(**table: object) -> tuple:
        cfg = relay_config(services, {"src": pg_database}, [{**base, **table}])
        h = Harness(cfg, dagster_instance)
        h.drain(h.table())
        return cfg, h.table()

    drain(skip_watermarks=[5])  # 1-30 without 5
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (status) SELECT CASE WHEN g % 3 = 0 THEN 'draft' ELSE 'final' END "
                          "FROM generate_series(31, 60) g"))
    cfg, table = drain(where="status <> 'draft'")  # 31-60 without the drafts; the skip removed again
    sent = [m.value["id"] for m in read_topic(services.kafka_bootstrap, table.topic_name)]
    assert sent == [i for i in range(1, 61) if i != 5 and (i <= 30 or i % 3)]
    from assets.checks import parity_result
    from assets.identity import channel_for
    from resources.exactly_once import live_records, read_progress_history
    from resources.source_database import SourceDatabaseResource

    records = [r for r in live_records(read_progress_history({"bootstrap.servers": services.kafka_bootstrap},
                                                             channel_for(table, PREFIX))) if r.hi > r.lo]
    assert sum(r.rows for r in records) == len(sent)
    for config in (cfg, relay_config(services, {"src": pg_database}, [base])):  # today's filter, or none at all
        report = verify_table(config, config.tables[0])
        assert (report.duplicates, report.missing, report.extra, report.order_violations) == (0, 0, 0, 0), report
        assert report.messages == report.source_rows == len(sent)
        # The slice_parity check recounts each slice by its own filter too (a re-run of old slices after the change).
        source = SourceDatabaseResource(url=config.sources["src"].url)
        try:
            result = parity_result(config.tables[0], source, records, {})
        finally:
            source.dispose()
        assert result.passed, result.description
        assert result.metadata["slices_checked"].value == len(records)


def test_where_that_does_not_run_is_a_clear_error_and_publishes_nothing(services, pg_database, pg_engine,
                                                                         dagster_instance, spark, name) -> None:
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, status text)"))
        conn.execute(text(f"INSERT INTO {name} (status) VALUES ('a'), ('b')"))
    with pytest.raises(ConfigError, match=r"where.*one SQL predicate"):
        parse_config({"sources": {"s": {"url": "postgresql://h/db"}}, "kafka": {"bootstrap_servers": "k:9092"},
                      "tables": [{"source": "s", "table": "t", "watermark": "id", "where": "1=1; DROP TABLE t"}]})
    cfg = relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "id", "where": "statuz = 'a'"}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    with pytest.raises(Exception, match=r"`where: statuz = 'a'` does not run on source") as err:
        h.tick(table)
    assert "statuz" in str(err.value) and name in str(err.value)
    assert h.progress(table) is None
    assert table.topic_name not in topic_names(services.kafka_bootstrap) or \
        read_topic(services.kafka_bootstrap, table.topic_name) == []

    # A source that cannot be reached is no predicate to fix: it fails as itself (transient, retried), not as a
    # SourceError that stops the table's run with no retry.
    import sqlalchemy as sa

    from resources.source_database import SourceDatabaseResource, SourceError, TableShape

    away = SourceDatabaseResource(url=pg_database.set(port=1).render_as_string(hide_password=False))
    shape = TableShape(dialect="postgresql", schema="public", name=name, columns=(), watermark="id",
                       where="status = 'a'")
    with pytest.raises(sa.exc.OperationalError) as unreachable:
        away.check_where(shape, name)
    assert not isinstance(unreachable.value, SourceError)
    away.dispose()


@pytest.mark.parametrize("policy", ["follow", "fail"])
def test_column_added_mid_stream(services, pg_database, pg_engine, dagster_instance, spark, name, tmp_path,
                                 monkeypatch, policy: str) -> None:
    import yaml

    from orchestration.cli import main

    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, label text)"))
        conn.execute(text(f"INSERT INTO {name} (label) SELECT 'r' || g FROM generate_series(1, 50) g"))
    cfg = relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "id", "on_schema_change": policy}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    (first,) = h.drain(table)
    meta = h.materialization(table, first)
    assert meta["columns"] == [["id", "BIGINT"], ["label", "TEXT"]] and len(meta["schema_fingerprint"]) == 16
    with pg_engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {name} ADD COLUMN region text"))
        conn.execute(text(f"INSERT INTO {name} (label, region) SELECT 'n' || g, 'eu' FROM generate_series(1, 10) g"))
    (key,) = h.cut(table)
    result = h.run(table, key, raise_on_error=False)
    if policy == "follow":
        assert result.success
        msgs = read_topic(services.kafka_bootstrap, table.topic_name)
        assert_exactly_once(msgs, list(range(1, 61)))
        assert "region" not in msgs[49].value and msgs[50].value["region"] == "eu"  # new rows carry it
        changed = h.materialization(table, key)
        assert changed["schema_change"] == "added region"
        assert changed["schema_fingerprint"] != meta["schema_fingerprint"]
        return
    # fail: the table stops, naming the column; nothing of the new slice is visible, progress unchanged.
    assert not result.success
    assert "added region" in failure_text(result) and "rowrelay schema accept" in failure_text(result)
    assert h.progress(table).hi == 50
    assert len(read_topic(services.kafka_bootstrap, table.topic_name)) == 50
    # A human accepts the new columns; the same slice then publishes.
    config_file = tmp_path / "rowrelay.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    monkeypatch.setenv("DAGSTER_HOME", dagster_instance.root_directory)
    assert main(["--config", str(config_file), "schema", "accept", "--table", table.table_id,
                 "--reason", "region is expected"]) == 0
    assert h.progress(table).hi == 50  # accepting does not move progress
    assert h.run(table, key).success
    msgs = read_topic(services.kafka_bootstrap, table.topic_name)
    assert_exactly_once(msgs, list(range(1, 61)))
    assert msgs[-1].value["region"] == "eu"


def test_a_changed_watermark_column_or_type_stops_the_table_until_a_reset(services, pg_database, pg_engine,
                                                                          dagster_instance, spark, name, tmp_path,
                                                                          monkeypatch, capsys) -> None:
    """Committed progress is a value of one watermark column. Switched to another column (`watermark: seq`), a
    relay of 50 ids took "50" as a seq value and sent the history again, and switched back it skipped new rows for
    good; a zone-less timestamp column retyped to timestamptz read its progress as another instant. Each is now
    refused before anything is cut or sent, until the table is put back or `rowrelay reset` says where it stands."""
    import yaml

    from assets.identity import partitions_for
    from assets.lag import measure_lag
    from orchestration.cli import main
    from orchestration.verify import verify_table
    from resources.exactly_once import WatermarkChanged
    from resources.slices import SliceRange
    from resources.source_database import SourceDatabaseResource

    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, seq bigint NOT NULL, "
                          "created_at timestamp NOT NULL)"))
        conn.execute(text(f"INSERT INTO {name} (seq, created_at) SELECT 1000 + g, TIMESTAMP '2026-11-27 10:00' "
                          "+ g * INTERVAL '1 second' FROM generate_series(1, 50) g"))
    base = {"source": "src", "table": f"public.{name}", "key": ["id"]}
    by_id = relay_config(services, {"src": pg_database}, [{**base, "watermark": "id"}])
    h = Harness(by_id, dagster_instance)
    table = h.table()
    h.drain(table)
    assert h.progress(table).watermark == "id" and h.progress(table).watermark_kind == "integer"
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (seq, created_at) SELECT 1000 + g, TIMESTAMP '2026-11-27 10:00' "
                          "+ g * INTERVAL '1 second' FROM generate_series(51, 80) g"))

    by_seq = relay_config(services, {"src": pg_database}, [{**base, "watermark": "seq"}])
    hs = Harness(by_seq, dagster_instance)
    # The sensor (and `rowrelay backfill`, which cuts the same way) refuses before cutting, naming both columns.
    with pytest.raises(Exception, match=r"committed progress \(50\) is a value of watermark column 'id'.*now 'seq'"):
        hs.tick(table)
    # A run of a range in the new column (a partition added by hand) is refused by the publisher after its fence.
    key = SliceRange(50, 1080).key
    dagster_instance.add_dynamic_partitions(partitions_for(table).name, [key])
    result = hs.run(table, key, raise_on_error=False)
    assert not result.success and "watermark column 'id'" in failure_text(result)
    with pytest.raises(WatermarkChanged, match="now 'seq'"):
        verify_table(by_seq, by_seq.tables[0])
    with pytest.raises(WatermarkChanged, match="now 'seq'"):  # the lag check and `status`: no lag in another sense
        measure_lag(SourceDatabaseResource(url=by_seq.sources["src"].url), by_seq.tables[0], h.progress(table), 0)
    assert h.progress(table).hi == 50 and len(read_topic(services.kafka_bootstrap, table.topic_name)) == 50
    dagster_instance.delete_dynamic_partition(partitions_for(table).name, key)

    # Put back, the table goes on in `id` as before.
    h.drain(table)
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), list(range(1, 81)))
    # Moved to seq deliberately: the highest seq already sent is 1080. The rows above it then go once.
    config_file = tmp_path / "rowrelay.yaml"
    config_file.write_text(yaml.safe_dump(by_seq.model_dump(mode="json", exclude_none=True)))
    monkeypatch.setenv("DAGSTER_HOME", dagster_instance.root_directory)
    assert main(["--config", str(config_file), "reset", "--table", table.table_id, "--after", "1080",
                 "--reason", "watermark is seq now"]) == 0
    assert (hs.progress(table).watermark, hs.progress(table).hi) == ("seq", 1080)
    said = capsys.readouterr().out  # the id partitions stay as the old watermark's history, none cut at 1080
    assert "progress reset to 1080 in watermark 'seq' (integer) (was 80); 0 partition(s) of the previous" in said
    assert len(dagster_instance.get_dynamic_partitions(partitions_for(table).name)) == 2
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (seq, created_at) SELECT 1000 + g, TIMESTAMP '2026-11-27 10:00' "
                          "+ g * INTERVAL '1 second' FROM generate_series(81, 90) g"))
    # Drained to the seq table's highest seq (1090): the id table's max (90) is below progress (1080), so draining
    # `table` returned after one tick, which cut nothing while another test's transaction was open (a CI flake).
    hs.drain(hs.table())
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), list(range(1, 91)))
    report = verify_table(by_seq, by_seq.tables[0])
    assert (report.duplicates, report.missing, report.extra) == (0, 0, 0), report
    # ... and switching back to `id` now is refused the same way (the progress is a seq value).
    with pytest.raises(Exception, match=r"is a value of watermark column 'seq'.*now 'id'"):
        Harness(by_id, dagster_instance).tick(table)

    # A zone-less timestamp watermark retyped to timestamptz (in a database whose zone is not UTC, its values
    # become other instants): refused until reset, whatever the config says.
    ts_name = f"{name}_ts"
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {ts_name} (id bigserial PRIMARY KEY, created_at timestamp NOT NULL)"))
        conn.execute(text(f"INSERT INTO {ts_name} (created_at) SELECT TIMESTAMP '2026-11-27 10:00' "
                          "+ g * INTERVAL '1 second' FROM generate_series(1, 20) g"))
    by_time = relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{ts_name}", "watermark": "created_at", "tie_break": "id"}])
    ht = Harness(by_time, dagster_instance)
    ts_table = ht.table()
    ht.drain(ts_table)
    assert ht.progress(ts_table).watermark_kind == "timestamp"
    with pg_engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {ts_name} ALTER COLUMN created_at TYPE timestamptz"))
        conn.execute(text(f"INSERT INTO {ts_name} (created_at) VALUES (now())"))
    from orchestration import cutting as sensors

    sensors._SHAPES.clear()  # the sensor's reflection is cached for a minute per process
    with pytest.raises(Exception, match="was a timestamp without time zone, but it is now a timestamp with time zone"):
        ht.tick(ts_table)
    assert ht.progress(ts_table).hi == SliceRange.from_key(ht.progress(ts_table).slice).hi  # not moved
    assert len(read_topic(services.kafka_bootstrap, ts_table.topic_name)) == 20
