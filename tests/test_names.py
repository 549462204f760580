"""Dagster and Kafka names of a table: unchanged where they were valid, mapped (never shared) where a schema or table
name holds a character they refuse (a space, non-ASCII), the true name kept wherever users see it."""

from __future__ import annotations

import re
from typing import Any

import pytest
from dagster import AssetKey
from sqlalchemy import text

from assets.identity import asset_key, partitions_for, pool_name
from orchestration.factory import build_definitions, job_name, lag_sensor_name
from resources.config import ConfigError, RelayConfig, parse_config
from tests.pipeline import Harness, assert_exactly_once, read_topic, relay_config

VALID_NAME = re.compile(r"[A-Za-z0-9_]+")  # dagster._core.definitions.utils.VALID_NAME_REGEX


def config(*tables: str, sources: tuple[str, ...] = ("shop",)) -> RelayConfig:
    """`tables` as "<source>:<[schema.]table>" or "<[schema.]table>" of the first source."""
    rows: list[dict[str, Any]] = []
    for t in tables:
        source, table = t.split(":", 1) if ":" in t else (sources[0], t)
        rows.append({"source": source, "table": table, "watermark": "id"})
    return parse_config({"sources": {s: {"url": "postgresql://u@h/db"} for s in sources}, "tables": rows,
                         "kafka": {"bootstrap_servers": "k:9092"}})


def dagster_names(cfg: RelayConfig) -> set[str]:
    """Every job, sensor and op name of the config's definitions (the implicit asset job's ops included)."""
    defs = build_definitions(cfg)
    jobs = defs.resolve_all_job_defs()  # builds the implicit asset job too: where an op name was refused
    names = {j.name for j in jobs} | {s.name for s in defs.sensors or []}
    return names | {node.name for j in jobs for node in j.nodes}


@pytest.mark.parametrize(("table", "key", "stem"), [
    ("public.orders", ["shop", "public", "orders"], "shop_public_orders"),
    ("orders", ["shop", "default", "orders"], "shop_default_orders"),
    ("my-schema.t-1", ["shop", "my-schema", "t-1"], "shop_my_schema_t_1"),
    ("Sales.OrderItems_2", ["shop", "Sales", "OrderItems_2"], "shop_Sales_OrderItems_2"),
])
def test_names_valid_before_stay_exactly_as_they_were(table: str, key: list[str], stem: str) -> None:
    t = config(table).tables[0]
    # What existing deployments have in their Dagster storage and Kafka: asset keys, partitions, runs, cursors.
    assert asset_key(t) == AssetKey(key)
    assert t.dagster_name == stem
    assert (job_name(t), lag_sensor_name(t), partitions_for(t).name, pool_name(t)) == (
        f"relay_{stem}", f"{stem}_lag", f"{stem}__slices", f"rowrelay-{stem}")
    assert t.topic_name == t.table_id == ".".join(key)


@pytest.mark.parametrize(("table", "schema_part", "table_part"), [
    ("public.Order Items", "public", "Order_Items_"),
    ("sales data.Order Items", "sales_data_", "Order_Items_"),
    ("public.Bestellungen_ü", "public", "Bestellungen___"),
    ("public.a$b", "public", "a_b_"),
    ("Étude.x", "_tude_", "x"),
])
def test_refused_characters_are_mapped_and_the_true_name_kept(table: str, schema_part: str, table_part: str) -> None:
    cfg = config(table, "public.orders")
    t = cfg.tables[0]
    source, schema, name = asset_key(t).path
    assert source == "shop"
    for part, expected in ((schema, schema_part), (name, table_part)):
        # Unchanged if valid; else the refused characters as "_" and 8 hex digits of the true name's hash.
        assert part == expected or re.fullmatch(re.escape(expected) + "[0-9a-f]{8}", part), (part, expected)
    assert VALID_NAME.fullmatch(t.dagster_name) and re.fullmatch(r"[A-Za-z0-9._-]+", t.topic_name)
    assert t.table_id == f"shop.{table}"  # the CLI's --table, the transactional id, progress records
    names = dagster_names(cfg)  # raised DagsterInvalidDefinitionError for every table of the config
    assert all(VALID_NAME.fullmatch(n) for n in names), names
    assert {job_name(t), f"{t.dagster_name}_slices", lag_sensor_name(t), "relay_shop_public_orders"} <= names
    spec = next(s for s in build_definitions(cfg).resolve_all_asset_specs() if s.key == asset_key(t))
    assert t.table in (spec.description or "")
    assert spec.metadata["rowrelay/table"] == t.table_id


def test_names_that_differ_only_in_refused_characters_stay_apart() -> None:
    tables = ["public.a b", "public.a_b", "public.a?b", "public.a ü", "public.a ö", "a b.t", "a_b.t"]
    cfg = config(*tables)
    for attr in ("dagster_name", "topic_name"):
        assert len({getattr(t, attr) for t in cfg.tables}) == len(tables), attr
    assert len({asset_key(t) for t in cfg.tables}) == len(tables)
    assert cfg.tables[1].dagster_name == "shop_public_a_b"  # the valid one keeps its name
    dagster_names(cfg)  # no duplicate definition


@pytest.mark.parametrize(("tables", "sources", "first", "second"), [
    # "-" was always made "_" in job and sensor names: these two never loaded together.
    (["public.a-b", "public.a_b"], ("s",), "s.public.a-b", "s.public.a_b"),
    (["a_b:c.d", "a:b_c.d"], ("a_b", "a"), "a_b.c.d", "a.b_c.d"),
    # Asset op names join the key's parts with "__".
    (["a:b__c.d", "a__b:c.d"], ("a", "a__b"), "a.b__c.d", "a__b.c.d"),
])
def test_tables_sharing_a_dagster_name_are_refused_naming_both(tables: list[str], sources: tuple[str, ...],
                                                                first: str, second: str) -> None:
    with pytest.raises(ConfigError) as err:
        config(*tables, sources=sources)
    assert f"tables[0] ('{first}') and tables[1] ('{second}') map to one Dagster" in str(err.value)
    assert "another source name" in str(err.value)


def test_source_name_must_be_a_dagster_name() -> None:
    # A source is its tables' Dagster asset group: Dagster refused "my-src" for every table of the config.
    with pytest.raises(ConfigError, match=r"source name\(s\) \['my-src'\] may hold only letters, digits and _"):
        config("public.t", sources=("my-src",))


def test_portable_name() -> None:
    from resources.names import portable_name

    assert portable_name("shop.public.orders-2") == "shop.public.orders-2"
    assert re.fullmatch(r"Order_Items_[0-9a-f]{8}", portable_name("Order Items"))
    assert portable_name("Order Items") == portable_name("Order Items")  # stable across processes: no salted hash()
    assert portable_name("a b") != portable_name("a?b")


@pytest.mark.integration
def test_table_with_spaces_in_schema_and_name_relays_exactly_once(services, pg_database, pg_engine,
                                                                   dagster_instance, spark, name) -> None:
    with pg_engine.begin() as conn:
        conn.execute(text('CREATE SCHEMA "sales data"'))
        conn.execute(text('CREATE TABLE "sales data"."Order Items" (id bigserial PRIMARY KEY, label text)'))
        conn.execute(text("CREATE TABLE plain (id bigserial PRIMARY KEY, label text)"))
    tables = ('"sales data"."Order Items"', "plain")

    def insert(rows: int) -> None:
        with pg_engine.begin() as conn:
            for t in tables:
                conn.execute(text(f"INSERT INTO {t} (label) SELECT 'r' || g FROM generate_series(1, {rows}) g"))

    insert(5)
    # The source's name makes the Kafka topics unique to this test; the spaced table's topic is its default.
    cfg = relay_config(services, {name: pg_database}, [
        {"source": name, "table": "sales data.Order Items", "watermark": "id", "slice_max_rows": 2},
        {"source": name, "table": "public.plain", "watermark": "id", "slice_max_rows": 2, "topic": f"{name}.plain"}])
    h = Harness(cfg, dagster_instance)  # raised DagsterInvalidDefinitionError, for the plain table too
    spaced, plain = h.table(0), h.table(1)
    assert spaced.table_id == f"{name}.sales data.Order Items"
    assert asset_key(plain) == AssetKey([name, "public", "plain"])
    for t in (spaced, plain):
        h.drain(t)
    insert(3)
    for t in (spaced, plain):
        h.drain(t)
        assert_exactly_once(read_topic(services.kafka_bootstrap, t.topic_name), list(range(1, 9)))
    # In Dagster under the mapped key, with the true name in its description and metadata.
    key = asset_key(spaced)
    assert [p for p in key.path if " " in p] == []
    records = dagster_instance.fetch_materializations(key, limit=100).records
    assert records and all(r.asset_materialization.partition for r in records)
    spec = next(s for s in h.defs.resolve_all_asset_specs() if s.key == key)
    assert "sales data.Order Items" in (spec.description or "")
    assert spec.metadata["rowrelay/table"] == spaced.table_id
