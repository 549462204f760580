"""Source database resource: cheap metadata queries over SQLAlchemy (reflection, watermarks, safety)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from dagster import ConfigurableResource
from pydantic import PrivateAttr
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import NoSuchTableError

from resources.config import resolve_env
from resources.jdbc import jdbc_options
from resources.slices import WatermarkCandidate

# SQLAlchemy type classes rowrelay serializes exactly (see resources/messages.py).
SUPPORTED_TYPES: tuple[type, ...] = (
    sa.Integer, sa.Numeric, sa.Float, sa.Boolean, sa.String, sa.Text, sa.Enum, sa.DateTime, sa.Date,
    sa.types._Binary, sa.JSON, sa.Uuid,
)


class SourceError(ValueError):
    """A configured table cannot be read as configured; the message says what to change."""


@dataclass(frozen=True)
class ColumnInfo:
    name: str
    type_name: str
    nullable: bool
    is_json: bool
    is_integer: bool


@dataclass(frozen=True)
class TableShape:
    """The reflected columns rowrelay will read, in order, with the watermark among them."""

    dialect: str
    schema: str | None
    name: str
    columns: tuple[ColumnInfo, ...]
    watermark: str

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    @property
    def json_columns(self) -> list[str]:
        return [c.name for c in self.columns if c.is_json]

    def column(self, name: str) -> ColumnInfo:
        return next(c for c in self.columns if c.name == name)


class SourceDatabaseResource(ConfigurableResource):
    """One source database. `url` may hold ${VAR} placeholders (resolved only to connect)."""

    url: str
    _engine: Engine | None = PrivateAttr(default=None)

    # -- connection ---------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = sa.create_engine(self.sqlalchemy_url, pool_pre_ping=True, pool_size=2, max_overflow=2)
        return self._engine

    @property
    def sqlalchemy_url(self) -> sa.URL:
        url = make_url(resolve_env(self.url))
        backend = url.get_backend_name()
        # Default drivers that are installed with rowrelay.
        if backend in ("postgresql", "postgres") and "+" not in url.drivername:
            url = url.set(drivername="postgresql+psycopg")
        elif backend in ("mysql", "mariadb", "singlestoredb") and "+" not in url.drivername:
            url = url.set(drivername="mysql+pymysql")
        return url

    @property
    def dialect(self) -> str:
        name = self.sqlalchemy_url.get_backend_name()
        return {"postgres": "postgresql", "mariadb": "mysql", "singlestoredb": "mysql"}.get(name, name)

    @property
    def safe_description(self) -> str:
        """The URL with any password hidden, for messages and metadata."""
        return make_url(resolve_env(self.url)).render_as_string(hide_password=True)

    def dispose(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    # -- reflection --------------------------------------------------------------------------

    def reflect(self, schema: str | None, table: str) -> sa.Table:
        try:
            return sa.Table(table, sa.MetaData(), schema=schema, autoload_with=self.engine)
        except NoSuchTableError:
            where = f"schema {schema!r} of " if schema else ""
            raise SourceError(f"table {table!r} not found in {where}source {self.safe_description}; "
                              "check `table:` in rowrelay.yaml") from None

    def table_shape(self, schema: str | None, table: str, watermark: str, columns: list[str] | None = None
                    ) -> TableShape:
        t = self.reflect(schema, table)
        label = f"{schema}.{table}" if schema else table
        if watermark not in t.c:
            raise SourceError(f"{label}: watermark column {watermark!r} does not exist (columns: {list(t.c.keys())})")
        wm_type = t.c[watermark].type
        if not isinstance(wm_type, sa.Integer):
            raise SourceError(f"{label}: watermark column {watermark!r} has type {wm_type}, but must be an integer "
                              "column that only grows (e.g. an auto-increment id)")
        wanted = list(columns) if columns else list(t.c.keys())
        missing = [c for c in wanted if c not in t.c]
        if missing:
            raise SourceError(f"{label}: configured columns {missing} do not exist (columns: {list(t.c.keys())})")
        if watermark not in wanted:
            wanted.append(watermark)
        infos = []
        for name in wanted:
            col_type = t.c[name].type
            if not isinstance(col_type, SUPPORTED_TYPES) or isinstance(col_type, sa.ARRAY | sa.Interval):
                raise SourceError(f"{label}: column {name!r} has type {col_type}, which rowrelay cannot serialize "
                                  "exactly; leave it out with `columns:` or cast it in a view")
            infos.append(ColumnInfo(name=name, type_name=str(col_type), nullable=bool(t.c[name].nullable),
                                    is_json=isinstance(col_type, sa.JSON), is_integer=isinstance(col_type, sa.Integer)))
        return TableShape(dialect=self.dialect, schema=schema, name=table, columns=tuple(infos), watermark=watermark)

    def _table(self, shape: TableShape) -> sa.TableClause:
        return sa.table(shape.name, sa.column(shape.watermark), schema=shape.schema)

    # -- watermark queries (each one indexed query) ------------------------------------------------

    def max_watermark(self, shape: TableShape, upto: int | None = None, after: int | None = None) -> int | None:
        t = self._table(shape)
        wm = t.c[shape.watermark]
        q = sa.select(sa.func.max(wm)).select_from(t)
        if upto is not None:
            q = q.where(wm <= upto)
        if after is not None:
            q = q.where(wm > after)
        with self.engine.connect() as conn:
            value = conn.execute(q).scalar()
        return None if value is None else int(value)

    def nth_watermark(self, shape: TableShape, after: int, n: int, upto: int) -> int | None:
        t = self._table(shape)
        wm = t.c[shape.watermark]
        q = sa.select(wm).select_from(t).where(wm > after, wm <= upto).order_by(wm).limit(1).offset(n - 1)
        with self.engine.connect() as conn:
            value = conn.execute(q).scalar()
        return None if value is None else int(value)

    def count_rows(self, shape: TableShape, after: int, upto: int) -> int:
        t = self._table(shape)
        wm = t.c[shape.watermark]
        with self.engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(t).where(wm > after, wm <= upto)).scalar())

    def has_null_watermarks(self, shape: TableShape) -> bool:
        if not shape.column(shape.watermark).nullable:
            return False
        t = self._table(shape)
        with self.engine.connect() as conn:
            return conn.execute(sa.select(sa.literal(1)).select_from(t)
                                .where(t.c[shape.watermark].is_(None)).limit(1)).first() is not None

    # -- safe high watermark ---------------------------------------------------------------------

    def observe(self, shape: TableShape) -> WatermarkCandidate | None:
        """The current max watermark with the marker that tells, later, when it is final."""
        t = self._table(shape)
        wm = t.c[shape.watermark]
        with self.engine.connect() as conn:
            if self.dialect == "postgresql":
                # Same statement, same snapshot: every id <= max is final once all transactions below the
                # snapshot's xmax have ended.
                row = conn.execute(sa.select(sa.func.max(wm), sa.text("pg_snapshot_xmax(pg_current_snapshot())::text"))
                                   .select_from(t)).one()
            elif self.dialect == "mysql":
                row = conn.execute(sa.select(sa.func.max(wm), sa.text("UNIX_TIMESTAMP(NOW(6))")).select_from(t)).one()
            else:
                row = (conn.execute(sa.select(sa.func.max(wm)).select_from(t)).scalar(), time.time())
        if row[0] is None:
            return None
        return WatermarkCandidate(int(row[0]), float(row[1]))

    def is_final(self, candidate: WatermarkCandidate, settle_seconds: float) -> bool:
        with self.engine.connect() as conn:
            if self.dialect == "postgresql":
                xmin = int(conn.execute(sa.text("SELECT pg_snapshot_xmin(pg_current_snapshot())::text")).scalar())
                return xmin >= candidate.marker
            if self.dialect == "mysql":
                now = float(conn.execute(sa.text("SELECT UNIX_TIMESTAMP(NOW(6))")).scalar())
                if now - candidate.marker < settle_seconds:
                    return False
                # A transaction open when the max was seen may still commit a lower auto-increment id.
                # trx_started has whole seconds: compare one second late to stay on the safe side.
                try:
                    open_before = conn.execute(sa.text(
                        "SELECT COUNT(*) FROM information_schema.innodb_trx "
                        "WHERE trx_started <= FROM_UNIXTIME(:t) AND trx_mysql_thread_id <> CONNECTION_ID()"),
                        {"t": candidate.marker + 1}).scalar()
                except sa.exc.DBAPIError:
                    return True  # no PROCESS privilege: the settle delay alone decides
                return int(open_before) == 0
            return time.time() - candidate.marker >= settle_seconds

    def jdbc_options(self) -> dict[str, Any]:
        """What Spark's JDBC source needs to read this database (see resources/jdbc.py)."""
        return jdbc_options(self.sqlalchemy_url, self.dialect)
