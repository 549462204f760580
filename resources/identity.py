"""A table's names, in Kafka and in Dagster, built in one place from its config (no Dagster import: the asset layer
builds its AssetKey and partitions definition from the names here).

Every name a table's definitions, sensors, CLI and tests look it up by comes from here, so renaming one is one
edit. The `rowrelay/*` tag and metadata keys live in resources/keys.py, the portable-name and progress-topic rules
in resources/names.py."""

from __future__ import annotations

from dataclasses import dataclass

from resources.config import TableConfig
from resources.exactly_once import TableChannel


def source_resource_key(source: str) -> str:
    """The Dagster resource key of configured source `source`."""
    return f"source_{source}"


@dataclass(frozen=True)
class DagsterNames:
    """A table's names in Dagster; none depends on the transactional-id prefix."""

    asset_path: tuple[str, ...]  # <source>, <schema>, <table>, mapped where Dagster refuses a part
    partitions: str  # its dynamic partitions definition
    pool: str  # the concurrency pool that serializes its runs
    source_resource_key: str
    job: str
    slice_sensor: str
    lag_sensor: str
    parity_hook: str  # the asset's failure hook (slice parity of what a failed run committed)

    @classmethod
    def of(cls, table: TableConfig) -> DagsterNames:
        stem = table.dagster_name
        return cls(asset_path=tuple(table.asset_path), partitions=f"{stem}__slices", pool=f"rowrelay-{stem}",
                   source_resource_key=source_resource_key(table.source), job=f"relay_{stem}",
                   slice_sensor=f"{stem}_slices", lag_sensor=f"{stem}_lag", parity_hook=f"{stem}_parity_after_failure")


@dataclass(frozen=True)
class TableIdentity:
    """A table's names under a deployment's `kafka.transactional_id_prefix`: its channel in Kafka (data topic,
    progress topic, transactional id) and its names in Dagster."""

    table_id: str
    channel: TableChannel
    dagster: DagsterNames

    @classmethod
    def of(cls, table: TableConfig, transactional_id_prefix: str) -> TableIdentity:
        channel = TableChannel.for_table(
            table.table_id, table.topic_name, start_after=table.start_after_watermark or 0,
            topic_partitions=table.topic_partitions, prefix=transactional_id_prefix, keyed=table.key != "none",
            baseline_required=table.start_after == "latest", shared_with=table.topic_shared_with)
        return cls(table_id=table.table_id, channel=channel, dagster=DagsterNames.of(table))

    @property
    def topic(self) -> str:
        return self.channel.topic

    @property
    def progress_topic(self) -> str:
        return self.channel.progress_topic

    @property
    def transactional_id(self) -> str:
        return self.channel.transactional_id
