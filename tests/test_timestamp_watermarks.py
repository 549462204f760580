"""Timestamp watermarks (`watermark: created_at`): keys, conversions, and exactly once on the real stack with many
equal timestamps and commits out of timestamp order, on PostgreSQL and MariaDB."""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime, timedelta, timezone
from functools import partial

import pytest
from confluent_kafka import Producer
from sqlalchemy import create_engine, text

from orchestration.verify import verify_table
from resources.exactly_once import ProgressRecord
from resources.slices import (
    SliceRange,
    WatermarkCandidate,
    cut_slices,
    datetime_to_micros,
    micros_text,
    micros_to_datetime,
)
from resources.source_database import InnodbTrxStale, SourceDatabaseResource, SourceError, below_step_in_reach
from tests.pipeline import Harness, assert_exactly_once, polled, read_topic, relay_config, source_url
from tests.test_errors import failure_text

TIME_KEY = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z_\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z$")


# -- pure logic ----------------------------------------------------------------------------------------------------

def test_micros_are_exact_and_zone_less_values_read_as_utc() -> None:
    moment = datetime(2026, 11, 23, 7, 29, 56, 123457, tzinfo=UTC)
    micros = datetime_to_micros(moment)
    assert micros == 1_795_418_996_123_457
    assert micros_to_datetime(micros) == moment
    assert datetime_to_micros(moment.replace(tzinfo=None)) == micros  # naive: as stored, read as UTC
    assert datetime_to_micros(moment.astimezone(timezone(timedelta(hours=-5)))) == micros  # the same instant
    # Far from 1970 float seconds lose microseconds; integer arithmetic does not.
    far = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
    assert micros_to_datetime(datetime_to_micros(far)) == far


def test_time_keys_are_readable_sort_as_their_ranges_and_round_trip() -> None:
    a = SliceRange(0, datetime_to_micros(datetime(2026, 1, 1, tzinfo=UTC)), timestamps=True)
    b = SliceRange(a.hi, a.hi + 1, timestamps=True)
    assert a.key == "1970-01-01T00:00:00.000000Z_2026-01-01T00:00:00.000000Z"
    assert b.key == "2026-01-01T00:00:00.000000Z_2026-01-01T00:00:00.000001Z"
    assert str(b) == "(2026-01-01T00:00:00.000000Z, 2026-01-01T00:00:00.000001Z]"
    assert sorted([b.key, a.key]) == [a.key, b.key]
    for s in (a, b):
        parsed = SliceRange.from_key(s.key)
        assert parsed == s and parsed.timestamps and parsed.key == s.key
    assert SliceRange(1, 5).key == "000000000001-000000000005"  # integer keys unchanged
    assert not SliceRange.from_key(SliceRange(1, 5).key).timestamps
    assert a.span(5, 9).key == f"{micros_text(5)}_{micros_text(9)}"
    record = ProgressRecord("t", b.key, b.lo, b.hi, 1, 1, "", "topic")
    assert record.slice_range.key == b.key


def test_a_candidate_stays_below_what_a_writer_starting_now_may_write() -> None:
    second = 1_000_000
    s = 1_796_000_000 * second  # a whole second
    # Whole seconds: the max in the clock's second (or rounded up to the next) waits one microsecond below itself.
    assert below_step_in_reach(s, s + 300_000, second) == s - 1
    assert below_step_in_reach(s + second, s + 700_000, second) == s + second - 1
    # A microsecond writer's value beside whole-second writers, in the clock's second: below that second's start.
    assert below_step_in_reach(s + 123_456, s + 200_000, second) == s - 1
    # A second the clock has left is final as it is; a step of 1 (microseconds) changes nothing.
    assert below_step_in_reach(s, s + second, second) == s
    assert below_step_in_reach(s + 123_456, s + 123_456, 1) == s + 123_456


def test_a_cut_never_splits_one_timestamp() -> None:
    # 7 rows at t=10 (one statement's now()), then 3 at t=20: slices of at most 5 rows.
    rows = [10] * 7 + [20] * 3

    def nth(after: int, n: int, upto: int) -> int | None:
        above = [r for r in rows if after < r <= upto]
        return above[n - 1] if len(above) >= n else None

    def top(after: int, upto: int) -> int | None:
        return max((r for r in rows if after < r <= upto), default=None)

    slices = cut_slices(0, 20, 5, nth, top, timestamps=True)
    assert [(s.lo, s.hi) for s in slices] == [(0, 10), (10, 20)] and all(s.timestamps for s in slices)


def test_times_as_users_write_them() -> None:
    from orchestration.cli.arguments import watermark
    from resources.config import parse_config

    new_year = datetime_to_micros(datetime(2026, 1, 1, tzinfo=UTC))
    assert watermark("2026-01-01T00:00:00Z") == watermark("2026-01-01 00:00:00") == new_year
    assert watermark("2026-01-01T01:00:00+01:00") == new_year and watermark("42") == 42
    with pytest.raises(Exception, match="neither an integer watermark nor an ISO-8601 time"):
        watermark("yesterday")
    base = {"sources": {"s": {"url": "postgresql://h/db"}}, "kafka": {"bootstrap_servers": "k:9092"}}
    for given in ("2026-01-01T00:00:00Z", datetime(2026, 1, 1)):  # quoted in YAML, or a YAML timestamp
        cfg = parse_config({**base, "tables": [{"source": "s", "table": "t", "watermark": "ts", "start_after": given}]})
        assert cfg.tables[0].start_after_watermark == new_year
    cfg = parse_config({**base, "tables": [{"source": "s", "table": "t", "watermark": "id", "start_after": 7}]})
    assert cfg.tables[0].start_after_watermark == 7


def test_sensor_cursor_keeps_the_key_format() -> None:
    from orchestration.cutting import SensorState

    state = SensorState(chain=[SliceRange(5, 9, timestamps=True)])
    (back,) = SensorState.from_cursor(state.to_cursor()).chain or []
    assert back.timestamps and back.key == SliceRange(5, 9, timestamps=True).key


def test_rollups_of_time_keys_are_time_keys() -> None:
    from resources.history import HistoryPolicy, plan_rollups

    now = datetime(2026, 11, 23, 12, tzinfo=UTC)
    day = datetime_to_micros(datetime(2026, 11, 20, tzinfo=UTC))
    keys = [SliceRange(day + i, day + i + 1, timestamps=True) for i in range(3)]
    records = [ProgressRecord("t", k.key, k.lo, k.hi, 1, 1, "c", "topic", {"0": [0, 0]}, "tx",
                              (now - timedelta(days=3)).isoformat()) for k in keys]
    (rollup,) = plan_rollups(keys, records, now, HistoryPolicy())
    assert rollup.range.key == f"{micros_text(day)}_{micros_text(day + 3)}" and TIME_KEY.match(rollup.range.key)


def test_messages_about_a_timestamp_watermark_name_times() -> None:
    """Errors and reports name a timestamp watermark's values as the UTC times users pass to the CLI, not as the
    microseconds rowrelay carries."""
    from resources.exactly_once import ReplayError, SliceOutOfOrder, replay_records

    day = datetime_to_micros(datetime(2026, 11, 20, tzinfo=UTC))
    late = SliceRange(day + 10, day + 20, timestamps=True)
    raw = re.compile(r"\d{16}")  # microseconds since 1970, as carried
    gap = str(SliceOutOfOrder.at("t", late, day))
    assert f"committed progress ends at {micros_text(day)}" in gap and not raw.search(gap), gap
    assert f"({micros_text(day)}, {micros_text(day + 10)}] must commit first" in gap
    inside = str(SliceOutOfOrder.at("t", late, day + 15))
    assert f"cuts the range again from {micros_text(day + 15)}" in inside and not raw.search(inside), inside

    ranges = [SliceRange(day + i * 10, day + (i + 1) * 10, timestamps=True) for i in range(3)]
    history = [ProgressRecord("t", r.key, r.lo, r.hi, 1, 1, "c", "topic", {"0": [i, i]}) for i, r in enumerate(ranges)]
    assert [r.key for r in replay_records(history, day + 30, "t", day + 10, day + 30)] == [r.key for r in ranges[1:]]
    for lo, hi, expected in [
        (day + 5, day + 30, f"--from {micros_text(day + 5)} is not a slice bound; slice lower bounds near --from: "
                            f"[{micros_text(day)}, {micros_text(day + 10)}, {micros_text(day + 20)}]"),
        (day, day + 40, f"range ({micros_text(day)}, {micros_text(day + 40)}] is not fully committed: committed "
                        f"progress ends at {micros_text(day + 30)}"),
    ]:
        with pytest.raises(ReplayError) as caught:
            replay_records(history, day + 30, "t", lo, hi)
        assert expected in str(caught.value) and not raw.search(str(caught.value)), str(caught.value)
    # An integer watermark's values stay integers.
    numbers = [ProgressRecord("t", SliceRange(0, 10).key, 0, 10, 1, 1, "c", "topic", {"0": [0, 0]})]
    with pytest.raises(ReplayError, match=r"--from 5 is not a slice bound; slice lower bounds near --from: \[0\]"):
        replay_records(numbers, 10, "t", 5, 10)


# -- on the real stack -----------------------------------------------------------------------------------------------

def _ordered(messages, ts_field: str = "created_at") -> list[tuple[str, int]]:
    return [(m.value[ts_field], m.value["n"]) for m in sorted(messages, key=lambda m: (m.partition, m.offset))]


@pytest.mark.integration
@pytest.mark.parametrize("column_type", ["timestamptz", "timestamp"])
def test_postgres_timestamp_watermark_equal_times_and_out_of_order_commits(
        services, pg_database, pg_engine, dagster_instance, spark, name, column_type: str) -> None:
    default = "now()" if column_type == "timestamptz" else "(now() AT TIME ZONE 'UTC')"
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), "
                          f"created_at {column_type} NOT NULL DEFAULT {default}, n int NOT NULL)"))
        conn.execute(text(f"CREATE INDEX ON {name} (created_at)"))
    for first in (1, 301, 601):  # three transactions: 300 rows share each one's now()
        with pg_engine.begin() as conn:
            conn.execute(text(f"INSERT INTO {name} (n) SELECT g FROM generate_series({first}, {first + 299}) g"))
    cfg = relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "created_at", "tie_break": "n",
         "slice_max_rows": 200, "key": ["id"]}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    keys = h.drain(table)
    assert keys and all(TIME_KEY.match(k) for k in keys), keys
    # A slice holds whole timestamps: 200 rows per slice would split each 300-row group; it does not.
    assert [h.materialization(table, k)["rows"] for k in keys] == [300, 300, 300]
    first_hi = h.progress(table).hi

    # A transaction takes its timestamp (now(): its start) and commits after a later one.
    slow = create_engine(pg_database).connect()
    try:
        slow.execute(text("BEGIN"))
        slow.execute(text(f"INSERT INTO {name} (n) SELECT g FROM generate_series(901, 950) g"))
        with pg_engine.begin() as conn:
            conn.execute(text(f"INSERT INTO {name} (n) SELECT g FROM generate_series(951, 1000) g"))
        # The later rows are committed and visible, but the open transaction may still commit an earlier time.
        assert h.tick(table) == [] and h.progress(table).hi == first_hi
        slow.execute(text("COMMIT"))
    finally:
        slow.close()
    h.drain(table)
    messages = read_topic(services.kafka_bootstrap, table.topic_name)
    with pg_engine.connect() as conn:
        ids = [str(r[0]) for r in conn.execute(text(f"SELECT id FROM {name}"))]
        top = conn.execute(text(f"SELECT max(created_at) FROM {name}")).scalar()
    assert len(ids) == 1000
    assert_exactly_once(messages, ids)
    # In order: by time, rows sharing a time by the tie-break; the slow transaction's rows before the later ones.
    ordered = _ordered(messages)
    assert ordered == sorted(ordered)
    assert [n for _, n in ordered] == list(range(1, 1001))
    assert h.progress(table).hi == datetime_to_micros(top)
    assert all(m.watermark == datetime_to_micros(datetime.fromisoformat(m.value["created_at"])) for m in messages)
    # `rowrelay verify` reads the source's times as the watermarks in the topic: every row once, in order.
    report = verify_table(cfg, table)
    assert report.ok and report.source_rows == report.messages == 1000, report
    assert report.rows_by_tie_break == 1000 and report.tie_break_unchecked is None

    # In one shared time: row n=1 sent a second time, and a row of the same time (below the committed progress)
    # never sent. Counted per time they even out (verify passed this); compared by tie_break they do not.
    first = next(m for m in messages if m.value["n"] == 1)
    producer = Producer({"bootstrap.servers": services.kafka_bootstrap})
    producer.produce(table.topic_name, value=json.dumps(first.value).encode(),
                     headers=[("rowrelay.table", table.table_id.encode()),
                              ("rowrelay.watermark", str(first.watermark).encode())])
    assert producer.flush(10) == 0
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (created_at, n) SELECT created_at, 5000 FROM {name} WHERE n = 1"))
    report = verify_table(cfg, table)
    assert (report.source_rows, report.duplicates, report.missing, report.extra) == (1001, 1, 1, 0), report
    assert report.examples["duplicates"] == report.examples["missing"] == [first.watermark]


def _relayed_time_table(services, pg_database, pg_engine, dagster_instance, name: str, nullable: str,
                        rows: int) -> tuple[Harness, list[str]]:
    """A PostgreSQL table (n, created_at timestamptz DEFAULT now()) with rows 1..`rows`, relayed up to its max;
    returns the harness and the slice keys run."""
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (n int PRIMARY KEY, created_at timestamptz {nullable} DEFAULT now())"))
        conn.execute(text(f"INSERT INTO {name} (n) SELECT generate_series(1, {rows})"))
    cfg = relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "created_at", "key": ["n"]}])
    h = Harness(cfg, dagster_instance)
    return h, h.drain(h.table())


@pytest.mark.integration
def test_postgres_open_transaction_holds_the_cut(services, pg_database, pg_engine, dagster_instance, spark,
                                                 name, monkeypatch, capsys) -> None:
    """The out-of-order case on its own: nothing at or above the open transaction's time is cut while it is open."""
    h, _ = _relayed_time_table(services, pg_database, pg_engine, dagster_instance, name, "NOT NULL", rows=1)
    table = h.table()
    first_hi = h.progress(table).hi
    slow = create_engine(pg_database).connect()
    try:
        slow.execute(text("BEGIN"))
        slow.execute(text(f"INSERT INTO {name} (n) VALUES (2)"))  # its time: this transaction's start
        with pg_engine.begin() as conn:
            conn.execute(text(f"INSERT INTO {name} (n) VALUES (3)"))
        assert h.tick(table) == [] and h.progress(table).hi == first_hi
        slow.execute(text("COMMIT"))
    finally:
        slow.close()
    h.drain(table)
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), [1, 2, 3], id_field="n")
    # `rowrelay status` shows the committed watermark as the time it is.
    from orchestration.cli import main

    monkeypatch.setenv("DAGSTER_HOME", dagster_instance.root_directory)
    assert main(["--config", str(h.config_file()), "status"]) == 0
    assert micros_text(h.progress(table).hi) in capsys.readouterr().out


@pytest.mark.integration
def test_cli_reports_a_timestamp_watermark_as_times(services, pg_database, pg_engine, dagster_instance, spark, name,
                                                    monkeypatch, capsys) -> None:
    """`rowrelay backfill`, `verify` and `reset` on a timestamp watermark print its values as UTC times."""
    from orchestration.cli import main

    h, _ = _relayed_time_table(services, pg_database, pg_engine, dagster_instance, name, "NOT NULL", rows=3)
    table = h.table()
    hi = h.progress(table).hi
    config_file = str(h.config_file())
    monkeypatch.setenv("DAGSTER_HOME", dagster_instance.root_directory)
    capsys.readouterr()
    assert main(["--config", config_file, "backfill", "--table", table.table_id, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"committed up to {micros_text(hi)}; 0 new slice(s) would be cut" in out and str(hi) not in out, out
    assert main(["--config", config_file, "verify"]) == 0
    out = capsys.readouterr().out
    assert f"committed up to {micros_text(hi)}, 3 source rows, 3 messages" in out and str(hi) not in out, out
    # A reset back by a microsecond: the three rows (one time, one transaction's now()) are above it again.
    back = micros_text(hi - 1)
    assert main(["--config", config_file, "reset", "--table", table.table_id, "--after", back]) == 0
    out = capsys.readouterr().out
    assert f"progress reset to {back} (was {micros_text(hi)})" in out and f"rows after {back} will be sent" in out
    assert str(hi - 1) not in out and str(hi) not in out, out
    # Before they are sent again, verify compares from the reset and reports the three as extra, by their time.
    assert main(["--config", config_file, "verify"]) == 1
    out = capsys.readouterr().out
    assert f"compared from {back} (reset-" in out and f"extra: e.g. watermarks {micros_text(hi)}" in out, out
    assert main(["--config", config_file, "verify", "--json"]) == 1  # scripts keep the integers, and the kind
    (report,) = json.loads(capsys.readouterr().out)
    assert report["committed_hi"] == hi - 1 and report["watermark_kind"] == "timestamptz", report
    # An integer is no time here (1764547200 would be 1970-01-01T00:29Z: a reset back re-sending everything), also
    # once the table is gone and its newest progress record is a reset (integer key): the kind then comes from the
    # newest slice in the table's progress.
    with pg_engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {name}"))
    assert main(["--config", config_file, "reset", "--table", table.table_id, "--after", "1764547200"]) == 2
    err = capsys.readouterr().err
    assert "--after 1764547200 is an integer, but the table's watermark is a timestamp" in err, err
    assert "would be 1970-01-01T00:29:24.547200Z" in err and "Traceback" not in err, err
    assert h.progress(table).hi == hi - 1


@pytest.mark.integration
def test_mariadb_datetime_watermark_equal_times_and_out_of_order_commits(
        services, mariadb_database, dagster_instance, spark, name) -> None:
    # CURRENT_TIMESTAMP(6) is the session's local time: writers in UTC, whatever the server's global zone (another
    # test sets it to +05:00 for a while; rows written in two zones would not be in time order).
    mariadb_engine = create_engine(mariadb_database, connect_args={"init_command": "SET time_zone = '+00:00'"})
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id CHAR(36) PRIMARY KEY, n INT NOT NULL, "
                          "created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), INDEX (created_at))"))
        for first in (1, 301):  # one statement: 300 rows share its CURRENT_TIMESTAMP(6)
            conn.execute(text(f"INSERT INTO {name} (id, n) SELECT UUID(), seq FROM seq_{first}_to_{first + 299}"))
    cfg = relay_config(services, {"src": mariadb_database}, [
        {"source": "src", "table": name, "watermark": "created_at", "tie_break": "n", "slice_max_rows": 200,
         "settle_seconds": 0.5, "key": ["id"]}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    keys = h.drain(table)
    assert all(TIME_KEY.match(k) for k in keys) and [h.materialization(table, k)["rows"] for k in keys] == [300, 300]
    first_hi = h.progress(table).hi

    slow = mariadb_engine.connect()
    try:
        slow.execute(text("BEGIN"))
        slow.execute(text(f"INSERT INTO {name} (id, n) SELECT UUID(), seq FROM seq_601_to_650"))
        with mariadb_engine.begin() as conn:
            conn.execute(text(f"INSERT INTO {name} (id, n) SELECT UUID(), seq FROM seq_651_to_700"))
        import time

        time.sleep(1.0)  # past settle_seconds: only the open transaction holds the cut now
        assert h.tick(table) == [] and h.progress(table).hi == first_hi
        slow.execute(text("COMMIT"))
    finally:
        slow.close()
    h.drain(table)
    messages = read_topic(services.kafka_bootstrap, table.topic_name)
    with mariadb_engine.connect() as conn:
        ids = [r[0] for r in conn.execute(text(f"SELECT id FROM {name}"))]
    mariadb_engine.dispose()
    assert len(ids) == 700
    assert_exactly_once(messages, ids)
    ordered = _ordered(messages)
    assert ordered == sorted(ordered) and [n for _, n in ordered] == list(range(1, 701))


def _relayed_datetime_table(services, mariadb_database, dagster_instance, name):
    """A MariaDB table (n, created_at DATETIME(6) DEFAULT CURRENT_TIMESTAMP(6)) with row 1 relayed, written in UTC;
    (its engine, config, harness, table) for the running-statement guard's cases."""
    engine = create_engine(mariadb_database, connect_args={"init_command": "SET time_zone = '+00:00'"},
                           isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f"CREATE TABLE {name} (n INT PRIMARY KEY, created_at DATETIME(6) NOT NULL "
                          "DEFAULT CURRENT_TIMESTAMP(6), INDEX (created_at))"))
        conn.execute(text(f"INSERT INTO {name} (n) VALUES (1)"))
    cfg = relay_config(services, {"src": mariadb_database}, [
        {"source": "src", "table": name, "watermark": "created_at", "settle_seconds": 0.5, "key": ["n"]}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    h.drain(table)
    return engine, cfg, h, table


@pytest.mark.integration
def test_mariadb_statement_whose_time_predates_its_innodb_transaction_holds_the_cut(
        services, mariadb_database, dagster_instance, spark, name) -> None:
    """A row's CURRENT_TIMESTAMP(6) is its statement's start, but InnoDB lists the statement's transaction only
    once it first touches a row: an INSERT whose expression takes seconds (a slow function, a subquery on a
    non-InnoDB table, a lock wait) wrote a time below a row committed meanwhile, which was cut once settled: the
    slow row committed below progress and was never sent. Here it runs inside a transaction that
    stays open after it. A long report query, which writes nothing, does not hold the cut."""
    import threading
    import time

    engine, cfg, h, table = _relayed_datetime_table(services, mariadb_database, dagster_instance, name)

    def slow_insert() -> None:  # its row's time is its statement's start; InnoDB sees it 4 s later
        with engine.connect() as conn:
            conn.execute(text("BEGIN"))
            conn.execute(text(f"INSERT INTO {name} (n) VALUES (2 + SLEEP(4))"))
            time.sleep(2.0)  # the transaction stays open after the statement
            conn.execute(text("COMMIT"))

    writer = threading.Thread(target=slow_insert)
    writer.start()
    time.sleep(0.5)
    with engine.connect() as conn:
        conn.execute(text(f"INSERT INTO {name} (n) VALUES (3)"))
    while writer.is_alive():  # the daemon's ticks meanwhile: whatever they cut is published at once
        for key in h.tick(table):
            h.run(table, key)
        time.sleep(0.3)
    writer.join()
    h.drain(table)
    with engine.connect() as conn:
        times = dict(conn.execute(text(f"SELECT n, created_at FROM {name}")).all())
    assert times[2] < times[3], "the slow row's time is below the row committed while it ran"
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), [1, 2, 3], id_field="n")
    assert verify_table(cfg, table).ok

    # A report query running for seconds is no write: rows committed meanwhile are cut as usual.
    report_errors: list[BaseException] = []

    def long_report() -> None:
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT SLEEP(6)"))
        except BaseException as exc:  # noqa: BLE001 - asserted below: without the SELECT the case proves nothing
            report_errors.append(exc)

    report = threading.Thread(target=long_report)
    report.start()
    with engine.connect() as conn:  # the SELECT is running before the row and the cut
        assert polled(lambda: conn.execute(text("SELECT COUNT(*) FROM information_schema.processlist "
                                                "WHERE info = 'SELECT SLEEP(6)'")).scalar(), bool, 5.0)
    with engine.connect() as conn:
        conn.execute(text(f"INSERT INTO {name} (n) VALUES (4)"))
    started = time.monotonic()
    assert h.cut(table, timeout=4.0), "a running SELECT held the cut"
    assert time.monotonic() - started < 4.0
    report.join()
    assert not report_errors, report_errors
    engine.dispose()


@pytest.mark.integration
def test_mariadb_event_scheduler_statement_holds_the_cut(services, dagster_instance, spark, name) -> None:
    """The same slow INSERT run by the event scheduler: its thread's COMMAND is 'Connect', not 'Query', so the
    running-statement guard did not see it; the row committed meanwhile was cut once settled, and the event's row
    (its time the statement's start, 4 s earlier) committed below progress and was never sent.
    The scheduler is server-wide: it runs on a server of the test's own, started with it on."""
    from tests.private_servers import private_mariadb_database

    with private_mariadb_database("--event-scheduler=ON") as (_, mariadb_database):
        engine, cfg, h, table = _relayed_datetime_table(services, mariadb_database, dagster_instance, name)
        try:
            _event_inserts_while_ticks_publish(engine, h, table, name)
            h.drain(table)
            with engine.connect() as conn:
                times = dict(conn.execute(text(f"SELECT n, created_at FROM {name}")).all())
            assert times[2] < times[3], "the event's row's time is below the row committed while it ran"
            assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), [1, 2, 3], id_field="n")
            assert verify_table(cfg, table).ok
        finally:
            engine.dispose()


def _event_inserts_while_ticks_publish(engine, h: Harness, table, name: str) -> None:
    """An event inserts row 2 in a 4 s statement; row 3 commits meanwhile; the daemon's ticks publish what they cut."""
    import time

    with engine.connect() as conn:
        assert conn.execute(text("SELECT @@GLOBAL.event_scheduler")).scalar() == "ON"
        conn.execute(text(f"CREATE EVENT {name}_e ON SCHEDULE AT CURRENT_TIMESTAMP ON COMPLETION NOT PRESERVE "
                          f"DO INSERT INTO {name} (n) VALUES (2 + SLEEP(4))"))
        running = polled(lambda: conn.execute(text(
            "SELECT COMMAND FROM information_schema.PROCESSLIST WHERE INFO LIKE '%SLEEP(4)%' "
            "AND ID <> CONNECTION_ID()")).scalar(), bool, 10.0)
        assert running == "Connect", running  # what the case is about: not a 'Query'
        conn.execute(text(f"INSERT INTO {name} (n) VALUES (3)"))
        while conn.execute(text(f"SELECT COUNT(*) FROM {name} WHERE n = 2")).scalar() == 0:
            for key in h.tick(table):
                h.run(table, key)
            time.sleep(0.3)


BULK_INSERT_JAVA = """
import java.sql.*;
public class BulkInsert {
  public static void main(String[] a) throws Exception {
    try (Connection c = DriverManager.getConnection(a[0], a[1], a[2])) {
      c.createStatement().execute("SET time_zone = '+00:00'");
      PreparedStatement ps = c.prepareStatement(a[3]);
      for (int n : new int[] {2, 5}) { ps.setInt(1, n); ps.setInt(2, n); ps.addBatch(); }
      ps.executeBatch();  // one COM_STMT_BULK_EXECUTE (Connector/J 3's default for a batch of inserts)
    }
  }
}
"""


@pytest.mark.integration
def test_mariadb_driver_batch_insert_holds_the_cut(services, mariadb_database, dagster_instance, spark, name,
                                                  tmp_path) -> None:
    """A JDBC batch insert (Connector/J's `executeBatch`) runs as COMMAND 'Bulk_execute', which the
    running-statement guard did not look at: a row committed meanwhile was cut once settled, and the batch's rows
    (their time the statement's start, 4 s earlier) committed below progress and were never sent. Real Connector/J, as a
    Java application writing the table would use it."""
    import subprocess
    import time

    engine, cfg, h, table = _relayed_datetime_table(services, mariadb_database, dagster_instance, name)
    (tmp_path / "BulkInsert.java").write_text(BULK_INSERT_JAVA)
    driver = next(j for j in services.jdbc_jars.split(",") if "mariadb-java-client" in j)
    url = (f"jdbc:mariadb://{services.mariadb_host}:{services.mariadb_port}/{mariadb_database.database}"
           "?useBulkStmts=true")
    batch = subprocess.Popen(["java", "-cp", driver, str(tmp_path / "BulkInsert.java"), url, services.mariadb_user,
                              services.mariadb_password,
                              f"INSERT INTO {name} (n) VALUES (? + SLEEP(IF(? = 2, 4, 0)))"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with engine.connect() as conn:
            running = polled(lambda: conn.execute(text(
                "SELECT COMMAND FROM information_schema.PROCESSLIST WHERE INFO LIKE '%SLEEP(IF%' "
                "AND ID <> CONNECTION_ID()")).scalar(), lambda command: command == "Bulk_execute", 30.0)
            # What the case is about (the statement shows as 'Prepare' a moment first).
            assert running == "Bulk_execute", (running, batch.poll())
            conn.execute(text(f"INSERT INTO {name} (n) VALUES (3)"))
        while batch.poll() is None:  # the daemon's ticks meanwhile: whatever they cut is published at once
            for key in h.tick(table):
                h.run(table, key)
            time.sleep(0.3)
    finally:
        if batch.poll() is None:
            batch.kill()
        output = batch.communicate(timeout=30)[0]
    assert batch.returncode == 0, output
    h.drain(table)
    with engine.connect() as conn:
        times = dict(conn.execute(text(f"SELECT n, created_at FROM {name}")).all())
    engine.dispose()
    assert times[2] < times[3], "the batch's rows' time is below the row committed while it ran"
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), [1, 2, 3, 5], id_field="n")
    assert verify_table(cfg, table).ok


@pytest.mark.integration
def test_null_timestamp_is_a_clear_error_and_nothing_moves(services, pg_database, pg_engine, dagster_instance,
                                                             spark, name, monkeypatch) -> None:
    import orchestration.cutting

    h, keys = _relayed_time_table(services, pg_database, pg_engine, dagster_instance, name, "NULL", rows=2)
    table = h.table()
    assert len(keys) == 1
    before = h.progress(table)
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (n, created_at) VALUES (3, NULL)"))
        conn.execute(text(f"INSERT INTO {name} (n) VALUES (4)"))
    # The sensor trusts a clean NULL check for a minute; forget it, as a minute later.
    orchestration.cutting._NULLS_OK.clear()
    with pytest.raises(Exception, match=r"NULL in watermark column 'created_at' would never be sent") as ticked:
        h.tick(table)
    assert f"values above the table's committed watermark {micros_text(before.hi)}" in str(ticked.value)
    # A run of a slice above progress refuses too, before anything is read or published.
    later = SliceRange(before.hi, before.hi + 10**9, timestamps=True)
    dagster_instance.add_dynamic_partitions(f"{table.dagster_name}__slices", [later.key])
    result = h.run(table, later.key, raise_on_error=False)
    assert not result.success and "NULL in watermark column 'created_at'" in failure_text(result)
    # Filling them is a fix only above the committed watermark: the message names it (it said "or fill it").
    assert f"values above the table's committed watermark {micros_text(before.hi)}" in failure_text(result)
    assert h.progress(table) == before
    assert sorted(m.value["n"] for m in read_topic(services.kafka_bootstrap, table.topic_name)) == [1, 2]


@pytest.mark.integration
def test_unsupported_timestamp_watermarks_are_refused_clearly(services, mariadb_engine, mariadb_database,
                                                              tmp_path, name) -> None:
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (n INT PRIMARY KEY, ts TIMESTAMP(6) NOT NULL)"))
    with pytest.raises(SourceError, match=r"must be DATETIME"):
        SourceDatabaseResource(url=str(mariadb_database.render_as_string(hide_password=False))).table_shape(
            None, name, "ts")
    sqlite = create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    with sqlite.begin() as conn:
        conn.execute(text("CREATE TABLE t (n INTEGER PRIMARY KEY, ts DATETIME)"))
    with pytest.raises(SourceError, match=r"timestamp watermarks are supported on PostgreSQL and MariaDB"):
        SourceDatabaseResource(url=f"sqlite:///{tmp_path / 'x.db'}").table_shape(None, "t", "ts")
    with pytest.raises(SourceError, match=r"tie_break column 'nope' does not exist"):
        SourceDatabaseResource(url=f"sqlite:///{tmp_path / 'x.db'}").table_shape(None, "t", "n", tie_break="nope")


@pytest.mark.integration
@pytest.mark.parametrize("dialect", ["postgresql", "mariadb"])
def test_large_time_slice_through_spark_connect_partitioned_reads(
        services, request, dagster_instance, name, dialect: str) -> None:
    """One 60k-row slice: Spark Connect reads it in two partitions split by time; three rows share each
    millisecond. Zone-less values (PostgreSQL timestamp, MariaDB DATETIME) keep their wall-clock time."""
    rows = 60_000
    database = request.getfixturevalue("pg_database" if dialect == "postgresql" else "mariadb_database")
    engine = request.getfixturevalue("pg_engine" if dialect == "postgresql" else "mariadb_engine")
    with engine.begin() as conn:
        if dialect == "postgresql":
            conn.execute(text(f"CREATE TABLE {name} (n int PRIMARY KEY, created_at timestamp NOT NULL)"))
            conn.execute(text(f"INSERT INTO {name} SELECT g, timestamp '2026-03-29 00:59:59.5' + (g / 3) * "
                              f"interval '1 millisecond' FROM generate_series(1, {rows}) g"))
        else:
            conn.execute(text(f"CREATE TABLE {name} (n INT PRIMARY KEY, created_at DATETIME(6) NOT NULL, "
                              "INDEX (created_at))"))
            conn.execute(text(f"INSERT INTO {name} SELECT seq, TIMESTAMP'2026-03-29 00:59:59.5' + INTERVAL "
                              f"(seq DIV 3) * 1000 MICROSECOND FROM seq_1_to_{rows}"))
    cfg = relay_config(services, {"src": database}, [
        {"source": "src", "table": f"public.{name}" if dialect == "postgresql" else name, "watermark": "created_at",
         "tie_break": "n", "slice_max_rows": 500_000, "settle_seconds": 0, "key": ["n"]}], spark_remote=True)
    h = Harness(cfg, dagster_instance)
    table = h.table()
    (key,) = h.drain(table, timeout=300)
    assert key == "1970-01-01T00:00:00.000000Z_2026-03-29T01:00:19.500000Z"  # the last row's time, as stored
    assert h.materialization(table, key)["rows"] == rows
    messages = read_topic(services.kafka_bootstrap, table.topic_name, timeout=120)
    assert_exactly_once(messages, list(range(1, rows + 1)), id_field="n")
    ordered = [m.value["n"] for m in sorted(messages, key=lambda m: m.offset)]
    assert ordered == list(range(1, rows + 1))
    # The wall-clock time as stored (01:00 UTC on a European DST night is not shifted) and its watermark header.
    first = min(messages, key=lambda m: m.offset)
    assert first.value["created_at"] == "2026-03-29T00:59:59.500000"
    assert first.watermark == datetime_to_micros(datetime(2026, 3, 29, 0, 59, 59, 500000))


@pytest.mark.integration
@pytest.mark.parametrize(("dialect", "declared"), [("postgresql", "timestamp(0)"), ("mariadb", "DATETIME"),
                                                   ("postgresql", "timestamptz"), ("mariadb", "DATETIME(6)")])
def test_whole_second_times_are_not_cut_while_their_second_can_still_be_written(
        services, request, dagster_instance, spark, name, dialect: str, declared: str) -> None:
    """PostgreSQL timestamp(0) and MariaDB DATETIME hold whole seconds. A transaction that starts after the sensor
    saw the max, while the database clock is still in the max's second, writes the max's own value; it waits for
    nothing, so the cut went up to the max and that transaction's row, committed after the slice was read, was
    never sent. The cut now stops one microsecond below the max while the clock is in its second. The same holds for
    whole seconds in a column declared with fractions (`timestamptz`, `DATETIME(6)`: a `date_trunc('second', now())`
    default, MariaDB's NOW()): what counts is the values the column holds, not its declared precision.

    The max is put well ahead of the clock (an explicit value), so "the clock is in the max's second" holds for as
    long as the test needs it, as it holds for up to a second for writers' own now(): a PostgreSQL cut also waits
    for every transaction in the cluster, which the parallel tests' writes may hold open for seconds (CI once cut
    9 s after the insert, past an 8-s lead, and the test lost its premise). A later row then ends the max's
    second for the relay, so the test does not wait for the clock."""
    if dialect == "postgresql":
        url = request.getfixturevalue("pg_database")
        engine = create_engine(url)
        # The session's time, as `DEFAULT now()` stores it in a timestamp: the server's zone.
        now = "LOCALTIMESTAMP" if declared == "timestamp(0)" else "now()"
        ahead = f"date_trunc('second', {now}) + interval '60 seconds'"
        past = f"{now} - interval '1 hour'"
        table_name = f"public.{name}"
    else:
        url = request.getfixturevalue("mariadb_database")
        engine = create_engine(url)
        ahead = "UTC_TIMESTAMP() + INTERVAL 60 SECOND"
        past = "UTC_TIMESTAMP(6) - INTERVAL 1 HOUR"
        table_name = name
    column = declared
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (n int PRIMARY KEY, created_at {column} NOT NULL)"))
        conn.execute(text(f"INSERT INTO {name} VALUES (1, {past}), (2, {ahead})"))
        top = conn.execute(text(f"SELECT max(created_at) FROM {name}")).scalar()
    cfg = relay_config(services, {"src": url}, [
        {"source": "src", "table": table_name, "watermark": "created_at", "key": ["n"], "settle_seconds": 0.2}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    keys = h.cut(table)
    assert keys
    cut_to = max(SliceRange.from_key(k).hi for key in keys for k in h.expand(table, key))
    assert cut_to < datetime_to_micros(top), f"the cut took the max {top} while its second could still be written"
    with engine.connect() as writer:
        writer.execute(text("BEGIN"))
        # The max's own value, written by a transaction that began after the look (as now() in that second would).
        writer.execute(text(f"INSERT INTO {name} VALUES (3, :top)"), {"top": top})
        for key in keys:
            h.run(table, key)
        writer.execute(text("COMMIT"))
    with engine.begin() as conn:  # a later max: the relay may now take the old max's second whole
        conn.execute(text(f"INSERT INTO {name} VALUES (4, :later)"), {"later": top + timedelta(seconds=1)})
    h.drain(table, until_hi=datetime_to_micros(top), timeout=60)
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), [1, 2, 3], id_field="n")
    engine.dispose()


@pytest.mark.integration
@pytest.mark.parametrize("dialect", ["postgresql", "mariadb"])
def test_whole_seconds_written_into_a_fractional_column_are_final_only_once_their_second_has_passed(
        request, name, dialect: str) -> None:
    """A `timestamptz DEFAULT date_trunc('second', now())` (PostgreSQL) or a `DATETIME(6)` written with NOW()
    (MariaDB) holds whole seconds though its type holds microseconds. The max S.000000 was seen; a transaction that
    begins after that look, within the same second, writes S.000000 too, waits for nothing the look saw, and commits
    after the slice is read: its row lay at or below committed progress and was never sent. A candidate at or above
    such a writer's time must not turn final while it is open; and the second's rows are relayed once the database
    clock has left it."""
    if dialect == "postgresql":
        url = request.getfixturevalue("pg_database")
        ddl = f"CREATE TABLE {name} (n serial PRIMARY KEY, at timestamptz NOT NULL DEFAULT date_trunc('second', now()))"
        insert, fraction = f"INSERT INTO {name} DEFAULT VALUES", "SELECT date_part('microseconds', clock_timestamp())"
    else:
        url = request.getfixturevalue("mariadb_database")
        ddl = f"CREATE TABLE {name} (n int AUTO_INCREMENT PRIMARY KEY, at DATETIME(6) NOT NULL, INDEX (at))"
        insert, fraction = f"INSERT INTO {name} (at) VALUES (NOW())", "SELECT MICROSECOND(NOW(6))"
    engine = create_engine(url)
    source = SourceDatabaseResource(url=source_url(url))
    try:
        with engine.begin() as conn:
            conn.execute(text(ddl))
        shape = source.table_shape(None if dialect == "mariadb" else "public", name, "at")
        for _ in range(5):  # each try needs the look and the writer in one second of the database clock
            with engine.connect() as conn:
                while int(conn.execute(text(fraction)).scalar()) % 1_000_000 > 200_000:
                    time.sleep(0.02)
                    conn.rollback()
            with engine.begin() as conn:
                conn.execute(text(insert))
                top = conn.execute(text(f"SELECT max(at) FROM {name}")).scalar()
            seen = _observed(source, shape)
            with engine.connect() as writer:
                writer.execute(text(insert))  # a transaction begun after the look
                written = writer.execute(text(f"SELECT max(at) FROM {name}")).scalar()
                if written != top:
                    writer.rollback()  # the clock left the second in between: try again
                    continue
                if datetime_to_micros(written) <= seen.watermark:
                    assert not polled(partial(source.is_final, seen, 0), bool, timeout=5), (
                        f"{seen} turned final while a transaction begun after the look holds a row at {written}, "
                        "below it: committed after the slice's read, that row would never be sent")
                writer.commit()
            break
        else:
            pytest.fail("the look and the writer never fell in one second of the database clock in 5 tries")
        # A column of whole seconds still makes progress: once the clock has left S, S is final.
        def final_past_top() -> bool:
            later = _observed(source, shape)
            return later.watermark >= datetime_to_micros(top) and source.is_final(later, 0)

        assert polled(final_past_top, bool, timeout=20), f"rows at {top} never turned final"
    finally:
        source.dispose()
        engine.dispose()


def _observed(source: SourceDatabaseResource, shape) -> WatermarkCandidate:
    """`observe`, asked again while MariaDB's innodb_trx cache stays stale (other clients of the shared server)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            seen = source.observe(shape)
            assert seen is not None
            return seen
        except InnodbTrxStale:
            assert time.monotonic() < deadline, "innodb_trx stayed stale for 30 s"


@pytest.mark.integration
def test_a_time_as_start_after_of_an_integer_watermark_is_refused(services, pg_database, pg_engine,
                                                                  dagster_instance, name) -> None:
    """`start_after: 2026-01-01T00:00:00Z` on an id watermark became 1.767e15 microseconds: every id below it was
    skipped silently and the table looked caught up. Refused
    before the first cut, nothing cut or sent; an id works."""
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v int)"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT g FROM generate_series(1, 5) g"))
    table_cfg = {"source": "src", "table": f"public.{name}", "watermark": "id", "start_after": "2026-01-01T00:00:00Z"}
    h = Harness(relay_config(services, {"src": pg_database}, [table_cfg]), dagster_instance)
    table = h.table()
    with pytest.raises(SourceError, match=r"start_after 2026-01-01T00:00:00\+00:00 is a time, but watermark column "
                                          r"'id' is an integer.*nothing was cut or sent"):
        h.tick(table)
    assert h.progress(table) is None
    assert dagster_instance.get_dynamic_partitions(f"{table.dagster_name}__slices") == []
    h = Harness(relay_config(services, {"src": pg_database}, [{**table_cfg, "start_after": 2}]), dagster_instance)
    h.drain(h.table(), until_hi=5)
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), [3, 4, 5])


@pytest.mark.integration
def test_postgres_times_before_the_year_1000_are_relayed(services, pg_database, pg_engine, dagster_instance, spark,
                                                        name) -> None:
    """Keys, the read's bounds and the SQL literals write the year in four digits: year 500 was keyed "500-…", and
    every tick and run refused it as "not a slice partition key"."""
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (n int PRIMARY KEY, created_at timestamp NOT NULL)"))
        conn.execute(text(f"INSERT INTO {name} VALUES (1, '0500-03-14 01:02:03.000004'), "
                          "(2, '0999-12-31 23:59:59.999999'), (3, '2026-11-29 00:00:00')"))
    cfg = relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "created_at", "key": ["n"],
         "start_after": "0001-01-01T00:00:00Z", "slice_max_rows": 1}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    keys = h.drain(table)
    assert keys[0] == "0001-01-01T00:00:00.000000Z_0500-03-14T01:02:03.000004Z", keys
    assert all(TIME_KEY.match(k) for k in keys) and len(keys) == 3, keys
    messages = read_topic(services.kafka_bootstrap, table.topic_name)
    assert_exactly_once(messages, [1, 2, 3], id_field="n")
    assert sorted(m.value["created_at"] for m in messages)[0].startswith("0500-03-14")
