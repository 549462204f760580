"""rowrelay.yaml: load, interpolate, validate. Errors name the offending key.

Secrets stay as `${VAR}` templates in what Dagster stores and shows; they are resolved only where a
connection is made (see `resolve_env`).
"""

from __future__ import annotations

import difflib
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from resources.errors import RowrelayError
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX, portable_name, progress_topic_name
from resources.slices import RowSkip, datetime_to_micros

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]*$")
_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
# Dagster's name rule (dagster._core.definitions.utils.VALID_NAME_REGEX): job, sensor, op, partitions names.
_DAGSTER_REFUSED = re.compile(r"[^A-Za-z0-9_]")
_SOURCE_NAME = re.compile(r"[A-Za-z0-9_]+")


class ConfigError(RowrelayError, ValueError):
    """rowrelay.yaml is invalid; the message names the key and what to change."""


def dagster_op_name(path: list[str]) -> str:
    """The op name Dagster derives from an asset key (AssetKey.to_python_identifier), computed here so that config
    validation needs no Dagster import."""
    return "__".join(path).replace("-", "_").replace(".", "_")


def resolve_env(template: str) -> str:
    """Replace ${VAR} and ${VAR:-default} (the default also where VAR is empty, as a shell does); a missing
    variable is an error naming it."""

    def sub(m: re.Match[str]) -> str:
        value = os.environ.get(m.group(1))
        if not value and m.group(2) is not None:
            value = m.group(2)
        if value is None:
            raise ConfigError(f"environment variable {m.group(1)} is not set (used in rowrelay configuration)")
        return value

    return _ENV.sub(sub, template)


_MASKED_VAR = re.compile("\x00(\\d+)\x00")


def resolve_url_env(template: str) -> str:
    """A database URL with its ${VAR}s resolved, each value kept in the part of the URL it stands in. A value in
    the user part (user, password) or in a query parameter is percent-encoded, which SQLAlchemy decodes: a password
    is taken literally, whatever it holds. Put in raw, a password with '@' moved into the host ('a@b' made the host
    'b@db.example', named in every error) and one with '@' and ':' failed as a port."""
    found: list[re.Match[str]] = []

    def mask(m: re.Match[str]) -> str:
        found.append(m)
        return f"\x00{len(found) - 1}\x00"

    masked = _ENV.sub(mask, template)  # the template's own '@', '/', '?' now mark its parts, not a value's

    def fill(part: str, encode: bool) -> str:
        def one(m: re.Match[str]) -> str:
            value = resolve_env(found[int(m.group(1))].group(0))
            return quote(value, safe="") if encode else value

        return _MASKED_VAR.sub(one, part)

    scheme, sep, rest = masked.partition("://")
    if not sep:
        return fill(masked, encode=False)
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    user, at, host = authority.rpartition("@")
    if ":" in user:  # user:password, each filled on its own
        name, _, password = user.partition(":")
        userinfo = f"{fill(name, encode=True)}:{fill(password, encode=True)}"
    else:  # a user alone, or one ${VAR} holding user:password: split its value at the first ':'
        name, colon, password = fill(user, encode=False).partition(":")
        userinfo = quote(name, safe="") + (f":{quote(password, safe='')}" if colon else "")
    path, question, query = tail.partition("?")
    # A parameter's value is taken literally; its name, or a part with no '=' (a ${VAR} holding whole parameters),
    # goes in as written.
    params = "&".join(f"{fill(key, encode=False)}={fill(value, encode=True)}" if eq else fill(key, encode=False)
                      for key, eq, value in (param.partition("=") for param in query.split("&"))) if question else ""
    return f"{scheme}://{userinfo}{at}{fill(host, encode=False)}{fill(path, encode=False)}{question}{params}"


def env_names(template: str) -> list[str]:
    return [m.group(1) for m in _ENV.finditer(template)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceConfig(_Strict):
    url: str = Field(description="SQLAlchemy URL: postgresql://…, mysql://… / mariadb://…, sqlite:///path")
    tables_written_here: bool = Field(False, description="a MariaDB server whose replication runs is refused; true: "
                                      "its relayed tables are written on it, not by replication")

    @field_validator("url")
    @classmethod
    def _known_dialect(cls, v: str) -> str:
        scheme = v.split(":", 1)[0].split("+", 1)[0]
        if scheme not in ("postgresql", "postgres", "mysql", "mariadb", "sqlite", "singlestoredb"):
            raise ValueError(f"unsupported database {scheme!r}: use postgresql, mysql/mariadb or sqlite")
        return v


SkipValue = int | str


class SkipRow(_Strict):
    """A `skip_watermarks` entry naming one row: its watermark and its `tie_break` value, or its watermark and
    the values of columns that tell it from the other rows at that watermark (`key`)."""

    watermark: int | datetime
    tie_break: SkipValue | None = None
    key: dict[str, SkipValue] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_way(self) -> SkipRow:
        if (self.tie_break is None) == (self.key is None):
            raise ValueError("a skip entry names its row by `tie_break: value` or by `key: {column: value, ...}`, "
                             "one of the two")
        return self


class TableConfig(_Strict):
    # The other tables of the same config that write to this table's topic (RelayConfig sets it).
    _topic_shared_with: tuple[str, ...] = PrivateAttr(default=())

    source: str
    table: str = Field(description="[schema.]table")
    watermark: str = Field(description="a column that only grows: an integer (e.g. an auto-increment id) or a "
                           "timestamp set when the row is written (PostgreSQL timestamp/timestamptz, MariaDB DATETIME)")
    tie_break: str | None = Field(None, description="orders rows that share one watermark value (e.g. the primary "
                                  "key of a table whose watermark is a creation time); unset: in any order")
    topic: str | None = None
    key: list[str] | Literal["hash_row", "none"] = "none"
    columns: list[str] | None = None
    slice_max_rows: int = Field(100_000, ge=1, le=50_000_000)
    start_after: int | Literal["latest"] | datetime | None = Field(
        None, description="watermark to start after (rows <= it are never sent; a time for a timestamp watermark, "
        "without an offset read as UTC); \"latest\": only rows committed "
        "after the first cut; unset: from 0, refusing to start if rows with watermark <= 0 exist (they would be "
        "skipped silently). Where a table with no progress starts: changed once it has progress, it changes nothing "
        "(`rowrelay reset` moves a table)")
    envelope: bool = False
    topic_partitions: int = Field(1, ge=1, le=10_000)
    settle_seconds: float = Field(3.0, ge=0, le=3600, description="MariaDB/MySQL/SQLite: wait before a new "
                                  "max watermark counts as final")
    sensor_interval_seconds: int = Field(5, ge=1, le=86_400)
    max_slices_per_run: int = Field(20, ge=1, le=10_000, description="a backlog of slices runs as one run of up to "
                                    "this many slices (one worker start), each slice still its own transaction")
    skip_watermarks: list[int | datetime | SkipRow] = Field(
        default_factory=list, description="rows never to send (runbook), each named by its watermark (a time for a "
        "timestamp watermark) and, where rows share it, by its tie_break or key: {watermark: W, tie_break: T} or "
        "{watermark: W, key: {column: value}}; a bare watermark is refused where it matches more than one row")
    where: str | None = Field(
        None, min_length=1, max_length=4000, description="a row filter in the source's SQL, applied identically to "
        "counts, cuts and reads, e.g. \"status <> 'draft'\"; it must be immutable per row (a row never enters or "
        "leaves it once written), or rows are missed")
    on_schema_change: Literal["follow", "fail"] = Field(
        "follow", description="a column added, dropped or retyped since the last slice: follow (publish the new "
        "columns, noted in the slice's metadata) or fail (the table stops until `rowrelay schema accept`)")
    lag_timestamp_column: str | None = Field(
        None, description="a column with each row's insert time: lag in seconds is then the age of the oldest "
        "unpublished row; unset: the time since the last commit while rows wait")
    warn_lag_seconds: float = Field(300.0, gt=0, description="the lag check warns above this many seconds")
    error_lag_seconds: float = Field(3600.0, gt=0, description="the lag check fails (ERROR) above this many seconds")
    parity_read_back_max_rows: int = Field(1_000_000, ge=0, description="slice_parity reads each slice of a run "
                                           "back from Kafka (count and checksum) up to this many rows; larger "
                                           "slices are recounted at the source only (0: never read back)")
    rollup_after_seconds: float | None = Field(
        3600.0, ge=0, description="committed slices older than this roll up into one partition per hour of their "
        "commit (resources/history.py); null: every slice stays its own partition")
    rollup_daily_after_seconds: float = Field(86_400.0, ge=0, description="committed slices older than this roll "
                                              "up into one partition per day")
    rollup_monthly_after_seconds: float | None = Field(
        90 * 86_400.0, ge=0, description="committed slices older than this roll up into one partition per month; "
        "null: daily partitions stay")
    sensor_group: str | None = Field(None, pattern=r"^[A-Za-z0-9_]{1,64}$", description="tables with the same "
                                     "group share one slice sensor and one lag sensor (many tables: one daemon tick "
                                     "for all); unset: own sensors, grouped automatically beyond 20 tables")
    min_slice_rows: int = Field(1, ge=1, description="cut a slice only once this many rows wait (or the oldest "
                                "has waited max_slice_delay_seconds): fewer, larger slices for a trickle")
    max_slice_delay_seconds: float = Field(0.0, ge=0, le=86_400, description="the longest rows wait for "
                                           "min_slice_rows; 0: cut every tick (freshest)")

    @field_validator("where")
    @classmethod
    def _one_predicate(cls, v: str | None) -> str | None:
        # Spliced into the source's SQL as one predicate: statements or comments would change what it means.
        if v is not None and (";" in v or "--" in v or "/*" in v):
            raise ValueError("must be one SQL predicate, without ';' or comments")
        return v

    @model_validator(mode="after")
    def _key_columns_read(self) -> TableConfig:
        # A key is built from the columns read: one left out of `columns:` failed every run with a bare KeyError.
        if isinstance(self.key, list) and self.columns is not None:
            read = {*self.columns, self.watermark, *([self.tie_break] if self.tie_break else [])}
            if missing := [c for c in self.key if c not in read]:
                raise ValueError(f"key columns {missing} are not among the columns read ({self.columns}); add them "
                                 "to `columns:`")
        return self

    @model_validator(mode="after")
    def _lag_thresholds(self) -> TableConfig:
        if self.warn_lag_seconds > self.error_lag_seconds:
            raise ValueError(f"warn_lag_seconds ({self.warn_lag_seconds}) must not exceed error_lag_seconds "
                             f"({self.error_lag_seconds})")
        return self

    @field_validator("table")
    @classmethod
    def _table_name(cls, v: str) -> str:
        parts = v.split(".")
        if not 1 <= len(parts) <= 2 or not all(parts):
            raise ValueError(f"{v!r} is not [schema.]table")
        return v

    @field_validator("topic")
    @classmethod
    def _topic_name(cls, v: str | None) -> str | None:
        if v is not None and not _TOPIC.match(v):
            raise ValueError(f"{v!r} is not a valid Kafka topic name (letters, digits, . _ -; at most 249)")
        return v

    @property
    def start_after_watermark(self) -> int | None:
        """`start_after` as a watermark (a time as microseconds since 1970 UTC); None: unset or \"latest\"."""
        if isinstance(self.start_after, datetime):
            return datetime_to_micros(self.start_after)
        return self.start_after if isinstance(self.start_after, int) else None

    @property
    def skip_rows(self) -> list[RowSkip]:
        """`skip_watermarks` as rows to leave out (times as microseconds since 1970 UTC)."""
        def micros(w: int | datetime) -> int:
            return datetime_to_micros(w) if isinstance(w, datetime) else w

        out = []
        for entry in self.skip_watermarks:
            if not isinstance(entry, SkipRow):
                out.append(RowSkip(micros(entry)))
                continue
            named = {self.tie_break: entry.tie_break} if entry.tie_break is not None else entry.key or {}
            out.append(RowSkip(micros(entry.watermark), tuple(sorted((str(c), str(v)) for c, v in named.items()))))
        return out

    def skip_rows_in(self, lo: int, hi: int) -> list[RowSkip]:
        """The skipped rows inside a slice's range (lo, hi]."""
        return [s for s in self.skip_rows if lo < s.watermark <= hi]

    @model_validator(mode="after")
    def _skip_tie_break(self) -> TableConfig:
        # An entry named by tie_break needs the table's: which column it is a value of.
        if self.tie_break is None and any(isinstance(e, SkipRow) and e.tie_break is not None
                                          for e in self.skip_watermarks):
            raise ValueError("a skip_watermarks entry names its row by tie_break, but the table has no `tie_break:`; "
                             "name it by `key: {column: value}` instead")
        return self

    @property
    def schema_name(self) -> str | None:
        return self.table.split(".")[0] if "." in self.table else None

    @property
    def table_name(self) -> str:
        return self.table.split(".")[-1]

    @property
    def table_id(self) -> str:
        """<source>.<schema>.<table>: the table's identity in Kafka (progress topic, transactional id)."""
        return f"{self.source}.{self.schema_name or 'default'}.{self.table_name}"

    @property
    def topic_shared_with(self) -> tuple[str, ...]:
        """The other configured tables whose `topic:` is this table's."""
        return self._topic_shared_with

    @property
    def topic_name(self) -> str:
        # By default the table id, mapped (portable_name) where Kafka would refuse it: a space, non-ASCII.
        return self.topic or portable_name(self.table_id)

    @property
    def asset_path(self) -> list[str]:
        """The asset key's parts: <source>, <schema>, <table>, each mapped by portable_name only where Dagster
        refuses it. The true names stay in `table_id`, descriptions and metadata."""
        return [self.source, *(portable_name(p) for p in (self.schema_name or "default", self.table_name))]

    @property
    def dagster_name(self) -> str:
        """The stem of the table's job, sensor, partitions, pool and hook names: its asset key joined by "_", every
        character outside Dagster's name rule made "_" (as always for "." and "-"; the hash of a mapped part keeps
        "a b" and "a_b" apart)."""
        return _DAGSTER_REFUSED.sub("_", ".".join(self.asset_path))


# Producer settings rowrelay sets itself: a value in kafka.producer would be overridden or break the protocol.
_OWN_PRODUCER_SETTINGS = {
    "transactional.id": "rowrelay sets it per table (<transactional_id_prefix>.<table>); to keep two deployments "
                        "apart on one cluster, give each its own kafka.transactional_id_prefix",
    "delivery.report.only.error": "rowrelay records each slice's offsets from its delivery reports",
}


class KafkaConfig(_Strict):
    bootstrap_servers: str
    producer: dict[str, Any] = Field(default_factory=dict, description="extra librdkafka settings")
    transactional_id_prefix: str = DEFAULT_TRANSACTIONAL_ID_PREFIX

    @field_validator("producer")
    @classmethod
    def _settings_rowrelay_owns(cls, v: dict[str, Any]) -> dict[str, Any]:
        for name, why in _OWN_PRODUCER_SETTINGS.items():
            if name in v:
                raise ValueError(f"{name!r} cannot be set: {why}")
        return v

    @field_validator("transactional_id_prefix")
    @classmethod
    def _prefix_names_topics(cls, v: str) -> str:
        # It names each table's progress topic (_<prefix>.progress.<table>) and transactional id: a character a
        # topic name cannot hold failed every run with librdkafka's "Unknown topic", naming nothing.
        if not re.fullmatch(r"[A-Za-z0-9._-]+", v):
            raise ValueError(f"{v!r} may hold only letters, digits, '.', '_' and '-': it names each table's progress "
                             "topic (_<prefix>.progress.<table>) and transactional id")
        return v


class SparkConfig(_Strict):
    master: str = "local[*]"
    remote: str | None = Field(None, description="Spark Connect URL, e.g. sc://host:15002")
    conf: dict[str, str] = Field(default_factory=dict)


class RelayConfig(_Strict):
    sources: dict[str, SourceConfig]
    tables: list[TableConfig]
    kafka: KafkaConfig
    spark: SparkConfig = SparkConfig()

    @field_validator("sources")
    @classmethod
    def _source_names(cls, v: dict[str, SourceConfig]) -> dict[str, SourceConfig]:
        # A source's name is its tables' Dagster asset group and resource key: Dagster refuses anything else (a raw
        # DagsterInvalidDefinitionError that stopped every table of the config). Unlike a table's, the user picks it.
        if bad := [name for name in v if not _SOURCE_NAME.fullmatch(name)]:
            raise ValueError(f"source name(s) {bad} may hold only letters, digits and _ (a Dagster group name)")
        return v

    @model_validator(mode="after")
    def _cross_checks(self) -> RelayConfig:
        seen: set[str] = set()
        for i, t in enumerate(self.tables):
            if t.source not in self.sources:
                raise ValueError(f"tables[{i}].source: {t.source!r} is not one of sources: {sorted(self.sources)}")
            if t.table_id in seen:
                raise ValueError(f"tables[{i}]: table {t.table_id} is configured twice")
            seen.add(t.table_id)
            progress = progress_topic_name(self.kafka.transactional_id_prefix, t.table_id)
            if len(progress) > 249:
                raise ValueError(f"tables[{i}]: its progress topic {progress[:60]}... would be {len(progress)} "
                                 "characters, over Kafka's 249: shorten kafka.transactional_id_prefix")
        self._dagster_names_distinct()
        writers: dict[str, list[str]] = {}
        for t in self.tables:
            writers.setdefault(t.topic_name, []).append(t.table_id)
        for t in self.tables:
            t._topic_shared_with = tuple(w for w in writers[t.topic_name] if w != t.table_id)
        return self

    def _dagster_names_distinct(self) -> None:
        # Two tables under one Dagster name would stop the definitions of every table with Dagster's "duplicate
        # definition" (e.g. public.a-b and public.a_b: both s_public_a_b, as ever; or sources a and a__b, whose asset
        # ops coincide): refused here, naming both tables.
        for what, name_of in (("name (of their jobs, sensors and partitions)", lambda t: t.dagster_name),
                              ("asset op name", lambda t: dagster_op_name(t.asset_path))):
            owner: dict[str, tuple[int, TableConfig]] = {}
            for i, t in enumerate(self.tables):
                name = name_of(t)
                if name in owner:
                    j, first = owner[name]
                    raise ValueError(f"tables[{j}] ({first.table_id!r}) and tables[{i}] ({t.table_id!r}) map to "
                                     f"one Dagster {what}: {name!r} (Dagster names hold only letters, digits and _); "
                                     "relay one of them under another source name (a second `sources:` entry with "
                                     "the same url)")
                owner[name] = (i, t)


def _format_error(exc: ValidationError) -> str:
    lines = []
    known = {name for model in _Strict.__subclasses__() for name in model.model_fields}
    for err in exc.errors():
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        hint = ""
        if err["type"] == "extra_forbidden" and err["loc"] and isinstance(err["loc"][-1], str):
            close = difflib.get_close_matches(err["loc"][-1], sorted(known), n=1)  # a typo: name the key meant
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        lines.append(f"  {loc or '(top level)'}: {err['msg']}{hint}")
    return "\n".join(lines)


def parse_config(data: Any, origin: str = "rowrelay.yaml") -> RelayConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping with sources, tables and kafka")
    try:
        return RelayConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{origin} is invalid:\n{_format_error(exc)}") from None


def config_path() -> Path:
    return Path(os.environ.get("ROWRELAY_CONFIG", "rowrelay.yaml"))


def component_origin(path: Path) -> str:
    """How an error names a Dagster component's settings: the `attributes:` of the `defs.yaml` at `path` (the
    file, or the folder holding it)."""
    return f"{path / 'defs.yaml' if path.is_dir() else path} attributes"


def load_component_config(path: str | Path) -> RelayConfig:
    """The settings of the rowrelay component declared in a Dagster project's `defs.yaml` (`rowrelay --defs`): the
    `attributes:` of its document whose `type` is the RelayComponent, validated as `rowrelay.yaml` is."""
    p = Path(path)
    file = p / "defs.yaml" if p.is_dir() else p
    if not file.exists():
        raise ConfigError(f"component file {file} not found")
    try:
        documents = [d for d in yaml.safe_load_all(file.read_text()) if d is not None]
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file} is not valid YAML: {exc}") from None
    relays = [d for d in documents if isinstance(d, dict) and str(d.get("type", "")).endswith(".RelayComponent")]
    if len(relays) != 1:
        raise ConfigError(f"{file}: expected one component of type orchestration.component.RelayComponent, found "
                          f"{len(relays)}")
    return parse_config(relays[0].get("attributes") or {}, component_origin(file))


def load_config(path: str | Path | None = None) -> RelayConfig:
    p = Path(path) if path is not None else config_path()
    if not p.exists():
        hint = "" if path is not None else " (set ROWRELAY_CONFIG to its path, or pass --config)"
        raise ConfigError(f"configuration file {p} not found{hint}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p} is not valid YAML: {exc}") from None
    return parse_config(data, str(p))
