"""A table's slice history kept small: which committed slices roll up into one wider partition key, what that key
carries, and which progress records an incremental compaction must read. Pure planning (the progress topic is read
by the protocol module, resources/exactly_once.py, and orchestration/compaction.py).

A roll-up key is an ordinary slice key `(lo, hi]` spanning consecutive committed slices, so `SliceRange.from_key`,
re-runs (a committed range publishes nothing) and `reconcile` treat it like any slice. Kafka's progress topic stays
the source of truth: a roll-up's figures are computed from the progress records of its slices, never from Dagster.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from resources.exactly_once import ProgressRecord, live_records, tiling
from resources.slices import SliceRange

HOUR_S = 3600.0
DAY_S = 86_400.0


@dataclass(frozen=True)
class HistoryPolicy:
    """Committed slices older than `rollup_after_s` roll up per hour (UTC) of their commit, older than
    `daily_after_s` per day, older than `monthly_after_s` per month (so years of history stay a few hundred keys:
    ~90 daily + ~24 hourly + one per month). None: never roll up."""

    rollup_after_s: float | None = HOUR_S
    daily_after_s: float = DAY_S
    monthly_after_s: float | None = 90 * DAY_S

    def bucket(self, committed_at: datetime, now: datetime) -> str | None:
        """The roll-up bucket of a slice committed at `committed_at`; None while it is too recent."""
        if self.rollup_after_s is None:
            return None
        age = (now - committed_at).total_seconds()
        if age < self.rollup_after_s:
            return None
        if age < max(self.daily_after_s, self.rollup_after_s):
            return committed_at.strftime("h%Y-%m-%dT%H")
        if self.monthly_after_s is None or age < max(self.monthly_after_s, self.daily_after_s):
            return committed_at.strftime("d%Y-%m-%d")
        return committed_at.strftime("m%Y-%m")


@dataclass(frozen=True)
class Rollup:
    """Consecutive partition keys `keys` (each fully covered by committed progress) replaced by one key `range`."""

    range: SliceRange
    keys: list[SliceRange]
    records: list[ProgressRecord] = field(repr=False)
    bucket: str = ""


def parse_time(value: str) -> datetime | None:
    if not value:
        return None
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def plan_rollups(keys: list[SliceRange], records: list[ProgressRecord], now: datetime,
                 policy: HistoryPolicy) -> list[Rollup]:
    """Group consecutive committed keys whose slices share a roll-up bucket (hour, then day, of their newest
    commit) into one roll-up each. `keys`: the table's partition keys; `records`: the committed progress
    records covering (at least) the keys to consider, in commit order. A key not covered exactly by records
    (uncommitted, a gap, a reset inside it, records not read) is never rolled up and ends a group."""
    # The records still standing: after a reset back, the old slices' records (superseded, their rows published
    # again under new ones) overlapped the new ones, and no key of the range was ever rolled up.
    # A range recorded twice (`schema accept` records the committed slice again, with the accepted columns) counts
    # once, as its newest record: two records of one range overlap, and the key would never tile.
    newest = {(r.lo, r.hi): r for r in live_records(records) if r.hi > r.lo}
    records = sorted(newest.values(), key=lambda r: (r.lo, r.hi))
    los = [r.lo for r in records]
    groups: list[tuple[str, list[SliceRange], list[ProgressRecord]]] = []
    current: tuple[str, list[SliceRange], list[ProgressRecord]] | None = None
    for key in sorted(set(keys)):
        start = bisect.bisect_left(los, key.lo)
        end = bisect.bisect_right(los, key.hi - 1)
        covered = tiling(key, records[start:end])
        newest = max((t for r in covered if (t := parse_time(r.committed_at)) is not None),
                     default=None) if covered else None
        bucket = policy.bucket(newest, now) if newest is not None else None
        if covered is None or bucket is None:
            current = None
            continue
        if current is not None and current[0] == bucket and current[1][-1].hi == key.lo:
            current[1].append(key)
            current[2].extend(covered)
        else:
            current = (bucket, [key], list(covered))
            groups.append(current)
    return [Rollup(g[1][0].span(g[1][0].lo, g[1][-1].hi), g[1], g[2], g[0]) for g in groups if len(g[1]) > 1]


# -- what an incremental compaction reads ------------------------------------------------------------------------
#
# A complete compaction at `prev` (one that applied every roll-up the records allowed) left no two adjacent
# committed keys of one bucket. A key's bucket changes only when its newest commit crosses a tier's age (the ages
# `tiers` lists): between `prev` and `now`, those whose newest commit lies in (prev - age, now - age]. So the next
# compaction needs, per tier, the records of those keys and of the keys of their bucket before them: from the start
# of the bucket (hour, day, month) of `prev - age` up to `now - age` (`incremental_windows`). Keys of that bucket
# after them crossed too. A tier only needs its window once a key crossed (`crossed`): the monthly window reaches
# back to the month's start, read once a day (a daily key's end crossing), not on every pass.


@dataclass(frozen=True)
class Window:
    """The records an incremental compaction needs for one tier: those committed in [start, until] if a key's newest
    commit lies in (after, until] (it crossed into `tier` since the previous compaction)."""

    tier: str  # "h", "d", "m": the bucket a key enters at this age
    start: datetime
    after: datetime
    until: datetime


def tiers(policy: HistoryPolicy) -> list[tuple[float, str]]:
    """The ages (seconds) at which a committed slice's bucket changes, youngest first, with the tier it enters
    there ("h" hourly, "d" daily, "m" monthly). An age at or past a later one enters that later tier at once
    (rollup_after_s of 3 days: straight to daily)."""
    if policy.rollup_after_s is None:
        return []
    ages = {policy.rollup_after_s, max(policy.daily_after_s, policy.rollup_after_s)}
    if policy.monthly_after_s is not None:
        ages.add(max(policy.monthly_after_s, policy.daily_after_s, policy.rollup_after_s))
    ref = datetime(2000, 1, 1, tzinfo=UTC)
    return [(age, (policy.bucket(ref, ref + timedelta(seconds=age)) or "?")[0]) for age in sorted(ages)]


def bucket_start(t: datetime, tier: str) -> datetime:
    """The start of the hour, day or month (UTC) of `t`."""
    t = t.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    if tier == "h":
        return t
    return t.replace(hour=0) if tier == "d" else t.replace(day=1, hour=0)


def incremental_windows(policy: HistoryPolicy, now: datetime, prev: datetime) -> list[Window]:
    """Per tier, what a compaction at `now` needs after a complete one at `prev` (see above)."""
    prev = min(prev, now)
    out = []
    for age, tier in tiers(policy):
        after, until = prev - timedelta(seconds=age), now - timedelta(seconds=age)
        out.append(Window(tier, bucket_start(after, tier), after, until))
    return out


def crossed(records: list[ProgressRecord], key_his: set[int], window: Window) -> bool:
    """Whether a key's newest commit lies in the window's (after, until]: a record ending a key committed then (a
    key's last slice is its newest), or one that may change which records are a key's newest (a range recorded
    again by `schema accept`, a reset)."""
    for r in records:
        t = parse_time(r.committed_at)
        if t is not None and window.after < t <= window.until and (r.hi in key_his or r.hi <= r.lo
                                                                        or r.reset_reason):
            return True
    return False


def merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Offset ranges [a, b) merged where they overlap or touch, in order."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(s for s in spans if s[0] < s[1]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def summarize(records: list[ProgressRecord]) -> dict[str, Any]:
    """What a range of committed slices published, from their progress records: the metadata of a roll-up key and
    what `load_input` / a re-run of it needs. The checksum is sha256 over the slices' checksums in order, so it is
    the same however the range was rolled up (hourly then daily, or at once)."""
    ordered = sorted((r for r in records if r.hi > r.lo), key=lambda r: r.lo)
    if not ordered:
        raise ValueError("no slice records to summarize")
    offsets: dict[str, list[int]] = {}
    digest = hashlib.sha256()
    for r in ordered:
        digest.update(r.checksum.encode() + b"\n")
        for partition, (first, last) in r.offsets.items():
            span = offsets.setdefault(str(partition), [first, last])
            span[0], span[1] = min(span[0], first), max(span[1], last)
    times = [r.committed_at for r in ordered if r.committed_at]
    return {"lo": ordered[0].lo, "hi": ordered[-1].hi, "slices": len(ordered), "rows": sum(r.rows for r in ordered),
            "bytes": sum(r.bytes for r in ordered), "topic": ordered[-1].topic,
            "offsets": dict(sorted(offsets.items(), key=lambda kv: int(kv[0]))), "checksum": digest.hexdigest(),
            "first_committed_at": min(times) if times else "", "last_committed_at": max(times) if times else ""}
