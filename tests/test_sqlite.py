"""SQLite as a source: a table in a database file, relayed exactly once (local Spark and the Connect server)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from tests.pipeline import Harness, assert_exactly_once, read_topic, relay_config

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("spark_remote", [False, True], ids=["local-spark", "spark-connect"])
def test_sqlite_table_reaches_kafka_exactly_once(services, dagster_instance, spark, name, tmp_path: Path,
                                                 spark_remote: bool) -> None:
    path = tmp_path / f"{name}.db"
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.execute(text("PRAGMA journal_mode=WAL"))  # readers (Spark's JDBC) alongside a writer
        conn.execute(text(f"CREATE TABLE {name} (id INTEGER PRIMARY KEY AUTOINCREMENT, label TEXT, amount REAL)"))
        conn.execute(text(f"INSERT INTO {name} (label, amount) VALUES " +
                          ", ".join(f"('r{i}', {i}.5)" for i in range(1, 251))))
    cfg = relay_config(services, {"lite": make_url(f"sqlite:///{path}")}, [
        {"source": "lite", "table": name, "watermark": "id", "slice_max_rows": 100, "key": ["id"],
         "settle_seconds": 0.2}], spark_remote=spark_remote)
    h = Harness(cfg, dagster_instance)
    table = h.table()
    h.drain(table)
    with engine.begin() as conn:  # more rows after the first cut
        conn.execute(text(f"INSERT INTO {name} (label, amount) VALUES ('late', 0.25)"))
    h.drain(table, until_hi=251)
    msgs = read_topic(services.kafka_bootstrap, table.topic_name)
    assert_exactly_once(msgs, list(range(1, 252)))
    assert msgs[0].value == {"id": 1, "label": "r1", "amount": 1.5} and msgs[0].key == b'{"id":1}'
    assert msgs[-1].value == {"id": 251, "label": "late", "amount": 0.25}
    engine.dispose()


def _wide_ids_table(path: Path, name: str, first: int) -> None:
    """Ids first..first+19 and an INTEGER column above 2^31-1: SQLite stores them in 8 bytes, its driver calls the
    columns 32-bit."""
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id INTEGER PRIMARY KEY, n INTEGER, label TEXT)"))
        conn.execute(text(f"INSERT INTO {name} (id, n, label) VALUES " +
                          ", ".join(f"({first - 1 + i}, {3 * 10**9 + i}, 'r{i}')" for i in range(1, 21))))
    engine.dispose()


def test_sqlite_integers_above_32_bits_are_relayed_exactly(services, dagster_instance, spark, name,
                                                           tmp_path: Path) -> None:
    """Spark read SQLite INTEGER columns as 32-bit: ids above 2^31-1 wrapped, fell out of their own slice's range,
    and the slice committed without them (a gap). They are read as BIGINT now."""
    path = tmp_path / f"{name}.db"
    first = 2**31 - 10  # across 2^31
    _wide_ids_table(path, name, first)
    cfg = relay_config(services, {"lite": make_url(f"sqlite:///{path}")}, [
        {"source": "lite", "table": name, "watermark": "id", "start_after": first - 1, "key": ["id"],
         "settle_seconds": 0.2}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    h.drain(table, until_hi=first + 19)
    msgs = read_topic(services.kafka_bootstrap, table.topic_name)
    assert_exactly_once(msgs, list(range(first, first + 20)))
    assert msgs[-1].value == {"id": first + 19, "n": 3 * 10**9 + 20, "label": "r20"}


def _relayed_values(services, dagster_instance, path: Path, name: str, until_hi: int) -> list[dict]:
    """Relay the SQLite table up to `until_hi` and return its messages' values, in order."""
    cfg = relay_config(services, {"lite": make_url(f"sqlite:///{path}")}, [
        {"source": "lite", "table": name, "watermark": "id", "settle_seconds": 0.2}])
    h = Harness(cfg, dagster_instance)
    h.drain(h.table(), until_hi=until_hi)
    return [m.value for m in read_topic(services.kafka_bootstrap, h.table().topic_name)]


def _sqlite_table(tmp_path: Path, name: str, columns: str, rows: str) -> tuple[Path, Any]:
    """A SQLite file holding table `name` (id INTEGER PRIMARY KEY, `columns`) with `rows`: (its path, an engine)."""
    path = tmp_path / f"{name}.db"
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id INTEGER PRIMARY KEY, {columns})"))
        conn.execute(text(f"INSERT INTO {name} VALUES {rows}"))
    return path, engine


def _run_first_slice(services, dagster_instance, path: Path, name: str, **table: object):
    """Cut the SQLite table's first slice and run it, expecting the run to fail: (harness, table, result)."""
    cfg = relay_config(services, {"lite": make_url(f"sqlite:///{path}")}, [
        {"source": "lite", "table": name, "watermark": "id", "settle_seconds": 0.2, **table}])
    h = Harness(cfg, dagster_instance)
    relayed = h.table()
    (key,) = h.cut(relayed)
    result = h.run(relayed, key, raise_on_error=False)
    assert not result.success
    return h, relayed, result


def test_a_read_that_loses_rows_fails_the_run_instead_of_committing(services, dagster_instance, spark, name,
                                                                   tmp_path: Path, monkeypatch) -> None:
    """Whatever makes a read lose rows (here the 32-bit SQLite read above, put back), the slice is checked against
    the source's count before its commit: the run fails saying so, nothing is visible, progress does not move."""
    from resources import spark as spark_module
    from resources.kafka_io_manager import STOPPED_TAG
    from tests.test_errors import failure_text

    path = tmp_path / f"{name}.db"
    first = 3 * 10**9 + 1  # every id wraps (to below the slice): the read gives none of them
    _wide_ids_table(path, name, first)
    monkeypatch.setattr(spark_module, "custom_schema_for", lambda shape: "")  # the driver's 32-bit mapping
    h, table, result = _run_first_slice(services, dagster_instance, path, name, start_after=first - 1)
    text_ = failure_text(result)
    assert "the read gave" in text_ and "the source counts 20" in text_, text_
    assert dagster_instance.get_run_by_id(result.run_id).tags.get(STOPPED_TAG) == "rows_mismatch"
    assert read_topic(services.kafka_bootstrap, table.topic_name, timeout=3.0) == []
    assert h.progress(table) is None


def test_sqlite_dates_and_floats_arrive_as_stored(services, dagster_instance, spark, name, tmp_path: Path) -> None:
    """SQLite has no date type and stores FLOAT in 8 bytes. Its driver parsed a DATETIME's text as a date (the time
    of day lost), a TIMESTAMP's microseconds as milliseconds, and read FLOAT as a 32-bit float, all silently. Date
    and time columns are sent as the text SQLite holds now, FLOAT as the double it is."""
    path = tmp_path / f"{name}.db"
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id INTEGER PRIMARY KEY, d DATE, dt DATETIME, ts TIMESTAMP, f FLOAT)"))
        conn.execute(text(
            f"INSERT INTO {name} VALUES (1, '2024-01-02', '2024-01-02 03:04:05.123456', '2024-01-02 03:04:05.000001', "
            "0.123456789), (2, 20240102, 1700000000, '2024-01-02T03:04:05', 1e-300), (3, NULL, NULL, NULL, NULL)"
            .replace(":", "\\:")))
    engine.dispose()
    assert _relayed_values(services, dagster_instance, path, name, until_hi=3) == [
        {"id": 1, "d": "2024-01-02", "dt": "2024-01-02 03:04:05.123456", "ts": "2024-01-02 03:04:05.000001",
         "f": 0.123456789},
        {"id": 2, "d": "20240102", "dt": "1700000000", "ts": "2024-01-02T03:04:05", "f": 1e-300},
        {"id": 3, "d": None, "dt": None, "ts": None, "f": None},
    ]


@pytest.mark.parametrize(("declared", "value", "kind"), [
    ("INTEGER", "1.5", "real"), ("INTEGER", "'12abc'", "text"), ("REAL", "'abc'", "text"),
    ("TEXT", "X'FF00'", "blob"), ("DECIMAL(10,2)", "123.456", "real"), ("BOOLEAN", "'yes'", "text"),
    ("NUMERIC", "12.345678901234567", "real"), ("DECIMAL(16,2)", "12345678901234.56", "real"),
    ("DECIMAL(10)", "1.5", "real"), ("NUMERIC", "1e20", "real"), ("DECIMAL(10,2)", "123456789", "integer"),
    ("DECIMAL(10,2)", "100000000.5", "real")])
def test_a_sqlite_value_its_declared_type_cannot_carry_stops_the_slice(services, dagster_instance, spark, name,
                                                                       tmp_path: Path, declared: str, value: str,
                                                                       kind: str) -> None:
    """SQLite keeps any value in any column and its driver converted the misfits silently (1.5 in an INTEGER column
    arrived as 1, '12abc' as 12, 123.456 in a DECIMAL(10,2) as 123.46, 'yes' in a BOOLEAN as false, a real of 16
    digits through 15). The slice stops as bad_row (no retry), naming the row and the column, nothing is sent; once
    the value is fixed the table relays exactly once."""
    from resources.kafka_io_manager import STOPPED_TAG
    from tests.test_errors import failure_text

    path, engine = _sqlite_table(tmp_path, name, f"v {declared}", f"(1, NULL), (2, {value}), (3, NULL)")
    h, table, result = _run_first_slice(services, dagster_instance, path, name)
    message = failure_text(result)
    shown = declared.replace(",", ", ")  # as SQLAlchemy reflects it
    assert f"row 2 (id) holds a {kind} value in column 'v' (reflected as {shown})" in message, message
    assert "skip_watermarks: [2]" in message, message
    assert dagster_instance.get_run_by_id(result.run_id).tags.get(STOPPED_TAG) == "bad_row"
    _assert_not_retried(dagster_instance, result.run_id)
    # The table's sensor says why it waits, and what to do (it only said "waiting for their runs").
    assert h.tick(table) == []  # within the backoff: no resume yet
    said = h.skip_messages[table.table_id] or ""
    assert f"run {result.run_id} stopped (bad_row); fix the row (or list its watermark in `skip_watermarks`)" in said
    assert read_topic(services.kafka_bootstrap, table.topic_name, timeout=3.0) == []
    assert h.progress(table) is None
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {name} SET v = NULL WHERE id = 2"))
    engine.dispose()
    h.drain(table, until_hi=3)
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), [1, 2, 3])


def test_a_re_execution_of_a_stopped_run_is_not_taken_for_stopped(services, dagster_instance, spark, name,
                                                                 tmp_path: Path) -> None:
    """The UI's Re-execute copies the parent run's tags, so a re-execution of a run stopped as bad_row carried the
    stop (and `retry_on_asset_or_op_failure: false`) from its first moment: had it then failed for any other
    reason, the sensor would have named the old bad row and Dagster's run retries would have left it. The asset
    clears the copied stop when it starts."""
    from dagster import RunsFilter
    from dagster._core.storage.tags import PARENT_RUN_ID_TAG, ROOT_RUN_ID_TAG

    from orchestration.factory import job_name
    from orchestration.runs import last_stop_reason
    from resources.kafka_io_manager import RETRY_ON_FAILURE_TAG, STOPPED_TAG
    from resources.keys import WORKER_PID_TAG

    path, engine = _sqlite_table(tmp_path, name, "v INTEGER", "(1, 1), (2, 2.5), (3, 3)")
    h, table, stopped = _run_first_slice(services, dagster_instance, path, name)
    parent = dagster_instance.get_run_by_id(stopped.run_id)
    assert parent.tags[STOPPED_TAG] == "bad_row" and parent.tags[RETRY_ON_FAILURE_TAG] == "false"
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {name} SET v = 2 WHERE id = 2"))
    engine.dispose()
    copied = {k: v for k, v in parent.tags.items() if not k.startswith("dagster/partition")}
    child = h.defs.resolve_job_def(job_name(table)).execute_in_process(
        partition_key=parent.tags["dagster/partition"], instance=dagster_instance,
        tags={**copied, PARENT_RUN_ID_TAG: parent.run_id, ROOT_RUN_ID_TAG: parent.run_id})
    run = dagster_instance.get_run_by_id(child.run_id)
    assert run.tags[WORKER_PID_TAG]  # the asset started and set its own tags with the cleared ones
    assert run.tags[STOPPED_TAG] == "" and run.tags[RETRY_ON_FAILURE_TAG] == "true"  # the instance's default
    assert last_stop_reason(dagster_instance.get_run_records(RunsFilter(run_ids=[child.run_id]))) is None
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), [1, 2, 3])


def test_sqlite_values_that_fit_their_declared_type_are_relayed(services, dagster_instance, spark, name,
                                                                tmp_path: Path) -> None:
    """No false stop: reals a decimal's scale holds (19.99 in DECIMAL(38,18), 0.1 in DECIMAL(10,2), 12.5 in a
    NUMERIC read at Spark's default scale 18, 1e-07 at scale 10), integers in REAL, BOOLEAN 0 and 1. And type names
    the driver does not know (VARCHAR2, DOUBLE PRECISION, BOOL), which it reported as NUMERIC: '007' arrived as a
    decimal 7, BOOL as a decimal."""
    path, engine = _sqlite_table(tmp_path, name, "d38 DECIMAL(38,18), d10 DECIMAL(10,2), n NUMERIC, r REAL, "
                                 "b BOOLEAN, small DECIMAL(20,10), v2 VARCHAR2(10), dp DOUBLE PRECISION, b2 BOOL",
                                 "(1, 19.99, 0.1, 12.5, 3, 1, 1e-7, '007', 0.1, 1), "
                                 "(2, 10000, 99999999.99, 7, 2.5, 0, 0.5, '12.345', 2.5, 0)")
    engine.dispose()
    assert _relayed_values(services, dagster_instance, path, name, until_hi=2) == [
        {"id": 1, "d38": "19.990000000000000000", "d10": "0.10", "n": "12.500000000000000000", "r": 3.0, "b": True,
         "small": "0.0000001000", "v2": "007", "dp": 0.1, "b2": True},
        {"id": 2, "d38": "10000.000000000000000000", "d10": "99999999.99", "n": "7.000000000000000000", "r": 2.5,
         "b": False, "small": "0.5000000000", "v2": "12.345", "dp": 2.5, "b2": False},
    ]


def test_a_sqlite_misfit_stops_its_own_slice_not_the_one_before(services, dagster_instance, spark, name,
                                                                tmp_path: Path) -> None:
    """The read-ahead prepares the next slice while one publishes: a bad row in the second slice of a run stops
    the second slice, after the first has committed. `skip_watermarks` leaves the row out, as its message says."""
    from resources.kafka_io_manager import STOPPED_TAG

    path, engine = _sqlite_table(tmp_path, name, "v INTEGER", "(1, 1), (2, 2), (3, 3), (4, 4), (5, 5.5), (6, 6)")
    engine.dispose()
    base = {"source": "lite", "table": name, "watermark": "id", "settle_seconds": 0.2, "slice_max_rows": 3}
    h = Harness(relay_config(services, {"lite": make_url(f"sqlite:///{path}")}, [base]), dagster_instance)
    table = h.table()
    (key,) = h.cut(table)  # one run for both slices
    assert key == "000000000000-000000000003...000000000003-000000000006", key
    result = h.run(table, key, raise_on_error=False)
    assert not result.success
    assert dagster_instance.get_run_by_id(result.run_id).tags.get(STOPPED_TAG) == "bad_row"
    assert h.progress(table).hi == 3
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), [1, 2, 3])
    skipping = Harness(relay_config(services, {"lite": make_url(f"sqlite:///{path}")},
                                    [{**base, "skip_watermarks": [5]}]), dagster_instance)
    skipping.drain(skipping.table(), until_hi=6)
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), [1, 2, 3, 4, 6])


@pytest.mark.parametrize(("ddl", "message"), [
    ("CREATE TABLE {t} (id INTEGER PRIMARY KEY, doc JSON)", "column 'doc' has type JSON, which rowrelay cannot read "
                                                            "from sqlite"),
    ('CREATE TABLE {t} (id INTEGER PRIMARY KEY, "we`ird" TEXT)', "column 'we`ird' has a backtick in its name"),
])
def test_sqlite_columns_rowrelay_cannot_read_are_refused_at_the_table_check(tmp_path: Path, name, ddl: str,
                                                                            message: str) -> None:
    """A SQLite JSON column (SQLite does not check its text; Spark failed on it as a decimal) and a backtick in a
    column name (Spark failed on the reference) are refused by name before anything is cut or read."""
    from resources.source_database import SourceDatabaseResource, SourceError

    path = tmp_path / f"{name}.db"
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.execute(text(ddl.format(t=name)))
    engine.dispose()
    source = SourceDatabaseResource(url=f"sqlite:///{path}")
    try:
        with pytest.raises(SourceError, match="leave it out with `columns:`") as info:
            source.table_shape(None, name, "id")
        assert message in str(info.value)
    finally:
        source.dispose()


def _assert_not_retried(instance, run_id: str) -> None:
    """A stopped run is left alone by Dagster's run retries (dagster.yaml: five), which repeated a bad row's run
    five times per sensor resume: Dagster's own retry decision, as its event storage makes it when a run fails,
    with five retries allowed, says no for it, and yes for the same run without rowrelay's tag."""
    from dagster._core.events import RunFailureReason
    from dagster._core.execution.retries import auto_reexecution_should_retry_run  # Dagster's retry rule
    from dagster._core.storage.tags import MAX_RETRIES_TAG

    from resources.kafka_io_manager import RETRY_ON_FAILURE_TAG

    run = instance.get_run_by_id(run_id)
    assert run.tags.get(RETRY_ON_FAILURE_TAG) == "false"
    five = run.with_tags({**run.tags, MAX_RETRIES_TAG: "5"})
    assert not auto_reexecution_should_retry_run(instance, five, RunFailureReason.STEP_FAILURE)
    untagged = five.with_tags({k: v for k, v in five.tags.items() if k != RETRY_ON_FAILURE_TAG})
    assert auto_reexecution_should_retry_run(instance, untagged, RunFailureReason.STEP_FAILURE)


def test_a_sqlite_table_renamed_away_fails_the_sensor_tick_with_the_table_checks_message(
        services, dagster_instance, spark, name, tmp_path: Path) -> None:
    """SQLite says a missing table with OperationalError, not ProgrammingError: the tick re-reflects on either, so
    it names the table and the remedy, not "no such table" for up to a minute (the PostgreSQL case is in
    tests/test_health.py)."""
    path = tmp_path / "lite.db"
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id INTEGER PRIMARY KEY, v TEXT)"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES ('a')"))
    cfg = relay_config(services, {"lite": make_url(f"sqlite:///{path}")}, [
        {"source": "lite", "table": name, "watermark": "id", "settle_seconds": 0.2}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    h.drain(table, until_hi=1)  # the shape is cached now
    with engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {name} RENAME TO {name}_old"))
    engine.dispose()
    with pytest.raises(Exception) as failed:
        h.tick(table)
    assert f"table '{name}' not found" in str(failed.value) and "check `table:` in rowrelay.yaml" in str(failed.value)
