"""The source database, dialect-neutral: connections, reflection into a `TableShape`, the watermark queries, and the
safe high watermark's skeleton (`observe`, `is_final`) around the hooks of the database's `Dialect`
(resources/source_database/postgresql.py, mariadb.py, sqlite.py). Imports no Dagster: `SourceDatabaseResource`
(resources/source_database/resource.py) is this with Dagster's configuration."""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import NoSuchTableError

from resources.config import ConfigError, env_names, resolve_url_env
from resources.jdbc import UrlParameterError, jdbc_options
from resources.slices import RowSkip, WatermarkCandidate, datetime_to_micros
from resources.source_database.cache import SETTLED_ANSWERS
from resources.source_database.dialect import Dialect, WatermarkKind
from resources.source_database.errors import SourceError
from resources.source_database.mariadb import MariaDB
from resources.source_database.postgresql import PostgreSQL
from resources.source_database.shape import (
    INTERNAL_PREFIX,
    MAX_WATERMARK,
    ColumnInfo,
    TableShape,
    below_step_in_reach,
    filtered,
    skip_sql,
    skipped_rows_predicate,
    table_clause,
)
from resources.source_database.sqlite import SQLite, first_misfit

# SQLAlchemy type classes rowrelay serializes exactly (see resources/messages.py).
SUPPORTED_TYPES: tuple[type, ...] = (
    sa.Integer, sa.Numeric, sa.Float, sa.Boolean, sa.String, sa.Text, sa.Enum, sa.DateTime, sa.Date,
    sa.types._Binary, sa.JSON, sa.Uuid,
)

# Each database's strategy, by dialect name; any other database gets the base `Dialect`.
DIALECTS: dict[str, Dialect] = {"postgresql": PostgreSQL("postgresql"), "mysql": MariaDB("mysql"),
                                "sqlite": SQLite("sqlite")}

# A type the dialect does not know is reflected as NullType with this warning; `table_shape` refuses such a column
# by its database type name, so the warning is noise. Installed once, here: warnings.catch_warnings() around each
# reflection is not thread-safe (the daemon's sensor threads reflect at once).
warnings.filterwarnings("ignore", message="Did not recognize type", category=sa.exc.SAWarning)

_log = logging.getLogger(__name__)

_Answer = TypeVar("_Answer")

# Query parameters of a source URL whose values are not shown (`safe_description`): libpq's sslpassword, tokens,
# keys (a key's file name is hidden too, harmlessly).
_SECRET_PARAMETER = re.compile(r"pass|secret|token|key|credential", re.IGNORECASE)


def parse_source_url(template: str) -> sa.URL:
    """A source's URL, ${VAR}s resolved each in its part (`resolve_url_env`). A URL that does not parse fails
    naming what to check, never with its text: it may hold a password."""
    try:
        return make_url(resolve_url_env(template))
    except (ValueError, sa.exc.ArgumentError) as exc:
        if isinstance(exc, ConfigError):
            raise
        variables = ", ".join(f"${{{name}}}" for name in env_names(template)) or "none"
        raise SourceError(f"a source url is not a valid database URL ({type(exc).__name__}; its variables: "
                          f"{variables}): check its host, port and database. A password or parameter value given "
                          "through ${VAR} is taken literally and needs no escaping") from None


class SourceDatabase:
    """One source database. `url` may hold ${VAR} placeholders (resolved only to connect). The attributes come from
    the class that holds the configuration (`SourceDatabaseResource`)."""

    url: str
    # A MariaDB server whose replication runs is refused (`refuse_unknowable_finality`) unless the user says the
    # relayed tables are written on it, not by replication (a local table on a server replicating others).
    tables_written_here: bool
    _engine: Engine | None

    # -- connection ---------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            # The code server evaluates up to eight sensors at once (the daemon's sensor threads), on one source
            # resource per URL: a smaller pool opened and closed connections above it on every burst of ticks.
            self._engine = sa.create_engine(self.sqlalchemy_url, pool_pre_ping=True, pool_size=8, max_overflow=2)
            sa.event.listen(self._engine, "handle_error", self._mark_error)
        return self._engine

    def _mark_error(self, context: sa.engine.ExceptionContext) -> None:
        """Mark the error with the URL as configured (`source_url`): a refused login named neither the source nor
        the variable its password comes from. The error itself is unchanged: callers tell transient ones apart."""
        if context.sqlalchemy_exception is not None:
            context.sqlalchemy_exception.source_url = self.url  # type: ignore[attr-defined]

    @property
    def sqlalchemy_url(self) -> sa.URL:
        url = parse_source_url(self.url)
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
    def strategy(self) -> Dialect:
        """The database's hooks (`DIALECTS`)."""
        return DIALECTS.get(self.dialect) or Dialect(self.dialect)

    @property
    def safe_description(self) -> str:
        """The URL with its password, and any query parameter that may hold a secret (`sslpassword`, a token, a
        key), hidden: for messages and metadata."""
        url = parse_source_url(self.url)
        hidden = {key: "***" for key in url.query if _SECRET_PARAMETER.search(key)}
        return url.update_query_dict(hidden).render_as_string(hide_password=True).replace("%2A%2A%2A", "***")

    def _asked(self, shape: TableShape, question: tuple[Any, ...], ask: Callable[[], _Answer], settled: bool
               ) -> _Answer:
        """`ask()`, or where `settled` the answer SETTLED_ANSWERS kept for the same question about the same rows:
        the database connected to (its URL, ${VAR}s resolved), the table, its watermark and its `where:`."""
        if not settled:
            return ask()
        scope = (self.engine.url.render_as_string(hide_password=False), shape.schema, shape.name, shape.watermark,
                 shape.where)
        return SETTLED_ANSWERS.answer((*scope, *question), ask)

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

    def declared_type(self, t: sa.Table, column: str) -> str:
        """The column's type as the database names it, for a refusal's message: SQLAlchemy names a type its dialect
        does not know (PostgreSQL's xml or point, a column SQLite declared without a type) "NULL", any array
        "ARRAY"; the catalog has the real one ("integer[]"; "" for a SQLite column declared without a type). Best
        effort: SQLAlchemy's name where the lookup fails."""
        reflected = t.c[column].type
        preparer = self.engine.dialect.identifier_preparer
        query = self.strategy.declared_type_query(preparer.format_table(t), t.schema, t.name, column)
        if query is None:
            return str(reflected)
        try:
            with self.engine.connect() as conn:
                name = conn.execute(sa.text(query[0]), query[1]).scalar()
        except sa.exc.SQLAlchemyError:
            return str(reflected)
        if name is None:
            return str(reflected)
        return repr(name) if name else ""

    def _unreadable(self, t: sa.Table, name: str) -> str | None:
        """Why column `name` cannot be sent (its type), None if it can."""
        col_type = self.strategy.base_type(t.c[name].type)
        if not isinstance(col_type, SUPPORTED_TYPES) or isinstance(col_type, sa.ARRAY | sa.Interval):
            declared = self.declared_type(t, name)
            kind = f"type {declared}" if declared else "no declared type"
            return f"column {name!r} has {kind}, which rowrelay cannot serialize exactly"
        if self.strategy.cannot_read(col_type):
            return f"column {name!r} has type {col_type}, which rowrelay cannot read from {self.dialect}"
        return None

    def _refuse_unreadable(self, t: sa.Table, label: str, wanted: list[str]) -> None:
        """SourceError naming every column whose type cannot be sent, at once: the remedy names the `columns:` that
        leaves them all out."""
        unreadable = {name: why for name in wanted if (why := self._unreadable(t, name)) is not None}
        if not unreadable:
            return
        text = self.strategy.text_remedy
        if len(unreadable) == 1:
            ((name, why),) = unreadable.items()
            remedy = "select it as text in a view" + text if "cannot read" in why else "cast it in a view"
            raise SourceError(f"{label}: {why}; leave it out with `columns:` or {remedy}")
        keep = ", ".join(c for c in wanted if c not in unreadable)
        raise SourceError(f"{label}: {len(unreadable)} columns cannot be sent: {'; '.join(unreadable.values())}; "
                          f"leave them out with `columns: [{keep}]` or cast or select them as text in a view{text}")

    def table_shape(self, schema: str | None, table: str, watermark: str, columns: list[str] | None = None,
                    where: str | None = None, tie_break: str | None = None, key: list[str] | None = None
                    ) -> TableShape:
        try:  # a URL parameter Spark's JDBC driver cannot honour fails the sensor tick, not only the run
            self.jdbc_options()
        except UrlParameterError as exc:
            raise SourceError(str(exc)) from None
        t = self.reflect(schema, table)
        label = f"{schema}.{table}" if schema else table
        if watermark not in t.c:
            raise SourceError(f"{label}: watermark column {watermark!r} does not exist (columns: {list(t.c.keys())})")
        wm_type = self.strategy.base_type(t.c[watermark].type)
        kind = self._watermark_kind(label, watermark, wm_type)
        if tie_break is not None and tie_break not in t.c:
            raise SourceError(f"{label}: tie_break column {tie_break!r} does not exist (columns: {list(t.c.keys())}); "
                              "fix `tie_break:` in rowrelay.yaml")
        wanted = list(columns) if columns else list(t.c.keys())
        missing = [c for c in wanted if c not in t.c]
        if missing:
            raise SourceError(f"{label}: configured columns {missing} do not exist (columns: {list(t.c.keys())})")
        for needed in (watermark, tie_break):
            if needed is not None and needed not in wanted:
                wanted.append(needed)
        if missing_key := [c for c in key or [] if c not in wanted]:  # a column dropped since (on_schema_change)
            raise SourceError(f"{label}: key columns {missing_key} do not exist (columns: {list(t.c.keys())}); fix "
                              "`key:` in rowrelay.yaml")
        charsets, shadowed = self.strategy.text_charsets(self, schema, table)
        self._refuse_unreadable(t, label, wanted)
        infos = tuple(self._column_info(t, label, name, watermark, charsets, shadowed) for name in wanted)
        shape = TableShape(dialect=self.dialect, schema=schema, name=table, columns=infos, watermark=watermark,
                           where=where, watermark_kind=kind, tie_break=tie_break,
                           watermark_unit=self._watermark_unit(wm_type) if kind != "integer" else 1)
        if where is not None:
            self.check_where(shape, label)
        if getattr(wm_type, "unsigned", False) and isinstance(wm_type, sa.BigInteger):
            self.check_watermark_range(shape)  # one indexed max query, only for BIGINT UNSIGNED watermarks
        self.strategy.check_shape(self, shape, label)
        return shape

    def _column_info(self, t: sa.Table, label: str, name: str, watermark: str, charsets: dict[str, str],
                     shadowed: set[str]) -> ColumnInfo:
        """Column `name` as a slice's read takes it, or a SourceError where its name cannot be read."""
        col_type = self.strategy.base_type(t.c[name].type)
        if "`" in name:
            raise SourceError(f"{label}: column {name!r} has a backtick in its name, which Spark's column "
                              "references cannot carry; leave it out with `columns:` or rename it in a view")
        if name.lower().startswith(INTERNAL_PREFIX):  # Spark matches names case-insensitively
            raise SourceError(f"{label}: column {name!r} has a name rowrelay gives columns of its own in a "
                              f"slice's read (names starting with {INTERNAL_PREFIX}: Spark would fail every run "
                              "with COLUMN_ALREADY_EXISTS); leave it out with `columns:` or rename it in a view")
        # The watermark stays whole: the read filters on it. A tie_break is checked too: its bytes sort as its
        # UTF-8 text does (by code point), as the text the driver gave did.
        checked = (name in charsets and name != watermark and isinstance(col_type, sa.String)
                   and not isinstance(col_type, sa.Enum) and type(col_type).__name__ != "SET")
        charset = charsets[name] if checked and not charsets[name].startswith("utf8") else ""
        shadow = checked and not charset and name in shadowed  # a tie_break too: its text sorts as its bytes
        checked = checked and not shadow
        return ColumnInfo(name=name, type_name=str(col_type), nullable=bool(t.c[name].nullable),
                          is_json=isinstance(col_type, sa.JSON), is_integer=isinstance(col_type, sa.Integer),
                          source_text=self.strategy.source_text(col_type), utf8_bytes=checked, charset=charset,
                          utf8_shadow=shadow)

    def _watermark_kind(self, label: str, watermark: str, wm_type: Any) -> WatermarkKind:
        """Integer columns, and the timestamp types whose values are exact to the microsecond and never move
        with a session's time zone: PostgreSQL timestamp/timestamptz, MariaDB/MySQL DATETIME."""
        if isinstance(wm_type, sa.Integer):
            return "integer"
        if isinstance(wm_type, sa.DateTime):
            return self.strategy.timestamp_kind(label, watermark, wm_type)
        raise SourceError(f"{label}: watermark column {watermark!r} has type {wm_type}, but must be an integer "
                          "column that only grows (e.g. an auto-increment id) or a timestamp set when the row is "
                          "written (PostgreSQL timestamp/timestamptz, MariaDB DATETIME)")

    def _watermark_unit(self, wm_type: Any) -> int:
        """Microseconds per step of a timestamp column, from its fractional digits."""
        digits = self.strategy.fractional_digits(wm_type)
        return 10 ** (6 - min(6, max(0, int(digits))))

    @staticmethod
    def filtered(q: sa.Select, shape: TableShape, watermark: sa.ColumnElement | None = None,
                 skip: Sequence[RowSkip] | None = None) -> sa.Select:
        """The rows counts, cuts, reads and the lag's oldest row see (`filtered` in shape.py)."""
        return filtered(q, shape, watermark, skip)

    def skip_sql(self, shape: TableShape, skip: Sequence[RowSkip]) -> str:
        """`filtered`'s skip as this source's SQL text (literals inline), for the slice read Spark sends."""
        return skip_sql(self.engine.dialect, shape, skip)

    def check_where(self, shape: TableShape, label: str) -> None:
        """The filter must run on this source: a predicate that does not parse (or names a missing column) is a
        clear error at the table check, before anything is cut or read."""
        q = self.filtered(sa.select(sa.literal(1)).select_from(table_clause(shape)), shape).limit(1)
        # A source that cannot be reached fails at connect, as itself: transient, retried like any read, not a
        # predicate to fix (and stopping the table for it).
        with self.engine.connect() as conn:
            try:
                conn.execute(q).first()
            except sa.exc.DBAPIError as exc:
                if exc.connection_invalidated:  # the connection dropped mid-statement: the same
                    raise
                reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
                raise SourceError(f"{label}: `where: {shape.where}` does not run on source {self.safe_description}: "
                                  f"{reason}; fix the predicate in rowrelay.yaml (it is the source's SQL)") from None

    # -- watermark queries (each one indexed query) ------------------------------------------------

    def max_watermark(self, shape: TableShape, upto: int | None = None, after: int | None = None) -> int | None:
        t = table_clause(shape)
        wm = t.c[shape.watermark]
        q = self.filtered(sa.select(sa.func.max(wm)).select_from(t), shape)
        if upto is not None:
            q = q.where(wm <= shape.watermark_param(upto))
        if after is not None:
            q = q.where(wm > shape.watermark_param(after))
        with self.engine.connect() as conn:
            value = conn.execute(q).scalar()
        return None if value is None else shape.watermark_value(value)

    def nth_watermark(self, shape: TableShape, after: int, n: int, upto: int, *, settled: bool = False
                      ) -> int | None:
        """The n-th watermark above `after` among rows up to `upto`. `settled`: see `SETTLED_ANSWERS`."""
        def ask() -> int | None:
            t = table_clause(shape)
            wm = t.c[shape.watermark]
            q = self.filtered(sa.select(wm).select_from(t).where(wm > shape.watermark_param(after),
                                                                  wm <= shape.watermark_param(upto)), shape
                               ).order_by(wm).limit(1).offset(n - 1)
            with self.engine.connect() as conn:
                value = conn.execute(q).scalar()
            return None if value is None else shape.watermark_value(value)

        return self._asked(shape, ("nth", after, n, upto), ask, settled)

    def count_rows(self, shape: TableShape, after: int, upto: int, skip: Sequence[RowSkip] | None = None, *,
                   settled: bool = False) -> int:
        """Rows in (after, upto] that the table's `where:` admits, minus the rows `skip` names.
        `settled`: see `SETTLED_ANSWERS` (a check that recounts the source now leaves it off)."""
        def ask() -> int:
            t = table_clause(shape)
            wm = t.c[shape.watermark]
            q = self.filtered(sa.select(sa.func.count()).select_from(t)
                              .where(wm > shape.watermark_param(after), wm <= shape.watermark_param(upto)), shape,
                              wm, skip)
            with self.engine.connect() as conn:
                return int(conn.execute(q).scalar())

        return self._asked(shape, ("count", after, upto, tuple(skip or ())), ask, settled)

    def count_skipped(self, shape: TableShape, after: int | None, upto: int, skip: Sequence[RowSkip]) -> int:
        """Rows in (after, upto] (None: from the first) that the table's `where:` admits and `skip` names: the rows
        a skip leaves out, for `rowrelay verify` and `status` to report as skipped."""
        if not skip:
            return 0
        t = table_clause(shape)
        wm = t.c[shape.watermark]
        q = self.filtered(sa.select(sa.func.count()).select_from(t).where(wm <= shape.watermark_param(upto)), shape
                          ).where(skipped_rows_predicate(shape, skip))
        if after is not None:
            q = q.where(wm > shape.watermark_param(after))
        with self.engine.connect() as conn:
            return int(conn.execute(q).scalar())

    def iter_watermarks(self, shape: TableShape, after: int | None, upto: int, skip: Sequence[RowSkip] | None = None
                        ) -> Iterator[int]:
        """Every row's watermark in (after, upto] that the table's `where:` admits, minus `skip`, streamed (for
        `rowrelay verify`: the one full pass over the rows, never on the relay path)."""
        t = table_clause(shape)
        with self.engine.connect().execution_options(stream_results=True, yield_per=50_000) as conn:
            for (value,) in conn.execute(self._watermark_rows(shape, t, [t.c[shape.watermark]], after, upto, skip)):
                yield shape.watermark_value(value)

    def iter_watermark_ties(self, shape: TableShape, after: int | None, upto: int,
                            skip: Sequence[RowSkip] | None = None, only: Sequence[int] | None = None
                            ) -> Iterator[tuple[int, Any]]:
        """As `iter_watermarks`, each with its row's tie_break value, for the watermarks in `only` if given."""
        assert shape.tie_break is not None
        t = table_clause(shape, shape.tie_break)
        q = self._watermark_rows(shape, t, [t.c[shape.watermark], t.c[shape.tie_break]], after, upto, skip)
        if only is not None:
            q = q.where(t.c[shape.watermark].in_([shape.watermark_param(w) for w in only]))
        with self.engine.connect().execution_options(stream_results=True, yield_per=50_000) as conn:
            for value, tie in conn.execute(q):
                yield shape.watermark_value(value), tie

    def _watermark_rows(self, shape: TableShape, t: sa.TableClause, columns: list[Any], after: int | None,
                        upto: int, skip: Sequence[RowSkip] | None) -> sa.Select:
        wm = t.c[shape.watermark]
        q = self.filtered(sa.select(*columns).select_from(t).where(wm <= shape.watermark_param(upto)), shape, wm, skip)
        return q if after is None else q.where(wm > shape.watermark_param(after))

    def has_null_watermarks(self, shape: TableShape) -> bool:
        if not shape.column(shape.watermark).nullable:
            return False
        t = table_clause(shape)
        with self.engine.connect() as conn:
            return conn.execute(sa.select(sa.literal(1)).select_from(t)
                                .where(t.c[shape.watermark].is_(None)).limit(1)).first() is not None

    def sqlite_misfit(self, shape: TableShape, after: int, upto: int, skip: Sequence[RowSkip] | None = None
                      ) -> tuple[int, str, str, str] | None:
        """SQLite only: the first row in (after, upto] holding a value its column's declared type cannot carry
        exactly (`first_misfit`)."""
        return first_misfit(self.engine, shape, after, upto, skip)

    # -- safe high watermark ---------------------------------------------------------------------

    def observe(self, shape: TableShape) -> WatermarkCandidate | None:
        """The current max watermark with what tells, later, when it is final (see `is_final`).

        The transactions it must wait for are read in a second statement, AFTER the max: a transaction that
        took an id <= max before the max was read is, by then, either still open (and listed) or ended.

        A timestamp column whose values are coarser than a microsecond is another case: a transaction that starts
        after this look, so waits for nothing, still writes the max's own value while the database clock is in the
        max's step. Then the candidate stops below that step, and the rows at the max wait for a later look. The step
        is the coarser of the declared one (`watermark_unit`: timestamp(0), DATETIME) and the one the newest values
        show (`_shown_step_sql`): a `timestamptz` or DATETIME(6) written by `date_trunc('second', now())`,
        `CURRENT_TIMESTAMP(0)` or MariaDB's NOW() holds whole seconds whatever its type. The clock is read as the
        writers write: PostgreSQL's session time (the
        server's zone, as `DEFAULT now()` on a `timestamp` stores it; an instant for `timestamptz`), MariaDB's NOW(6)
        in this session's zone (the server's default, as `CURRENT_TIMESTAMP` stores a DATETIME for writers in it; a
        source URL that sets another zone must set the writers').
        """
        t = table_clause(shape)
        with self.engine.connect() as conn:
            self.refuse_unknowable_finality(shape, conn)
            seen = self.strategy.observe(self, conn, shape, t)
        if seen.max is None:
            return None
        value = shape.watermark_value(seen.max)
        if value > MAX_WATERMARK:
            raise SourceError(self._range_message(shape, value))
        step = max(shape.watermark_unit, int(seen.shown_step or 1))
        if seen.clock is not None:
            value = below_step_in_reach(value, datetime_to_micros(seen.clock), step)
        if seen.earliest is not None:
            # Its rows carry its start time (CURRENT_TIMESTAMP is the statement's), in the values' step.
            value = min(value, seen.earliest // step * step - 1)
        return WatermarkCandidate(value, float(seen.marker), seen.waits, seen.durable_at, seen.table_token)

    def refuse_unknowable_finality(self, shape: TableShape, conn: sa.Connection | None = None) -> None:
        """Refuse a source where `is_final` cannot know when new rows are final, so a cut could skip a row for good:

        - a source that receives the table's rows by replication: a PostgreSQL standby, a table a logical
          replication subscription fills, a MariaDB server whose replication runs. Rows arrive there in the
          primary's commit order, while the transactions still open on the primary — those the safe high watermark
          waits for — are invisible: on a standby the check saw id 3 final while the primary still held id 2 drawn
          and uncommitted;
        - a PostgreSQL UNLOGGED table: a crash empties it and restarts its sequence (not in the WAL, so no flush
          makes its rows durable); and an UNLOGGED sequence the watermark takes its ids from (PostgreSQL 15+, behind
          a logged table too): a crash resets it to its start, and new rows take ids at or below those sent;
        - a PostgreSQL foreign table (its writers' transactions are on another server) or materialized view (its
          rows appear at a refresh, below rows already sent). These and the two above are looked for in every
          relation a read of the table takes rows from: partitions, inheritance children, a view's base relations;
        - a PostgreSQL integer watermark drawn from a sequence with CACHE > 1, in any of those relations: each
          session draws its ids from a cache of its own, so a session can insert id 2 long after another committed
          21, in a transaction that began after the cut (nothing the cut could wait for);
        - a MariaDB/MySQL table in MEMORY (a restart empties it and reuses its ids) or an engine other than InnoDB
          (whose open transactions `is_final` reads), MyISAM and Aria (one writing statement at a time).

        Checked before every cut (`observe`) and every run's read; `verify` and `status` may still read a replica.
        Readable by any role: the recovery flag, the catalogs, MariaDB's Slaves_running status. MySQL's replication
        state needs a privilege rowrelay does not ask for: not checked there (docs/design.md)."""
        if conn is None:
            with self.engine.connect() as own:
                return self.refuse_unknowable_finality(shape, own)
        self.strategy.refuse_unknowable_finality(self, shape, conn)

    def is_final(self, candidate: WatermarkCandidate, settle_seconds: float) -> bool:
        """Whether every row with watermark <= `candidate.watermark` is committed (none can still appear).

        - PostgreSQL: the xmin of a new snapshot has reached the xmax seen with the max (every transaction with
          an xid then has ended) AND none of the virtual transactions open in the table's database when the max
          was seen is still open. The second part covers a `DEFAULT nextval` drawn before its transaction has an
          xid (before BEFORE-ROW triggers run; only 1 in 32 nextval calls writes WAL and takes an xid early).
          pg_locks and the pid/datid of pg_stat_activity are readable by any role. It also waits for unrelated
          transactions open in that database then (a long report query, an idle-in-transaction session).
          PREPARE TRANSACTION releases a vxid, so a prepared transaction of that database whose xid was taken after
          the max was seen also holds it, until COMMIT PREPARED or ROLLBACK PREPARED (pg_prepared_xacts: any role).
          Not covered: client-supplied ids (a watermark sequence with CACHE > 1 is refused:
          `refuse_unknowable_finality`).
        - MariaDB/MySQL: `settle_seconds` have passed on the database clock AND none of the InnoDB transactions
          open when the max was seen is still open. Needs the PROCESS privilege (`SourceError` otherwise).
          A timestamp watermark's candidate also stays below every running writing statement's start
          (`_earliest_running_write`, applied in `observe`).
          Not covered: a transaction that took an auto-increment id but was not yet listed in innodb_trx when the
          max was read (a window of microseconds inside its insert, or between our snapshot and the max read
          under READ COMMITTED), a SELECT whose stored function inserts rows, and client-supplied ids.
        - SQLite: one writer at a time; `settle_seconds` on this host's clock.

        And durable: committed is not enough where commits are acknowledged before the log is on disk
        (PostgreSQL's synchronous_commit=off, MariaDB's innodb_flush_log_at_trx_commit=0 or 2). A crash of the
        server then loses the last commits and gives their ids out again: rows sent would vanish from the source and
        new rows with the same ids would never be sent (committed rows, visible to every session, are gone after
        the crash). So the write-ahead (redo) log must be flushed past the point where all those commits
        lay: PostgreSQL's insert position once the transactions waited for have ended; MariaDB's, seen with the
        max when nothing was waited for, else at the check. The check waits up to DURABLE_WAIT_S for the flush (the
        WAL writer's interval, 0.2 s by default; InnoDB's once a second), then answers False. Not covered: MySQL
        (no such status readable without privileges) and SQLite; a failover to a replica that lags.

        A check that fails (connection lost, server away) answers False: not final, never final by default.
        """
        return self.not_final_because(candidate, settle_seconds) is None

    def not_final_because(self, candidate: WatermarkCandidate, settle_seconds: float) -> str | None:
        """`is_final`, saying why not: None when final, else what still holds the candidate (the transaction that
        is still open, the settle delay, the log flush), for the sensor's skip message. Named from what the check
        reads anyway: the idle path (nothing pending) never gets here, and a pending one costs no query more."""
        if candidate.is_settled:
            # It was final, and durable, when it settled. Asked again, its durability target would be the WAL
            # position now, which can include an open transaction's WAL that the WAL writer leaves in a partly
            # filled page until a later commit: a re-cut after a timed-out slice then waited for unrelated writers.
            return None
        try:
            with self.engine.connect() as conn:
                return self.strategy.not_final_because(self, conn, candidate, settle_seconds)
        except sa.exc.DBAPIError as exc:
            # Logged: a check that keeps failing stalls the table, and this says why.
            _log.warning("watermark %s not known final yet: the check failed: %s", candidate.watermark,
                         exc.orig or exc)
            return f"the finality check failed: {exc.orig or exc}"

    def check_watermark_range(self, shape: TableShape) -> None:
        """Refuse a watermark beyond what rowrelay carries (a signed 64-bit integer): BIGINT UNSIGNED values
        >= 2^63 would wrap when Spark's decimal(20,0) is cast to a long."""
        top = self.max_watermark(shape)
        if top is not None and top > MAX_WATERMARK:
            raise SourceError(self._range_message(shape, top))

    def _range_message(self, shape: TableShape, value: int) -> str:
        label = shape.label
        return (f"{label}: watermark column {shape.watermark!r} holds {value}, above the largest watermark rowrelay "
                f"supports, {MAX_WATERMARK} (2^63 - 1, a signed 64-bit integer); a BIGINT UNSIGNED watermark must "
                "stay below 2^63. Use another watermark column or a view that maps it below 2^63")

    def jdbc_options(self) -> dict[str, Any]:
        """What Spark's JDBC source needs to read this database (see resources/jdbc.py)."""
        return jdbc_options(self.sqlalchemy_url, self.dialect)


