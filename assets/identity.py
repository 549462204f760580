"""A table's names as Dagster objects, from resources/identity.py (where the naming rules live)."""

from dagster import AssetKey, DynamicPartitionsDefinition

from resources.config import TableConfig
from resources.exactly_once import TableChannel
from resources.identity import DagsterNames, TableIdentity


def pool_name(table: TableConfig) -> str:
    return DagsterNames.of(table).pool


def asset_key(table: TableConfig) -> AssetKey:
    # <source>/<schema>/<table>, a part Dagster refuses (a space, non-ASCII) mapped: see TableConfig.asset_path.
    return AssetKey(list(DagsterNames.of(table).asset_path))


def partitions_for(table: TableConfig) -> DynamicPartitionsDefinition:
    return DynamicPartitionsDefinition(name=DagsterNames.of(table).partitions)


def channel_for(table: TableConfig, transactional_id_prefix: str) -> TableChannel:
    return TableIdentity.of(table, transactional_id_prefix).channel
