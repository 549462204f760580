"""The source database: cheap metadata queries over SQLAlchemy (reflection, watermarks, safety).

A package of small modules: `source` (the dialect-neutral source), `dialect` (the hooks each database fills) with
`postgresql`, `mariadb` and `sqlite` (one strategy each), `shape` (TableShape, schema changes), `rendering` (the
select list of a slice's read), `errors`, `cache` (KeptAnswers) and `resource` (the Dagster resource). The names
other modules use are exported here."""

from __future__ import annotations

from resources.source_database.cache import SETTLED_ANSWERS, KeptAnswers
from resources.source_database.errors import (
    InnodbTrxStale,
    SchemaChanged,
    SchemaRaced,
    SourceError,
    invalid_datetime_message,
    null_watermark_error,
)
from resources.source_database.postgresql import DURABLE_TARGETS, pg_lsn, wal_flushed_to
from resources.source_database.rendering import exceeds_spark_decimal, read_as_text, source_rendering
from resources.source_database.resource import SourceDatabaseResource
from resources.source_database.shape import (
    FRAME_WATERMARK,
    INTERNAL_PREFIX,
    MAX_MICROS,
    MAX_WATERMARK,
    MIN_MICROS,
    ColumnInfo,
    SchemaChange,
    TableShape,
    below_step_in_reach,
    schema_change,
    schema_fingerprint,
    skipped_rows_predicate,
)
from resources.source_database.source import SUPPORTED_TYPES, SourceDatabase
from resources.source_database.sqlite import sqlite_affinity

__all__ = [
    "DURABLE_TARGETS", "FRAME_WATERMARK", "INTERNAL_PREFIX", "MAX_MICROS", "MAX_WATERMARK", "MIN_MICROS",
    "SETTLED_ANSWERS", "SUPPORTED_TYPES", "ColumnInfo", "InnodbTrxStale", "KeptAnswers", "SchemaChange",
    "SchemaChanged", "SchemaRaced", "SourceDatabase", "SourceDatabaseResource", "SourceError", "TableShape",
    "below_step_in_reach", "exceeds_spark_decimal", "invalid_datetime_message", "null_watermark_error",
    "pg_lsn", "read_as_text", "schema_change", "schema_fingerprint", "skipped_rows_predicate", "source_rendering",
    "sqlite_affinity", "wal_flushed_to",
]
