"""`rowrelay status` (each table's committed progress, lag and active runs) and `rowrelay pools`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dagster import DagsterInstance
from rich.console import Console
from rich.table import Table

from assets.identity import pool_name
from orchestration.cli.errors import each_table
from orchestration.instance import ensure_pool
from orchestration.status import active_runs, table_status
from orchestration.tables import select_tables
from resources.config import RelayConfig
from resources.slices import watermark_text


def cmd_status(config: RelayConfig, args: argparse.Namespace) -> int:
    tables = select_tables(config, args.table)
    lags, failed = each_table(config, tables, lambda t: table_status(config, t), "no status")
    if not lags:
        return 1
    rows = [lag.as_dict() for lag in lags]
    active = active_runs(tables)
    for row in rows:
        row["active_runs"] = active.get(row["table"]) if active is not None else None
    for lag in lags:
        if (behind := lag.source_behind) is not None:
            print(f"rowrelay: warning: {behind}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 1 if failed else 0
    view = Table(title="rowrelay status", title_justify="left")
    for column in ("table", "committed", "source max", "lag rows", "skipped rows", "lag s", "lag measured as",
                   "last commit", "active runs"):
        view.add_column(column, justify="right" if column in ("committed", "source max", "lag rows", "skipped rows",
                                                             "lag s", "active runs") else "left",
                        no_wrap=column in ("committed", "source max"))  # a time watermark reads whole
    basis = {"oldest_unpublished_row": "age of oldest unpublished row", "since_last_commit": "time since last commit",
             "caught_up": "caught up", "unknown": "rows wait, nothing committed yet",
             "awaiting_baseline": "start_after: latest, baseline not recorded yet",
             "since_first_run": "nothing committed; since the table's first run"}

    def cell(value: Any) -> str:
        return "-" if value is None else str(value)

    def mark(row: dict[str, Any], value: int | None) -> str:  # a timestamp watermark as its UTC time
        timestamps = row.get("watermark_kind", "integer") != "integer"
        return cell(value) if value is None else watermark_text(value, timestamps)

    for row in rows:
        view.add_row(row["table"], mark(row, row["committed_hi"]), mark(row, row["source_max"]),
                     cell(row["lag_rows"]), cell(row["skipped_rows"]), cell(row["lag_seconds"]),
                     basis[row["lag_basis"]], cell(row["last_commit_at"]), cell(row["active_runs"]))
    Console(width=max(160, Console().width)).print(view)
    return 1 if failed else 0


def cmd_pools(config: RelayConfig, args: argparse.Namespace) -> int:
    with DagsterInstance.get() as instance:
        for t in select_tables(config, args.table):
            ensure_pool(instance, pool_name(t))
            print(f"pool {pool_name(t)}: limit {instance.event_log_storage.get_concurrency_info(pool_name(t)).limit}")
    return 0
