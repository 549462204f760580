"""Publishing a table's slices exactly once through one transactional producer."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from resources.exactly_once.batches import MessageBatch, OutgoingMessage
from resources.exactly_once.clients import (
    StageHook,
    _fatal_message,
    _log,
    broker_max_transaction_timeout_ms,
    env_failpoint,
    transaction_timeout_ms,
    unreachable,
    with_error_cb,
)
from resources.exactly_once.errors import (
    BadRowError,
    KafkaAuthenticationError,
    KafkaUnavailable,
    ProducerSettingsError,
    ProgressMissing,
    PublisherFenced,
    RelayError,
    SliceOutOfOrder,
    SliceRowsMismatch,
    TransactionTimedOut,
    _AbortAndRedo,
    _CommitUnknown,
)
from resources.exactly_once.preflight import KafkaReads, Purpose, preflight
from resources.exactly_once.progress_log import find_slice_progress, read_committed_progress
from resources.exactly_once.records import (
    BASELINE_PREFIX,
    RESET_PREFIX,
    ProgressRecord,
    PublishResult,
    ResetOutcome,
    TableChannel,
    watermark_fields,
)
from resources.exactly_once.slice_rows import SliceRows
from resources.exactly_once.topics import ensure_topics, topic_end_offsets
from resources.exactly_once.transaction import Transaction
from resources.slices import RowSkip, SliceRange


class SlicePublisher(Transaction):
    """Publishes one table's slices through one transactional producer (one epoch)."""

    def __init__(self, channel: TableChannel, kafka_conf: dict[str, Any], *,
                 on_stage: StageHook | None = None, max_attempts: int = 3, init_timeout_s: float = 60.0,
                 flush_timeout_s: float = 300.0, abort_timeout_s: float = 10.0,
                 recorded: SliceRange | None = None, commit_timeout_s: float = 120.0) -> None:
        self.channel = channel
        # The newest slice the orchestrator recorded as committed, where Kafka's progress looked empty to it (None:
        # nothing recorded, or progress was there): see `_refuse_unpublishable`.
        self.recorded = recorded
        self.flush_timeout_s = flush_timeout_s
        self.kafka_conf = kafka_conf
        self.on_stage = on_stage or env_failpoint
        self.max_attempts = max_attempts
        self.init_timeout_s = init_timeout_s
        self.abort_timeout_s = abort_timeout_s
        self.commit_timeout_s = commit_timeout_s
        # The user's transaction.timeout.ms (kafka.producer) wins; a slice must commit within it.
        self.transaction_timeout_ms = transaction_timeout_ms(kafka_conf)
        producer_conf = {
            # librdkafka's own retries handle transient broker errors inside a transaction.
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 50,
            "compression.type": "lz4",
            "queue.buffering.max.messages": 500_000,
            "queue.buffering.max.kbytes": 1_048_576,
            "batch.size": 1_000_000,
            **kafka_conf,
            "transactional.id": channel.transactional_id,
            "transaction.timeout.ms": self.transaction_timeout_ms,
        }
        self.max_message_bytes = int(producer_conf.get("message.max.bytes", 1_000_000))
        self._producer_conf = producer_conf
        try:
            self.producer = Producer(with_error_cb(producer_conf))
        except KafkaException as exc:  # e.g. message.timeout.ms over transaction.timeout.ms
            raise ProducerSettingsError(f"kafka.producer: {exc.args[0].str().strip()}") from exc
        self._initialized = False
        self._own_progress: ProgressRecord | None = None
        self._topic_checked = False  # the data topic was checked for this table's messages (empty progress)
        self._topic_checked_back = False  # a topic change was checked for a deployment sharing the progress
        self._data_partitions = channel.topic_partitions
        # A delivery report per row costs a Python Message and a callback per row (much of the produce loop).
        # With one data partition the first and last row of each batch give the slice's offsets, and a failed row
        # still fails the commit (librdkafka: any permanent delivery failure makes the transaction abortable).
        # After such an abort the slice is redone with a report per row, which names the row that failed.
        self._report_every_row = False
        self.last_phases: dict[str, float] = {}  # seconds per phase of the last transaction (see _transaction)
        # The open transaction: when it began (monotonic; None: none open) and rows produced into it so far.
        self._txn_began: float | None = None
        self._txn_rows = 0

    # -- protocol steps ---------------------------------------------------------------------------

    def init(self) -> None:
        # First: an unreachable broker fails here, clearly.
        ready = ensure_topics(self.kafka_conf, self.channel)
        self._data_partitions = ready.partitions
        self._fit_batches_to(ready.max_message_bytes)
        broker_max = broker_max_transaction_timeout_ms(self.kafka_conf)
        if broker_max is not None and self.transaction_timeout_ms > broker_max:
            raise ProducerSettingsError(self._timeout_over_max(broker_max))
        try:
            self.producer.init_transactions(self.init_timeout_s)
        except KafkaException as exc:
            err = exc.args[0]
            if err.code() == KafkaError.INVALID_TRANSACTION_TIMEOUT:  # the broker's maximum was not readable
                raise ProducerSettingsError(self._timeout_over_max(broker_max)) from exc
            if err.retriable() or err.code() in (KafkaError._TIMED_OUT, KafkaError._TRANSPORT):
                failure = unreachable(self.producer, self.kafka_conf, err.str())
                if isinstance(failure, KafkaAuthenticationError):
                    raise failure from exc
                raise KafkaUnavailable(f"init_transactions for {self.channel.transactional_id}: {err.str()}") from exc
            raise RelayError(f"init_transactions for {self.channel.transactional_id}: {_fatal_message(err)}") from exc
        self._initialized = True
        self.on_stage("initialized")

    def _fit_batches_to(self, topic_max_bytes: int | None) -> None:
        """Batches no larger than the data topic accepts. The broker refuses a whole batch over the topic's
        max.message.bytes, and librdkafka, unlike Kafka's Java producer, does not split it: every slice then failed,
        blaming its largest row however small. Before init_transactions the producer has done nothing: it is made
        again with a batch.size the topic takes (lz4's worst-case growth left aside)."""
        batch = int(self._producer_conf.get("batch.size", 1_000_000))
        if topic_max_bytes is None or batch <= topic_max_bytes:
            return
        fitted = max(1, (topic_max_bytes - 128) * 255 // 256)
        _log.info("%s: batch.size %d is over topic %s's max.message.bytes %d: %d used", self.channel.table, batch,
                  self.channel.topic, topic_max_bytes, fitted)
        self._producer_conf = {**self._producer_conf, "batch.size": fitted}
        self.producer = Producer(with_error_cb(self._producer_conf))

    def _timeout_over_max(self, broker_max: int | None) -> str:
        limit = f"the brokers' transaction.max.timeout.ms ({broker_max} ms)" if broker_max is not None else \
            "the brokers' transaction.max.timeout.ms"
        return (f"{self.channel.table}: the producer's transaction.timeout.ms ({self.transaction_timeout_ms} ms) "
                f"is over {limit}: lower transaction.timeout.ms in kafka.producer to at most that (or raise "
                "transaction.max.timeout.ms on the brokers)")

    def committed_progress(self) -> ProgressRecord | None:
        return read_committed_progress(self.kafka_conf, self.channel)

    def _progress_after_fence(self) -> ProgressRecord | None:
        """The table's committed progress once this publisher has fenced every other (init): final, since no other
        can commit any more. After its own commit it knows it without reading: a newer one would fence it first."""
        if not self._initialized:
            self.init()
        return self._own_progress if self._own_progress is not None else self.committed_progress()

    def publish(self, slice_range: SliceRange,
                batches: Callable[[], Iterable[MessageBatch | Sequence[OutgoingMessage]]], *,
                columns: list[list[str]] | None = None, schema_fingerprint: str = "",
                expected_rows: int | None = None, where: str | None = None,
                skipped: Sequence[RowSkip] | None = None, skipped_rows: int | None = None,
                watermark: tuple[str, str] | None = None) -> PublishResult:
        """Publish the slice's rows exactly once; `batches` re-reads the rows if a retry needs them. `columns` and
        `schema_fingerprint` (the columns the rows were read with) go into the slice's progress record.
        `expected_rows`: the rows the source counts in the slice; a read that yields another number is aborted
        (SliceRowsMismatch) instead of committed. `where` and `skipped`: the row filter the rows were chosen by
        (`where:`, "" for none, and the skip_watermarks entries in the slice, which left out `skipped_rows`), kept in
        the progress record. `watermark`:
        the table's watermark column and kind as read now, kept in the record; progress measured in another one is
        refused (WatermarkChanged)."""
        started = time.monotonic()
        committed = self._progress_after_fence()
        self.on_stage("progress_read")
        self._refuse_unpublishable(committed, slice_range.timestamps, slice_range, watermark)
        committed_hi = committed.hi if committed else self.channel.start_after
        if committed_hi >= slice_range.hi:
            return PublishResult(self._committed_record(slice_range, committed), already_committed=True,
                                 duration_s=time.monotonic() - started)
        if committed_hi != slice_range.lo:
            raise SliceOutOfOrder.at(self.channel.table, slice_range, committed_hi)
        attempt = 0
        while True:
            attempt += 1
            try:
                record = self._transaction(slice_range, batches(), columns or [], schema_fingerprint,
                                           expected_rows, where, skipped, skipped_rows, watermark)
                self._own_progress = record
                return PublishResult(record, already_committed=False, duration_s=time.monotonic() - started,
                                     attempts=attempt, phases=dict(self.last_phases))
            except _CommitUnknown as exc:
                # Kafka, read once a fresh producer has settled the transaction, tells whether the slice committed:
                # redone blindly, it would be in the topic twice if the first commit had landed.
                committed = self._fence_after_unknown_commit()
                if committed is not None and committed.slice == slice_range.key:
                    self._own_progress = committed
                    return PublishResult(committed, already_committed=False, duration_s=time.monotonic() - started,
                                         attempts=attempt, phases=dict(self.last_phases))
                if (committed.hi if committed else self.channel.start_after) != slice_range.lo:
                    # Another publisher moved progress meanwhile: the checks a publish starts with say what stands.
                    return self.publish(slice_range, batches, columns=columns, schema_fingerprint=schema_fingerprint,
                                        expected_rows=expected_rows, where=where, skipped=skipped,
                                        skipped_rows=skipped_rows, watermark=watermark)
                if attempt >= self.max_attempts:
                    raise KafkaUnavailable(f"{self.channel.table}: slice {slice_range}: the commit failed {attempt} "
                                           f"times without an answer (last: {exc}); nothing of it committed") from exc
                _log.warning("%s: the commit of slice %s got no answer (%s) and did not land; sending it again",
                             self.channel.table, slice_range, exc)
            except _AbortAndRedo as exc:
                self._raise_if_timed_out(slice_range, exc)
                self._abort()
                self._report_every_row = True  # the redo names a row that fails delivery
                if attempt >= self.max_attempts:
                    raise KafkaUnavailable(
                        f"{self.channel.table}: slice {slice_range} aborted {attempt} times: {exc}") from exc
                time.sleep(min(2.0 * attempt, 10.0))
            except BadRowError:
                self._abort()
                raise
            except SliceRowsMismatch:  # its own diagnosis, even late in a long transaction (not "timed out")
                self._abort_quietly()
                raise
            except RelayError as exc:  # fenced, fatal: a coordinator abort on timeout also looks like these
                self._raise_if_timed_out(slice_range, exc)
                self._abort_quietly()
                raise
            except BaseException:
                # Anything else (a Spark error in `batches`, the order check, an interrupt, SystemExit): end the
                # transaction now instead of holding every read_committed reader for transaction.timeout.ms.
                self._abort_quietly()
                raise

    def _refuse_unpublishable(self, committed: ProgressRecord | None, timestamps: bool,
                              slice_range: SliceRange | None = None, watermark: tuple[str, str] | None = None) -> None:
        """The refusals a publish (of `slice_range`; None: a progress record alone) starts with (`preflight`), on the
        progress read once this publisher fenced every other. Kafka is asked once per publisher: whether an empty
        progress's rows were published all the same, and whether a topic change took the progress back."""
        checked = self._topic_checked if committed is None else self._topic_checked_back
        refusal = preflight(Purpose.PUBLISH, committed, self.channel, watermark=watermark, timestamps=timestamps,
                            recorded=self.recorded, kafka=None if checked else KafkaReads.of(self.kafka_conf),
                            publishing=slice_range)
        if committed is None:
            self._topic_checked = checked or not isinstance(refusal, ProgressMissing | PublisherFenced)
        elif refusal is None and committed.topic and committed.topic != self.channel.topic:
            self._topic_checked_back = True
        if refusal is not None:
            raise refusal

    def _committed_record(self, slice_range: SliceRange, committed: ProgressRecord | None) -> ProgressRecord:
        """The progress record of a slice that progress already covers."""
        # A baseline or reset record (lo == hi) is not this slice's record.
        record = committed if committed and (committed.lo, committed.hi) == (slice_range.lo, slice_range.hi) \
            else find_slice_progress(self.kafka_conf, self.channel, slice_range)
        if record is None:  # covered by progress but not a slice of its own (e.g. start_after)
            record = ProgressRecord(self.channel.table, slice_range.key, slice_range.lo, slice_range.hi, 0, 0,
                                    "", self.channel.topic)
        return record

    def publish_baseline(self, hi: int, watermark: tuple[str, str] | None = None) -> ProgressRecord:
        """The table's first progress, "committed up to `hi`" (start_after: latest), recorded only if the progress
        is still empty once this publisher has fenced every other: another cutter (the sensor, a CLI backfill)
        may have recorded its own baseline or committed slices since it was read. Then that progress stands and is
        returned, and nothing is written: a baseline over it would skip rows (a higher one) or send them again (a
        lower one)."""
        ch = self.channel
        record = ProgressRecord(ch.table, f"{BASELINE_PREFIX}{hi}", hi, hi, 0, 0, "", ch.topic,
                                transactional_id=ch.transactional_id, **watermark_fields(watermark))
        return self.publish_progress_only(record, only_if_empty=True)

    def publish_progress_only(self, record: ProgressRecord, *, reset: bool = False,
                              only_if_empty: bool = False) -> ProgressRecord:
        """Commit a progress record with no rows; returns the table's progress after it. With empty progress
        while the data topic holds the table's messages this refuses (ProgressMissing) unless `reset`: a
        deliberate new baseline. `only_if_empty`: with progress already committed, commit nothing and return it."""
        if not self._initialized:
            self.init()
        if not reset:
            standing = self._progress_after_fence()
            if standing is None:
                self._refuse_unpublishable(None, record.watermark_kind in ("timestamp", "timestamptz"))
            elif only_if_empty:
                return standing
        try:
            self._call(self.producer.begin_transaction)
            self._txn_began, self._txn_rows = time.monotonic(), 0
            self._produce(self.channel.progress_topic, record.slice.encode(), record.to_json(), None, None, None,
                          partition=0)  # read at partition 0 whatever partitions the topic has
            self._commit()
            self._txn_began = None
        except _CommitUnknown as exc:
            standing = self._fence_after_unknown_commit()
            if standing is None or (standing.slice, standing.committed_at) != (record.slice, record.committed_at):
                raise RelayError(f"{self.channel.table}: progress record {record.slice} not committed ({exc}); "
                                 "progress is unchanged, try again") from exc
        except _AbortAndRedo as exc:
            # Not committed. The abort says why when a newer publisher fenced this one meanwhile (a commit racing
            # the fence can fail "Unknown broker error" first); else the caller is told in a RelayError, as for
            # any failed commit, never in this module's private redo signal.
            self._abort()
            raise RelayError(f"{self.channel.table}: progress record {record.slice} not committed ({exc}); "
                             "progress is unchanged, try again") from exc
        except BaseException:
            self._abort_quietly()
            raise
        self._own_progress = record
        return record

    def publish_reset(self, after: int, reason: str, watermark: tuple[str, str] | None = None) -> ResetOutcome:
        """A deliberate new baseline: the table's progress says "committed up to `after`". One transaction with
        only a progress record; taking the table's transactional id, it fences any running publisher of it.
        Returns the record and the progress it replaced, read after the fence: no slice can commit between them.
        `watermark`: the column and kind `after` is a value of (None: the source could not be asked)."""
        if not reason.strip():
            raise RelayError(f"{self.channel.table}: a reset needs a reason (it is kept in the progress record)")
        ch = self.channel
        replaced = self._progress_after_fence()
        # The columns last published carry over: the next slice is checked against them (`on_schema_change`). A
        # reset without them would let a re-created table's new columns through unchecked.
        record = ProgressRecord(table=ch.table, slice=f"{RESET_PREFIX}{after}", lo=after, hi=after, rows=0, bytes=0,
                                checksum="", topic=ch.topic, transactional_id=ch.transactional_id,
                                committed_at=datetime.now(UTC).isoformat(), reset_reason=reason,
                                topic_ends=topic_end_offsets(self.kafka_conf, ch.topic),
                                columns=replaced.columns if replaced else [],
                                schema_fingerprint=replaced.schema_fingerprint if replaced else "",
                                **watermark_fields(watermark))
        self.publish_progress_only(record, reset=True)
        return ResetOutcome(record, replaced)

    def accept_schema(self, columns: list[list[str]], schema_fingerprint: str, reason: str) -> ProgressRecord:
        """Record that a human accepted the table's current columns: the committed progress record again (same
        range, rows and checksum), with the new columns and the reason. Progress does not move."""
        if not reason.strip():
            raise RelayError(f"{self.channel.table}: accepting a schema change needs a reason (kept in progress)")
        committed = self._progress_after_fence()
        if committed is None:
            raise RelayError(f"{self.channel.table}: nothing committed yet: there is no schema to accept a change to")
        record = replace(committed, columns=columns, schema_fingerprint=schema_fingerprint,
                         committed_at=datetime.now(UTC).isoformat(), reset_reason=f"schema accepted: {reason}")
        self.publish_progress_only(record)
        return record

    def close(self) -> None:
        """Best effort: a committed or aborted transaction leaves nothing queued. A fenced (fatal) producer raises
        from flush, and close runs where a publish failed: that error, not this one, must reach the caller."""
        with contextlib.suppress(KafkaException, SystemError):  # SystemError: see `_serve`
            self.producer.flush(5)

    # -- internals ----------------------------------------------------------------------------------

    def _raise_if_timed_out(self, slice_range: SliceRange, exc: BaseException) -> None:
        """A fenced/epoch/abort error of a transaction open about as long as transaction.timeout.ms is the
        coordinator aborting it on timeout, not another publisher: say so, and what to change."""
        if self._txn_began is None:
            return
        elapsed = time.monotonic() - self._txn_began
        timeout_s = self.transaction_timeout_ms / 1000
        if elapsed < 0.9 * timeout_s:  # 0.9: the coordinator's clock started a little after ours
            return
        self._abort_quietly()
        raise TransactionTimedOut(
            f"{self.channel.table}: the transaction of slice {slice_range} was open {elapsed:.1f} s "
            f"({self._txn_rows} rows produced so far), longer than transaction.timeout.ms "
            f"({self.transaction_timeout_ms} ms), so Kafka aborted it; nothing of the slice is visible. Make "
            "slices smaller (lower slice_max_rows) or raise transaction.timeout.ms in kafka.producer, up to the "
            "brokers' transaction.max.timeout.ms") from exc

    def _transaction(self, slice_range: SliceRange, batches: Iterable[MessageBatch | Sequence[OutgoingMessage]],
                     columns: list[list[str]], schema_fingerprint: str,
                     expected_rows: int | None = None, where: str | None = None,
                     skipped: Sequence[RowSkip] | None = None, skipped_rows: int | None = None,
                     watermark: tuple[str, str] | None = None) -> ProgressRecord:
        """One transaction: the slice's rows, flushed, then its progress record (with the offsets the rows got),
        then the commit."""
        sent = SliceRows(self, slice_range, every_row_reports=self._report_every_row or self._data_partitions != 1,
                         max_message_bytes=self.max_message_bytes)
        try:
            self._begin()
            self.on_stage("begun")
            # Seconds per phase of this transaction: waiting for rows (read), producing them, flushing, committing.
            phases = self.last_phases = {"read_s": 0.0, "produce_s": 0.0, "flush_s": 0.0, "commit_s": 0.0}
            clock = sent.produce_all(batches, phases)
        finally:
            sent.close()
        phases["read_s"] += time.monotonic() - clock  # the wait for the end of the rows
        clock = time.monotonic()
        self.on_stage("rows_produced")
        # Delivery of every row (uncommitted) before the progress record, so it can carry their offsets.
        failure = sent.flush(self.flush_timeout_s)
        phases["flush_s"] = time.monotonic() - clock
        self.on_stage("flushed")
        if failure is not None:
            sent.raise_delivery_failure(failure)
        if expected_rows is not None and sent.rows != expected_rows:
            raise self._rows_mismatch(slice_range, sent.rows, expected_rows)
        record = self._progress_record(slice_range, sent, columns, schema_fingerprint, where, skipped, skipped_rows,
                                       watermark)
        self._produce(self.channel.progress_topic, slice_range.key.encode(), record.to_json(), None, None, None,
                      partition=0)  # read at partition 0 whatever partitions the topic has
        self.on_stage("before_commit")
        clock = time.monotonic()
        self._commit()
        phases["commit_s"] = time.monotonic() - clock
        self._txn_began = None
        self.on_stage("committed")
        return record

    def _rows_mismatch(self, slice_range: SliceRange, rows: int, expected_rows: int) -> SliceRowsMismatch:
        """The progress record would say "every row up to hi is sent" over rows that were not (or twice): a driver
        reading a column narrower than the source stores it, a session time zone moving zone-less times out of the
        range, rows deleted or rewritten in an append-only table. The transaction is aborted instead."""
        return SliceRowsMismatch(
            f"{self.channel.table}: slice {slice_range}: the read gave {rows} rows but the source counts "
            f"{expected_rows} in it; nothing of the slice is committed and progress has not moved. Likely causes: a "
            "column the JDBC driver reads narrower than the source stores it, a Spark session time zone other than "
            "UTC with zone-less timestamp watermarks, a `where:` whose result depends on the session's time zone "
            "(rowrelay counts in the database's default zone, Spark reads in UTC: write times with their "
            "offset), or rows deleted or changed inside the slice (rowrelay relays append-only tables). Fix "
            "the cause and run the slice again")

    def _progress_record(self, slice_range: SliceRange, sent: SliceRows, columns: list[list[str]],
                         schema_fingerprint: str, where: str | None, skipped: Sequence[RowSkip] | None,
                         skipped_rows: int | None, watermark: tuple[str, str] | None) -> ProgressRecord:
        ch = self.channel
        return ProgressRecord(
            table=ch.table, slice=slice_range.key, lo=slice_range.lo, hi=slice_range.hi, rows=sent.rows,
            bytes=sent.nbytes, checksum=sent.digest.hexdigest(), topic=ch.topic,
            offsets={str(p): span for p, span in sorted(sent.offsets.items())},
            transactional_id=ch.transactional_id, committed_at=datetime.now(UTC).isoformat(),
            transaction_s=round(time.monotonic() - self._txn_began, 3) if self._txn_began is not None else 0.0,
            columns=columns, schema_fingerprint=schema_fingerprint, where=where,
            skipped=None if skipped is None else [s.to_record() for s in skipped], skipped_rows=skipped_rows,
            **watermark_fields(watermark),
        )

    def _fence_after_unknown_commit(self) -> ProgressRecord | None:
        """A fresh producer of the table's transactional id in place of the one whose commit got no answer, and the
        progress committed once it is initialized: its init_transactions has the coordinator finish that
        transaction (committed, or aborted) and fences the old producer's requests still on their way, so the
        progress read then says for good whether the commit landed."""
        self._txn_began = None
        self._own_progress = None
        self._initialized = False
        stale, self.producer = self.producer, Producer(with_error_cb(self._producer_conf))
        try:
            self.init()
        finally:
            with contextlib.suppress(KafkaException, SystemError):  # its queue emptied, dropping it waits for nothing
                stale.purge()
        return self.committed_progress()


def publish_slice(channel: TableChannel, kafka_conf: dict[str, Any], slice_range: SliceRange,
                  batches: Callable[[], Iterable[Sequence[OutgoingMessage]]], *,
                  on_stage: StageHook | None = None) -> PublishResult:
    """Publish one slice exactly once: init (fence), check progress, one transaction with rows + progress."""
    publisher = SlicePublisher(channel, kafka_conf, on_stage=on_stage)
    try:
        return publisher.publish(slice_range, batches)
    finally:
        publisher.close()
