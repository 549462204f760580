"""The explorer's world (fresh databases, tables, topics and a Dagster instance on the shared stack) and the loop
that carries out a schedule in it, checking exactly-once with the oracle after each round."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import create_engine, text

from assets.relay import channel_for
from resources.config import RelayConfig, TableConfig
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.slices import micros_text
from tests.conftest import Services, unique
from tests.explorer import faults, oracle
from tests.explorer.model import Where, admits
from tests.explorer.schedule import TABLES, Schedule, Step
from tests.explorer.writers import MESSAGE_MAX_BYTES, Writers, table_name
from tests.pipeline import ROOT, Harness, relay_config


@dataclass
class World:
    services: Services
    config: RelayConfig
    harness: Harness
    writers: Writers
    tables: dict[int, TableConfig]  # schedule table index -> its config
    records: list[faults.FaultRecord] = field(default_factory=list)
    broker: Any = None  # the world's private broker (tests/private_kafka.py), when its schedule stops brokers
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
def world(services: Services, tables: tuple[int, ...], keep_on_failure: bool = True) -> Iterator[World]:
    """Fresh PostgreSQL and MariaDB databases with the schedule's tables, a PostgreSQL-backed Dagster instance, a
    config on the stack's Spark Connect server; all dropped afterwards (kept, and named, if a check failed)."""
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
    (home / "dagster.yaml").write_text(yaml.safe_dump({
        "storage": services.dagster_storage(names["dagster"]), "telemetry": {"enabled": False},
        # As the product's dagster.yaml: a table's pool limits its queued runs, never a run's own step.
        "concurrency": {"pools": {"granularity": "run", "default_limit": 1}}}))
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
def private_broker_world(services: Services, tables: tuple[int, ...]) -> Iterator[World]:
    """A world whose topics live on a broker of its own (tests/private_kafka.py), so that broker faults stop no
    broker other people's tests use; its databases and Spark Connect server are still the stack's."""
    from dataclasses import replace

    from tests.private_kafka import private_kafka

    with private_kafka() as broker, world(replace(services, kafka_bootstrap=broker.bootstrap), tables) as w:
        w.broker = broker
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
            w.records.append(faults.FaultRecord(table.table_id, "-", step.args["fault"],
                                                step.args.get("stage", "-"), "not injected: the tick cut nothing",
                                                False))


def replay(w: World, step: Step) -> None:
    """`rowrelay replay` of one committed slice since the newest reset (drawn by `pick`), its copies recorded in
    the model with the filter its rows were chosen by."""
    from orchestration.cli import kafka_conf, replay_range
    from resources.exactly_once import read_progress_history

    table = w.tables[step.table]
    history = read_progress_history(kafka_conf(w.config), channel_for(table, PREFIX))
    since = max((n for n, r in enumerate(history) if r.topic_ends is not None), default=-1)
    history = [r for r in history[since + 1:] if r.rows and r.hi > r.lo and r.topic_ends is None]
    if not history:
        w.note(step.table, "replay", "-", "-", "nothing committed since the newest reset", False)
        return
    record = history[int(step.args["pick"] * len(history))]
    done = replay_range(w.config, table, record.lo, record.hi, None)
    model = w.writers.models[step.table]
    model.replays[done["replay_id"]] = (record.lo, record.hi, model.where_for(record.hi))
    w.note(step.table, "replay", record.slice, f"({record.lo}, {record.hi}]",
           f"{done['rows']} rows as {done['replay_id']}", bool(done["rows"]))


def fail_dead_runs(w: World) -> int:
    """Between steps no run of the explorer is alive: a run its faults SIGKILLed stays STARTED on the instance, as
    there is no daemon whose run monitor would fail it. Fails them as that monitor does (else `rowrelay reset` and
    compaction rightly wait for them forever). Returns how many."""
    from dagster import DagsterRunStatus, RunsFilter

    unfinished = [DagsterRunStatus.STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.NOT_STARTED,
                  DagsterRunStatus.QUEUED, DagsterRunStatus.CANCELING]
    runs = w.harness.instance.get_runs(RunsFilter(statuses=unfinished))
    for run in runs:
        w.harness.instance.report_run_failed(run, "its process was killed by the explorer (no run monitor here)")
    return len(runs)


def rowrelay(w: World, *args: str) -> subprocess.CompletedProcess[str]:
    """The `rowrelay` command line on the explorer's config and instance, as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "orchestration.cli", "--config", str(w.harness.config_file()),
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=600, env=w.harness.cli_env())


def reset(w: World, step: Step) -> None:
    """`rowrelay reset --after W` back to a committed watermark: a slice's bound or a point inside one (drawn by
    `pick`); rows above W are then expected once more, after the reset's position in the topic."""
    table = w.tables[step.table]
    progress = w.harness.progress(table)
    slices = committed_slices(w, table)
    if progress is None or not slices or progress.hi <= (w.writers.models[step.table].resets or [-(2**62)])[-1]:
        w.note(step.table, "reset", "-", "-", "not made: nothing committed since the newest reset", False)
        return
    floor = min(r.hi for r in slices) - 1  # inside or above the first slice: not back to the epoch
    after = floor + int(step.args["pick"] * (progress.hi - floor))
    if step.args["at_bound"]:
        after = max((r.hi for r in slices if r.hi <= after), default=after)
    text_after = micros_text(after) if TABLES[step.table][1] == "ts" else str(after)
    fail_dead_runs(w)
    done = rowrelay(w, "reset", "--table", table.table_id, "--after", text_after, "--reason", f"explorer {step.args}")
    if done.returncode != 0:
        w.problems.append(f"rowrelay reset of {table.table_id} to {text_after} failed: {done.stderr[-1500:]}")
        w.say("  reset FAILED")
        return
    model = w.writers.models[step.table]
    model.resets.append(after)
    # The rows above W are sent again by slices cut from now on, chosen by today's filter.
    model.wheres = [(p, f) for p, f in model.wheres if p < after] + [(after, model.where_now())]
    w.note(step.table, "reset", progress.slice, f"--after {text_after} ({after})",
           f"progress {progress.hi} back to {after}", True)


def committed_slices(w: World, table: TableConfig) -> list[Any]:
    """The committed slices recorded in the table's progress topic (resets left out)."""
    from orchestration.cli import kafka_conf
    from resources.exactly_once import read_progress_history

    return [r for r in read_progress_history(kafka_conf(w.config), channel_for(table, PREFIX))
            if r.topic_ends is None and r.hi > r.lo and r.rows]


def reconfigure(w: World, index: int, **changes: Any) -> None:
    """An operator's config edit between relay steps: the next ticks and runs read the new file (runs are processes
    of their own, each loading it at its start, as a code location reload does); the sensor keeps its cursor."""
    dumped = w.config.model_dump(mode="json")
    position = list(w.tables).index(index)
    dumped["tables"][position] = {**dumped["tables"][position], **changes}
    config = RelayConfig.model_validate(dumped)
    harness = Harness(config, w.harness.instance)
    harness.cursors, harness.skip_messages = w.harness.cursors, w.harness.skip_messages
    w.config, w.harness = config, harness
    w.tables = dict(zip(w.tables, config.tables, strict=True))


def change_where(w: World, step: Step) -> None:
    """`where:` widened or narrowed (or dropped) once the table has caught up: rows above its committed progress are
    chosen by the new filter, rows at or below it stay as they were sent."""
    table = w.tables[step.table]
    model = w.writers.models[step.table]
    if w.harness.max_watermark(table):
        w.harness.drain(table, until_hi=matching_max(w, step.table), timeout=300)
    progress = w.harness.progress(table)
    where: Where = None if step.args["v_min"] is None else (f"v >= {step.args['v_min']}", step.args["v_min"])
    was = model.where_now()
    reconfigure(w, step.table, where=where and where[0])
    model.wheres.append((progress.hi if progress else -(2**62), where))
    w.note(step.table, "where", progress.slice if progress else "-", f"from progress {progress and progress.hi}",
           f"where: {was and was[0]} -> {where and where[0]}", was != where)


def matching_max(w: World, index: int) -> int:
    """The highest watermark of a row the table's current filter admits (progress ends at the last such row)."""
    table = w.tables[index]
    where = w.writers.models[index].where_now()
    with w.writers.engines[TABLES[index][0]].connect() as conn:
        top = conn.execute(text(f"SELECT max({table.watermark}) FROM {table_name(index)}"
                                + (f" WHERE {where[0]}" if where else ""))).scalar()
    return 0 if top is None else oracle.watermark_of(top)


SUGGESTED_SKIP = re.compile(r"skip_watermarks: \[(.+?)\](?:;|\s|$)")


def bad_row(w: World, step: Step) -> None:
    """A committed transaction holding one row the producer refuses (over message.max.bytes); the table is relayed
    until its run stops as `bad_row`, whose message must name that row as a skip_watermarks entry ({watermark,
    tie_break} where rows may share the watermark); the entry is added as the runbook says and the table relayed
    on: every row but that one is then to be sent."""
    index, table = step.table, w.tables[step.table]
    tok = w.writers.bad_row(index, step.args)
    with w.writers.engines[TABLES[index][0]].connect() as conn:
        row = conn.execute(text(f"SELECT id, v, {table.watermark} AS wm FROM {table_name(index)} WHERE tok = :t"),
                           {"t": tok}).one()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for key in w.harness.cut(table, timeout=10):
            result = w.harness.run_cli(table, key)
            if result.success:
                continue
            found = SUGGESTED_SKIP.search(result.output)
            if found is None:
                w.problems.append(f"run of {key} stopped at a bad row without naming a skip: {result.output[-2000:]}")
                return
            entry = yaml.safe_load(f"[{found.group(1)}]")[0]
            names = (entry.get("tie_break") == row.id if isinstance(entry, dict)
                     else TABLES[index][1] == "int" and entry == row.id)
            w.say(f"  run {key} stopped at the bad row (id {row.id}); suggested skip {entry!r}")
            w.note(index, "bad_row", key, "publish", f"stopped; skip {entry!r}", True)
            if not names:
                w.problems.append(f"the bad row's stop suggests skip {entry!r}, not row id {row.id} ({row.wm})")
                return
            now = w.config.model_dump(mode="json")["tables"][list(w.tables).index(index)]["skip_watermarks"]
            reconfigure(w, index, skip_watermarks=[*now, entry])
            w.writers.models[index].skipped.add(tok)
            return
        if (progress := w.harness.progress(table)) is not None and progress.hi >= oracle.watermark_of(row.wm):
            break
    left_out = not admits(w.writers.models[index].where_now(), row.v)
    if not left_out:
        w.problems.append(f"the bad row (id {row.id}) stopped no run of {table.table_id} within 300 s")
    w.note(index, "bad_row", "-", "-", "no stop: where: leaves the row out" if left_out else "no stop", False)


def change_schema(w: World, step: Step) -> None:
    """An added column dropped or retyped (bigint to text). `follow`: the relay follows, the new rendering in the
    slices recorded with the new shape (the oracle's shape check). `fail`: the table caught up first; the next run
    stops naming the change and nothing new is sent (progress unchanged) until `rowrelay schema accept`; then the
    same slice publishes."""
    index, table, change = step.table, w.tables[step.table], step.args["change"]
    fail = step.args["policy"] == "fail"
    if fail and (top := matching_max(w, index)):
        w.harness.drain(table, until_hi=top, timeout=300)
    column = w.writers.change_column(index, change)
    if column is None:
        w.note(index, change, "-", "-", "no added column left to change", False)
        return
    if not fail:
        w.note(index, change, "-", "between relay steps", f"{column} ({step.args['policy']})", True)
        return
    reconfigure(w, index, on_schema_change="fail")
    before = w.harness.progress(table)
    w.writers.write(index, {"writer": "autocommit", "rows": 3, "seed": step.args["seed"]})
    keys = w.harness.cut(table, timeout=60)
    if not keys:
        w.problems.append(f"{table.table_id}: no cut within 60 s after {change} of {column}")
        return
    stopped = w.harness.run_cli(table, keys[0])
    after = w.harness.progress(table)
    if stopped.success or "rowrelay schema accept" not in stopped.output:
        w.problems.append(f"{table.table_id}: {change} of {column} under on_schema_change: fail did not stop the run "
                          f"of {keys[0]} naming `rowrelay schema accept`: {stopped.output[-1500:]}")
    if (after and after.hi) != (before and before.hi):
        w.problems.append(f"{table.table_id}: progress moved from {before and before.hi} to {after and after.hi} "
                          "while the table was stopped by a schema change")
    accepted = rowrelay(w, "schema", "accept", "--table", table.table_id, "--reason", f"explorer: {change} {column}")
    if accepted.returncode != 0:
        w.problems.append(f"rowrelay schema accept of {table.table_id} failed: {accepted.stderr[-1500:]}")
    reconfigure(w, index, on_schema_change="follow")
    w.note(index, change, keys[0], "table check (on_schema_change: fail)",
           f"{column}: run stopped (exit {stopped.returncode}), accepted (exit {accepted.returncode})", True)
    for key in keys:
        result = w.harness.run_cli(table, key)
        if not result.success:
            w.problems.append(f"run of {key} after `rowrelay schema accept` failed: {result.output[-2000:]}")
            return


def compact(w: World, step: Step) -> None:
    """History compaction on the explorer's instance between relay steps, as the history sensor runs it, with the
    clock `hours` ahead so that committed slices are old enough to roll up."""
    from orchestration.cli import kafka_conf
    from orchestration.factory import job_name
    from orchestration.history import compact_table

    table = w.tables[step.table]
    fail_dead_runs(w)
    result = compact_table(w.harness.instance, table, kafka_conf(w.config), PREFIX,
                           now=datetime.now(UTC) + timedelta(hours=step.args["hours"]), full=step.args["full"],
                           job_name=job_name(table))
    w.note(step.table, "compact", f"{result.keys_before} keys", f"now +{step.args['hours']} h", result.line(),
           result.rollups > 0)


def catch_up_and_check(w: World, timeout: float = 300.0, only: int | None = None) -> list[str]:
    """End held transactions, relay every table (or table `only`) up to its max watermark, then the oracle on each."""
    w.writers.end_all()
    problems: list[str] = []
    for i, table in w.tables.items():
        if only is not None and i != only:
            continue
        try:
            if top := matching_max(w, i):  # an empty table has nothing to drain (its progress stays empty)
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
        OPS[step.args["op"]](w, step)


OPS = {"replay": replay, "bad_row": bad_row, "reset": reset, "where": change_where, "compact": compact,
       "schema": change_schema}


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
            "ops": len(ops), "ops_without_effect": sum(not r.disrupted for r in ops),
            "problems": w.problems[:20]}


# What operator actions' records call them (the rest are faults').
OP_RECORDS = {*OPS, "add_column", "drop", "retype"}


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
