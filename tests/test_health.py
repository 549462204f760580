"""Asset checks per table asset on the real stack: slice_parity (in each run, and when re-evaluated after the
source or the progress record changed) and lag (the lag sensor, between runs)."""

from __future__ import annotations

import pytest
from dagster import AssetCheckKey, AssetCheckSeverity, build_sensor_context
from sqlalchemy import text

from assets.checks import LAG_CHECK, PARITY_CHECK, evaluate_parity
from assets.identity import asset_key, channel_for
from orchestration.factory import lag_sensor_name
from resources.exactly_once import ProgressRecord, SlicePublisher
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.source_database import SourceDatabaseResource
from tests.pipeline import Harness, drained_then_moved_to_another_prefix, relay_config

pytestmark = pytest.mark.integration


def _latest(instance, table, check: str):  # -> AssetCheckEvaluation | None
    record = instance.get_latest_asset_check_evaluation_record(AssetCheckKey(asset_key(table), check))
    return record.evaluation if record is not None else None


def test_slice_parity_passes_in_runs_and_fails_with_both_figures(services, pg_database, pg_engine, dagster_instance,
                                                                 spark, name) -> None:
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' || g FROM generate_series(1, 300) g"))
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}", "watermark": "id",
                                                         "slice_max_rows": 100, "skip_watermarks": [150]}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    h.drain(table, until_hi=300)

    # Evaluated in the run, after the publish: every slice of the run agrees (the skipped row is not expected),
    # each read back from Kafka.
    in_run = _latest(dagster_instance, table, PARITY_CHECK)
    assert in_run is not None and in_run.passed, in_run
    assert in_run.metadata["slices_checked"].value >= 1
    assert in_run.metadata["slices_read_back"].value == in_run.metadata["slices_checked"].value
    assert h.materialization(table, "000000000100-000000000200")["rows"] == 99

    source = SourceDatabaseResource(url=cfg.sources["src"].url)
    conf = {"bootstrap.servers": services.kafka_bootstrap}

    def evaluate(keys: list[str] | None = None):  # run alone (e.g. from the UI): the last committed slice, (200, 300]
        return evaluate_parity(table, source, conf, keys, PREFIX)

    assert evaluate().passed
    assert evaluate(["000000000100-000000000200", "000000000200-000000000300"]).metadata["slices_read_back"].value == 2
    # A run's slice with no committed record is not passed over: the check says it could not look.
    missing = evaluate(["000000000300-000000000400"])
    assert not missing.passed and missing.severity == AssetCheckSeverity.WARN
    assert "no committed progress record found for slice(s) 000000000300-000000000400" in missing.description

    # Forged progress records for the slice, each disagreeing with the messages in Kafka (before, the check
    # compared the record's checksum with the same checksum kept in the slice's materialization: it could not
    # fail on anything Kafka holds).
    channel = channel_for(table, PREFIX)
    real = h.progress(table)
    assert real is not None and (real.lo, real.hi) == (200, 300)
    (part, (first, last)), = real.offsets.items()

    def forge(**changes) -> None:
        publisher = SlicePublisher(channel, conf)
        try:
            publisher.publish_progress_only(ProgressRecord(**{**real.__dict__, **changes}))
        finally:
            publisher.close()

    forge(checksum="f" * 64)  # the messages are not the ones the record describes
    result = evaluate()
    assert not result.passed and result.severity == AssetCheckSeverity.ERROR
    assert result.metadata["checksum_progress_record"].value == "f" * 64
    assert result.metadata["checksum_in_kafka"].value == real.checksum
    assert "checksum differ" in result.description
    forge(offsets={part: [first + 1, last]})  # a message of the slice missing from Kafka
    result = evaluate()
    assert not result.passed and result.severity == AssetCheckSeverity.ERROR
    assert "slice 000000000200-000000000300: messages differ: 100 in the progress record vs 99 messages in Kafka" \
        in result.description
    forge()  # the record as published: passes again
    assert evaluate().passed

    # A row of the slice deleted after publish: the recount disagrees with the record; both figures shown.
    with pg_engine.begin() as conn:
        conn.execute(text(f"DELETE FROM {name} WHERE id = 250"))
    result = evaluate()
    assert not result.passed and result.severity == AssetCheckSeverity.ERROR
    assert (result.metadata["rows_progress_record"].value, result.metadata["rows_source_now"].value) == (100, 99)
    assert "100 in the progress record vs 99 in the source now" in result.description
    source.dispose()


def test_lag_check_warns_while_rows_wait_and_passes_when_caught_up(services, pg_database, pg_engine,
                                                                    dagster_instance, spark, name) -> None:
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text, "
                          "created_at timestamptz NOT NULL DEFAULT now())"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' || g FROM generate_series(1, 100) g"))
    cfg = relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "id", "slice_max_rows": 1000,
         "lag_timestamp_column": "created_at", "warn_lag_seconds": 30, "error_lag_seconds": 3600}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    h.drain(table, until_hi=100)
    in_run = _latest(dagster_instance, table, LAG_CHECK)  # evaluated in the run too
    assert in_run is not None and in_run.passed
    sensor = h.defs.resolve_sensor_def(lag_sensor_name(table))
    cursor: list[str | None] = [None]

    def tick() -> str:
        with build_sensor_context(cursor=cursor[0], resources=h.defs.resources, definitions=h.defs,
                                  sensor_name=sensor.name, instance=dagster_instance) as ctx:
            data = sensor.evaluate_tick(ctx)
        cursor[0] = data.cursor
        return data.skip_message or ""

    assert "lag recorded" in tick()
    assert _latest(dagster_instance, table, LAG_CHECK).passed

    # The table's sensor is not ticking while a writer inserts: rows wait, the oldest for a minute.
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v, created_at) SELECT 'w', now() - interval '60 seconds' "
                          "FROM generate_series(1, 25) g"))
    assert "lag recorded" in tick()
    warned = _latest(dagster_instance, table, LAG_CHECK)
    assert not warned.passed and warned.severity == AssetCheckSeverity.WARN
    assert warned.metadata["lag_rows"].value == 25 and 59 <= warned.metadata["lag_seconds"].value < 120
    assert warned.metadata["lag_measured_as"].value == "oldest_unpublished_row"
    # Unchanged outcome: not recorded again (bounded rate), the event log is not flooded.
    assert "lag unchanged" in tick()
    # Waiting past error_lag_seconds: ERROR.
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v, created_at) VALUES ('old', now() - interval '2 hours')"))
    assert "lag recorded" in tick()
    assert _latest(dagster_instance, table, LAG_CHECK).severity == AssetCheckSeverity.ERROR

    # The relay resumes and catches up: the check passes again.
    h.drain(table, until_hi=126)
    assert "lag recorded" in tick()
    recovered = _latest(dagster_instance, table, LAG_CHECK)
    assert recovered.passed and recovered.metadata["lag_rows"].value == 0


def test_lag_goes_red_for_a_table_that_never_committed_and_warns_when_unmeasurable(
        services, pg_database, pg_engine, dagster_instance, spark, name) -> None:
    """Every run of a table failing before its first commit (a bad first row) left `lag` green: "rows waiting, lag
    None s (unknown)". Its lag is now the time since the table's first run (a lower bound of the rows' wait). And a
    lag sensor that could not measure (the table renamed away) only logged it, leaving the last outcome standing: it
    now records a WARN saying why."""
    import time

    from dagster import DagsterRunStatus
    from dagster._core.test_utils import create_run_for_test  # Dagster's own test helper: a run in a given state

    from orchestration.factory import job_name

    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' FROM generate_series(1, 10) g"))
    cfg = relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "id", "warn_lag_seconds": 1,
         "error_lag_seconds": 2}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    sensor = h.defs.resolve_sensor_def(lag_sensor_name(table))

    def tick() -> str:
        with build_sensor_context(resources=h.defs.resources, definitions=h.defs, sensor_name=sensor.name,
                                  instance=dagster_instance) as ctx:
            return sensor.evaluate_tick(ctx).skip_message or ""

    tick()  # no run yet: the rows' age is unknown, said so
    assert _latest(dagster_instance, table, LAG_CHECK).metadata["lag_measured_as"].value == "unknown"
    create_run_for_test(dagster_instance, job_name=job_name(table), status=DagsterRunStatus.FAILURE)
    time.sleep(2.5)
    assert "lag recorded" in tick()
    red = _latest(dagster_instance, table, LAG_CHECK)
    assert not red.passed and red.severity == AssetCheckSeverity.ERROR, red.description
    assert red.metadata["lag_measured_as"].value == "since_first_run" and red.metadata["lag_rows"].value == 10

    with pg_engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {name} RENAME TO {name}_gone"))
    assert "lag recorded" in tick()
    unmeasured = _latest(dagster_instance, table, LAG_CHECK)
    assert not unmeasured.passed and unmeasured.severity == AssetCheckSeverity.WARN
    assert "lag could not be evaluated" in unmeasured.description and name in unmeasured.description
    # Not measured after a measured WARN is a change of its own: recorded at once, not 5 minutes later.
    from assets.identity import channel_for
    from orchestration.factory import lag_tick
    from resources.identity import source_resource_key

    _, note = lag_tick(dagster_instance, table, channel_for(table, PREFIX),
                       h.defs.resources[source_resource_key(table.source)],
                       {"bootstrap.servers": services.kafka_bootstrap}, {"outcome": "WARN", "at": time.time()},
                       time.time())
    assert note.startswith("lag recorded"), note


def test_a_table_renamed_away_fails_the_sensor_tick_with_the_table_checks_message(
        services, pg_database, pg_engine, dagster_instance, spark, name) -> None:
    """The slice sensor keeps the table's reflected shape for a minute: a table renamed or dropped meanwhile failed
    its ticks with the driver's UndefinedTable error until then. The tick now reflects afresh and says what to fix."""
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES ('a')"))
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}",
                                                         "watermark": "id"}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    h.drain(table, until_hi=1)  # the shape is cached now
    with pg_engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {name} RENAME TO {name}_old"))
    with pytest.raises(Exception) as failed:
        h.tick(table)
    assert f"table '{name}' not found" in str(failed.value) and "check `table:` in rowrelay.yaml" in str(failed.value)


def test_progress_missing_over_published_rows_is_an_error_in_status_and_the_lag_check(
        services, pg_database, pg_engine, dagster_home, dagster_instance, spark, name, tmp_path, capsys,
        monkeypatch) -> None:
    """A table whose rows are in its topic while its committed progress reads empty (here a new
    transactional_id_prefix; a deleted progress topic looks the same) is refused by every run and by `verify`, until
    a human resets it. `status` showed it as "rows wait, nothing committed yet" and exited 0, and the lag check
    measured a lag, hiding why nothing moved. Both now say what happened and how to resolve it: `status` exits 1,
    the lag check is an ERROR."""
    import time

    import yaml

    from orchestration.cli import main
    from orchestration.factory import lag_tick
    from resources.config import parse_config
    from resources.identity import source_resource_key

    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' || g FROM generate_series(1, 5) g"))
    _, table, data = drained_then_moved_to_another_prefix(services, pg_database, dagster_instance, name, 5)
    moved = parse_config(data)
    path = tmp_path / "moved.yaml"
    path.write_text(yaml.safe_dump(data))
    capsys.readouterr()

    assert main(["--config", str(path), "status", "--table", table.table_id]) == 1
    err = capsys.readouterr().err
    assert f"rowrelay: {table.table_id} no status: " in err and "committed progress is empty" in err \
        and "already holds this table's messages up to watermark 5" in err \
        and f"rowrelay reset --table {table.table_id} --after 5" in err, err

    h = Harness(moved, dagster_instance)
    _, note = lag_tick(dagster_instance, moved.tables[0], channel_for(moved.tables[0], "other"),
                       h.defs.resources[source_resource_key(table.source)],
                       {"bootstrap.servers": services.kafka_bootstrap}, {}, time.time())
    assert note.startswith("lag recorded"), note
    red = _latest(dagster_instance, table, LAG_CHECK)
    assert not red.passed and red.severity == AssetCheckSeverity.ERROR, red.description
    assert "committed progress is empty" in red.description and "rowrelay reset" in red.description, red.description
    assert red.metadata["lag_measured_as"].value == "progress_missing"
