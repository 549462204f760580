"""Reading published slices back from the data topic by the offsets their progress records hold."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from resources.exactly_once.batches import SliceDigest, message_watermark, table_message_watermark
from resources.exactly_once.clients import READ_BATCH, _consumer
from resources.exactly_once.errors import KafkaUnavailable, SliceMessagesGone
from resources.exactly_once.progress_log import (
    _read_range,
    partition_watermarks,
    read_progress_history,
    records_in_range,
)
from resources.exactly_once.records import LivePiece, ProgressRecord, TableChannel, live_pieces
from resources.slices import SliceRange


def messages_gone(record: ProgressRecord, offset: int, partition: int | str, wm: int) -> SliceMessagesGone:
    return SliceMessagesGone(
        f"{record.table}: the table's message at offset {offset} of {record.topic} partition {partition} has "
        f"watermark {wm}, outside slice {record.slice}, whose progress record names that offset: the topic no longer "
        "holds the slice's messages (deleted and re-created, or its log truncated), so they cannot be read back by "
        "their offsets. Nothing was read for it. `rowrelay verify` compares the topic with the source; to send the "
        "rows again, see docs/operations.md (\"The data topic was deleted\")")


@contextlib.contextmanager
def slice_reader(kafka_conf: dict[str, Any]) -> Iterator[Consumer]:
    """One read_committed consumer for reading back many slices (`read_back_slices`)."""
    consumer = _consumer(kafka_conf)
    try:
        yield consumer
    finally:
        consumer.close()


def read_published_messages(kafka_conf: dict[str, Any], record: ProgressRecord, timeout: float = 30.0,
                            consumer: Consumer | None = None) -> Iterator[Any]:
    """The messages one committed slice published, read_committed, by its recorded offsets. Within those offsets a
    shared partition may also hold other tables' messages, and a replay into the table's own topic its copies:
    only the slice's own messages are yielded. `consumer`: one of `slice_reader`'s (kept open), else its own."""
    table = record.table.encode()
    own = consumer is None
    consumer = _consumer(kafka_conf) if consumer is None else consumer
    try:
        for partition, (first, last) in sorted(record.offsets.items(), key=lambda kv: int(kv[0])):
            tp = TopicPartition(record.topic, int(partition))
            for m in _read_range(consumer, tp, first, last + 1, timeout):
                mine, wm = table_message_watermark(m.headers(), table)
                if not mine:
                    continue
                if wm is not None and not record.lo < wm <= record.hi:
                    raise messages_gone(record, m.offset(), partition, wm)
                yield m
    finally:
        if own:
            consumer.close()


@dataclass(frozen=True)
class PublishedSlice:
    """A committed slice as its consumers see it: its own messages read back by its record's offsets."""

    rows: int
    # Of their values in watermark order (`slice_checksum`); None where that order cannot be told from the topic:
    # one watermark value in several partitions (a tie_break table on a multi-partition topic).
    checksum: str | None


def pieces_in_range(kafka_conf: dict[str, Any], channel: TableChannel, rng: SliceRange,
                    timeout: float = 30.0) -> list[LivePiece]:
    """The committed pieces that tile `rng`, in order; [] if nothing does. Whole slices (`records_in_range`), else,
    where a reset back landed inside a slice, the part of it the reset kept (`live_pieces`: the partition (lo, W]
    the reset left), found by reading the table's progress history, so such a key loads as published."""
    records = records_in_range(kafka_conf, channel, rng, timeout)
    if records:
        return [LivePiece(r, r.lo, r.hi) for r in records]
    tiles, at = [], rng.lo
    for piece in live_pieces(read_progress_history(kafka_conf, channel, timeout)):
        if piece.lo == at and piece.hi <= rng.hi:
            tiles.append(piece)
            at = piece.hi
    return tiles if tiles and at == rng.hi else []


def read_piece_messages(kafka_conf: dict[str, Any], piece: LivePiece, timeout: float = 30.0) -> Iterator[Any]:
    """A piece's messages: its slice's (`read_published_messages`), but those above the piece's end where a reset
    cut the slice (the slices cut after the reset sent those rows again)."""
    for msg in read_published_messages(kafka_conf, piece.record, timeout):
        if piece.hi < piece.record.hi and (wm := message_watermark(msg)) is not None and wm > piece.hi:
            continue
        yield msg


READ_BACK_GAP = 10_000  # offsets of other messages between two slices still read through rather than sought past


def read_back_slices(kafka_conf: dict[str, Any], records: list[ProgressRecord], timeout: float = 30.0
                     ) -> dict[str, PublishedSlice]:
    """Slices' messages read back by their records' offsets, counted and checksummed as `SliceDigest` did while
    publishing, by slice. A slice in one partition is read as a stream (it holds the slice in publish order); slices
    there whose offsets follow each other are read in one pass and split by their records' offsets: read one by one,
    each would wait for a fetch of its own, which holds a roll-up key's many slices in their parity check for long.
    Slices over several partitions are gathered one by one (`_gathered_read_back`)."""
    out: dict[str, PublishedSlice] = {}
    runs: dict[tuple[str, int], list[tuple[int, int, ProgressRecord]]] = {}
    with slice_reader(kafka_conf) as consumer:
        for r in records:
            if len(r.offsets) == 1:
                ((partition, (first, last)),) = r.offsets.items()
                runs.setdefault((r.topic, int(partition)), []).append((first, last, r))
            else:
                out[r.slice] = _gathered_read_back(kafka_conf, r, timeout, consumer)
        for (topic, partition), spans in runs.items():
            spans.sort(key=lambda span: span[0])
            if any(b[0] <= a[1] for a, b in zip(spans, spans[1:], strict=False)):  # overlapping: one at a time
                for span in spans:
                    out.update(_read_back_run(consumer, topic, partition, [span], timeout))
                continue
            start = 0
            while start < len(spans):
                end = start + 1
                while end < len(spans) and spans[end][0] <= spans[end - 1][1] + 1 + READ_BACK_GAP:
                    end += 1
                out.update(_read_back_run(consumer, topic, partition, spans[start:end], timeout))
                start = end
    return out


def _read_back_run(consumer: Consumer, topic: str, partition: int, spans: list[tuple[int, int, ProgressRecord]],
                   timeout: float) -> dict[str, PublishedSlice]:
    """Slices of one partition, in offset order, their offsets [first, last] apart: read from the first's first
    offset to the last's last, each message counted and digested for the slice whose offsets hold it."""
    digests = [SliceDigest() for _ in spans]
    rows = [0] * len(spans)
    chunks: list[list[bytes]] = [[] for _ in spans]
    tables = [r.table.encode() for _, _, r in spans]
    at = 0
    for m in _read_range(consumer, TopicPartition(topic, partition), spans[0][0], spans[-1][1] + 1, timeout):
        offset = m.offset()
        while at < len(spans) and spans[at][1] < offset:
            at += 1
        if at == len(spans) or offset < spans[at][0]:
            continue  # between two slices: no record names it
        record = spans[at][2]
        mine, wm = table_message_watermark(m.headers(), tables[at])
        if not mine:
            continue
        if wm is not None and not record.lo < wm <= record.hi:
            raise messages_gone(record, offset, partition, wm)
        chunks[at].append(m.value())
        if len(chunks[at]) >= READ_BATCH:
            digests[at].update(chunks[at])
            rows[at] += len(chunks[at])
            chunks[at] = []
    out = {}
    for i, (_, _, record) in enumerate(spans):
        digests[i].update(chunks[i])
        out[record.slice] = PublishedSlice(rows[i] + len(chunks[i]), digests[i].hexdigest())
    return out


def read_back_slice(kafka_conf: dict[str, Any], record: ProgressRecord, timeout: float = 30.0) -> PublishedSlice:
    """The slice's messages counted and checksummed as `SliceDigest` did while publishing (`read_back_slices`)."""
    return read_back_slices(kafka_conf, [record], timeout)[record.slice]


def _gathered_read_back(kafka_conf: dict[str, Any], record: ProgressRecord, timeout: float, consumer: Consumer
                        ) -> PublishedSlice:
    """A slice over several partitions (or none): its messages gathered and put in watermark order."""
    gathered: list[tuple[int, int, bytes]] = []  # (watermark, partition, value), each partition in publish order
    for msg in read_published_messages(kafka_conf, record, timeout, consumer=consumer):
        wm = message_watermark(msg)
        gathered.append((wm if wm is not None else -1, msg.partition(), msg.value()))
    gathered.sort(key=lambda g: g[0])  # stable: within one partition, publish order
    spread = any(a[0] == b[0] and a[1] != b[1] for a, b in zip(gathered, gathered[1:], strict=False))
    if spread:
        return PublishedSlice(len(gathered), None)
    digest = SliceDigest()
    digest.update([g[2] for g in gathered])
    return PublishedSlice(len(gathered), digest.hexdigest())


def table_messages_high_watermark(kafka_conf: dict[str, Any], channel: TableChannel, timeout: float = 30.0
                                  ) -> int | None:
    """The highest `rowrelay.watermark` header among the table's committed messages in its data topic (other
    tables may share the topic; `rowrelay replay` copies are not the table's publishing); None if it holds none.
    Reads headers only, each partition from its end backwards in growing windows (per partition the watermarks
    of a table's own messages only grow), up to the end at call time."""
    table = channel.table.encode()
    consumer = _consumer(kafka_conf)
    try:
        try:
            topic = consumer.list_topics(channel.topic, timeout=timeout).topics.get(channel.topic)
        except KafkaException as exc:
            raise KafkaUnavailable(f"cannot reach Kafka at {kafka_conf.get('bootstrap.servers')}: "
                                   f"{exc.args[0].str()}") from exc
        if topic is None or topic.error is not None:
            return None
        highest: int | None = None
        for partition in sorted(topic.partitions):
            tp = TopicPartition(channel.topic, partition)
            low, end = partition_watermarks(consumer, tp, timeout, kafka_conf)
            window = 64
            while end > low:
                start = max(low, end - window)
                found = [wm for own, wm in (table_message_watermark(m.headers(), table)
                                            for m in _read_range(consumer, tp, start, end, timeout))
                         if own and wm is not None]
                if found:
                    highest = max(found) if highest is None else max(highest, *found)
                    break
                end, window = start, window * 4
        return highest
    finally:
        consumer.close()
