"""MariaDB's (and MySQL's) strategy: its catalogs and text charsets, DATETIME watermarks, the look at the max (InnoDB's
open transactions, running statements, the redo log), what makes new rows unknowable final (engines, replicas), and
when they are final and durable (`MariaDB.not_final_because`)."""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from resources.slices import WatermarkCandidate, datetime_to_micros
from resources.source_database import hooks
from resources.source_database.cache import KeptAnswers
from resources.source_database.dialect import (
    NOT_DURABLE,
    PRIMARY_REMEDY,
    TEXT_REMEDY,
    Dialect,
    Seen,
    Source,
    WatermarkKind,
    first_few,
    flushed_within,
    settling,
)
from resources.source_database.errors import InnodbTrxStale, SourceError
from resources.source_database.shape import TableShape

# A statement that only reads (MariaDB's processlist text, after comments): it writes no row of the table.
_READ_STATEMENT = re.compile(r"^(\s|/\*.*?\*/|--[^\n]*\n|#[^\n]*\n)*(SELECT|WITH|SHOW)\b", re.IGNORECASE | re.DOTALL)
# Taken off a running statement's estimated start: the processlist's elapsed time and NOW(6) come from two clocks.
_STATEMENT_START_MARGIN_S = 0.01

# Reads of innodb_trx, 150 ms apart, until one is known fresh (see `_innodb_trx_open_since`).
INNODB_TRX_READS = 14

# MariaDB/MySQL engines whose new rows rowrelay can tell final (`is_final`): InnoDB by its open transactions;
# MyISAM and Aria take the whole table per writing statement, so rows become visible in the order their ids were
# drawn. A view has no engine (NULL): not checked.
_MYSQL_ENGINES_KNOWN = frozenset({"innodb", "myisam", "aria"})

# Per server (its URL, no password): whether its information_schema.CHECK_CONSTRAINTS has a TABLE_NAME (MySQL's has
# none): else the UTF-8 column query goes without its JSON-check part there.
CHECK_TABLE_NAMES = KeptAnswers()

def _charset_names(rows: Sequence[Any]) -> dict[str, str]:
    """Column -> charset, from information_schema (a charset's name goes into the read's SQL: only a plain one)."""
    return {name: charset for name, charset, _ in rows if charset and re.fullmatch(r"[a-z0-9_]+", charset)}




class MariaDB(Dialect):
    text_remedy = TEXT_REMEDY

    def declared_type_query(self, rel: str, schema: str | None, table: str, column: str
                            ) -> tuple[str, dict[str, Any]] | None:
        return ("SELECT COLUMN_TYPE FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = COALESCE(:schema, DATABASE()) "
                "AND TABLE_NAME = :table AND COLUMN_NAME = :column", {"schema": schema, "table": table,
                                                                      "column": column})

    def cannot_read(self, col_type: Any) -> bool:
        """MariaDB's UUID is a type Spark's JDBC reader does not know."""
        return isinstance(col_type, sa.Uuid)

    def text_charsets(self, source: Source, schema: str | None, table: str) -> tuple[dict[str, str], set[str]]:
        """MariaDB/MySQL: the table's text columns whose values must be checked on the way (column -> charset):
        those in a UTF-8 charset (utf8mb3, utf8mb4) and those in a charset with bytes that have no character (all
        but latin1, whose 256 bytes all convert both ways). And those of them to read as text with their bytes beside
        them (`ColumnInfo.utf8_shadow`): columns that may be JSON, which the driver marks as such only while it reads
        them as text (its mark decides how they are sent) — a LONGTEXT with a json_valid()
        check (MariaDB's JSON; the catalog cannot tell a declared JSON from a hand-written check) and a view's
        LONGTEXT (no catalog tells). MySQL's JSON type is stored parsed, always valid: not checked."""
        columns = ("SELECT c.COLUMN_NAME, c.CHARACTER_SET_NAME, c.DATA_TYPE = 'longtext' AND ({json} OR EXISTS ("
                   "SELECT 1 FROM information_schema.TABLES v WHERE v.TABLE_SCHEMA = c.TABLE_SCHEMA AND v.TABLE_NAME "
                   "= c.TABLE_NAME AND v.TABLE_TYPE = 'VIEW')) FROM information_schema.COLUMNS c WHERE "
                   "c.TABLE_SCHEMA = COALESCE(:schema, DATABASE()) AND c.TABLE_NAME = :table AND c.DATA_TYPE <> "
                   "'json' AND c.CHARACTER_SET_NAME NOT IN ('latin1', 'binary')")
        json_checks = ("EXISTS (SELECT 1 FROM information_schema.CHECK_CONSTRAINTS k WHERE "
                       "k.CONSTRAINT_SCHEMA = c.TABLE_SCHEMA AND k.TABLE_NAME = c.TABLE_NAME AND "
                       "LOCATE(CONCAT('json_valid(`', c.COLUMN_NAME, '`)'), k.CHECK_CLAUSE) > 0)")
        params = {"schema": schema, "table": table}
        rows: list[Any] | None = None
        with source.engine.connect() as conn:

            def with_json_checks() -> bool:
                nonlocal rows
                try:
                    rows = conn.execute(sa.text(columns.format(json=json_checks)), params).all()
                    return True
                except sa.exc.DBAPIError:  # MySQL: CHECK_CONSTRAINTS without TABLE_NAME (or none); JSON is a type
                    conn.rollback()
                    return False

            server = source.engine.url.render_as_string(hide_password=True)
            if CHECK_TABLE_NAMES.answer((server,), with_json_checks) and rows is None:
                rows = conn.execute(sa.text(columns.format(json=json_checks)), params).all()
            if rows is None:
                rows = conn.execute(sa.text(columns.format(json="FALSE")), params).all()
        return _charset_names(rows), {name for name, _, shadowed in rows if shadowed}

    def source_text(self, col_type: Any) -> str:
        return {"DATE": "mysql_date", "DATETIME": "mysql_datetime", "TIMESTAMP": "mysql_timestamp",
                "FLOAT": "mysql_float"}.get(type(col_type).__name__, "")

    def timestamp_kind(self, label: str, watermark: str, wm_type: Any) -> WatermarkKind:
        if type(wm_type).__name__ == "DATETIME":
            return "timestamp"
        raise SourceError(f"{label}: watermark column {watermark!r} has type {wm_type}; a timestamp watermark "
                          "on MariaDB/MySQL must be DATETIME (ideally DATETIME(6)): TIMESTAMP values are shown "
                          "in each session's time zone. Use a DATETIME column or a view")

    def fractional_digits(self, wm_type: Any) -> int:
        """Its fsp, unset: 0."""
        return int(getattr(wm_type, "fsp", None) or 0)

    def check_shape(self, source: Source, shape: TableShape, label: str) -> None:
        if shape.timestamps:
            check_datetime_watermark(source, shape, label)  # one catalog row
        else:
            check_sequence_watermark(source, shape, label)  # one catalog row (two with a sequence DEFAULT)

    def fraction_sql(self, column: str) -> str:
        return f"MICROSECOND({column})"

    def observe(self, source: Source, conn: sa.Connection, shape: TableShape, t: sa.TableClause) -> Seen:
        """The max with the database clock, then the writing statements still running and the InnoDB transactions
        open (each read after the max), and the redo log's position."""
        # Our own InnoDB transaction, begun before the max is read: innodb_trx lists it, with the statement
        # it ran when the cache was filled (`_innodb_trx_open_since` proves its read fresh by that).
        conn.execute(sa.text("START TRANSACTION WITH CONSISTENT SNAPSHOT"))
        # NOW(6): the wall clock of this session's zone (the server's default unless the URL sets one),
        # which is what writers in that zone store with CURRENT_TIMESTAMP: a DATETIME's own frame. The
        # epoch time only times the settle delay.
        row = conn.execute(sa.select(sa.func.max(t.c[shape.watermark]), sa.text("UNIX_TIMESTAMP(NOW(6))"),
                                     sa.text("CONNECTION_ID()"), sa.text("NOW(6)"),
                                     _mysql_incarnation(shape), self.shown_step_sql(source, shape, t))
                           .select_from(t)).one()
        hooks.observe_pause("max read", conn)
        # Running statements first, then open transactions, from a cache filled during that second read: a
        # statement that ends before it has touched a row by then, so its transaction, if still open, is
        # listed (the other order, or a cache filled before the first read, missed one that ended in between
        # with its transaction open).
        earliest = None
        if row[0] is not None and shape.timestamps:
            earliest = _earliest_running_write(conn, datetime_to_micros(row[3]))
        waits = _innodb_trx_open_since(source, conn, int(row[2])) if row[0] is not None else ()
        # Every row at or below the max committed before this point of the redo log (see is_final).
        durable_at = _innodb_lsns(conn).get("innodb_lsn_current") if row[0] is not None else None
        return Seen(max=row[0], marker=row[1], waits=waits, clock=row[3], table_token=row[4], shown_step=row[5],
                    earliest=earliest, durable_at=durable_at)

    def refuse_unknowable_finality(self, source: Source, shape: TableShape, conn: sa.Connection) -> None:
        """A table in MEMORY or an engine whose open transactions are not known, and a MariaDB replica."""
        label = shape.label
        engine = conn.execute(sa.text(
            "SELECT ENGINE FROM information_schema.TABLES WHERE TABLE_SCHEMA = COALESCE(:schema, DATABASE()) "
            "AND TABLE_NAME = :table"), {"schema": shape.schema, "table": shape.name}).scalar()
        if engine is not None and engine.lower() == "memory":
            raise SourceError(
                f"{label}: the table is ENGINE=MEMORY: a restart of the server empties it and restarts its "
                "AUTO_INCREMENT, so rows already sent would vanish while new rows took their ids and were never "
                "sent. Run `ALTER TABLE ... ENGINE=InnoDB` (or relay an InnoDB copy) and run again; nothing was "
                "cut or sent")
        if engine is not None and engine.lower() not in _MYSQL_ENGINES_KNOWN:
            raise SourceError(
                f"{label}: the table is ENGINE={engine}. rowrelay knows when new rows are final only in InnoDB "
                "(whose open transactions it reads) and in MyISAM and Aria (whose writers take the table in "
                f"turn); in {engine} a row whose id was drawn before a higher one committed, or whose rows live "
                "on another server, could be cut past and never sent. Relay an InnoDB table (`ALTER TABLE ... "
                "ENGINE=InnoDB`, or the table on the server that holds it) and run again; nothing was cut or sent")
        if getattr(conn.dialect, "is_mariadb", False):
            running = conn.execute(sa.text("SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS "
                                           "WHERE VARIABLE_NAME = 'SLAVES_RUNNING'")).scalar()
            if running is not None and int(running) > 0 and not source.tables_written_here:
                raise SourceError(
                    f"{label}: source {source.safe_description} is a MariaDB replica (Slaves_running = {running}). "
                    "On a replica rows arrive in the primary's commit order and the primary's open transactions are "
                    "invisible, so rowrelay cannot tell when new rows are final: a row whose id was drawn before a "
                    f"higher one committed could be cut past and never sent; {PRIMARY_REMEDY}. If this table is "
                    "written on this server itself, not by replication, set `tables_written_here: true` on the "
                    "source")

    def not_final_because(self, source: Source, conn: sa.Connection, candidate: WatermarkCandidate,
                          settle_seconds: float) -> str | None:
        """Final once `settle_seconds` passed on the database clock, none of the InnoDB transactions open when the max
        was seen is still open, and the redo log is flushed past those commits (see the source's `is_final`)."""
        now = float(conn.execute(sa.text("SELECT UNIX_TIMESTAMP(NOW(6))")).scalar())
        if now - candidate.marker < settle_seconds:
            return settling(settle_seconds)
        # A stale cache can only list a transaction that has ended since: never calls one ended too soon.
        open_now = _innodb_trx(source, conn) if candidate.waits else []
        holding = [row for row in open_now
                   if any(_same_innodb_trx(wait, [row]) for wait in candidate.waits)]
        if holding:
            # A detached XA transaction first: it is the one that will not end by itself.
            holding.sort(key=lambda row: row.trx_mysql_thread_id != 0)
            return first_few([_innodb_trx_text(row) for row in holding])
        lsns = _innodb_lsns(conn)
        if "innodb_lsn_flushed" not in lsns:  # MySQL: not readable (docstring)
            return None
        # InnoDB flushes a lazy log within a second (innodb_flush_log_at_timeout), inside the check's
        # wait: the position at the check is a target reached in time.
        target = (candidate.durable_at if candidate.durable_at is not None and not candidate.waits
                  else lsns["innodb_lsn_current"])
        flushed_in_time = lsns["innodb_lsn_flushed"] >= target or flushed_within(
            lambda: _innodb_lsns(conn)["innodb_lsn_flushed"] >= target)
        return None if flushed_in_time else NOT_DURABLE


def _earliest_running_write(conn: sa.Connection, now: int) -> int | None:
    """MariaDB: the start of the earliest statement of another session still running that may write rows, or
    None, in the frame of `now` (NOW(6) of the observe session read as UTC, as a DATETIME watermark is: the
    wall clock its writers store).

    A statement's CURRENT_TIMESTAMP(6) is its start time, but InnoDB lists its transaction only once it first
    touches a row: an `INSERT ... VALUES (f())` whose expression, subquery on a non-InnoDB table or lock wait
    takes seconds writes a time below rows that others commit meanwhile, and innodb_trx does not show it while
    it runs. So a timestamp watermark is final only below every such statement's start. Statements that read
    (SELECT, WITH, SHOW: reports, Spark's own reads) are left out: a report query must not hold the table
    back for its whole length. Not covered: a SELECT whose stored function inserts into the table.
    A statement of the event scheduler runs under COMMAND 'Connect' (a client still logging in has no INFO, and
    is left out with a replica's I/O thread, which has none either); a batch a driver sends in one round trip
    (Connector/J's `executeBatch`, Connector/C's array binding) under 'Bulk_execute'.
    `now`: the database clock read before this look (NOW(6), in microseconds), so each start is estimated no
    later than it was; a second is taken off for MySQL, whose processlist counts whole seconds."""
    running_statement = ("ID <> CONNECTION_ID() AND (COMMAND IN ('Query', 'Execute', 'Bulk_execute') "
                         "OR (COMMAND = 'Connect' AND INFO IS NOT NULL))")
    try:
        rows = conn.execute(sa.text(
            f"SELECT TIME_MS / 1000, INFO FROM information_schema.PROCESSLIST WHERE {running_statement}")).all()
    except sa.exc.OperationalError:  # MySQL: no TIME_MS
        rows = [(float(r[0]) + 1.0, r[1]) for r in conn.execute(sa.text(
            f"SELECT TIME, INFO FROM information_schema.PROCESSLIST WHERE {running_statement}")).all()]
    running = [float(elapsed) for elapsed, info in rows if not _READ_STATEMENT.match(info or "")]
    return now - math.ceil((max(running) + _STATEMENT_START_MARGIN_S) * 1_000_000) if running else None


def _innodb_trx_open_since(source: Source, conn: sa.Connection, connection_id: int) -> tuple[str, ...]:
    """The other InnoDB transactions open now, from a read of innodb_trx whose cache was filled by that very
    read, so after everything this connection read before it (the max, the running statements). innodb_trx is a
    cache that InnoDB refreshes only when nobody read it for 100 ms; a client reading it often keeps it stale,
    blind to transactions that touched a row since. Our own transaction's row (`connection_id`, in a transaction
    since before the max) carries the statement it ran when the cache was filled: this read's own token there
    proves the fill came with this read. Our row alone would not: a fill by another client after our transaction
    began, but before the running statements were read, lists it too, and misses a statement that ended in
    between, its transaction left open. Otherwise wait past 100 ms and read again."""
    for _ in range(INNODB_TRX_READS):
        token = uuid.uuid4().hex
        rows = _innodb_trx(source, conn, token)
        if any(r.trx_mysql_thread_id == connection_id and token in (r.trx_query or "") for r in rows):
            return tuple(_innodb_trx_key(r) for r in rows if r.trx_mysql_thread_id != connection_id)
        time.sleep(0.15)
    raise InnodbTrxStale(f"source {source.safe_description}: information_schema.innodb_trx stayed stale for "
                       f"{INNODB_TRX_READS * 0.15:.1f} s (another client reads it more often than every 100 ms), "
                       "so the transactions still open below the max watermark are unknown; retried next time")

def _innodb_trx(source: Source, conn: sa.Connection, token: str = "") -> list[sa.Row]:
    """InnoDB's (cached) list of open transactions. `token` opens the statement's text, so that a cache filled by
    this read shows it as our own transaction's trx_query (InnoDB keeps a statement's first 1024 characters)."""
    try:
        return list(conn.execute(sa.text(
            f"/* rowrelay {token} */ SELECT trx_id, trx_mysql_thread_id, trx_started, trx_query "
            "FROM information_schema.innodb_trx")))
    except sa.exc.DBAPIError as exc:
        if _mysql_error_code(exc) in (1227, 1044, 1142):  # access denied: no PROCESS privilege
            user = source.sqlalchemy_url.username or "<user>"
            raise SourceError(
                f"source {source.safe_description}: user {user!r} cannot read information_schema.innodb_trx, "
                "which rowrelay needs to know when new rows are final (transactions still open below the max "
                f"watermark); run `GRANT PROCESS ON *.* TO '{user}'@'<host>'` ({exc.orig})") from None
        raise


def check_datetime_watermark(source: Source, shape: TableShape, label: str) -> None:
    """Refuse a MariaDB/MySQL DATETIME watermark that moves when a row is updated (`ON UPDATE
    CURRENT_TIMESTAMP`: the UPDATE lifted a row sent already above progress, and it was sent again).

    Zero dates and zero months or days ('0000-00-00', '2024-05-00': an sql_mode without NO_ZERO_DATE /
    NO_ZERO_IN_DATE accepts them) are not looked for here: inside a slice they relay as stored, and below a
    `start_after` they are never read; where a cut or check meets one as a bound, `TableShape.watermark_value`
    refuses it (it failed every tick with a bare "invalid literal for int()")."""
    with source.engine.connect() as conn:
        extra = conn.execute(sa.text(
            "SELECT EXTRA FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = COALESCE(:schema, DATABASE()) "
            "AND TABLE_NAME = :table AND COLUMN_NAME = :column"),
            {"schema": shape.schema, "table": shape.name, "column": shape.watermark}).scalar()
        if extra and "on update" in extra.lower():
            raise SourceError(
                f"{label}: watermark column {shape.watermark!r} is set on every UPDATE ({extra}): an update "
                "moves a row already sent above progress, and it would be sent again (a duplicate). Drop the "
                f"clause (`ALTER TABLE {shape.name} MODIFY {shape.watermark} <its type and DEFAULT, without "
                "ON UPDATE>`) or choose a watermark that is set once, when the row is inserted (an "
                "AUTO_INCREMENT id, a creation time); nothing was sent")

def check_sequence_watermark(source: Source, shape: TableShape, label: str) -> None:
    """Refuse a MariaDB integer watermark whose DEFAULT draws from a SEQUENCE (`DEFAULT NEXTVAL(s)`) on a table
    with a BEFORE INSERT trigger. The id is drawn as the row's defaults are filled, before the trigger runs,
    while InnoDB lists the transaction only once it writes the row: a trigger that takes seconds holds an
    id no cut can wait for, which could commit below a cut made meanwhile and never be sent.
    AUTO_INCREMENT is drawn as the row is written, after the triggers. Triggers are listed only to a role with
    the TRIGGER privilege on the table: without it this is not seen (docs/design.md)."""
    with source.engine.connect() as conn:
        default = conn.execute(sa.text(
            "SELECT COLUMN_DEFAULT FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = "
            "COALESCE(:schema, DATABASE()) AND TABLE_NAME = :table AND COLUMN_NAME = :column"),
            {"schema": shape.schema, "table": shape.name, "column": shape.watermark}).scalar()
        if not default or not re.search(r"\bnextval\s*\(", default, re.IGNORECASE):
            return
        triggers = conn.execute(sa.text(
            "SELECT TRIGGER_NAME FROM information_schema.TRIGGERS WHERE EVENT_OBJECT_SCHEMA = "
            "COALESCE(:schema, DATABASE()) AND EVENT_OBJECT_TABLE = :table AND EVENT_MANIPULATION = 'INSERT' "
            "AND ACTION_TIMING = 'BEFORE' ORDER BY ACTION_ORDER"),
            {"schema": shape.schema, "table": shape.name}).scalars().all()
    if triggers:
        raise SourceError(
            f"{label}: watermark column {shape.watermark!r} takes its ids from a sequence (DEFAULT {default}), "
            f"and BEFORE INSERT trigger(s) {', '.join(triggers)} run after the id is drawn but before InnoDB "
            "lists the inserting transaction: while a trigger runs, no cut can see that id is still to come, "
            "and a row committed below a cut is never sent. Take the ids from AUTO_INCREMENT (drawn as the row "
            "is written, after the triggers); nothing was cut or sent")



def _innodb_lsns(conn: sa.Connection) -> dict[str, int]:
    """MariaDB's redo log positions (Innodb_lsn_current, Innodb_lsn_flushed; lower-case keys), readable by any
    user; empty on MySQL, which has no such status variables."""
    rows = conn.execute(sa.text("SHOW GLOBAL STATUS WHERE Variable_name IN "
                                "('Innodb_lsn_current', 'Innodb_lsn_flushed')")).all()
    return {str(name).lower(): int(value) for name, value in rows}


# innodb_trx's trx_id of a transaction that has written: MySQL prints one that has not (read-only so far) as its
# memory address with bit 48 set, an id the next transaction on that connection may show again.
_INNODB_WRITE_TRX_IDS = 2**48


def _mysql_incarnation(shape: TableShape) -> sa.TextClause:
    """MariaDB/MySQL: the table's incarnation, as a scalar subquery to read in the statement that reads its max (the
    statement's metadata lock keeps the table from being dropped in between): its CREATE_TIME in
    information_schema.TABLES, which any user who may read the table may read, as epoch seconds (UNIX_TIMESTAMP:
    the same text in any session time zone; whole seconds, all either server keeps). A DROP and CREATE
    changes it, unless both fall in the old table's creation second; so does an ALTER that rebuilds the table, which
    only drops a pending candidate needlessly (sensors.settled_watermark). TRUNCATE keeps it. MariaDB takes it from
    the .frm file, MySQL 8 from the data dictionary (mysql.tables.created, not the statistics that
    information_schema_stats_expiry caches). NULL (no token) for a view."""
    schema = ":rowrelay_schema" if shape.schema else "DATABASE()"
    clause = sa.text("(SELECT CAST(UNIX_TIMESTAMP(CREATE_TIME) AS CHAR) FROM information_schema.TABLES "
                     f"WHERE TABLE_SCHEMA = {schema} AND TABLE_NAME = :rowrelay_name)")
    # Literal names in the lookup (not COALESCE of a parameter): MariaDB then opens that one table, not every one.
    return clause.bindparams(rowrelay_name=shape.name, **({"rowrelay_schema": shape.schema} if shape.schema else {}))


def _innodb_trx_key(row: sa.Row) -> str:
    """One open InnoDB transaction, as `thread id|trx_started|trx_id` (as InnoDB reports them, so never converted
    between zones). The thread and start tell a transaction while its client is connected; trx_id, once it has
    written (before that it is 0, or an address on MySQL, and it changes at the first write), also after its client
    disconnected from a prepared XA transaction, which MariaDB keeps detached under thread id 0."""
    trx_id = int(row.trx_id) if str(row.trx_id).isdigit() else 0
    return f"{row.trx_mysql_thread_id}|{row.trx_started}|{trx_id if trx_id < _INNODB_WRITE_TRX_IDS else 0}"


def _innodb_trx_text(row: sa.Row) -> str:
    """An open InnoDB transaction, as the skip message names it. Thread id 0 is a prepared XA transaction whose
    client disconnected (`_innodb_trx_key`): unlike any other it never ends by itself, so the text says who must
    end it."""
    if row.trx_mysql_thread_id == 0:
        return (f"a prepared XA transaction (InnoDB trx_id {row.trx_id}, started {row.trx_started}) whose client "
                "disconnected is still open: it will not end on its own; its transaction manager, or an operator, "
                "must XA COMMIT or XA ROLLBACK it (XA RECOVER lists its xid)")
    return (f"InnoDB transaction {row.trx_id} of connection {row.trx_mysql_thread_id} (started {row.trx_started}), "
            "open when the max was seen, is still open")



def _same_innodb_trx(key: str, open_now: list[sa.Row]) -> bool:
    """Whether the transaction `key` names is among `open_now`: the same thread and start; or the same trx_id, once
    it has written; or a detached XA transaction (thread 0) of the same start, whose trx_id changed if it first
    wrote after the key was taken (another detached one of that second only makes the cut wait longer). A key
    without trx_id (a sensor cursor written before it was kept) is matched by thread and start."""
    thread, started, *rest = key.split("|")
    trx_id = rest[0] if rest and rest[0] != "0" else None
    for row in open_now:
        now = _innodb_trx_key(row).split("|")
        if now[1] == started and now[0] in (thread, "0"):
            return True
        if trx_id is not None and now[2] == trx_id:
            return True
    return False


def _mysql_error_code(exc: sa.exc.DBAPIError) -> int | None:
    args = getattr(exc.orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None
