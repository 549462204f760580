"""Reading a table's messages back from its topic for `rowrelay verify`: each message's watermark header, per
partition in offset order, and (for a `tie_break` table) what identifies rows sharing a watermark value."""

from __future__ import annotations

import json
import time
import uuid
from array import array
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from resources.exactly_once import (
    FAST_READS,
    REPLAY_HEADER,
    TABLE_HEADER,
    WATERMARK_HEADER,
    KafkaUnavailable,
    base_conf,
    partition_watermarks,
    topic_end_offsets,
)


@dataclass
class TopicWatermarks:
    """The watermark header of each committed message of one table in its topic, per partition in offset order;
    and how many messages were not the table's own: replay copies, other tables' or other producers'."""

    partitions: dict[int, list[int]] = field(default_factory=dict)
    offsets: dict[int, list[int]] = field(default_factory=dict)  # each of those messages' offset, alike
    # With `shared` asked for: each message's `tie_hash` where its watermark is shared (0 elsewhere), alike.
    tie_hashes: dict[int, array[int]] = field(default_factory=dict)
    # (partition, index in `partitions[p]`) -> the message's `tie_text` (None: it has no tie_break field), for
    # `collect`'s watermarks.
    ties: dict[tuple[int, int], str | None] = field(default_factory=dict)
    ends: dict[int, int] = field(default_factory=dict)  # the offset each partition was read up to
    replayed: int = 0
    other_messages: int = 0


ENVELOPE_FIELDS = {"op", "data", "source"}
NULL_TIE = "\x00NULL\x00"  # a NULL tie_break: no text a column holds is this
HASH_MASK = (1 << 64) - 1


def tie_text(value: Any) -> str | None:
    """A tie_break value as `rowrelay verify` compares it, the same from the source's driver and from the message's
    JSON: integers, text and UUIDs (a JSON string), NULL; None for another type (its JSON text is not Python's)."""
    if value is None:
        return NULL_TIE
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str):
        return value
    if isinstance(value, uuid.UUID):
        return str(value)
    return None


def tie_hash(text: str | None) -> int:
    """One row's part of its watermark value's fingerprint (the sum of its rows' parts, modulo 2**64): Python's
    hash of the tie text, the same for the source's rows and the messages within one verify."""
    return hash(text) & HASH_MASK


def message_tie(value: bytes | None, tie_break: str) -> str | None:
    """The `tie_text` of a message's tie_break field, None if it has none. An envelope is told by its shape (the
    table's `envelope:` may have changed since the message was sent): its three fields, its row under `data`."""
    try:
        doc = json.loads(value or b"")
    except ValueError:
        return None
    if isinstance(doc, dict) and doc.keys() == ENVELOPE_FIELDS and isinstance(doc["data"], dict):
        doc = doc["data"]
    if not isinstance(doc, dict) or tie_break not in doc:
        return None
    return tie_text(doc[tie_break])


class TopicHeldOpen(KafkaUnavailable):
    """Another producer's transaction is open in the topic below the table's committed messages: read_committed,
    no consumer sees past it until it ends (Kafka aborts it at its transaction timeout at the latest)."""


def held_open_text(tp: TopicPartition, stable: int, needed: int) -> str:
    return (f"{tp.topic}[{tp.partition}] is readable (read_committed) only up to offset {stable}, below the "
            f"committed messages it must show (to offset {needed - 1}): a transaction of another producer is open "
            "there (a table sharing the topic, a `rowrelay replay` into it), and until it ends no consumer of the "
            "topic sees what was committed after it began. Nothing can be told missing yet: try again once it ends "
            "(Kafka aborts it at its transaction.timeout.ms at the latest)")


def topic_watermarks(conf: dict[str, Any], topic: str, table: str, timeout: float = 60.0,
                     tie_break: str | None = None, shared: Container[int] = (), collect: Container[int] = (),
                     ends: dict[int, int] | None = None, committed_ends: dict[int, int] | None = None
                     ) -> TopicWatermarks:
    """Read the topic to its end (or each partition up to `ends`: what an earlier read saw): the table's own
    messages' watermarks (`TopicWatermarks`); with a `tie_break`, the `tie_hash` of the messages whose watermark is
    in `shared` and the `tie_text` of those in `collect` (their JSON parsed only for that). `committed_ends`: per
    partition, the offset the table's committed slices reach (exclusive); an end read below it is another
    producer's open transaction, waited for up to `timeout`, then `TopicHeldOpen` (not missing rows)."""
    consumer = Consumer({**base_conf(conf), "group.id": f"rowrelay-verify-{uuid.uuid4().hex}",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "auto.offset.reset": "earliest", **FAST_READS})
    out = TopicWatermarks()
    own = table.encode()
    hashing = tie_break is not None and bool(shared)
    try:
        md = consumer.list_topics(topic, timeout=timeout)
        meta = md.topics.get(topic)
        if meta is None or meta.error is not None:
            return out
        log_ends: dict[str, int] | None = None  # uncommitted messages included, asked once if needed
        for p in sorted(meta.partitions):
            tp = TopicPartition(topic, p)
            low, high = partition_watermarks(consumer, tp, timeout, conf)  # a new topic's leader may still move
            needed, waited = (committed_ends or {}).get(p, 0), time.monotonic() + timeout
            if high < needed and ends is None:
                log_ends = topic_end_offsets(conf, topic, timeout) if log_ends is None else log_ends
                # Only where the log holds those offsets (not a topic re-created or truncated since: then they are
                # gone, and the comparison says which rows are missing).
                while high < needed <= log_ends.get(str(p), 0):
                    if time.monotonic() > waited:
                        raise TopicHeldOpen(held_open_text(tp, high, needed))
                    time.sleep(0.5)
                    low, high = partition_watermarks(consumer, tp, timeout, conf)
            if ends is not None:
                high = min(high, ends.get(p, low))
            out.ends[p] = high
            wms, offsets = out.partitions.setdefault(p, []), out.offsets.setdefault(p, [])
            hashes = out.tie_hashes.setdefault(p, array("Q")) if hashing else None
            if high <= low:
                continue
            consumer.assign([TopicPartition(topic, p, low)])
            deadline = time.monotonic() + timeout
            while consumer.position([tp])[0].offset < high:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{topic}[{p}] could not be read to offset {high} (open transaction?)")
                msg = consumer.poll(0.5)
                if msg is None or msg.error():
                    continue
                if msg.offset() >= high:  # written since the end was taken (past a commit marker)
                    break
                deadline = time.monotonic() + timeout
                headers = dict(msg.headers() or [])
                if headers.get(TABLE_HEADER) != own or WATERMARK_HEADER not in headers:
                    out.other_messages += 1
                elif REPLAY_HEADER in headers:
                    out.replayed += 1
                else:
                    wm = int(headers[WATERMARK_HEADER])
                    wms.append(wm)
                    offsets.append(msg.offset())
                    if tie_break is None:
                        continue
                    text = message_tie(msg.value(), tie_break) if wm in shared or wm in collect else None
                    if hashes is not None:
                        hashes.append(tie_hash(text) if wm in shared else 0)
                    if wm in collect:
                        out.ties[(p, len(wms) - 1)] = text
    finally:
        consumer.close()
    return out

