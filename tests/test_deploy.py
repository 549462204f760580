"""rowrelay installed as its users install it, in a fresh virtualenv:
- the code location image's recipe (deploy/install.sh, which deploy/Dockerfile runs): rowrelay with the locked
  dependencies, every product module imported from the installed copy (not this checkout), the CLI starting, the
  code location's definitions loading;
- a Dagster project adopting it as a component: `create-dagster project`, `dg scaffold defs` of the rowrelay
  component, `dg check defs`, `dg list defs`, and a daemon's sensor run relaying rows on the stack exactly once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster
import pytest
import yaml
from sqlalchemy import text
from sqlalchemy.engine import URL, Engine

from assets.identity import channel_for
from orchestration.verify import verify_table
from resources.exactly_once import read_committed_progress
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from tests.conftest import Services
from tests.pipeline import ROOT, dagster_database, id_table_config
from tests.test_faults import DAGSTER_YAML, LAUNCHERS

pytestmark = pytest.mark.integration

CHECK = """
import importlib, pkgutil, sys
import orchestration, assets, resources
names = [m.name for pkg in (orchestration, assets, resources)
         for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".") if not m.name.endswith(".__main__")]
for name in names:
    module = importlib.import_module(name)
    assert "/site-packages/" in module.__file__, module.__file__
assert "stack" not in sys.modules
import resources.arrow_produce as native
print(len(names), native.LIBRARY.exists())
"""


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with rowrelay installed by the image's recipe."""
    venv = tmp_path_factory.mktemp("deploy") / "venv"
    install = subprocess.run([str(ROOT / "deploy" / "install.sh"), str(venv)], capture_output=True, text=True,
                             timeout=600)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    return venv


def clean_env() -> dict[str, str]:
    """This process's environment without what would make this checkout importable."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def test_the_image_recipe_installs_a_working_code_location_in_a_fresh_venv(venv: Path, tmp_path: Path) -> None:
    python = str(venv / "bin" / "python")
    # Run from an empty directory so nothing of this checkout is importable but what was installed.
    env = clean_env()
    work = tmp_path / "work"
    work.mkdir()
    config = work / "rowrelay.yaml"
    config.write_text(yaml.safe_dump({
        "sources": {"shop": {"url": "postgresql://u:p@db.example:5432/shop"}},
        "tables": [{"source": "shop", "table": "public.orders", "watermark": "id"}],
        "kafka": {"bootstrap_servers": "kafka.example:9092"},
        "spark": {"remote": "sc://spark.example:15002"}}))
    env = {**env, "ROWRELAY_CONFIG": str(config), "DAGSTER_HOME": str(work)}
    checked = subprocess.run([python, "-c", CHECK], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stderr[-3000:]
    modules, native = checked.stdout.split()
    assert int(modules) >= 20 and native == "True", checked.stdout
    cli = subprocess.run([str(venv / "bin" / "rowrelay"), "--help"], cwd=work, env=env, capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 0 and "verify" in cli.stdout, cli.stdout + cli.stderr
    loaded = subprocess.run([str(venv / "bin" / "dagster"), "definitions", "validate", "-m",
                             "orchestration.definitions"], cwd=work, capture_output=True, text=True, timeout=300,
                            env=env)
    assert loaded.returncode == 0, loaded.stdout[-3000:] + loaded.stderr[-3000:]
    assert sys.executable != python


def run_ok(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def a_project_with_the_component(venv: Path, tmp_path: Path, settings: dict, env: dict[str, str]) -> Path:
    """A Dagster project as `create-dagster` makes one, with a rowrelay component scaffolded by `dg scaffold defs`
    and its attributes set to `settings`; returns the project's directory."""
    bin_ = venv / "bin"
    run_ok([str(bin_ / "python"), "-m", "uv", "pip", "install", "--quiet", "--python", str(bin_ / "python"),
            f"dagster-dg-cli=={dagster.__version__}", f"create-dagster=={dagster.__version__}"], tmp_path, env)
    run_ok([str(bin_ / "create-dagster"), "project", "--no-uv-sync", "adopter"], tmp_path, env)
    project = tmp_path / "adopter"
    run_ok([str(bin_ / "python"), "-m", "uv", "pip", "install", "--quiet", "--python", str(bin_ / "python"),
            "--no-deps", "-e", str(project)], tmp_path, env)
    listed = run_ok([str(bin_ / "dg"), "list", "components"], project, env)
    assert "orchestration.component.RelayComponent" in listed, listed
    run_ok([str(bin_ / "dg"), "scaffold", "defs", "orchestration.component.RelayComponent", "relay"], project, env)
    defs = project / "src" / "adopter" / "defs" / "relay" / "defs.yaml"
    scaffolded = yaml.safe_load(defs.read_text())
    assert scaffolded["type"] == "orchestration.component.RelayComponent", scaffolded
    defs.write_text(yaml.safe_dump({**scaffolded, "attributes": settings}))
    return project


def dagster_home(home: Path, services: Services, dagster_db: str) -> Path:
    """A DAGSTER_HOME whose instance stores in `dagster_db` and launches runs with Dagster's DefaultRunLauncher."""
    home.mkdir()
    (home / "dagster.yaml").write_text(DAGSTER_YAML.format(
        storage=yaml.safe_dump({"storage": services.dagster_storage(dagster_db)}), launcher=LAUNCHERS["default"]))
    return home


def test_a_dagster_project_adopts_the_component_and_its_sensor_relays_rows(
        venv: Path, tmp_path: Path, services: Services, pg_database: URL, pg_engine: Engine) -> None:
    cfg = id_table_config(services, pg_database, pg_engine, "adopt")
    table = cfg.tables[0]
    with dagster_database(pg_engine) as dagster_db:
        home = dagster_home(tmp_path / "home", services, dagster_db)
        env = {**clean_env(), "DAGSTER_HOME": str(home), "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}
        project = a_project_with_the_component(venv, tmp_path, cfg.model_dump(mode="json", exclude_none=True), env)
        checked = run_ok([str(venv / "bin" / "dg"), "check", "defs"], project, env)
        assert "loaded successfully" in checked, checked
        listed = run_ok([str(venv / "bin" / "dg"), "list", "defs", "--json"], project, env)
        assert f'"src/public/{table.table_name}"' in listed.replace(" ", ""), listed[-3000:]
        with pg_engine.begin() as conn:
            conn.execute(text(f"INSERT INTO {table.table_name} (v) SELECT 'r' || g FROM generate_series(1, 2500) g"))
        log = open(home / "daemon.log", "ab")  # noqa: SIM115 - owned by the daemon
        daemon = subprocess.Popen([str(venv / "bin" / "dagster-daemon"), "run", "-m", "adopter.definitions"],
                                  cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            conf = {"bootstrap.servers": services.kafka_bootstrap}
            deadline = time.monotonic() + 300
            while (progress := read_committed_progress(conf, channel_for(table, PREFIX))) is None or \
                    progress.hi < 2500:
                assert daemon.poll() is None and time.monotonic() < deadline, \
                    f"the component's sensor runs did not relay 2500 rows\n{(home / 'daemon.log').read_text()[-4000:]}"
                time.sleep(2)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait(30)
        defs = project / "src" / "adopter" / "defs" / "relay" / "defs.yaml"
        verified = run_ok([str(venv / "bin" / "rowrelay"), "--defs", str(defs), "verify"], project, env)
        assert "2500" in verified, verified
        report = verify_table(cfg, table)
        assert report.ok and report.source_rows == report.messages == 2500, report
