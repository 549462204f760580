"""A replicated Kafka cluster from the stack's jars: N KRaft nodes (each a broker and a controller, a static quorum)
with the settings a production cluster has, on 127.0.0.1.

Replication 3, `min.insync.replicas=2`, the transaction state log replicated the same way, no unclean leader
election: what rowrelay's guarantee relies on where a broker can die. The fault tests of a cluster
(tests/test_kafka_cluster.py) start one per module and SIGKILL, SIGSTOP and restart its nodes.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from stack.local import KAFKA_LOG4J, kafka_classpath, kafka_ready, log, pid_alive, read_pid, stop_pidfile

# Small heaps: a test's topics, three JVMs on a small machine.
JVM_OPTIONS = ("-Xms256m", "-Xmx512m", "-XX:+UseG1GC", "-Djava.awt.headless=true")
TRANSACTION_STATE_PARTITIONS = 3  # few, so the tests can tell which node coordinates a transactional id

PRODUCTION_SETTINGS = {
    "default.replication.factor": "3",
    "min.insync.replicas": "2",
    "offsets.topic.replication.factor": "3",
    "transaction.state.log.replication.factor": "3",
    "transaction.state.log.min.isr": "2",
    "transaction.state.log.num.partitions": str(TRANSACTION_STATE_PARTITIONS),
    "unclean.leader.election.enable": "false",
    "share.coordinator.state.topic.replication.factor": "3",
    "share.coordinator.state.topic.min.isr": "2",
}


def cluster_id() -> str:
    found = "-"
    while found.startswith("-"):  # read as an option otherwise (Kafka's own Uuid.randomUuid skips those too)
        found = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
    return found


def node_properties(node: int, ports: list[int], controllers: list[int], data: Path,
                    settings: dict[str, str]) -> str:
    voters = ",".join(f"{i + 1}@127.0.0.1:{c}" for i, c in enumerate(controllers))
    port, controller = ports[node - 1], controllers[node - 1]
    lines = {
        "process.roles": "broker,controller",
        "node.id": str(node),
        "controller.quorum.voters": voters,
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(data),
        "num.partitions": "1",
        "auto.create.topics.enable": "false",
        "offsets.topic.num.partitions": "1",
        "group.initial.rebalance.delay.ms": "0",
        "transaction.abort.timed.out.transaction.cleanup.interval.ms": "2000",
        **PRODUCTION_SETTINGS,
        **settings,
    }
    return "".join(f"{key}={value}\n" for key, value in lines.items())


@dataclass
class Node:
    node_id: int
    port: int
    base: Path
    process: subprocess.Popen | None = None

    @property
    def log(self) -> Path:
        return self.base / "kafka.log"

    def command(self) -> list[str]:
        return ["java", *JVM_OPTIONS, f"-Dlog4j2.configurationFile={self.base / 'log4j2.properties'}", "-cp",
                kafka_classpath(), "kafka.Kafka", str(self.base / "server.properties")]

    @property
    def pidfile(self) -> Path:
        return self.base / "kafka.pid"

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        self.pidfile.write_text(str(self.process.pid))

    @property
    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return pid_alive(read_pid(self.pidfile))  # a node an earlier `make stack` started

    def kill(self) -> None:
        """SIGKILL: the node's socket buffers, page cache writes not yet on disk and open requests die with it."""
        if self.alive:
            assert self.process is not None
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
            self.process.wait(30)

    def stop(self) -> None:
        """A clean shutdown (SIGTERM), as a rolling restart does: leadership moves off first."""
        if self.alive:
            assert self.process is not None
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()

    def pause(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""


@dataclass
class KafkaCluster:
    nodes: list[Node] = field(default_factory=list)

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def node(self, node_id: int) -> Node:
        return next(n for n in self.nodes if n.node_id == node_id)

    def brokers_up(self, timeout: float = 5.0) -> set[int]:
        """The node ids the cluster's metadata lists as brokers now (asked of any node that answers)."""
        from confluent_kafka.admin import AdminClient

        live = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes if n.alive)
        if not live:
            return set()
        try:
            metadata = AdminClient({"bootstrap.servers": live, "log_level": 0}).list_topics(timeout=timeout)
        except Exception:  # noqa: BLE001 - no node answering yet
            return set()
        return set(metadata.brokers)

    def wait_for(self, wanted: set[int], timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not wanted <= self.brokers_up():
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- node {n.node_id}\n{n.log_tail()}" for n in self.nodes)
                raise TimeoutError(f"brokers {sorted(wanted)} not up in {timeout:.0f} s\n{tails}")
            time.sleep(0.5)

    def out_of_isr(self, node_id: int, timeout: float = 10.0) -> list[str]:
        """The partitions (every topic's, the internal ones too) whose in-sync replicas lack `node_id` now."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        topics = admin.list_topics(timeout=timeout).topics
        return [f"{name}[{p}]" for name, meta in topics.items() for p, part in meta.partitions.items()
                if node_id in part.replicas and node_id not in part.isrs]

    def wait_in_isr(self, node_id: int, timeout: float = 180.0) -> None:
        """Until `node_id` is a broker again and back in the in-sync replicas of every partition it holds."""
        deadline = time.monotonic() + timeout
        self.wait_for({node_id}, timeout)
        while lagging := self.out_of_isr(node_id):
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node_id} not back in the ISR of {lagging} in {timeout:.0f} s")
            time.sleep(0.5)

    def kill_all(self) -> None:
        for node in self.nodes:
            node.kill()


def start_cluster(base: Path, ports: list[int], controllers: list[int], settings: dict[str, str] | None = None
                  ) -> KafkaCluster:
    """Formats and starts len(ports) nodes under `base` (one directory each) and waits until all are brokers."""
    ident = cluster_id()
    cluster = KafkaCluster()
    for i in range(1, len(ports) + 1):
        node_base = base / f"node-{i}"
        node_base.mkdir(parents=True, exist_ok=True)
        props = node_base / "server.properties"
        props.write_text(node_properties(i, ports, controllers, node_base / "data", settings or {}))
        (node_base / "log4j2.properties").write_text(KAFKA_LOG4J)
        subprocess.run(["java", "-cp", kafka_classpath(), "kafka.tools.StorageTool", "format", "-t", ident, "-c",
                        str(props)], check=True, capture_output=True)
        cluster.nodes.append(Node(i, ports[i - 1], node_base))
    log(f"kafka cluster: starting {len(ports)} nodes on {cluster.bootstrap} (logs under {base})")
    for node in cluster.nodes:
        node.start()
    cluster.wait_for({n.node_id for n in cluster.nodes})
    return cluster


# -- the stack's own cluster (`ROWRELAY_KAFKA_BROKERS=3 make stack`) -------------------------------------------


def brokers_wanted() -> int:
    """How many brokers the stack runs its data on: 1 (the default) is the single broker of stack/local.py."""
    return max(1, int(os.environ.get("ROWRELAY_KAFKA_BROKERS", "1") or 1))


def stack_ports(brokers: int) -> tuple[list[int], list[int]]:
    """The stack cluster's client and controller ports: node i on base + 2i and base + 2i + 1, away from the single
    broker's (ROWRELAY_KAFKA_CLUSTER_PORT, default 19192)."""
    base = int(os.environ.get("ROWRELAY_KAFKA_CLUSTER_PORT", 19192))
    return [base + 2 * i for i in range(brokers)], [base + 2 * i + 1 for i in range(brokers)]


def stack_cluster_up(base: Path, brokers: int) -> str:
    """The stack's cluster of `brokers` nodes under `base`, started (formatted the first time) or reused if all its
    nodes run and answer; returns its bootstrap servers. A node found dead is started again on its data."""
    ports, controllers = stack_ports(brokers)
    bootstrap = ",".join(f"127.0.0.1:{p}" for p in ports)
    nodes = [Node(i + 1, ports[i], base / f"node-{i + 1}") for i in range(brokers)]
    if not all((n.base / "data" / "meta.properties").exists() for n in nodes):
        stack_cluster_down(base)
        start_cluster(base, ports, controllers)
        return bootstrap
    for node in nodes:
        if pid_alive(read_pid(node.pidfile)):
            continue
        log(f"kafka cluster: starting node {node.node_id} again on 127.0.0.1:{node.port}")
        node.start()
    # Each node's own port first: the metadata lists a node killed a moment ago until its session times out.
    deadline = time.monotonic() + 180
    while not all(kafka_ready(p) for p in ports):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the stack's Kafka cluster on {bootstrap} does not answer; logs under {base}")
        time.sleep(0.5)
    KafkaCluster(nodes).wait_for({n.node_id for n in nodes})
    log(f"kafka cluster: {brokers} nodes up on {bootstrap}")
    return bootstrap


def stack_cluster_down(base: Path) -> None:
    for pidfile in sorted(base.glob("node-*/kafka.pid")):
        stop_pidfile(f"kafka cluster {pidfile.parent.name}", pidfile, timeout=60)
