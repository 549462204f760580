"""One sensor per table: cut new slices up to the safe high watermark, add them as partitions, request runs."""


import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from confluent_kafka import KafkaException
from dagster import (
    DagsterInstance,
    DagsterRunStatus,
    DefaultSensorStatus,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    sensor,
)
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
    PARTITION_NAME_TAG,
)

from assets.relay import (
    asset_key,
    channel_for,
    last_recorded_slice,
    local_worker_pid,
    partitions_for,
    pool_name,
    source_resource_key,
    table_shape,
)
from orchestration.history import open_keys
from resources.config import TableConfig
from resources.exactly_once import (
    BASELINE_PREFIX,
    KafkaUnavailable,
    ProgressRecord,
    SlicePublisher,
    TableChannel,
    progress_missing,
    progress_recorded_refusal,
    progress_shared,
    read_progress_tail,
    refuse_watermark_change,
    transaction_timeout_ms,
)
from resources.kafka_io_manager import STOPPED_TAG, KafkaIOManager
from resources.keys import RESUME_TAG
from resources.slices import SliceRange, WatermarkCandidate, cut_slices, reconcile, settle, watermark_text
from resources.source_database import (
    InnodbTrxStale,
    SourceDatabaseResource,
    SourceError,
    TableShape,
    null_watermark_error,
)

ACTIVE = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
          DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]


@dataclass
class SensorState:
    """The sensor cursor: max watermarks seen that are not yet known to be final, the uncommitted slices the
    sensor cut (so a tick need not read the table's partitions), and since when rows have waited below
    `min_slice_rows` (trickle batching)."""

    pending: list[WatermarkCandidate] = field(default_factory=list)
    chain: list[SliceRange] | None = None  # None: not known (a first tick, an old cursor): read from storage
    waiting_since: float | None = None
    table: str | None = None  # the table's incarnation the pending candidates were seen in (WatermarkCandidate)
    # Not in the cursor: what holds the lowest pending candidate as of this tick (`not_final_because`), for the
    # tick's skip message; read afresh by the next tick.
    held: str | None = field(default=None, compare=False)

    @property
    def unsettled(self) -> list[WatermarkCandidate]:
        """The pending candidates not known to be final: a settled one is final and only held back (trickle
        batching, the cut's limit of slices), so nothing waits or is warned of for it."""
        return [c for c in self.pending if not c.is_settled]

    def to_cursor(self) -> str:
        data: dict[str, Any] = {"pending": [[c.watermark, c.marker, list(c.waits),
                                             *([c.durable_at] if c.durable_at is not None else [])]
                                            for c in self.pending]}
        if self.chain is not None:
            data["chain"] = [[s.lo, s.hi] for s in self.chain]
            if any(s.timestamps for s in self.chain):
                data["timestamps"] = True
        if self.waiting_since is not None:
            data["waiting_since"] = self.waiting_since
        if self.table is not None:
            data["table"] = self.table
        return json.dumps(data)

    @classmethod
    def from_cursor(cls, cursor: str | None) -> "SensorState":
        if not cursor:
            return cls()
        data = json.loads(cursor)
        timestamps = bool(data.get("timestamps"))
        chain = [SliceRange(int(lo), int(hi), timestamps) for lo, hi in data["chain"]] if "chain" in data else None
        return cls([WatermarkCandidate(int(c[0]), float(c[1]), tuple(c[2]) if len(c) > 2 else (),
                                       int(c[3]) if len(c) > 3 else None)
                    for c in data.get("pending", [])], chain, data.get("waiting_since"), data.get("table"))


def known_chain(chain: list[SliceRange] | None, committed_hi: int) -> list[SliceRange] | None:
    """The cursor's uncommitted slices still above committed progress, if they continue it without a gap; None
    when they disagree with Kafka (unknown, progress inside a slice, a reset) and storage must be read."""
    if chain is None:
        return None
    rest = [s for s in chain if s.hi > committed_hi]
    position = committed_hi
    for s in rest:
        if s.lo != position:
            return None
        position = s.hi
    return rest


_SHAPES: dict[tuple[str, str], tuple[float, TableShape]] = {}
SHAPE_TTL_S = 60.0
FINALITY_WAIT_S = 1.0


def cached_table_shape(source: SourceDatabaseResource, table: TableConfig) -> TableShape:
    """The table's reflected shape, re-read at most once a minute per code-server process: reflection is the
    largest part of an idle tick. Runs always reflect afresh, so a changed table still fails its run clearly."""
    key = (source.url, table.model_dump_json())
    now = time.monotonic()
    hit = _SHAPES.get(key)
    if hit is None or now - hit[0] > SHAPE_TTL_S:
        hit = (now, table_shape(source, table))
        _SHAPES[key] = hit
    return hit[1]


@dataclass
class TickPlan:
    slices: list[SliceRange]
    state: SensorState
    safe_hi: int | None
    cut_after: int


def settled_watermark(source: SourceDatabaseResource, shape: TableShape, table: TableConfig, above: int | None,
                      state: SensorState) -> tuple[int | None, SensorState]:
    """The highest watermark now known to be final (every row at or below it committed), and the candidates still
    pending. A candidate is the max seen at one moment; it becomes final once every transaction that could still
    commit a lower watermark has ended (resources/source_database.py `is_final`)."""
    seen = source.observe(shape)
    # The max of an append-only table never falls: a pending candidate above it (or any, once the table is empty)
    # is from a table since re-created or emptied (`rowrelay reset` after it), and its waits from that table. Kept,
    # it would turn final at once and be cut up to, over the new table's open transactions. So is one seen in
    # another incarnation of the table (PostgreSQL: re-created or truncated; MariaDB/MySQL: re-created, by
    # CREATE_TIME), even below the new max: the new table's ids restarted, and a lower one may still be uncommitted
    # (found by review). Dropping one needlessly (MariaDB: an ALTER that rebuilt the same table) loses nothing: the
    # cut then waits for `seen`, final once the transactions open now have ended, a delay only.
    incarnation = seen.table if seen is not None else None
    candidates = [c for c in state.pending
                  if seen is not None and c.watermark <= seen.watermark and state.table == incarnation]
    if seen is not None and (above is None or seen.watermark > above) and all(
            seen.watermark > c.watermark for c in candidates):
        candidates.append(seen)

    held: dict[WatermarkCandidate, str] = {}  # why each candidate is not final (the latest check's answer)

    def final(c: WatermarkCandidate) -> bool:
        because = source.not_final_because(c, table.settle_seconds)
        if because is not None:
            held[c] = because
        return because is None

    safe_hi, pending = settle(candidates, final)
    if source.dialect == "postgresql":
        # The writers' open transactions usually end within milliseconds: wait for them briefly in this tick
        # rather than a whole sensor interval (the daemon ticks a sensor at most every 5 s).
        deadline = time.monotonic() + FINALITY_WAIT_S
        while pending and time.monotonic() < deadline:
            time.sleep(0.05)
            safe_hi, pending = settle(candidates, final)
    if above is not None:
        pending = [c for c in pending if c.watermark > above]
    # The lowest pending candidate is the one the next cut waits for: its reason is the one to show.
    lowest = min(pending, key=lambda c: c.watermark, default=None)
    return safe_hi, SensorState(pending, table=incarnation, held=held.get(lowest) if lowest is not None else None)


_NULLS_OK: dict[tuple[str, str], float] = {}


def check_null_watermarks(source: SourceDatabaseResource, shape: TableShape, table: TableConfig, cut_after: int
                          ) -> None:
    """Refuse a table with NULL watermarks. A clean result is trusted for SHAPE_TTL_S per process (like the
    shape): one query less per idle tick, which counts with many tables per sensor; runs check afresh."""
    key = (source.url, table.table_id)
    if time.monotonic() - _NULLS_OK.get(key, -SHAPE_TTL_S) < SHAPE_TTL_S:
        return
    if source.has_null_watermarks(shape):
        _NULLS_OK.pop(key, None)
        raise null_watermark_error(table.table_id, table.watermark, shape.watermark_text(cut_after))
    _NULLS_OK[key] = time.monotonic()


def plan_tick(source: SourceDatabaseResource, table: TableConfig, cut_after: int, state: SensorState,
              limit: int = 500, max_rows: int | None = None, batch: bool = True) -> TickPlan:
    """Observe the table, settle pending candidates, cut slices above `cut_after` up to the safe watermark.
    `batch`: trickle batching (`min_slice_rows`) applies; False cuts every final row now (`rowrelay backfill`)."""
    shape = cached_table_shape(source, table)
    check_null_watermarks(source, shape, table, cut_after)
    waiting_since = state.waiting_since  # settled_watermark returns a fresh state: keep the trickle clock
    safe_hi, state = settled_watermark(source, shape, table, cut_after, state)
    pending = list(state.pending)
    slices: list[SliceRange] = []
    if safe_hi is not None and safe_hi > cut_after:
        slices = cut_slices(
            cut_after, safe_hi, max_rows or table.slice_max_rows,
            # Up to the safe watermark: settled rows, so an early read's cut answers the backfill's cut.
            nth_watermark=lambda lo, n, upto: source.nth_watermark(shape, lo, n, upto, settled=True),
            max_watermark=lambda lo, upto: source.max_watermark(shape, upto=upto, after=lo),
            limit=limit, timestamps=shape.timestamps,
        )
        if slices and slices[-1].hi < safe_hi and len(slices) == limit:
            # More to cut next tick: keep the settled value as an already-final candidate.
            pending.insert(0, WatermarkCandidate.settled(safe_hi))
    if not batch or table.min_slice_rows <= 1 or (not slices and not pending):
        waiting_since = None  # no trickle batching, or no rows wait: the clock starts with the next rows
    elif slices:
        waiting_since, slices = trickle(slices, table, waiting_since, time.time(),
                                        lambda: source.count_rows(shape, cut_after, slices[-1].hi))
        if not slices and safe_hi is not None:  # keep the settled value: it is final, only held back
            pending.insert(0, WatermarkCandidate.settled(safe_hi))
    return TickPlan(slices=slices, state=SensorState(pending, waiting_since=waiting_since, table=state.table,
                                                     held=state.held),
                    safe_hi=safe_hi,
                    cut_after=cut_after)


def trickle(slices: list[SliceRange], table: TableConfig, waiting_since: float | None, now: float,
            count_rows: Callable[[], int]) -> tuple[float | None, list[SliceRange]]:
    """Trickle batching: hold back a cut of fewer than `min_slice_rows` rows until the rows have waited
    `max_slice_delay_seconds`, so a trickle makes one partition per delay instead of one per tick. Returns (since
    when rows wait, the slices to cut now)."""
    since = waiting_since if waiting_since is not None else now
    if now - since >= table.max_slice_delay_seconds or count_rows() >= table.min_slice_rows:
        return None, slices
    return since, []


def trickle_text(plan: "CutPlan", table: TableConfig, now: float) -> str | None:
    """Why final rows are not cut yet when trickle batching holds them, or None. The tick showed Dagster's "Sensor
    function returned an empty result" for up to `max_slice_delay_seconds` (found by review)."""
    since = plan.state.waiting_since
    if since is None or plan.state.unsettled:  # rows not final yet: not trickle batching's doing
        return None
    above = plan.chain[-1].hi if plan.chain else plan.committed_hi
    left = max(0.0, table.max_slice_delay_seconds - (now - since))
    return (f"final rows above {plan.text(above)} are held by trickle batching: they are cut once "
            f"min_slice_rows ({table.min_slice_rows}) wait, or max_slice_delay_seconds "
            f"({table.max_slice_delay_seconds:g} s) after the first was seen (in {left:.0f} s)")


@dataclass
class CutPlan:
    """What one cut does to a table's partitions: orphans to delete, new slices to add (in order), and the
    uncommitted slices that continue Kafka's progress (the existing chain followed by the new slices)."""

    committed_hi: int
    delete: list[SliceRange]
    add: list[SliceRange]
    chain: list[SliceRange]
    state: SensorState
    waiting: str | None = None  # why nothing could be cut yet (e.g. a baseline waits for open transactions)
    timestamps: bool = False  # a timestamp watermark: messages name its values as UTC times

    def text(self, value: int) -> str:
        return watermark_text(value, self.timestamps)

    def held_text(self) -> str | None:
        """Why rows above the cut wait for open transactions (as `rowrelay backfill` words it), naming what holds
        them, or None when none are held back as not final. The tick said only "Sensor function returned an empty
        result" while a prepared XA transaction held a table for good (found by review)."""
        if self.state.held is None or not self.state.pending:
            return None
        # Rows up to a settled candidate are final (held by trickle batching or the cut's limit), not waiting.
        final_to = max([self.chain[-1].hi if self.chain else self.committed_hi]
                       + [c.watermark for c in self.state.pending if c.is_settled])
        newest = max(c.watermark for c in self.state.pending)
        what = self.waiting or (f"rows above {self.text(final_to)} (up to {self.text(newest)}) are not final yet, "
                                "so they are not cut")
        return f"{what}: {self.state.held}. See docs/operations.md, \"New rows are not cut\""


def slice_rows_limit(slice_max_rows: int, recent: list[ProgressRecord], transaction_timeout_ms: int) -> int:
    """Rows a slice may hold so that its transaction ends well within `transaction.timeout.ms`: a transaction that
    outlives it is aborted by the broker and can never commit. Judged from the table's recent slices (their rows
    per second inside the transaction), with a 2x margin, never below 1000 rows; no history, no limit beyond
    `slice_max_rows`, which always bounds it (a `slice_max_rows` under 1000 was raised to 1000 once the table had
    slices of 1000 rows or more)."""
    timed = [r for r in recent if r.rows >= 1000 and r.transaction_s > 0]
    if not timed:
        return slice_max_rows
    rate = min(r.rows / r.transaction_s for r in timed[-5:])  # the slowest recent slice
    # Infinite for a record stating a time too small to divide by (any JSON a record may hold): no limit then.
    budget = rate * transaction_timeout_ms / 1000 / 2
    if budget >= slice_max_rows:
        return slice_max_rows
    return min(slice_max_rows, max(1000, int(budget)))


def latest_baseline(source: SourceDatabaseResource, shape: TableShape, table: TableConfig, channel: TableChannel,
                    kafka_conf: dict[str, Any], state: SensorState, recorded: SliceRange | None = None
                    ) -> tuple[ProgressRecord | None, SensorState]:
    """`start_after: latest` on a table with no progress: record a baseline in Kafka at the table's *safe*
    watermark (every row at or below it committed), so a row committed after the baseline is never skipped.
    Returns the table's progress after it: the baseline, or what another cutter committed meanwhile. None while
    transactions that may hold lower watermarks are still open (the candidate stays pending). `recorded`: the
    highest slice Dagster recorded as committed; the publisher refuses a baseline over it (`plan_cut` does first)."""
    safe_hi, state = settled_watermark(source, shape, table, None, state)
    if safe_hi is None and state.pending:
        return None, state
    hi = safe_hi if safe_hi is not None else 0  # an empty table: every row to come is new
    publisher = SlicePublisher(channel, kafka_conf, recorded=recorded)
    try:
        # Recorded in Kafka like any progress, so a lost orchestrator database cannot re-send old rows.
        return publisher.publish_baseline(hi, shape.watermark_id), SensorState()
    finally:
        publisher.close()


def refuse_start_after_kind(shape: TableShape, table: TableConfig) -> None:
    """A time as `start_after` of an integer watermark became microseconds since 1970 (2026 is ~1.8e15): every id
    below it was skipped without a word and the table looked caught up (found by a review of the README against
    the code). The CLI's `--after` refused it already; the config now does too, before the first cut."""
    if isinstance(table.start_after, datetime) and not shape.timestamps:
        raise SourceError(
            f"{table.table_id}: start_after {table.start_after.isoformat()} is a time, but watermark column "
            f"{table.watermark!r} is an integer: as a time's microseconds it would skip every row below "
            f"{table.start_after_watermark}. Set `start_after` to an id (rows <= it are never sent), or to 0 or unset "
            "to send the whole table; nothing was cut or sent")


def check_start_after(source: SourceDatabaseResource, shape: TableShape, table: TableConfig, start: int) -> None:
    """With `start_after` unset, rows at or below 0 would be skipped silently: refuse, saying what to set."""
    if table.start_after is not None:
        return  # set explicitly: rows at or below it are skipped on purpose
    try:
        below = source.max_watermark(shape, upto=start)
    except sa.exc.DataError as exc:  # PostgreSQL '-infinity' (or a time before the year 1): no datetime holds it
        raise SourceError(
            f"{table.table_id}: rows with watermark times before the year 1 ('-infinity' included) exist; with "
            f"`start_after` unset rowrelay starts after {shape.watermark_text(start)} and would skip them, and such "
            f"times cannot be carried (microseconds since 1970 within the years 1-9999). Set `start_after: "
            f"{shape.watermark_text(start)}` (or an earlier time) to skip them deliberately") from exc
    if below is not None:
        lowest = source.nth_watermark(shape, -(2**63), 1, start)
        text = shape.watermark_text
        raise SourceError(
            f"{table.table_id}: rows with watermark <= {text(start)} exist (the lowest is "
            f"{text(lowest if lowest is not None else start)}); with `start_after` unset rowrelay starts after "
            f"{text(start)} and would skip them. Set `start_after: {text((lowest or start) - 1)}` to send them, or "
            f"`start_after: {text(start)}` to skip them deliberately")


def plan_cut(table: TableConfig, source: SourceDatabaseResource, io_manager: KafkaIOManager,
             progress: ProgressRecord | None, keys: list[str], state: SensorState, *, heal: bool,
             cut_while_pending: bool, limit: int = 500, resplit: bool = False, write: bool = True,
             refuse: bool = False, recorded: SliceRange | None = None, batch: bool = True) -> CutPlan:
    """The one way slices are cut, for the sensor and `rowrelay backfill` alike.

    Kafka's progress decides where the table stands, not the partitions: partitions off the chain that continues
    it (`orphans`) are deleted when `heal` (no run of the table active) and the range is cut again, so a table
    whose partitions disagree with Kafka (a racing cut, a changed `start_after`, a new baseline) heals itself
    instead of failing "out of order" forever. New slices start where the chain ends, up to the safe watermark.
    `resplit`: the first uncommitted slice outlived the transaction timeout, so it can never commit as cut: the
    uncommitted slices are deleted and cut again from Kafka's progress at a quarter of its rows.
    `progress`: the table's committed progress, just read from Kafka.
    `write`: False for a dry run: a `start_after: latest` table's baseline is not recorded in Kafka (the plan says
    where it would be). Partitions are never touched here: the caller applies `delete` and `add`.
    `refuse`: refuse as the publisher would, before anything is cut (always so for a dry run): `rowrelay backfill`,
    so that it adds no partition its run would refuse to publish. `recorded`: the highest slice Dagster recorded
    as committed, asked by a caller with the instance where progress is empty (the run's own `recorded` check; a
    `start_after: latest` table's baseline is refused over it too).
    `batch`: hold back a cut of fewer than `min_slice_rows` rows (trickle batching, `plan_tick`): the sensor's cost
    control; False for `rowrelay backfill`, an explicit "publish now" of every final row.
    """
    channel = channel_for(table, io_manager.transactional_id_prefix)
    conf = io_manager.kafka_conf()
    recent = [progress] if progress is not None else []
    shape = cached_table_shape(source, table)
    slices = [SliceRange.from_key(k) for k in keys]
    refuse = refuse or not write  # a dry run refuses as the backfill's baseline or first publish would
    if refuse and progress is None and (missing := progress_missing(conf, channel, shape.timestamps)) is not None:
        raise missing
    # Slices Dagster recorded as committed over empty progress (its topic lost after the data topic's messages
    # expired): the run refuses them (`recorded`), and so does a `latest` table's baseline, before any partition is
    # touched. A baseline recorded over them (at the newest row) skipped every row written since the last commit,
    # silently (found by review); and with a fresh sensor cursor, the committed slices' partitions (from the old
    # baseline up) did not continue a chain from 0 and were deleted as orphans.
    if progress is None and (missing := progress_recorded_refusal(channel, recorded)) is not None:
        raise missing
    # Slices over empty progress were cut under another `start_after` (a baseline is progress): orphans, once the
    # baseline is recorded. Left as a chain from 0, they sent the history `latest` skips (found by review).
    if progress is None and table.start_after == "latest":
        if not write:
            # The new state keeps a pending candidate, so the dry run waits for open transactions as the backfill's
            # baseline would (a CI run caught it answering "not final yet" at once while another test's was open).
            safe_hi, state = settled_watermark(source, shape, table, None, state)
            if safe_hi is not None:
                at = f"the safe watermark ({shape.watermark_text(safe_hi)})"
            elif state.pending:
                at = "the safe watermark (not final yet: a transaction that may write below it is still open)"
            else:  # as latest_baseline records it: an empty table's every row to come is new
                at = f"{shape.watermark_text(0)} (the table is empty: every row it gets will be sent)"
            return CutPlan(channel.start_after, slices if heal else [], [], [], state, timestamps=shape.timestamps,
                           waiting=("start_after: latest: its baseline is not recorded yet; a backfill or the sensor "
                                    f"would record it at {at}"))
        progress, state = latest_baseline(source, shape, table, channel, conf, state, recorded)
        if progress is None:  # the slices go now: no publisher takes them, and the next tick may not see them
            return CutPlan(channel.start_after, slices if heal else [], [], [], state, timestamps=shape.timestamps,
                           waiting="start_after: latest waits for open transactions before recording its baseline")
        # Below the baseline they would pass for committed slices (never published): deleted all the same. Only
        # below a baseline: progress another cutter committed meanwhile (this read stale) keeps its slices.
        below = progress.slice.startswith(BASELINE_PREFIX)
        pre_baseline = [s for s in slices if below and s.lo < progress.hi]
        slices = [s for s in slices if s not in pre_baseline]
    else:
        pre_baseline = []
    refuse_watermark_change(progress, shape.watermark_id)  # before any cut: "nothing new" would skip rows too
    # `topic:` moved back to a topic it had left: the publisher refuses (two deployments sharing the progress).
    if refuse and progress is not None and (shared := progress_shared(conf, channel, progress)) is not None:
        raise shared
    if progress is None:
        refuse_start_after_kind(shape, table)
    committed_hi = progress.hi if progress else channel.start_after
    if progress is None:  # also over slices cut under another `start_after` (`-1` then unset skipped row 0)
        check_start_after(source, shape, table, committed_hi)
    ledger = reconcile(slices, committed_hi)
    # Slices below a baseline go even beside active runs: no run can publish them (found by review: a backfill
    # beside a running run left them for good, and a later run of one materialized "already committed").
    delete = pre_baseline + (ledger.orphans if heal else [])
    max_rows = slice_rows_limit(table.slice_max_rows, recent, transaction_timeout_ms(conf))
    chain, frontier = ledger.chain, ledger.frontier
    if resplit and chain:
        too_long = chain[0]
        # Settled answers (a cut slice's rows never change): asked once per process, not every tick.
        rows = source.count_rows(shape, too_long.lo, too_long.hi, settled=True)
        if source.nth_watermark(shape, too_long.lo, 1, too_long.hi, settled=True) == too_long.hi:
            # Its rows share one watermark value, which a slice never splits: cut again it would be the same slice,
            # timing out again for as long as the timeout allows, forever. Kept as it is, for a human.
            return CutPlan(committed_hi, delete, [], chain, state, timestamps=shape.timestamps, waiting=(
                f"slice {too_long.key} outlived transaction.timeout.ms and cannot be cut smaller: its {rows} rows "
                f"share one {table.watermark} value. Raise kafka.producer transaction.timeout.ms (up to the "
                "broker's transaction.max.timeout.ms), then run it again (`rowrelay backfill --table "
                f"{table.table_id}` or Materialize in the UI)"))
        max_rows = min(max_rows, max(1, rows // 4))
        # The slices' end was final when they were cut: cut again up to it at once (already-final candidate),
        # not after the open transactions of this moment, or a busy source would re-cut them at full size.
        state = SensorState([WatermarkCandidate.settled(chain[-1].hi), *state.pending], state.chain,
                            state.waiting_since, state.table)
        delete, chain, frontier = delete + chain, [], committed_hi
    if chain and not cut_while_pending:
        return CutPlan(committed_hi, delete, [], chain, state, timestamps=shape.timestamps)
    tick = plan_tick(source, table, frontier, state, limit=limit, max_rows=max_rows, batch=batch)
    return CutPlan(committed_hi, delete, tick.slices, chain + tick.slices, tick.state, timestamps=shape.timestamps)


def run_slices(tags: dict[str, str]) -> tuple[SliceRange, SliceRange] | None:
    """The first and last slice a run targets, from its partition tags (one partition or a range)."""
    if PARTITION_NAME_TAG in tags:
        only = SliceRange.from_key(tags[PARTITION_NAME_TAG])
        return only, only
    if ASSET_PARTITION_RANGE_START_TAG in tags and ASSET_PARTITION_RANGE_END_TAG in tags:
        return (SliceRange.from_key(tags[ASSET_PARTITION_RANGE_START_TAG]),
                SliceRange.from_key(tags[ASSET_PARTITION_RANGE_END_TAG]))
    return None


def slices_request(slices: list[SliceRange], run_key: str | None, tags: dict[str, str] | None = None,
                   job_label: str | None = None) -> RunRequest:
    """One run for consecutive slices: a single partition, or a partition range (one worker for all).
    `job_label`: the job, for a sensor of several tables (its run keys then carry the job too)."""
    tags = {**slice_tags(slices[0]), **(tags or {})}
    if job_label is not None and run_key is not None:
        run_key = f"{job_label}:{run_key}"
    if len(slices) == 1:
        return RunRequest(partition_key=slices[0].key, run_key=run_key, tags=tags, job_name=job_label)
    return RunRequest(run_key=run_key, job_name=job_label, tags={**tags, ASSET_PARTITION_RANGE_START_TAG: slices[0].key,
                                                                 ASSET_PARTITION_RANGE_END_TAG: slices[-1].key})


def batched_requests(slices: list[SliceRange], max_per_run: int, job_label: str | None = None) -> list[RunRequest]:
    groups = [slices[i:i + max_per_run] for i in range(0, len(slices), max_per_run)]
    return [slices_request(g, run_key=g[0].key if len(g) == 1 else f"{g[0].key}...{g[-1].key}", job_label=job_label)
            for g in groups]


def stalled_slice(records: list[Any], chain: list[SliceRange], committed_hi: int, max_per_run: int = 1,
                  job_label: str | None = None) -> RunRequest | None:
    """Self-healing: re-request the first uncommitted slice (and the ones after it, up to `max_per_run`) if no
    run covering it is active (retries exhausted, worker lost, daemon restarted). `chain`: the uncommitted
    slices that continue Kafka's progress, in order (resources/slices.py `reconcile`); `records`: the recent runs
    of its first slice (`runs_of_slice`)."""
    if not chain or chain[0].lo != committed_hi:
        return None
    group = chain[:max_per_run]
    if any(r.dagster_run.status in ACTIVE for r in records):
        return None
    ended = max((r.end_time or 0.0 for r in records), default=0.0)
    # A slice stopped by bad input (a row too large, a source error, fenced) is retried with a growing backoff,
    # capped at a minute so the table recovers soon after the cause is fixed; one that failed transiently
    # (worker killed, broker away, retries exhausted) is resumed soon.
    stopped = sum(1 for r in records if r.dagster_run.tags.get(STOPPED_TAG))  # empty: a cleared copy
    # 15 s: time for the run-retry daemon to queue its own retry, which would make a resume a wasted run.
    wait = min(60.0, 5.0 * 2 ** min(stopped - 1, 4)) if stopped else 15.0
    if records and time.time() - ended < wait:
        return None
    return slices_request(group, run_key=f"{group[0].key}#resume-{len(records)}", tags={RESUME_TAG: "true"},
                          job_label=job_label)


TIMED_OUT = "transaction_timeout"  # the STOPPED_TAG value of a run whose transaction outlived its timeout

# What to do after a run stopped, by its stop reason (resources/kafka_io_manager.py STOP_REASONS and the asset's
# own: source, schema_change, skip_of_many_rows, bad_row), for the sensor's skip message and a failed
# `rowrelay backfill`.
NEXT_STEP = {
    "schema_change": "the table's columns changed and `on_schema_change: fail` stops it: check the change, then "
                     "`rowrelay schema accept --table ID --reason ...` and run it again",
    "baseline_missing": "the slice was cut before `start_after: latest`: the next tick (or `rowrelay backfill`) "
                        "records the baseline and deletes such slices; nothing to do",
    "fenced": "another publisher of the table took over (the daemon's run or a backfill): it publishes the "
              "slices; nothing is lost",
    "bad_row": "fix the row (or list its watermark in `skip_watermarks`) and run it again",
    "skip_of_many_rows": "a bare `skip_watermarks` value matches several rows: name the one row as the run's message "
                         "shows and run it again",
    "source": "fix what the run's message names and run it again",
    "rows_mismatch": "the source's rows changed under the read: see the run's message, fix the cause, and run it again",
    "progress_missing": "see docs/operations.md (\"A table dropped and re-created\": progress missing) before anything "
                        "runs again",
    "producer_settings": "fix `kafka.producer` as the run's message says and run it again",
    "topic_settings": "fix the topic's settings (or the table's `key:`) as the run's message says and run it again",
    "progress_shared": "two deployments share the table's progress: give each its own `kafka.transactional_id_prefix` "
                       "(or `rowrelay reset` if `topic:` was moved back on purpose; see the run's message)",
    "watermark_changed": "the table's watermark column or its type changed since its progress was recorded: put it "
                         "back, or set where the new one stands with `rowrelay reset` (see the run's message)",
    TIMED_OUT: "the table's sensor (with the daemon) cuts the slice smaller and runs it again; without it, lower "
               "`slice_max_rows` or raise `transaction.timeout.ms`",
}


def runs_of_slice(context: SensorEvaluationContext, job_name: str, first: SliceRange) -> list[Any]:
    """Recent run records (newest first) whose slices include `first`."""
    return [r for r in context.instance.get_run_records(RunsFilter(job_name=job_name), limit=200)
            if (span := run_slices(dict(r.dagster_run.tags))) is not None and span[0].lo <= first.lo <= span[1].lo]


def last_stop_reason(records: list[Any]) -> str | None:
    """Why the latest of a slice's runs (`runs_of_slice`) was stopped (STOPPED_TAG), if it was."""
    return (records[0].dagster_run.tags.get(STOPPED_TAG) or None) if records else None


def cancel_committed_runs(context: SensorEvaluationContext, job_name: str, committed_hi: int) -> list[str]:
    """Cancel queued sensor runs (and their retries) whose slices Kafka already has: they would publish nothing
    but still cost a worker start each, serialized by the table's pool. Backfills and UI launches are left
    alone: someone asked for them."""
    canceled = []
    for run in context.instance.get_runs(RunsFilter(job_name=job_name, statuses=[DagsterRunStatus.QUEUED])):
        span = run_slices(dict(run.tags))
        if span is None or "dagster/sensor_name" not in run.tags or "dagster/backfill" in run.tags:
            continue
        if span[1].hi <= committed_hi:
            upto = watermark_text(committed_hi, span[1].timestamps)
            context.instance.report_run_canceled(run, f"slices up to {upto} are already committed in Kafka; "
                                                      "canceled by the table's sensor (nothing to publish)")
            canceled.append(run.run_id)
    return canceled


def fail_dead_runs(context: SensorEvaluationContext, job_name: str, active: list[Any] | None = None) -> list[str]:
    """Mark STARTED runs whose worker process is gone as failed, so run retries and the sensor move on.

    Only for a run launcher with no worker health check (Dagster's DefaultRunLauncher): there a worker killed by
    SIGKILL or the OOM killer would leave its run STARTED forever and hold the table's pool. rowrelay's
    WarmRunLauncher (and Dagster's container launchers) report worker health, and Dagster's run monitoring
    fails such runs itself. Only workers on this host are judged.
    """
    if context.instance.run_launcher.supports_check_run_worker_health:
        return []
    failed: list[str] = []
    host = socket.gethostname()
    started = ([r for r in active if r.status == DagsterRunStatus.STARTED] if active is not None else
               context.instance.get_runs(RunsFilter(job_name=job_name, statuses=[DagsterRunStatus.STARTED])))
    for run in started:
        pid = local_worker_pid(run)  # a retry's pid copied from its parent, or another namespace's: not judged
        if pid is None or pid_alive(pid):
            continue
        context.instance.report_run_failed(run, f"run worker pid {pid} is gone (killed?); marked failed by {host}")
        failed.append(run.run_id)
    return failed


UNSTARTED_GRACE_S = 30.0  # a run leaves NOT_STARTED within a second when it is queued or executed in-process


def cancel_unstartable_runs(context: SensorEvaluationContext, partitions_name: str, active: list[Any]) -> list[str]:
    """Cancel runs left NOT_STARTED past UNSTARTED_GRACE_S whose slices no longer exist.

    Dagster's retry of a run whose slices were deleted (by hand in the UI, or cut again by this sensor when they
    no longer continued Kafka's progress) is created but can never be queued ("Nonexistent partition keys"); run
    monitoring failed it only after its start timeout (120 s), the next retry the same way, five times: the table
    counted them as active and waited ~10 minutes (found by review). A canceled run is not retried; the sensor
    requests the slices as they are now under new runs."""
    unstarted = [r.run_id for r in active if r.status == DagsterRunStatus.NOT_STARTED]
    if not unstarted:
        return []
    canceled = []
    for record in context.instance.get_run_records(RunsFilter(run_ids=unstarted)):
        run = record.dagster_run
        span = run_slices(dict(run.tags))
        if span is None or time.time() - record.create_timestamp.timestamp() < UNSTARTED_GRACE_S:
            continue
        gone = [s.key for s in dict.fromkeys(span)
                if not context.instance.has_dynamic_partition(partitions_name, s.key)]
        if gone:
            context.instance.report_run_canceled(
                run, f"slice(s) {gone} of this run no longer exist (deleted by hand, or cut again from Kafka's "
                     "progress): it can never start; canceled by the table's sensor, which requests the table's "
                     "slices as they are now under new runs")
            canceled.append(run.run_id)
    return canceled


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by another user
    return True


def slice_tags(slice_range: SliceRange) -> dict[str, str]:
    """Lower slices first in the run queue; a retried run keeps its tags, so it keeps its place."""
    return {"dagster/priority": str(-slice_range.lo)}


_POOLS_SEEN: dict[tuple[str, str], float] = {}
POOL_CHECK_S = 600.0


def ensure_pool(instance: DagsterInstance, pool: str, *, cached: bool = False) -> None:
    """Give the table's pool its limit of 1 before any run of it is queued.

    Dagster creates a pool's default limit lazily, in the same pass that first sees its queued runs, and
    that pass does not enforce it: two runs of one table could start together.
    `cached`: checked at most every POOL_CHECK_S per process and storage (the check is ~35 ms, a third of an idle
    tick); the pool is made before the table's first cut, and a limit once set stays.
    """
    storage = instance.event_log_storage
    key = (repr(instance.get_ref().event_storage_data), pool)
    if cached and time.monotonic() - _POOLS_SEEN.get(key, -POOL_CHECK_S) < POOL_CHECK_S:
        return
    if pool not in storage.get_concurrency_keys():
        storage.set_concurrency_slots(pool, 1)
    _POOLS_SEEN[key] = time.monotonic()


_SOURCES: dict[str, SourceDatabaseResource] = {}


def shared_source(source: SourceDatabaseResource) -> SourceDatabaseResource:
    """One source resource (and so one connection pool) per URL and process: Dagster builds resources anew for
    every tick, and a new engine costs a database connection (~10 ms) each time."""
    return _SOURCES.setdefault(source.url, source)


# The sensor daemon evaluates sensors in a loop every 5 s (MIN_INTERVAL_LOOP_TIME in dagster/_daemon/sensor.py)
# and skips a sensor while the time since its last tick's *start* is under its minimum interval. A tick starts a
# moment after its loop began, so an interval equal to the loop's is missed by that moment at the next loop and
# becomes 10 s (seen in `make bench`: ticks 10 s apart with a 5 s interval).
DAEMON_LOOP_S = 5


def daemon_min_interval(interval_s: int) -> int:
    """The minimum interval to declare so ticks come every `interval_s` seconds (at the daemon loop's pace)."""
    return interval_s - 1 if interval_s > 1 and interval_s % DAEMON_LOOP_S == 0 else interval_s


@dataclass
class TableTick:
    """One table's share of a sensor tick."""

    run_requests: list[RunRequest]
    partition_requests: list[Any]
    cursor: str
    skip_reason: str | None = None


def tick_table(context: SensorEvaluationContext, table: TableConfig, job_name: str, cursor: str | None,
               source: SourceDatabaseResource, io_manager: KafkaIOManager, active_runs: list[Any] | None = None,
               group: bool = False) -> TableTick:
    """What one sensor tick does for one table: its own sensor, or one table of a group sensor's loop.
    `active_runs`: the table's queued/running runs if the caller fetched them already (a group sensor: one query
    for all its tables). `group`: run requests name their job and run keys carry it (a sensor's run keys are one
    namespace)."""
    try:
        return _tick_table(context, table, job_name, cursor, source, io_manager, active_runs, group)
    except (sa.exc.ProgrammingError, sa.exc.OperationalError):
        # A statement on the cached shape failed (the table dropped or renamed, a column gone: PostgreSQL says
        # ProgrammingError, SQLite and MariaDB's unknown column OperationalError): reflect afresh, so the tick
        # fails with the table check's own message and remedy, not the driver's, for up to a minute. A source
        # that is down fails the reflection too, with its own error.
        _SHAPES.pop((source.url, table.model_dump_json()), None)
        cached_table_shape(source, table)
        raise


def _tick_table(context: SensorEvaluationContext, table: TableConfig, job_name: str, cursor: str | None,
                source: SourceDatabaseResource, io_manager: KafkaIOManager, active_runs: list[Any] | None,
                group: bool) -> TableTick:
    partitions = partitions_for(table)
    instance = context.instance
    ensure_pool(instance, pool_name(table), cached=True)
    # One query for the table's active runs serves the dead-worker check and the count below (each storage
    # query is a new PostgreSQL connection: ~10 ms of an idle tick).
    if active_runs is None:
        active_runs = instance.get_runs(RunsFilter(job_name=job_name, statuses=ACTIVE))
    if active_runs and (fail_dead_runs(context, job_name, active_runs)
                        or cancel_unstartable_runs(context, partitions.name, active_runs)):
        active_runs = instance.get_runs(RunsFilter(job_name=job_name, statuses=ACTIVE))
    cached_table_shape(source, table)  # a broken table or config fails the tick with its reason, every tick
    channel = channel_for(table, io_manager.transactional_id_prefix)
    # Kafka's progress through the process's long-lived reader: re-read only when the topic's end moved.
    progress = read_progress_tail(io_manager.kafka_conf(), channel)
    committed_hi = progress.hi if progress else channel.start_after
    state = SensorState.from_cursor(cursor)
    # Flat ticks: the uncommitted slices come from the cursor, checked against storage by one key; the
    # partitions are read (their newest end only) when the cursor disagrees with Kafka or the key is gone.
    chain = known_chain(state.chain, committed_hi)
    stored: list[str] | None = None
    if chain is None or (chain and not instance.has_dynamic_partition(partitions.name, chain[0].key)):
        stored = open_keys(instance, partitions.name, committed_hi)
        chain = reconcile([SliceRange.from_key(k) for k in stored], committed_hi).chain
    if progress is None and table.start_after == "latest" and chain:
        # Cut under another `start_after` before the first commit: no chain until the baseline is recorded
        # (`plan_cut` records it and deletes them), never resumed.
        stored = open_keys(instance, partitions.name, committed_hi) if stored is None else stored
        chain = []
    state = SensorState(state.pending, chain, state.waiting_since, state.table)
    job_label = job_name if group else None

    def skip(reason: str) -> TableTick:
        return TableTick([], [], state.to_cursor(), reason)

    active = len(active_runs)
    if active and cancel_committed_runs(context, job_name, committed_hi):
        active = instance.get_runs_count(RunsFilter(job_name=job_name, statuses=ACTIVE))
    # Self-healing: the first uncommitted slice has no run (retries exhausted, worker lost) while later ones
    # may be queued; without this they would fail "out of order" and retry forever.
    slice_runs = runs_of_slice(context, job_name, chain[0]) if chain else []  # one query for the three uses below
    resplit = bool(chain) and not active and last_stop_reason(slice_runs) == TIMED_OUT
    resume = None if resplit else stalled_slice(slice_runs, chain, committed_hi, table.max_slices_per_run,
                                                job_label=job_label)
    if resume is not None:
        return TableTick([resume], [], state.to_cursor())
    if active > 1 or (active and chain):
        # Cut only when the table's runs have drained: slices then grow (up to slice_max_rows) to fill the
        # time a run takes, instead of the queue growing without bound. One run whose slices Kafka already
        # has is only finishing (its checks): the next slice may queue behind it in the table's pool.
        return skip(f"{active} run(s) of {table.table_id} still queued or running")
    if chain and not resplit:
        # Slices cut earlier are not committed yet (a retry about to be queued, a slice stopped by bad
        # input): new slices would only fail "out of order" behind them.
        waiting = (f"{table.table_id}: slices after {watermark_text(committed_hi, chain[0].timestamps)} are not "
                   "committed yet")
        reason = last_stop_reason(slice_runs)
        if reason is None:
            return skip(f"{waiting}; waiting for their runs (or a resume)")
        return skip(f"{waiting}: run {slice_runs[0].dagster_run.run_id} stopped ({reason}); "
                    f"{NEXT_STEP.get(reason, 'see the run')}. Resumed with a backoff (up to a minute)")
    keys = stored if stored is not None else [s.key for s in chain]
    # A `latest` table with empty progress is about to record its baseline: not over slices Dagster recorded as
    # committed (its progress topic lost after the data topic's messages expired), which would skip every row since
    # (`plan_cut` refuses). Asked only then: one storage query, not one per idle tick. Other tables' runs refuse.
    recorded = (last_recorded_slice(instance, asset_key(table))
                if progress is None and table.start_after == "latest" else None)
    try:
        plan = plan_cut(table, source, io_manager, progress, keys, state, heal=True, cut_while_pending=False,
                        resplit=resplit, recorded=recorded)
        if plan.add and stored is None:
            # About to add partitions: another cutter (`rowrelay backfill`) may have cut slices this cursor does
            # not know. Check the newest keys (cheap: only uncommitted ones are read) and plan again if so.
            stored = open_keys(instance, partitions.name, committed_hi)
            if set(stored) - set(keys):
                plan = plan_cut(table, source, io_manager, progress, stored, state, heal=True,
                                cut_while_pending=False, resplit=resplit, recorded=recorded)
    except InnodbTrxStale as exc:
        # Not a failed tick: which transactions are open is unknown this tick (other clients of the server keep
        # MariaDB's cache stale); nothing is cut and the next tick asks again.
        return skip(str(exc))
    if plan.delete:
        context.log.warning(f"{table.table_id}: partitions {[s.key for s in plan.delete]} do not continue Kafka's "
                            f"progress ({plan.text(plan.committed_hi)}) and can never commit: deleted, range cut again")
    requests = batched_requests(plan.add, table.max_slices_per_run, job_label=job_label)
    partition_requests: list[Any] = []
    # A re-cut can give a deleted slice again (the same range). Dagster refuses one key deleted and added by one
    # tick, and a kept key would keep its old place in the partitions' order, breaking a range run over the new
    # ones: such keys are deleted now, and added back below in their new place.
    again = {s.key for s in plan.delete} & {s.key for s in plan.add}
    for key in again:
        instance.delete_dynamic_partition(partitions.name, key)
    if deleted := [s.key for s in plan.delete if s.key not in again]:
        partition_requests.append(partitions.build_delete_request(deleted))
    if plan.add:
        partition_requests.append(partitions.build_add_request([s.key for s in plan.add]))
    after = SensorState(plan.state.pending, plan.chain, plan.state.waiting_since, plan.state.table).to_cursor()
    waiting = (plan.held_text() or plan.waiting or trickle_text(plan, table, time.time())) if not requests else None
    if waiting is not None:
        waiting = f"{table.table_id}: {waiting}"
    return TableTick(requests, partition_requests, after, waiting)


def build_slice_sensor(table: TableConfig, job: "UnresolvedAssetJobDefinition") -> SensorDefinition:
    """The table's own sensor (a deployment of a few tables: each can be stopped on its own in the UI)."""
    source_key = source_resource_key(table.source)

    @sensor(
        name=f"{table.dagster_name}_slices",
        job=job,
        minimum_interval_seconds=daemon_min_interval(table.sensor_interval_seconds),
        required_resource_keys={source_key, "kafka_io_manager"},
        default_status=DefaultSensorStatus.RUNNING,
        description=f"Cuts new watermark slices of {table.table_id} and requests their runs in order.",
    )
    def slice_sensor(context: SensorEvaluationContext) -> SensorResult:
        tick = tick_table(context, table, job.name, context.cursor,
                          shared_source(getattr(context.resources, source_key)), context.resources.kafka_io_manager)
        return SensorResult(run_requests=tick.run_requests, dynamic_partitions_requests=tick.partition_requests,
                            cursor=tick.cursor, skip_reason=tick.skip_reason if not tick.run_requests else None)

    return slice_sensor


KAFKA_DOWN: tuple[type[BaseException], ...] = (KafkaUnavailable, KafkaException, TimeoutError)


def build_group_slice_sensor(name: str, tables: list[TableConfig], jobs: list["UnresolvedAssetJobDefinition"]
                             ) -> SensorDefinition:
    """One sensor for many tables (a large deployment): one daemon tick, one code-server call and one runs query
    serve all of them, instead of a tick each; the daemon cannot tick 100 sensors every 5 s on a small machine
    (measured: each tick costs the daemon ~0.1-0.2 s of its own on top of the table's work). Per-table cursors in
    one JSON; one table's error is logged and leaves the others' cuts intact (its lag check shows it)."""
    by_name = {job.name: (table, job) for table, job in zip(tables, jobs, strict=True)}
    interval = min(t.sensor_interval_seconds for t in tables)

    @sensor(
        name=name,
        jobs=jobs,
        minimum_interval_seconds=daemon_min_interval(interval),
        required_resource_keys={source_resource_key(t.source) for t in tables} | {"kafka_io_manager"},
        default_status=DefaultSensorStatus.RUNNING,
        description=f"Cuts new watermark slices of {len(tables)} tables and requests their runs in order.",
    )
    def group_sensor(context: SensorEvaluationContext) -> SensorResult:
        cursors: dict[str, str] = json.loads(context.cursor) if context.cursor else {}
        active: dict[str, list[Any]] = {n: [] for n in by_name}
        for run in context.instance.get_runs(RunsFilter(job_name=None, statuses=ACTIVE)):
            if run.job_name in active:
                active[run.job_name].append(run)
        requests: list[RunRequest] = []
        partition_requests: list[Any] = []
        notes: list[str] = []
        errors: list[str] = []
        for job_name, (table, _) in by_name.items():
            try:
                tick = tick_table(context, table, job_name, cursors.get(table.table_id),
                                  shared_source(getattr(context.resources, source_resource_key(table.source))),
                                  context.resources.kafka_io_manager, active_runs=active[job_name], group=True)
            except Exception as exc:  # one table's failure must not stop the others' cuts
                context.log.error(f"{table.table_id}: {type(exc).__name__}: {exc}")
                errors.append(f"{table.table_id}: {exc}")
                if isinstance(exc, KAFKA_DOWN):  # every table needs Kafka: waiting for each in turn helps none
                    errors.append("Kafka unreachable: the remaining tables wait for the next tick")
                    break
                continue
            cursors[table.table_id] = tick.cursor
            requests.extend(tick.run_requests)
            partition_requests.extend(tick.partition_requests)
            if tick.skip_reason and not tick.run_requests:
                notes.append(tick.skip_reason)
        skip = None if requests else ("; ".join(errors + notes)[:2000] or "no new rows")
        return SensorResult(run_requests=requests, dynamic_partitions_requests=partition_requests,
                            cursor=json.dumps(cursors), skip_reason=skip)

    return group_sensor
