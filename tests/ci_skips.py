"""Under CI=true, a skipped integration or fault test (or any test on the real services, marked or not) fails the
run: a suite must not pass by not running.

A skip is allowed only where it is a fact of the environment named below (testcontainers mode has no TLS, SASL
listener, Spark Connect server or stack command of the local stack). Bench tests are neither integration nor
faults: `make test-bench` runs them on purpose, and their skips stay skips. An expected failure (xfail) is not a
skip either.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

GUARDED_MARKERS = ("integration", "faults")
# A test on the real services is guarded even if its marker was forgotten (every stack fixture asks for `services`).
STACK_FIXTURE = "services"

# Reasons a skip is the environment's, with the environment they are allowed in. Every other reason fails.
CONTAINER_ONLY_SKIPS = (
    "tests the local stack command",
    "TLS is set up by the local stack only",
    "the SASL_SSL listener is set up by the local stack only",
    "no Spark Connect server in this test environment",
    "this MariaDB serves TLS; the test needs one that does not",  # testcontainers' MariaDB may serve TLS
)


def ci_run() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def allowed(reason: str) -> bool:
    return os.environ.get("ROWRELAY_TEST_CONTAINERS") == "1" and reason in CONTAINER_ONLY_SKIPS


def guarded(item: pytest.Item) -> bool:
    if item.get_closest_marker("bench"):
        return False
    return (any(item.get_closest_marker(m) for m in GUARDED_MARKERS)
            or STACK_FIXTURE in getattr(item, "fixturenames", ()))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not (report.skipped and ci_run()) or hasattr(report, "wasxfail"):
        return
    if not guarded(item):
        return
    reason = skip_reason(report)
    if allowed(reason):
        return
    report.outcome = "failed"
    report.longrepr = (f"{item.nodeid} was skipped under CI=true ({reason}); an integration or fault test must run "
                       "in CI: provide what it needs, or list the reason in tests/ci_skips.py if only an environment "
                       "other than the local stack lacks it")
