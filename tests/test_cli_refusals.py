"""The CLI refuses (and reports) where the publisher would, and a reset over empty progress tells the truth about
the partitions Dagster recorded as committed."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from sqlalchemy import text

from orchestration.cli import main
from resources.config import RelayConfig, TableConfig
from resources.exactly_once import read_committed_progress
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.slices import SliceRange
from tests.conftest import partition_ends
from tests.pipeline import Harness, read_topic, relay_config

pytestmark = pytest.mark.integration


def serial_table(engine, name: str, rows: int, start: int = 1) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE IF NOT EXISTS {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' || g FROM generate_series({start}, "
                          f"{start + rows - 1}) g"))


def config_file_for(cfg: RelayConfig | dict[str, Any], path: Path) -> str:
    import yaml

    data = cfg if isinstance(cfg, dict) else cfg.model_dump(mode="json", exclude_none=True)
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _ten_row_slices(services, pg_database, name: str, **spec: Any) -> RelayConfig:
    return relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}",
                                                          "watermark": "id", "slice_max_rows": 10,
                                                          "start_after": 0, **spec}])


def lose_progress_and_messages(services, table: TableConfig) -> None:
    """The table's progress topic deleted and its data topic's messages deleted (as retention does): Kafka shows
    nothing of the table."""
    from assets.identity import channel_for

    channel = channel_for(table, PREFIX)
    admin = AdminClient({"bootstrap.servers": services.kafka_bootstrap})
    admin.delete_topics([channel.progress_topic])[channel.progress_topic].result(timeout=30)
    end = partition_ends(services.kafka_bootstrap, table.topic_name)[1]
    for fut in admin.delete_records([TopicPartition(table.topic_name, 0, end)]).values():  # as retention does
        fut.result(timeout=30)
    conf = {"bootstrap.servers": services.kafka_bootstrap}
    deadline = time.monotonic() + 30
    while read_committed_progress(conf, channel) is not None:
        assert time.monotonic() < deadline, "the progress topic never went"
        time.sleep(0.5)


def lag_check_result(h: Harness, table: TableConfig, instance) -> Any:
    """The table's lag asset check, evaluated once on its own."""
    from dagster import build_asset_check_context

    from assets.checks import LAG_CHECK, build_table_checks
    from resources.identity import source_resource_key

    lag = next(c for c in build_table_checks(table, PREFIX) if LAG_CHECK in {k.name for k in c.check_keys})
    context = build_asset_check_context(
        resources={source_resource_key(table.source): h.defs.resources[source_resource_key(table.source)],
                   "kafka_io_manager": h.defs.resources["kafka_io_manager"]}, instance=instance)
    with context.op_execution_context:  # its resources are context managers: opened (and closed) here
        return lag(context)


def _progress_lost_over_30_committed(services, pg_database, pg_engine, dagster_home: Path, name: str,
                                     tmp_path: Path, monkeypatch) -> tuple[RelayConfig, str, tuple[str, str]]:
    """30 rows backfilled in 3 slices (Dagster records them as committed), then the progress topic deleted and the
    data topic's messages deleted (as retention does): Kafka shows nothing of the table. Returns the config, its
    file and the parts of the refusal (the run's message and its remedy) every command must show."""

    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    serial_table(pg_engine, name, 30)
    cfg = _ten_row_slices(services, pg_database, name)
    table = cfg.tables[0]
    config_file = config_file_for(cfg, tmp_path / "c.yaml")
    assert main(["--config", config_file, "backfill", "--table", table.table_id]) == 0
    lose_progress_and_messages(services, table)
    refusal = ("slices of this table recorded as committed reach watermark 30 (Dagster's materializations)",
               f"rowrelay reset --table {table.table_id} --after 30")
    return cfg, config_file, refusal


def _latest_materializations(instance, table) -> dict[str, Any]:
    """Each partition's latest materialization."""
    from assets.identity import asset_key

    latest: dict[str, Any] = {}
    for r in instance.fetch_materializations(asset_key(table), limit=1000).records:  # newest first
        m = r.asset_materialization
        if m is not None and m.partition not in latest:
            latest[m.partition] = m
    return latest


def test_a_reset_after_a_prefix_change_leaves_the_slices_dagster_recorded_as_committed(
        services, pg_database, pg_engine, dagster_home, dagster_instance, spark, name, tmp_path, capsys,
        monkeypatch) -> None:
    """30 rows backfilled in 3 slices, a 4th slice cut but never run; then `transactional_id_prefix` changed: the
    backfill refuses and the runbook's `rowrelay reset --after W` under the new prefix follows. Its progress was
    empty, so the reset took every partition at or below W for uncommitted and materialized the 3 published
    slices as "never sent: skipped by rowrelay reset" (`published_up_to: 0`): false, their rows are in the topic.
    It now goes by Dagster's materializations: the committed slices stay as they are, only the one never run is
    settled, and the output says which is which."""
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    serial_table(pg_engine, name, 30)
    cfg = _ten_row_slices(services, pg_database, name)
    table = cfg.tables[0]
    assert main(["--config", config_file_for(cfg, tmp_path / "p1.yaml"), "backfill", "--table", table.table_id]) == 0
    serial_table(pg_engine, name, 5, start=31)
    h = Harness(cfg, dagster_instance)
    assert h.cut(table) == [SliceRange(30, 35).key]  # cut, never run
    committed = [SliceRange(0, 10).key, SliceRange(10, 20).key, SliceRange(20, 30).key]
    before = _latest_materializations(dagster_instance, table)
    assert set(committed) <= set(before) and SliceRange(30, 35).key not in before

    data = cfg.model_dump(mode="json", exclude_none=True)
    data["kafka"]["transactional_id_prefix"] = "p2"
    moved = config_file_for(data, tmp_path / "p2.yaml")
    capsys.readouterr()
    assert main(["--config", moved, "backfill", "--table", table.table_id]) == 1
    assert f"rowrelay reset --table {table.table_id} --after 30" in capsys.readouterr().err
    # Past the remedy's 30, on purpose: the slice cut and never run is skipped.
    assert main(["--config", moved, "reset", "--table", table.table_id, "--after", "35", "--reason",
                 "prefix renamed"]) == 0
    out = capsys.readouterr().out
    assert "progress reset to 35 (was empty); 0 partition(s) above it deleted" in out, out
    assert "3 partition(s) at or below it that Dagster records as committed left as they are" in out, out
    assert "1 partition(s) at or below it that Dagster records no materialization of materialized as settled" \
        in out, out
    assert "uncommitted partition(s)" not in out, out

    after = _latest_materializations(dagster_instance, table)
    for key in committed:  # still the run's own record, not a reset's "never sent"
        assert after[key].description == before[key].description, after[key].description
        assert "rowrelay/published_up_to" not in after[key].metadata, key
    settled = after[SliceRange(30, 35).key]
    assert "never sent: skipped by rowrelay reset after 35" in (settled.description or ""), settled.description
    assert settled.metadata["rowrelay/published_up_to"].value == 30

    # Under the new prefix, only the rows after the reset are sent.
    serial_table(pg_engine, name, 5, start=36)
    assert main(["--config", moved, "backfill", "--table", table.table_id]) == 0
    assert sorted(m.value["id"] for m in read_topic(services.kafka_bootstrap, table.topic_name)) == [
        *range(1, 31), *range(36, 41)]


def test_progress_lost_with_committed_slices_recorded_is_refused_by_the_dry_run_status_and_lag_check(
        services, pg_database, pg_engine, dagster_home, dagster_instance, spark, name, tmp_path, capsys,
        monkeypatch) -> None:
    """The progress topic deleted after the data topic's messages expired: Kafka shows nothing of the table, but
    Dagster records its committed slices up to 30, and the real backfill refuses on that record. The dry run
    answered "3 slice(s) would be published" (rc 0), `status` a lag "since_first_run" and the lag check a mere
    lag: they went by Kafka alone. They now refuse with the run's message and remedy."""
    from dagster import AssetCheckSeverity


    cfg, config_file, refusal = _progress_lost_over_30_committed(services, pg_database, pg_engine, dagster_home,
                                                                 name, tmp_path, monkeypatch)
    table = cfg.tables[0]
    partitions = f"{table.dagster_name}__slices"
    keys = dagster_instance.get_dynamic_partitions(partitions)
    capsys.readouterr()

    for dry in (["--dry-run"], []):  # the dry run refuses where the backfill does, and neither adds a partition
        assert main(["--config", config_file, "backfill", "--table", table.table_id, *dry]) == 1, dry
        out, err = capsys.readouterr()
        assert all(part in err for part in refusal), (dry, out, err)
        assert "would be published" not in out, out
        assert dagster_instance.get_dynamic_partitions(partitions) == keys

    assert main(["--config", config_file, "status", "--table", table.table_id, "--json"]) == 1
    out, err = capsys.readouterr()
    assert f"rowrelay: {table.table_id} no status: " in err and all(part in err for part in refusal), (out, err)
    assert "since_first_run" not in out, out

    h = Harness(cfg, dagster_instance)
    result = lag_check_result(h, table, dagster_instance)
    assert not result.passed and result.severity == AssetCheckSeverity.ERROR, result.description
    assert all(part in (result.description or "") for part in refusal), result.description
    assert result.metadata["lag_measured_as"].value == "progress_missing", json.dumps(
        {k: str(v) for k, v in result.metadata.items()})
    assert read_topic(services.kafka_bootstrap, table.topic_name, timeout=2) == []

    # The remedy: the reset over empty progress leaves the slices Dagster recorded as committed as they are.
    before = _latest_materializations(dagster_instance, table)
    assert main(["--config", config_file, "reset", "--table", table.table_id, "--after", "30", "--reason",
                 "progress topic lost"]) == 0
    out = capsys.readouterr().out
    assert "progress reset to 30 (was empty); 0 partition(s) above it deleted; 3 partition(s) at or below it that " \
           "Dagster records as committed left as they are" in out and "never sent" not in out, out
    assert _latest_materializations(dagster_instance, table) == before
    assert main(["--config", config_file, "status", "--table", table.table_id, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["lag_rows"] == 0


def test_a_dry_run_refuses_a_topic_moved_back_and_the_backfill_adds_no_partition_first(
        services, pg_database, pg_engine, dagster_home, dagster_instance, spark, name, tmp_path, capsys,
        monkeypatch) -> None:
    """`topic:` A -> B -> back to A under one prefix: the publisher refuses the move back (two deployments sharing
    the progress: ProgressShared). Its dry run said "1 new slice would be cut" (rc 0), and the backfill added the
    new partition before its run refused. Both now refuse before anything is cut."""
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    serial_table(pg_engine, name, 20)
    a = _ten_row_slices(services, pg_database, name, topic=f"{name}_a")
    b = _ten_row_slices(services, pg_database, name, topic=f"{name}_b")
    table = a.tables[0]
    in_a, in_b = config_file_for(a, tmp_path / "a.yaml"), config_file_for(b, tmp_path / "b.yaml")
    assert main(["--config", in_a, "backfill", "--table", table.table_id]) == 0
    serial_table(pg_engine, name, 10, start=21)
    assert main(["--config", in_b, "backfill", "--table", table.table_id]) == 0
    serial_table(pg_engine, name, 5, start=31)
    partitions = f"{table.dagster_name}__slices"
    keys = dagster_instance.get_dynamic_partitions(partitions)
    capsys.readouterr()

    for dry in (["--dry-run"], []):
        assert main(["--config", in_a, "backfill", "--table", table.table_id, *dry]) == 1, dry
        out, err = capsys.readouterr()
        assert f"its committed progress was last written for topic {name}_b" in err \
            and f"after earlier slices of this run's topic {name}_a" in err \
            and f"rowrelay reset --table {table.table_id} --after 30" in err, (dry, out, err)
        assert "would be cut" not in out, out
        assert dagster_instance.get_dynamic_partitions(partitions) == keys, dry
    assert sorted(m.value["id"] for m in read_topic(services.kafka_bootstrap, f"{name}_a")) == list(range(1, 21))
    # The move back meant: the remedy, then the backfill continues in A.
    assert main(["--config", in_a, "reset", "--table", table.table_id, "--after", "30", "--reason",
                 "back to A"]) == 0
    assert main(["--config", in_a, "backfill", "--table", table.table_id]) == 0
    assert sorted(m.value["id"] for m in read_topic(services.kafka_bootstrap, f"{name}_a")) == [
        *range(1, 21), *range(31, 36)]


def test_reset_partitions_over_empty_progress_settle_only_what_dagster_never_recorded() -> None:
    """`reset_partitions` with `recorded` (the partitions Dagster holds a materialization of, asked where the reset
    replaced empty progress): those at or below W are left as they are, the others settled as before."""
    from orchestration.reset import reset_partitions

    ranges = {r.key: r for r in (SliceRange(0, 10), SliceRange(10, 20), SliceRange(20, 30), SliceRange(30, 35))}
    committed = {SliceRange(0, 10).key: 10, SliceRange(10, 20).key: 20, SliceRange(20, 30).key: 30}
    plan = reset_partitions(ranges, 35, 0, moved=False, recorded=committed)
    assert (plan.dropped, plan.settled, plan.recorded) == ([], [SliceRange(30, 35).key], list(committed))
    # Without a record (or with progress that says where the table stands), every one below W above it is settled.
    assert reset_partitions(ranges, 35, 0, moved=False).settled == list(ranges)
    straddling = reset_partitions(ranges, 25, 0, moved=False, recorded=committed)
    assert straddling.kept_below == {SliceRange(20, 30).key: SliceRange(20, 25)}
    assert straddling.settled == [] and straddling.recorded == [SliceRange(0, 10).key, SliceRange(10, 20).key]


def test_progress_lost_with_committed_slices_recorded_is_refused_by_the_lag_sensor(
        services, pg_database, pg_engine, dagster_home, dagster_instance, spark, name, tmp_path, monkeypatch) -> None:
    """The lag sensor between runs went by Kafka alone: over a lost progress topic whose data topic's messages
    expired it recorded a passing lag ("30 row(s) waiting ... since_first_run") while every run refuses. It now
    records the run's refusal, an ERROR with its remedy."""
    from dagster import AssetCheckKey, AssetCheckSeverity, build_sensor_context

    from assets.checks import LAG_CHECK
    from assets.identity import asset_key
    from orchestration.factory import lag_sensor_name

    cfg, _, refusal = _progress_lost_over_30_committed(services, pg_database, pg_engine, dagster_home, name,
                                                       tmp_path, monkeypatch)
    table = cfg.tables[0]
    h = Harness(cfg, dagster_instance)
    sensor = h.defs.resolve_sensor_def(lag_sensor_name(table))
    cursor: str | None = None
    # Two ticks, as the daemon's: the process's long-lived progress reader (read by the backfill here) saw the
    # topic before it went, and its first read after fails (a WARN "could not be evaluated", not this test's
    # subject); the next reads afresh and finds the progress empty.
    for _ in range(2):
        with build_sensor_context(cursor=cursor, resources=h.defs.resources, definitions=h.defs,
                                  sensor_name=sensor.name, instance=dagster_instance) as ctx:
            data = sensor.evaluate_tick(ctx)
        cursor, note = data.cursor, data.skip_message or ""
    assert note.startswith("lag recorded") and all(part in note for part in refusal), note
    record = dagster_instance.get_latest_asset_check_evaluation_record(AssetCheckKey(asset_key(table), LAG_CHECK))
    assert record is not None
    red = record.evaluation
    assert not red.passed and red.severity == AssetCheckSeverity.ERROR, red.description
    assert all(part in (red.description or "") for part in refusal), red.description
    assert red.metadata["lag_measured_as"].value == "progress_missing", red.metadata


def test_progress_lost_with_committed_slices_recorded_is_refused_by_verify(
        services, pg_database, pg_engine, dagster_home, dagster_instance, spark, name, tmp_path, capsys,
        monkeypatch) -> None:
    """`verify` over a lost progress topic whose data topic's messages expired compared nothing (progress empty:
    from start_after to start_after) and said "0 source rows, 0 messages ... [OK]", rc 0, while every run refuses.
    It now refuses with the run's message and remedy, rc 1."""
    cfg, config_file, refusal = _progress_lost_over_30_committed(services, pg_database, pg_engine, dagster_home,
                                                                 name, tmp_path, monkeypatch)
    table = cfg.tables[0]
    capsys.readouterr()
    for json_out in ([], ["--json"]):
        assert main(["--config", config_file, "verify", "--table", table.table_id, *json_out]) == 1, json_out
        out, err = capsys.readouterr()
        assert f"rowrelay: {table.table_id} not verified: " in err and all(part in err for part in refusal), (out, err)
        assert "[OK]" not in out and '"ok": true' not in out, out
