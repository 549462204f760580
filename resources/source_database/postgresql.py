"""PostgreSQL's strategy: its catalogs, timestamp kinds, the look at the max (xmax and open virtual transactions), what
makes new rows unknowable final (standbys, subscriptions, foreign, materialized and UNLOGGED relations, sequences),
and when they are final and durable (`PostgreSQL.not_final_because`)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import DOMAIN

from resources.slices import WatermarkCandidate
from resources.source_database.cache import KeptAnswers
from resources.source_database.dialect import (
    NOT_DURABLE,
    PRIMARY_REMEDY,
    Dialect,
    Seen,
    Source,
    WatermarkKind,
    first_few,
    flushed_within,
)
from resources.source_database.errors import SourceError
from resources.source_database.shape import TableShape, filtered, table_clause

# Virtual transaction ids of the transactions open now in this database, other than ours. Every transaction
# holds the lock on its own vxid from its start, with or without an xid (pg_locks shows fast-path locks too).
_PG_OPEN_VXIDS = (
    "SELECT l.virtualxid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
    "WHERE l.locktype = 'virtualxid' AND l.granted AND l.pid <> pg_backend_pid() "
    "AND a.datid = (SELECT oid FROM pg_database WHERE datname = current_database())"
)

# `refuse_unknowable_finality` on PostgreSQL, one statement. `reached`: the relations a read of the table takes rows
# from (itself, its partitions and inheritance children, what a view's rule reads, recursively), each with its depth (0:
# the table itself). A view's rule is its SELECT rule (ev_type '1'); a rule that writes elsewhere on INSERT reads
# nothing into this table. Then: the recovery flag; a subscription filling any of them; the first foreign table,
# materialized view or UNLOGGED relation among them; among the watermark's sequences (its serial or identity sequence,
# any its DEFAULT calls) in any of them, an UNLOGGED one first (PostgreSQL 15+: `ALTER SEQUENCE ... SET UNLOGGED` behind
# a logged table), else the most caching, with its persistence and the relation it feeds: a child's or a partition's own
# DEFAULT serves inserts made into it directly, and a view's rows take their ids from its base table; and two of those
# sequences, if the watermark takes ids from more than one (`fed`). A reached relation's watermark is its column of the
# same name, and only along relations whose ids the table's can be (`ids`): partitions, children, and the base of a view
# over one relation. A join's other tables have columns of that name too (`customers.id` beside `orders.id`): they are
# not followed (such views would be refused), nor is a view that renames the column (docs/design.md).
_PG_FINALITY_CATALOG = """
WITH RECURSIVE reached(oid, depth, ids) AS (
    SELECT CAST(CAST(:rel AS regclass) AS oid), 0, true
    UNION
    SELECT x.oid, r.depth + 1, r.ids AND x.single FROM reached r CROSS JOIN LATERAL (
        SELECT i.inhrelid AS oid, true AS single FROM pg_inherits i WHERE i.inhparent = r.oid
        UNION ALL
        SELECT b.oid, b.bases = 1 FROM (
            SELECT v.oid, count(*) OVER () AS bases FROM (
                SELECT DISTINCT d.refobjid AS oid FROM pg_rewrite w
                JOIN pg_depend d ON d.classid = 'pg_rewrite'::regclass AND d.objid = w.oid
                    AND d.refclassid = 'pg_class'::regclass
                WHERE w.ev_class = r.oid AND w.ev_type = '1' AND d.refobjid <> r.oid) v) b) x
    WHERE r.depth < 32),
rel AS (
    SELECT c.oid, c.relkind, c.relpersistence, CAST(CAST(c.oid AS regclass) AS text) AS name,
        min(reached.depth) AS depth, bool_or(reached.ids) AS ids
    FROM reached JOIN pg_class c ON c.oid = reached.oid GROUP BY c.oid, c.relkind, c.relpersistence),
fed AS (
    SELECT q.seq, rel.name, rel.depth FROM rel
    JOIN pg_attribute a ON a.attrelid = rel.oid AND a.attname = :column AND a.attnum > 0 AND NOT a.attisdropped
    CROSS JOIN LATERAL (
        -- its serial or identity sequence (what pg_get_serial_sequence finds)
        SELECT d.objid AS seq FROM pg_depend d WHERE d.classid = 'pg_class'::regclass
            AND d.refclassid = 'pg_class'::regclass AND d.refobjid = rel.oid AND d.refobjsubid = a.attnum
            AND d.deptype IN ('a', 'i')
        UNION
        -- any sequence its DEFAULT calls
        SELECT dep.refobjid FROM pg_attrdef ad
        JOIN pg_depend dep ON dep.classid = 'pg_attrdef'::regclass AND dep.objid = ad.oid
            AND dep.refclassid = 'pg_class'::regclass
        WHERE ad.adrelid = rel.oid AND ad.adnum = a.attnum) q
    JOIN pg_sequence s ON s.seqrelid = q.seq
    WHERE :integer AND rel.ids)
SELECT pg_is_in_recovery(),
    (SELECT ARRAY[s.subname, rel.name, CAST(rel.depth AS text)] FROM pg_subscription_rel sr
        JOIN pg_subscription s ON s.oid = sr.srsubid JOIN rel ON rel.oid = sr.srrelid ORDER BY rel.depth LIMIT 1),
    (SELECT ARRAY[CASE WHEN rel.relkind IN ('f', 'm') THEN CAST(rel.relkind AS text) ELSE 'u' END, rel.name,
                  CAST(rel.depth AS text)]
        FROM rel WHERE rel.relkind IN ('f', 'm') OR rel.relpersistence = 'u'
        ORDER BY rel.relkind IN ('f', 'm') DESC, rel.depth, rel.name LIMIT 1),
    q.seqcache, CAST(CAST(q.seqrelid AS regclass) AS text), q.name, CAST(q.depth AS text), q.unlogged,
    (SELECT ARRAY[CAST(CAST(f.seq AS regclass) AS text), f.name, CAST(f.depth AS text),
                  CAST(CAST(g.seq AS regclass) AS text), g.name, CAST(g.depth AS text)]
        FROM fed f JOIN fed g ON g.seq <> f.seq ORDER BY f.depth, f.name, g.depth, g.name LIMIT 1)
FROM (SELECT 1) one LEFT JOIN LATERAL (
    SELECT s.seqcache, s.seqrelid, fed.name, fed.depth, sc.relpersistence = 'u' AS unlogged FROM fed
    JOIN pg_sequence s ON s.seqrelid = fed.seq JOIN pg_class sc ON sc.oid = fed.seq
    ORDER BY sc.relpersistence = 'u' DESC, s.seqcache DESC, fed.depth, fed.name LIMIT 1) q ON true
"""
# PostgreSQL: the WAL position each finality candidate waits to see flushed, from the first check that found its
# transactions ended, per server start (see `is_final`).
DURABLE_TARGETS = KeptAnswers()

_WAL_PAGE = 8192
_WAL_PAGE_HEADERS = (24, 40)  # a page's short header; the long one at a WAL segment's start


def pg_lsn(text: str) -> int:
    """A PostgreSQL LSN ('16/B374D848') as an integer."""
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def wal_flushed_to(flushed: int, target: int) -> bool:
    """Whether WAL flushed up to `flushed` covers everything inserted before `target`. An insert position at a page
    start points past the page's header, which is written only with the next record: a flush that ended at the page
    boundary covers it (else an idle server whose last record ended a page would never look flushed)."""
    offset = target % _WAL_PAGE
    return flushed >= target or (offset in _WAL_PAGE_HEADERS and flushed >= target - offset)




class PostgreSQL(Dialect):
    def base_type(self, col_type: Any) -> Any:
        """A domain as its base type (reflected as DOMAIN, it would be refused as a type rowrelay cannot read),
        through domains over domains: the driver reads its values as the base type's, and its constraints are the
        database's business."""
        while isinstance(col_type, DOMAIN) and col_type.data_type is not None:
            col_type = col_type.data_type
        return col_type

    def declared_type_query(self, rel: str, schema: str | None, table: str, column: str
                            ) -> tuple[str, dict[str, Any]] | None:
        return ("SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
                "WHERE attrelid = CAST(:rel AS regclass) AND attname = :column", {"rel": rel, "column": column})

    def source_text(self, col_type: Any) -> str:
        if isinstance(col_type, sa.DateTime):
            return "timestamptz" if col_type.timezone else "timestamp"
        return "date" if isinstance(col_type, sa.Date) else ""

    def timestamp_kind(self, label: str, watermark: str, wm_type: Any) -> WatermarkKind:
        return "timestamptz" if wm_type.timezone else "timestamp"

    def check_shape(self, source: Source, shape: TableShape, label: str) -> None:
        if shape.timestamps:
            check_watermark_times(source, shape, label)  # one indexed probe

    def fraction_sql(self, column: str) -> str:
        return f"CAST(date_part('microseconds', {column}) AS bigint) % 1000000"

    def observe(self, source: Source, conn: sa.Connection, shape: TableShape, t: sa.TableClause) -> Seen:
        """The max with the xmax of the same snapshot, which the later xmin must reach, and the virtual transactions
        open after it was read (`_PG_OPEN_VXIDS`). The clock: this transaction's start (now()), before every
        transaction this look does not wait for."""
        # The table's incarnation: a candidate of a table since re-created or truncated (ids restarted) must not
        # settle over the new table's open transactions (sensors.settled_watermark).
        incarnation = sa.text(
            "(SELECT c.oid::text || '/' || c.relfilenode::text FROM pg_class c "
            "WHERE c.oid = CAST(:rowrelay_rel AS regclass))").bindparams(
            rowrelay_rel=source.engine.dialect.identifier_preparer.format_table(t))
        clock = ("LOCALTIMESTAMP" if shape.watermark_kind == "timestamp" else "now()") if shape.timestamps else "NULL"
        row = conn.execute(sa.select(sa.func.max(t.c[shape.watermark]),
                                     sa.text("pg_snapshot_xmax(pg_current_snapshot())::text"), sa.text(clock),
                                     incarnation, self.shown_step_sql(source, shape, t)).select_from(t)).one()
        waits = tuple(conn.execute(sa.text(_PG_OPEN_VXIDS)).scalars()) if row[0] is not None else ()
        return Seen(max=row[0], marker=row[1], waits=waits, clock=row[2], table_token=row[3], shown_step=row[4])

    def refuse_unknowable_finality(self, source: Source, shape: TableShape, conn: sa.Connection) -> None:
        """Any relation a read of the table takes rows from counts: a partition, a child, a view's base table
        (`_PG_FINALITY_CATALOG`, one statement)."""
        standby, subscription, odd, cache, sequence, fed, fed_depth, unlogged_sequence, two = conn.execute(
            sa.text(_PG_FINALITY_CATALOG), {
                "rel": source.engine.dialect.identifier_preparer.format_table(table_clause(shape)),
                "column": shape.watermark, "integer": shape.watermark_kind == "integer"}).one()
        label = shape.label
        if standby:
            raise SourceError(
                f"{label}: source {source.safe_description} is a PostgreSQL standby (pg_is_in_recovery()). A "
                "standby cannot show the primary's open transactions, so rowrelay cannot tell there when new "
                "rows are final: a row whose id was drawn before a higher one committed could be cut past and "
                f"never sent; {PRIMARY_REMEDY}")
        if subscription is not None:
            _refuse_subscription(source, label, *subscription)
        if odd is not None:
            _refuse_relation(label, *odd)
        of = "" if fed_depth == "0" else f" of {fed}, which a read of the table takes rows from,"
        _refuse_sequences(shape, of, sequence, cache, unlogged_sequence, two)

    def not_final_because(self, source: Source, conn: sa.Connection, candidate: WatermarkCandidate,
                          settle_seconds: float) -> str | None:
        """Final once the xmin of a new snapshot has reached the xmax seen with the max, none of the virtual
        transactions open then is still open, no transaction prepared after it holds it, and the WAL is flushed past
        where those commits lay (see the source's `is_final`)."""
        # The waited-for transactions still open, with their backend's pid: the same lookup as an
        # EXISTS, and the skip message can name them.
        # And the prepared transactions of the table's database (pg_prepared_xacts, readable by any
        # role), read after the vxids: one that prepared before pg_locks was read is listed here.
        xmin, still_open, prepared, flushed, inserted, started = conn.execute(sa.text(
            "SELECT pg_snapshot_xmin(pg_current_snapshot())::text, ARRAY(SELECT virtualxid || ' (pid ' "
            "|| COALESCE(pid::text, '?') || ')' FROM pg_locks WHERE locktype = 'virtualxid' AND granted "
            "AND virtualxid = ANY(CAST(:waits AS text[]))), "
            "ARRAY(SELECT ARRAY[gid, transaction::text, prepared::text, owner::text] "
            "FROM pg_prepared_xacts WHERE database = current_database() ORDER BY prepared), "
            "pg_current_wal_flush_lsn()::text, pg_current_wal_insert_lsn()::text, "
            "pg_postmaster_start_time()"), {"waits": list(candidate.waits)}).one()
        if int(xmin) < candidate.marker:
            # xid8 -> the 32-bit xid that pg_stat_activity.backend_xid and pg_prepared_xacts show.
            return (f"transaction id {int(xmin) & 0xFFFFFFFF}, begun before the max was seen, is still "
                    "open (the oldest on the server, in any database: pg_stat_activity.backend_xid, or "
                    "pg_prepared_xacts if it is a prepared transaction)")
        # PREPARE TRANSACTION releases the vxid lock ("not meaningful after restart"), so a transaction
        # waited for by its vxid, that took its xid after the max was seen (at or above the marker: the
        # xmin above passes it) and prepared, is no longer among `still_open`, though COMMIT PREPARED
        # may still make rows below the max visible. Those prepared with a lower xid hold the xmin.
        holding = [_pg_prepared_text(*row) for row in prepared or []
                   if _pg_full_xid(int(row[1]), int(xmin)) >= candidate.marker]
        if holding:
            return first_few(holding)
        if still_open:
            return (f"transaction {first_few(list(still_open), sep=', ')}, open in the table's "
                    "database when the max was seen, is still open (pg_stat_activity by that pid)")
        # The first position seen once the waits ended is the target, kept: a later one would move
        # with every write (a WAL writer slower than the check's wait would never be caught up with).
        # Per server start: after a crash the same candidate can come back (its xids given out again)
        # over WAL written anew, which a target from before the crash does not cover.
        key = (str(source.engine.url), started, candidate)
        target = DURABLE_TARGETS.answer(key, lambda: pg_lsn(inserted))
        if wal_flushed_to(pg_lsn(flushed), target) or flushed_within(lambda: wal_flushed_to(pg_lsn(
                conn.execute(sa.text("SELECT pg_current_wal_flush_lsn()::text")).scalar()), target)):
            DURABLE_TARGETS.forget(key)
            return None
        return NOT_DURABLE


def check_watermark_times(source: Source, shape: TableShape, label: str) -> None:
    """Refuse a PostgreSQL timestamp watermark holding a value after the year 9999 (rowrelay carries it as
    microseconds, within Python's datetime): 'infinity' or year 10000 would fail every cut with the driver's
    "timestamp too large", naming neither table nor column."""
    # Only above: the table's max is read as a time, every cut's too; rows before the year 1 ('-infinity') lie
    # below any progress and are never read (a table holding them relays, with a `start_after`).
    t = table_clause(shape)
    bound = sa.literal_column("TIMESTAMPTZ '10000-01-01 00:00:00+00'" if shape.watermark_kind == "timestamptz"
                              else "TIMESTAMP '10000-01-01'")
    q = filtered(sa.select(sa.literal(1)).select_from(t).where(t.c[shape.watermark] >= bound), shape)
    with source.engine.connect() as conn:
        above = conn.execute(q.limit(1)).first()
    if above:
        raise SourceError(
            f"{label}: watermark column {shape.watermark!r} holds times after the year 9999 ('infinity' "
            "included); a timestamp watermark must be a time of the years 1-9999 (rowrelay carries it as "
            "microseconds since 1970), so no slice can be cut. Fix those rows, or leave them out with `where:` "
            f"(for example {shape.watermark} < '10000-01-01'); nothing was sent")


def _refuse_subscription(source: Source, label: str, subname: str, filled: str, depth: str) -> None:
    what = "the table is" if depth == "0" else f"{filled}, which a read of the table takes rows from, is"
    raise SourceError(
        f"{label}: {what} filled by logical replication (subscription {subname!r}) on source "
        f"{source.safe_description}. Its rows arrive in the publisher's commit order and the publisher's "
        "open transactions are invisible here, so rowrelay cannot tell when new rows are final: a row "
        "whose id was drawn before a higher one committed could be cut past and never sent; relay the "
        "table from the publisher (its url) and run again; nothing was cut or sent")


def _refuse_relation(label: str, kind: str, relation: str, depth: str) -> None:
    """A foreign table, a materialized view or an UNLOGGED relation among those a read of the table takes rows
    from."""
    what = "the table" if depth == "0" else f"{relation}, which a read of the table takes rows from,"
    if kind == "f":
        raise SourceError(
            f"{label}: {what} is a foreign table: its rows live on another server, whose open "
            "transactions rowrelay cannot see from here, so it cannot tell when new rows are final: a "
            "row whose id was drawn before a higher one committed could be cut past and never sent. "
            "Relay the table from the server that holds it (a source with its url) and run again; "
            "nothing was cut or sent")
    if kind == "m":
        raise SourceError(
            f"{label}: {what} is a materialized view: its rows change only when it is refreshed, all at "
            "once, so a row committed in its base tables after one refresh appears at the next, below "
            "rows already sent, and would never be sent. Relay the table it is built from and run "
            "again; nothing was cut or sent")
    raise SourceError(
        f"{label}: {what} is UNLOGGED: its rows are not in the write-ahead log, so a crash of the "
        "server empties it: rows already sent vanish from the source, and where the watermark's values "
        "restart (an UNLOGGED table's own sequence), new rows take them and are never sent. Run "
        f"`ALTER TABLE {relation} SET LOGGED` (or relay a logged copy) and run again; nothing was cut or "
        "sent")


def _refuse_sequences(shape: TableShape, of: str, sequence: str | None, cache: Any, unlogged_sequence: bool | None,
                      two: list[str] | None) -> None:
    """The watermark's sequences: UNLOGGED, two of them, or one that caches ids per session."""
    label = shape.label
    if unlogged_sequence:
        raise SourceError(
            f"{label}: watermark column {shape.watermark!r}{of} takes its ids from sequence {sequence}, which "
            "is UNLOGGED: it is not in the write-ahead log, so a crash of the server resets it to its start "
            "while the table keeps its rows, and new rows take ids at or below those already sent and are "
            f"never sent. Run `ALTER SEQUENCE {sequence} SET LOGGED` and run again; nothing was cut or sent")
    if two is not None:
        first, first_rel, first_depth, other, other_rel, other_depth = two
        whose = ["the table's" if depth == "0" else f"{rel}'s, which a read of the table takes rows from"
                 for rel, depth in ((first_rel, first_depth), (other_rel, other_depth))]
        raise SourceError(
            f"{label}: watermark column {shape.watermark!r} takes its ids from two sequences: {first} "
            f"({whose[0]}) and {other} ({whose[1]}). Each counts on its own, so a row inserted through one "
            "takes an id at or below those the other has already handed out (and rowrelay sent), and would "
            f"never be sent. Give {other_rel} the same source of ids (`ALTER TABLE {other_rel} ALTER COLUMN "
            f"{shape.watermark} DROP IDENTITY IF EXISTS, ALTER COLUMN {shape.watermark} SET DEFAULT "
            f"nextval('{first}')`) and run again; nothing was cut or sent")
    if cache is not None and int(cache) > 1:
        raise SourceError(
            f"{label}: watermark column {shape.watermark!r}{of} takes its ids from sequence {sequence}, which "
            f"caches {cache} per session (CACHE {cache}): a session can insert an id from its cache long "
            "after another session committed a higher one, in a transaction no cut can wait for, and that "
            f"row would never be sent. Run `ALTER SEQUENCE {sequence} CACHE 1` (ids are then drawn in "
            "order of asking) and run again; nothing was cut or sent")


def _pg_full_xid(xid: int, xmin: int) -> int:
    """A 32-bit xid still running (pg_prepared_xacts.transaction) as the 64-bit xid8 it is: at or above `xmin`, the
    xid8 of a snapshot taken while it runs (the oldest running xid, less than 2^31 below any running one)."""
    return xmin + ((xid - xmin) & 0xFFFFFFFF)


def _pg_prepared_text(gid: str, xid: str, prepared: str, owner: str) -> str:
    """A PostgreSQL prepared transaction that holds a candidate, as the skip message names it: like MariaDB's
    detached XA transaction (`_innodb_trx_text`), it never ends by itself, so the text says who must end it."""
    return (f"prepared transaction {gid!r} (transaction id {xid}, prepared {prepared} by {owner}), which took its "
            "transaction id after the max was seen, may still commit rows below it: it will not end on its own; its "
            "transaction manager, or an operator, must COMMIT PREPARED or ROLLBACK PREPARED it (pg_prepared_xacts "
            "lists its gid)")
