"""Demo data for `make run` (stack/demo.yaml): source tables in the local stack and a writer that keeps adding rows.

    python -m stack.demo setup               # create + seed the tables (idempotent)
    python -m stack.demo write [--rate N]    # insert ~N rows/s per table until killed
    python -m stack.demo pools               # create the tables' Dagster pools (needs DAGSTER_HOME)

Connection settings come from the ROWRELAY_* env vars (stack.env); missing ones are read from stack.env.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pymysql

DEMO_DB = "rowrelay_demo"
SEED_ROWS = {"orders": 3000, "events": 2500, "page_views": 4000}
CUSTOMERS = ["ada", "grace", "linus", "barbara", "ken", "margaret", "dennis", "frances"]
KINDS = ["signup", "login", "checkout", "refund", "logout"]
URLS = ["/", "/shop", "/shop/cart", "/shop/checkout", "/docs", "/docs/relay", "/about"]

PG_DDL = [
    "CREATE TABLE IF NOT EXISTS public.orders (id bigserial PRIMARY KEY, customer text, total numeric(12,2), "
    "created_at timestamptz DEFAULT now())",
    "CREATE TABLE IF NOT EXISTS public.events (id bigserial PRIMARY KEY, kind text, payload jsonb, ts timestamp)",
]
MARIADB_DDL = ("CREATE TABLE IF NOT EXISTS page_views (id bigint AUTO_INCREMENT PRIMARY KEY, url varchar(255), "
               "ms int, at datetime(6))")


def log(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def _env() -> dict[str, str]:
    """The process env, completed from stack.env so the module also works outside `make`."""
    wanted = ("ROWRELAY_PG_HOST", "ROWRELAY_PG_PORT", "ROWRELAY_PG_USER", "ROWRELAY_PG_PASSWORD",
              "ROWRELAY_MARIADB_HOST", "ROWRELAY_MARIADB_PORT", "ROWRELAY_MARIADB_USER", "ROWRELAY_MARIADB_PASSWORD")
    env = dict(os.environ)
    if any(k not in env for k in wanted):
        from stack.local import load_env_file

        env = {**load_env_file(), **env}
    return env


def pg_connect(env: dict[str, str]) -> psycopg.Connection[Any]:
    return psycopg.connect(host=env["ROWRELAY_PG_HOST"], port=int(env["ROWRELAY_PG_PORT"]),
                           user=env["ROWRELAY_PG_USER"], password=env["ROWRELAY_PG_PASSWORD"], dbname=DEMO_DB,
                           connect_timeout=10)


def mariadb_connect(env: dict[str, str]) -> pymysql.connections.Connection[Any]:
    return pymysql.connect(host=env["ROWRELAY_MARIADB_HOST"], port=int(env["ROWRELAY_MARIADB_PORT"]),
                           user=env["ROWRELAY_MARIADB_USER"], password=env["ROWRELAY_MARIADB_PASSWORD"],
                           database=DEMO_DB, connect_timeout=10, autocommit=False)


# --------------------------------------------------------------------------- rows


def order_row(rng: random.Random) -> tuple[Any, ...]:
    return (rng.choice(CUSTOMERS), Decimal(rng.randint(100, 500_000)) / 100)


def event_row(rng: random.Random) -> tuple[Any, ...]:
    payload = {"user": rng.randint(1, 500), "ok": rng.random() > 0.1, "amount": f"{rng.uniform(1, 99):.2f}"}
    return (rng.choice(KINDS), json.dumps(payload), datetime.now() - timedelta(milliseconds=rng.randint(0, 5000)))


def page_view_row(rng: random.Random) -> tuple[Any, ...]:
    return (rng.choice(URLS), rng.randint(3, 2500), datetime.now())


@dataclass(frozen=True)
class DemoTable:
    name: str
    database: str  # "pg" | "mariadb"
    insert: str
    row: Callable[[random.Random], tuple[Any, ...]]


TABLES = [
    DemoTable("orders", "pg", "INSERT INTO public.orders (customer, total) VALUES (%s, %s)", order_row),
    DemoTable("events", "pg", "INSERT INTO public.events (kind, payload, ts) VALUES (%s, %s::jsonb, %s)", event_row),
    DemoTable("page_views", "mariadb", "INSERT INTO page_views (url, ms, at) VALUES (%s, %s, %s)", page_view_row),
]


def _connect(table: DemoTable, env: dict[str, str]) -> Any:
    return pg_connect(env) if table.database == "pg" else mariadb_connect(env)


def insert_rows(conn: Any, table: DemoTable, rows: list[tuple[Any, ...]]) -> None:
    """One transaction: all rows or none."""
    with conn.cursor() as cur:
        cur.executemany(table.insert, rows)
    conn.commit()


# --------------------------------------------------------------------------- setup


def setup() -> None:
    env = _env()
    rng = random.Random(42)
    with pg_connect(env) as conn:
        for ddl in PG_DDL:
            conn.execute(ddl)
        conn.commit()
    my = mariadb_connect(env)
    try:
        with my.cursor() as cur:
            cur.execute(MARIADB_DDL)
        my.commit()
    finally:
        my.close()
    for table in TABLES:
        conn = _connect(table, env)
        try:
            with conn.cursor() as cur:
                cur.execute(f"SELECT COUNT(*) FROM {table.name}")
                count = int(cur.fetchone()[0])
            conn.commit()
            # Seed only an empty table, so re-running setup never multiplies the demo data.
            if count == 0:
                insert_rows(conn, table, [table.row(rng) for _ in range(SEED_ROWS[table.name])])
                count = SEED_ROWS[table.name]
                log(f"{table.database}:{DEMO_DB}.{table.name}: seeded {count} rows")
            else:
                log(f"{table.database}:{DEMO_DB}.{table.name}: exists with {count} rows")
        finally:
            conn.close()


# --------------------------------------------------------------------------- pools


def init_pools() -> None:
    """Create each configured table's pool on the instance (DAGSTER_HOME) before the daemon starts.

    The run queue creates a pool's default limit only when it first sees a queued run of that pool, and
    in that same pass it does not enforce the limit yet, so two runs of one table could start together.
    """
    from dagster import DagsterInstance

    from assets.identity import pool_name
    from orchestration.instance import ensure_pool
    from resources.config import load_config

    config = load_config()
    with DagsterInstance.get() as instance:
        for table in config.tables:
            pool = pool_name(table)
            ensure_pool(instance, pool)
            info = instance.event_log_storage.get_concurrency_info(pool)
            log(f"pool {pool}: limit {info.limit}")


# --------------------------------------------------------------------------- writer


def writer_loop(table: DemoTable, env: dict[str, str], rate: float, stop: threading.Event, seed: int) -> None:
    """Small transactions (1-3 rows) at about `rate` rows/s; reconnects when the database goes away."""
    rng = random.Random(seed)
    conn: Any = None
    while not stop.is_set():
        try:
            if conn is None:
                conn = _connect(table, env)
            rows = [table.row(rng) for _ in range(rng.randint(1, 3))]
            insert_rows(conn, table, rows)
            # Exponential gaps around the mean keep commits of concurrent writers interleaving irregularly.
            stop.wait(rng.expovariate(rate / len(rows)) if rate > 0 else 1.0)
        except Exception as exc:  # a demo writer outlives a database restart
            log(f"{table.name}: {type(exc).__name__}: {exc}; reconnecting in 2s")
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
                conn = None
            stop.wait(2.0)
    if conn is not None:
        conn.close()


def write(rate: float, writers: int, exit_with_parent: bool) -> None:
    env = _env()
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    threads = [
        threading.Thread(target=writer_loop, name=f"{t.name}-{i}", daemon=True,
                         args=(t, env, rate / writers, stop, 1000 * n + i))
        for n, t in enumerate(TABLES) for i in range(writers)
    ]
    for th in threads:
        th.start()
    log(f"writing ~{rate:g} rows/s into each of {', '.join(t.name for t in TABLES)} with {writers} writers per "
        "table; stop with SIGTERM/Ctrl-C")
    parent = os.getppid()
    while not stop.wait(1.0):
        # run-demo.sh execs `dagster dev`, so its EXIT trap is gone: follow the parent instead.
        if exit_with_parent and os.getppid() != parent:
            log("parent process exited; stopping")
            stop.set()
    for th in threads:
        th.join(timeout=10)
    log("writer stopped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stack.demo", description="rowrelay demo tables and writer")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("setup", help="create and seed the demo tables (idempotent)")
    w = sub.add_parser("write", help="keep inserting rows until killed")
    w.add_argument("--rate", type=float, default=3.0, help="rows per second per table (default 3)")
    w.add_argument("--writers", type=int, default=2, help="concurrent writers per table (default 2)")
    w.add_argument("--exit-with-parent", action="store_true", help="stop when the parent process exits")
    sub.add_parser("pools", help="create the configured tables' pools on the Dagster instance (DAGSTER_HOME)")
    args = parser.parse_args(argv)
    if args.cmd == "setup":
        setup()
    elif args.cmd == "pools":
        init_pools()
    else:
        write(args.rate, max(1, args.writers), args.exit_with_parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
