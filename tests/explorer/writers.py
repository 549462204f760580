"""The writer kinds: what each does to a table, on PostgreSQL and MariaDB, recorded in the model.

Every row carries a `tok` drawn from the schedule's seed, a value `v` and a text `s` of drawn length. A held
kind leaves its transaction open (a connection of its own) until the schedule's `end` step for it.
"""

from __future__ import annotations

import random
import threading
import time
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
                      "s mediumtext)",
    ("maria", "ts"): "CREATE TABLE {t} (id bigint AUTO_INCREMENT PRIMARY KEY, ts DATETIME(6) NOT NULL DEFAULT "
                     "NOW(6), tok varchar(32) NOT NULL, v bigint, s mediumtext)",
}
# The producer's message.max.bytes in the explorer's world: a bad row's message is over it, any other far under it.
MESSAGE_MAX_BYTES = 100_000
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
    added: dict[int, list[str]] = field(default_factory=dict)  # table -> columns added since it was created
    dropped: dict[int, set[str]] = field(default_factory=dict)  # table -> added columns dropped since
    retyped: dict[int, set[str]] = field(default_factory=dict)  # table -> added columns made text since
    bursts: list[threading.Thread] = field(default_factory=list)  # writer threads running beside the schedule

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
        if kind == "burst":
            self.burst(table, args)
            return
        rows = [{"tok": f"{args['seed']}-{n}", "v": rng.randint(-10**12, 10**12),
                 "s": "".join(rng.choice("abcxyz é") for _ in range(rng.randint(0, 40))),
                 **{c: rng.randint(0, 10**6) for c in self.columns(table)}}
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
            late = {**rows[0], "tok": f"{args['seed']}-late"}
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

    def burst(self, table: int, args: dict[str, Any]) -> None:
        """A writer thread that keeps committing small transactions, each held open 0-2 s, for `seconds`, while the
        schedule goes on: the only writer whose commits race the relay's cuts in time (its timing is the clock's,
        not the seed's; its rows and values are the seed's)."""
        thread = threading.Thread(target=self._burst, args=(table, args), daemon=True)
        thread.start()
        self.bursts.append(thread)

    def _burst(self, table: int, args: dict[str, Any]) -> None:
        dialect, rng = TABLES[table][0], random.Random(args["seed"])
        ts_sql = WHOLE_SECOND[dialect] if args.get("whole_second") else None
        deadline, n = time.monotonic() + args["seconds"], 0
        while time.monotonic() < deadline:
            rows = [{"tok": f"{args['seed']}-{n}-{k}", "v": rng.randint(0, 10**9), "s": "burst",
                     **{c: rng.randint(0, 10**6) for c in self.columns(table)}} for k in range(rng.randint(1, 3))]
            n += 1
            with self.engines[dialect].connect() as conn:
                tx = conn.begin()
                self._insert(conn, table, rows, ts_sql)
                time.sleep(rng.choice((0, 0, 0.2, 0.5, 1.0, 2.0)))
                tx.commit()
            self.models[table].written(None, [r["tok"] for r in rows])

    def bad_row(self, table: int, args: dict[str, Any]) -> str:
        """One transaction of `rows` rows, committed, one of them (the `at`-th) too large for the producer: random
        hex, which compression cannot shrink under the limit. Returns that row's tok."""
        rng = random.Random(args["seed"])
        rows = [{"tok": f"{args['seed']}-{n}", "v": rng.randint(0, 10**12), "s": "ok",
                 **{c: rng.randint(0, 10**6) for c in self.columns(table)}} for n in range(args["rows"])]
        big = rows[args["at"] % len(rows)]
        big["s"] = f"{rng.getrandbits(4 * 2 * MESSAGE_MAX_BYTES):0{2 * MESSAGE_MAX_BYTES}x}"
        self._insert(self.engines[TABLES[table][0]], table, rows, WHOLE_SECOND[TABLES[table][0]]
                     if args.get("whole_second") and TABLES[table][1] == "ts" else None)
        self.models[table].written(None, [r["tok"] for r in rows])
        return str(big["tok"])

    def add_column(self, table: int) -> None:
        """A nullable column added (the relay follows it); rows written from now on fill it."""
        column = f"c{len(self.added.setdefault(table, [])) + 1}"
        with self.engines[TABLES[table][0]].begin() as conn:
            conn.execute(text(f"ALTER TABLE {table_name(table)} ADD COLUMN {column} bigint"))
        self.added[table].append(column)

    def change_column(self, table: int, change: str) -> str | None:
        """The newest added column still there dropped, or retyped from bigint to text (rows written from then on
        fill it with the text of a number); None where no added column is left."""
        alive = [c for c in self.added.get(table, []) if c not in self.dropped.get(table, set())
                 and (change == "drop" or c not in self.retyped.get(table, set()))]
        if not alive:
            return None
        column, (dialect, _) = alive[-1], TABLES[table]
        sql = {"drop": f"ALTER TABLE {table_name(table)} DROP COLUMN {column}",
               "retype": f"ALTER TABLE {table_name(table)} ALTER COLUMN {column} TYPE text USING {column}::text"
               if dialect == "pg" else f"ALTER TABLE {table_name(table)} MODIFY {column} varchar(40)"}[change]
        with self.engines[dialect].begin() as conn:
            conn.execute(text(sql))
        (self.dropped if change == "drop" else self.retyped).setdefault(table, set()).add(column)
        return column

    def columns(self, table: int) -> list[str]:
        """The added columns writers fill now."""
        return [c for c in self.added.get(table, []) if c not in self.dropped.get(table, set())]

    def end(self, table: int, args: dict[str, Any]) -> None:
        conn, tx, kind = self.held.pop(args["txn"])
        commit = args["commit"] and kind != "rollback"
        (tx.commit if commit else tx.rollback)()
        conn.close()
        self.models[table].ended(args["txn"], commit)

    def end_all(self) -> None:
        """Commit every transaction still held (the schedule stopped before its end step); wait for writer threads."""
        for thread in self.bursts:
            thread.join()
        self.bursts.clear()
        for txn in list(self.held):
            table = next(t for t, m in self.models.items() if txn in m.pending)
            self.end(table, {"txn": txn, "commit": True})

    def _insert(self, target: Engine | Connection, table: int, rows: list[dict[str, Any]], ts_sql: str | None,
                stamp: Any = None) -> None:
        names = ["tok", "v", "s", *self.columns(table)]
        texts = self.retyped.get(table, set())
        rows = [{k: str(v) if k in texts else v for k, v in r.items()} for r in rows]
        cols, values = ", ".join(names), ", ".join(f":{n}" for n in names)
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
