"""`rowrelay status`, `replay` and the backfill progress bar on the real stack."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from sqlalchemy import text

from orchestration.cli import main
from orchestration.verify import verify_table
from resources.config import RelayConfig
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from tests.pipeline import ROOT, Harness, read_topic, relay_config

pytestmark = pytest.mark.integration


def _config_file(cfg: RelayConfig, tmp_path: Path) -> str:
    path = tmp_path / "rowrelay.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    return str(path)


def test_status_json_matches_the_real_lag(services, pg_database, pg_engine, dagster_home, dagster_instance, spark,
                                          name, tmp_path, capsys, monkeypatch) -> None:
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text, "
                          "created_at timestamptz NOT NULL DEFAULT now())"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' || g FROM generate_series(1, 200) g"))
    cfg = relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "id", "slice_max_rows": 100,
         "lag_timestamp_column": "created_at"}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    h.drain(table, until_hi=200)
    config_file = _config_file(cfg, tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))

    assert main(["--config", config_file, "status", "--table", table.table_id, "--json"]) == 0
    (caught_up,) = json.loads(capsys.readouterr().out)
    assert (caught_up["committed_hi"], caught_up["source_max"], caught_up["lag_rows"]) == (200, 200, 0)
    assert caught_up["lag_basis"] == "caught_up" and caught_up["active_runs"] == 0
    # A Materialize from the UI runs `__ASSET_JOB`: counted like a run of the table's own job (it was left out).
    from dagster import DagsterRunStatus
    from dagster._core.test_utils import create_run_for_test  # Dagster's own test helper: a run in a given state

    from assets.identity import asset_key

    ui_run = create_run_for_test(dagster_instance, job_name="__ASSET_JOB", status=DagsterRunStatus.STARTED,
                                 asset_selection=frozenset({asset_key(table)}))
    assert main(["--config", config_file, "status", "--table", table.table_id, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["active_runs"] == 1
    dagster_instance.report_run_canceled(ui_run)

    # 37 rows wait above committed progress, the oldest written 120 s ago (the database's own clock).
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v, created_at) SELECT 'w' || g, now() - interval '120 seconds' "
                          "FROM generate_series(1, 37) g"))
    assert main(["--config", config_file, "status", "--table", table.table_id, "--json"]) == 0
    (waiting,) = json.loads(capsys.readouterr().out)
    assert (waiting["committed_hi"], waiting["source_max"], waiting["lag_rows"]) == (200, 237, 37)
    assert waiting["lag_basis"] == "oldest_unpublished_row"
    assert 119 <= waiting["lag_seconds"] < 180
    assert waiting["last_commit_at"] == h.progress(table).committed_at

    # Without a timestamp column the seconds are the time since the last commit, and the output says so.
    no_ts = cfg.model_copy(update={"tables": [table.model_copy(update={"lag_timestamp_column": None})]})
    monkeypatch.delenv("DAGSTER_HOME")
    assert main(["--config", _config_file(no_ts, tmp_path), "status"]) == 0
    out = capsys.readouterr().out
    assert table.table_id in out and "time since last commit" in out and "37" in out

    # A timestamp column that does not exist is named, with the key to fix.
    bad = cfg.model_copy(update={"tables": [table.model_copy(update={"lag_timestamp_column": "nope"})]})
    assert main(["--config", _config_file(bad, tmp_path), "status", "--json"]) == 1
    assert "lag_timestamp_column 'nope' does not exist" in capsys.readouterr().err
    assert main(["--config", config_file, "status", "--table", "src.public.missing"]) == 2
    assert "no configured table 'src.public.missing'" in capsys.readouterr().err


def _create_topic(bootstrap: str, topic: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    deadline = time.monotonic() + 30
    while topic not in admin.list_topics(timeout=10).topics and time.monotonic() < deadline:
        time.sleep(0.2)


def test_replay_republishes_a_committed_range_once_and_refuses_bad_input(
        services, pg_database, pg_engine, dagster_home, dagster_instance, spark, name, tmp_path, capsys,
        monkeypatch) -> None:
    from assets.identity import asset_key
    from resources.slices import SliceRange

    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' || g FROM generate_series(1, 300) g"))
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}", "watermark": "id",
                                                         "slice_max_rows": 100, "key": ["id"]}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    h.drain(table, until_hi=300)
    with pg_engine.begin() as conn:  # rows above committed progress: not replayable
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'late' FROM generate_series(1, 50) g"))
    config_file = _config_file(cfg, tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    before = read_topic(services.kafka_bootstrap, table.topic_name)
    progress = h.progress(table)
    assert len(before) == 300

    refusals = {
        ("--from", "100", "--to", "350"): "is not fully committed: committed progress ends at 300",
        ("--from", "150", "--to", "300"): "--from 150 is not a slice bound",
        ("--from", "100", "--to", "250"): "--to 250 is not a slice bound",
        ("--from", "200", "--to", "100"): "--to (100) must be greater than --from (200)",
        ("--from", "0", "--to", "100", "--topic", f"{name}_missing"): f"topic '{name}_missing' does not exist",
    }
    for bounds, message in refusals.items():
        assert main(["--config", config_file, "replay", "--table", table.table_id, *bounds]) == 1, bounds
        assert message in capsys.readouterr().err, bounds
    assert main(["--config", config_file, "replay", "--table", "src.public.nope", "--from", "0", "--to", "100"]) == 2
    assert "no configured table 'src.public.nope'" in capsys.readouterr().err
    assert len(read_topic(services.kafka_bootstrap, table.topic_name)) == 300  # nothing produced by a refusal

    assert main(["--config", config_file, "replay", "--table", table.table_id, "--from", "100", "--to", "300",
                 "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert (done["rows"], done["topic"]) == (200, table.topic_name)
    assert done["slices"] == [SliceRange(100, 200).key, SliceRange(200, 300).key]
    after = read_topic(services.kafka_bootstrap, table.topic_name)
    replayed = [m for m in after if "rowrelay.replay" in m.headers]
    assert [m.watermark for m in replayed] == list(range(101, 301))  # exactly the range, once, in order
    assert {m.headers["rowrelay.replay"].decode() for m in replayed} == {done["replay_id"]}
    original = {m.watermark: m for m in before}
    for m in replayed:  # the same message: key, value and the original headers (table, watermark)
        o = original[m.watermark]
        assert (m.key, m.value) == (o.key, o.value)
        assert {k: v for k, v in m.headers.items() if k != "rowrelay.replay"} == o.headers
    assert [m.offset for m in after[:300]] == [m.offset for m in before]  # the originals are untouched
    assert h.progress(table) == progress  # progress unchanged
    report = verify_table(cfg, table)  # the copies are counted apart, not as duplicates
    assert report.ok and (report.messages, report.replayed) == (300, 200), report

    # To another existing topic, and recorded on the asset.
    other = f"{name}_replay"
    _create_topic(services.kafka_bootstrap, other)
    assert main(["--config", config_file, "replay", "--table", table.table_id, "--from", "0", "--to", "100",
                 "--topic", other]) == 0
    assert "100 messages to " + other in capsys.readouterr().out
    assert [m.watermark for m in read_topic(services.kafka_bootstrap, other)] == list(range(1, 101))
    observations = dagster_instance.fetch_observations(asset_key(table), limit=10).records
    recorded = [{k: v.value for k, v in r.asset_observation.metadata.items()} for r in observations
                if "rowrelay/replay_id" in r.asset_observation.metadata]
    assert sorted((o["from"], o["to"], o["rows"], o["topic"]) for o in recorded) == [
        (0, 100, 100, other), (100, 300, 200, table.topic_name)]
    assert h.progress(table) == progress


def _run_in_pty(argv: list[str], env: dict[str, str], timeout: float = 300.0) -> tuple[int, str]:
    """Run a command on a pseudo-terminal (tests/test_backfill_bar.py `run_in_pty`); return its code and output."""
    from tests.test_backfill_bar import run_in_pty

    code, chunks, _ = run_in_pty(argv, env, timeout)
    return code, b"".join(data for _, data in chunks).decode(errors="replace")


def test_backfill_shows_a_live_progress_bar_on_a_terminal(services, pg_database, pg_engine, dagster_home,
                                                          dagster_instance, name, tmp_path) -> None:
    import os
    import re
    import sys

    from tests.pipeline import assert_exactly_once

    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' || g FROM generate_series(1, 50000) g"))
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}", "watermark": "id",
                                                         "slice_max_rows": 10000, "max_slices_per_run": 2,
                                                         "settle_seconds": 0}], spark_remote=True)
    table = cfg.tables[0]
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home), "TERM": "xterm-256color", "COLUMNS": "160"}
    env.pop("NO_COLOR", None)
    code, out = _run_in_pty([sys.executable, "-m", "orchestration.cli", "--config", _config_file(cfg, tmp_path),
                             "backfill", "--table", table.table_id], env)
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)  # the bar's cursor movements and colours
    assert code == 0, plain[-3000:]
    assert "5/5 slices" in plain and "50,000/50,000 rows" in plain and "100%" in plain, plain[-3000:]
    assert "rows/s" in plain and "ETA" in plain
    assert "\x1b[" in out  # drawn as a live terminal bar, not as log lines
    assert "rows (" not in plain  # the plain per-slice lines are for non-terminals
    assert "STEP_START" not in plain  # Dagster's DEBUG lines stay in the event log, off the bar
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), list(range(1, 50001)))

    # Not a terminal: plain lines, one per committed slice, no terminal codes.
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'n' || g FROM generate_series(1, 20000) g"))
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "orchestration.cli", "--config", _config_file(cfg, tmp_path),
                           "backfill", "--table", table.table_id], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\x1b[" not in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if "rows/s, ETA" in line]
    assert lines and lines[-1].endswith("ETA 0 s") and "2/2 slices, 20,000/20,000 rows (100%)" in lines[-1], lines


def test_after_a_reset_back_a_range_is_its_new_slices_not_the_old_ones(
        services, pg_database, pg_engine, dagster_home, dagster_instance, spark, name, tmp_path, capsys,
        monkeypatch) -> None:
    """The runbook's re-created table: 200 old rows as one slice, the table dropped and re-created, `reset --after
    0`, the 200 new rows cut as two slices. The range (0, 200] is now the new slices: replay republished the old
    table's messages, and the lookup a run's parity check and load_input use found the old record."""
    from assets.identity import channel_for
    from resources.exactly_once import records_in_range
    from resources.slices import SliceRange

    def load(tag: str) -> None:
        with pg_engine.begin() as conn:
            conn.execute(text(f"DROP TABLE IF EXISTS {name}"))
            conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
            conn.execute(text(f"INSERT INTO {name} (v) SELECT '{tag}-' || g FROM generate_series(1, 200) g"))

    spec = {"source": "src", "table": f"public.{name}", "watermark": "id", "slice_max_rows": 200, "key": ["id"]}
    load("OLD")
    cfg = relay_config(services, {"src": pg_database}, [spec])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    h.drain(table, until_hi=200)
    load("NEW")
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    # A time on an integer watermark used to be taken as 1767225600000000: no row below it ever sent again.
    progress = h.progress(table)
    assert main(["--config", _config_file(cfg, tmp_path), "reset", "--table", table.table_id, "--after",
                 "2026-01-01", "--reason", "oops"]) == 2
    assert ("--after 2026-01-01 is a time, but the table's watermark is an integer" in capsys.readouterr().err)
    assert h.progress(table) == progress
    assert main(["--config", _config_file(cfg, tmp_path), "reset", "--table", table.table_id, "--after", "0",
                 "--reason", "table re-created"]) == 0
    cfg = relay_config(services, {"src": pg_database}, [{**spec, "slice_max_rows": 100}])
    h = Harness(cfg, dagster_instance)
    h.drain(table, until_hi=200)
    capsys.readouterr()

    kafka = {"bootstrap.servers": services.kafka_bootstrap}
    found = records_in_range(kafka, channel_for(table, PREFIX), SliceRange(0, 200))
    assert [r.slice for r in found] == [SliceRange(0, 100).key, SliceRange(100, 200).key]
    assert main(["--config", _config_file(cfg, tmp_path), "replay", "--table", table.table_id, "--from", "0",
                 "--to", "200", "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["slices"] == [SliceRange(0, 100).key, SliceRange(100, 200).key]
    replayed = [m for m in read_topic(services.kafka_bootstrap, table.topic_name) if "rowrelay.replay" in m.headers]
    assert [m.value["v"] for m in replayed] == [f"NEW-{i}" for i in range(1, 201)]


def test_status_of_a_latest_table_before_its_baseline_counts_no_lag(pg_database, pg_engine, name) -> None:
    """`start_after: latest` before its first cut: the rows there are never sent (the first cut records them as the
    baseline), yet status counted them as lag, and their age could trip the lag check."""
    from assets.lag import measure_lag
    from resources.config import TableConfig
    from resources.source_database import SourceDatabaseResource

    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, at timestamptz DEFAULT now())"))
        conn.execute(text(f"INSERT INTO {name} (at) SELECT now() - interval '1 hour' FROM generate_series(1, 50)"))
    source = SourceDatabaseResource(url=pg_database.render_as_string(hide_password=False))
    try:
        spec = {"source": "src", "table": f"public.{name}", "watermark": "id", "lag_timestamp_column": "at"}
        lag = measure_lag(source, TableConfig(**spec, start_after="latest"), None)
        assert (lag.lag_rows, lag.lag_seconds, lag.lag_basis, lag.source_max) == (0, 0.0, "awaiting_baseline", 50)
        lag = measure_lag(source, TableConfig(**spec, start_after=0), None)  # from 0: all 50 wait, an hour old
        assert (lag.lag_rows, lag.lag_basis) == (50, "oldest_unpublished_row") and lag.lag_seconds >= 3600
        # Rows `where:` leaves out (or skip_watermarks skips) are never sent, so they are no lag: the hour-old rows
        # 1..49 left out and 50 skipped, one new row waits, seconds old (it used to be measured from the old rows).
        with pg_engine.begin() as conn:
            conn.execute(text(f"INSERT INTO {name} (at) VALUES (now())"))  # id 51
        filtered = TableConfig(**spec, start_after=0, where="id > 49", skip_watermarks=[50])
        lag = measure_lag(source, filtered, None)
        assert (lag.lag_rows, lag.lag_basis) == (1, "oldest_unpublished_row") and lag.lag_seconds < 60, lag
    finally:
        source.dispose()


def test_a_replay_that_outlives_the_transaction_timeout_says_what_to_do(
        services, pg_database, pg_engine, dagster_home, dagster_instance, spark, name, tmp_path, capsys,
        monkeypatch) -> None:
    """A replay is one transaction. It ran under librdkafka's 60 s default (not the publisher's timeout), and when
    the broker aborted it the user got a KafkaException traceback. Now it takes the publisher's
    timeout and fails with what happened and what to do; nothing of it is visible."""
    import resources.exactly_once as protocol
    from resources.exactly_once import replay

    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' || g FROM generate_series(1, 200) g"))
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}", "watermark": "id",
                                                         "slice_max_rows": 100, "key": ["id"]}],
                       producer={"transaction.timeout.ms": "2000"})
    h = Harness(cfg, dagster_instance)
    table = h.table()
    h.drain(table, until_hi=200)
    config_file = _config_file(cfg, tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    read = protocol.read_published_messages

    def slow_read(conf, record):  # the first slice read, then a pause past the 2 s timeout (and the broker's check)
        yield from read(conf, record)
        time.sleep(5.5)

    monkeypatch.setattr(replay, "read_published_messages", slow_read)
    capsys.readouterr()
    assert main(["--config", config_file, "replay", "--table", table.table_id, "--from", "0", "--to", "200"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert f"rowrelay: {table.table_id}: the replay's transaction (" in err and "nothing was replayed" in err, err
    assert "past transaction.timeout.ms (2000 ms)" in err and "replay the range in parts (--from/--to)" in err, err
    assert not [m for m in read_topic(services.kafka_bootstrap, table.topic_name) if "rowrelay.replay" in m.headers]
