"""A configured table as the `rowrelay` commands reach it: the Kafka settings, the tables a `--table` names, and
its source opened on a connection of its own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from assets.shape import table_shape
from resources.config import ConfigError, RelayConfig, TableConfig, resolve_env
from resources.source_database import SourceDatabaseResource


def kafka_conf(config: RelayConfig) -> dict[str, Any]:
    conf = {k: resolve_env(str(v)) for k, v in config.kafka.producer.items()}
    conf["bootstrap.servers"] = resolve_env(config.kafka.bootstrap_servers)
    return conf


def select_tables(config: RelayConfig, table_id: str | None) -> list[TableConfig]:
    """The table `table_id` names (all of them for None); a ConfigError names the configured ones."""
    tables = [t for t in config.tables if table_id in (None, t.table_id)]
    if not tables:
        raise ConfigError(f"no configured table {table_id!r}; tables: {[t.table_id for t in config.tables]}")
    return tables


@contextlib.contextmanager
def table_source(config: RelayConfig, table: TableConfig) -> Iterator[tuple[SourceDatabaseResource, Any]]:
    """The table's source and its shape (TableShape), reflected on a connection of its own; disposed on exit. A
    SourceError says why not."""
    source = SourceDatabaseResource.for_source(config.sources[table.source])
    try:
        yield source, table_shape(source, table)
    finally:
        source.dispose()


def reflect_table(config: RelayConfig, table: TableConfig) -> Any:
    """The table's shape (TableShape), reflected on a source connection of its own; a SourceError says why not."""
    with table_source(config, table) as (_, shape):
        return shape
