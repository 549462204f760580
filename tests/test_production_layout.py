"""rowrelay in Dagster's production layout: the code location is its own gRPC code server (`dagster code-server
start`), the webserver and the daemon are separate processes that reach it through a `workspace.yaml`
`grpc_server:` entry, and runs are started by Dagster's DefaultRunLauncher through that code server — the shape
the official Helm chart deploys. One run is launched through the webserver's GraphQL API (as the UI launches
one), one by the table's sensor; each relays its rows, exactly once.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from dagster import DagsterInstance, DagsterRunStatus, RunsFilter
from dagster_graphql import DagsterGraphQLClient
from sqlalchemy import text
from sqlalchemy.engine import URL, Engine

from assets.identity import channel_for, partitions_for
from orchestration.factory import job_name
from orchestration.verify import verify_table
from resources.config import RelayConfig, TableConfig
from resources.exactly_once import read_committed_progress
from resources.keys import WARM_WORKER_TAG
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.slices import SliceRange
from stack.screenshot import graphql, wait_for_ui
from tests.conftest import Services
from tests.pipeline import ROOT, dagster_database, id_table_config
from tests.private_servers import free_ports
from tests.test_faults import DAGSTER_YAML, LAUNCHERS

pytestmark = pytest.mark.integration

LOCATION = "rowrelay"
REPOSITORY = "__repository__"  # the repository Dagster names for a code location's `Definitions`


class Layout:
    """The three Dagster processes of a deployment, each in its own process group, logging to `home`."""

    def __init__(self, home: Path, env: dict[str, str]) -> None:
        self.home, self.env = home, env
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str]) -> None:
        log = open(self.home / f"{name}.log", "ab")  # noqa: SIM115 - owned by the process
        self.procs[name] = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=self.env,
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.home.glob("*.log"))

    def stop(self) -> None:
        from bench.run import stop_process_group

        for proc in reversed(self.procs.values()):
            with contextlib.suppress(ProcessLookupError):
                stop_process_group(proc, grace_s=30)


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, layout: Layout) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert time.monotonic() < deadline, f"{what} not within {timeout:.0f} s\n{layout.logs()}"
        time.sleep(1)
    return found


def wait_for_code_server(port: int, layout: Layout, timeout: float = 120.0) -> None:
    from dagster._grpc.client import DagsterGrpcClient  # the ping the daemon and webserver use themselves

    client = DagsterGrpcClient(port=port, host="127.0.0.1")

    def answers() -> bool:
        try:
            return bool(client.ping("x"))
        except Exception:  # noqa: BLE001 - not listening yet
            return False

    wait_until(answers, timeout, "the code server answering", layout)


REPOSITORY_SELECTOR = {"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY}
SENSOR_STATE = """query ($s: SensorSelector!) { sensorOrError(sensorSelector: $s) {
    ... on Sensor { sensorState { id status } } } }"""
STOP_SENSOR = """mutation ($id: String!) { stopSensor(id: $id) {
    __typename ... on StopSensorMutationResult { instigationState { status } } } }"""
START_SENSOR = "mutation ($s: SensorSelector!) { startSensor(sensorSelector: $s) { __typename } }"
ADD_PARTITION = """mutation ($name: String!, $key: String!, $repo: RepositorySelector!) {
    addDynamicPartition(partitionsDefName: $name, partitionKey: $key, repositorySelector: $repo) { __typename } }"""


def sensor_state_id(base: str, sensor: str) -> str:
    data = graphql(base, SENSOR_STATE, s={**REPOSITORY_SELECTOR, "sensorName": sensor})
    return data["sensorOrError"]["sensorState"]["id"]


def committed_hi(conf: dict[str, str], table: TableConfig) -> int:
    progress = read_committed_progress(conf, channel_for(table, PREFIX))
    return progress.hi if progress else 0


def insert(engine: Engine, table: str, rows: int) -> int:
    with engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {table} (v) SELECT 'r' || g FROM generate_series(1, {rows}) g"))
        return conn.execute(text(f"SELECT max(id) FROM {table}")).scalar()


@pytest.fixture
def deployment(services: Services, pg_database: URL, pg_engine: Engine, tmp_path: Path
               ) -> Iterator[tuple[Layout, Any, RelayConfig, str]]:
    if not services.spark_remote:
        pytest.skip("the production layout runs on the stack's Spark Connect server")
    cfg = id_table_config(services, pg_database, pg_engine, "prod")
    with dagster_database(pg_engine) as dagster_db:
        config_file = tmp_path / "rowrelay.yaml"
        config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
        (tmp_path / "dagster.yaml").write_text(DAGSTER_YAML.format(
            storage=yaml.safe_dump({"storage": services.dagster_storage(dagster_db)}), launcher=LAUNCHERS["default"]))
        grpc_port, web_port = free_ports(2)
        (tmp_path / "workspace.yaml").write_text(yaml.safe_dump({"load_from": [{"grpc_server": {
            "host": "127.0.0.1", "port": grpc_port, "location_name": LOCATION}}]}))
        env = {**os.environ, "DAGSTER_HOME": str(tmp_path), "ROWRELAY_CONFIG": str(config_file),
               "PYTHONPATH": str(ROOT)}
        layout = Layout(tmp_path, env)
        try:
            layout.start("code-server", ["dagster", "code-server", "start", "-m", "orchestration.definitions",
                                         "-h", "127.0.0.1", "-p", str(grpc_port), "--location-name", LOCATION])
            wait_for_code_server(grpc_port, layout)
            layout.start("webserver", ["dagster_webserver", "-h", "127.0.0.1", "-p", str(web_port), "-w",
                                       str(tmp_path / "workspace.yaml")])
            base = f"http://127.0.0.1:{web_port}"
            wait_for_ui(base, timeout=120)
            with DagsterInstance.from_config(str(tmp_path)) as instance:
                yield layout, instance, cfg, base
        finally:
            layout.stop()


def test_a_run_launched_through_graphql_and_one_by_the_sensor_each_relay_their_rows(
        deployment: tuple[Layout, Any, RelayConfig, str], services: Services, pg_engine: Engine) -> None:
    layout, instance, cfg, base = deployment
    table = cfg.tables[0]
    conf = {"bootstrap.servers": services.kafka_bootstrap}
    sensor = f"{table.dagster_name}_slices"
    # The sensor stopped through the API before the daemon starts: the first slice is the GraphQL run's alone.
    stopped = graphql(base, STOP_SENSOR, id=sensor_state_id(base, sensor))
    assert stopped["stopSensor"]["instigationState"]["status"] == "STOPPED", stopped
    first_hi = insert(pg_engine, table.table_name, 300)
    key = SliceRange(0, first_hi).key
    added = graphql(base, ADD_PARTITION, name=partitions_for(table).name, key=key, repo=REPOSITORY_SELECTOR)
    assert added["addDynamicPartition"]["__typename"] == "AddDynamicPartitionSuccess", added
    client = DagsterGraphQLClient("127.0.0.1", port_number=int(base.rsplit(":", 1)[1]))
    run_id = client.submit_job_execution(job_name(table), repository_location_name=LOCATION,
                                         repository_name=REPOSITORY, tags={"dagster/partition": key})
    layout.start("daemon", ["dagster._daemon", "run", "-w", str(layout.home / "workspace.yaml")])
    run = wait_until(lambda: (r := instance.get_run_by_id(run_id)) and r.is_finished and r, 240,
                     "the GraphQL run finishing", layout)
    assert run.status == DagsterRunStatus.SUCCESS, f"{run.status}\n{layout.logs()}"
    print(f"GraphQL run {run_id} relayed (0, {first_hi}]")
    assert committed_hi(conf, table) == first_hi

    started = graphql(base, START_SENSOR, s={**REPOSITORY_SELECTOR, "sensorName": sensor})
    assert started["startSensor"]["__typename"] == "Sensor", started
    second_hi = insert(pg_engine, table.table_name, 500)
    wait_until(lambda: committed_hi(conf, table) >= second_hi, 240, "the sensor's runs relaying the new rows",
               layout)
    by_sensor = [r for r in instance.get_runs(RunsFilter(job_name=job_name(table)))
                 if r.tags.get("dagster/sensor_name") == sensor]
    assert by_sensor and all(r.status == DagsterRunStatus.SUCCESS for r in by_sensor if r.is_finished)
    assert WARM_WORKER_TAG not in run.tags  # Dagster's DefaultRunLauncher started it through the code server

    report = verify_table(cfg, table)
    assert report.ok and report.source_rows == report.messages == 800, report
