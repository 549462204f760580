"""The code location image's recipe (deploy/install.sh, which deploy/Dockerfile runs) works on a fresh
directory: a new virtualenv gets rowrelay with the locked dependencies, every product module imports from the
installed copy (not this checkout), the CLI starts, and the code location's definitions load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.pipeline import ROOT

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


def test_the_image_recipe_installs_a_working_code_location_in_a_fresh_venv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    install = subprocess.run([str(ROOT / "deploy" / "install.sh"), str(venv)], capture_output=True, text=True,
                             timeout=600)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    python = str(venv / "bin" / "python")
    # Run from an empty directory so nothing of this checkout is importable but what was installed.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
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
