"""Dagster's PostgreSQL storage with one small connection pool per process.

dagster-postgres gives its storages a NullPool outside the webserver: every storage call opens a new connection
(a TCP connect, a backend fork and a SCRAM-SHA-256 handshake: ~10 ms of CPU between client and server on a
2-core host). A run worker writes some 50 events, and the daemon and code server poll every second, so a
deployment would open many connections a second and a run would spend a good part of its start connecting.
`PooledPostgresStorage` is the same storage (same tables, same config keys as `storage: postgres:`) with one
pooled engine shared by its run, event log and schedule storages:

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
- One engine per database per process, not per instance: Dagster builds a new instance from its ref for every sensor
  evaluation in the code server, and each one would otherwise open connections of its own (three table checks on
  dagster-postgres's NullPool engines, then a pool of its own; tests/test_storage_pool.py counts them). A
  process keeps at most `POOL_SIZE` idle connections per database; bursts above it open short-lived ones. Disposing
  of an instance leaves the process's pool as it is.
- dagster-postgres's table checks at start (`get_table_names`, once per storage) run only when one catalog query on
  the pool finds a main table missing; then they run as Dagster wrote them, creating what is missing.
- The schedule storage asks the catalog whether its optional tables exist on nearly every call (the daemon makes
  such calls on every sensor tick); a yes is kept for the storage's life (Dagster never drops them).
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from dagster._serdes import ConfigurableClassData
from dagster_postgres import DagsterPostgresStorage
from dagster_postgres.event_log import PostgresEventLogStorage
from dagster_postgres.run_storage import PostgresRunStorage
from dagster_postgres.schedule_storage import PostgresScheduleStorage
from dagster_postgres.utils import (
    create_pg_engine,
    get_token_provider_from_config,
    pg_url_from_config,
    retry_pg_connection_fn,
)
from sqlalchemy import inspect
from sqlalchemy.engine import Connection, Engine

# As many idle connections as the daemon's sensor threads (dagster.yaml: sensors.num_workers) and the code server
# evaluating their sensors use at once; with fewer, every tick's burst opens connections above the pool and closes
# them again. A pool only grows to what its process uses at once: a run
# worker's stays at one or two.
POOL_SIZE = 8
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


_PROCESS_ENGINES: dict[str, Engine] = {}
_PROCESS_ENGINES_LOCK = threading.Lock()


def process_engine(postgres_url: str) -> Engine:
    """This process's pooled engine for `postgres_url`, shared by every instance the process builds."""
    with _PROCESS_ENGINES_LOCK:
        engine = _PROCESS_ENGINES.get(postgres_url)
        if engine is None:
            engine = _PROCESS_ENGINES[postgres_url] = pooled_engine(postgres_url)
        return engine


# A table each dagster-postgres storage looks for at start, creating its schema when it is missing: runs (and
# instance_info, made on its own when missing), event_logs, jobs (or the older schedules).
MAIN_TABLES = frozenset({"runs", "instance_info", "event_logs", "jobs"})


def has_main_tables(engine: Engine) -> bool:
    def ask() -> bool:
        with engine.connect() as conn:
            return MAIN_TABLES.issubset(inspect(conn).get_table_names())

    return retry_pg_connection_fn(ask)  # as dagster-postgres's own checks: a database restarting is waited for


class _PooledEngine:
    """Mixin for a dagster-postgres storage: use a given engine (closed on dispose only if it is the storage's own).

    `_engine` is dagster-postgres's private attribute for the engine every call connects through; it has no
    public way to pass one in (only `optimize_for_webserver`, which has no pre-ping), so this is the one place
    that sets it."""

    _engine: Engine
    _owns_engine: bool = False

    def use_engine(self, engine: Engine, owned: bool) -> None:
        """`owned`: the engine is this instance's alone (not the process's), closed with it."""
        self._engine, self._owns_engine = engine, owned

    def dispose(self) -> None:
        super().dispose()  # type: ignore[misc]
        if self._owns_engine:
            self._engine.dispose()


class PooledRunStorage(_PooledEngine, PostgresRunStorage):
    pass


class PooledEventLogStorage(_PooledEngine, PostgresEventLogStorage):
    pass


class PooledScheduleStorage(_PooledEngine, PostgresScheduleStorage):
    """Remembers that an optional table exists (see the module docstring). The methods overridden here are how
    Dagster's SqlScheduleStorage asks, two of them private; each falls back to asking when the answer was no."""

    def _remembered(self, what: str, ask: Callable[[], bool]) -> bool:
        seen: set[str] = self.__dict__.setdefault("_rowrelay_present", set())
        if what in seen:
            return True
        present = ask()
        if present:
            seen.add(what)
        return present

    def has_instigators_table(self) -> bool:
        return self._remembered("instigators", super().has_instigators_table)

    def _has_instigators_table(self, conn: Connection) -> bool:
        return self._remembered("instigators", functools.partial(super()._has_instigators_table, conn))

    def _has_asset_daemon_asset_evaluations_table(self, conn: Connection) -> bool:
        return self._remembered("asset_daemon_asset_evaluations",
                                functools.partial(super()._has_asset_daemon_asset_evaluations_table, conn))

    def has_secondary_index_table(self) -> bool:
        return self._remembered("secondary_indexes", super().has_secondary_index_table)

    def has_built_index(self, migration_name: str) -> bool:  # a built index migration is never unbuilt
        return self._remembered(f"index {migration_name}", functools.partial(super().has_built_index, migration_name))


class PooledPostgresStorage(DagsterPostgresStorage):
    """`DagsterPostgresStorage` whose three storages share one pooled engine (see the module docstring)."""

    def __init__(self, postgres_url: str, should_autocreate_tables: bool = True,
                 inst_data: ConfigurableClassData | None = None, token_provider: Any = None) -> None:
        # DagsterPostgresStorage.__init__ names its storage classes; this is the same body with ours.
        self.postgres_url = postgres_url
        self.should_autocreate_tables = should_autocreate_tables
        self._inst_data = inst_data
        # With a token provider (IAM auth) the engine is the instance's own: its tokens are this config's.
        owned = token_provider is not None
        engine = pooled_engine(postgres_url, token_provider) if owned else process_engine(postgres_url)
        # dagster-postgres's own checks (and table creation) only when a main table is missing.
        check = should_autocreate_tables and not has_main_tables(engine)
        self._run_storage = PooledRunStorage(postgres_url, check, token_provider=token_provider)
        self._event_log_storage = PooledEventLogStorage(postgres_url, check, token_provider=token_provider)
        self._schedule_storage = PooledScheduleStorage(postgres_url, check, token_provider=token_provider)
        for storage in (self._run_storage, self._event_log_storage, self._schedule_storage):
            storage.use_engine(engine, owned)
        super(DagsterPostgresStorage, self).__init__()  # what DagsterPostgresStorage.__init__ ends with

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData | None,  # type: ignore[override]
                          config_value: Mapping[str, Any]) -> PooledPostgresStorage:
        return cls(inst_data=inst_data, postgres_url=pg_url_from_config(config_value),
                   should_autocreate_tables=config_value.get("should_autocreate_tables", True),
                   token_provider=get_token_provider_from_config(config_value))
