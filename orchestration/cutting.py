"""The cut planner: where a table stands (Kafka's progress against its uncommitted slices), which watermark is
final, and the new slices up to it; the one way slices are cut, for the sensor and `rowrelay backfill` alike.
It asks the source and Kafka, never the Dagster instance: callers pass what they read from it and apply the plan
(partitions to delete and add) themselves."""

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from assets.identity import channel_for
from assets.shape import table_shape
from resources.cache import KeptAnswers
from resources.config import TableConfig
from resources.exactly_once import (
    BASELINE_PREFIX,
    KafkaReads,
    ProgressRecord,
    Purpose,
    SlicePublisher,
    TableChannel,
    preflight,
    transaction_timeout_ms,
)
from resources.kafka_io_manager import KafkaIOManager
from resources.slices import SliceRange, WatermarkCandidate, cut_slices, reconcile, settle, watermark_text
from resources.source_database import (
    SourceDatabaseResource,
    SourceError,
    TableShape,
    null_watermark_error,
)


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


SHAPE_TTL_S = 60.0
_SHAPES: KeptAnswers[tuple[str, str], TableShape] = KeptAnswers(ttl_s=SHAPE_TTL_S)
FINALITY_WAIT_S = 1.0


def cached_table_shape(source: SourceDatabaseResource, table: TableConfig) -> TableShape:
    """The table's reflected shape, re-read at most once a minute per code-server process: reflection is the
    largest part of an idle tick. Runs always reflect afresh, so a changed table still fails its run clearly."""
    return _SHAPES.answer((source.url, table.model_dump_json()), lambda: table_shape(source, table))


def forget_table_shape(source: SourceDatabaseResource, table: TableConfig) -> None:
    """Drop the table's cached shape, so the next `cached_table_shape` reflects afresh."""
    _SHAPES.forget((source.url, table.model_dump_json()))


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
    # CREATE_TIME), even below the new max: the new table's ids restarted, and a lower one may still be uncommitted.
    # Dropping one needlessly (MariaDB: an ALTER that rebuilt the same table) loses nothing: the
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


_NULLS_OK: KeptAnswers[tuple[str, str], bool] = KeptAnswers(ttl_s=SHAPE_TTL_S)


def check_null_watermarks(source: SourceDatabaseResource, shape: TableShape, table: TableConfig, cut_after: int
                          ) -> None:
    """Refuse a table with NULL watermarks. A clean result is trusted for SHAPE_TTL_S per process (like the
    shape): one query less per idle tick, which counts with many tables per sensor; runs check afresh."""
    key = (source.url, table.table_id)
    if _NULLS_OK.get(key):
        return
    if source.has_null_watermarks(shape):
        _NULLS_OK.forget(key)
        raise null_watermark_error(table.table_id, table.watermark, shape.watermark_text(cut_after))
    _NULLS_OK.keep(key, True)


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
    """Why final rows are not cut yet when trickle batching holds them, or None: the tick's skip reason, rather than
    Dagster's "Sensor function returned an empty result", for up to `max_slice_delay_seconds`."""
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
        them, or None when none are held back as not final: a prepared XA transaction may hold a table for good, and
        the tick's skip reason says so."""
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
    highest slice Dagster recorded as committed; the publisher refuses a baseline over it (`cut` does first)."""
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
    """Refuse a time as `start_after` of an integer watermark, before the first cut: as microseconds since 1970 (2026
    is ~1.8e15) it would skip every id below it without a word, and the table would look caught up. The CLI's
    `--after` refuses it too."""
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


@dataclass(frozen=True)
class CutMode:
    """How a caller cuts: the sensor's tick (`SENSOR`), `rowrelay backfill`'s (`backfill`) or its early read's.

    `heal`: partitions off the chain that continues Kafka's progress (`orphans`) are deleted and their range cut
    again (no run of the table active). `cut_while_pending`: cut above uncommitted slices too (the sensor waits for
    their runs instead). `limit`: slices per cut. `write`: False for a dry run: a `start_after: latest` table's
    baseline is not recorded in Kafka (the plan says where it would be). `refuse`: refuse as the publisher would,
    before anything is cut (always so for a dry run), so that a backfill adds no partition its run would refuse to
    publish. `batch`: hold back a cut of fewer than `min_slice_rows` rows (trickle batching, `plan_tick`): the
    sensor's cost control; False for a backfill, an explicit "publish now" of every final row."""

    heal: bool
    cut_while_pending: bool
    limit: int = 500
    write: bool = True
    refuse: bool = False
    batch: bool = True


SENSOR = CutMode(heal=True, cut_while_pending=False)


def backfill(*, heal: bool, dry_run: bool = False) -> CutMode:
    """`rowrelay backfill`'s cut: heals only with no run of the table active, refuses as its runs would."""
    return CutMode(heal=heal, cut_while_pending=True, limit=100_000, write=not dry_run, refuse=True, batch=False)


def early_read(limit: int) -> CutMode:
    """The backfill's guess of its first slices, before Dagster is loaded: nothing deleted, nothing written."""
    return CutMode(heal=False, cut_while_pending=True, limit=limit, batch=False)


@dataclass
class CutInputs:
    """What a cut starts from, as the caller read it: the table's committed progress (just read from Kafka), its
    partition keys that may be uncommitted, the sensor's state. `resplit`: the first uncommitted slice outlived the
    transaction timeout, so it can never commit as cut: the uncommitted slices are deleted and cut again from
    Kafka's progress at a quarter of its rows. `recorded`: the highest slice Dagster recorded as committed, asked by
    a caller with the instance where progress is empty (the run's own `recorded` check; a `start_after: latest`
    table's baseline is refused over it too)."""

    table: TableConfig
    source: SourceDatabaseResource
    io_manager: KafkaIOManager
    progress: ProgressRecord | None
    keys: list[str]
    state: SensorState
    resplit: bool = False
    recorded: SliceRange | None = None


@dataclass
class _Start:
    """Where a cut starts once a `start_after: latest` table's baseline is settled."""

    progress: ProgressRecord | None
    state: SensorState
    slices: list[SliceRange]
    pre_baseline: list[SliceRange]


def cut(given: CutInputs, mode: CutMode) -> CutPlan:
    """The one way slices are cut, for the sensor and `rowrelay backfill` alike.

    Kafka's progress decides where the table stands, not the partitions: partitions off the chain that continues
    it (`orphans`) are deleted when `mode.heal` and the range is cut again, so a table whose partitions disagree with
    Kafka (a racing cut, a changed `start_after`, a new baseline) heals itself instead of failing "out of order"
    forever. New slices start where the chain ends, up to the safe watermark. Partitions are never touched here:
    the caller applies `delete` and `add`."""
    table, source = given.table, given.source
    channel = channel_for(table, given.io_manager.transactional_id_prefix)
    conf = given.io_manager.kafka_conf()
    shape = cached_table_shape(source, table)
    refuse = mode.refuse or not mode.write  # a dry run refuses as the backfill's baseline or first publish would
    start = _start(given, mode, shape, channel, conf, refuse)
    if isinstance(start, CutPlan):
        return start
    progress, state = start.progress, start.state
    if progress is None:
        refuse_start_after_kind(shape, table)
    committed_hi = progress.hi if progress else channel.start_after
    if progress is None:  # also over slices cut under another `start_after` (`-1` then unset skipped row 0)
        check_start_after(source, shape, table, committed_hi)
    ledger = reconcile(start.slices, committed_hi)
    # Slices below a baseline go even beside active runs: no run can publish them, and a later run of one would
    # materialize "already committed".
    delete = start.pre_baseline + (ledger.orphans if mode.heal else [])
    recent = [progress] if progress is not None else []
    max_rows = slice_rows_limit(table.slice_max_rows, recent, transaction_timeout_ms(conf))
    chain, frontier = ledger.chain, ledger.frontier
    if given.resplit and chain:
        resplit = _resplit(source, shape, table, chain, max_rows, state)
        if isinstance(resplit, str):
            return CutPlan(committed_hi, delete, [], chain, state, timestamps=shape.timestamps, waiting=resplit)
        max_rows, state = resplit
        delete, chain, frontier = delete + chain, [], committed_hi
    if chain and not mode.cut_while_pending:
        return CutPlan(committed_hi, delete, [], chain, state, timestamps=shape.timestamps)
    tick = plan_tick(source, table, frontier, state, limit=mode.limit, max_rows=max_rows, batch=mode.batch)
    return CutPlan(committed_hi, delete, tick.slices, chain + tick.slices, tick.state, timestamps=shape.timestamps)


def _start(given: CutInputs, mode: CutMode, shape: TableShape, channel: TableChannel, conf: dict[str, Any],
           refuse: bool) -> _Start | CutPlan:
    """Refusals over empty progress, and a `start_after: latest` table's baseline: where the cut starts, or the plan
    that waits for the baseline."""
    table, source, progress, state = given.table, given.source, given.progress, given.state
    slices = [SliceRange.from_key(k) for k in given.keys]
    # As the publisher refuses, before any cut: a changed watermark ("nothing new" would skip rows too), `topic:`
    # moved back to a topic it had left (two deployments sharing the progress), empty progress over published rows;
    # Kafka asked only where the cut refuses. Slices Dagster recorded as committed over empty progress (its topic
    # lost after the data topic's messages expired) are refused always: the run refuses them (`recorded`), and so
    # does a `latest` table's baseline, before any partition is touched. A baseline recorded over them (at the newest
    # row) would skip every row written since the last commit; and with a fresh sensor cursor, the committed slices'
    # partitions (from the old baseline up) would not continue a chain from 0 and be deleted as orphans.
    kafka = KafkaReads.of(conf) if refuse else None
    if (refused := preflight(Purpose.CUT, progress, channel, watermark=shape.watermark_id,
                             timestamps=shape.timestamps, recorded=given.recorded, kafka=kafka)):
        raise refused
    # Slices over empty progress were cut under another `start_after` (a baseline is progress): orphans, once the
    # baseline is recorded. Left as a chain from 0, they would send the history `latest` skips.
    if progress is None and table.start_after == "latest":
        if not mode.write:
            return _baseline_dry_run(given, mode, shape, channel, slices)
        progress, state = latest_baseline(source, shape, table, channel, conf, state, given.recorded)
        if progress is None:  # the slices go now: no publisher takes them, and the next tick may not see them
            return CutPlan(channel.start_after, slices if mode.heal else [], [], [], state,
                           timestamps=shape.timestamps,
                           waiting="start_after: latest waits for open transactions before recording its baseline")
        # The baseline, or the progress another cutter committed meanwhile (this read stale), as given progress is.
        if (refused := preflight(Purpose.CUT, progress, channel, watermark=shape.watermark_id, kafka=kafka)):
            raise refused
        # Below the baseline they would pass for committed slices (never published): deleted all the same. Only
        # below a baseline: progress another cutter committed meanwhile (this read stale) keeps its slices.
        below = progress.slice.startswith(BASELINE_PREFIX)
        pre_baseline = [s for s in slices if below and s.lo < progress.hi]
        return _Start(progress, state, [s for s in slices if s not in pre_baseline], pre_baseline)
    return _Start(progress, state, slices, [])


def _baseline_dry_run(given: CutInputs, mode: CutMode, shape: TableShape, channel: TableChannel,
                      slices: list[SliceRange]) -> CutPlan:
    """Where a `start_after: latest` table's baseline would be recorded. The new state keeps a pending candidate, so
    the dry run waits for open transactions as the backfill's baseline would, rather than answering "not final
    yet" at once."""
    safe_hi, state = settled_watermark(given.source, shape, given.table, None, given.state)
    if safe_hi is not None:
        at = f"the safe watermark ({shape.watermark_text(safe_hi)})"
    elif state.pending:
        at = "the safe watermark (not final yet: a transaction that may write below it is still open)"
    else:  # as latest_baseline records it: an empty table's every row to come is new
        at = f"{shape.watermark_text(0)} (the table is empty: every row it gets will be sent)"
    return CutPlan(channel.start_after, slices if mode.heal else [], [], [], state, timestamps=shape.timestamps,
                   waiting=("start_after: latest: its baseline is not recorded yet; a backfill or the sensor "
                            f"would record it at {at}"))


def _resplit(source: SourceDatabaseResource, shape: TableShape, table: TableConfig, chain: list[SliceRange],
             max_rows: int, state: SensorState) -> tuple[int, SensorState] | str:
    """The rows per slice and the state to cut the uncommitted slices again at a quarter of the first one's rows;
    or why it cannot be cut smaller."""
    too_long = chain[0]
    # Settled answers (a cut slice's rows never change): asked once per process, not every tick.
    rows = source.count_rows(shape, too_long.lo, too_long.hi, settled=True)
    if source.nth_watermark(shape, too_long.lo, 1, too_long.hi, settled=True) == too_long.hi:
        # Its rows share one watermark value, which a slice never splits: cut again it would be the same slice,
        # timing out again for as long as the timeout allows, forever. Kept as it is, for a human.
        return (f"slice {too_long.key} outlived transaction.timeout.ms and cannot be cut smaller: its {rows} rows "
                f"share one {table.watermark} value. Raise kafka.producer transaction.timeout.ms (up to the "
                "broker's transaction.max.timeout.ms), then run it again (`rowrelay backfill --table "
                f"{table.table_id}` or Materialize in the UI)")
    # The slices' end was final when they were cut: cut again up to it at once (already-final candidate), not after
    # the open transactions of this moment, or a busy source would re-cut them at full size.
    return (min(max_rows, max(1, rows // 4)),
            SensorState([WatermarkCandidate.settled(chain[-1].hi), *state.pending], state.chain,
                        state.waiting_since, state.table))


_SOURCES: dict[str, SourceDatabaseResource] = {}


def shared_source(source: SourceDatabaseResource) -> SourceDatabaseResource:
    """One source resource (and so one connection pool) per URL and process: Dagster builds resources anew for
    every tick, and a new engine costs a database connection (~10 ms) each time."""
    return _SOURCES.setdefault(source.url, source)
