"""Fault scenarios on the real pipeline: the Dagster daemon (sensors, run queue, pools, run retries) on a
PostgreSQL-backed instance, run workers in their own processes on the stack's Spark Connect server, and
writers that keep inserting. After each fault, with the fault stopped, the pipeline must catch up on its
own and `verify` must report 0 duplicates, 0 missing, 0 extra, 0 order violations.

Run alone with `make test-faults` (pytest -m faults).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url

from orchestration.verify import verify_table
from resources.config import RelayConfig
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.slices import datetime_to_micros
from stack import local as stack
from tests.conftest import Services, unique
from tests.pipeline import assert_exactly_once, read_topic, relay_config

pytestmark = [pytest.mark.faults, pytest.mark.integration]
ROOT = Path(__file__).resolve().parents[1]
RESULTS: list[dict] = []


class Writer:
    """Keeps inserting small transactions into a table; survives dropped connections and restarts."""

    def __init__(self, engine: Engine, table: str, batch: int = 5, pause: float = 0.25) -> None:
        self.engine, self.table, self.batch, self.pause = engine, table, batch, pause
        self.rows = 0
        self.rows_at_resume = 0  # rows written when writing last resumed: a scenario must have written more
        self.errors = 0
        self._run = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._run.wait(0.2):
                continue
            try:
                with self.engine.begin() as conn:
                    conn.execute(text(f"INSERT INTO {self.table} (v) VALUES (:v)"),
                                 [{"v": random.randint(0, 10**9)} for _ in range(self.batch)])
                self.rows += self.batch
            except Exception:  # noqa: BLE001 - a fault test drops connections on purpose
                self.errors += 1
                time.sleep(0.5)
            time.sleep(self.pause)

    def resume(self) -> None:
        self.rows_at_resume = self.rows
        self._run.set()

    def pause_writes(self, settle: bool = True) -> None:
        self._run.clear()
        if settle:
            time.sleep(0.5)  # let an in-flight batch finish

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


@dataclass
class FaultPipeline:
    services: Services
    config: RelayConfig
    home: Path
    config_file: Path
    engines: dict[str, Engine]
    writers: list[Writer] = field(default_factory=list)
    daemon: subprocess.Popen | None = None
    log: Path | None = None
    launcher: str = "warm"  # "warm": rowrelay's WarmRunLauncher; "default": Dagster's DefaultRunLauncher

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "DAGSTER_HOME": str(self.home), "ROWRELAY_CONFIG": str(self.config_file),
                "PYTHONPATH": str(ROOT)}

    def start_daemon(self, cwd: Path = ROOT, env: dict[str, str] | None = None) -> None:
        """`env`: the daemon's environment instead of `self.env` (which its runs inherit)."""
        self.log = self.home / "daemon.log"
        out = open(self.log, "ab")  # noqa: SIM115 - owned by the daemon process
        self.daemon = subprocess.Popen([sys.executable, "-m", "dagster._daemon", "run", "-w",
                                        str(self.home / "workspace.yaml")], cwd=cwd, env=env or self.env,
                                       stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def kill_daemon(self) -> None:
        """SIGKILL the daemon's whole process group: daemon, code server and any run worker it started."""
        assert self.daemon is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.daemon.pid, signal.SIGKILL)
        self.daemon.wait(30)

    def stop_daemon(self) -> None:
        if self.daemon is None:
            return
        try:
            os.killpg(self.daemon.pid, signal.SIGTERM)
            self.daemon.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            self.kill_daemon()
        self.daemon = None

    def warm_workers(self, status: str = "STARTED") -> list[dict]:
        """The warm launcher's record ({pid, host, start, server_pid}) of each run of this pipeline in `status` whose
        worker is alive: the launcher tags every run it forks (orchestration/launcher.py WORKER_TAG)."""
        from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

        from orchestration.launcher import WORKER_TAG

        try:
            with DagsterInstance.from_config(str(self.home)) as instance:
                runs = instance.get_runs(RunsFilter(statuses=[DagsterRunStatus(status)]))
        except Exception:  # noqa: BLE001 - the storage-restart scenario takes the database away for a moment
            return []
        found = [{**json.loads(r.tags[WORKER_TAG]), "run_id": r.run_id} for r in runs if WORKER_TAG in r.tags]
        return [w for w in found if Path(f"/proc/{w['pid']}").exists()]

    def started_workers(self) -> list[dict]:
        """{pid, run_id} of each STARTED run of this pipeline whose worker is alive: the warm launcher's record, or
        under Dagster's launcher the pid the run's own process tagged it with when its asset started."""
        if self.launcher == "warm":
            return self.warm_workers()
        from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

        from resources.keys import WORKER_PID_TAG

        try:
            with DagsterInstance.from_config(str(self.home)) as instance:
                runs = instance.get_runs(RunsFilter(statuses=[DagsterRunStatus.STARTED]))
        except Exception:  # noqa: BLE001 - the storage-restart scenario takes the database away for a moment
            return []
        found = [{"pid": int(r.tags[WORKER_PID_TAG]), "run_id": r.run_id} for r in runs if WORKER_PID_TAG in r.tags]
        return [w for w in found if Path(f"/proc/{w['pid']}").exists()]

    def workers(self) -> list[int]:
        """Pids of live run workers of this pipeline."""
        return [w["pid"] for w in self.started_workers()]

    def wait_for_worker(self, timeout: float = 90.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = self.workers()
            if pids:
                return random.choice(pids)
            time.sleep(0.2)
        raise AssertionError(f"no run worker started within {timeout}s; see {self.log}")

    def workers_mid_run(self, tries: int = 10) -> list[dict]:
        """`warm_workers` a random moment (0.2-1.0 s) after a run started. Runs take about a second, so the one
        waited for may end within the pause: then the next one, up to `tries` times ([] if none was caught)."""
        for _ in range(tries):
            self.wait_for_worker()
            time.sleep(random.uniform(0.2, 1.0))
            if running := self.started_workers():
                return running
        return []

    def max_ids(self) -> dict[str, int]:
        """Each table's max watermark (a timestamp watermark as microseconds since 1970 UTC, as rowrelay has it)."""
        out = {}
        for t in self.config.tables:
            with self.engines[t.source].connect() as conn:
                top = conn.execute(text(f"SELECT max({t.watermark}) FROM {t.table_name}")).scalar()
            out[t.table_id] = datetime_to_micros(top) if isinstance(top, datetime) else (top or 0)
        return out

    def catch_up_and_verify(self, scenario: str, faults: int, timeout: float = 240.0) -> None:
        """Stop writing, wait until every table's committed progress reaches its max id, verify the topics."""
        for w in self.writers:
            w.pause_writes(settle=False)
        time.sleep(0.5)  # let in-flight batches finish
        for w in self.writers if faults else ():  # rows written around a fault, or the catch-up proves nothing
            assert w.rows > w.rows_at_resume, f"{scenario}: no row written to {w.table} ({w.errors} write errors)"
        target = self.max_ids()
        deadline = time.monotonic() + timeout
        from assets.identity import channel_for
        from resources.exactly_once import read_committed_progress

        conf = {"bootstrap.servers": self.services.kafka_bootstrap}
        while True:
            done = {t.table_id: (p.hi if (p := read_committed_progress(conf, channel_for(t, PREFIX))) else 0)
                    for t in self.config.tables}
            if all(done[k] >= v for k, v in target.items()):
                break
            assert time.monotonic() < deadline, f"{scenario}: no catch-up in {timeout}s: {done} < {target}; {self.log}"
            time.sleep(1)
        reports = [verify_table(self.config, t) for t in self.config.tables]
        result = {"scenario": scenario, "faults": faults, "rows": sum(r.source_rows for r in reports),
                  "catch_up_s": round(time.monotonic() - deadline + timeout, 1),
                  "verify": {r.table: {"duplicates": r.duplicates, "missing": r.missing, "extra": r.extra,
                                       "order_violations": r.order_violations} for r in reports}}
        RESULTS.append(result)
        print(json.dumps(result))
        for r in reports:
            assert r.ok, f"{scenario}: {r}"
            assert r.source_rows == r.messages
        # Rows sharing a watermark value (a tie_break table: each writer transaction's rows share its now()): verify
        # compared them by tie_break too, and they are checked here by id, independently of verify.
        for r, t in zip(reports, self.config.tables, strict=True):
            if t.tie_break:
                assert r.rows_by_tie_break > 0 and r.tie_break_unchecked is None, f"{scenario}: {r}"
                with self.engines[t.source].connect() as conn:
                    ids = [str(i) for i in conn.execute(text(f"SELECT {t.tie_break} FROM {t.table_name}")).scalars()]
                assert_exactly_once(read_topic(self.services.kafka_bootstrap, t.topic_name), ids, t.tie_break)
        for w in self.writers:
            w.resume()


DAGSTER_YAML = """
{storage}
run_coordinator:
  module: dagster.core.run_coordinator
  class: QueuedRunCoordinator
  config: {{dequeue_interval_seconds: 1}}
run_retries: {{enabled: true, max_retries: 10, retry_on_asset_or_op_failure: true}}
concurrency:
  runs: {{max_concurrent_runs: 4}}
  pools: {{granularity: run, default_limit: 1}}
run_monitoring: {{enabled: true, start_timeout_seconds: 20, poll_interval_seconds: 2}}
{launcher}
sensors: {{use_threads: true, num_workers: 2}}
telemetry: {{enabled: false}}
"""


# dagster.yaml's run_launcher stanza per launcher; without one, Dagster uses its DefaultRunLauncher.
LAUNCHERS = {"warm": "run_launcher: {module: orchestration.launcher, class: WarmRunLauncher}", "default": ""}

ALL_TABLES = ("orders", "clicks", "events", "stamped")


@pytest.fixture(scope="module")
def pipeline(services: Services, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultPipeline]:
    with fault_pipeline(services, tmp_path_factory, ALL_TABLES) as p:
        yield p


@contextlib.contextmanager
def fault_pipeline(services: Services, tmp_path_factory: pytest.TempPathFactory,
                   tables: tuple[str, ...], start: bool = True, launcher: str = "warm") -> Iterator[FaultPipeline]:
    """The daemon-driven pipeline with writers on `tables` (of ALL_TABLES: PostgreSQL `orders` and `stamped`,
    MariaDB `clicks`, SQLite `events`); the fault suite uses all four, a test that needs one table less work.
    `start=False`: the daemon and the writers are left to the test to start (a daemon of its own settings).
    `launcher`: "warm" (rowrelay's, as dagster.yaml has it) or "default" (Dagster's DefaultRunLauncher: a fresh
    process per run started by the code server, the model of the Kubernetes, Docker and ECS launchers)."""
    if not services.spark_remote:
        pytest.skip("fault tests need the stack's Spark Connect server")
    home = tmp_path_factory.mktemp("faults_home")
    db_names = {k: unique(k) for k in ("dagster", "pgsrc", "mariasrc")}
    # pre_ping: the storage-restart scenario drops every pooled connection.
    pg_admin = create_engine(services.pg_url(), isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    maria_admin = create_engine(services.mariadb_url(), isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    with pg_admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{db_names["dagster"]}"'))
        conn.execute(text(f'CREATE DATABASE "{db_names["pgsrc"]}"'))
    with maria_admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE `{db_names['mariasrc']}`"))
    pg_url, maria_url = services.pg_url(db_names["pgsrc"]), services.mariadb_url(db_names["mariasrc"])
    engines = {"pg": create_engine(pg_url, pool_pre_ping=True), "maria": create_engine(maria_url, pool_pre_ping=True)}
    with engines["pg"].begin() as conn:
        conn.execute(text("CREATE TABLE orders (id bigserial PRIMARY KEY, v bigint)"))
        # A timestamp watermark: each writer transaction's rows share its now(); two writers commit out of order.
        conn.execute(text("CREATE TABLE stamped (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), "
                          "created_at timestamptz NOT NULL DEFAULT now(), v bigint)"))
        conn.execute(text("CREATE INDEX ON stamped (created_at)"))
    with engines["maria"].begin() as conn:
        conn.execute(text("CREATE TABLE clicks (id bigint AUTO_INCREMENT PRIMARY KEY, v bigint)"))
    # SQLite too (a database file the daemon's runs read through Spark's JDBC while a writer inserts): WAL lets
    # readers and the writer work at the same time.
    lite_url = f"sqlite:///{home / 'source.db'}"
    engines["lite"] = create_engine(lite_url)
    with engines["lite"].begin() as conn:
        conn.execute(text("PRAGMA journal_mode=WAL"))
        conn.execute(text("CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, v bigint)"))
    # Source names unique per run: a table's identity (progress topic, transactional id) must be new too.
    pg_src, maria_src, lite_src = unique("pg"), unique("maria"), unique("lite")
    table_settings = [
        {"source": pg_src, "table": "public.orders", "watermark": "id", "slice_max_rows": 5000,
         "sensor_interval_seconds": 1, "topic": f"faults.{db_names['pgsrc']}.orders"},
        {"source": maria_src, "table": "clicks", "watermark": "id", "slice_max_rows": 3000, "settle_seconds": 1,
         "sensor_interval_seconds": 1, "topic": f"faults.{db_names['mariasrc']}.clicks", "key": ["id"],
         "topic_partitions": 2},
        {"source": lite_src, "table": "events", "watermark": "id", "slice_max_rows": 3000, "settle_seconds": 1,
         "sensor_interval_seconds": 1, "topic": f"faults.{db_names['pgsrc']}.events"},
        {"source": pg_src, "table": "public.stamped", "watermark": "created_at", "tie_break": "id",
         "slice_max_rows": 3000, "sensor_interval_seconds": 3, "topic": f"faults.{db_names['pgsrc']}.stamped",
         "key": ["id"]},
    ]
    cfg = relay_config(services, {pg_src: pg_url, maria_src: maria_url, lite_src: make_url(lite_url)},
                       [t for t in table_settings if t["table"].rsplit(".", 1)[-1] in tables], spark_remote=True)
    engines[pg_src], engines[maria_src], engines[lite_src] = engines["pg"], engines["maria"], engines["lite"]
    config_file = home / "rowrelay.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    (home / "dagster.yaml").write_text(DAGSTER_YAML.format(
        storage=yaml.safe_dump({"storage": services.dagster_storage(db_names["dagster"])}),
        launcher=LAUNCHERS[launcher]))
    (home / "workspace.yaml").write_text(yaml.safe_dump({"load_from": [{"python_module": {
        "module_name": "orchestration.definitions", "working_directory": str(ROOT)}}]}))
    p = FaultPipeline(services, cfg, home, config_file, engines, launcher=launcher)
    writers = [("pg", "orders", 0.25), ("pg", "orders", 0.25), ("maria", "clicks", 0.25), ("lite", "events", 0.25),
               ("pg", "stamped", 1.0), ("pg", "stamped", 1.0)]
    p.writers = [Writer(engines[e], t, pause=pause) for e, t, pause in writers if t in tables]
    if start:
        p.start_daemon()
        for w in p.writers:
            w.resume()
    try:
        yield p
    finally:
        for w in p.writers:
            w.close()
        p.stop_daemon()
    print("FAULT RESULTS " + json.dumps(RESULTS))
    (ROOT / "tests" / ".fault-results.json").write_text(json.dumps(RESULTS, indent=2))
    for e in (engines["pg"], engines["maria"], engines["lite"]):
        e.dispose()
    with pg_admin.connect() as conn:
        for k in ("dagster", "pgsrc"):
            conn.execute(text(f'DROP DATABASE IF EXISTS "{db_names[k]}" WITH (FORCE)'))
    with maria_admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS `{db_names['mariasrc']}`"))


def _during_a_run(p: FaultPipeline, inject: Callable[[], None]) -> None:
    """Inject the fault at a random moment of a run that is still in flight: a fault that lands between runs would
    let the scenario pass without testing what its name says."""
    assert p.workers_mid_run(), f"no run in flight to inject the fault into in 10 tries; see {p.log}"
    inject()


def restart_broker_mid_publish(p: FaultPipeline) -> None:
    def restart_kafka() -> None:
        stack.stop_pidfile("kafka", stack.home() / "kafka" / "kafka.pid")
        time.sleep(5)
        stack.kafka_up(stack.Ports.from_env())

    _during_a_run(p, restart_kafka)
    p.catch_up_and_verify(f"kafka broker restarted mid-publish ({p.launcher} launcher)", faults=1)


def test_broker_restarted_mid_publish(pipeline: FaultPipeline) -> None:
    restart_broker_mid_publish(pipeline)


def test_source_connections_terminated_mid_read(pipeline: FaultPipeline) -> None:
    """A run's Spark JDBC read loses its PostgreSQL connection (terminated the moment one shows, pgjdbc's
    application_name), then every other connection to the sources goes too (MariaDB's reader among them)."""
    pg_db = pipeline.engines["pg"].url.database
    maria_db = pipeline.engines["maria"].url.database
    admin_pg = create_engine(pipeline.services.pg_url(), isolation_level="AUTOCOMMIT")
    admin_maria = create_engine(pipeline.services.mariadb_url(), isolation_level="AUTOCOMMIT")
    faults = readers = 0

    def terminate() -> None:
        nonlocal faults, readers
        with admin_pg.connect() as conn:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # watch for a read's connection, and end it mid-read
                hit = len(conn.execute(text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :db "
                    "AND application_name = 'PostgreSQL JDBC Driver'"), {"db": pg_db}).all())
                if hit:
                    readers += hit
                    break
                time.sleep(0.01)
            faults += readers + len(conn.execute(text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :db "
                "AND pid <> pg_backend_pid()"), {"db": pg_db}).all())
        with admin_maria.connect() as conn:
            ids = [r[0] for r in conn.execute(text(
                "SELECT id FROM information_schema.processlist WHERE db = :db AND id <> CONNECTION_ID()"),
                {"db": maria_db})]
            for i in ids:
                try:
                    conn.execute(text(f"KILL {int(i)}"))
                    faults += 1
                except Exception:  # noqa: BLE001 - it may have ended meanwhile
                    pass

    for _ in range(8):  # until a JDBC read itself was hit
        _during_a_run(pipeline, terminate)
        time.sleep(3)
        if readers and faults:
            break
    admin_pg.dispose()
    admin_maria.dispose()
    assert readers, "no Spark JDBC read connection was caught open to terminate in 8 runs"
    pipeline.catch_up_and_verify("source connections terminated mid-read", faults=faults)


def test_storage_database_restarted_with_runs_in_flight(pipeline: FaultPipeline) -> None:
    def restart_postgres() -> None:
        stack.postgres_down()
        time.sleep(3)
        stack.postgres_up(stack.Ports.from_env())

    _during_a_run(pipeline, restart_postgres)
    pipeline.catch_up_and_verify("dagster storage (PostgreSQL) restarted with runs in flight", faults=1)


def kill_workers_in_a_loop(p: FaultPipeline, kills_wanted: int) -> None:
    kills = 0
    while kills < kills_wanted:
        pid = p.wait_for_worker(timeout=120)
        time.sleep(random.uniform(0.0, 3.0))  # anywhere from process start to the Kafka commit
        try:
            os.kill(pid, signal.SIGKILL)
            kills += 1
        except ProcessLookupError:
            continue
    p.catch_up_and_verify(f"run worker SIGKILLed at random points ({p.launcher} launcher)", faults=kills,
                          timeout=300)


def test_run_workers_sigkilled_in_a_loop(pipeline: FaultPipeline) -> None:
    kill_workers_in_a_loop(pipeline, 20)


def test_run_workers_sigkilled_before_their_runs_started(pipeline: FaultPipeline) -> None:
    """Workers SIGKILLed between their launch and RUN_START, held there by a failpoint in a daemon of this scenario
    (the pipeline's own daemon: no shared service restarts). Run monitoring only times such a run out (20 s here,
    120 s in dagster.yaml); the warm launcher fails it within seconds of the kill, and a retry publishes it once."""
    from dagster import DagsterInstance, DagsterRunStatus

    pipeline.stop_daemon()
    pipeline.start_daemon(env={**pipeline.env, "ROWRELAY_FAILPOINT": "sleep:worker_released:10"})
    failed_after: list[float] = []
    with DagsterInstance.from_config(str(pipeline.home)) as instance:
        while len(failed_after) < 3:
            deadline = time.monotonic() + 120
            while not (held := pipeline.warm_workers("STARTING")):
                assert time.monotonic() < deadline, f"no worker held before RUN_START in 120 s; see {pipeline.log}"
                time.sleep(0.2)
            try:
                os.kill(held[0]["pid"], signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed = time.monotonic()
            while not (run := instance.get_run_by_id(held[0]["run_id"])).is_finished:
                assert time.monotonic() < killed + 60, f"run {run.run_id} still {run.status} 60 s after the kill"
                time.sleep(0.2)
            assert run.status == DagsterRunStatus.FAILURE, run.status
            failed_after.append(round(time.monotonic() - killed, 1))
    print(f"runs failed {failed_after} s after their workers' kill")
    assert max(failed_after) <= 15, failed_after
    pipeline.stop_daemon()
    pipeline.start_daemon()
    pipeline.catch_up_and_verify("run workers SIGKILLed before their runs started", faults=len(failed_after))


def test_fork_server_sigkilled_mid_run(pipeline: FaultPipeline) -> None:
    """The warm launcher's fork server dies while a worker it forked publishes: the worker finishes, the next
    launch starts a new fork server, nothing is lost or sent twice."""
    servers = {w["server_pid"] for w in pipeline.workers_mid_run()}
    assert servers, f"no run in flight to take the fork server from in 10 tries; see {pipeline.log}"
    for pid in servers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while not ({w["server_pid"] for w in pipeline.warm_workers()} - servers):
        assert time.monotonic() < deadline, f"no run forked by a new fork server within 120 s; see {pipeline.log}"
        time.sleep(0.5)
    pipeline.catch_up_and_verify("warm launcher's fork server SIGKILLed mid-run", faults=len(servers))


def test_run_terminated_mid_publish(pipeline: FaultPipeline) -> None:
    """Terminate, as the UI's button does (the run coordinator asks the launcher to stop the worker): the run is
    canceled, its worker stops, its open transaction is aborted, and the slice is published once later."""
    from dagster import DagsterInstance, DagsterRunStatus

    from orchestration.launcher import process_start_ticks

    ended = (DagsterRunStatus.CANCELED, DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE)
    canceled = None
    with DagsterInstance.from_config(str(pipeline.home)) as instance:
        for _ in range(5):  # a run may finish before the terminate reaches it: take the next one
            running = pipeline.workers_mid_run()
            if not running:
                continue
            worker = running[0]
            instance.run_coordinator.cancel_run(worker["run_id"])
            deadline = time.monotonic() + 60
            while (run := instance.get_run_by_id(worker["run_id"])) is not None and run.status not in ended:
                assert time.monotonic() < deadline, f"run {worker['run_id']} still {run.status} after terminate"
                time.sleep(0.5)
            if run is not None and run.status == DagsterRunStatus.CANCELED:
                canceled = worker
                break
    assert canceled is not None, f"no run was caught mid-publish to terminate; see {pipeline.log}"
    deadline = time.monotonic() + 10
    while (proc := process_start_ticks(canceled["pid"])) is not None and proc[1] != "Z":  # gone, or a zombie
        assert time.monotonic() < deadline, f"worker {canceled['pid']} still running after its run was canceled"
        time.sleep(0.2)
    pipeline.catch_up_and_verify("run terminated mid-publish (the UI's Terminate)", faults=1)


def kill_daemon_mid_run(p: FaultPipeline) -> None:
    _during_a_run(p, p.kill_daemon)
    time.sleep(3)
    p.start_daemon()
    p.catch_up_and_verify(f"dagster daemon SIGKILLed (with its workers) and restarted ({p.launcher} launcher)",
                          faults=1)


def test_daemon_killed_and_restarted(pipeline: FaultPipeline) -> None:
    kill_daemon_mid_run(pipeline)


def test_zombie_publisher_resumes_after_takeover(pipeline: FaultPipeline) -> None:
    """A frozen worker (SIGSTOP inside its open transaction) wakes up after a newer publisher took over."""
    from assets.identity import asset_key
    from resources.slices import SliceRange

    pipeline.stop_daemon()  # nothing else may publish meanwhile
    for w in pipeline.writers:
        w.pause_writes()
    table = pipeline.config.tables[0]
    from dagster import DagsterInstance

    from assets.identity import channel_for
    from resources.exactly_once import read_committed_progress

    with pipeline.engines["pg"].begin() as conn:
        conn.execute(text("INSERT INTO orders (v) SELECT g FROM generate_series(1, 50) g"))
        top = conn.execute(text("SELECT max(id) FROM orders")).scalar()
    # The next slice after what Kafka says is committed (a killed run may have left later partitions unrun).
    committed = read_committed_progress({"bootstrap.servers": pipeline.services.kafka_bootstrap},
                                        channel_for(table, PREFIX))
    new_key = SliceRange(committed.hi if committed else 0, top).key
    with DagsterInstance.from_config(str(pipeline.home)) as instance:
        instance.add_dynamic_partitions(f"{table.dagster_name}__slices", [new_key])
    select = "/".join(asset_key(table).path)
    cmd = [sys.executable, "-m", "dagster", "asset", "materialize", "--select", select, "--partition", new_key,
           "-m", "orchestration.definitions"]
    zombie_log = pipeline.home / "zombie.log"
    with open(zombie_log, "wb") as log:  # a file, not a pipe: a full pipe would block the zombie early
        zombie = subprocess.Popen(cmd, cwd=ROOT, env={**pipeline.env, "ROWRELAY_FAILPOINT": "stop:rows_produced"},
                                  stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "T":
        assert time.monotonic() < deadline and zombie.poll() is None, "zombie never froze in its transaction"
        time.sleep(0.2)
    newer = subprocess.run(cmd, cwd=ROOT, env=pipeline.env, capture_output=True, text=True, timeout=300)
    assert newer.returncode == 0, newer.stdout[-2000:] + newer.stderr[-2000:]
    os.kill(zombie.pid, signal.SIGCONT)
    zombie.wait(timeout=120)
    out = zombie_log.read_text(errors="replace")
    assert zombie.returncode != 0, "the zombie must fail: it was fenced"
    assert "fenced" in out.lower() or "another publisher took over" in out or "PRODUCER_FENCED" in out, out[-3000:]
    pipeline.start_daemon()  # writers stay paused: the newer publisher already sent everything up to `top`
    pipeline.catch_up_and_verify("zombie publisher resumed after a newer one took over", faults=1)
