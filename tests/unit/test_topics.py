"""When a table's topics are called weak: one replica on a multi-broker cluster, or replicas without
min.insync.replicas to need them (resources/exactly_once/topics.py durability_warning)."""

from __future__ import annotations

from resources.exactly_once.topics import durability_warning


def test_one_replica_on_a_cluster_is_weak_and_on_one_broker_is_all_there_is() -> None:
    text = durability_warning("t", "_rowrelay.t", "progress", brokers=3, replicas=1, min_isr=1)
    assert text is not None and "one replica on a cluster of 3 brokers" in text and "table's place" in text
    assert "3 replicas" in text
    assert durability_warning("t", "_rowrelay.t", "progress", brokers=1, replicas=1, min_isr=1) is None


def test_replicas_need_two_in_sync() -> None:
    text = durability_warning("t", "orders", "data", brokers=3, replicas=3, min_isr=1)
    assert text is not None and "min.insync.replicas=1" in text and "--add-config min.insync.replicas=2" in text
    assert durability_warning("t", "orders", "data", brokers=3, replicas=3, min_isr=2) is None
    assert durability_warning("t", "orders", "data", brokers=3, replicas=3, min_isr=None) is None
