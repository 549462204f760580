"""Dagster's PostgreSQL storage with one small connection pool per process.

dagster-postgres gives its storages a NullPool outside the webserver: every storage call opens a new connection
(a TCP connect, a backend fork and a SCRAM-SHA-256 handshake: ~10 ms of CPU between client and server on a
2-core host). A run worker writes some 50 events, and the daemon and code server poll every second, so a
rowrelay deployment opened ~20 connections a second (1,569 in 80 s of two tests here) and a run spent about
half a second connecting. `PooledPostgresStorage` is the same storage (same tables, same config keys as
`storage: postgres:`) with one pooled engine shared by its run, event log and schedule storages:

    storage:
      custom:
        module: orchestration.storage
        class: PooledPostgresStorage
        config:
          postgres_db: {username: ..., password: ..., hostname: ..., db_name: ..., port: ...}

- `pool_pre_ping`: a connection that died with the server (a restart, a failover) is replaced at checkout
  instead of failing the call that drew it.
- Fork safety: a forked child drops the connections it inherited without closing them (they belong to the
  parent), the pattern SQLAlchemy documents for multiprocessing.
- A process keeps at most `POOL_SIZE` idle connections per instance; bursts above it open short-lived ones.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from typing import Any

from dagster._serdes import ConfigurableClassData
from dagster_postgres import DagsterPostgresStorage
from dagster_postgres.event_log import PostgresEventLogStorage
from dagster_postgres.run_storage import PostgresRunStorage
from dagster_postgres.schedule_storage import PostgresScheduleStorage
from dagster_postgres.utils import create_pg_engine, get_token_provider_from_config, pg_url_from_config
from sqlalchemy.engine import Engine

POOL_SIZE = 2  # the daemon's threads and a worker's event writes rarely need more at once
MAX_OVERFLOW = 16
POOL_RECYCLE_S = 3600

_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


def _forget_inherited_connections() -> None:
    for engine in list(_ENGINES):
        engine.dispose(close=False)


os.register_at_fork(after_in_child=_forget_inherited_connections)


def pooled_engine(postgres_url: str, token_provider: Any = None) -> Engine:
    engine = create_pg_engine(postgres_url, token_provider, isolation_level="AUTOCOMMIT", pool_size=POOL_SIZE,
                              max_overflow=MAX_OVERFLOW, pool_recycle=POOL_RECYCLE_S, pool_pre_ping=True)
    _ENGINES.add(engine)
    return engine


class _PooledEngine:
    """Mixin for a dagster-postgres storage: use a given engine, and close its connections on dispose.

    `_engine` is dagster-postgres's private attribute for the engine every call connects through; it has no
    public way to pass one in (only `optimize_for_webserver`, which has no pre-ping), so this is the one place
    that sets it."""

    _engine: Engine

    def use_engine(self, engine: Engine) -> None:
        self._engine = engine

    def dispose(self) -> None:
        super().dispose()  # type: ignore[misc]
        self._engine.dispose()


class PooledRunStorage(_PooledEngine, PostgresRunStorage):
    pass


class PooledEventLogStorage(_PooledEngine, PostgresEventLogStorage):
    pass


class PooledScheduleStorage(_PooledEngine, PostgresScheduleStorage):
    pass


class PooledPostgresStorage(DagsterPostgresStorage):
    """`DagsterPostgresStorage` whose three storages share one pooled engine (see the module docstring)."""

    def __init__(self, postgres_url: str, should_autocreate_tables: bool = True,
                 inst_data: ConfigurableClassData | None = None, token_provider: Any = None) -> None:
        # DagsterPostgresStorage.__init__ names its storage classes; this is the same body with ours.
        self.postgres_url = postgres_url
        self.should_autocreate_tables = should_autocreate_tables
        self._inst_data = inst_data
        self._run_storage = PooledRunStorage(postgres_url, should_autocreate_tables, token_provider=token_provider)
        self._event_log_storage = PooledEventLogStorage(postgres_url, should_autocreate_tables,
                                                        token_provider=token_provider)
        self._schedule_storage = PooledScheduleStorage(postgres_url, should_autocreate_tables,
                                                       token_provider=token_provider)
        engine = pooled_engine(postgres_url, token_provider)
        for storage in (self._run_storage, self._event_log_storage, self._schedule_storage):
            storage.use_engine(engine)
        super(DagsterPostgresStorage, self).__init__()  # what DagsterPostgresStorage.__init__ ends with

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData | None,  # type: ignore[override]
                          config_value: Mapping[str, Any]) -> PooledPostgresStorage:
        return cls(inst_data=inst_data, postgres_url=pg_url_from_config(config_value),
                   should_autocreate_tables=config_value.get("should_autocreate_tables", True),
                   token_provider=get_token_provider_from_config(config_value))
