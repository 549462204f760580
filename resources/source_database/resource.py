"""The source database as a Dagster resource: `SourceDatabase` (resources/source_database/source.py) with its
configuration (`url`, `tables_written_here`) as Dagster's."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import PrivateAttr
from sqlalchemy.engine import Engine

from resources.config import SourceConfig
from resources.source_database.source import SourceDatabase


class SourceDatabaseResource(ConfigurableResource, SourceDatabase):
    """One source database. `url` may hold ${VAR} placeholders (resolved only to connect)."""

    url: str
    # A MariaDB server whose replication runs is refused (`refuse_unknowable_finality`) unless the user says the
    # relayed tables are written on it, not by replication (a local table on a server replicating others).
    tables_written_here: bool = False
    _engine: Engine | None = PrivateAttr(default=None)

    @classmethod
    def for_source(cls, source: SourceConfig) -> SourceDatabaseResource:
        return cls(url=source.url, tables_written_here=source.tables_written_here)
