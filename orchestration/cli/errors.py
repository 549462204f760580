"""What a `rowrelay` command says instead of a traceback: an error a user causes or fixes, named with what to
check; and the Dagster settings a command needs before it starts."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from resources.config import RelayConfig, TableConfig

NO_DAGSTER_HOME = ("set DAGSTER_HOME to the directory holding rowrelay's dagster.yaml (this checkout): the command "
                   "records on the Dagster instance; nothing was done")


def dagster_home_set() -> bool:
    """True if DAGSTER_HOME is set; else says so (`NO_DAGSTER_HOME`) for a command that records on the instance."""
    if os.environ.get("DAGSTER_HOME"):
        return True
    print(f"rowrelay: {NO_DAGSTER_HOME}", file=sys.stderr)
    return False


def each_table(config: RelayConfig, tables: list[TableConfig], work: Callable[[TableConfig], Any], failing: str
               ) -> tuple[list[Any], int]:
    """`work` for each table, and how many failed: one table's error a user can act on (`user_error`) is printed
    and must not hide the other tables' results; any other error is a defect and raised."""
    results, failed = [], 0
    for table in tables:
        try:
            results.append(work(table))
        except Exception as exc:
            message = user_error(exc, config)
            if message is None:
                raise
            print(f"rowrelay: {table.table_id} {failing}: {message}", file=sys.stderr)
            failed += 1
    return results, failed


def source_error_text(exc: Any, config: RelayConfig | None) -> str:
    """A source database that cannot be reached or refuses the login: which source, and the setting and variables
    its URL takes (SourceDatabaseResource marks the error with the URL as configured). Imported only here, once
    something failed, for start-up time: the happy path does not import the source drivers for it."""
    from resources.source_database import SourceDatabaseResource

    cause = (str(exc.orig).strip().splitlines() or ["no detail"])[0]
    url = getattr(exc, "source_url", None)
    names = [n for n, src in (config.sources.items() if config else []) if src.url == url]
    if url is None or not names:
        return f"a database could not be reached or refused the request: {cause}"
    where = SourceDatabaseResource(url=url).sqlalchemy_url.render_as_string(hide_password=True)
    variables = re.findall(r"\$\{(\w+)", url)
    takes = f" and the environment variable{'s' if len(variables) > 1 else ''} it reads ({', '.join(variables)})" \
        if variables else ""
    return (f"source {names[0]!r} ({where}) could not be reached or refused the login: {cause}; check "
            f"sources.{names[0]}.url in rowrelay.yaml{takes}")


def dagster_storage_text(exc: BaseException) -> str:
    """dagster-postgres's `too many retries for DB connection`: the database it tried, and the settings to check."""
    cause = str(exc.__cause__ or exc).strip().splitlines()
    env = {k: os.environ.get(f"DAGSTER_PG_{k}", "?") for k in ("DB", "HOST", "PORT", "USER")}
    return (f"the Dagster storage database {env['DB']!r} on {env['HOST']}:{env['PORT']} (user {env['USER']}) could "
            f"not be reached: {cause[0] if cause else exc}; check the DAGSTER_PG_DB, DAGSTER_PG_HOST, DAGSTER_PG_PORT, "
            "DAGSTER_PG_USER and DAGSTER_PG_PASSWORD settings rowrelay's dagster.yaml reads (in DAGSTER_HOME="
            f"{os.environ.get('DAGSTER_HOME', '')}); `make stack` writes the local stack's to stack.env")


def dagster_home_problem() -> str | None:
    """DAGSTER_HOME set to a directory without a dagster.yaml: Dagster would keep runs and records in SQLite files of
    its own there, out of the daemon's sight, and say nothing."""
    home = os.environ.get("DAGSTER_HOME")
    if not home or os.path.isfile(os.path.join(home, "dagster.yaml")):
        return None
    return (f"DAGSTER_HOME={home} holds no dagster.yaml: set DAGSTER_HOME to the directory holding rowrelay's "
            "dagster.yaml (the checkout), or copy it there; nothing was done")


class StorageRetryLines(logging.Filter):
    """dagster-postgres logs each retry of its storage connection on the root logger (`WARNING:root:Retrying failed
    database connection`): noise before the one line that says what failed and what to check."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Retrying failed database")


STORAGE_RETRY_LINES = StorageRetryLines()


def user_error(exc: BaseException, config: RelayConfig | None = None) -> str | None:
    """The message for an error a user causes or fixes (a database or Kafka away, a table missing, DAGSTER_HOME
    unset, a run's slices changed under it), instead of a traceback; None for anything else. Imported only here,
    once something failed, for start-up time: the happy path does not import these modules for it."""
    import sqlalchemy as sa
    from dagster import DagsterInvalidInvocationError
    from dagster._core.errors import DagsterHomeNotSetError  # not exported publicly; what DagsterInstance.get raises

    from resources.errors import RowrelayError

    if isinstance(exc, RowrelayError):  # every refusal and user-fixable failure rowrelay raises itself
        return str(exc)
    if isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError):
        return source_error_text(exc, config)
    if type(exc).__name__ == "DagsterPostgresException":  # dagster-postgres gave up connecting to its storage
        return dagster_storage_text(exc)
    if isinstance(exc, DagsterHomeNotSetError):
        return NO_DAGSTER_HOME
    if isinstance(exc, DagsterInvalidInvocationError) and "partition" in str(exc).lower():
        return ("the table's slices changed while this command ran (a `rowrelay reset` or another cut deleted "
                f"them): {str(exc).splitlines()[0]}; what committed stays committed: run the command again")
    return None
