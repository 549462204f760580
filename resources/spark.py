"""Spark resource: one SparkSession per process (local, cluster master or Spark Connect) and JDBC slice reads."""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from math import ceil
from typing import TYPE_CHECKING, Any

from dagster import ConfigurableResource
from pydantic import Field

from resources.config import ConfigError, resolve_env
from resources.errors import RowrelayError
from resources.slices import RowSkip, SliceRange, micros_sql_text
from resources.source_database import MAX_MICROS, MAX_WATERMARK, read_as_text, sqlite_affinity

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from resources.source_database import SourceDatabaseResource, TableShape

_lock = threading.Lock()
# One LazyPySparkResource per Spark endpoint and process: it creates the SparkSession on first use.
_lazy_sessions: dict[str, Any] = {}
# The Spark Connect sessions this process made, to release at its end (release_sessions).
_connect_sessions: dict[str, Any] = {}
# Spark Connect URLs this process found answering (check_connect_server): checked once, not per session use.
_answering: set[str] = set()
CONNECT_CHECK_S = 5.0


class SparkUnreachable(RowrelayError, RuntimeError):
    """The Spark Connect server does not answer; the message names the URL and the setting to check."""


def unreachable_text(url: str, setting: str, why: str) -> str:
    named = f"spark.remote in rowrelay.yaml ({setting})" if setting != url else "spark.remote in rowrelay.yaml"
    return (f"the Spark Connect server {url} {why}: check {named}: its host and port, and that the server is "
            "running there (the local stack's URL is ROWRELAY_SPARK_REMOTE in stack.env)")


def check_connect_server(url: str, setting: str | None = None, timeout_s: float = CONNECT_CHECK_S) -> None:
    """Raise SparkUnreachable unless a Spark Connect server answers at `url` within `timeout_s`.

    PySpark's client retries a server that refuses or never answers for about ten minutes before its first error,
    and its exit hook retries again: a wrong port must fail in seconds, before anything is cut. A TCP connect tells
    a refused or unroutable address; a gRPC channel becoming ready tells a port that takes connections but does not
    speak HTTP/2 (another service, a firewall that swallows them). `setting`: the URL as written in the config."""
    # On first use, for start-up time (see SparkResource.get_session).
    import grpc
    from pyspark.sql.connect.client import DefaultChannelBuilder

    setting = setting or url
    if url in _answering:
        return
    try:
        builder = DefaultChannelBuilder(url)
    except Exception as exc:  # noqa: BLE001 - PySpark's URL errors share no narrower base
        raise SparkUnreachable(f"spark.remote {setting}: {str(exc).splitlines()[0]}") from None
    started = time.monotonic()
    try:
        host, port = builder.endpoint.rsplit(":", 1)
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        why = "did not answer" if isinstance(exc, TimeoutError) else f"cannot be reached ({exc.strerror or exc})"
        raise SparkUnreachable(unreachable_text(url, setting, why)) from None
    channel = builder.toChannel()
    try:
        grpc.channel_ready_future(channel).result(timeout=max(0.5, timeout_s - (time.monotonic() - started)))
    except grpc.FutureTimeoutError:
        why = f"takes connections but gave no Spark Connect (gRPC) answer within {timeout_s:g} s"
        raise SparkUnreachable(unreachable_text(url, setting, why)) from None
    finally:
        channel.close()
    _answering.add(url)


def release_sessions(timeout_s: float = 5.0) -> None:
    """Release this process's Spark Connect sessions on the server; called when the process is done with Spark.

    A Connect session lives on the server until its client releases it or it idles past the server's timeout
    (`spark.connect.session.manager.defaultSessionTimeout`, 60 minutes by default), holding its state and the
    class loader its compiled plans are loaded into. Every run is a process with a session of its own, and none
    was released: a table relayed every 5 s would keep up to ~700 there. Best effort and bounded: a
    server that is gone must not hold up the process's exit (its client retries for minutes)."""
    def release() -> None:
        with _lock:  # inside the bound too: a session being made holds the lock through the client's retries
            sessions = list(_connect_sessions.values())
            for key in _connect_sessions:
                _lazy_sessions.pop(key, None)
            _connect_sessions.clear()
        for session in sessions:
            session.stop()  # releases the session on the server and closes the channel; it raises nothing

    releasing = threading.Thread(target=release, name="rowrelay-spark-release", daemon=True)
    releasing.start()
    releasing.join(timeout_s)


def default_jars() -> str:
    """JDBC driver jars for a local Spark session: ROWRELAY_JDBC_JARS (comma-separated paths).

    `python -m stack up` writes it to stack.env; a Spark Connect server or cluster brings its own drivers.
    """
    jars = os.environ.get("ROWRELAY_JDBC_JARS")
    if not jars:
        raise ValueError("no JDBC driver jars for the local Spark session: set `spark.conf` spark.jars in "
                         "rowrelay.yaml or the ROWRELAY_JDBC_JARS environment variable (comma-separated jar paths)")
    return jars


SQL_CONF = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.chunkBase64String.enabled": "false",  # base64() would otherwise insert line breaks
    # Spark pads CHAR(n) values it reads to n characters; MariaDB returns CHAR without its trailing spaces and
    # reports ENUM and SET as CHAR(n) ('a' arrived as "a  "): send what the database returns.
    "spark.sql.readSideCharPadding": "false",
    # ANSI mode (Spark 4's default, but a user's conf or a shared Connect server may turn it off): a decimal cast
    # to string stays in plain notation (1E-10 otherwise) and an overflow fails instead of becoming null.
    "spark.sql.ansi.enabled": "true",
    # PostgreSQL and MariaDB tell "Name" from "name"; Spark by default does not, and refused a table holding both
    # ([COLUMN_ALREADY_EXISTS]). rowrelay names every column exactly as reflected.
    "spark.sql.caseSensitive": "true",
}


# Sessions whose SQL_CONF is set: once per session, not per read (with Spark Connect each set is a round trip, made
# under the lock that every chunk's read took: two per chunk, serialising the fetch threads).
_configured: weakref.WeakSet[Any] = weakref.WeakSet()


def _with_sql_conf(session: SparkSession, client_conf: dict[str, str] | None = None) -> SparkSession:
    """`client_conf`: a Spark Connect client's own `spark.conf`, set on its session (a local session takes it in its
    builder): it was ignored there. What a client cannot set (a static or core setting) fails, naming the key."""
    if session not in _configured:
        for key, value in (client_conf or {}).items():
            try:
                session.conf.set(key, value)
            except Exception as exc:  # noqa: BLE001 - pyspark's Connect errors share no narrower base
                if "CANNOT_MODIFY" not in str(exc) and "Cannot modify the value" not in str(exc):
                    raise  # the server away, or another failure: its own message
                raise ConfigError(
                    f"spark.conf {key}: a Spark Connect client cannot set it ({str(exc).splitlines()[0][:200]}); "
                    "set it on the Spark Connect server instead, or remove it from rowrelay.yaml") from None
        for key, value in SQL_CONF.items():
            session.conf.set(key, value)
        _configured.add(session)
    return session


def custom_schema_for(shape: TableShape) -> str:
    """Columns Spark's default JDBC mapping would not read exactly, re-typed (customSchema).

    Decimals beyond DecimalType (PostgreSQL unconstrained or numeric(78,0), numeric(5,7), MariaDB
    DECIMAL(65,30)) would be rounded or overflow: read the driver's own text instead, which is exact, in plain
    notation and keeps the column's scale. So is every PostgreSQL numeric (as a tie_break, the source orders its
    rows: TableShape.tie_order): any of them may hold 'NaN' (and, from PostgreSQL 14, 'Infinity'), which the
    driver cannot make a BigDecimal of, so the read failed; the text is the same string the decimal gave otherwise.
    PostgreSQL real (float4) through Java 17's Float.toString is not the shortest text, so read PostgreSQL's own
    text and cast to double. A MariaDB FLOAT is selected as an exact double and read back as a 32-bit float.
    Decided from the reflected types, which saves Spark a second schema round trip.

    SQLite stores every integer in up to 8 bytes, but its driver reports a column declared INTEGER (or INT,
    SMALLINT...) as 32-bit, and Spark wrapped values above 2^31-1: such a watermark fell out of its own slice's range.
    Integer-affinity columns (SQLite's rule: the declared type contains "INT") are read as BIGINT; FLOAT (8 bytes in
    SQLite, a 32-bit float to the driver) and every other real as DOUBLE, text as STRING, BOOL(EAN) as BOOLEAN.
    SQLite has no date or time type: the driver parsed a DATE/DATETIME/TIMESTAMP column's text with a pattern of its
    own (a DATETIME lost its time of day, a TIMESTAMP's microseconds were read as milliseconds), so those columns
    are sent as the text SQLite holds (`sqlite_affinity`, SQLITE_READ_TYPES).
    """
    if shape.dialect == "sqlite":
        return ", ".join(f"`{c.name}` {sqlite_type}" for c in shape.columns
                         if (sqlite_type := SQLITE_READ_TYPES.get(sqlite_affinity(c.type_name.upper()))))
    if shape.dialect not in ("postgresql", "mysql"):
        return ""
    as_text = [c.name for c in shape.columns if read_as_text(shape.dialect, c.type_name)]
    # MariaDB FLOAT, selected as its exact double (MYSQL_TEXT_RENDERING): back to the 32-bit float it is.
    floats = [c.name for c in shape.columns if c.source_text == "mysql_float"]
    return ", ".join([f"`{c}` STRING" for c in as_text] + [f"`{c}` FLOAT" for c in floats])


# The Spark type each SQLite affinity is read as where the driver's own mapping is not exact (absent: its own). The
# driver maps a type name it does not know (VARCHAR2, LONGTEXT, DOUBLE PRECISION, BOOL...) to NUMERIC, which Spark
# reads as a decimal.
SQLITE_READ_TYPES = {"integer": "BIGINT", "text": "STRING", "real": "DOUBLE", "date": "STRING", "boolean": "BOOLEAN"}


def _spark_time_text(micros: int) -> str:
    """A partition stride bound for a timestamp column, as Spark parses it."""
    return micros_sql_text(micros)


class SparkResource(ConfigurableResource):
    """Reads slices over JDBC. `remote` (sc://host:15002) uses a Spark Connect server instead of a local JVM."""

    master: str = "local[*]"
    remote: str | None = None
    conf: dict[str, str] = Field(default_factory=dict)
    jars: str | None = Field(None, description="comma-separated JDBC driver jars (default: the stack's cache)")
    rows_per_partition: int = Field(50_000, description="JDBC partitioned read: rows per Spark partition")
    max_partitions: int = Field(4, description="cap on parallel JDBC connections per slice read")
    fetchsize: int = 10_000

    def session_config(self) -> dict[str, str]:
        """The SparkSession builder settings: `spark.remote` for Spark Connect, else a local/cluster session."""
        if self.remote:
            return {"spark.remote": resolve_env(self.remote)}
        return {
            "spark.master": resolve_env(self.master),
            "spark.app.name": "rowrelay",
            # Timestamps are read and formatted in UTC whatever the machine's zone.
            "spark.driver.extraJavaOptions": "-Duser.timezone=UTC",
            "spark.executor.extraJavaOptions": "-Duser.timezone=UTC",
            "spark.ui.enabled": "false",
            "spark.sql.shuffle.partitions": "4",
            "spark.sql.execution.arrow.pyspark.enabled": "true",
            "spark.jars": self.jars or self.conf.get("spark.jars") or default_jars(),
            **{key: resolve_env(value) for key, value in self.conf.items()},
        }

    def check_server(self) -> None:
        """With Spark Connect: SparkUnreachable within seconds unless its server answers (check_connect_server)."""
        if self.remote:
            check_connect_server(resolve_env(self.remote), self.remote)

    def get_session(self) -> SparkSession:
        """The session, created once per process by dagster-pyspark's LazyPySparkResource (on first use)."""
        # PySpark is imported on first use, for start-up time: the CLI, the daemon and the webserver load this
        # module with the code location and never read a slice.
        from dagster_pyspark import LazyPySparkResource
        from pyspark.sql import SparkSession

        with _lock:
            if not self.remote:
                active = SparkSession.getActiveSession()
                if active is not None:
                    return active
            lazy = _lazy_sessions.get(self.remote or self.master)
            if lazy is None:
                lazy = _lazy_sessions[self.remote or self.master] = LazyPySparkResource(
                    spark_config=self.session_config())
            if not self.remote:
                return _with_sql_conf(lazy.spark_session)
            self.check_server()
            session = lazy.spark_session
            if not _connect_sessions:
                atexit.register(release_sessions)  # at a normal exit (a forked warm worker's end calls it itself)
            _connect_sessions[self.remote] = session
            return _with_sql_conf(session, {key: resolve_env(value) for key, value in self.conf.items()})

    def read_slice(self, source: SourceDatabaseResource, shape: TableShape, slice_range: SliceRange,
                   expected_rows: int, skip: Sequence[RowSkip] = ()) -> DataFrame:
        """The slice's rows (lo < watermark <= hi) but those `skip` names, ordered by watermark within each ordered
        partition."""
        from pyspark.sql import functions as F  # on first use, for start-up time (see get_session)

        preparer = source.engine.dialect.identifier_preparer
        qualified = preparer.quote(shape.name)
        if shape.schema:
            qualified = f"{preparer.quote_schema(shape.schema)}.{qualified}"
        predicates = [f"({shape.where})"] if shape.where else []  # the same predicate counts and cuts use
        if skip:  # the rows counts leave out, by the same predicate (in the source, where its columns are)
            predicates.append(source.skip_sql(shape, skip))
        tie_order = shape.tie_order
        if shape.timestamps or tie_order:
            # The slice's bounds inside the subquery, as the source's own literals: a timestamp's (indexed, exact to
            # the microsecond; Spark would render its pushed-down timestamp filters in the JVM's zone), and where a
            # tie order's window is computed there (not left to the database to push Spark's outer filter through
            # the window: older MySQL 8.0 would number the whole table per chunk).
            column = preparer.quote(shape.watermark)
            predicates += [f"{column} > {shape.watermark_sql_literal(slice_range.lo)}",
                           f"{column} <= {shape.watermark_sql_literal(slice_range.hi)}"]
        # The source renders dates and timestamps as text itself (TableShape.rendered_select): PostgreSQL's is
        # cheaper than the driver parsing and Spark formatting them; MariaDB's is exact where those are not.
        select = shape.rendered_select(preparer.quote)
        if predicates or select:
            where = f" WHERE {' AND '.join(predicates)}" if predicates else ""
            qualified = f"(SELECT {select or '*'} FROM {qualified}{where}) rowrelay_slice"
        options: dict[str, Any] = {**source.jdbc_options(), "dbtable": qualified, "fetchsize": str(self.fetchsize)}
        partitions = max(1, min(self.max_partitions, ceil(expected_rows / self.rows_per_partition)))
        if partitions > 1:
            # Bounds only set the stride; the filter below is what limits rows to the slice. Spark's partitions are
            # complementary ranges of the column (each stride bound in two predicates), so none is read twice.
            # hi + 1 would overflow at the largest watermark (2^63 - 1; a timestamp's year 9999): a stride bound may
            # be the last value itself.
            top = MAX_MICROS if shape.timestamps else MAX_WATERMARK
            lo, hi = slice_range.lo + 1, min(slice_range.hi, top - 1) + 1
            bounds = (_spark_time_text(lo), _spark_time_text(hi)) if shape.timestamps else (str(lo), str(hi))
            options.update(partitionColumn=shape.watermark, lowerBound=bounds[0], upperBound=bounds[1],
                           numPartitions=str(partitions))
        if shape.dialect == "postgresql":
            options["preferTimestampNTZ"] = "true"  # timestamp -> NTZ (no offset), timestamptz -> instant
        session = self.get_session()

        custom = custom_schema_for(shape)
        if custom:
            options["customSchema"] = custom
        reader = session.read.format("jdbc")
        for key, value in options.items():
            reader = reader.option(key, value)
        frame = reader.load()
        columns = [F.col(f"`{c}`") for c in [*shape.column_names, *shape.source_texts.values(),
                                              *shape.utf8_shadows.values(), *filter(None, [tie_order])]]
        if shape.timestamps:  # microseconds since 1970 UTC; a zone-less value is read as UTC (session zone)
            columns.append(F.unix_micros(F.col(f"`{shape.watermark}`").cast("timestamp")).alias(shape.frame_watermark))
        wm = F.col(f"`{shape.frame_watermark}`")
        order = [wm] + ([F.col(f"`{tie_order or shape.tie_break}`")] if shape.tie_break else [])
        return (frame.select(*columns)
                .where((wm > F.lit(slice_range.lo)) & (wm <= F.lit(slice_range.hi)))
                .sortWithinPartitions(*order))
