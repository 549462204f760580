"""Kafka's Admin API for transactions (KIP-664: ListTransactions, DescribeTransactions), for the cluster tests.

confluent-kafka (2.16) has no list_transactions / describe_transactions, and the stack's Kafka jars carry no
kafka-tools (no `kafka-transactions.sh`): a few lines of Java against kafka-clients' `Admin` ask the brokers,
compiled once per test session with the JDK that runs the brokers.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from stack.local import kafka_classpath

# A transaction in one of these states still holds its partitions' last stable offset back.
HANGING_STATES = ("Ongoing", "PrepareCommit", "PrepareAbort", "PrepareEpochFence")

JAVA_SOURCE = """\
import java.util.*;
import org.apache.kafka.clients.admin.*;

public class Transactions {
    public static void main(String[] args) throws Exception {
        Properties props = new Properties();
        props.put("bootstrap.servers", args[0]);
        props.put("request.timeout.ms", "15000");
        try (Admin admin = Admin.create(props)) {
            for (TransactionListing t : admin.listTransactions().all().get()) {
                System.out.println("listed " + t.transactionalId() + " " + t.state() + " " + t.producerId());
            }
            List<String> ids = Arrays.asList(args).subList(1, args.length);
            if (!ids.isEmpty()) {
                for (Map.Entry<String, TransactionDescription> e
                        : admin.describeTransactions(ids).all().get().entrySet()) {
                    TransactionDescription d = e.getValue();
                    System.out.println("described " + e.getKey() + " " + d.state() + " " + d.producerId() + " "
                                       + d.producerEpoch() + " " + d.coordinatorId());
                }
            }
        }
    }
}
"""


@dataclass(frozen=True)
class TransactionState:
    transactional_id: str
    state: str
    producer_id: int
    producer_epoch: int  # -1 where only listed (ListTransactions names no epoch)


def compiled(directory: Path) -> Path:
    """Transactions.class under `directory` (compiled there unless it already is)."""
    if not (directory / "Transactions.class").exists():
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "Transactions.java").write_text(JAVA_SOURCE)
        subprocess.run(["javac", "-cp", kafka_classpath(), "-d", str(directory), str(directory / "Transactions.java")],
                       check=True, capture_output=True, timeout=180)
    return directory


def transactions(classes: Path, bootstrap: str, described: list[str]) -> tuple[list[TransactionState],
                                                                             list[TransactionState]]:
    """(every transactional id the cluster's coordinators list, the `described` ones) with their states."""
    out = subprocess.run(["java", "-Xmx128m", "-cp", f"{classes}:{kafka_classpath()}", "Transactions", bootstrap,
                          *described], check=True, capture_output=True, text=True, timeout=120).stdout
    listed: list[TransactionState] = []
    found: list[TransactionState] = []
    for line in out.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "listed":  # a transactional id may hold spaces: its fields are read from the right
            ident, state, producer = rest.rsplit(" ", 2)
            listed.append(TransactionState(ident, state, int(producer), -1))
        elif kind == "described":
            ident, state, producer, epoch, _coordinator = rest.rsplit(" ", 4)
            found.append(TransactionState(ident, state, int(producer), int(epoch)))
    return listed, found


def assert_no_transaction_hanging(classes: Path, bootstrap: str, transactional_ids: list[str],
                                  timeout: float = 60.0) -> list[TransactionState]:
    """No transaction of `transactional_ids` is left Ongoing or Prepare* by the coordinators (asked by
    DescribeTransactions, and ListTransactions of the whole cluster), within `timeout` (a coordinator just elected
    finishes what its predecessor left in PrepareCommit). Returns their states."""
    deadline = time.monotonic() + timeout
    while True:
        listed, found = transactions(classes, bootstrap, transactional_ids)
        hanging = [t for t in [*listed, *found]
                   if t.transactional_id in transactional_ids and t.state in HANGING_STATES]
        if not hanging:
            assert {t.transactional_id for t in found} == set(transactional_ids), found
            return found
        assert time.monotonic() < deadline, f"transactions left hanging: {hanging}"
        time.sleep(2)
