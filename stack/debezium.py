"""Kafka Connect + Debezium's PostgreSQL connector from Maven Central, for the benchmark peer.

The jars land in ``$ROWRELAY_HOME/debezium/libs`` (default ``~/.cache/rowrelay/debezium/libs``), outside any
checkout, fetched once by Maven from ``stack/poms/debezium.xml`` and reused while that pom is unchanged.
Used by ``bench/debezium_peer.py``; not part of ``python -m stack up`` (the product never needs them).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from stack.local import STACK_DIR, StackError, home, log

POM = STACK_DIR / "poms" / "debezium.xml"


def debezium_home() -> Path:
    return home() / "debezium"


def debezium_libs() -> Path:
    return debezium_home() / "libs"


def ensure_debezium_jars() -> Path:
    """Copy the pom's runtime dependencies into ``debezium_libs()`` once; return that folder.

    A ``.complete`` marker holds the pom text it was built from, so editing the pom (a version bump)
    refetches, and a fetch that died half-way (no marker) starts over instead of running on a partial set.
    """
    target = debezium_libs()
    marker = target / ".complete"
    pom_text = POM.read_text(encoding="utf-8")
    if marker.exists() and marker.read_text(encoding="utf-8") == pom_text:
        return target
    for tool in ("java", "mvn"):
        if not shutil.which(tool):
            raise StackError(f"{tool} not found; run: apt-get install -y openjdk-17-jre-headless maven")
    log(f"fetching Kafka Connect + Debezium jars from Maven Central into {target}")
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    try:
        subprocess.run(
            ["mvn", "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
             "-DincludeScope=runtime", f"-DoutputDirectory={target}"],
            check=True, text=True, capture_output=True,
        )
    except subprocess.CalledProcessError as exc:
        raise StackError(f"mvn could not fetch the Debezium jars:\n{exc.stdout}\n{exc.stderr}") from exc
    if not any(target.glob("debezium-connector-postgres-*.jar")):
        raise StackError(f"mvn finished but {target} has no debezium-connector-postgres jar")
    marker.write_text(pom_text, encoding="utf-8")
    return target


def jar_version(libs: Path, artifact: str) -> str:
    """The version in ``<artifact>-<version>.jar`` inside ``libs`` (e.g. 'debezium-connector-postgres')."""
    for jar in sorted(libs.glob(f"{artifact}-*.jar")):
        rest = jar.name[len(artifact) + 1 : -len(".jar")]
        if rest[:1].isdigit():
            return rest
    raise StackError(f"no {artifact} jar in {libs}")


if __name__ == "__main__":
    libs = ensure_debezium_jars()
    print(f"{libs}: debezium {jar_version(libs, 'debezium-connector-postgres')}, "
          f"connect {jar_version(libs, 'connect-runtime')}")
