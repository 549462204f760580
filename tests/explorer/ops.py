"""The operator's actions a schedule draws, each carried out between relay steps on the explorer's world and
recorded beside the faults: `rowrelay replay`, `rowrelay reset` back, `where:` edits, a bad row relayed to its stop
then skipped, an added column dropped or retyped (followed, or stopping the table until `rowrelay schema accept`),
history compaction."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import yaml
from sqlalchemy import text

from assets.identity import channel_for
from resources.config import RelayConfig, TableConfig
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.slices import micros_text
from tests.explorer import oracle
from tests.explorer.model import Where, admits
from tests.explorer.schedule import TABLES, Step
from tests.explorer.writers import table_name
from tests.pipeline import ROOT, Harness

if TYPE_CHECKING:
    from tests.explorer.runner import World


def replay(w: World, step: Step) -> None:
    """`rowrelay replay` of one committed slice since the newest reset (drawn by `pick`), its copies recorded in
    the model with the filter its rows were chosen by."""
    from orchestration.cli.replay import replay_range
    from orchestration.tables import kafka_conf
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
    from orchestration.tables import kafka_conf
    from resources.exactly_once import read_progress_history

    return [r for r in read_progress_history(kafka_conf(w.config), channel_for(table, PREFIX))
            if r.topic_ends is None and r.hi > r.lo and r.rows]


def reconfigure(w: World, index: int, reload: bool = True, **changes: Any) -> None:
    """An operator's config edit between relay steps: runs (processes of their own) load the new file at their
    start; the sensor's definitions follow it on a code location reload (`reload`), else they keep the old config
    until the next reload; the sensor keeps its cursor either way."""
    dumped = w.config.model_dump(mode="json")
    position = list(w.tables).index(index)
    dumped["tables"][position] = {**dumped["tables"][position], **changes}
    config = RelayConfig.model_validate(dumped)
    harness = Harness(config, w.harness.instance)
    harness.cursors, harness.skip_messages = w.harness.cursors, w.harness.skip_messages
    if not reload:
        harness.defs = w.harness.defs
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


def names_row(w: World, index: int, entry: Any, row: Any) -> bool:
    """A skip_watermarks entry names the row: {watermark, tie_break} with its tie_break, or a bare watermark where
    no other row has that watermark (docs/configuration.md)."""
    def micros(value: Any) -> int:  # YAML reads most times as datetimes; some stay text
        return oracle.watermark_of(datetime.fromisoformat(value) if isinstance(value, str) else value)

    if isinstance(entry, dict):
        return bool(entry.get("tie_break") == row.id and micros(entry.get("watermark")) == micros(row.wm))
    table = w.tables[index]
    with w.writers.engines[TABLES[index][0]].connect() as conn:
        sharing = conn.execute(text(f"SELECT count(*) FROM {table_name(index)} WHERE {table.watermark} = :wm"),
                               {"wm": row.wm}).scalar()
    return micros(entry) == micros(row.wm) and sharing == 1


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
            names = names_row(w, index, entry, row)
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


def edit_config(w: World, step: Step) -> None:
    """Slice sizing edited (`slice_max_rows`, `max_slices_per_run`), with or without a code location reload: what
    must be sent does not change."""
    table = w.tables[step.table]
    changes = {k: step.args[k] for k in ("slice_max_rows", "max_slices_per_run")}
    was = {k: getattr(table, k) for k in changes}
    reconfigure(w, step.table, reload=step.args["reload"], **changes)
    w.note(step.table, "config", "-", "with a reload" if step.args["reload"] else "without a reload (runs only)",
           f"{was} -> {changes}", was != changes)


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
    from orchestration.compaction import compact_table
    from orchestration.factory import job_name
    from orchestration.tables import kafka_conf

    table = w.tables[step.table]
    fail_dead_runs(w)
    result = compact_table(w.harness.instance, table, kafka_conf(w.config), PREFIX,
                           now=datetime.now(UTC) + timedelta(hours=step.args["hours"]), full=step.args["full"],
                           job_name=job_name(table))
    w.note(step.table, "compact", f"{result.keys_before} keys", f"now +{step.args['hours']} h", result.line(),
           result.rollups > 0)


OPS = {"replay": replay, "bad_row": bad_row, "reset": reset, "where": change_where, "compact": compact,
       "schema": change_schema, "config": edit_config}
