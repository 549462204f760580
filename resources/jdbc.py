"""SQLAlchemy URL -> Spark JDBC options (URL, driver, credentials, connection parameters) per database.

The URL's query holds the Python driver's connection parameters (libpq-style for psycopg, pymysql's for
MariaDB/MySQL); SQLAlchemy honours them, so Spark's JDBC reads must too (TLS above all). Each is mapped to the
JDBC driver's own property (pgjdbc 42.7, MariaDB Connector/J 3.5); one with no equivalent is an error naming it,
never silently dropped. Properties go to Spark as options (passed to the driver, redacted in Spark's logs when
secret), never into the JDBC URL. Error messages name keys only: values may be secrets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import sqlalchemy as sa

from resources.errors import RowrelayError

# libpq/pgjdbc sslmode values (pgjdbc knows all six).
PG_SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
# libpq parameter -> pgjdbc property of the same meaning.
PG_PROPERTIES = {
    "sslmode": "sslmode", "sslrootcert": "sslrootcert", "sslcert": "sslcert",
    "sslkey": "sslkey",  # pgjdbc reads a PKCS-8 DER (.pk8) or PKCS-12 (.p12) key, not libpq's PEM
    "sslpassword": "sslpassword", "application_name": "ApplicationName", "connect_timeout": "connectTimeout",
    "options": "options", "gssencmode": "gssEncMode",
}
# Accepted with no property: pgjdbc always talks UTF-8.
PG_UTF8_ONLY = {"client_encoding"}
# Accepted with no property: Connector/J always talks utf8mb4 and decodes text as Unicode.
MYSQL_NO_EFFECT = {"charset": ("utf8", "utf8mb4", "utf8mb3"), "use_unicode": ("1", "true", "yes", "on")}
MYSQL_SSL_KEYS = ("ssl_ca", "ssl_check_hostname", "ssl_verify_cert", "ssl_verify_identity", "ssl_disabled")
MYSQL_SECONDS_TO_MS = {"connect_timeout": "connectTimeout", "read_timeout": "socketTimeout"}
MYSQL_UNSUPPORTED = {
    "ssl_cert": "MariaDB Connector/J takes a client certificate only from a key store (keyStore, "
                "keyStorePassword), not from PEM files",
    "ssl_key": "MariaDB Connector/J takes a client key only from a key store (keyStore, keyStorePassword), "
               "not from PEM files",
    "ssl_key_password": "MariaDB Connector/J takes a client key only from a key store",
    "ssl_capath": "MariaDB Connector/J takes one CA file: use ssl_ca",
    "ssl_cipher": "cipher names differ between OpenSSL and Java: leave ssl_cipher out",
}
TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class UrlParameterError(RowrelayError, ValueError):
    """A source URL parameter the JDBC driver cannot honour; the message names it and says what to do."""


def _single(query: Mapping[str, str | tuple[str, ...]], key: str) -> str:
    value = query[key]
    if isinstance(value, tuple):
        raise UrlParameterError(f"source URL parameter {key!r} is given {len(value)} times; give it once")
    return value


def _flag(key: str, value: str) -> bool:
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise UrlParameterError(f"source URL parameter {key!r} must be true or false")


def _seconds(key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise UrlParameterError(f"source URL parameter {key!r} must be a number of seconds") from None


def _unknown(key: str, dialect: str, known: list[str]) -> UrlParameterError:
    return UrlParameterError(
        f"source URL parameter {key!r} has no equivalent for Spark's {dialect} JDBC driver, so Spark's reads "
        f"could not honour it; remove it from the URL (supported: {', '.join(sorted(known))})")


def postgres_properties(query: Mapping[str, str | tuple[str, ...]]) -> dict[str, str]:
    """libpq-style parameters (psycopg) -> pgjdbc connection properties."""
    props: dict[str, str] = {}
    for key in query:
        value = _single(query, key)
        if key in PG_PROPERTIES:
            if key == "sslmode" and value not in PG_SSL_MODES:
                raise UrlParameterError(f"source URL parameter 'sslmode' must be one of {', '.join(PG_SSL_MODES)}")
            if key == "connect_timeout":
                value = str(max(0, int(_seconds(key, value))))
            props[PG_PROPERTIES[key]] = value
        elif key in PG_UTF8_ONLY and value.replace("-", "").lower() == "utf8":
            continue
        else:
            raise _unknown(key, "PostgreSQL", [*PG_PROPERTIES, *PG_UTF8_ONLY])
    return props


def mysql_properties(query: Mapping[str, str | tuple[str, ...]]) -> dict[str, str]:
    """pymysql parameters -> MariaDB Connector/J 3.x properties, TLS verification as pymysql would do it.

    pymysql (through SQLAlchemy's `ssl` dict) verifies the server's certificate and host name once a CA is
    given, unless ssl_verify_cert / ssl_check_hostname (ssl_verify_identity) say otherwise; with TLS asked for
    but no CA it encrypts without verifying (Connector/J: trust).
    """
    props: dict[str, str] = {}
    values = {key: _single(query, key) for key in query}
    for key, value in values.items():
        if key in MYSQL_SSL_KEYS:
            continue
        if key in MYSQL_SECONDS_TO_MS:
            props[MYSQL_SECONDS_TO_MS[key]] = str(int(_seconds(key, value) * 1000))
        elif key in MYSQL_UNSUPPORTED:
            raise UrlParameterError(f"source URL parameter {key!r} cannot reach Spark's reads: "
                                    f"{MYSQL_UNSUPPORTED[key]}")
        elif key in MYSQL_NO_EFFECT and value.lower() in MYSQL_NO_EFFECT[key]:
            continue
        else:
            raise _unknown(key, "MariaDB/MySQL", [*MYSQL_SSL_KEYS, *MYSQL_SECONDS_TO_MS, *MYSQL_NO_EFFECT])
    if "ssl_disabled" in values and _flag("ssl_disabled", values["ssl_disabled"]):
        props["sslMode"] = "disable"
        return props
    if not any(k in values for k in MYSQL_SSL_KEYS):
        return props
    has_ca = "ssl_ca" in values
    verify_cert = _flag("ssl_verify_cert", values["ssl_verify_cert"]) if "ssl_verify_cert" in values else has_ca
    identity_key = next((k for k in ("ssl_verify_identity", "ssl_check_hostname") if k in values), None)
    verify_host = _flag(identity_key, values[identity_key]) if identity_key else verify_cert and has_ca
    if (verify_cert or verify_host) and not has_ca:
        raise UrlParameterError("source URL asks to verify the server's certificate but gives no CA: add ssl_ca "
                                "(Spark's MariaDB driver does not read the system's CA store)")
    props["sslMode"] = "verify-full" if verify_host else "verify-ca" if verify_cert else "trust"
    if has_ca:
        props["serverSslCert"] = values["ssl_ca"]
    return props


def _no_parameters(query: Mapping[str, str | tuple[str, ...]]) -> dict[str, str]:
    if query:
        raise _unknown(next(iter(query)), "SQLite", [])
    return {}


PROPERTY_MAPPERS: dict[str, Callable[[Mapping[str, str | tuple[str, ...]]], dict[str, str]]] = {
    "postgresql": postgres_properties, "mysql": mysql_properties, "sqlite": _no_parameters,
}


def jdbc_options(url: sa.URL, dialect: str) -> dict[str, Any]:
    """What Spark's JDBC source needs to read the database at `url` (a resolved SQLAlchemy URL, query included)."""
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
    opts: dict[str, Any] = {"url": jdbc, "driver": driver, **PROPERTY_MAPPERS[dialect](url.query)}
    if url.username:
        opts["user"] = url.username
    if url.password:
        opts["password"] = url.password
    return opts
