"""Run the peer tool **dpone** (PostgreSQL -> Kafka) so a benchmark can compare it with rowrelay.

dpone (PyPI ``dpone``, Apache-2.0) is a declarative, YAML-manifest ETL framework. Its PostgreSQL -> Kafka
route ("docs/source-sink/postgres-to-kafka.md" in its repository) works like this:

* the PostgreSQL source runs one ``COPY (SELECT ...) TO STDOUT`` into a CSV file in a temp dir,
* ``KafkaSink`` reads that CSV back and calls ``Producer.produce`` once per row (JSON value), then
  ``flush(30 s)``; delivery is at-least-once, no Kafka transactions, no idempotent producer by default,
* ``full_refresh`` keeps no state (no cursor/offset table), so every run republishes the whole table.

dpone is installed in its own venv outside the checkout (``$ROWRELAY_HOME/dpone-venv``) and run as a
subprocess through its canonical CLI, ``dpone run <manifest> --format json`` (its docs call ``dpone run`` the
canonical way; ``dpone.run(...)`` is the embedding API and is selectable with ``via="api"``).

What the generated manifest sets, and why (everything else is dpone's default):

* ``source.table`` / ``sink.topic``: point it at the table and topic.
* ``connection_type: env``: credentials come from ``DPONE_CONN_<ID>_*`` environment variables of the
  subprocess, so no password is written to disk.
* ``runtime.compatibility.legacy_runtime_connections: explicit_only``: dpone 0.88 refuses direct
  ``connection_id`` credentials without it (``DPONE_LEGACY_RUNTIME_DEFAULTS_DISABLED``); the alternative,
  ``connection_ref``, needs a GitOps-published, hash-pinned init-fetch plan. Its own quickstart uses this flag.
* ``sink.strategy.mode: full_refresh``: the stateless "publish the whole bounded snapshot" mode.
* ``source.options.batch_commit_mode: whole``: required. With the default (``separate``, 10,000-row
  LIMIT/OFFSET batches) the run fails with ``TypeError: KafkaSink cannot iterate artifact type
  BatchedFileExportArtifact``; dpone's own live Postgres->Kafka tests set ``whole`` as well.

dpone defaults kept (noted for the comparison):

* source ``batch_size`` 10,000 (not used in ``whole`` mode: one COPY of the whole table);
* sink ``message_format: json``, ``envelope: flat`` (the row's columns only; every value is a *string*
  because it comes from the CSV wire: ``{"id":"1","amount":"0.01",...}``), ``key.mode: unique_key`` with no
  unique key configured -> null message key, no headers;
* ``delivery.mode: at_least_once``; the producer gets only ``bootstrap.servers`` and ``client.id=dpone``, so
  librdkafka's defaults apply (acks=all, enable.idempotence=false, linger.ms=5, batch.num.messages=10000,
  no compression); ``delivery.flush_timeout`` 30 s.

dpone does not create topics (the local broker has ``auto.create.topics.enable=false``), so
``run_dpone`` creates the topic before the timed run, as rowrelay's own setup does for its topics.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

DPONE_VERSION = "0.88.0"
DPONE_REQUIREMENT = f"dpone[postgres,kafka]=={DPONE_VERSION}"
# Modules the two extras bring in; their presence means the extras are installed.
_EXTRA_MODULES = ("confluent_kafka", "psycopg")

_PG_CONN_ID = "rowrelay_bench_pg"
_KAFKA_CONN_ID = "rowrelay_bench_kafka"

_API_DRIVER = """\
import json
import sys

import dpone

report = dpone.run(sys.argv[1])
result = report.result
print(json.dumps({
    "passed": bool(report.passed),
    "result": {
        "status": str(getattr(result, "status", "")),
        "inserted_rows": getattr(report, "inserted_rows", None) or getattr(result, "inserted_rows", None),
        "duration_seconds": getattr(report, "duration_seconds", None) or getattr(result, "duration_seconds", None),
        "errors": [str(e) for e in (getattr(result, "errors", None) or [])],
    },
}, default=str))
sys.exit(0 if report.passed else 1)
"""


def rowrelay_home() -> Path:
    return Path(os.environ.get("ROWRELAY_HOME") or Path.home() / ".cache" / "rowrelay").expanduser()


def dpone_venv_dir() -> Path:
    return rowrelay_home() / "dpone-venv"


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _dpone_installed(venv: Path) -> bool:
    if not _venv_python(venv).exists() or not (venv / "bin" / "dpone").exists():
        return False
    site = glob.glob(str(venv / "lib" / "python3*" / "site-packages"))
    if not site:
        return False
    sp = Path(site[0])
    if not (sp / f"dpone-{DPONE_VERSION}.dist-info").is_dir():
        return False
    return all((sp / mod).is_dir() for mod in _EXTRA_MODULES)


def ensure_dpone_venv() -> Path:
    """Create ``$ROWRELAY_HOME/dpone-venv`` with the pinned dpone + extras if needed; return its python."""
    venv = dpone_venv_dir()
    if _dpone_installed(venv):
        return _venv_python(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    if not _venv_python(venv).exists():
        base = getattr(sys, "_base_executable", None) or sys.executable
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
    py = _venv_python(venv)
    subprocess.run(
        [str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", DPONE_REQUIREMENT],
        check=True,
    )
    if not _dpone_installed(venv):
        raise RuntimeError(f"{DPONE_REQUIREMENT} did not install into {venv}")
    return py


def _split_table(table: str) -> tuple[str, str]:
    schema, _, name = table.rpartition(".")
    return (schema or "public"), name


def _q(value: str) -> str:
    """A YAML double-quoted scalar (JSON string syntax is valid YAML)."""
    return json.dumps(value)


def write_manifest(workdir: Path, table: str, topic: str) -> Path:
    schema, name = _split_table(table)
    text = f"""\
# Generated by rowrelay bench/dpone_peer.py for dpone {DPONE_VERSION}: PostgreSQL -> Kafka, full_refresh.
name: {_q("rowrelay_bench_" + name)}
source:
  type: postgres
  connection_id: {_PG_CONN_ID}
  connection_type: env
  table:
    schema: {_q(schema)}
    name: {_q(name)}
  options:
    # Required: the default 'separate' mode yields an artifact KafkaSink cannot read.
    batch_commit_mode: whole
sink:
  type: kafka
  connection_id: {_KAFKA_CONN_ID}
  connection_type: env
  topic: {_q(topic)}
  strategy:
    mode: full_refresh
runtime:
  compatibility:
    legacy_runtime_connections: explicit_only
"""
    path = workdir / "dpone_manifest.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def _subprocess_env(venv: Path, pg: dict, bootstrap: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"}}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    pg_prefix = f"DPONE_CONN_{_PG_CONN_ID.upper()}_"
    env[pg_prefix + "HOST"] = str(pg["host"])
    env[pg_prefix + "PORT"] = str(pg["port"])
    env[pg_prefix + "DATABASE"] = str(pg["dbname"])
    env[pg_prefix + "USERNAME"] = str(pg["user"])
    env[pg_prefix + "PASSWORD"] = str(pg["password"])
    env[f"DPONE_CONN_{_KAFKA_CONN_ID.upper()}_BOOTSTRAP_SERVERS"] = bootstrap
    return env


def _ensure_topic(bootstrap: str, topic: str, partitions: int) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    if topic in admin.list_topics(timeout=10).topics:
        return
    futures = admin.create_topics([NewTopic(topic, partitions, 1)], request_timeout=30)
    futures[topic].result(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        meta = admin.list_topics(topic=topic, timeout=10).topics.get(topic)
        if meta is not None and meta.error is None and len(meta.partitions) == partitions:
            return
        time.sleep(0.2)
    raise RuntimeError(f"topic {topic} did not become available")


def delete_topic(bootstrap: str, topic: str) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    try:
        admin.delete_topics([topic], request_timeout=30)[topic].result(timeout=30)
    except Exception as exc:  # the topic may not exist
        print(f"delete_topic({topic}): {exc}", file=sys.stderr)


def count_topic_messages(bootstrap: str, topic: str, timeout_s: float = 120.0) -> int:
    """Read the topic with a plain consumer from the beginning up to the current end offsets; return the count."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"rowrelay-bench-dpone-verify-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": True,
        }
    )
    try:
        meta = consumer.list_topics(topic=topic, timeout=10).topics[topic]
        ends: dict[int, int] = {}
        for p in sorted(meta.partitions):
            _low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            ends[p] = high
        pending = {p for p, high in ends.items() if high > 0}
        if not pending:
            return 0
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in pending])
        count = 0
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=10_000, timeout=1.0):
                p = msg.partition()
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(p)
                        continue
                    raise RuntimeError(f"consumer error on {topic}[{p}]: {err}")
                if p not in pending or msg.offset() >= ends[p]:
                    continue
                count += 1
                if msg.offset() + 1 >= ends[p]:
                    pending.discard(p)
        if pending:
            raise TimeoutError(f"did not reach end offsets of {topic} partitions {sorted(pending)} in {timeout_s}s")
        return count
    finally:
        consumer.close()


def _parse_report(stdout: str) -> dict[str, Any]:
    text = stdout.strip()
    start = text.find("{")
    if start < 0:
        return {}
    try:
        parsed = json.loads(text[start:])
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def run_dpone(
    pg: dict,
    table: str,
    bootstrap: str,
    topic: str,
    rows: int,
    workdir: Path,
    *,
    via: str = "cli",
    partitions: int = 1,
    timeout_s: float = 3600.0,
) -> dict:
    """Run dpone's PostgreSQL -> Kafka sink on ``table`` into ``topic``, timed launch-to-exit, then verify.

    ``via="cli"`` (default) runs ``dpone run <manifest> --format json``; ``via="api"`` runs a small driver
    that calls ``dpone.run(manifest)`` (same runtime, ~3 s less interpreter/CLI start-up).
    """
    if via not in {"cli", "api"}:
        raise ValueError("via must be 'cli' or 'api'")
    py = ensure_dpone_venv()
    venv = py.parent.parent
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    manifest = write_manifest(workdir, table, topic)
    _ensure_topic(bootstrap, topic, partitions)
    before = count_topic_messages(bootstrap, topic)

    if via == "cli":
        cmd = [str(venv / "bin" / "dpone"), "run", manifest.name, "--format", "json"]
        mode = f"cli: dpone run {manifest.name} --format json (postgres full_refresh -> kafka, batch_commit_mode=whole)"
    else:
        driver = workdir / "dpone_driver.py"
        driver.write_text(_API_DRIVER, encoding="utf-8")
        cmd = [str(py), driver.name, manifest.name]
        mode = f"api: dpone.run('{manifest.name}') in a driver script (postgres full_refresh -> kafka, whole)"

    env = _subprocess_env(venv, pg, bootstrap)
    with open(workdir / "dpone.stdout.json", "w+b") as out, open(workdir / "dpone.stderr.log", "wb") as err:
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=workdir, env=env, stdout=out, stderr=err, timeout=timeout_s, check=False)
        seconds = time.perf_counter() - started
        out.seek(0)
        stdout = out.read().decode("utf-8", errors="replace")

    messages = count_topic_messages(bootstrap, topic) - before
    report = _parse_report(stdout)
    result = report.get("result") or {}
    figures: dict[str, Any] = {
        "seconds": round(seconds, 3),
        "messages": messages,
        "rows_per_s": round(messages / seconds, 1) if seconds > 0 else 0.0,
        "version": DPONE_VERSION,
        "mode": mode,
    }
    if result.get("duration_seconds") is not None:
        # dpone's own process timer (extract + produce + flush), i.e. without interpreter/CLI start-up.
        figures["dpone_reported_seconds"] = round(float(result["duration_seconds"]), 3)
    notes: list[str] = []
    if before:
        notes.append(f"topic already held {before} messages before the run; they are not counted")
    if proc.returncode != 0 or report.get("passed") is False:
        errors = "; ".join(str(e) for e in result.get("errors") or [])[:500]
        notes.append(f"dpone exited {proc.returncode}: {errors or 'see dpone.stderr.log in workdir'}")
    if messages < rows:
        notes.append(f"delivered {messages} messages for {rows} rows")
    elif messages > rows:
        notes.append(f"delivered {messages} messages for {rows} rows (duplicates: at-least-once)")
    if notes:
        figures["note"] = "; ".join(notes)
    return figures


def _stack_setting(name: str, default: str) -> str:
    if os.environ.get(name):
        return os.environ[name]
    env_file = rowrelay_home() / "stack.env"
    if env_file.exists():
        for line in env_file.read_text(encoding="utf-8").splitlines():
            key, sep, value = line.partition("=")
            if sep and key.strip() == name:
                return value.strip()
    return default


def _pg_settings() -> dict:
    return {
        "host": _stack_setting("ROWRELAY_PG_HOST", "127.0.0.1"),
        "port": int(_stack_setting("ROWRELAY_PG_PORT", "15432")),
        "user": _stack_setting("ROWRELAY_PG_USER", "rowrelay"),
        "password": _stack_setting("ROWRELAY_PG_PASSWORD", "rowrelay-local"),
        "dbname": os.environ.get("ROWRELAY_PG_DB", "rowrelay_demo"),
    }


def create_probe_table(pg: dict, table: str, rows: int) -> None:
    import psycopg
    from psycopg import sql

    ident = sql.Identifier(*table.split("."))
    with psycopg.connect(**pg, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(ident))
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (id bigserial primary key, category varchar, domain varchar, "
                "ts timestamp, amount numeric(12,2), note text)"
            ).format(ident)
        )
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (category, domain, ts, amount, note) "
                "SELECT 'cat_' || (g %% 17), 'd' || (g %% 5) || '.example.com', "
                "timestamp '2024-01-01' + g * interval '1 second', ((g * 7919) %% 1000000) / 100.0, "
                "CASE WHEN g %% 10 = 0 THEN NULL ELSE 'note ' || g END "
                "FROM generate_series(1, %s) AS g"
            ).format(ident),
            (rows,),
        )
        conn.execute(sql.SQL("ANALYZE {}").format(ident))


def drop_probe_table(pg: dict, table: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(**pg, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(*table.split("."))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run dpone PostgreSQL -> Kafka on a generated probe table.")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--via", choices=("cli", "api"), default="cli")
    parser.add_argument("--keep-workdir", action="store_true")
    args = parser.parse_args(argv)

    import shutil
    import tempfile

    pg = _pg_settings()
    bootstrap = _stack_setting("ROWRELAY_KAFKA_BOOTSTRAP", "127.0.0.1:19092")
    suffix = uuid.uuid4().hex[:8]
    table = f"dpone_probe_{suffix}"
    topic = f"dpone_probe_{suffix}"
    workdir = Path(tempfile.mkdtemp(prefix="dpone_probe_"))
    print(f"dpone venv python: {ensure_dpone_venv()}", file=sys.stderr)
    try:
        create_probe_table(pg, table, args.rows)
        figures = run_dpone(pg, table, bootstrap, topic, args.rows, workdir, via=args.via)
        print(json.dumps(figures, indent=2))
    finally:
        drop_probe_table(pg, table)
        delete_topic(bootstrap, topic)
        if args.keep_workdir:
            print(f"workdir kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
