"""The explorer's world (fresh databases, tables, topics and a Dagster instance on the shared stack) and the loop
that carries out a schedule in it, checking exactly-once with the oracle after each round."""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import create_engine, text

from assets.identity import channel_for
from resources.config import RelayConfig, TableConfig
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from tests.conftest import Services, unique
from tests.explorer import faults, ops, oracle, service_faults
from tests.explorer.schedule import TABLES, Schedule, Step
from tests.explorer.writers import MESSAGE_MAX_BYTES, Writers, table_name
from tests.pipeline import Harness, relay_config


@dataclass
class World:
    services: Services
    config: RelayConfig
    harness: Harness
    writers: Writers
    tables: dict[int, TableConfig]  # schedule table index -> its config
    records: list[faults.FaultRecord] = field(default_factory=list)
    broker: Any = None  # the world's private broker (tests/private_kafka.py), when its schedule stops brokers
    spark: Any = None  # its private Spark Connect server (service_faults.py), when its schedule kills Spark
    problems: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def say(self, line: str) -> None:
        self.log.append(line)
        print(line, flush=True)

    def note(self, index: int, kind: str, run: str, stage: str, outcome: str, disrupted: bool) -> None:
        """An operator action's record beside the faults': what it hit, and whether it changed anything."""
        record = faults.FaultRecord(self.tables[index].table_id, run, kind, stage, outcome, disrupted)
        self.records.append(record)
        self.say(f"  {'op' if disrupted else 'op without effect'} {json.dumps(record.as_dict())}")


@contextlib.contextmanager
def world(services: Services, tables: tuple[int, ...], keep_on_failure: bool = True,
          daemon: bool = False) -> Iterator[World]:
    """Fresh PostgreSQL and MariaDB databases with the schedule's tables, a PostgreSQL-backed Dagster instance, a
    config on the stack's Spark Connect server; all dropped afterwards (kept, and named, if a check failed).
    `daemon`: the instance set up for a daemon of the world's own (service_faults.py), a workspace beside it."""
    from dagster import DagsterInstance

    names = {k: unique(k) for k in ("dagster", "xpg", "xmaria")}
    pg_admin = create_engine(services.pg_url(), isolation_level="AUTOCOMMIT")
    maria_admin = create_engine(services.mariadb_url(), isolation_level="AUTOCOMMIT")
    with pg_admin.connect() as conn:
        for k in ("dagster", "xpg"):
            conn.execute(text(f'CREATE DATABASE "{names[k]}"'))
    with maria_admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE `{names['xmaria']}`"))
    urls = {"pg": services.pg_url(names["xpg"]), "maria": services.mariadb_url(names["xmaria"])}
    engines = {k: create_engine(u, pool_pre_ping=True) for k, u in urls.items()}
    writers = Writers(engines)
    writers.create_tables(tables)
    sources = {k: unique(k) for k in urls}  # a new table identity each time: progress topic, transactional id
    settings = [{"source": sources[TABLES[i][0]], "table": table_name(i), "watermark": "id" if TABLES[i][1] == "int"
                 else "ts", "topic": f"explore.{names['xpg']}.{table_name(i)}", "slice_max_rows": 150,
                 "max_slices_per_run": 3, "settle_seconds": 1, "rollup_after_seconds": 3600,
                 **({"tie_break": "id"} if TABLES[i][1] == "ts" else {})}
                for i in tables]
    for s in settings:
        if s["source"] == sources["pg"]:
            s["table"] = f"public.{s['table']}"
    config = relay_config(services, {sources[k]: u for k, u in urls.items()}, settings,
                          producer={"message.max.bytes": MESSAGE_MAX_BYTES}, spark_remote=True)
    home = Path(tempfile.mkdtemp(prefix="explore-"))
    (home / "dagster.yaml").write_text(service_faults.daemon_instance_settings(services.dagster_storage(
        names["dagster"])) if daemon else yaml.safe_dump({
            "storage": services.dagster_storage(names["dagster"]), "telemetry": {"enabled": False},
            # As the product's dagster.yaml: a table's pool limits its queued runs, never a run's own step.
            "concurrency": {"pools": {"granularity": "run", "default_limit": 1}}}))
    if daemon:
        service_faults.write_workspace(home)
    instance = DagsterInstance.from_config(str(home))
    w = World(services, config, Harness(config, instance), writers, dict(zip(tables, config.tables, strict=True)))
    failed = True
    try:
        yield w
        failed = bool(w.problems)
    finally:
        writers.end_all()
        instance.dispose()
        for e in engines.values():
            e.dispose()
        if failed and keep_on_failure:
            print(f"[explore] kept for inspection: databases {names}, DAGSTER_HOME {home}")
        else:
            with pg_admin.connect() as conn:
                for k in ("dagster", "xpg"):
                    conn.execute(text(f'DROP DATABASE IF EXISTS "{names[k]}" WITH (FORCE)'))
            with maria_admin.connect() as conn:
                conn.execute(text(f"DROP DATABASE IF EXISTS `{names['xmaria']}`"))
            delete_topics(services.kafka_bootstrap, [names["xpg"], *sources.values()])
        pg_admin.dispose()
        maria_admin.dispose()


@contextlib.contextmanager
def private_world(services: Services, tables: tuple[int, ...], broker: bool = False, spark: bool = False,
                  daemon: bool = False) -> Iterator[World]:
    """A world whose broker (`broker`) or Spark Connect server (`spark`) is one of its own, so that faults on it stop
    nothing other people's tests use; `daemon`: its instance ready for a daemon of its own. The rest is the stack's."""
    from dataclasses import replace

    from tests.private_kafka import private_kafka

    with contextlib.ExitStack() as stack:
        own_broker = stack.enter_context(private_kafka()) if broker else None
        own_spark = stack.enter_context(service_faults.private_spark()) if spark else None
        if own_broker is not None:
            services = replace(services, kafka_bootstrap=own_broker.bootstrap)
        if own_spark is not None:
            services = replace(services, spark_remote=own_spark.remote)
        w = stack.enter_context(world(services, tables, daemon=daemon))
        w.broker, w.spark = own_broker, own_spark
        yield w


def delete_topics(bootstrap: str, marks: list[str]) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    topics = [t for t in admin.list_topics(timeout=10).topics if any(m in t for m in marks)]
    if topics:
        for future in admin.delete_topics(topics, operation_timeout=30).values():
            with contextlib.suppress(Exception):
                future.result()


def relay(w: World, step: Step) -> None:
    """One tick of the table; each requested run carried out, the first with the step's fault, then (as a run
    retry would) run again normally."""
    table = w.tables[step.table]
    if step.args.get("fault") == "daemon":
        rec, problems = service_faults.daemon_mid_run(w.harness, table, ops.matching_max(w, step.table),
                                                      step.args["after_s"], step.args["down_s"])
        w.problems.extend(problems)
        w.records.append(rec)
        w.say(f"  fault {json.dumps(rec.as_dict())}")
        return
    keys = w.harness.cut(table, timeout=step.args.get("wait_s", 5))
    for n, key in enumerate(keys):
        fault = step.args.get("fault") if n == 0 else None
        if fault == "kill":
            rec = faults.kill_at_stage(w.harness, table, key, step.args["stage"])
        elif fault == "freeze_takeover":
            rec, problems = faults.freeze_then_takeover(w.harness, table, key, step.args["stage"])
            w.problems.extend(problems)
        elif fault == "kill_early":
            rec = faults.kill_early(w.harness, table, key, step.args["after_s"])
        elif fault == "broker":
            rec, problems = faults.broker_mid_run(w.harness, table, key, w.broker, step.args["after_s"],
                                                  step.args["kill"], step.args["down_s"])
            w.problems.extend(problems)
        elif fault == "spark":
            rec, problems = service_faults.spark_mid_run(w.harness, table, key, w.spark, step.args["after_s"],
                                                         step.args["down_s"], step.args.get("stage"))
            w.problems.extend(problems)
        else:
            rec = None
        if rec is not None:
            w.records.append(rec)
            w.say(f"  fault {json.dumps(rec.as_dict())}")
        result = w.harness.run_cli(table, key)
        if not result.success:
            w.problems.append(f"run of {table.table_id} {key} failed: {result.output[-2000:]}")
            w.say(f"  run {key} FAILED")
            return
    if not keys:
        w.say("  nothing cut")
        if "fault" in step.args:  # a drawn fault with no run to hit is reported, as one without effect
            w.records.append(faults.FaultRecord(table.table_id, "-", faults.record_name(step.args),
                                                step.args.get("stage", "-"), "not injected: the tick cut nothing",
                                                False))


def catch_up_and_check(w: World, timeout: float = 300.0, only: int | None = None) -> list[str]:
    """End held transactions, relay every table (or table `only`) up to its max watermark, then the oracle on each."""
    w.writers.end_all()
    problems: list[str] = []
    for i, table in w.tables.items():
        if only is not None and i != only:
            continue
        try:
            if top := ops.matching_max(w, i):  # an empty table has nothing to drain (its progress stays empty)
                w.harness.drain(table, until_hi=top, timeout=timeout)
        except AssertionError as exc:
            problems.append(f"{table.table_id}: no catch-up: {exc}")
            continue
        engine = w.writers.engines[TABLES[i][0]]
        found = oracle.check_table(w.config, table, engine, w.writers.models[i], channel_for(table, PREFIX).table,
                                   w.services.kafka_bootstrap, oracle.Columns(
                                       frozenset(w.writers.added.get(i, [])), frozenset(w.writers.dropped.get(i, [])),
                                       frozenset(w.writers.retyped.get(i, []))))
        problems.extend(f"{table.table_id}: {p}" for p in found)
    w.problems.extend(problems)
    return problems


def execute(w: World, step: Step) -> None:
    w.say(f"step {step.text()}")
    if step.kind == "write":
        w.writers.write(step.table, step.args)
    elif step.kind == "end":
        w.writers.end(step.table, step.args)
    elif step.kind == "relay":
        relay(w, step)
    elif step.args["op"] == "add_column":
        w.writers.add_column(step.table)
        w.note(step.table, "add_column", "-", "between relay steps", f"added {w.writers.added[step.table][-1]}", True)
    else:
        ops.OPS[step.args["op"]](w, step)


def explore(w: World, schedule: Schedule, minutes: float, round_steps: int = 12,
            max_steps: int | None = None) -> dict[str, Any]:
    """Steps from the schedule until `minutes` passed (or `max_steps` were taken), checked every `round_steps`."""
    started = time.monotonic()
    rounds = 0
    while schedule.index < (max_steps or 10**9) and time.monotonic() - started < minutes * 60:
        for _ in range(round_steps):
            execute(w, schedule.next())
        rounds += 1
        schedule.open.clear()  # the check commits what is still held: the schedule must not end it again
        found = catch_up_and_check(w)
        w.say(f"round {rounds} (step {schedule.index}): {'OK' if not found else 'FAILED'}")
        for p in found:
            w.say(f"  PROBLEM {p}")
        if found:
            break
    return summary(w, schedule.index, rounds, time.monotonic() - started)


def summary(w: World, steps: int, rounds: int, seconds: float) -> dict[str, Any]:
    faulted = [r for r in w.records if r.fault not in OP_RECORDS]
    ops = [r for r in w.records if r.fault in OP_RECORDS]
    return {"steps": steps, "rounds": rounds, "seconds": round(seconds), "ok": not w.problems,
            "faults": len(faulted), "faults_without_effect": sum(not r.disrupted for r in faulted),
            "by_fault": {k: [sum(r.fault == k for r in faulted), sum(r.fault == k and r.disrupted for r in faulted)]
                         for k in sorted({r.fault for r in faulted})},  # kind: [drawn, disrupted]
            "ops": len(ops), "ops_without_effect": sum(not r.disrupted for r in ops),
            "problems": w.problems[:20]}


# What operator actions' records call them (the rest are faults').
OP_RECORDS = {*ops.OPS, "add_column", "drop", "retype"}


def run_matrix(w: World, steps: list[Step]) -> dict[str, Any]:
    """Each cell: rows written to its table, one faulted relay step, then catch-up and the oracle."""
    started = time.monotonic()
    for n, step in enumerate(steps):
        w.writers.write(step.table, {"writer": "autocommit", "rows": 5, "seed": f"m{n}"})
        w.writers.write(step.table, {"writer": "batch_now" if TABLES[step.table][1] == "ts" else "long_txn",
                                     "rows": 20, "seed": f"b{n}"})
        faulted = len(w.records)
        execute(w, step)
        hit = w.records[faulted:] and w.records[-1].run != "-"
        found = [] if hit else [f"matrix cell {step.text()}: no run to inject the fault into"]
        w.problems.extend(found)
        found += catch_up_and_check(w, only=step.table)
        w.say(f"matrix {step.args['fault']}@{step.args['stage']}: {'OK' if not found else 'FAILED'}")
        for p in found:
            w.say(f"  PROBLEM {p}")
    return summary(w, len(steps), len(steps), time.monotonic() - started)


def run_ops(w: World, steps: list[Step]) -> dict[str, Any]:
    """The operator actions' cells: the steps in order, then catch-up and the oracle on their table; every action
    must have acted (none recorded as without effect)."""
    started = time.monotonic()
    for step in steps:
        execute(w, step)
    idle = [f"{r.fault}: {r.outcome}" for r in w.records if not r.disrupted]
    w.problems.extend(f"ops cell without effect: {i}" for i in idle)
    found = catch_up_and_check(w, only=steps[0].table)
    w.say(f"ops on {TABLES[steps[0].table]}: {'OK' if not found and not idle else 'FAILED'}")
    for p in found:
        w.say(f"  PROBLEM {p}")
    return summary(w, len(steps), 1, time.monotonic() - started)
