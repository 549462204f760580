"""One table's transactions on its transactional producer: begin, produce, serve, commit and abort, and the rule for a
commit whose outcome is unknown. A commit that gets no answer is neither aborted nor called again on its producer
(librdkafka lacks KIP-890's epoch per transaction, so an EndTxn still on its way could land on a later transaction of
the same producer): `_CommitUnknown` ends that producer, and its owner fences it with a fresh one."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from resources.exactly_once.clients import _fatal_message, _is_fenced, _log, call_retrying, outcome_unknown
from resources.exactly_once.errors import (
    BadRowError,
    PublisherFenced,
    RelayError,
    _AbortAndRedo,
    _column_hint,
    _CommitUnknown,
    skip_advice,
)
from resources.exactly_once.records import TableChannel


class Transaction:
    """The transactional calls of one table's producer, for its publisher. `_txn_began` (monotonic; None: no
    transaction open) and `_txn_rows` describe the open transaction."""

    channel: TableChannel
    producer: Producer
    abort_timeout_s: float
    commit_timeout_s: float
    transaction_timeout_ms: int
    _txn_began: float | None
    _txn_rows: int

    def _begin(self) -> None:
        self._call(self.producer.begin_transaction)
        self._txn_began, self._txn_rows = time.monotonic(), 0

    def _transaction_failure(self) -> KafkaError | None:
        """The error that failed the open transaction, if one did, without waiting. librdkafka has no call that
        reads the transaction's state, but begin_transaction checks it locally and changes nothing when it
        refuses: inside a healthy transaction it refuses with _STATE; once the transaction has failed it
        returns that failure (txn_requires_abort, or fatal)."""
        try:
            self.producer.begin_transaction()
        except KafkaException as exc:
            err = exc.args[0]
            return err if err.txn_requires_abort() or err.fatal() or _is_fenced(err) else None
        raise RelayError(f"{self.channel.table}: a transaction was expected to be open")  # a bug of ours

    def _produce(self, topic: str, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]] | None,
                 callback: Callable[..., None] | None, watermark: int | None,
                 refused: list[KafkaError] | None = None, partition: int = -1) -> None:
        """Produce one message (partition -1: the partitioner's choice), waiting while the local queue is full. With
        `refused`, a produce refused because the transaction already failed (_STATE) is appended to it instead of
        raised: the caller finds out why."""
        while True:
            try:
                self.producer.produce(topic, value, key, partition, headers=headers, on_delivery=callback)
                return
            except BufferError:
                self.producer.poll(0.05)  # local queue full: let deliveries drain
            except KafkaException as exc:
                err = exc.args[0]
                if err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
                    column, hint = _column_hint(value)
                    # The watermark as a number (a time's microseconds, which skip_watermarks reads as that time):
                    # the run names the row as its table writes it (`BadRowError.naming`).
                    raise BadRowError(
                        f"{self.channel.table}: row with watermark {watermark} is too large for Kafka "
                        f"({len(value)} bytes{hint}); raise message.max.bytes or {skip_advice(str(watermark))} (see "
                        "docs/operations.md)", table=self.channel.table, watermark=watermark, column=column,
                        entry=str(watermark), value=value) from exc
                if refused is not None and err.code() == KafkaError._STATE:
                    refused.append(err)
                    return
                self._raise_for(err)

    def _serve(self, fn: Callable[[float], int], timeout: float) -> int:
        """producer.poll / producer.flush. A producer turned fatal (fenced, or its transaction aborted on timeout)
        raises from inside them; confluent-kafka 2.16 then also calls the next delivery callback with that
        exception pending, which surfaces as a SystemError caused by it, or, when the exception was lost on the
        way, by nothing ("returned NULL without setting an exception"): then the transaction's own state says what
        failed it. Each becomes our error for it."""
        try:
            return fn(timeout)
        except (KafkaException, SystemError) as exc:
            cause = exc if isinstance(exc, KafkaException) else exc.__cause__
            if isinstance(cause, KafkaException):
                self._raise_for(cause.args[0])
            failure = self._transaction_failure() if self._txn_began is not None else None
            if failure is None:
                raise
            self._raise_for(failure)
            raise  # _raise_for always raises

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return call_retrying(fn, *args)
        except KafkaException as exc:
            self._raise_for(exc.args[0])
            raise  # _raise_for always raises

    def _commit(self) -> None:
        """One commit_transaction call, never repeated nor followed by an abort on this producer when its outcome is
        unknown (_CommitUnknown): librdkafka lacks KIP-890's epoch per transaction, so an EndTxn still on its way
        could land on a later transaction of the same producer. `_fence_after_unknown_commit` ends it."""
        try:
            self.producer.commit_transaction(self.commit_timeout_s)
        except KafkaException as exc:
            err = exc.args[0]
            if outcome_unknown(err):
                raise _CommitUnknown(_fatal_message(err)) from exc
            self._raise_for(err)

    def _raise_for(self, err: KafkaError) -> None:
        if err.code() == KafkaError._FATAL and self._txn_began is not None:
            # A produce refused "Local: Fatal error" names no cause; the producer's own fatal error (a fence, most
            # often) is what failed the transaction: reported as that, so a fenced run stops as fenced.
            err = self._transaction_failure() or err
        if _is_fenced(err):
            raise PublisherFenced(
                f"{self.channel.table}: another publisher took over transactional id "
                f"{self.channel.transactional_id} ({err.str()}); this one stops without publishing")
        if err.txn_requires_abort():
            raise _AbortAndRedo(_fatal_message(err))
        if err.fatal():
            raise RelayError(f"{self.channel.table}: fatal Kafka error {_fatal_message(err)}")
        if err.retriable() or err.code() in (KafkaError._TIMED_OUT, KafkaError._TRANSPORT):
            raise _AbortAndRedo(_fatal_message(err))
        raise RelayError(f"{self.channel.table}: Kafka error {_fatal_message(err)}")

    def _abort(self) -> None:
        self._txn_began = None
        deadline = time.monotonic() + 60
        while True:
            try:
                self.producer.abort_transaction(max(1.0, deadline - time.monotonic()))
                return
            except KafkaException as exc:
                err = exc.args[0]
                if _is_fenced(err) or err.fatal():
                    raise PublisherFenced(f"{self.channel.table}: {_fatal_message(err)}") from exc
                # librdkafka: a retriable abort error (a timeout, the coordinator busy) is retried by calling it again.
                if err.retriable() and time.monotonic() < deadline:
                    time.sleep(0.5)
                    continue
                # Not in a transaction, or the broker is away: the transaction times out on its own.
                _log.warning("%s: aborting the transaction failed (%s); the broker aborts it after "
                             "transaction.timeout.ms (%d ms)", self.channel.table, err.str(),
                             self.transaction_timeout_ms)
                return

    def _abort_quietly(self) -> None:
        """Best effort and bounded: end the open transaction, if any; errors here must not hide the cause."""
        if self._txn_began is None:
            return
        self._txn_began = None
        # Fenced, fatal or broker away: the coordinator ends it (after transaction.timeout.ms at worst).
        with contextlib.suppress(KafkaException):
            self.producer.abort_transaction(self.abort_timeout_s)
