"""How far a table's committed progress is behind its source: for the lag check, its sensor and `rowrelay status`."""

from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from functools import partial
from typing import Any

import sqlalchemy as sa

from assets.shape import table_shape
from resources.cache import KeptAnswers
from resources.config import TableConfig
from resources.exactly_once import (
    KafkaReads,
    ProgressMissing,
    ProgressRecord,
    Purpose,
    TableChannel,
    preflight,
    progress_missing,
)
from resources.slices import SliceRange, watermark_text
from resources.source_database import SourceDatabaseResource, SourceError, TableShape

# Kafka reads of a check are bounded: a check must never hold up (or hang) the run it is part of.
CHECK_KAFKA_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class TableLag:
    """How far a table's committed progress is behind its source, for `rowrelay status` and the lag check."""

    table: str
    committed_hi: int | None  # None: nothing committed yet
    source_max: int | None  # None: the source table is empty
    lag_rows: int  # source rows above committed progress
    lag_seconds: float | None  # None: nothing to measure it from (rows wait, nothing committed, no timestamp)
    lag_basis: str  # oldest_unpublished_row | since_last_commit | since_first_run | caught_up | unknown |
    # awaiting_baseline
    last_commit_at: str | None
    watermark_kind: str = "integer"  # integer | timestamp | timestamptz: the watermarks are then UTC microseconds
    # The newest row's watermark whatever `where:` says, where committed progress ends at a published slice (a
    # baseline or reset may rightly sit above every row); else None: nothing to compare.
    newest_row: int | None = None
    newest_checked: bool = False
    # Source rows the table's skip_watermarks entries name: left out on purpose, never sent and never lag.
    skipped_rows: int = 0

    def as_dict(self) -> dict[str, Any]:
        """`rowrelay status --json`'s fields (the newest-row check speaks through `source_behind`)."""
        out = asdict(self)
        del out["newest_row"], out["newest_checked"]
        return out

    @property
    def source_behind(self) -> str | None:
        """Why the source's newest row is below committed progress, if it is: in an append-only table that means
        it was re-created (ids restarted) or emptied, and its new rows up to the progress would count as sent."""
        newest = self.newest_row
        if not self.newest_checked or self.committed_hi is None or (newest is not None and newest >= self.committed_hi):
            return None

        def text(value: int) -> str:
            return watermark_text(value, self.watermark_kind != "integer")

        top = "the source table is empty" if newest is None else \
            f"the source's newest row ({text(newest)}) is below committed progress"
        return (f"{self.table}: {top} ({text(self.committed_hi)}): was the table re-created or its rows deleted? "
                "Its new rows up to the progress would count as sent and never be published: see the runbook, "
                "\"A table dropped and re-created\" (`rowrelay reset`)")


def _oldest_unpublished_age(source: SourceDatabaseResource, table: TableConfig, shape: TableShape, after: int
                            ) -> float | None:
    """Seconds since the oldest row above `after` was written, on the database's clock (None: no such row); from
    `lag_timestamp_column`, else from a timestamp watermark itself."""
    column = table.lag_timestamp_column or shape.watermark
    t = source.reflect(table.schema_name, table.table_name)
    if column not in t.c:
        raise SourceError(f"{table.table_id}: lag_timestamp_column {column!r} does not exist "
                          f"(columns: {list(t.c.keys())}); fix `lag_timestamp_column:` in rowrelay.yaml")
    ts = t.c[column]
    if not isinstance(ts.type, sa.DateTime):
        raise SourceError(f"{table.table_id}: lag_timestamp_column {column!r} has type {ts.type}, not a timestamp; "
                          "fix `lag_timestamp_column:` in rowrelay.yaml")
    # "now" cast to the column's own type: naive columns compare in the session's time zone, aware ones in UTC.
    now = sa.cast(sa.func.current_timestamp(), ts.type)
    wm = t.c[table.watermark]
    # Only rows that will be sent: the table's `where:` and `skip_watermarks` apply, as to the rows counted (a row
    # the filter leaves out stays above progress for good and would make every later lag look hours old).
    q = source.filtered(sa.select(sa.func.min(ts), now).where(wm > shape.watermark_param(after)), shape, wm,
                        table.skip_rows)
    with source.engine.connect() as conn:
        oldest, current = conn.execute(q).one()
    if oldest is None:
        return None
    return max(0.0, (current - oldest).total_seconds())


# Tables found not missing their progress, and when (monotonic): the lag sensor asks every minute, and each answer
# reads the data topic's tail (a shared topic: back until the table's newest message) and lists every topic.
PROGRESS_NOT_MISSING_TTL_S = 600.0
_PROGRESS_NOT_MISSING: KeptAnswers[tuple[str, str, str], bool] = KeptAnswers(ttl_s=PROGRESS_NOT_MISSING_TTL_S)


def progress_missing_cached(kafka_conf: dict[str, Any], channel: TableChannel, timestamps: bool
                            ) -> ProgressMissing | None:
    """`progress_missing`'s refusal; a "not missing" answer is trusted for PROGRESS_NOT_MISSING_TTL_S per process
    (a change of prefix or a deleted progress topic comes with a new code location, or is seen then)."""
    key = (str(kafka_conf.get("bootstrap.servers")), channel.progress_topic, channel.topic)
    if _PROGRESS_NOT_MISSING.get(key):
        return None
    if (missing := progress_missing(kafka_conf, channel, timestamps, timeout=CHECK_KAFKA_TIMEOUT_S)) is not None:
        _PROGRESS_NOT_MISSING.forget(key)
        return missing
    _PROGRESS_NOT_MISSING.keep(key, True)
    return None


def measure_lag(source: SourceDatabaseResource, table: TableConfig, progress: ProgressRecord | None,
                start_after: int = 0, first_run_at: datetime | None = None,
                published: tuple[dict[str, Any], TableChannel] | None = None,
                recorded: SliceRange | None = None) -> TableLag:
    """Rows above the committed progress and how long they have waited: the age of the oldest of them when the
    table has `lag_timestamp_column`, else the time since the last commit (an upper bound only while rows wait);
    with nothing ever committed, the time since the table's first run (`first_run_at`, a lower bound: its rows
    have waited at least that long), else unknown.

    `published` (Kafka's settings and the table's channel): with no committed progress but rows to send (or a
    baseline to record), ask whether the table's rows were published all the same (its progress topic deleted, or
    its transactional_id_prefix changed) and raise that `ProgressMissing`: every run refuses until a human resolves
    it, so "nothing committed yet, rows wait" would hide why nothing moves. Not asked of a table with nothing to
    send (an empty table is never refused, and the lag sensor asks every minute: ~a Kafka consumer per ask).
    `recorded`: the highest slice Dagster recorded as committed (`last_recorded_slice`, asked by callers that have
    the instance where progress is empty): over rows to send it is the run's own refusal (the progress topic lost
    after the data topic's messages expired), raised here too."""
    shape = table_shape(source, table)
    # A lag in another column's sense would be wrong: the committed progress alone is checked before any count.
    if (refused := preflight(Purpose.CHECK, progress, watermark=shape.watermark_id)) is not None:
        raise refused
    hi = progress.hi if progress else start_after
    top = source.max_watermark(shape)
    # `start_after: latest` before its baseline: the rows there now are never sent, so none of them is lag.
    awaiting_baseline = progress is None and table.start_after == "latest"
    rows = (source.count_rows(shape, hi, top, table.skip_rows)
            if top is not None and top > hi and not awaiting_baseline else 0)
    if progress is None and published is not None and (rows or awaiting_baseline):
        # As the run: asked where it has slices to publish, and before a `latest` table's baseline, which is refused
        # over Dagster's record as well (`cut`): the check said "awaiting_baseline" over the gap.
        kafka_conf, channel = published
        reads = replace(KafkaReads.of(kafka_conf, CHECK_KAFKA_TIMEOUT_S),
                        published=partial(progress_missing_cached, kafka_conf))
        if (refused := preflight(Purpose.CHECK, None, channel, timestamps=shape.timestamps, recorded=recorded,
                                 kafka=reads)) is not None:
            raise refused
    last = progress.committed_at if progress and progress.committed_at else None
    seconds: float | None
    if awaiting_baseline:
        seconds, basis = 0.0, "awaiting_baseline"
    elif rows == 0:
        seconds, basis = 0.0, "caught_up"
    elif table.lag_timestamp_column or shape.timestamps:
        seconds, basis = _oldest_unpublished_age(source, table, shape, hi), "oldest_unpublished_row"
    elif last is not None:
        seconds = max(0.0, (datetime.now(UTC) - datetime.fromisoformat(last)).total_seconds())
        basis = "since_last_commit"
    elif first_run_at is not None:
        seconds, basis = max(0.0, (datetime.now(UTC) - first_run_at).total_seconds()), "since_first_run"
    else:
        seconds, basis = None, "unknown"
    # Progress at a published slice, yet the newest row below it: the table was re-created or emptied. Every row
    # counts here (`where:` aside: a row it leaves out still exists), so one more query only where it filters.
    checked = progress is not None and progress.hi > progress.lo and progress.rows > 0
    newest = (top if not shape.where else source.max_watermark(replace(shape, where=None))) if checked else None
    skipped = source.count_skipped(shape, None, top, table.skip_rows) if table.skip_rows and top is not None else 0
    return TableLag(table=table.table_id, committed_hi=progress.hi if progress else None, source_max=top,
                    lag_rows=rows, lag_seconds=None if seconds is None else round(seconds, 1), lag_basis=basis,
                    last_commit_at=last, watermark_kind=shape.watermark_kind, newest_row=newest,
                    newest_checked=checked, skipped_rows=skipped)
