"""The stack's own replicated Kafka cluster (`ROWRELAY_KAFKA_BROKERS=3 make stack`): three nodes started with a
production cluster's settings, reused by the next `make stack`, a dead node started again on its data, all stopped
by `stack down`. In `make test-cluster` (three broker JVMs)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from stack.kafka_cluster import KafkaCluster, Node, brokers_wanted, stack_cluster_down, stack_cluster_up, stack_ports
from stack.local import pid_alive, port_open, read_pid
from tests.private_servers import free_ports

pytestmark = [pytest.mark.cluster, pytest.mark.integration]


def consecutive_free_base(count: int) -> int:
    """A port p with p .. p + count - 1 all free (the stack cluster's ports are consecutive)."""
    for candidate in free_ports(20):
        if all(not port_open(candidate + i) for i in range(count)) and candidate + count < 65535:
            return candidate
    raise AssertionError(f"no {count} consecutive free ports found")


def replicas_of(admin: AdminClient, topic: str, timeout: float = 60.0) -> int:
    """Replicas of the topic's partition 0, once its metadata has reached the node asked."""
    deadline = time.monotonic() + timeout
    while True:
        found = admin.list_topics(topic, timeout=30).topics[topic]
        if found.error is None and 0 in found.partitions:
            return len(found.partitions[0].replicas)
        assert time.monotonic() < deadline, f"{topic}: no metadata in {timeout:.0f} s: {found.error}"
        time.sleep(0.5)


def node_pids(base: Path) -> list[int | None]:
    return [read_pid(p) for p in sorted(base.glob("node-*/kafka.pid"))]


def test_the_stacks_cluster_starts_durable_is_reused_and_restarts_a_dead_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROWRELAY_KAFKA_BROKERS", "3")
    monkeypatch.setenv("ROWRELAY_KAFKA_CLUSTER_PORT", str(consecutive_free_base(6)))
    assert brokers_wanted() == 3
    ports, _ = stack_ports(3)
    try:
        bootstrap = stack_cluster_up(tmp_path, 3)
        assert bootstrap == ",".join(f"127.0.0.1:{p}" for p in ports)
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic("durable")])["durable"].result(60)
        assert replicas_of(admin, "durable") == 3
        config = admin.describe_configs([ConfigResource("topic", "durable")])
        (found,) = [f.result(30) for f in config.values()]
        assert found["min.insync.replicas"].value == "2", found["min.insync.replicas"]

        first = node_pids(tmp_path)
        assert len(first) == 3 and all(pid_alive(p) for p in first), first
        assert stack_cluster_up(tmp_path, 3) == bootstrap
        assert node_pids(tmp_path) == first  # reused, not restarted

        os.kill(first[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while pid_alive(first[1]):  # until it has exited: as a later `make stack` would find it
            assert time.monotonic() < deadline, f"node 2 (pid {first[1]}) still running 30 s after its SIGKILL"
            time.sleep(0.1)
        assert stack_cluster_up(tmp_path, 3) == bootstrap
        again = node_pids(tmp_path)
        assert again[0] == first[0] and again[2] == first[2] and again[1] != first[1] and pid_alive(again[1])
        nodes = [Node(i + 1, ports[i], tmp_path / f"node-{i + 1}") for i in range(3)]
        assert KafkaCluster(nodes).brokers_up() == {1, 2, 3}
    finally:
        stack_cluster_down(tmp_path)
    assert not any(pid_alive(p) for p in node_pids(tmp_path) + first)
