"""The rows of one slice's transaction: produced in watermark order, their delivery reports and offsets, the slice's
checksum, and the error that names the row when the producer or the broker refuses one."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from resources.arrow_produce import RowProducer
from resources.exactly_once.batches import TABLE_HEADER, WATERMARK_HEADER, MessageBatch, OutgoingMessage, SliceDigest
from resources.exactly_once.clients import _fatal_message, _is_fenced
from resources.exactly_once.errors import (
    BadRowError,
    PublisherFenced,
    TopicSettingsError,
    _AbortAndRedo,
    _column_hint,
    skip_advice,
)
from resources.exactly_once.transaction import Transaction
from resources.slices import SliceRange, watermark_text

_RowTuples = Iterable[tuple[bytes | None, bytes, int, bytes]]


class SliceRows:
    """Produces one slice's batches into the open transaction of `txn` and keeps what its progress record needs."""

    def __init__(self, txn: Transaction, slice_range: SliceRange, *, every_row_reports: bool,
                 max_message_bytes: int) -> None:
        self.txn = txn
        self.slice_range = slice_range
        self.table = txn.channel.table
        self.topic = txn.channel.topic
        self.max_message_bytes = max_message_bytes
        self.offsets: dict[int, list[int]] = {}
        self.errors: list[tuple[KafkaError, int | None]] = []
        self.digest = SliceDigest()
        self.rows = self.nbytes = 0
        # (size, watermark, value): names the culprit if the broker refuses a message as too large.
        self.largest: tuple[int, int | None, bytes | None] = (0, None, None)
        self._produce_fn = txn.producer.produce
        # Per row only what is per row (each header costs about as much as the produce call itself): the table,
        # for topics that several tables share, and the row's watermark. Which slice a message belongs to is in
        # the progress record (its offsets); the slice's checksum is over the values themselves (SliceDigest).
        self.table_pair = (TABLE_HEADER, self.table.encode())
        # Set when librdkafka refuses to produce because the transaction already failed (_STATE): a message sent
        # earlier was refused (too large, say); the flush asks the producer why (_transaction_failure).
        self.refused: list[KafkaError] = []
        # Offsets per partition need a report per row (several partitions, or the redo naming a failed row).
        self.every_row_reports = every_row_reports
        # Otherwise the topic has one partition, named on every row: no partitioner hashing each key to find it,
        # and the offsets of a batch's first and last row span the rows between them even if partitions were
        # added to the topic since init.
        self.partition = -1 if every_row_reports else 0
        self.native = None if every_row_reports else RowProducer.attach(txn.producer, self.topic, self.table,
                                                                        self.partition)

    def close(self) -> None:
        if self.native is not None:
            self.native.close()

    def delivered(self, err: KafkaError | None, msg: Any) -> None:
        if err is not None:
            self.errors.append((err, None))
            return
        span = self.offsets.setdefault(msg.partition(), [msg.offset(), msg.offset()])
        span[0] = min(span[0], msg.offset())
        span[1] = max(span[1], msg.offset())

    def send(self, rows: _RowTuples, report: Callable[..., None] | None) -> None:
        if self.refused:
            return
        produce, topic, partition, table_pair = self._produce_fn, self.topic, self.partition, self.table_pair
        for key, value, wm, wm_text in rows:
            headers = [table_pair, (WATERMARK_HEADER, wm_text)]
            try:  # one C call per row, positional (keyword parsing costs much of the loop):
                # topic, value, key, partition (-1: the partitioner), callback, on_delivery (its alias),
                # timestamp, headers
                produce(topic, value, key, partition, report, None, 0, headers)
            except (BufferError, KafkaException):
                self.txn._produce(topic, key, value, headers, report, wm, self.refused, partition)
                if self.refused:
                    return

    def send_quietly(self, batch: MessageBatch, start: int, stop: int) -> None:
        """Rows [start, stop) without a delivery report: from C where it is attached (the hot path), each
        row librdkafka refuses through `send`, which waits out a full queue or says why."""
        native = self.native
        if native is None or not native.supports(batch.keys, batch.values, batch.watermark_texts):
            self.send(batch.rows(start, stop), None)
            return
        while start < stop and not self.refused:
            done, _ = native.produce(batch.keys, batch.values, batch.watermark_texts, start, stop)
            start += done
            if start < stop:
                self.send(batch.rows(start, start + 1), None)
                start += 1

    def produce_all(self, batches: Iterable[MessageBatch | Sequence[OutgoingMessage]],
                    phases: dict[str, float]) -> float:
        """Every batch, until a delivery fails or a produce is refused; the time the last batch came (monotonic)."""
        clock = time.monotonic()
        for batch in batches:
            now = time.monotonic()
            phases["read_s"] += now - clock
            clock = now
            if not isinstance(batch, MessageBatch):
                batch = MessageBatch.of(batch)
            n = len(batch)
            if not n:
                continue
            self.add(batch, n)
            self.txn._serve(self.txn.producer.poll, 0)  # delivery reports so far
            now = time.monotonic()
            phases["produce_s"] += now - clock
            clock = now
            if self.errors or self.refused:
                break
        return clock

    def add(self, batch: MessageBatch, n: int) -> None:
        sizes = self.check(batch)
        if self.every_row_reports or n <= 2:
            self.send(batch.rows(0, n), self.delivered)
        else:  # the first and the last row report their offsets, in order around the rest
            self.send(batch.rows(0, 1), self.delivered)
            self.send_quietly(batch, 1, n - 1)
            self.send(batch.rows(n - 1, n), self.delivered)
        self.digest.update_arrow(batch.values)
        self.rows += n
        self.txn._txn_rows = self.rows
        self.nbytes += int(sizes.sum())

    def check(self, batch: MessageBatch) -> Any:
        """The batch's message sizes, once its rows are known to be inside the slice and small enough to send."""
        slice_range, table = self.slice_range, self.table
        low, high = batch.watermark_bounds()
        if low <= slice_range.lo or high > slice_range.hi:
            wm = low if low <= slice_range.lo else high
            raise BadRowError(f"{table}: row with watermark {wm} is outside slice {slice_range}",
                              table=table, watermark=wm)
        sizes = batch.sizes()
        at = int(sizes.argmax())
        biggest = int(sizes[at])
        if biggest > self.largest[0]:
            self.largest = (biggest, batch.watermarks[at].as_py(), batch.values[at].as_py())
        if biggest > self.max_message_bytes:
            largest = self.largest
            column, hint = _column_hint(largest[2])
            named = watermark_text(int(largest[1] or 0), slice_range.timestamps)
            raise BadRowError(
                f"{table}: row with watermark {named} is {biggest} bytes as a message{hint}, over the "
                f"producer's message.max.bytes ({self.max_message_bytes}); raise message.max.bytes on the "
                f"producer and the topic (max.message.bytes), or {skip_advice(named)} (see docs/operations.md)",
                table=table, watermark=largest[1], column=column, entry=named, value=largest[2])
        return sizes

    def flush(self, timeout_s: float) -> KafkaError | None:
        """Wait for the delivery of every row (uncommitted), in short flushes: a failed delivery ends the wait at once
        instead of after the whole timeout. The transaction's failure, or a failed delivery's error; None: all
        delivered."""
        txn = self.txn
        deadline = time.monotonic() + timeout_s
        while True:
            left = 0 if self.refused else txn._serve(txn.producer.flush, 1.0)
            # A refused message without a delivery callback fails the transaction silently, and the messages
            # queued behind it then wait out message.timeout.ms: ask the producer instead of waiting.
            failure = txn._transaction_failure()
            if failure is not None or self.errors:
                return failure if failure is not None else self.errors[0][0]
            if self.refused:  # refused, yet the transaction has not failed: say what was refused
                txn._raise_for(self.refused[0])
            if not left:
                return None
            if time.monotonic() > deadline:
                raise _AbortAndRedo(f"messages not delivered within {timeout_s:.0f} s")

    def raise_delivery_failure(self, err: KafkaError) -> None:
        """The error for a slice whose rows did not all reach the broker. The transaction's own error names the
        cause; a delivery report may only say its message was purged."""
        table, slice_range = self.table, self.slice_range
        if err.code() == KafkaError.INVALID_RECORD:
            raise TopicSettingsError(
                f"{table}: the broker refused a message of slice {slice_range} as invalid ({err.str()}): a "
                f"compacted topic refuses messages without a key (is topic {self.topic} compacted while the table "
                "has `key: none`?), or a broker-side record check (a timestamp outside "
                "message.timestamp.*.max.ms) failed. Nothing of the slice is visible; fix the topic's settings "
                "or the table's `key:`")
        if err.code() in (KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE):
            size, wm, value = self.largest
            column, hint = _column_hint(value)
            named = watermark_text(int(wm or 0), slice_range.timestamps)
            raise BadRowError(
                f"{table}: the broker rejected a message as too large ({err.str()}); the largest row of slice "
                f"{slice_range} has watermark {named} ({size} bytes{hint}). Raise the topic's max.message.bytes "
                f"(and the producer's message.max.bytes) or {skip_advice(named)} (see docs/operations.md)",
                table=table, watermark=wm, column=column, entry=named, value=value)
        if _is_fenced(err) or err.fatal():
            raise PublisherFenced(f"{table}: {_fatal_message(err)}")
        raise _AbortAndRedo(_fatal_message(err))
