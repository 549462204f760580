"""A Kafka broker a test starts for itself: one KRaft node (broker and controller) from the jars and properties the
local stack's broker uses (stack/local.py), on free ports with its own data directory. For faults the shared
broker must not take: a broker paused (SIGSTOP) in the middle of a commit, or killed."""

from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from stack.local import KAFKA_LOG4J, Ports, kafka_classpath, kafka_properties, kafka_ready
from tests.private_servers import free_ports

# A small heap: one test's topics, not the thousands the shared broker collects.
JVM_OPTIONS = ("-Xms256m", "-Xmx512m", "-XX:+UseG1GC", "-Djava.awt.headless=true")


@dataclass
class PrivateKafka:
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def pause(self) -> None:
        """Freeze the broker (SIGSTOP): connections stay open, requests wait unanswered in its sockets."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _cluster_id() -> str:
    cluster_id = "-"
    while cluster_id.startswith("-"):  # read as an option otherwise (Kafka's own Uuid.randomUuid skips those too)
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
    return cluster_id


@contextmanager
def private_kafka(settings: dict[str, str] | None = None, start_timeout_s: float = 180.0) -> Iterator[PrivateKafka]:
    """A fresh broker, ready to answer metadata; `settings` are appended to the stack's server.properties. Killed
    (resumed first, if paused) and its data removed on exit."""
    base = Path(tempfile.mkdtemp(prefix="rowrelay-kafka-"))
    kafka, controller = free_ports(2)
    ports = Ports(kafka=kafka, kafka_controller=controller, postgres=0, mariadb=0, spark_connect=0)
    props, log4j, log = base / "server.properties", base / "log4j2.properties", base / "kafka.log"
    props.write_text(kafka_properties(ports, base / "data")
                     + "".join(f"{key}={value}\n" for key, value in (settings or {}).items()))
    log4j.write_text(KAFKA_LOG4J)
    java = ["java", f"-Dlog4j2.configurationFile={log4j}", "-cp", kafka_classpath()]
    process: subprocess.Popen[bytes] | None = None
    try:
        subprocess.run([*java, "kafka.tools.StorageTool", "format", "-t", _cluster_id(), "-c", str(props),
                        "--standalone"], check=True, capture_output=True)
        with open(log, "ab") as out:
            process = subprocess.Popen(["java", *JVM_OPTIONS, *java[1:], "kafka.Kafka", str(props)], stdout=out,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        broker = PrivateKafka(ports.kafka, process, log)
        deadline = time.monotonic() + start_timeout_s
        while not kafka_ready(ports.kafka):
            assert process.poll() is None, f"the private broker exited:\n{broker.log_tail()}"
            assert time.monotonic() < deadline, f"the private broker not ready in {start_timeout_s} s:\n" \
                                                f"{broker.log_tail()}"
            time.sleep(0.5)
        yield broker
    finally:
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)  # a stopped process takes SIGKILL too, but resume it for clarity
            process.kill()
            process.wait(30)
        shutil.rmtree(base, ignore_errors=True)
