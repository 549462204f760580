"""rowrelay on a replicated Kafka cluster: three KRaft nodes with a production cluster's settings (replication 3,
`min.insync.replicas=2`, the transaction log the same, no unclean election; stack/kafka_cluster.py), nodes
SIGKILLed, frozen and restarted while slices publish.

Each scenario: a run of a slice held inside its open transaction (a failpoint after its rows are produced), the
fault injected there, then the table relayed to its end. Then a `read_committed` reader that ran throughout must
have seen every row exactly once and in order, `verify` must agree, and no transaction may be left hanging: every
partition's last stable offset at its end, the table's transactional id neither Ongoing nor Prepare* for the
coordinators (Kafka's Admin API, tests/kafka_cluster_admin.py). Besides: a rolling restart under a `rowrelay
backfill`, and a commit left unanswered by a frozen coordinator (the fresh producer that fences the old one).

`make test-cluster` runs it (three broker JVMs on two cores, about fifteen minutes, run alone): not part of the CI
run, whose `make test` and `make test-faults` already take most of its time budget.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, IsolationLevel, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec
from sqlalchemy import text
from sqlalchemy.engine import URL, Engine

from assets.identity import channel_for
from orchestration.verify import verify_table
from resources.config import KafkaConfig, RelayConfig
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.slices import SliceRange
from stack.kafka_cluster import TRANSACTION_STATE_PARTITIONS, KafkaCluster, start_cluster
from tests.conftest import Services, unique
from tests.kafka_cluster_admin import TransactionState, assert_no_transaction_hanging, compiled
from tests.pipeline import Harness, relay_config
from tests.private_servers import free_ports

pytestmark = [pytest.mark.cluster, pytest.mark.integration]

ROWS = 30_000
SLICE_ROWS = 10_000
HOLD_S = 8  # a held run waits this long inside its open transaction, rows flushed, before it commits


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    ports = free_ports(6)
    found = start_cluster(tmp_path_factory.mktemp("kafka_cluster"), ports[:3], ports[3:])
    try:
        yield found
    finally:
        found.kill_all()


@dataclass
class Reader:
    """A read_committed consumer of the data topic for the whole scenario: every row it saw, in order."""
    bootstrap: str
    topic: str
    seen: list[tuple[int, int, int]] = field(default_factory=list)  # (partition, offset, id)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        import json

        # Assigned, not subscribed: a group's rebalance (its coordinator killed) would start it over from the
        # beginning and show the reader's own re-reads as duplicates.
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": unique("reader"),
                             "isolation.level": "read_committed", "enable.auto.commit": False, "log_level": 0})
        consumer.assign([TopicPartition(self.topic, 0, 0)])
        try:
            while not self.stop.is_set():
                msg = consumer.poll(0.5)
                if msg is not None and not msg.error():
                    self.seen.append((msg.partition(), msg.offset(), json.loads(msg.value())["id"]))
        finally:
            consumer.close()

    def close(self, expected: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.seen) < expected and time.monotonic() < deadline:
            time.sleep(0.5)
        self.stop.set()
        self.thread.join(30)

    def assert_exactly_once_in_order(self, rows: int) -> None:
        ids = [i for _, _, i in self.seen]
        assert len(ids) == len(set(ids)), f"{len(ids) - len(set(ids))} duplicates seen by the reader"
        assert set(ids) == set(range(1, rows + 1)), f"{rows - len(set(ids))} rows missing for the reader"
        assert ids == sorted(ids), "the reader saw rows out of watermark order"


def leader_of(cluster: KafkaCluster, topic: str, partition: int = 0) -> int:
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap, "log_level": 0})
    return admin.list_topics(topic, timeout=10).topics[topic].partitions[partition].leader


def java_string_hash(s: str) -> int:
    h = 0
    for ch in s.encode("utf-16-be").decode("utf-16-be"):
        h = (31 * h + ord(ch)) & 0xFFFFFFFF
    return h


def coordinator_of(cluster: KafkaCluster, transactional_id: str) -> int:
    """The node that coordinates `transactional_id`: the leader of its `__transaction_state` partition (Kafka's
    `Utils.abs(id.hashCode()) % partitions`)."""
    return leader_of(cluster, "__transaction_state",
                     (java_string_hash(transactional_id) & 0x7FFFFFFF) % TRANSACTION_STATE_PARTITIONS)


def end_offsets(bootstrap: str, tp: TopicPartition) -> tuple[int, int]:
    """(last stable offset, high watermark) of a partition, as the partition's leader reports them."""
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    key = TopicPartition(tp.topic, tp.partition)
    ends = []
    for level in (IsolationLevel.READ_COMMITTED, IsolationLevel.READ_UNCOMMITTED):
        result = admin.list_offsets({key: OffsetSpec.latest()}, isolation_level=level, request_timeout=10)
        ends.append(result[key].result().offset)
    return ends[0], ends[1]


def stable_everywhere(bootstrap: str, topics: list[str], timeout: float = 60.0) -> None:
    """Every partition's last stable offset equals its high watermark: no transaction is left open on them."""
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    deadline = time.monotonic() + timeout
    for topic in topics:
        for p in admin.list_topics(topic, timeout=10).topics[topic].partitions:
            while (ends := end_offsets(bootstrap, TopicPartition(topic, p)))[0] != ends[1]:
                assert time.monotonic() < deadline, f"{topic}[{p}]: last stable offset {ends[0]} < {ends[1]}"
                time.sleep(1)


def relayed_table(services: Services, pg_database: URL, pg_engine: Engine, cluster: KafkaCluster,
                  dagster_instance: Any, name: str, slice_rows: int = SLICE_ROWS, rows: int = ROWS,
                  producer: dict[str, Any] | None = None) -> Harness:
    """A table of `rows` rows relayed to the cluster in slices of `slice_rows`, its first slice already published
    (its topics exist and have leaders before any fault)."""
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} SELECT g, md5(g::text) FROM generate_series(1, {slice_rows}) g"))
    cfg: RelayConfig = relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "id", "slice_max_rows": slice_rows,
         "topic": f"cluster.{name}", "topic_partitions": 1}], spark_remote=True)
    kafka = KafkaConfig(bootstrap_servers=cluster.bootstrap, producer=producer or {})
    h = Harness(cfg.model_copy(update={"kafka": kafka}), dagster_instance)
    table = h.table()
    keys = h.cut(table)
    assert keys, "nothing cut"
    for key in keys:
        h.run(table, key)
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} SELECT g, md5(g::text) "
                          f"FROM generate_series({slice_rows + 1}, {rows}) g"))
    return h


def settled(cluster: KafkaCluster, h: Harness) -> list[TransactionState]:
    """No transaction of the table left hanging: its partitions' last stable offsets at their ends, and its
    transactional id neither Ongoing nor Prepare* for the coordinators (the Admin API). Returns its state."""
    channel = channel_for(h.table(), PREFIX)
    stable_everywhere(cluster.bootstrap, [channel.topic, channel.progress_topic])
    classes = compiled(cluster.nodes[0].base.parent / "admin-classes")
    return assert_no_transaction_hanging(classes, cluster.bootstrap, [channel.transactional_id])


@pytest.fixture
def scenario(services: Services, pg_database: URL, pg_engine: Engine, cluster: KafkaCluster, dagster_instance: Any,
             name: str) -> Iterator[tuple[Harness, Reader]]:
    h = relayed_table(services, pg_database, pg_engine, cluster, dagster_instance, name)
    reader = Reader(cluster.bootstrap, h.table().topic_name)
    yield h, reader
    reader.stop.set()


def held_run(h: Harness, key: str, failpoint: str = f"sleep:flushed:{HOLD_S}") -> tuple[subprocess.Popen, Path]:
    """A run of `key` that waits HOLD_S s inside its open transaction once its rows are flushed to the brokers
    (or as `failpoint` says)."""
    table = h.table()
    log = Path(h.instance.root_directory) / f"held-{unique('run')}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(h.cli_command(table, key), cwd=Path(__file__).resolve().parents[1], stdout=out,
                                stderr=subprocess.STDOUT,
                                env=h.cli_env({"ROWRELAY_FAILPOINT": failpoint}))
    return proc, log


def wait_until_produced(h: Harness, before: int, proc: subprocess.Popen) -> None:
    """Until the held run's rows are in the data topic, its transaction still open: the high watermark moved past
    `before` while the last stable offset (a read_committed reader's end) did not."""
    tp = TopicPartition(h.table().topic_name, 0)
    deadline = time.monotonic() + 180
    while (ends := end_offsets(h.config.kafka.bootstrap_servers, tp))[1] <= before:
        assert proc.poll() is None and time.monotonic() < deadline, "the held run never produced its rows"
        time.sleep(0.2)
    assert ends[0] <= before, f"the slice committed before the fault: {ends}"


def end_offset(h: Harness) -> int:
    return end_offsets(h.config.kafka.bootstrap_servers, TopicPartition(h.table().topic_name, 0))[1]


def fault_mid_publish(h: Harness, reader: Reader, cluster: KafkaCluster, victim: Callable[[], int],
                      inject: Callable[[int], None], heal: Callable[[int], None],
                      heal_after_s: float | None = None) -> None:
    """The held run's fault: `inject` into the node `victim` names while the run's transaction is open, then
    `heal` once the run has ended (or `heal_after_s` after the fault, for a run that can only wait)."""
    table = h.table()
    key = SliceRange(SLICE_ROWS, 2 * SLICE_ROWS).key
    h.instance.add_dynamic_partitions(f"{table.dagster_name}__slices", [key])
    proc, log = held_run(h, key)
    wait_until_produced(h, end_offset(h), proc)
    node = victim()
    inject(node)
    assert proc.poll() is None, "the held run ended before the fault"
    if heal_after_s is not None:
        time.sleep(heal_after_s)
        heal(node)
        proc.wait(600)
    else:
        proc.wait(600)
        heal(node)
    cluster.wait_for({n.node_id for n in cluster.nodes})
    h.drain(table, until_hi=ROWS, timeout=600)
    reader.close(ROWS)
    reader.assert_exactly_once_in_order(ROWS)
    report = verify_table(h.config, table)
    assert report.ok and report.messages == report.source_rows == ROWS, (report, log.read_text()[-3000:])
    settled(cluster, h)
    print(f"node {node} faulted mid-publish; the held run exited {proc.returncode}")


def sigkill_mid_publish(scenario: tuple[Harness, Reader], cluster: KafkaCluster,
                        victim: Callable[[Harness], int]) -> None:
    """The node `victim` names SIGKILLed while the held run's transaction is open, restarted once the run ended."""
    h, reader = scenario
    fault_mid_publish(h, reader, cluster, lambda: victim(h), lambda n: cluster.node(n).kill(),
                      lambda n: cluster.node(n).start())


def test_leader_of_the_data_partition_sigkilled_mid_publish(scenario: tuple[Harness, Reader],
                                                            cluster: KafkaCluster) -> None:
    sigkill_mid_publish(scenario, cluster, lambda h: leader_of(cluster, h.table().topic_name))


def test_leader_of_the_progress_partition_sigkilled_mid_publish(scenario: tuple[Harness, Reader],
                                                                cluster: KafkaCluster) -> None:
    sigkill_mid_publish(scenario, cluster,
                        lambda h: leader_of(cluster, channel_for(h.table(), PREFIX).progress_topic))


def test_transaction_coordinator_sigkilled_mid_publish(scenario: tuple[Harness, Reader],
                                                       cluster: KafkaCluster) -> None:
    sigkill_mid_publish(scenario, cluster,
                        lambda h: coordinator_of(cluster, channel_for(h.table(), PREFIX).transactional_id))


def test_a_node_frozen_past_the_request_timeouts_then_resumed(scenario: tuple[Harness, Reader],
                                                              cluster: KafkaCluster) -> None:
    h, reader = scenario

    def freeze(node: int) -> None:
        cluster.node(node).pause()
        time.sleep(45)  # past librdkafka's request and socket timeouts (30 s): the cluster moves on without it

    fault_mid_publish(h, reader, cluster, lambda: leader_of(cluster, h.table().topic_name), freeze,
                      lambda n: cluster.node(n).resume())


def test_two_of_three_nodes_down_the_relay_waits_and_resumes(scenario: tuple[Harness, Reader],
                                                             cluster: KafkaCluster) -> None:
    """With one node of three, min.insync.replicas=2 cannot be met and the controller quorum is lost: nothing can
    commit. The held run waits (or fails) for 30 s; nothing is lost or doubled when the nodes return."""
    h, reader = scenario

    def two_down(node: int) -> None:
        for other in [n.node_id for n in cluster.nodes if n.node_id != node][:2]:
            cluster.node(other).kill()

    def back(node: int) -> None:
        for n in cluster.nodes:
            if not n.alive:
                n.start()

    fault_mid_publish(h, reader, cluster, lambda: 1, two_down, back, heal_after_s=30)


def test_topics_a_single_broker_could_undo_are_named_with_their_fix(cluster: KafkaCluster, caplog: Any) -> None:
    """A progress topic someone created with one replica, and a data topic with three replicas but
    min.insync.replicas=1: each is named once, with the command that fixes it."""
    from confluent_kafka.admin import NewTopic

    from resources.exactly_once import TableChannel, ensure_topics

    name = unique("weak")
    channel = TableChannel.for_table(f"src.public.{name}", f"cluster.{name}", prefix=PREFIX)
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
    created = admin.create_topics([
        NewTopic(channel.topic, 1, 3, config={"min.insync.replicas": "1"}),
        NewTopic(channel.progress_topic, 1, 1, config={"cleanup.policy": "compact"})])
    for fut in created.values():
        fut.result(30)
    conf = {"bootstrap.servers": cluster.bootstrap}
    with caplog.at_level("WARNING"):
        ensure_topics(conf, channel)
    warned = [r.getMessage() for r in caplog.records if "replica" in r.getMessage()]
    progress = f"progress topic {channel.progress_topic} has one replica on a cluster of 3"
    assert any(progress in w for w in warned), warned
    assert any(f"data topic {channel.topic} has 3 replicas but min.insync.replicas=1" in w for w in warned), warned
    # Topics rowrelay creates itself take the cluster's defaults (3 replicas, 2 in sync): nothing to say.
    caplog.clear()
    sound = TableChannel.for_table(f"src.public.{name}_ok", f"cluster.{name}_ok", prefix=PREFIX)
    with caplog.at_level("WARNING"):
        ensure_topics(conf, sound)
        ensure_topics(conf, sound)  # now existing: checked
    assert not [r for r in caplog.records if "replica" in r.getMessage()]



# A million rows relay here sooner than three nodes restart one after another: twice that keeps every node's stop
# inside the backfill.
BACKFILL_ROWS = 2_000_000
BACKFILL_SLICE_ROWS = 50_000  # forty slices: the backfill commits many transactions across the restarts


def backfill(h: Harness) -> tuple[subprocess.Popen, Path]:
    """`rowrelay backfill` of the table, the console script in a process of its own, its output to a file."""
    log = Path(h.instance.root_directory) / f"backfill-{unique('run')}.log"
    command = [str(Path(sys.executable).with_name("rowrelay")), "--config", str(h.config_file()), "backfill",
               "--table", h.table().table_id]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=Path(__file__).resolve().parents[1], stdout=out,
                                stderr=subprocess.STDOUT, env=h.cli_env())
    return proc, log


def rolling_restart(cluster: KafkaCluster, during: subprocess.Popen) -> list[tuple[int, float, bool, bool]]:
    """Each node in turn stopped cleanly (SIGTERM), started again and waited for until it is back in the ISR of
    every partition it holds, before the next. Returns (node, seconds it took, `during` running when it stopped,
    and once it was back)."""
    restarts = []
    for node in cluster.nodes:
        clock, running = time.monotonic(), during.poll() is None
        node.stop()
        node.start()
        cluster.wait_in_isr(node.node_id)
        restarts.append((node.node_id, round(time.monotonic() - clock, 1), running, during.poll() is None))
        print(f"node {node.node_id} restarted and back in every ISR in {restarts[-1][1]} s")
    return restarts


def test_a_rolling_restart_during_a_backfill(services: Services, pg_database: URL, pg_engine: Engine,
                                             cluster: KafkaCluster, dagster_instance: Any, name: str) -> None:
    h = relayed_table(services, pg_database, pg_engine, cluster, dagster_instance, name,
                      slice_rows=BACKFILL_SLICE_ROWS, rows=BACKFILL_ROWS)
    reader = Reader(cluster.bootstrap, h.table().topic_name)
    try:
        first = end_offset(h)
        started = time.monotonic()
        proc, log = backfill(h)
        wait_until_publishing(h, first, proc, log)
        restarts = rolling_restart(cluster, proc)
        assert proc.wait(600) == 0, log.read_text()[-3000:]
        took = time.monotonic() - started
        print(f"backfill of {BACKFILL_ROWS} rows: {took:.0f} s; restarts (node, s, backfill running at its stop, "
              f"once back): {restarts}\n{log.read_text()[-300:]}")
        assert all(r[2] for r in restarts), f"the backfill ended before every node was stopped: {restarts}"
        reader.close(BACKFILL_ROWS)
        reader.assert_exactly_once_in_order(BACKFILL_ROWS)
        report = verify_table(h.config, h.table())
        assert report.ok and report.messages == report.source_rows == BACKFILL_ROWS, report
        settled(cluster, h)
    finally:
        reader.stop.set()


def wait_until_publishing(h: Harness, before: int, proc: subprocess.Popen, log: Path) -> None:
    """Until the backfill's first rows are in the data topic (its Dagster start and cut behind it)."""
    deadline = time.monotonic() + 180
    while end_offset(h) <= before:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


COMMIT_TIMEOUT_S = 120  # SlicePublisher's commit_timeout_s: how long commit_transaction waits for an answer
# librdkafka's request timeout past the commit's: an EndTxn sent into a frozen coordinator stays unanswered (not
# timed out and sent again to the next coordinator by librdkafka) until commit_transaction gives up on it.
SLOW_SOCKET = {"socket.timeout.ms": 300_000}
INITIALIZED = re.compile(r"Initialized transactionalId (\S+) with producerId (\d+) and producer epoch (\d+)")


def initializations(cluster: KafkaCluster, transactional_id: str) -> list[tuple[int, int, int]]:
    """(node, producer id, epoch) of each init_transactions of `transactional_id` the coordinators logged."""
    found = []
    for node in cluster.nodes:
        for m in INITIALIZED.finditer(node.log.read_text(errors="replace")):
            if m[1] == transactional_id:
                found.append((node.node_id, int(m[2]), int(m[3])))
    return found


@pytest.fixture
def slow_socket_scenario(services: Services, pg_database: URL, pg_engine: Engine, cluster: KafkaCluster,
                         dagster_instance: Any, name: str) -> Iterator[tuple[Harness, Reader]]:
    h = relayed_table(services, pg_database, pg_engine, cluster, dagster_instance, name, producer=SLOW_SOCKET)
    reader = Reader(cluster.bootstrap, h.table().topic_name)
    yield h, reader
    reader.stop.set()


def test_a_commit_unanswered_by_a_frozen_coordinator_ends_its_producer_and_fences_it(
        slow_socket_scenario: tuple[Harness, Reader], cluster: KafkaCluster) -> None:
    """KIP-890's path without KIP-890 (librdkafka lacks it): the coordinator of the table's transactional id frozen
    (SIGSTOP) while the run's commit is on its way to it, past the commit's timeout. The run must not send that
    commit again on the same producer (an EndTxn still in the frozen node's socket could land on a later
    transaction of it): it ends the producer and fences it with a fresh init_transactions at the coordinator the
    cluster elected meanwhile, which aborts the open transaction; the slice is then sent again, once."""
    h, reader = slow_socket_scenario
    table = h.table()
    key = SliceRange(SLICE_ROWS, 2 * SLICE_ROWS).key
    h.instance.add_dynamic_partitions(f"{table.dagster_name}__slices", [key])
    tid = channel_for(table, PREFIX).transactional_id
    before = len(initializations(cluster, tid))
    proc, log = held_run(h, key, f"sleep:before_commit:{HOLD_S}")
    wait_until_produced(h, end_offset(h), proc)
    time.sleep(2)  # the progress record delivered too; the run still asleep before its commit
    frozen = coordinator_of(cluster, tid)
    cluster.node(frozen).pause()
    time.sleep(HOLD_S + COMMIT_TIMEOUT_S + 10)  # the commit sent into the frozen node has timed out unanswered
    assert proc.poll() is None, "the held run ended while its coordinator was frozen"
    cluster.node(frozen).resume()
    assert proc.wait(600) == 0, log.read_text()[-3000:]
    output = log.read_text()
    inits = initializations(cluster, tid)[before:]
    print(f"coordinator {frozen} frozen; init_transactions of {tid} in the run: {inits}")
    assert "got no answer" in output and "did not land; sending it again" in output, output[-3000:]
    # The run's producer, then the fresh one that fenced it, at the coordinator elected in place of the frozen one.
    (_, pid, epoch), (node, fresh_pid, fresh_epoch) = inits[0], inits[-1]
    assert len(inits) >= 2 and node != frozen and fresh_pid == pid and fresh_epoch > epoch, inits
    cluster.wait_for({n.node_id for n in cluster.nodes})
    h.drain(table, until_hi=ROWS, timeout=600)
    reader.close(ROWS)
    reader.assert_exactly_once_in_order(ROWS)
    report = verify_table(h.config, table)
    assert report.ok and report.messages == report.source_rows == ROWS, report
    (state,) = settled(cluster, h)
    assert state.producer_epoch >= fresh_epoch and state.producer_id == pid, state
