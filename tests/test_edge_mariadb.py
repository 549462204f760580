"""MariaDB edges of the safe high watermark and of table checks (XA transactions whose client went
away, running statements in another time zone, ON UPDATE and zero-date watermarks, a table re-created past the old
table's pending max), and two PostgreSQL type and name edges. Real MariaDB, PostgreSQL (and Kafka and Spark where a
run is needed)."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime

import pymysql
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, Engine

from orchestration.cutting import SensorState
from resources.slices import SliceRange, WatermarkCandidate
from resources.source_database import SourceDatabaseResource, SourceError
from tests.pipeline import Harness, assert_exactly_once, read_topic, relay_config, source_url
from tests.test_edge_watermarks import observe_when_fresh

pytestmark = pytest.mark.integration


def final_within(source: SourceDatabaseResource, candidate: WatermarkCandidate, seconds: float) -> bool:
    """Whether `candidate` turns final within `seconds` (innodb_trx is a cache: asked a few times)."""
    deadline = time.monotonic() + seconds
    while not source.is_final(candidate, 0):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def raw_connection(url: URL) -> pymysql.connections.Connection:
    return pymysql.connect(host=url.host, port=url.port, user=url.username, password=url.password,
                           database=url.database, autocommit=True)


@contextlib.contextmanager
def prepared_xa_holding_id_2(mariadb_database: URL, mariadb_engine: Engine, name: str
                             ) -> Iterator[tuple[str, pymysql.connections.Connection, pymysql.connections.Connection]]:
    """Table `name` with id 1 committed, id 2 inserted by an XA transaction now prepared (its client, `xa`, still
    connected) and id 3 committed by `admin`. Yields (xid, xa, admin). Never left prepared: it would hold every cut
    on the server. The client is closed first: another connection's XA ROLLBACK reaches only a detached
    transaction (a failure with the client attached left one)."""
    xid = f"rr_{uuid.uuid4().hex[:12]}"
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint AUTO_INCREMENT PRIMARY KEY, v int) ENGINE=InnoDB"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES (1)"))
    xa = raw_connection(mariadb_database)
    admin = raw_connection(mariadb_database)
    try:
        with xa.cursor() as cur:
            cur.execute(f"XA START '{xid}'")
            cur.execute(f"INSERT INTO {name} (v) VALUES (2)")  # id 2, uncommitted
            cur.execute(f"XA END '{xid}'")
            cur.execute(f"XA PREPARE '{xid}'")
        with admin.cursor() as cur:
            cur.execute(f"INSERT INTO {name} (v) VALUES (3)")  # id 3, committed
        time.sleep(0.15)  # innodb_trx's cache
        yield xid, xa, admin
    finally:
        if xa.open:
            xa.close()
        with admin.cursor() as cur, contextlib.suppress(pymysql.MySQLError):
            cur.execute(f"XA ROLLBACK '{xid}'")
        admin.close()


# --------------------------------------------------------------------------- 1. XA transaction, client gone


def test_mariadb_prepared_xa_transaction_whose_client_disconnected_still_holds_the_cut(
        services, mariadb_database, mariadb_engine, name) -> None:
    """XA START; INSERT id 2; XA END; XA PREPARE, then the client disconnects (a transaction manager's connection
    lost or recycled): MariaDB keeps the prepared transaction, detached (innodb_trx: thread id 0, same trx_id and
    start), until XA COMMIT or ROLLBACK. It was taken as ended and the cut passed id 2, which a transaction
    manager's recovery then committed below progress: never sent."""
    source = SourceDatabaseResource(url=source_url(mariadb_database))
    with prepared_xa_holding_id_2(mariadb_database, mariadb_engine, name) as (xid, xa, admin):
        try:
            seen = observe_when_fresh(source, source.table_shape(None, name, "id"))
            assert seen is not None and seen.watermark == 3 and seen.waits
            assert not final_within(source, seen, 0.5), "final while the XA transaction was attached"
            xa.close()  # the client goes away; the prepared transaction stays
            with admin.cursor() as cur:
                cur.execute("XA RECOVER")
                assert any(row[3] == xid.encode() for row in cur.fetchall()), "no detached XA transaction to test"
            time.sleep(0.3)  # innodb_trx's cache refreshed
            assert not final_within(source, seen, 2.0), (
                f"{seen} called final while XA transaction {xid!r}, holding id 2, was prepared and detached")
            with admin.cursor() as cur:
                cur.execute(f"XA COMMIT '{xid}'")  # the transaction manager's recovery
            assert final_within(source, seen, 10.0), f"{seen} held after the XA transaction committed"
        finally:
            source.dispose()


def test_mariadb_sensor_tick_names_the_transaction_that_holds_its_rows(services, mariadb_database, mariadb_engine,
                                                                     dagster_instance, name) -> None:
    """While a transaction held new rows back, the tick said only "Sensor function returned an empty result" in the
    UI, even for a prepared XA transaction whose client disconnected, which never ends by itself.
    The skip message now names the rows held, what holds them (the connection; for a detached XA transaction: that
    it needs XA COMMIT or XA ROLLBACK), and the runbook entry."""
    with prepared_xa_holding_id_2(mariadb_database, mariadb_engine, name) as (xid, xa, admin):
        h = Harness(relay_config(services, {"src": mariadb_database},
                                 [{"source": "src", "table": name, "watermark": "id", "settle_seconds": 0}]),
                    dagster_instance)
        table = h.table()
        assert h.tick(table) == [], "cut while id 2 was uncommitted"
        attached = h.skip_messages[table.table_id] or ""
        assert f"{table.table_id}: rows above 0 (up to 3) are not final yet" in attached, attached
        assert f"of connection {xa.thread_id()}" in attached, attached  # the XA client, still connected
        xa.close()  # the client goes away; the prepared transaction stays, detached
        time.sleep(0.3)  # innodb_trx's cache refreshed
        assert h.tick(table) == [], "cut while the detached XA transaction held id 2"
        detached = h.skip_messages[table.table_id] or ""
        assert "rows above 0 (up to 3) are not final yet" in detached, detached
        assert "a prepared XA transaction" in detached and "will not end on its own" in detached, detached
        assert "XA COMMIT or XA ROLLBACK" in detached and "XA RECOVER" in detached, detached
        assert 'docs/operations.md, "New rows are not cut"' in detached, detached
        with admin.cursor() as cur:
            cur.execute(f"XA COMMIT '{xid}'")  # the transaction manager's recovery
        assert h.cut(table, timeout=30) == [SliceRange(0, 3).key], h.skip_messages[table.table_id]


# --------------------------------------------------------------------------- 2. running statements, server zone


@pytest.mark.parametrize("zone", ["-05:00", "+05:30"])
def test_mariadb_running_insert_holds_a_datetime_cut_in_the_servers_time_zone(
        name, zone: str) -> None:
    """A DATETIME(6) DEFAULT CURRENT_TIMESTAMP(6) row takes its statement's start in the writer's zone, the server's
    default. The cut's cap below a still-running INSERT was computed in UTC and compared with those wall-clock
    values: at -05:00 the row of an `INSERT ... SLEEP` was cut past (lost), at +05:30 the cut was held 5.5 hours
    behind. Here the writers and rowrelay are in the server's default zone, on a server of the
    test's own: a zone set on a shared one reaches every other test's connections."""
    from resources.slices import datetime_to_micros
    from tests.private_servers import private_mariadb_database

    with private_mariadb_database(f"--default-time-zone={zone}") as (_, mariadb_database):
        writers = create_engine(mariadb_database, isolation_level="AUTOCOMMIT")
        source = SourceDatabaseResource(url=source_url(mariadb_database))
        slow_error: list[BaseException] = []

        def slow_insert() -> None:  # row 2's time is its statement's start; InnoDB lists it only 3 s later
            try:
                with writers.connect() as conn:
                    conn.execute(text(f"INSERT INTO {name} (n) VALUES (2 + SLEEP(3))"))
            except BaseException as exc:  # noqa: BLE001 - asserted below
                slow_error.append(exc)

        try:
            with writers.connect() as conn:
                assert conn.execute(text("SELECT @@session.time_zone")).scalar() == zone
                conn.execute(text(f"CREATE TABLE {name} (n INT PRIMARY KEY, created_at DATETIME(6) NOT NULL "
                                  "DEFAULT CURRENT_TIMESTAMP(6), INDEX (created_at))"))
                conn.execute(text(f"INSERT INTO {name} (n) VALUES (1)"))
            shape = source.table_shape(None, name, "created_at")
            writer = threading.Thread(target=slow_insert)
            writer.start()
            time.sleep(0.5)
            with writers.connect() as conn:
                conn.execute(text(f"INSERT INTO {name} (n) VALUES (3)"))  # committed while row 2's INSERT runs
            seen = observe_when_fresh(source, shape)
            writer.join()
            assert not slow_error, slow_error
            with writers.connect() as conn:
                times: dict[int, datetime] = dict(conn.execute(text(f"SELECT n, created_at FROM {name}")).all())
        finally:
            source.dispose()
            writers.dispose()
    assert seen is not None and times[1] < times[2] < times[3]
    assert seen.watermark < datetime_to_micros(times[2]), (
        f"cut candidate {seen.watermark} at or above row 2 ({times[2]}), still being inserted when seen ({zone})")
    assert seen.watermark >= datetime_to_micros(times[1]), (
        f"cut candidate {seen.watermark} below row 1 ({times[1]}), committed before the running INSERT ({zone})")


# --------------------------------------------------------------------------- 3. ON UPDATE watermark


def test_mariadb_watermark_set_on_update_is_refused(mariadb_database, mariadb_engine, name) -> None:
    """`DATETIME(6) ... ON UPDATE CURRENT_TIMESTAMP(6)` as the watermark: an UPDATE lifted a row already sent above
    progress and it was sent again. Refused at the table check, naming the fix."""
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (n INT PRIMARY KEY, created_at DATETIME(6) NOT NULL DEFAULT "
                          "CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6), INDEX (created_at))"))
        conn.execute(text(f"INSERT INTO {name} (n) VALUES (1)"))
    source = SourceDatabaseResource(url=source_url(mariadb_database))
    try:
        with pytest.raises(SourceError, match=rf"{name}: watermark column 'created_at' is set on every UPDATE "
                                              r"\(on update current_timestamp\(6\)\).*Drop the clause.*"
                                              r"choose a watermark that is set once"):
            source.table_shape(None, name, "created_at")
        with mariadb_engine.begin() as conn:  # the remedy: the same column without ON UPDATE
            conn.execute(text(f"ALTER TABLE {name} MODIFY created_at DATETIME(6) NOT NULL "
                              "DEFAULT CURRENT_TIMESTAMP(6)"))
        assert source.table_shape(None, name, "created_at").watermark_kind == "timestamp"
    finally:
        source.dispose()


# --------------------------------------------------------------------------- 4. zero dates in a watermark


@pytest.mark.parametrize("zero", ["0000-00-00 00:00:00", "2024-05-00 10:00:00"])
def test_mariadb_zero_datetime_watermark_is_a_clear_error(services, mariadb_database, mariadb_engine,
                                                          dagster_instance, name, zero: str) -> None:
    """A DATETIME watermark holding a zero date, or a zero day (the default sql_mode accepts both; pymysql returns
    them as text), failed every sensor tick with a bare "invalid literal for int()". Now the
    tick fails naming the table, the column, the value and the remedy, before anything is cut; the `where:` it
    names lets the table relay."""
    from tests.pipeline import Harness, relay_config

    writer = create_engine(mariadb_database, connect_args={"init_command": "SET sql_mode = ''"})
    with writer.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint AUTO_INCREMENT PRIMARY KEY, at DATETIME(6) NOT NULL, "
                          "INDEX (at))"))
        for at in ("2024-04-29 10:00:00", zero):  # the zero-in-date value sorts last: the max a tick sees
            conn.execute(text(f"INSERT INTO {name} (at) VALUES (:at)"), {"at": at})
    writer.dispose()
    table = {"source": "src", "table": name, "watermark": "at", "settle_seconds": 0.2}
    if zero.startswith("2024"):  # start_after unset asks first for rows below 1970: a zero date is one of them
        table["start_after"] = "2024-01-01T00:00:00Z"
    h = Harness(relay_config(services, {"src": mariadb_database}, [table]), dagster_instance)
    with pytest.raises(SourceError, match=(
            rf"{name}: watermark column 'at' holds '{zero}\.000000', a DATETIME with a zero date, month or day.*"
            r"Fix those rows.*a `start_after` skips them.*unless one is the table's newest.*"
            r"`where: at >= '1000-01-01' AND MONTH\(at\) > 0 AND DAYOFMONTH\(at\) > 0`")):
        h.tick(h.table())
    assert h.progress(h.table()) is None

    with mariadb_engine.begin() as conn:  # the odd row no longer the newest: the `where:` it names then serves
        conn.execute(text(f"INSERT INTO {name} (at) VALUES ('2024-05-02 10:00:00')"))
    ok = relay_config(services, {"src": mariadb_database}, [{
        **table, "start_after": "2024-01-01T00:00:00Z",
        "where": "at >= '1000-01-01' AND MONTH(at) > 0 AND DAYOFMONTH(at) > 0"}])
    source = SourceDatabaseResource(url=source_url(mariadb_database))
    try:  # the remedy it names passes the table check and the cut's look
        shape = source.table_shape(None, name, "at", where=ok.tables[0].where)
        seen = observe_when_fresh(source, shape)
        assert seen is not None and shape.watermark_text(seen.watermark).startswith("2024-05-02T10:00:00")
        assert source.count_rows(shape, shape.watermark_value(datetime(2024, 1, 1)), seen.watermark) == 2
        if zero.startswith("0000"):  # below every time: a `start_after` alone skips it, as before
            plain = source.table_shape(None, name, "at")
            assert source.count_rows(plain, plain.watermark_value(datetime(2024, 1, 1)), seen.watermark) == 2
    finally:
        source.dispose()


# --------------------------------------------------------------------------- 5. PostgreSQL: BC timestamp


def test_postgres_bc_timestamp_keeps_its_era(services, pg_database, pg_engine, spark, name) -> None:
    """A BC `timestamp` (without time zone) arrived as "0044-03-15T12:00:00.000000", the text of 44 AD. It comes as an
    astronomical year now, like a BC timestamptz or date: 44 BC is -0043, 1 BC is 0000."""
    import json

    from resources.messages import message_columns
    from resources.slices import SliceRange
    from resources.spark import SparkResource

    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, ts timestamp, tstz timestamptz)"))
        conn.execute(text(f"INSERT INTO {name} (ts, tstz) VALUES "
                          "('0044-03-15 12:00:00 BC', '0044-03-15 12:00:00+00 BC'), "
                          "('0044-03-15 12:00:00', '0044-03-15 12:00:00+00'), "
                          "('0001-12-31 23:59:59.999999 BC', '0001-12-31 23:59:59.999999+00 BC'), "
                          "('4713-01-01 00:00:00 BC', NULL), ('infinity', NULL), (NULL, NULL)"))
    source = SourceDatabaseResource(url=source_url(pg_database))
    try:
        shape = source.table_shape("public", name, "id")
        frame = SparkResource(master="local[2]", jars=services.jdbc_jars).read_slice(
            source, shape, SliceRange(0, 6), 6)
        values = message_columns(frame, shape, "none", False, name, "k").toArrow().column("value").to_pylist()
    finally:
        source.dispose()
    got = {v["id"]: (v["ts"], v["tstz"]) for v in (json.loads(raw) for raw in values)}
    assert got == {1: ("-0043-03-15T12:00:00.000000", "-0043-03-15T12:00:00.000000+00:00"),
                   2: ("0044-03-15T12:00:00.000000", "0044-03-15T12:00:00.000000+00:00"),
                   3: ("0000-12-31T23:59:59.999999", "0000-12-31T23:59:59.999999+00:00"),
                   4: ("-4712-01-01T00:00:00.000000", None), 5: ("infinity", None), 6: (None, None)}, got


# --------------------------------------------------------------------------- 6. names of rowrelay's own columns


@pytest.mark.parametrize("column", ["__rowrelay_text_1", "__rowrelay_watermark", "__rowrelay_bytes_0",
                                    "__ROWRELAY_TIE_ORDER"])
def test_postgres_column_named_like_rowrelays_own_is_refused(pg_database, pg_engine, name, column: str) -> None:
    """A column named like one rowrelay adds to a slice's read passed the table check, and every run then failed
    with Spark's bare COLUMN_ALREADY_EXISTS: refused at the table check, naming the fix."""
    with pg_engine.begin() as conn:
        conn.execute(text(f'CREATE TABLE {name} (id bigserial PRIMARY KEY, ts timestamp, "{column}" text)'))
    source = SourceDatabaseResource(url=source_url(pg_database))
    try:
        with pytest.raises(SourceError, match=rf"public\.{name}: column '{column}' has a name rowrelay gives columns "
                                              r"of its own.*leave it out with `columns:` or rename it in a view"):
            source.table_shape("public", name, "id")
        assert source.table_shape("public", name, "id", columns=["id", "ts"]).column_names == ["id", "ts"]
    finally:
        source.dispose()


# --------------------------------------------------------------------------- 7. a table re-created


def test_mariadb_recreated_table_past_the_old_pending_max_is_not_cut_on_it(
        services, mariadb_database, mariadb_engine, dagster_instance, spark, name) -> None:
    """tests/test_edge_cuts.py's PostgreSQL case on MariaDB: the sensor's cursor kept the old table's max (10)
    pending; the table was dropped and re-created and its new ids passed 10 while its id 4 was still uncommitted.
    The old candidate's waits had ended, so it turned final at once and (0, 10] was cut without id 4, never to be
    sent. A candidate now belongs to the table's CREATE_TIME (one second apart here: its resolution)."""
    create = f"CREATE TABLE {name} (id bigint AUTO_INCREMENT PRIMARY KEY, v int) ENGINE=InnoDB"

    def insert(ids: range) -> None:
        with mariadb_engine.begin() as conn:
            conn.execute(text(f"INSERT INTO {name} (v) VALUES {', '.join(f'({i})' for i in ids)}"))

    with mariadb_engine.begin() as conn:
        conn.execute(text(create))
    insert(range(1, 11))  # ids 1..10
    h = Harness(relay_config(services, {"src": mariadb_database},
                             [{"source": "src", "table": name, "watermark": "id", "settle_seconds": 0}]),
                dagster_instance)
    table = h.table()
    holder = raw_connection(mariadb_database)
    writer = raw_connection(mariadb_database)
    try:
        with holder.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute(f"INSERT INTO {name} (v) VALUES (0)")  # id 11, open: the max 10 stays pending
        assert h.tick(table) == [], "cut while id 11 was uncommitted"
        assert [c.watermark for c in SensorState.from_cursor(h.cursors[table.table_id]).pending] == [10]
        holder.rollback()
        with mariadb_engine.begin() as conn:
            conn.execute(text(f"DROP TABLE {name}"))
        time.sleep(1.1)  # the new table's CREATE_TIME another second than the old one's
        with mariadb_engine.begin() as conn:
            conn.execute(text(create))
        insert(range(1, 4))  # ids 1..3
        with writer.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute(f"INSERT INTO {name} (v) VALUES (4)")  # id 4, open
        insert(range(5, 13))  # ids 5..12, committed
        assert h.tick(table) == [], "cut on the old table's max while id 4 was still uncommitted"
        writer.commit()
        keys = h.cut(table)
        assert keys == [SliceRange(0, 12).key], h.skip_messages[table.table_id]
    finally:  # closing a client rolls back its open transaction
        holder.close()
        writer.close()
    h.run(table, keys[0])
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), list(range(1, 13)))
