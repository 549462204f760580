"""A table's shape (reflected columns and settings) for a run: taken, held to the committed columns, and taken
again around each slice's read."""

from dataclasses import dataclass

from resources.config import TableConfig
from resources.slices import SliceRange
from resources.source_database import SchemaChanged, SchemaRaced, SourceDatabaseResource, TableShape, schema_change


def table_shape(source: SourceDatabaseResource, table: TableConfig) -> TableShape:
    return source.table_shape(table.schema_name, table.table_name, table.watermark, table.columns, table.where,
                              table.tie_break, table.key if isinstance(table.key, list) else None)


def check_schema(table: TableConfig, shape: TableShape, committed_columns: list[list[str]]) -> str:
    """The change of columns since the last committed slice, described ("" if none, or nothing to compare with:
    a first slice, a record from an older version). With `on_schema_change: fail` a change stops the table."""
    if not committed_columns:
        return ""
    change = schema_change(committed_columns, shape.schema_columns)
    if change and table.on_schema_change == "fail":
        raise SchemaChanged(
            f"{table.table_id}: columns changed since the last committed slice ({change.describe()}) and "
            "on_schema_change is fail: nothing is published until a human accepts the new columns with "
            f"`rowrelay schema accept --table {table.table_id} --reason ...` (see docs/operations.md)")
    return change.describe() if change else ""


@dataclass(frozen=True)
class SliceShapes:
    """The table's shape for each slice of a run: taken from the catalog right before the slice's read (a column
    added, dropped, retyped or moved during a run applies from the next slice read), and taken again after each of
    its chunks is read, which must find it unchanged. A DDL waits for the reads of the table before it (PostgreSQL's
    ACCESS EXCLUSIVE lock, MariaDB's metadata lock), so equal shapes on both sides prove every statement of the read
    ran on that shape. Spark's JDBC reads use connections of their own: the catalog cannot be asked in their
    snapshot, hence the check on both sides."""

    source: SourceDatabaseResource
    table: TableConfig
    # What `on_schema_change: fail` holds each slice to: the last committed slice's columns (on a table's first
    # run, the columns it started with).
    accepted: list[list[str]]

    def before_read(self) -> TableShape:
        """The shape to read the next slice with (on_schema_change applied: `fail` raises SchemaChanged)."""
        shape = table_shape(self.source, self.table)
        check_schema(self.table, shape, self.accepted)
        return shape

    def after_read(self, shape: TableShape, slice_range: SliceRange) -> None:
        """Raise SchemaRaced where the table's columns are no longer `shape`'s (a DDL landed during the read)."""
        now = table_shape(self.source, self.table)
        if now.columns != shape.columns:
            change = schema_change(shape.schema_columns, now.schema_columns).describe() or "column details changed"
            raise SchemaRaced(f"{self.table.table_id}: the table's columns changed while slice {slice_range} was "
                              f"read ({change}): nothing of it is published from that read")
