"""`rowrelay reset`'s engine: a deliberate new baseline for a table, recorded in Kafka (a progress record with the
reason) and on the Dagster instance (an observation of the table's asset), with the table's partitions made to
agree with it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Container
from dataclasses import dataclass, field

from dagster import AssetMaterialization, AssetObservation, DagsterInstance, MetadataValue

from assets.identity import asset_key, channel_for, partitions_for
from assets.records import recorded_published
from orchestration.compaction import keys_version, replace_keys
from orchestration.tables import kafka_conf, reflect_table
from resources.config import RelayConfig, TableConfig
from resources.exactly_once import (
    ProgressRecord,
    SlicePublisher,
    read_committed_progress,
    read_progress_history,
    recorded_watermark_kind,
    watermark_change,
)
from resources.keys import BEFORE_RESET_OF, PUBLISHED_UP_TO, RESET_AFTER
from resources.slices import SliceRange, is_timestamp_key, watermark_text


def reflected_watermark(config: RelayConfig, table: TableConfig) -> tuple[str, str] | None:
    """The table's watermark column and kind (integer, timestamp, timestamptz) as the source reflects them; None
    where it cannot (a dropped table, the source away)."""
    try:
        shape = reflect_table(config, table)
    except Exception:  # noqa: BLE001 - a reset must stay possible with the table gone
        return None
    return shape.watermark_id


def watermark_is_timestamp(config: RelayConfig, table: TableConfig, reflected: tuple[str, str] | None
                           ) -> bool | None:
    """Whether the table's watermark is a timestamp: from the source's columns (`reflected_watermark`), or where the
    source cannot say from the newest slice in its progress (resets and baselines have integer keys either way);
    None when neither can tell."""
    if reflected is not None:
        return reflected[1] != "integer"
    with contextlib.suppress(Exception):
        history = read_progress_history(kafka_conf(config), channel_for(table, config.kafka.transactional_id_prefix))
        newest = next((r for r in reversed(history) if r.hi > r.lo), None)
        return None if newest is None else is_timestamp_key(newest.slice)
    return None


def reset_outcome(part: SliceRange, replaced_hi: int, after_text: str, text: Callable[[int], str]
                  ) -> tuple[int, str]:
    """What became of the rows of a partition part (lo, hi] at or below a reset's watermark (`after_text`): those up
    to the progress the reset replaced were published, the rest skipped by it. (watermark published up to, what)."""
    sent_to = min(max(replaced_hi, part.lo), part.hi)
    if sent_to == part.hi:
        return sent_to, f"published before rowrelay reset after {after_text}"
    if sent_to == part.lo:
        return sent_to, f"never sent: skipped by rowrelay reset after {after_text}"
    return sent_to, f"published up to {text(sent_to)} before rowrelay reset after {after_text}, the rest skipped"


@dataclass(frozen=True)
class ResetPartitions:
    """What a reset to W does to a table's partitions (`reset_partitions`)."""

    dropped: list[str]  # deleted
    kept_below: dict[str, SliceRange]  # of those, a straddling one's part (lo, W], materialized without a run
    settled: list[str]  # uncommitted, wholly at or below W: materialized without a run
    # Over empty progress: partitions wholly at or below W that Dagster records as materialized (`recorded`), left
    # as they are (their rows count as published, as the run's refusal counted them).
    recorded: list[str] = field(default_factory=list)


def reset_partitions(ranges: dict[str, SliceRange], after: int, replaced_hi: int, moved: bool,
                     recorded: Container[str] = ()) -> ResetPartitions:
    """The partitions above W are cut again from W, one straddling W keeps its part (lo, W], and uncommitted ones
    wholly at or below W (a reset forward) are settled: no run could ever commit them. `moved`: the reset also says
    where a changed watermark (another column or kind) stands, so the partitions are ranges of the old one: those
    above W or never committed are deleted (read as the new one's ranges they would be orphans, a settled part a
    false statement), the committed ones below stay as the old watermark's history. `recorded`: where the reset
    replaced empty progress (a changed transactional_id_prefix, a lost progress topic), Kafka cannot tell which
    partitions committed: those Dagster holds a materialization of are not settled (they were, or were recorded as,
    published: "never sent" would be false)."""
    if moved:
        return ResetPartitions([k for k, r in ranges.items() if r.hi > after or r.hi > replaced_hi], {}, [])
    dropped = [k for k, r in ranges.items() if r.hi > after]
    kept = {k: ranges[k].span(ranges[k].lo, after) for k in dropped if ranges[k].lo < after}
    below = [k for k, r in ranges.items() if replaced_hi < r.hi <= after]
    return ResetPartitions(dropped, kept, [k for k in below if k not in recorded],
                           [k for k in below if k in recorded])



def reset_watermark(config: RelayConfig, table: TableConfig) -> tuple[tuple[str, str] | None, bool | None]:
    """The watermark column and kind a reset records (`reflected_watermark`; with the source away and the column
    unchanged, its progress's), and whether the watermark is a timestamp (`watermark_is_timestamp`). Asked once:
    the refusal of a wrongly written --after, the texts after the reset, and the watermark the reset is one of."""
    reflected = reflected_watermark(config, table)
    kind = watermark_is_timestamp(config, table, reflected)
    channel = channel_for(table, config.kafka.transactional_id_prefix)
    prior = read_committed_progress(kafka_conf(config), channel) if reflected is None else None
    if prior is not None and prior.watermark == table.watermark and prior.watermark_kind:
        # The source away (or the table gone), the column unchanged: the reset keeps the watermark its progress is
        # of, so the next cut still compares it (a record without one would compare nothing from then on).
        reflected = (prior.watermark, prior.watermark_kind)
    return reflected, kind


@dataclass
class ResetDone:
    """A reset as it was recorded: what it replaced and what became of the table's partitions."""

    after: int
    record: ProgressRecord
    before: ProgressRecord | None  # the progress the reset replaced (None: empty)
    reflected: tuple[str, str] | None
    moved: bool  # the reset also says where a changed watermark (another column or kind) stands
    timestamps: bool  # the watermark is a timestamp: texts name times, as --after takes them
    replaced_hi: int
    plan: ResetPartitions
    kept: list[tuple[str, SliceRange]]  # a dropped partition straddling W and its part (lo, W], re-added
    published: dict[str, int]  # over empty progress: partitions Dagster records as published, and up to where

    def text(self, value: int) -> str:
        return watermark_text(value, self.timestamps)

    @property
    def was(self) -> str:
        """The progress the reset replaced, as text."""
        if self.before is None:
            return "empty"
        kind = recorded_watermark_kind(self.before) or ("timestamp" if self.timestamps else "integer")
        return watermark_text(self.before.hi, kind != "integer")


def replace_partitions(instance: DagsterInstance, table: TableConfig, after: int, before: ProgressRecord | None,
                       reflected: tuple[str, str] | None, kind: bool | None, replaced_hi: int
                       ) -> tuple[ResetPartitions, list[tuple[str, SliceRange]], bool, bool, dict[str, int]]:
    """The partitions made to agree with a reset to `after` (`reset_partitions`), in one replacement of the keys:
    (the plan, the straddling partitions' parts kept, moved, timestamps, published)."""
    partitions = partitions_for(table)
    while True:  # read again when a history compaction replaced the keys between this read and the replacement
        version = keys_version(instance, partitions.name)  # before the keys are read, as a compaction takes it
        keys = instance.get_dynamic_partitions(partitions.name)
        # The reset also says where a changed watermark stands: the config's column against the progress's (the
        # source away), or the reflected column and kind.
        moved = before is not None and (watermark_change(before, *reflected) is not None if reflected is not None
                                        else before.watermark is not None and before.watermark != table.watermark)
        # A timestamp watermark's slices have times as keys: the texts then name times, as --after takes them.
        timestamps = any(map(is_timestamp_key, keys)) or (before is not None and is_timestamp_key(before.slice))
        if moved or (not keys and (before is None or before.hi == before.lo)):  # the source's column tells
            timestamps = bool(kind)
        ranges = {key: SliceRange.from_key(key) for key in keys}
        # Empty progress says nothing of what was published (a new prefix, a lost progress topic): Dagster's own
        # record of each partition at or below W does (the run's refusal went by it too), not "never sent".
        published = {} if before is not None else recorded_published(
            instance, asset_key(table), [k for k, r in ranges.items() if r.hi > replaced_hi and r.lo < after])
        plan = reset_partitions(ranges, after, replaced_hi, moved, published)
        # One transaction: killed between a delete and its add, (lo, W] would be left without a partition for good.
        kept = [(key, below) for key in plan.dropped if (below := plan.kept_below.get(key)) is not None]
        if replace_keys(instance, partitions.name, version, list(plan.dropped), [below.key for _, below in kept]):
            return plan, kept, moved, timestamps, published


def settle_part(instance: DagsterInstance, table: TableConfig, done: ResetDone, key: str, part: SliceRange,
                reason: str) -> None:
    """Materialize `part` (of partition `key`) without a run, saying what became of its rows."""
    sent_to, what = reset_outcome(part, max(done.replaced_hi, done.published.get(key, done.replaced_hi)),
                                  done.text(done.after), done.text)
    of = f" of {key}" if part.key != key else ""
    instance.report_runless_asset_event(AssetMaterialization(
        asset_key=asset_key(table), partition=part.key, description=f"rows {part}{of}, {what}",
        metadata={BEFORE_RESET_OF: key, PUBLISHED_UP_TO: sent_to, "reason": reason}))


def reset_table(instance: DagsterInstance, config: RelayConfig, table: TableConfig, after: int, reason: str,
                reflected: tuple[str, str] | None, kind: bool | None) -> ResetDone:
    """A deliberate new baseline: the table's progress says "committed up to W" (`after`), recorded in Kafka and on
    the Dagster instance. Rows at or below W are then never sent again; rows above W are sent once, whatever the
    topic already holds. Partitions above W are deleted (they are cut again from W); one that straddles W (a slice
    or roll-up (lo, hi] with lo < W) keeps its part below W as the partition (lo, W], materialized: those rows were
    published before the reset, or, above the old progress (a reset forward), skipped by it. Uncommitted partitions
    entirely at or below W (a reset forward over slices cut but not published) are materialized alike: no run
    could ever commit them. Committed partitions at or below W are left as they are. The caller has checked the
    table's active runs (the reset fences a running publisher)."""
    channel = channel_for(table, config.kafka.transactional_id_prefix)
    publisher = SlicePublisher(channel, kafka_conf(config))
    try:
        # `before`: the progress the reset replaced, read by the publisher after it fenced every other (read
        # here first, a run's slice could commit between the read and the fence, and go unreported).
        record, before = publisher.publish_reset(after, reason, reflected)
    finally:
        publisher.close()
    replaced_hi = before.hi if before else channel.start_after
    plan, kept, moved, timestamps, published = replace_partitions(instance, table, after, before, reflected, kind,
                                                                  replaced_hi)
    done = ResetDone(after, record, before, reflected, moved, timestamps, replaced_hi, plan, kept, published)
    for key, below in kept:  # else (lo, W] would have no partition
        settle_part(instance, table, done, key, below, reason)
    for key in plan.settled:
        settle_part(instance, table, done, key, SliceRange.from_key(key), reason)
    instance.report_runless_asset_event(AssetObservation(
        asset_key=asset_key(table), description=f"rowrelay reset: new baseline after watermark {done.text(after)}",
        metadata={RESET_AFTER: after, "reason": reason,
                  "previous_progress": before.hi if before else MetadataValue.null(),
                  "partitions_deleted": len(plan.dropped), "partitions_settled": len(plan.settled),
                  "partitions_recorded_committed": len(plan.recorded), "committed_at": record.committed_at}))
    return done
