"""Applies the slice-history policy (resources/history.py) to a table's partitions on the Dagster instance: roll-up
keys recorded as materializations, the small keys deleted, insertion order kept in watermark order.

Run by one global sensor at a slow cadence (a few tables per tick, within a time budget) and by
`rowrelay history compact [--table]`. A table's first compaction reads its whole progress topic; later ones read
what the policy's horizons crossed since the previous one (resources/history.py `incremental_windows`), which is
noted on the instance.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from dagster import (
    AssetMaterialization,
    DagsterInstance,
    DefaultSensorStatus,
    MetadataValue,
    SensorDefinition,
    SensorEvaluationContext,
    SkipReason,
    sensor,
)
from dagster._core.storage.event_log.schema import DynamicPartitionsTable as KEYS_TABLE
from dagster._core.storage.event_log.sql_event_log import SqlEventLogStorage
from sqlalchemy import func, select, text

from assets.identity import asset_key, channel_for, partitions_for
from orchestration.instance import job_name, table_runs_active
from resources.config import TableConfig
from resources.exactly_once import (
    START_MARK_KEYS,
    ProgressRecord,
    ProgressTopicReader,
    TableChannel,
    read_progress_tail,
    read_records,
)
from resources.history import (
    HistoryPolicy,
    Rollup,
    Window,
    crossed,
    incremental_windows,
    merge_spans,
    plan_rollups,
    summarize,
)
from resources.keys import history_note_key
from resources.slices import SliceRange

BATCH = 10_000  # keys per storage statement


# -- the instance's dynamic partition keys and a key-value note: the private Dagster calls, wrapped here only ----
# The keys' reads and their one-transaction replacement live beside the compaction that plans it; the sensor's cut
# (`open_keys`) and `rowrelay reset` (`replace_keys`) use them from here.


def page_keys(instance: DagsterInstance, partitions_name: str, limit: int, ascending: bool,
              cursor: str | None = None) -> tuple[list[str], str, bool]:
    """A page of a dynamic partitions definition's keys in insertion order: (keys, cursor, has_more).

    `DagsterInstance.get_paginated_dynamic_partitions` is not marked public, but it is what Dagster's own UI pages
    with, and it is the only way to read the newest keys without loading all of them (the sensor's flat tick)."""
    page = instance.get_paginated_dynamic_partitions(partitions_name, limit=limit, ascending=ascending,
                                                     cursor=cursor)
    return list(page.results), page.cursor, page.has_more


KeysVersion = tuple[int, int]  # a partitions definition's (key count, newest row id): any add or delete moves it


def keys_version(instance: DagsterInstance, partitions_name: str) -> KeysVersion | None:
    """The keys' version (`KeysVersion`), to tell later whether anything added or deleted keys meanwhile; None on a
    storage that is not SQL (its keys are then replaced through the public calls, unchecked)."""
    storage = instance.event_log_storage
    if not isinstance(storage, SqlEventLogStorage):
        return None
    with storage.index_connection() as conn:
        return _keys_version_in(conn, partitions_name)


def _keys_version_in(conn: Any, partitions_name: str) -> KeysVersion:
    count, newest = conn.execute(select(func.count(), func.max(KEYS_TABLE.c.id))
                                 .where(KEYS_TABLE.c.partitions_def_name == partitions_name)).one()
    return int(count), int(newest or 0)


def replace_keys(instance: DagsterInstance, partitions_name: str, version: KeysVersion | None, delete: list[str],
                 append: list[str]) -> bool:
    """Delete `delete` and append `append` (in order) to the keys, in one storage transaction, if the keys are still at
    `version` (None: unchecked); False if anything added or deleted keys since (a cut, another compaction, a reset):
    nothing is written then. The public calls (`delete_dynamic_partition`, `add_dynamic_partitions`) are one
    transaction each, so a compaction killed between its deletes and its adds left committed ranges without a key
    for good, and a cut appended between them landed before the keys re-added, out of watermark order, where
    `open_keys` (which reads the newest end only) missed it and the sensor cut over it; two compactions at once left
    keys covering one range twice. On PostgreSQL the table is locked against other writers (SHARE
    ROW EXCLUSIVE: a cut's insert waits the few milliseconds until the commit, then appends after these keys)."""
    storage = instance.event_log_storage
    if not isinstance(storage, SqlEventLogStorage):  # another storage: the public calls
        for key in delete:
            instance.delete_dynamic_partition(partitions_name, key)
        for i in range(0, len(append), BATCH):
            instance.add_dynamic_partitions(partitions_name, append[i:i + BATCH])
        return True
    with _transaction(storage) as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text(f"LOCK TABLE {conn.dialect.identifier_preparer.format_table(KEYS_TABLE)} "
                              "IN SHARE ROW EXCLUSIVE MODE"))
        if version is not None and _keys_version_in(conn, partitions_name) != version:
            return False
        _delete_keys_in(conn, partitions_name, delete)
        for i in range(0, len(append), BATCH):
            batch = append[i:i + BATCH]
            present = set(conn.execute(select(KEYS_TABLE.c.partition).where(
                (KEYS_TABLE.c.partitions_def_name == partitions_name) & KEYS_TABLE.c.partition.in_(batch))).scalars())
            if fresh := [key for key in batch if key not in present]:  # as add_dynamic_partitions: once each
                conn.execute(KEYS_TABLE.insert(), [{"partitions_def_name": partitions_name, "partition": key}
                                              for key in fresh])
    return True


def delete_keys(instance: DagsterInstance, partitions_name: str, keys: list[str]) -> None:
    """Delete many keys at once, unchecked (`bench/scale.py` empties a seeded table's keys with it)."""
    storage = instance.event_log_storage
    if not isinstance(storage, SqlEventLogStorage):  # another storage: the public call, key by key
        for key in keys:
            instance.delete_dynamic_partition(partitions_name, key)
        return
    with _transaction(storage) as conn:
        _delete_keys_in(conn, partitions_name, keys)


@contextmanager
def _transaction(storage: Any) -> Iterator[Any]:
    """A transaction on the event log storage's index connection. Dagster's PostgreSQL storage connects in
    AUTOCOMMIT (each statement its own transaction): as its own `index_transaction` does, the connection is switched
    to READ COMMITTED for the block."""
    with storage.index_connection() as conn:
        if conn.dialect.name == "postgresql":
            conn = conn.execution_options(isolation_level="READ COMMITTED")  # noqa: PLW2901
        with conn.begin():
            yield conn


def _delete_keys_in(conn: Any, partitions_name: str, keys: list[str]) -> None:
    """One DELETE per batch of keys (the public `delete_dynamic_partition` is one statement per key: ~300k of them
    took minutes on PostgreSQL)."""
    for i in range(0, len(keys), BATCH):
        conn.execute(KEYS_TABLE.delete().where((KEYS_TABLE.c.partitions_def_name == partitions_name)
                                          & KEYS_TABLE.c.partition.in_(keys[i:i + BATCH])))


def note_key(partitions_name: str) -> str:
    return history_note_key(partitions_name)


def read_note(instance: DagsterInstance, partitions_name: str) -> dict[str, Any] | None:
    """The note the table's last complete compaction left (`write_note`); None if none. Kept in the run storage's
    key-value table (`get_cursor_values`, what Dagster's daemons keep their cursors in; not marked public): the
    sensor and `rowrelay history compact` both read it, and a sensor cursor reset leaves it."""
    raw = instance.run_storage.get_cursor_values({note_key(partitions_name)}).get(note_key(partitions_name))
    try:
        note = json.loads(raw) if raw else None
    except ValueError:
        return None
    return note if isinstance(note, dict) else None


def write_note(instance: DagsterInstance, partitions_name: str, note: dict[str, Any]) -> None:
    instance.run_storage.set_cursor_values({note_key(partitions_name): json.dumps(note, sort_keys=True)})


def all_keys(instance: DagsterInstance, partitions_name: str) -> list[str]:
    return list(instance.get_dynamic_partitions(partitions_name))


def open_keys(instance: DagsterInstance, partitions_name: str, committed_hi: int, page: int = 64) -> list[str]:
    """Keys whose slices are not committed yet (hi above committed progress), from the newest end of the list only:
    partitions are appended in watermark order (cuts append; roll-ups re-add what follows them), so uncommitted
    keys are the newest. Pages back while a whole page is uncommitted: cost grows with the uncommitted keys,
    never with history."""
    found: list[str] = []
    cursor = None
    while True:
        keys, cursor, more = page_keys(instance, partitions_name, page, ascending=False, cursor=cursor)
        open_here = [k for k in keys if _hi(k) > committed_hi]
        found.extend(open_here)
        if not more or len(open_here) < len(keys):
            return list(reversed(found))


def _hi(key: str) -> int:
    try:
        return SliceRange.from_key(key).hi
    except ValueError:
        return -(2**63)  # not a slice key: never part of the chain


def policy_for(table: TableConfig) -> HistoryPolicy:
    return HistoryPolicy(rollup_after_s=table.rollup_after_seconds, daily_after_s=table.rollup_daily_after_seconds,
                         monthly_after_s=table.rollup_monthly_after_seconds)


@dataclass
class CompactResult:
    table: str
    keys_before: int = 0
    keys_after: int = 0
    rollups: int = 0
    slices_rolled: int = 0
    skipped: str = ""
    seconds: float = 0.0
    full: bool = False  # read the whole progress topic (asked, or no complete compaction noted for this policy)
    records_read: int = 0  # progress records parsed
    details: list[dict[str, Any]] = field(default_factory=list)

    def line(self) -> str:
        if self.skipped:
            return f"{self.table}: {self.skipped}"
        return (f"{self.table}: {self.keys_before} -> {self.keys_after} partitions ({self.rollups} roll-up(s) of "
                f"{self.slices_rolled} keys) in {self.seconds:.1f} s")


def rollup_metadata(rollup: Rollup, transactional_id: str) -> dict[str, Any]:
    """The roll-up key's materialization metadata: the figures a slice carries (kafka_io_manager.slice_metadata)
    summed over its slices, from Kafka's progress records."""
    s = summarize(rollup.records)
    return {
        "status": MetadataValue.text(f"roll-up of {s['slices']} committed slices ({rollup.bucket[1:]})"),
        "rollup": rollup.bucket,
        "slices": s["slices"],
        "rows": s["rows"],
        "bytes": s["bytes"],
        "topic": s["topic"],
        "offsets": MetadataValue.json(s["offsets"]),
        "watermark_lo": s["lo"],
        "watermark_hi": s["hi"],
        "checksum": s["checksum"],
        "checksum_of": MetadataValue.text("sha256 over the slices' checksums, in watermark order"),
        "first_committed_at": s["first_committed_at"],
        "committed_at": s["last_committed_at"],
        "rolled_up_keys": MetadataValue.json([rollup.keys[0].key, rollup.keys[-1].key]),
        "transactional_id": transactional_id,
    }


def redundant(keys: list[SliceRange]) -> list[SliceRange]:
    """Keys inside a wider key: left by a compaction interrupted after adding its roll-up key (the roll-up covers
    them, so they go)."""
    out: list[SliceRange] = []
    reach: SliceRange | None = None
    for k in sorted(keys, key=lambda k: (k.lo, -k.hi)):
        if reach is not None and reach.lo <= k.lo and k.hi <= reach.hi:
            out.append(k)
        elif reach is None or k.hi > reach.hi:
            reach = k
    return out


# -- reading what an incremental compaction needs -----------------------------------------------------------------

# Kafka timestamps of progress records (the publisher's clock, as it produced) against their committed_at (the same
# clock, just before): windows are widened by this on each side; records outside a window's times are harmless.
WINDOW_MARGIN = timedelta(hours=1)


def _note_scope(channel: TableChannel, policy: HistoryPolicy) -> dict[str, Any]:
    return {"progress_topic": channel.progress_topic,
            "policy": [policy.rollup_after_s, policy.daily_after_s, policy.monthly_after_s]}


def compaction_note(channel: TableChannel, policy: HistoryPolicy, now: datetime) -> dict[str, Any]:
    """What a complete compaction notes: when it planned, for which progress topic and policy (another topic or
    policy: the keys were not compacted for it, and the next compaction reads the whole topic)."""
    return {"planned_at": now.isoformat(), **_note_scope(channel, policy)}


def previous_compaction(note: dict[str, Any] | None, channel: TableChannel, policy: HistoryPolicy
                        ) -> datetime | None:
    """When the table's last complete compaction planned, from its note; None if there is none for this topic and
    policy."""
    if note is None or any(note.get(k) != v for k, v in _note_scope(channel, policy).items()):
        return None
    try:
        at = datetime.fromisoformat(str(note.get("planned_at")))
    except ValueError:
        return None
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def _amendments(reader: ProgressTopicReader, start: int, end: int) -> list[ProgressRecord]:
    """The records at offsets [start, end) that change what earlier ones mean (`live_records`, `plan_rollups`):
    resets and baselines (told by their keys) and ranges recorded again (`schema accept`: a reset_reason), parsed;
    the others are only fetched."""
    out = []
    for msg in reader.messages(start, end):
        value = msg.value() or b""
        if ((msg.key() or b"").startswith(START_MARK_KEYS)
                or (b'"reset_reason": "' in value and b'"reset_reason": ""' not in value)):
            out.append(ProgressRecord.from_json(value))
    return out


def read_windows(kafka_conf: dict[str, Any], channel: TableChannel, windows: list[Window], key_his: set[int],
                 timeout: float = 30.0) -> tuple[list[ProgressRecord], int]:
    """The progress records an incremental compaction needs, in the topic's order, and how many were parsed. Per
    window, the records committed in its (after, until] are read (Kafka's time index: `offsets_for_times`); if a
    key's newest commit is among them (`crossed`), those from the window's start on too. After each span read, the
    records up to the next one (or the end) are looked through for resets and ranges recorded again, so the records
    returned are those `plan_rollups` would take as standing from the whole topic."""
    with ProgressTopicReader(kafka_conf, channel, timeout) as reader:
        low, high = reader.bounds()

        def offset(t: datetime) -> int:
            found = reader.offset_at(int(t.timestamp() * 1000))
            return high if found < 0 else max(low, found)  # -1: nothing that recent

        parsed, spans = 0, []
        for w in windows:
            end = offset(w.until + WINDOW_MARGIN)
            probe = reader.records(offset(w.after - WINDOW_MARGIN), end)
            parsed += len(probe)
            if crossed(probe, key_his, w):
                # A start found by time is exact (every record before it is older); an end holds while Kafka
                # timestamps go back by less than the margin. Hourly and daily windows, a day or two of records,
                # are read to the end; only a month's, 90 days back, stops at its end.
                spans.append((offset(w.start - WINDOW_MARGIN), end if w.tier == "m" else high))
        spans = merge_spans(spans)
        records: list[ProgressRecord] = []
        for i, (a, b) in enumerate(spans):
            read = reader.records(a, b)
            parsed += len(read)
            records.extend(read)
            records.extend(_amendments(reader, b, spans[i + 1][0] if i + 1 < len(spans) else high))
        return records, parsed


# -- compaction ------------------------------------------------------------------------------------------------


def compact_table(instance: DagsterInstance, table: TableConfig, kafka_conf: dict[str, Any],
                  transactional_id_prefix: str, *, now: datetime | None = None, full: bool = False,
                  job_name: str | None = None) -> CompactResult:
    """Roll up the table's committed slices per the policy. Only committed keys are touched, and only while no key
    is uncommitted and no run of the table is active (so keys keep watermark order and no run loses its
    partition). `full`: read the whole progress topic (a first compaction); otherwise what the policy's horizons
    crossed since the previous complete compaction (its note on the instance; none, or one for another progress topic
    or policy: the whole topic)."""
    started = time.monotonic()
    now = now or datetime.now(UTC)
    result = CompactResult(table.table_id)
    policy = policy_for(table)
    if policy.rollup_after_s is None:
        result.skipped = "rollup_after_seconds is off"
        return result
    channel = channel_for(table, transactional_id_prefix)
    name = partitions_for(table).name
    progress = read_progress_tail(kafka_conf, channel)
    if progress is None:
        result.skipped = "nothing committed"
        return result
    if job_name is not None and table_runs_active(instance, table, job_name):
        result.skipped = "runs active; later"
        return result
    version = keys_version(instance, name)  # before the keys are read: a change after this read is seen below
    raw = all_keys(instance, name)
    result.keys_before = result.keys_after = len(raw)
    parsed: dict[str, SliceRange] = {}
    for k in raw:
        try:
            parsed[k] = SliceRange.from_key(k)
        except ValueError:
            continue
    if any(s.hi > progress.hi for s in parsed.values()):
        result.skipped = "uncommitted slices; later"
        return result
    gone = {s.key for s in redundant(list(parsed.values()))} & set(parsed)
    keys = [s for k, s in parsed.items() if k not in gone]
    prev = None if full else previous_compaction(read_note(instance, name), channel, policy)
    if prev is None:
        records = read_records(kafka_conf, channel)
        result.full, result.records_read = True, len(records)
    else:
        records, result.records_read = read_windows(kafka_conf, channel, incremental_windows(policy, now, prev),
                                                    {s.hi for s in keys})
    rollups = plan_rollups(keys, records, now, policy)
    key_of = {s: k for k, s in parsed.items()}
    # A cut (the slice sensor's, in another thread; a CLI backfill's) appends keys: one appended since `raw` was
    # read would end up before the keys re-added below, out of watermark order. Checked again at the last moment.
    newest, _, _ = page_keys(instance, name, 1, ascending=False)
    if newest != raw[-1:] or (job_name is not None and table_runs_active(instance, table, job_name)):
        result.skipped = "keys or runs changed meanwhile; later"
        return result
    for r in rollups:  # the roll-up key first: a crash after this leaves redundant keys, removed next time
        instance.report_runless_asset_event(AssetMaterialization(
            asset_key=asset_key(table), partition=r.range.key, metadata=rollup_metadata(r, channel.transactional_id),
            description=f"{len(r.keys)} committed slices rolled up into {r.range}"))
        gone.update(key_of[s] for s in r.keys)
        result.details.append({"key": r.range.key, "keys": len(r.keys), "bucket": r.bucket})
    survivors = [k for k in raw if k not in gone]
    final = sorted([parsed[k] for k in survivors if k in parsed] + [r.range for r in rollups])
    desired = [s.key for s in final] + [k for k in survivors if k not in parsed]
    same = 0  # keep the common prefix of the current and desired order; re-add what follows
    while same < min(len(survivors), len(desired)) and survivors[same] == desired[same]:
        same += 1
    if not replace_keys(instance, name, version, sorted(gone) + survivors[same:], desired[same:]):
        result.skipped = "keys changed meanwhile; later"  # the roll-ups' materializations stay: the next records them
        return result  # again, and a roll-up key that does not exist shows nowhere
    result.rollups, result.slices_rolled = len(rollups), sum(len(r.keys) for r in rollups)
    result.keys_after = len(desired)
    write_note(instance, name, compaction_note(channel, policy, now))  # complete: the next one starts from here
    result.seconds = time.monotonic() - started
    return result


def iter_compact(instance: DagsterInstance, tables: list[TableConfig], kafka_conf: dict[str, Any],
                 transactional_id_prefix: str, full: bool = False) -> Iterator[CompactResult]:
    for table in tables:
        yield compact_table(instance, table, kafka_conf, transactional_id_prefix, full=full,
                            job_name=job_name(table))


# -- the sensor -------------------------------------------------------------------------------------------------

HISTORY_SENSOR = "rowrelay_history"
HISTORY_INTERVAL_S = 60
HISTORY_EVERY_S = 600.0  # each table compacted at most this often
HISTORY_BUDGET_S = 20.0  # per tick: the daemon's sensor timeout is 60 s, and other sensors share its workers


@dataclass
class HistoryCursor:
    """The history sensor's cursor: when each table's last compaction that did something ended."""

    last: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_cursor(cls, cursor: str | None) -> HistoryCursor:
        return cls(json.loads(cursor).get("last", {}) if cursor else {})

    def to_cursor(self) -> str:
        return json.dumps({"last": self.last})


def due_tables(tables: list[TableConfig], last: dict[str, float], now: float) -> list[TableConfig]:
    """Tables whose compaction is due, the longest-waiting first (never done: first)."""
    due = [t for t in tables if now - last.get(t.table_id, 0.0) >= HISTORY_EVERY_S]
    return sorted(due, key=lambda t: last.get(t.table_id, 0.0))


def build_history_sensor(tables: list[TableConfig], transactional_id_prefix: str) -> SensorDefinition:
    """One sensor for every table: compacts due tables within a time budget per tick. The first compaction of a
    table reads its whole progress topic (an existing deployment's history), later ones what the policy's horizons
    crossed since the previous one (`compact_table`)."""

    @sensor(name=HISTORY_SENSOR, minimum_interval_seconds=HISTORY_INTERVAL_S, required_resource_keys={
            "kafka_io_manager"}, default_status=DefaultSensorStatus.RUNNING,
            description="Rolls up old committed slices of every table (hour, day, month) so partitions stay few.")
    def history_sensor(context: SensorEvaluationContext) -> SkipReason:
        conf = context.resources.kafka_io_manager.kafka_conf()
        last = HistoryCursor.from_cursor(context.cursor).last
        started = time.time()
        done: list[str] = []
        for table in due_tables(tables, last, started):
            if time.time() - started > HISTORY_BUDGET_S:
                break
            result = compact_table(context.instance, table, conf, transactional_id_prefix,
                                   full=table.table_id not in last, job_name=job_name(table))
            if not result.skipped:
                last[table.table_id] = time.time()
                context.log.info(result.line())
            done.append(result.line())
        context.update_cursor(HistoryCursor(last).to_cursor())
        return SkipReason("; ".join(done) or "no table due")

    return history_sensor
