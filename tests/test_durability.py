"""A watermark is final only once its rows are durable: where commits are acknowledged before the log is on disk
(PostgreSQL's synchronous_commit=off, MariaDB's innodb_flush_log_at_trx_commit=0), a crash of the server loses the
last commits and gives their ids out again. Each test runs its own server (it is crashed) with the flush held back
for longer than the test looks."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL

from resources.slices import WatermarkCandidate
from resources.source_database import SourceDatabaseResource
from tests.private_servers import USER, mariadb_servers, postgres_servers

pytestmark = pytest.mark.integration


def _execute(url: URL, *statements: str) -> None:
    """The statements in order, in one session, each committed."""
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            for statement in statements:
                conn.execute(text(statement))
    finally:
        engine.dispose()


def _count(url: URL, table: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar())
    finally:
        engine.dispose()


def test_postgres_rows_committed_asynchronously_are_final_once_their_wal_is_flushed(name) -> None:
    # The WAL writer flushes every 10 s: asynchronous commits stay unflushed while the test looks.
    with postgres_servers("-c synchronous_commit=off -c wal_writer_delay=10000") as make:
        server = make()
        url = server.url()
        _execute(url, f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v int)", "CHECKPOINT")
        source = SourceDatabaseResource(url=url.render_as_string(hide_password=False))
        try:
            shape = source.table_shape("public", name, "id")
            _execute(url, f"INSERT INTO {name} (v) VALUES (1), (2), (3)")  # committed, visible, not on disk
            seen = source.observe(shape)
            assert seen is not None and seen.watermark == 3
            assert not source.is_final(seen, 0), "rows whose commit is not on disk were called final"
            # Why: a crash now loses them, and the sequence gives ids 1-3 out again to other rows.
            source.dispose()
            server.crash()
            server.start()
            assert _count(url, name) == 0
            _execute(url, f"INSERT INTO {name} (v) VALUES (4), (5), (6)")
            seen = source.observe(shape)
            assert seen is not None and seen.watermark == 3 and not source.is_final(seen, 0)
            # A synchronous commit flushes the WAL up to it, the three rows' commits included.
            _execute(url, "SET synchronous_commit = on", "CREATE TABLE flushed (x int)")
            assert source.is_final(seen, 0)
            # A value settled before (kept for a later tick, a re-cut's end) is not asked again: its target would be
            # the WAL position now, past an open transaction's WAL, which the WAL writer leaves unflushed in a
            # partly filled page until a later commit (a re-cut after a timed-out slice waited on it in CI).
            writer = create_engine(url)
            try:
                with writer.connect() as open_tx:
                    open_tx.execute(text(f"INSERT INTO {name} (v) VALUES (7)"))
                    assert source.is_final(WatermarkCandidate.settled(3), 0)
                    assert not source.is_final(replace(seen, marker=float("-1e300")), 0), \
                        "the WAL writer flushed the open transaction's WAL: the case above is not shown"
            finally:
                writer.dispose()
        finally:
            source.dispose()


def test_mariadb_rows_are_final_once_the_redo_log_is_flushed_past_them(name) -> None:
    """innodb_flush_log_at_trx_commit=0: the log is written and flushed about once a second, so a crash loses the
    last second's commits (seen by hand: three committed rows gone after a kill -9, their ids given out again). When
    that flush comes is not up to a test: the position the check waits for is set here instead."""
    with mariadb_servers() as make:
        server = make("--innodb-flush-log-at-trx-commit=0")
        admin = server.url("mysql", USER, "pw")
        _execute(admin, f"CREATE DATABASE {name}",
                 f"CREATE TABLE {name}.t (id bigint AUTO_INCREMENT PRIMARY KEY, v int)",
                 f"INSERT INTO {name}.t (v) VALUES (1), (2), (3)",
                 f"CREATE USER '{name}'@'127.0.0.1' IDENTIFIED BY 'pw'",
                 f"GRANT SELECT, PROCESS ON *.* TO '{name}'@'127.0.0.1'")
        # The privileges rowrelay documents (SELECT, PROCESS): the log positions are readable with them.
        source = SourceDatabaseResource(url=server.url(name, name, "pw").render_as_string(hide_password=False))
        engine = create_engine(admin)
        try:
            def log_position(status: str) -> int:
                with engine.connect() as conn:
                    return int(conn.execute(text(f"SHOW GLOBAL STATUS LIKE '{status}'")).one()[1])

            shape = source.table_shape(name, "t", "id")
            before = log_position("Innodb_lsn_current")
            seen = source.observe(shape)
            assert seen is not None and seen.watermark == 3 and not seen.waits
            # The candidate carries the log position seen with the max, at or after every commit below it.
            assert seen.durable_at is not None and before <= seen.durable_at <= log_position("Innodb_lsn_current")
            assert source.is_final(seen, 0)
            assert log_position("Innodb_lsn_flushed") >= seen.durable_at
            # A position the log has not been flushed to (nor will be within the check's wait) is not final.
            ahead = replace(seen, durable_at=log_position("Innodb_lsn_current") + 10**9)
            assert not source.is_final(ahead, 0), "rows whose commit is not on disk were called final"
        finally:
            source.dispose()
            engine.dispose()
