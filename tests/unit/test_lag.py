"""assets/lag.py: a table's lag, and a source below its committed progress."""

from __future__ import annotations


def test_a_source_below_its_committed_progress_is_flagged() -> None:
    """A table re-created (ids restarted) before the runbook's reset: `status` said "caught up" and the lag check
    passed, while its new rows up to the old progress would count as sent and never be published."""
    from dagster import AssetCheckSeverity

    from assets.checks import lag_result
    from assets.lag import TableLag
    from resources.config import TableConfig

    table = TableConfig(source="src", table="public.orders", watermark="id")

    def lag(committed: int | None, top: int | None, checked: bool = True) -> TableLag:
        return TableLag(table=table.table_id, committed_hi=committed, source_max=top, lag_rows=0, lag_seconds=0.0,
                        lag_basis="caught_up", last_commit_at=None, newest_row=top, newest_checked=checked)

    assert lag(231, 231).source_behind is None and lag(None, 5).source_behind is None
    # Progress at a baseline or reset (not a published slice) may rightly sit above every row: not checked.
    assert lag(0, None, checked=False).source_behind is None and lag(500, 231, checked=False).source_behind is None
    assert "newest_row" not in lag(231, 150).as_dict()  # status --json keeps its fields
    assert lag_result(table, lag(231, 300)).passed
    behind = lag(231, 150)
    assert "the source's newest row (150) is below committed progress (231)" in (behind.source_behind or "")
    result = lag_result(table, behind)
    assert not result.passed and result.severity == AssetCheckSeverity.WARN
    assert "re-created" in (result.description or "") and "rowrelay reset" in (result.description or "")
    assert "the source table is empty (231)" in (lag(231, None).source_behind or "")
