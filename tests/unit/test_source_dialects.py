"""The source database's dialect strategies and their pure parts: chosen by name once, each filling its hooks."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql

from resources.source_database.cache import KeptAnswers
from resources.source_database.dialect import Dialect
from resources.source_database.errors import SourceError
from resources.source_database.mariadb import MariaDB
from resources.source_database.postgresql import PostgreSQL
from resources.source_database.rendering import read_rules
from resources.source_database.shape import ColumnInfo, TableShape
from resources.source_database.source import DIALECTS, SourceDatabase
from resources.source_database.sqlite import SQLite


def _source(url: str) -> SourceDatabase:
    source = SourceDatabase()
    source.url, source.tables_written_here, source._engine = url, False, None
    return source


def test_each_url_gets_its_database_strategy_and_others_the_base() -> None:
    assert isinstance(_source("postgresql://u@h/db").strategy, PostgreSQL)
    assert isinstance(_source("postgres://u@h/db").strategy, PostgreSQL)
    assert isinstance(_source("mariadb://u@h/db").strategy, MariaDB)
    assert isinstance(_source("mysql+pymysql://u@h/db").strategy, MariaDB)
    assert isinstance(_source("sqlite:///x.db").strategy, SQLite)
    other = _source("oracle://u@h/db").strategy
    assert type(other) is Dialect and other.name == "oracle"
    assert set(DIALECTS) == {"postgresql", "mysql", "sqlite"}


def test_the_strategies_name_their_source_rendered_kinds() -> None:
    pg, maria = DIALECTS["postgresql"], DIALECTS["mysql"]
    assert pg.source_text(sa.DateTime(timezone=True)) == "timestamptz"
    assert pg.source_text(sa.DateTime()) == "timestamp"
    assert pg.source_text(sa.Date()) == "date"
    assert maria.source_text(mysql.DATETIME()) == "mysql_datetime"
    assert maria.source_text(mysql.FLOAT()) == "mysql_float"
    assert DIALECTS["sqlite"].source_text(sa.DateTime()) == ""


def test_timestamp_watermarks_by_database() -> None:
    assert DIALECTS["postgresql"].timestamp_kind("t", "at", sa.DateTime(timezone=True)) == "timestamptz"
    assert DIALECTS["mysql"].timestamp_kind("t", "at", mysql.DATETIME(fsp=6)) == "timestamp"
    for dialect, wm_type, says in ((DIALECTS["mysql"], mysql.TIMESTAMP(), "must be DATETIME"),
                                   (DIALECTS["sqlite"], sa.DateTime(), "not on sqlite")):
        try:
            dialect.timestamp_kind("t", "at", wm_type)
        except SourceError as exc:
            assert says in str(exc)
        else:
            raise AssertionError(f"{dialect.name} accepted {wm_type}")
    assert DIALECTS["mysql"].fractional_digits(mysql.DATETIME()) == 0
    assert DIALECTS["postgresql"].fractional_digits(postgresql.TIMESTAMP()) == 6
    assert DIALECTS["postgresql"].fractional_digits(postgresql.TIMESTAMP(precision=0)) == 0


def test_types_a_database_cannot_send() -> None:
    assert DIALECTS["mysql"].cannot_read(sa.Uuid()) and not DIALECTS["postgresql"].cannot_read(sa.Uuid())
    assert DIALECTS["sqlite"].cannot_read(sa.JSON()) and not DIALECTS["mysql"].cannot_read(sa.JSON())
    domain = postgresql.DOMAIN("positive", postgresql.DOMAIN("whole", sa.Integer()))
    assert isinstance(DIALECTS["postgresql"].base_type(domain), sa.Integer)


def test_read_rules_of_the_select_list() -> None:
    assert read_rules("mysql").names_every_column and not read_rules("postgresql").names_every_column
    assert read_rules("postgresql").reads_as_text("NUMERIC(10, 2)") and read_rules("postgresql").reads_as_text("REAL")
    assert not read_rules("mysql").reads_as_text("DECIMAL(10, 2)") and read_rules("mysql").reads_as_text(
        "DECIMAL(65, 30)")
    assert not read_rules("sqlite").reads_as_text("NUMERIC(78, 0)")

    def col(name: str, type_name: str = "INTEGER") -> ColumnInfo:
        return ColumnInfo(name=name, type_name=type_name, nullable=True, is_json=False, is_integer=False)

    plain = TableShape(dialect="mysql", schema=None, name="t", watermark="id", columns=(col("id"), col("v")))
    assert plain.rendered_select(lambda n: f"`{n}`") == "`id`, `v`"  # MariaDB: always every column by name
    tied = TableShape(dialect="postgresql", schema=None, name="t", watermark="id", tie_break="n",
                      columns=(col("id"), col("n", "NUMERIC")))
    assert tied.rendered_select(lambda n: n) == (
        "id, n, ROW_NUMBER() OVER (PARTITION BY id ORDER BY n NULLS FIRST) AS __rowrelay_tie_order")


def test_kept_answers_keep_the_most_recent_within_their_limit() -> None:
    kept, asked = KeptAnswers(limit=2), []

    def ask(value: int) -> int:
        asked.append(value)
        return value

    assert [kept.answer((k,), lambda k=k: ask(k)) for k in (1, 2, 1, 3, 1, 2)] == [1, 2, 1, 3, 1, 2]
    assert asked == [1, 2, 3, 2]  # 2 went out when 3 came in; 1, asked again in between, stayed
    kept.forget((1,))
    assert kept.answer((1,), lambda: ask(10)) == 10
