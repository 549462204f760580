"""SQLAlchemy URL -> Spark JDBC options (URL, driver, credentials) per database."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa


def jdbc_options(url: sa.URL, dialect: str) -> dict[str, Any]:
    """What Spark's JDBC source needs to read the database at `url` (a resolved SQLAlchemy URL)."""
    if dialect == "postgresql":
        jdbc = f"jdbc:postgresql://{url.host}:{url.port or 5432}/{url.database}"
        driver = "org.postgresql.Driver"
    elif dialect == "mysql":
        # jdbc:mysql (permitMysqlScheme) makes Spark use its MySQL dialect (backtick quoting);
        # tinyInt1isBit=false keeps TINYINT(1) an integer.
        jdbc = (f"jdbc:mysql://{url.host}:{url.port or 3306}/{url.database}"
                "?permitMysqlScheme&tinyInt1isBit=false&connectionTimeZone=UTC&forceConnectionTimeZoneToSession=true")
        driver = "org.mariadb.jdbc.Driver"
    elif dialect == "sqlite":
        jdbc = f"jdbc:sqlite:{url.database}"
        driver = "org.sqlite.JDBC"
    else:
        raise ValueError(f"no JDBC mapping for dialect {dialect}")
    opts: dict[str, Any] = {"url": jdbc, "driver": driver}
    if url.username:
        opts["user"] = url.username
    if url.password:
        opts["password"] = url.password
    return opts
