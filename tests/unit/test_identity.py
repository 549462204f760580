"""A table's names, built once from its config: the same names the asset, its jobs and sensors are defined under."""

from __future__ import annotations

import pytest

from assets.identity import asset_key, channel_for, partitions_for, pool_name
from orchestration.factory import job_name, lag_sensor_name
from resources.config import RelayConfig, parse_config
from resources.identity import DagsterNames, TableIdentity, source_resource_key


def config(table: str, **settings: object) -> RelayConfig:
    return parse_config({"sources": {"shop": {"url": "postgresql://u@h/db"}},
                         "tables": [{"source": "shop", "table": table, "watermark": "id", **settings}],
                         "kafka": {"bootstrap_servers": "k:9092"}})


def test_identity_names_a_table_in_kafka_and_dagster() -> None:
    table = config("public.orders").tables[0]
    identity = TableIdentity.of(table, "deploy")
    assert identity.table_id == "shop.public.orders"
    assert identity.topic == "shop.public.orders"
    assert identity.progress_topic == "_deploy.progress.shop.public.orders"
    assert identity.transactional_id == "deploy.shop.public.orders"
    assert identity.dagster == DagsterNames(
        asset_path=("shop", "public", "orders"), partitions="shop_public_orders__slices",
        pool="rowrelay-shop_public_orders", source_resource_key="source_shop", job="relay_shop_public_orders",
        slice_sensor="shop_public_orders_slices", lag_sensor="shop_public_orders_lag",
        parity_hook="shop_public_orders_parity_after_failure")


@pytest.mark.parametrize("name", ["public.orders", "public.\"order lines\"", "public.bestellungen_ä"])
def test_the_asset_layer_and_orchestration_use_the_identity_names(name: str) -> None:
    table = config(name).tables[0]
    names = DagsterNames.of(table)
    assert list(asset_key(table).path) == list(names.asset_path)
    assert partitions_for(table).name == names.partitions
    assert pool_name(table) == names.pool
    assert source_resource_key(table.source) == names.source_resource_key
    assert job_name(table) == names.job
    assert lag_sensor_name(table) == names.lag_sensor


def test_the_channel_carries_the_tables_settings() -> None:
    table = config("public.orders", topic="orders", topic_partitions=3, key="none", start_after=41).tables[0]
    channel = channel_for(table, "p")
    assert channel == TableIdentity.of(table, "p").channel
    assert (channel.topic, channel.topic_partitions, channel.keyed, channel.start_after) == ("orders", 3, False, 41)
    assert not channel.baseline_required
    assert TableIdentity.of(config("public.orders", start_after="latest").tables[0], "p").channel.baseline_required
