"""The writer kinds: what each does to a table, on PostgreSQL and MariaDB, recorded in the model.

Every row carries a `tok` drawn from the schedule's seed, a value `v` and a text `s` of drawn length. A held
kind leaves its transaction open (a connection of its own) until the schedule's `end` step for it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

from tests.explorer.model import TableModel
from tests.explorer.schedule import TABLES

DDL = {
    ("pg", "int"): "CREATE TABLE {t} (id bigserial PRIMARY KEY, tok text NOT NULL, v bigint, s text)",
    ("pg", "ts"): "CREATE TABLE {t} (id bigserial PRIMARY KEY, ts timestamptz NOT NULL DEFAULT now(), "
                  "tok text NOT NULL, v bigint, s text)",
    ("maria", "int"): "CREATE TABLE {t} (id bigint AUTO_INCREMENT PRIMARY KEY, tok varchar(32) NOT NULL, v bigint, "
                      "s varchar(300))",
    ("maria", "ts"): "CREATE TABLE {t} (id bigint AUTO_INCREMENT PRIMARY KEY, ts DATETIME(6) NOT NULL DEFAULT "
                     "NOW(6), tok varchar(32) NOT NULL, v bigint, s varchar(300))",
}
# The time a kind writes into `ts` (None: the column's default, the transaction's or statement's now()).
WHOLE_SECOND = {"pg": "date_trunc('second', now())", "maria": "NOW()"}
CLOCK = {"pg": "SELECT clock_timestamp()", "maria": "SELECT NOW(6)"}


def table_name(index: int) -> str:
    dialect, wm = TABLES[index]
    return f"x_{dialect}_{wm}"


@dataclass
class Writers:
    """Carries out write and end steps on the tables (`engines` by dialect), keeping `models` up to date."""

    engines: dict[str, Engine]
    models: dict[int, TableModel] = field(default_factory=dict)
    held: dict[int, tuple[Connection, Any, str]] = field(default_factory=dict)  # txn -> (connection, its txn, kind)

    def create_tables(self, tables: tuple[int, ...]) -> None:
        for i in tables:
            with self.engines[TABLES[i][0]].begin() as conn:
                conn.execute(text(DDL[TABLES[i]].format(t=table_name(i))))
                if TABLES[i][1] == "ts":
                    conn.execute(text(f"CREATE INDEX {table_name(i)}_ts ON {table_name(i)} (ts)"))
            self.models[i] = TableModel()

    def write(self, table: int, args: dict[str, Any]) -> None:
        dialect = TABLES[table][0]
        rng, kind, txn = random.Random(args["seed"]), args["writer"], args.get("txn")
        rows = [{"tok": f"{args['seed']}-{n}", "v": rng.randint(-10**12, 10**12),
                 "s": "".join(rng.choice("abcxyz é") for _ in range(rng.randint(0, 40)))}
                for n in range(args["rows"])]
        if kind == "autocommit":
            for row in rows:  # each row its own commit
                self._insert(self.engines[dialect], table, [row], None)
            self.models[table].written(None, [r["tok"] for r in rows])
            return
        conn = self.engines[dialect].connect()
        tx = conn.begin()
        stamp = None
        if kind == "client_stamped":  # a time read from the database's clock, written later in the transaction
            with self.engines[dialect].connect() as other:
                stamp = other.execute(text(CLOCK[dialect])).scalar()
        self._insert(conn, table, rows, WHOLE_SECOND[dialect] if kind == "whole_second" else None, stamp)
        if kind == "out_of_order":  # a later id (and time) committed before this transaction's
            late = {"tok": f"{args['seed']}-late", "v": 0, "s": "late"}
            self._insert(self.engines[dialect], table, [late], None)
            self.models[table].written(None, [late["tok"]])
        if txn is None:
            (tx.commit if kind != "rollback" else tx.rollback)()
            conn.close()
            self.models[table].written(None, [] if kind == "rollback" else [r["tok"] for r in rows])
            if kind == "rollback":
                self.models[table].rolled_back.update(r["tok"] for r in rows)
            return
        self.held[txn] = (conn, tx, kind)
        self.models[table].written(txn, [r["tok"] for r in rows])

    def end(self, table: int, args: dict[str, Any]) -> None:
        conn, tx, kind = self.held.pop(args["txn"])
        commit = args["commit"] and kind != "rollback"
        (tx.commit if commit else tx.rollback)()
        conn.close()
        self.models[table].ended(args["txn"], commit)

    def end_all(self) -> None:
        """Commit every transaction still held (the schedule stopped before its end step)."""
        for txn in list(self.held):
            table = next(t for t, m in self.models.items() if txn in m.pending)
            self.end(table, {"txn": txn, "commit": True})

    def _insert(self, target: Engine | Connection, table: int, rows: list[dict[str, Any]], ts_sql: str | None,
                stamp: Any = None) -> None:
        cols, values = "tok, v, s", ":tok, :v, :s"
        if stamp is not None:
            cols, values, rows = cols + ", ts", values + ", :ts", [{**r, "ts": stamp} for r in rows]
        elif ts_sql is not None:
            cols, values = cols + ", ts", values + f", {ts_sql}"
        sql = text(f"INSERT INTO {table_name(table)} ({cols}) VALUES ({values})")
        if isinstance(target, Engine):
            with target.begin() as conn:
                conn.execute(sql, rows)
        else:
            target.execute(sql, rows)
