"""resources/source_database/postgresql.py: WAL positions."""

from __future__ import annotations


def test_wal_flushed_to_counts_a_page_header_not_yet_written() -> None:
    from resources.source_database import pg_lsn, wal_flushed_to

    assert pg_lsn("16/B374D848") == (0x16 << 32) | 0xB374D848
    assert wal_flushed_to(pg_lsn("0/3000100"), pg_lsn("0/3000100"))
    assert not wal_flushed_to(pg_lsn("0/30000F8"), pg_lsn("0/3000100"))
    # An insert position right after a page's header (short, or long at a segment's start): the last record ended
    # the page before, and a flush that reached the boundary is complete (an idle server never writes the header).
    assert wal_flushed_to(pg_lsn("0/3002000"), pg_lsn("0/3002018"))
    assert wal_flushed_to(pg_lsn("0/4000000"), pg_lsn("0/4000028"))
    assert not wal_flushed_to(pg_lsn("0/3001FF8"), pg_lsn("0/3002018"))
    assert not wal_flushed_to(pg_lsn("0/3002000"), pg_lsn("0/3002020"))
