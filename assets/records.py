"""What Dagster's instance recorded of a table's slices: the other record of what was published, besides Kafka's
progress."""

import contextlib

from dagster import AssetKey, AssetRecordsFilter, DagsterInstance

from resources.keys import PUBLISHED_UP_TO
from resources.slices import SliceRange

RECORDED_LOOKBACK = 1000  # materializations read back: a roll-up stored after newer slices is among them


def last_recorded_slice(instance: DagsterInstance, key: AssetKey) -> SliceRange | None:
    """The highest slice Dagster recorded as committed (a materialization), if any: asked only where Kafka's
    progress is empty, so that a progress topic lost after its data topic's messages expired does not send the
    table again (the publisher refuses: `recorded`). The highest of the recent ones, not the latest: a roll-up is
    recorded as a new materialization, after slices above it."""
    records = instance.fetch_materializations(AssetRecordsFilter(asset_key=key), limit=RECORDED_LOOKBACK).records
    ranges = []
    for record in records:
        partition = record.asset_materialization.partition if record.asset_materialization else None
        with contextlib.suppress(ValueError):  # not a slice key
            ranges.append(SliceRange.from_key(partition or ""))
    return max(ranges, key=lambda r: r.hi, default=None)


RECORDED_KEYS_PER_QUERY = 500  # partition keys per materializations query (an SQL IN list)


def recorded_published(instance: DagsterInstance, key: AssetKey, partition_keys: list[str]) -> dict[str, int]:
    """Of `partition_keys`, those Dagster holds a materialization of, each with the watermark its rows are
    recorded as published up to, by its latest materialization: its end for a committed slice (a run's, a roll-up's,
    one recorded for a run that failed or died later), else what a reset recorded (`rowrelay/published_up_to`).
    For `rowrelay reset` over empty progress (a changed transactional_id_prefix, a lost progress topic), where Kafka
    cannot say which partitions were published: a partition missing here was never materialized."""
    out: dict[str, int] = {}
    for i in range(0, len(partition_keys), RECORDED_KEYS_PER_QUERY):
        wanted = set(partition_keys[i:i + RECORDED_KEYS_PER_QUERY])
        cursor = None
        while wanted:
            page = instance.fetch_materializations(AssetRecordsFilter(asset_key=key, asset_partitions=list(wanted)),
                                                   limit=RECORDED_LOOKBACK, cursor=cursor)
            for record in page.records:  # newest first: a key's first record is its latest
                m = record.asset_materialization
                if m is None or m.partition not in wanted:
                    continue
                wanted.discard(m.partition)
                upto = m.metadata.get(PUBLISHED_UP_TO)
                out[m.partition] = int(upto.value) if upto is not None else SliceRange.from_key(m.partition).hi
            if not page.has_more:
                break
            cursor = page.cursor
    return out
