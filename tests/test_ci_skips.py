"""tests/ci_skips.py, proven on a tiny test file run by a pytest of its own (the plugin only, no stack)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TINY = '''
import pytest

@pytest.mark.integration
def test_body_skip():
    pytest.skip("no widget here")

@pytest.mark.integration
@pytest.mark.skipif(True, reason="widget off")
def test_skipif():
    pass

@pytest.fixture
def needs_widget():
    pytest.skip("fixture found no widget")

@pytest.mark.faults
def test_fixture_skip(needs_widget):
    pass

@pytest.mark.integration
def test_environment_skip():
    pytest.skip("TLS is set up by the local stack only")

def test_unmarked_skip():
    pytest.skip("pure test, skipped on purpose")

@pytest.mark.bench
def test_bench_skip():
    pytest.skip("no JVM peer")

@pytest.mark.integration
@pytest.mark.xfail(reason="known", strict=True)
def test_xfail():
    assert False

@pytest.mark.integration
def test_runs():
    pass

@pytest.fixture
def services():
    pytest.skip("no stack here")

def test_unmarked_on_the_stack(services):
    pass
'''

GUARDED = ("test_body_skip", "test_skipif", "test_fixture_skip", "test_unmarked_on_the_stack")


def run_tiny(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_tiny.py").write_text(TINY)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    integration\n    faults\n    bench\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "ROWRELAY_TEST_CONTAINERS")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.ci_skips", "-p", "no:cacheprovider", "-rA", "-q",
         "--strict-markers", "test_tiny.py"],
        cwd=tmp_path, env={**clean, "PYTHONPATH": str(ROOT), **env}, capture_output=True, text=True, timeout=120)


def outcomes(out: str) -> dict[str, str]:
    """test name -> PASSED/FAILED/ERROR/XFAIL from the -rA summary (a skip in setup fails as an ERROR at setup)."""
    found: dict[str, str] = {}
    for line in out.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR", "XFAIL") and rest.startswith("test_tiny.py::"):
            found[rest.removeprefix("test_tiny.py::").split()[0]] = word
    return found


def test_skips_fail_an_integration_or_fault_run_under_ci(tmp_path: Path) -> None:
    res = run_tiny(tmp_path, CI="true")
    assert res.returncode == 1, res.stdout + res.stderr
    got = outcomes(res.stdout)
    for name in (*GUARDED, "test_environment_skip"):  # an environment skip is allowed in containers mode only
        assert got.get(name) in ("FAILED", "ERROR"), (name, res.stdout)
    assert got.get("test_runs") == "PASSED" and got.get("test_xfail") == "XFAIL", res.stdout
    for name, reason in (("test_body_skip", "no widget here"), ("test_skipif", "widget off"),
                         ("test_fixture_skip", "fixture found no widget"),
                         ("test_unmarked_on_the_stack", "no stack here")):
        assert f"test_tiny.py::{name} was skipped under CI=true ({reason})" in res.stdout, res.stdout
    # Unmarked and bench tests keep their skips (reported as skips, not failures).
    assert "SKIPPED [1] test_tiny.py:26: pure test, skipped on purpose" in res.stdout, res.stdout
    assert "SKIPPED [1] test_tiny.py:30: no JVM peer" in res.stdout, res.stdout
    assert "2 failed, 1 passed, 2 skipped, 1 xfailed, 3 errors" in res.stdout, res.stdout


def test_environment_skip_is_allowed_only_where_the_environment_lacks_the_part(tmp_path: Path) -> None:
    res = run_tiny(tmp_path, CI="true", ROWRELAY_TEST_CONTAINERS="1")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "SKIPPED [1] test_tiny.py:23: TLS is set up by the local stack only" in res.stdout, res.stdout
    assert set(outcomes(res.stdout)) == {*GUARDED, "test_runs", "test_xfail"}, res.stdout


def test_outside_ci_skips_stay_skips(tmp_path: Path) -> None:
    res = run_tiny(tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 passed, 7 skipped, 1 xfailed in" in res.stdout, res.stdout
