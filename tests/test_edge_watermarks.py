"""The safe high watermark at the edges (issue 9): ids drawn before a transaction is visible, database time zones,
failed checks, BIGINT UNSIGNED watermarks. Real PostgreSQL, MariaDB, Kafka and Spark."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import pytest
import yaml
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, Engine

from orchestration import exits
from orchestration.cli import main
from resources.slices import WatermarkCandidate, datetime_to_micros
from resources.source_database import InnodbTrxStale, SourceDatabaseResource, SourceError, TableShape, hooks
from tests.pipeline import Harness, assert_exactly_once, read_topic, relay_config, source_url
from tests.private_servers import private_mariadb_database
from tests.test_errors import failure_text

pytestmark = pytest.mark.integration


def observe_when_fresh(source: SourceDatabaseResource, shape: TableShape) -> WatermarkCandidate | None:
    """`observe` on MariaDB, asked again while innodb_trx stays stale: other clients of the shared server (the other
    pytest worker's sensor ticks and checks) may keep the cache stale longer than observe waits. It then refuses to
    answer ("retried next time"), never answers wrong."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return source.observe(shape)
        except InnodbTrxStale:
            assert time.monotonic() < deadline, "innodb_trx stayed stale for 30 s"


def eventually(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# --------------------------------------------------------------------------- PostgreSQL: id drawn before an xid


def create_holding_table(engine: Engine, name: str) -> int:
    """`name (id bigserial, v int)` whose BEFORE INSERT trigger waits on an advisory lock when v = -1: the insert
    then holds its `DEFAULT nextval` id without an xid. Row 1 is committed first, so the next nextval is not
    WAL-logged (that would take an xid early). Returns the advisory lock key."""
    key = uuid.uuid4().int % 2**31
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v int)"))
        conn.execute(text(f"CREATE FUNCTION {name}_hold() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                          f"IF NEW.v = -1 THEN PERFORM pg_advisory_xact_lock({key}); END IF; RETURN NEW; END $$"))
        conn.execute(text(f"CREATE TRIGGER {name}_hold BEFORE INSERT ON {name} FOR EACH ROW "
                          f"EXECUTE FUNCTION {name}_hold()"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES (0)"))
    return key


@contextmanager
def id_held_without_xid(url: URL, name: str, key: int) -> Iterator[tuple[Callable[[], int], str]]:
    """Session A inserts v = -1 and blocks in the trigger holding id 2 (no xid yet); then session B commits id 3.
    Yields `release`, which lets A commit and returns A's id, and A's virtual transaction id.

    A checkpoint between row 1 and A's insert makes A's nextval WAL-logged, which takes an xid: the staging is
    then undone (TRUNCATE ... RESTART IDENTITY, row 1 again) and tried again, a few times at most."""
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    gate = admin.connect()
    writer = create_engine(url)
    outcome: dict[str, object] = {}
    a: threading.Thread | None = None

    def insert_a() -> None:
        try:
            with writer.begin() as conn:
                outcome["id"] = conn.execute(text(f"INSERT INTO {name} (v) VALUES (-1) RETURNING id")).scalar()
        except Exception as exc:  # noqa: BLE001 - reported by release()
            outcome["error"] = exc

    def a_waiting() -> list:
        return gate.execute(text(
            "SELECT a.backend_xid, v.virtualxid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "JOIN pg_locks v ON v.pid = l.pid AND v.locktype = 'virtualxid' AND v.granted "
            "WHERE l.locktype = 'advisory' AND NOT l.granted AND l.objid = :k"), {"k": key}).all()

    def release() -> int:
        if a is not None and a.is_alive():
            gate.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
            a.join(30)
        assert "error" not in outcome, outcome.get("error")
        return int(outcome["id"])  # type: ignore[call-overload]

    try:
        for _attempt in range(5):
            outcome.clear()
            gate.execute(text("SELECT pg_advisory_lock(:k)"), {"k": key})
            a = threading.Thread(target=insert_a)
            a.start()
            assert eventually(lambda: bool(a_waiting()), 10), "session A never blocked in the trigger"
            if a_waiting()[0][0] is None:
                break
            release()
            with writer.begin() as conn:
                conn.execute(text(f"TRUNCATE {name} RESTART IDENTITY"))
                conn.execute(text(f"INSERT INTO {name} (v) VALUES (0)"))
        else:
            raise AssertionError("session A had an xid in all 5 attempts: the reproduction needs one without (a "
                                 "checkpoint each time between row 1 and A's insert?)")
        with writer.begin() as conn:
            assert conn.execute(text(f"INSERT INTO {name} (v) VALUES (2) RETURNING id")).scalar() == 3
        yield release, a_waiting()[0][1]
    finally:
        release()
        gate.close()
        writer.dispose()
        admin.dispose()


@contextmanager
def unprivileged_pg_role(services, pg_database: URL, pg_engine: Engine, table: str,
                         password: str | None = None) -> Iterator[URL]:
    """A login role with only CONNECT and SELECT on the table (no superuser, no pg_read_all_stats/pg_monitor)."""
    role, password = f"{table}_reader", password or uuid.uuid4().hex
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'"))
        conn.execute(text(f'GRANT CONNECT ON DATABASE "{pg_database.database}" TO {role}'))
        conn.execute(text(f"GRANT SELECT ON {table} TO {role}"))
    try:
        yield pg_database.set(username=role, password=password)
    finally:
        with pg_engine.begin() as conn:
            conn.execute(text(f"DROP OWNED BY {role}"))  # also revokes CONNECT on the database
            conn.execute(text(f"DROP ROLE {role}"))


def test_postgres_id_drawn_before_its_xid_holds_the_watermark(services, pg_database, pg_engine, name) -> None:
    key = create_holding_table(pg_engine, name)
    with unprivileged_pg_role(services, pg_database, pg_engine, name) as reader_url:
        source = SourceDatabaseResource(url=source_url(reader_url))
        try:
            shape = source.table_shape("public", name, "id")
            with id_held_without_xid(pg_database, name, key) as (release, a_vxid):
                seen = source.observe(shape)
                assert seen is not None and seen.watermark == 3
                # Seen by a role without pg_read_all_stats: pg_locks and pg_stat_activity's pid/datid are public.
                assert a_vxid in seen.waits, f"A's transaction {a_vxid} is not among {seen.waits}"
                # Id 2 is taken but not committed: 3 must not be final, however long we look.
                for _ in range(3):
                    assert not source.is_final(seen, 0), f"{seen} declared final while id 2 is uncommitted"
                    time.sleep(0.2)
                assert release() == 2
                # 60 s: finality also waits for every xid open in the cluster when 3 was seen, and the other pytest
                # worker holds some for seconds (tests/test_exactly_once.py's out-of-order commits: ~7 s).
                assert eventually(lambda: source.is_final(seen, 0), timeout=60), \
                    f"{seen} never became final after A committed"
        finally:
            source.dispose()


@pytest.mark.parametrize(("ddl", "sequence", "cache", "via"), [
    ("CREATE TABLE {t} (id bigserial PRIMARY KEY, v int); ALTER SEQUENCE {t}_id_seq CACHE 20", "{t}_id_seq", 20, None),
    ("CREATE TABLE {t} (id bigint GENERATED ALWAYS AS IDENTITY (CACHE 5) PRIMARY KEY, v int)", "{t}_id_seq", 5, None),
    ("CREATE SEQUENCE {t}_ids CACHE 3; CREATE TABLE {t} (id bigint DEFAULT nextval('{t}_ids') PRIMARY KEY, v int)",
     "{t}_ids", 3, None),
    ("CREATE TABLE {t} (id bigserial PRIMARY KEY, v int)", None, 1, None),
    # Relations a read takes rows from (`via`): a view's base table, a child's or a partition's own DEFAULT (it
    # serves rows inserted into it directly). The check once looked at the named relation's own column only.
    ("CREATE TABLE {t}_base (id bigint GENERATED BY DEFAULT AS IDENTITY (CACHE 20) PRIMARY KEY, v int); "
     "CREATE VIEW {t} AS SELECT id, v FROM {t}_base WHERE v IS NOT NULL", "{t}_base_id_seq", 20, "{t}_base"),
    # (The table itself draws no ids there: a second sequence beside the table's is refused on its own, below.)
    ("CREATE TABLE {t} (id bigint, v int); CREATE SEQUENCE {t}_kid_ids CACHE 10; "
     "CREATE TABLE {t}_kid (id bigint DEFAULT nextval('{t}_kid_ids')) INHERITS ({t}); "
     "INSERT INTO {t} (id, v) VALUES (1, 1)", "{t}_kid_ids", 10, "{t}_kid"),
    ("CREATE TABLE {t} (id bigint, v int) PARTITION BY RANGE (id); CREATE SEQUENCE {t}_hi_ids CACHE 4; "
     "CREATE TABLE {t}_lo PARTITION OF {t} FOR VALUES FROM (1) TO (1000); "
     "CREATE TABLE {t}_hi PARTITION OF {t} (id DEFAULT nextval('{t}_hi_ids')) FOR VALUES FROM (1000) TO (2000000); "
     "INSERT INTO {t} (id, v) VALUES (1, 1)", "{t}_hi_ids", 4, "{t}_hi"),
    ("CREATE TABLE {t}_base (id bigserial PRIMARY KEY, v int); CREATE VIEW {t} AS SELECT * FROM {t}_base",
     None, 1, None),
    # A join's other table has an `id` of its own, from a caching sequence: not the view's ids (the view's `id` is
    # the orders'), so not refused.
    ("CREATE TABLE {t}_c (id bigint GENERATED BY DEFAULT AS IDENTITY (CACHE 20) PRIMARY KEY, name text); "
     "CREATE TABLE {t}_o (id bigserial PRIMARY KEY, c bigint, v int); "
     "CREATE VIEW {t} AS SELECT o.id, o.v, c.name FROM {t}_o o JOIN {t}_c c ON c.id = o.c; "
     "INSERT INTO {t}_c (name) VALUES ('a'); INSERT INTO {t}_o (c, v) VALUES (1, 1)", None, 1, None),
], ids=["serial", "identity", "default", "cache_1", "view_base", "child_default", "partition_default",
        "view_cache_1", "view_join"])
def test_postgres_watermark_sequence_caching_ids_per_session_is_refused(services, pg_database, pg_engine, name, ddl,
                                                                        sequence, cache, via) -> None:
    """With CACHE 20, session A draws 1 (and holds 2..20), B draws 21 and commits; A inserts 2 in a transaction that
    begins after a cut at 21: nothing the cut could wait for. Refused, naming the sequence, the relation it feeds
    when that is not the table itself, and the fix: wherever the sequence feeds rows a read takes (the table, a
    view's base table, a child or a partition)."""
    with pg_engine.begin() as conn:
        for statement in ddl.format(t=name).split("; "):
            conn.execute(text(statement))
        if "INSERT" not in ddl:
            conn.execute(text(f"INSERT INTO {name} (v) VALUES (1)"))
    with unprivileged_pg_role(services, pg_database, pg_engine, name) as reader_url:
        source = SourceDatabaseResource(url=source_url(reader_url))
        try:
            shape = source.table_shape("public", name, "id")
            if sequence is None:
                seen = source.observe(shape)
                assert seen is not None and seen.watermark == 1
            else:
                of = "" if via is None else f" of {via.format(t=name)}, which a read of the table takes rows from,"
                seq = sequence.format(t=name)
                with pytest.raises(SourceError, match=rf"^public\.{name}: watermark column 'id'{of} takes its ids "
                                                      rf"from sequence {seq}, which caches {cache} per session.*"
                                                      rf"ALTER SEQUENCE {seq} CACHE 1.*nothing was cut or sent$"):
                    source.observe(shape)
                with pg_engine.begin() as conn:
                    conn.execute(text(f"ALTER SEQUENCE {seq} CACHE 1"))
                seen = source.observe(shape)  # the fix the message names is enough
                assert seen is not None and seen.watermark == 1
        finally:
            source.dispose()


@pytest.mark.parametrize(("ddl", "first", "first_in", "other", "other_rel"), [
    # A child made `LIKE` its parent `INCLUDING IDENTITY` (or `INCLUDING ALL`) gets an identity sequence of its own.
    ("CREATE TABLE {t} (id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, v int); "
     "CREATE TABLE {t}_kid (LIKE {t} INCLUDING IDENTITY) INHERITS ({t})",
     "{t}_id_seq", "the table's", "{t}_kid_id_seq", "{t}_kid"),
    # A partition with a DEFAULT of its own beside the table's serial.
    ("CREATE TABLE {t} (id bigserial, v int) PARTITION BY RANGE (id); CREATE SEQUENCE {t}_hi_ids START 1000; "
     "CREATE TABLE {t}_lo PARTITION OF {t} FOR VALUES FROM (1) TO (1000); "
     "CREATE TABLE {t}_hi PARTITION OF {t} (id DEFAULT nextval('{t}_hi_ids')) FOR VALUES FROM (1000) TO (2000000)",
     "{t}_id_seq", "the table's", "{t}_hi_ids", "{t}_hi"),
], ids=["like_including_identity", "partition_default"])
def test_postgres_watermark_from_two_sequences_is_refused(services, pg_database, pg_engine, name, ddl, first,
                                                          first_in, other, other_rel) -> None:
    """The watermark takes ids from two sequences (the table's, and a child's or a partition's own): each counts on
    its own, so a row inserted through one takes an id at or below those the other already handed out, and rowrelay
    sent: that row was never sent, silently (now refused). Refused naming both
    sequences and where each feeds; the fix the message names (one source of ids) is enough."""
    t = name
    with pg_engine.begin() as conn:
        for statement in ddl.format(t=t).split("; "):
            conn.execute(text(statement))
        conn.execute(text(f"INSERT INTO {t} (v) VALUES (1)"))  # through the table: its sequence
    source = SourceDatabaseResource(url=source_url(pg_database))
    try:
        shape = source.table_shape("public", t, "id")
        with pytest.raises(SourceError, match=(
                rf"^public\.{t}: watermark column 'id' takes its ids from two sequences: {first.format(t=t)} "
                rf"\({first_in}\) and {other.format(t=t)} \({other_rel.format(t=t)}'s, which a read of the table "
                rf"takes rows from\)\. .*would never be sent\. Give {other_rel.format(t=t)} the same source of ids .*"
                rf"SET DEFAULT nextval\('{first.format(t=t)}'\)`\) and run again; nothing was cut or sent$")):
            source.observe(shape)
        with pytest.raises(SourceError, match="takes its ids from two sequences"):
            source.refuse_unknowable_finality(shape)  # as every run's read checks it
        kid = other_rel.format(t=t)
        with pg_engine.begin() as conn:
            conn.execute(text(f"ALTER TABLE {kid} ALTER COLUMN id DROP IDENTITY IF EXISTS, "
                              f"ALTER COLUMN id SET DEFAULT nextval('{first.format(t=t)}')"))
            if "_hi_ids" in other:  # its own sequence, no longer any column's DEFAULT, may go
                conn.execute(text(f"DROP SEQUENCE {other.format(t=t)}"))
        seen = source.observe(shape)  # the fix the message names is enough
        assert seen is not None and seen.watermark == 1
    finally:
        source.dispose()


def test_postgres_unlogged_table_is_refused(services, pg_database, pg_engine, name) -> None:
    """An UNLOGGED table is not in the WAL: a crash empties it and restarts its sequence, so sent rows vanish and new
    rows take their ids, never sent; no flush makes it durable."""
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE UNLOGGED TABLE {name} (id bigserial PRIMARY KEY, v int)"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES (1)"))
    source = SourceDatabaseResource(url=source_url(pg_database))
    try:
        shape = source.table_shape("public", name, "id")
        with pytest.raises(SourceError, match=rf"the table is UNLOGGED.*new rows take them and are never sent\. Run "
                                              rf"`ALTER TABLE {name} SET LOGGED`.*nothing was cut or sent"):
            source.observe(shape)
        with pg_engine.begin() as conn:
            conn.execute(text(f"ALTER TABLE {name} SET LOGGED"))
        seen = source.observe(shape)
        assert seen is not None and seen.watermark == 1
    finally:
        source.dispose()


POSTGRES_RELATIONS_READ_THROUGH = {
    # name: (DDL, {t} the table rowrelay reads; the relation the refusal names; what it says; the fix, or None)
    "unlogged_partition": (
        "CREATE TABLE {t} (id bigserial, v int) PARTITION BY RANGE (id); "
        "CREATE TABLE {t}_old PARTITION OF {t} FOR VALUES FROM (1) TO (100); "
        "CREATE UNLOGGED TABLE {t}_new PARTITION OF {t} FOR VALUES FROM (100) TO (1000)",
        "{t}_new", "is UNLOGGED", "ALTER TABLE {t}_new SET LOGGED"),
    "unlogged_grandchild": (
        "CREATE TABLE {t} (id bigserial, v int); CREATE TABLE {t}_kid () INHERITS ({t}); "
        "CREATE UNLOGGED TABLE {t}_grandkid () INHERITS ({t}_kid)",
        "{t}_grandkid", "is UNLOGGED", "ALTER TABLE {t}_grandkid SET LOGGED"),
    "view_over_unlogged": (
        "CREATE UNLOGGED TABLE {t}_base (id bigserial, v int); CREATE VIEW {t}_mid AS SELECT * FROM {t}_base; "
        "CREATE VIEW {t} AS SELECT id, v FROM {t}_mid WHERE v IS NOT NULL",
        "{t}_base", "is UNLOGGED", "ALTER TABLE {t}_base SET LOGGED"),
    "materialized_view": (
        "CREATE TABLE {t}_base (id bigserial, v int); CREATE MATERIALIZED VIEW {t} AS SELECT * FROM {t}_base",
        None, "is a materialized view: its rows change only when it is refreshed", None),
    "foreign_table": (
        "CREATE EXTENSION IF NOT EXISTS postgres_fdw; "
        "CREATE SERVER {t}_far FOREIGN DATA WRAPPER postgres_fdw "
        "OPTIONS (host '{host}', port '{port}', dbname '{db}'); "
        "CREATE TABLE {t}_base (id bigserial, v int); "
        "CREATE FOREIGN TABLE {t}_far_rows (id bigint, v int) SERVER {t}_far OPTIONS (table_name '{t}_base'); "
        "CREATE VIEW {t} AS SELECT * FROM {t}_far_rows",
        "{t}_far_rows", "is a foreign table: its rows live on another server", None),
}


@pytest.mark.parametrize("case", list(POSTGRES_RELATIONS_READ_THROUGH))
def test_postgres_relations_a_read_takes_rows_from_are_checked_too(services, pg_database, pg_engine, name,
                                                                  case) -> None:
    """A partitioned table, an inheritance parent or a view reads rows from other relations. The checks looked at
    the named relation only: an UNLOGGED partition, child or base table (a crash empties it), a materialized view (its
    rows appear at a refresh, below rows already sent) and a foreign table (its writers' transactions are on another
    server) were all cut as if final (found by looking at source shapes the checks had not met). Now every relation
    a read reaches is checked, by a role with only SELECT, and the one at fault is named with its fix."""
    ddl, culprit, says, fix = POSTGRES_RELATIONS_READ_THROUGH[case]
    u = pg_database
    with pg_engine.begin() as conn:
        for statement in ddl.format(t=name, host=u.host, port=u.port, db=u.database).split("; "):
            conn.execute(text(statement))
    with unprivileged_pg_role(services, pg_database, pg_engine, name) as reader_url:
        source = SourceDatabaseResource(url=source_url(reader_url))
        try:
            shape = source.table_shape("public", name, "id")
            what = "the table" if culprit is None else f"{culprit.format(t=name)}, which a read of the table takes " \
                                                       "rows from,"
            with pytest.raises(SourceError, match=rf"^public\.{name}: {what} {says}.*nothing was cut or sent$"):
                source.observe(shape)
            if fix is not None:
                with pg_engine.begin() as conn:
                    conn.execute(text(fix.format(t=name)))
                    conn.execute(text(f"INSERT INTO {name}_base (v) VALUES (1)" if case == "view_over_unlogged"
                                      else f"INSERT INTO {name} (v) VALUES (1), (2)"))
                seen = source.observe(shape)
                assert seen is not None and seen.watermark >= 1, f"{case}: still refused or empty after `{fix}`"
        finally:
            source.dispose()


def test_postgres_backfill_does_not_skip_an_id_drawn_before_its_xid(services, pg_database, pg_engine, dagster_home,
                                                                      dagster_instance, spark, name, tmp_path,
                                                                      monkeypatch) -> None:
    from orchestration.cli import main

    key = create_holding_table(pg_engine, name)
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}", "watermark": "id",
                                                         "settle_seconds": 0}])
    table = cfg.tables[0]
    config_file = tmp_path / "rowrelay.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    backfill = ["--config", str(config_file), "backfill", "--table", table.table_id, "--settle-timeout", "1"]
    with id_held_without_xid(pg_database, name, key) as (release, _):
        # Row 1 goes out if it is final by then; other tests' transactions in the cluster can hold it too, and a
        # backfill that finds nothing final says so (exits.NOT_FINAL).
        assert main(backfill) in (exits.OK, exits.NOT_FINAL)
        early = [m.value["id"] for m in read_topic(services.kafka_bootstrap, table.topic_name)]
        assert set(early) <= {1}, f"published {early} while id 2 was uncommitted"
        assert release() == 2
    # Finality also waits for transactions with an xid anywhere in the PostgreSQL cluster (the snapshot's xmin):
    # other tests running beside this one hold some for a second or two.
    assert main([*backfill[:-1], "30"]) == 0
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), [1, 2, 3])


# --------------------------------------------------------------------------- MariaDB: one clock, open transactions


@pytest.mark.parametrize("zone", ["+05:00", "-05:00"])
def test_mariadb_open_transaction_holds_the_watermark_in_any_time_zone(name, zone) -> None:
    """A server whose default zone is not UTC (new connections take it): on a server of the test's own, since a
    zone set on a shared one reaches every other test's connections."""
    with private_mariadb_database(f"--default-time-zone={zone}") as (_, database):
        mariadb_engine = create_engine(database)
        try:
            with mariadb_engine.begin() as conn:
                assert conn.execute(text("SELECT @@session.time_zone")).scalar() == zone
                conn.execute(text(f"CREATE TABLE {name} (id bigint AUTO_INCREMENT PRIMARY KEY, v int)"))
                conn.execute(text(f"INSERT INTO {name} (v) VALUES (0)"))
            _open_transaction_holds_the_watermark(database, mariadb_engine, name, zone)
        finally:
            mariadb_engine.dispose()


def _id_2_held_open_and_3_observed(a, mariadb_engine: Engine, source: SourceDatabaseResource, shape: TableShape,
                                   name: str) -> tuple[object, WatermarkCandidate]:
    """Connection `a` draws id 2 in a transaction it leaves open; id 3 commits; the max is observed (3)."""
    a_tx = a.begin()
    assert a.execute(text(f"INSERT INTO {name} (v) VALUES (-1)")).lastrowid == 2  # open, holds id 2
    with mariadb_engine.begin() as conn:
        assert conn.execute(text(f"INSERT INTO {name} (v) VALUES (2)")).lastrowid == 3
    seen = observe_when_fresh(source, shape)
    assert seen is not None and seen.watermark == 3
    return a_tx, seen


def _open_transaction_holds_the_watermark(database: URL, mariadb_engine: Engine, name: str, zone: str) -> None:
    source = SourceDatabaseResource(url=source_url(database))
    holder = create_engine(database)
    a, c = holder.connect(), holder.connect()
    try:
        with source.engine.connect() as conn:
            assert conn.execute(text("SELECT @@session.time_zone")).scalar() == zone
        shape = source.table_shape(None, name, "id")
        a_tx, seen = _id_2_held_open_and_3_observed(a, mariadb_engine, source, shape, name)
        time.sleep(0.7)  # past the settle delay
        assert not source.is_final(seen, 0.5), f"{seen} declared final while id 2 is uncommitted ({zone})"
        a_tx.commit()
        # A transaction that began after the max was seen holds only higher ids: it must not hold it back.
        c_tx = c.begin()
        c.execute(text(f"INSERT INTO {name} (v) VALUES (4)"))
        assert eventually(lambda: source.is_final(seen, 0.5)), f"{seen} never became final ({zone})"
        c_tx.rollback()
    finally:
        a.close()  # an open transaction would block the database's DROP
        c.close()
        source.dispose()
        holder.dispose()


def test_mariadb_stale_innodb_trx_cache_does_not_hide_an_open_transaction(services, mariadb_database,
                                                                          mariadb_engine, name) -> None:
    """information_schema.innodb_trx is a cache, refreshed only when nobody read it for 100 ms: another client
    reading it often (monitoring, other tables' sensors) keeps it stale, blind to a transaction that just began."""
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint AUTO_INCREMENT PRIMARY KEY, v int)"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES (0)"))
    source = SourceDatabaseResource(url=source_url(mariadb_database))
    reader = create_engine(services.mariadb_url())
    holder = create_engine(mariadb_database)
    a = holder.connect()
    stop = threading.Event()

    reads: list[int] = []  # the monitor's reads: it must have run for the cache to be kept stale

    def read_often() -> None:  # for 0.8 s, every 20 ms
        with reader.connect() as conn:
            deadline = time.monotonic() + 0.8
            while not stop.is_set() and time.monotonic() < deadline:
                conn.execute(text("SELECT COUNT(*) FROM information_schema.innodb_trx")).scalar()
                conn.rollback()
                reads.append(1)
                time.sleep(0.02)

    monitor = threading.Thread(target=read_often)
    try:
        shape = source.table_shape(None, name, "id")
        monitor.start()
        time.sleep(0.1)  # the cache is refreshed once, then kept stale
        a_tx, seen = _id_2_held_open_and_3_observed(a, mariadb_engine, source, shape, name)
        monitor.join(5)
        assert len(reads) >= 10, f"the monitor read innodb_trx {len(reads)} times"
        time.sleep(0.7)  # past the settle delay; the cache is fresh again
        assert not source.is_final(seen, 0.5), f"{seen} declared final while id 2 is uncommitted"
        a_tx.commit()
        assert eventually(lambda: source.is_final(seen, 0.5)), f"{seen} never became final"
    finally:
        stop.set()
        if monitor.is_alive():
            monitor.join(5)
        a.close()
        source.dispose()
        holder.dispose()
        reader.dispose()


def test_mariadb_read_only_transactions_begun_later_do_not_hold_the_watermark(services, mariadb_database,
                                                                             mariadb_engine, name) -> None:
    """innodb_trx shows every read-only transaction with trx_id 0: a transaction is told by thread and start."""
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint AUTO_INCREMENT PRIMARY KEY, v int)"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES (0), (1)"))
    source = SourceDatabaseResource(url=source_url(mariadb_database))
    holder = create_engine(mariadb_database)
    first, later = holder.connect(), holder.connect()
    try:
        first.execute(text(f"SELECT COUNT(*) FROM {name}")).scalar()  # a read-only transaction, open
        time.sleep(0.15)  # let innodb_trx's cache see it
        seen = observe_when_fresh(source, source.table_shape(None, name, "id"))
        assert seen is not None and seen.watermark == 2 and seen.waits
        first.rollback()
        later.execute(text(f"SELECT COUNT(*) FROM {name}")).scalar()  # another one, begun after the max was seen
        time.sleep(0.15)
        assert eventually(lambda: source.is_final(seen, 0)), f"{seen} held back by a later read-only transaction"
    finally:
        first.close()
        later.close()
        source.dispose()
        holder.dispose()


def test_mariadb_without_process_privilege_is_a_clear_error(services, mariadb_database, mariadb_engine,
                                                            name) -> None:
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint AUTO_INCREMENT PRIMARY KEY, v int)"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES (0), (1)"))
    user, password = f"{name}_np", uuid.uuid4().hex
    admin = create_engine(services.mariadb_url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE USER '{user}'@'%' IDENTIFIED BY '{password}'"))
        conn.execute(text(f"GRANT SELECT ON `{mariadb_database.database}`.* TO '{user}'@'%'"))
    source = SourceDatabaseResource(url=source_url(mariadb_database.set(username=user, password=password)))
    try:
        shape = source.table_shape(None, name, "id")
        with pytest.raises(SourceError, match=r"GRANT PROCESS ON \*\.\* TO"):
            source.observe(shape)
        # A candidate from before the grant was lost: the check must not call it final without the guard.
        with pytest.raises(SourceError, match=r"GRANT PROCESS ON \*\.\* TO"):
            source.is_final(WatermarkCandidate(2, 0.0, ("1|2020-01-01 00:00:00",)), 0)
    finally:
        source.dispose()
        with admin.connect() as conn:
            conn.execute(text(f"DROP USER '{user}'@'%'"))
        admin.dispose()


@pytest.mark.parametrize("url", ["postgresql://rowrelay:x@127.0.0.1:1/db", "mysql://rowrelay:x@127.0.0.1:1/db"])
def test_a_check_that_cannot_reach_the_database_is_not_final(url: str) -> None:
    source = SourceDatabaseResource(url=url)
    try:
        assert source.is_final(WatermarkCandidate(10, 0.0, ("3/7",)), 0) is False
    finally:
        source.dispose()


@contextmanager
def innodb_trx_kept_stale(database: URL, seconds: float = 60.0) -> Iterator[None]:
    """innodb_trx's cache kept stale while the block runs: a stored procedure reads it every 10 ms inside the server
    (InnoDB refreshes the cache only when nobody read it for 100 ms) until a row in its stop table ends it. A reader
    thread in the test's own process missed that 100 ms now and then under load (it shares the GIL with the sensor
    tick it is meant to blind), and the tick then saw a fresh cache and cut."""
    engine = create_engine(database, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text("CREATE TABLE keep_innodb_trx_stale_stop (stop int)"))
        conn.execute(text(
            "CREATE PROCEDURE keep_innodb_trx_stale(n INT) BEGIN DECLARE i INT DEFAULT 0; "
            "WHILE i < n AND NOT EXISTS (SELECT 1 FROM keep_innodb_trx_stale_stop) DO "
            "SELECT COUNT(*) INTO @rows FROM information_schema.innodb_trx; DO SLEEP(0.01); SET i = i + 1; "
            "END WHILE; END"))

    def keep_stale() -> None:
        with engine.connect() as conn:
            conn.execute(text(f"CALL keep_innodb_trx_stale({int(seconds * 100)})"))

    loop = threading.Thread(target=keep_stale)
    loop.start()
    try:
        time.sleep(0.1)  # the cache is refreshed once, then kept stale
        yield
    finally:
        with engine.connect() as conn:
            conn.execute(text("INSERT INTO keep_innodb_trx_stale_stop VALUES (1)"))
        loop.join(10)
        engine.dispose()


def test_mariadb_statement_ending_before_the_processlist_read_is_in_the_innodb_trx_read(
        services, mariadb_database, mariadb_engine, name, monkeypatch) -> None:
    """A DATETIME watermark's writer whose statement began before the max was read (its CURRENT_TIMESTAMP(6) below
    the max), blocked before it touched a row (so not in innodb_trx), ends in the window between observe's max read
    and its PROCESSLIST read, its transaction left open: the PROCESSLIST read no longer sees it running, so only the
    innodb_trx read can hold the cut for it. A cache filled before the statement ended (another client's read,
    after observe's transaction began) listed observe's own transaction, was taken as fresh and missed the writer:
    its row committed below a final candidate, never to be sent. The innodb_trx read must be fresh after the
    PROCESSLIST read. Driven here: observe held after its max read while innodb_trx's cache is filled and kept
    stale, the writer released and finished, then the cache kept stale a little longer."""
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (n int AUTO_INCREMENT PRIMARY KEY, "
                          "at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), v int, INDEX (at))"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES (1)"))
    source = SourceDatabaseResource(url=source_url(mariadb_database))
    lock = f"{name}_writer"
    holder, writer = mariadb_engine.connect(), mariadb_engine.connect()
    stale = ExitStack()
    try:
        shape = source.table_shape(None, name, "at")
        assert holder.execute(text("SELECT GET_LOCK(:k, 10)"), {"k": lock}).scalar() == 1
        writer_id = writer.execute(text("SELECT CONNECTION_ID()")).scalar()
        writer.execute(text("BEGIN"))
        # Its time is its statement's start; it touches a row only once the lock is granted.
        slow = threading.Thread(target=lambda: writer.execute(
            text(f"INSERT INTO {name} (v) VALUES ((SELECT GET_LOCK(:k, 30)))"), {"k": lock}))
        slow.start()
        assert eventually(lambda: _processlist_state(mariadb_engine, writer_id) == "User lock")
        # Well before the max: the cache keeper's CALL, running at the PROCESSLIST read, holds the candidate below
        # its own start (a statement that may write), which must stay above the writer's time.
        time.sleep(2)
        with mariadb_engine.begin() as conn:
            conn.execute(text(f"INSERT INTO {name} (v) VALUES (3)"))  # a later time: the max
        held: list[int] = []

        def pause(point: str, conn) -> None:
            if point != "max read" or held:
                return
            observer = int(conn.execute(text("SELECT CONNECTION_ID()")).scalar())
            held.append(observer)
            time.sleep(0.15)  # so the next read of innodb_trx fills its cache anew: observe's transaction is in it
            stale.enter_context(innodb_trx_kept_stale(mariadb_database))
            holder.execute(text("SELECT RELEASE_LOCK(:k)"), {"k": lock})
            slow.join(10)  # the writer's statement ended: its row is written, its transaction open
            assert not slow.is_alive()
            with mariadb_engine.connect() as conn:  # the kept cache: filled after observe began, before the write
                listed = set(conn.execute(text("SELECT trx_mysql_thread_id FROM information_schema.innodb_trx"))
                             .scalars())
            assert observer in listed and writer_id not in listed, (observer, writer_id, listed)
            threading.Timer(0.6, stale.close).start()  # fresh again within observe's wait

        monkeypatch.setattr(hooks, "observe_pause", pause)
        seen = source.observe(shape)
        assert held and seen is not None
        at = writer.execute(text(f"SELECT at FROM {name} WHERE v = 1 AND n > 1")).scalar()
        assert at is not None and datetime_to_micros(at) <= seen.watermark, (at, seen)
        time.sleep(0.8)  # the cache is fresh again
        assert not source.is_final(seen, 0), (
            f"{seen} declared final while the writer's row at {at} is uncommitted: it would never be sent")
        writer.execute(text("COMMIT"))
        # innodb_trx is server-wide: other tests' transactions open at the look hold the candidate too.
        assert eventually(lambda: source.is_final(seen, 0), timeout=60), f"{seen} never became final"
    finally:
        stale.close()
        writer.close()
        holder.close()
        source.dispose()


def _processlist_state(engine: Engine, connection_id: int) -> str | None:
    with engine.connect() as conn:
        return conn.execute(text("SELECT STATE FROM information_schema.PROCESSLIST WHERE ID = :id"),
                            {"id": connection_id}).scalar()


def test_mariadb_sensor_skips_a_tick_while_innodb_trx_stays_stale(services, mariadb_database, mariadb_engine,
                                                                   dagster_instance, dagster_home, spark, name,
                                                                   tmp_path, capsys, monkeypatch) -> None:
    """A client reading innodb_trx every 10 ms keeps its cache stale past observe's wait: the sensor's tick is
    skipped with the reason (not a failed tick), `rowrelay backfill` exits 1 with it, nothing is cut, and the next
    tick cuts once the cache is fresh."""
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint AUTO_INCREMENT PRIMARY KEY, v int)"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES (1), (2), (3)"))
    h = Harness(relay_config(services, {"src": mariadb_database},
                             [{"source": "src", "table": name, "watermark": "id", "settle_seconds": 0}]),
                dagster_instance)
    table = h.table()
    with innodb_trx_kept_stale(mariadb_database):
        assert h.tick(table) == []
        assert "innodb_trx stayed stale" in (h.skip_messages[table.table_id] or "")
        monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
        capsys.readouterr()
        assert main(["--config", str(h.config_file()), "backfill", "--table", table.table_id]) == 1
        assert "innodb_trx stayed stale" in capsys.readouterr().err
        assert h.instance.get_dynamic_partitions(f"{table.dagster_name}__slices") == []
    time.sleep(0.2)  # nobody reads it now: the next read refreshes it
    keys: list[str] = []
    assert eventually(lambda: bool(keys.extend(h.tick(table)) or keys), timeout=10), h.skip_messages[table.table_id]
    for key in keys:
        h.run(table, key)
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), [1, 2, 3])


# --------------------------------------------------------------------------- BIGINT UNSIGNED beyond 2^63


def test_bigint_unsigned_watermark_beyond_2_63_is_refused(services, mariadb_database, mariadb_engine,
                                                          dagster_instance, spark, name) -> None:
    beyond = 2**63 + 5
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id BIGINT UNSIGNED PRIMARY KEY, v int)"))
        conn.execute(text(f"INSERT INTO {name} VALUES (1, 0), ({beyond}, 1)"))
    h = Harness(relay_config(services, {"src": mariadb_database},
                             [{"source": "src", "table": name, "watermark": "id"}]), dagster_instance)
    table = h.table()
    expected = f"{name}: watermark column 'id' holds {beyond}"
    with pytest.raises(Exception) as info:  # noqa: PT011 - the message is asserted below
        h.tick(table)
    assert expected in str(info.value) and "2^63" in str(info.value)
    key = "000000000000-000000000010"
    h.instance.add_dynamic_partitions(f"{table.dagster_name}__slices", [key])
    result = h.run(table, key, raise_on_error=False)
    assert not result.success and expected in failure_text(result)
    assert read_topic(services.kafka_bootstrap, table.topic_name) == []
    assert h.progress(table) is None


@pytest.mark.parametrize(("engine", "ddl", "says"), [
    ("MEMORY", "id bigint AUTO_INCREMENT PRIMARY KEY, v int", "the table is ENGINE=MEMORY: a restart of the server "
                                                               "empties it and restarts its AUTO_INCREMENT"),
    ("CSV", "id bigint NOT NULL, v int NOT NULL", "the table is ENGINE=CSV. rowrelay knows when new rows are final "
                                                  "only in InnoDB"),
])
def test_mariadb_engines_whose_rows_rowrelay_cannot_tell_final_are_refused(services, mariadb_database,
                                                                           mariadb_engine, name, engine, ddl,
                                                                           says) -> None:
    """MariaDB's finality check reads InnoDB's open transactions and its durability wait InnoDB's redo log. A MEMORY
    table is emptied by a restart and gives its AUTO_INCREMENT ids out again (rows sent vanish, new rows with their ids
    are never sent), and another engine's writers are not in innodb_trx at all: both were cut as if InnoDB (found by
    looking at source shapes the checks had not met). Refused before any cut, with the fix; InnoDB accepted."""
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} ({ddl}) ENGINE={engine}"))
        conn.execute(text(f"INSERT INTO {name} (id, v) VALUES (1, 1), (2, 2)"))
    source = SourceDatabaseResource(url=source_url(mariadb_database))
    try:
        shape = source.table_shape(None, name, "id")
        with pytest.raises(SourceError, match=rf"^{name}: {says}.*ENGINE=InnoDB.*nothing was cut or sent$"):
            source.observe(shape)
        with mariadb_engine.begin() as conn:
            conn.execute(text(f"ALTER TABLE {name} ENGINE=InnoDB"))
        seen = observe_when_fresh(source, shape)
        assert seen is not None and seen.watermark == 2
    finally:
        source.dispose()


def test_mariadb_sequence_default_under_a_before_insert_trigger_is_refused(services, mariadb_database,
                                                                         mariadb_engine, name) -> None:
    """`id DEFAULT NEXTVAL(seq)`: MariaDB draws the id as the row's defaults are filled, before BEFORE INSERT
    triggers run, while InnoDB lists the transaction only once it writes the row. A trigger taking 4 s held id 2
    that no check could see: id 3, committed meanwhile, was final after the settle delay and cut, and id 2 committed
    below it (probed on this stack). Refused at the table check where a trigger is seen; the same
    table without the trigger relays (the window is then AUTO_INCREMENT's microseconds)."""
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE SEQUENCE {name}_ids"))
        conn.execute(text(f"CREATE TABLE {name} (id BIGINT NOT NULL DEFAULT NEXTVAL({name}_ids) PRIMARY KEY, "
                          "v INT) ENGINE=InnoDB"))
        conn.execute(text(f"CREATE TRIGGER {name}_audit BEFORE INSERT ON {name} FOR EACH ROW SET NEW.v = NEW.v + 1"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES (1), (2)"))
    source = SourceDatabaseResource(url=source_url(mariadb_database))
    try:
        with pytest.raises(SourceError, match=rf"^{name}: watermark column 'id' takes its ids from a sequence .*"
                                              rf"BEFORE INSERT trigger\(s\) {name}_audit .*AUTO_INCREMENT"):
            source.table_shape(None, name, "id")
        with mariadb_engine.begin() as conn:
            conn.execute(text(f"DROP TRIGGER {name}_audit"))
        seen = observe_when_fresh(source, source.table_shape(None, name, "id"))
        assert seen is not None and seen.watermark == 2
    finally:
        source.dispose()


def test_mariadb_myisam_table_relays_exactly_once_beside_a_long_insert(services, mariadb_database, mariadb_engine,
                                                                       dagster_instance, spark, name) -> None:
    """MyISAM (and Aria) are accepted without transactions to wait for: a writing statement takes the whole table, so
    rows become visible in the order their ids were drawn. Shown end to end: ticks and runs while one slow
    INSERT ... SELECT of 20k rows runs for seconds, then every row exactly once."""
    with mariadb_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint AUTO_INCREMENT PRIMARY KEY, v int) ENGINE=MyISAM"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT seq FROM seq_1_to_1000"))
    cfg = relay_config(services, {"src": mariadb_database}, [
        {"source": "src", "table": name, "watermark": "id", "settle_seconds": 0.2, "slice_max_rows": 50_000}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    h.drain(table, until_hi=1000)
    done = threading.Event()

    def long_insert() -> None:
        with mariadb_engine.begin() as conn:
            # ~4 s: a row every 0.2 ms (SLEEP per row), so ticks and runs go on beside it.
            conn.execute(text(f"INSERT INTO {name} (v) SELECT seq FROM seq_1_to_20000 WHERE SLEEP(0.0002) = 0"))
        done.set()

    writer = threading.Thread(target=long_insert)
    writer.start()
    ticks_while_writing = 0
    while not done.is_set():
        for key in h.tick(table):
            h.run(table, key)
        ticks_while_writing += not done.is_set()  # the insert still ran when this tick (and its runs) ended
        time.sleep(0.05)
    writer.join()
    assert ticks_while_writing >= 2, "the insert ended before the relay could tick beside it: nothing was shown"
    h.drain(table, until_hi=21_000, timeout=180)
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), list(range(1, 21_001)))


def test_postgres_rule_that_writes_elsewhere_is_not_a_relation_the_read_takes_rows_from(services, pg_database,
                                                                                         pg_engine, name) -> None:
    """Only a view's SELECT rule says what a read of it takes rows from. An INSERT rule of a logged table that also
    writes into an UNLOGGED audit table was followed too, and the table refused."""
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v int)"))
        conn.execute(text(f"CREATE UNLOGGED TABLE {name}_audit (id bigint, v int)"))
        conn.execute(text(f"CREATE RULE {name}_audited AS ON INSERT TO {name} DO ALSO "
                          f"INSERT INTO {name}_audit VALUES (NEW.id, NEW.v)"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES (1), (2)"))
    source = SourceDatabaseResource(url=source_url(pg_database))
    try:
        seen = source.observe(source.table_shape("public", name, "id"))
        assert seen is not None and seen.watermark == 2
    finally:
        source.dispose()


def test_postgres_partitioned_table_relays_exactly_once(services, pg_database, pg_engine, dagster_instance, spark,
                                                        name) -> None:
    """A partitioned table whose partitions are all logged (a default one included) passes the checks on every
    partition and is read through its parent: every row once, across partition bounds and slices."""
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v int) PARTITION BY RANGE (id)"))
        for lo in range(1, 3001, 1000):
            conn.execute(text(f"CREATE TABLE {name}_{lo} PARTITION OF {name} FOR VALUES FROM ({lo}) TO ({lo + 1000})"))
        conn.execute(text(f"CREATE TABLE {name}_rest PARTITION OF {name} DEFAULT"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT g FROM generate_series(1, 3500) g"))
    cfg = relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "id", "slice_max_rows": 1000}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    assert len(h.drain(table, until_hi=3500)) == 4
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), list(range(1, 3501)))
