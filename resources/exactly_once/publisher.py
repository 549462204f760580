"""Publishing a table's slices exactly once through one transactional producer."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from resources.arrow_produce import RowProducer
from resources.exactly_once.batches import TABLE_HEADER, WATERMARK_HEADER, MessageBatch, OutgoingMessage, SliceDigest
from resources.exactly_once.clients import (
    StageHook,
    _fatal_message,
    _is_fenced,
    _log,
    broker_max_transaction_timeout_ms,
    call_retrying,
    env_failpoint,
    outcome_unknown,
    transaction_timeout_ms,
    unreachable,
    with_error_cb,
)
from resources.exactly_once.errors import (
    BadRowError,
    BaselineMissing,
    KafkaAuthenticationError,
    KafkaUnavailable,
    ProducerSettingsError,
    PublisherFenced,
    RelayError,
    SliceOutOfOrder,
    SliceRowsMismatch,
    TopicSettingsError,
    TransactionTimedOut,
    _AbortAndRedo,
    _column_hint,
    _CommitUnknown,
    skip_advice,
)
from resources.exactly_once.preflight import progress_missing, progress_recorded_refusal, progress_shared
from resources.exactly_once.progress_log import find_slice_progress, read_committed_progress
from resources.exactly_once.records import (
    BASELINE_PREFIX,
    RESET_PREFIX,
    ProgressRecord,
    PublishResult,
    ResetOutcome,
    TableChannel,
    refuse_watermark_change,
    watermark_fields,
)
from resources.exactly_once.topics import ensure_topics, topic_end_offsets
from resources.slices import RowSkip, SliceRange, watermark_text


class SlicePublisher:
    """Publishes one table's slices through one transactional producer (one epoch)."""

    def __init__(self, channel: TableChannel, kafka_conf: dict[str, Any], *,
                 on_stage: StageHook | None = None, max_attempts: int = 3, init_timeout_s: float = 60.0,
                 flush_timeout_s: float = 300.0, abort_timeout_s: float = 10.0,
                 recorded: SliceRange | None = None, commit_timeout_s: float = 120.0) -> None:
        self.channel = channel
        # The newest slice the orchestrator recorded as committed, where Kafka's progress looked empty to it (None:
        # nothing recorded, or progress was there): see `_refuse_if_progress_missing`.
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
        if committed is None:
            self._refuse_if_progress_missing(slice_range.timestamps)
            if self.channel.baseline_required:
                # Cut before `start_after` became `latest`: the whole history would be sent.
                raise BaselineMissing(
                    f"{self.channel.table}: start_after is latest, and no baseline is recorded yet: slice "
                    f"{slice_range} was cut before (under another start_after) and would send rows `latest` skips. "
                    "Nothing was sent; the table's sensor (or `rowrelay backfill`) records the baseline at the "
                    "newest final row and deletes such slices")
        else:
            if watermark is not None:
                refuse_watermark_change(committed, watermark)
            self._refuse_topic_taken_back(committed)
        committed_hi = committed.hi if committed else self.channel.start_after
        if committed_hi >= slice_range.hi:
            # A baseline or reset record (lo == hi) is not this slice's record.
            record = committed if committed and (committed.lo, committed.hi) == (slice_range.lo, slice_range.hi) \
                else find_slice_progress(self.kafka_conf, self.channel, slice_range)
            if record is None:  # covered by progress but not a slice of its own (e.g. start_after)
                record = ProgressRecord(self.channel.table, slice_range.key, slice_range.lo, slice_range.hi, 0, 0,
                                        "", self.channel.topic)
            return PublishResult(record, already_committed=True, duration_s=time.monotonic() - started)
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
                # redone blindly, it was in the topic twice when the first commit had landed.
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
                self._refuse_if_progress_missing(record.watermark_kind in ("timestamp", "timestamptz"))
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

    def _refuse_topic_taken_back(self, committed: ProgressRecord) -> None:
        """Refuse when the table's progress moved to another topic and back (`topic_taken_back`): two deployments
        sharing one transactional_id prefix. Reads the history only when the topics differ, once per publisher."""
        if self._topic_checked_back:
            return
        if (shared := progress_shared(self.kafka_conf, self.channel, committed)) is not None:
            raise shared
        if committed.topic and committed.topic != self.channel.topic:
            self._topic_checked_back = True

    def _refuse_if_overtaken(self) -> None:
        """The empty progress this publisher read is stale when a newer publisher fenced it and committed since
        (this one stalled in between): the messages in the topic are that one's, and this one stops as fenced. Read a
        few times: the commit marker on the progress partition may follow the data partitions' by a moment."""
        for attempt in range(3):
            if (now := self.committed_progress()) is not None:
                break
            if attempt < 2:
                time.sleep(1.0)
        else:
            return
        raise PublisherFenced(
            f"{self.channel.table}: another publisher took over transactional id {self.channel.transactional_id} "
            f"and committed progress up to {now.hi_text} since this one read it; this one stops without publishing")

    def _refuse_if_progress_missing(self, timestamps: bool) -> None:
        """Empty progress but the table's messages already in its data topic (e.g. a new transactional_id_prefix
        gave it a new, empty progress topic), or slices of it recorded committed by the orchestrator (`recorded`:
        the progress topic deleted after the data topic's messages expired): publishing would send them all again.
        Checked once per publisher."""
        if self._topic_checked:
            return
        if (missing := progress_missing(self.kafka_conf, self.channel, timestamps)) is not None:
            self._refuse_if_overtaken()
            raise missing
        if (missing := progress_recorded_refusal(self.channel, self.recorded)) is not None:
            raise missing
        self._topic_checked = True

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

    def _abort_quietly(self) -> None:
        """Best effort and bounded: end the open transaction, if any; errors here must not hide the cause."""
        if self._txn_began is None:
            return
        self._txn_began = None
        # Fenced, fatal or broker away: the coordinator ends it (after transaction.timeout.ms at worst).
        with contextlib.suppress(KafkaException):
            self.producer.abort_transaction(self.abort_timeout_s)

    def _transaction(self, slice_range: SliceRange, batches: Iterable[MessageBatch | Sequence[OutgoingMessage]],
                     columns: list[list[str]], schema_fingerprint: str,
                     expected_rows: int | None = None, where: str | None = None,
                     skipped: Sequence[RowSkip] | None = None, skipped_rows: int | None = None,
                     watermark: tuple[str, str] | None = None) -> ProgressRecord:
        ch = self.channel
        offsets: dict[int, list[int]] = {}
        errors: list[tuple[KafkaError, int | None]] = []

        def delivered(err: KafkaError | None, msg: Any) -> None:
            if err is not None:
                errors.append((err, None))
                return
            span = offsets.setdefault(msg.partition(), [msg.offset(), msg.offset()])
            span[0] = min(span[0], msg.offset())
            span[1] = max(span[1], msg.offset())

        digest = SliceDigest()
        rows = nbytes = 0
        # (size, watermark, value): names the culprit if the broker refuses a message as too large.
        largest: tuple[int, int | None, bytes | None] = (0, None, None)
        produce, topic = self.producer.produce, ch.topic
        # Per row only what is per row (each header costs about as much as the produce call itself): the table,
        # for topics that several tables share, and the row's watermark. Which slice a message belongs to is in
        # the progress record (its offsets); the slice's checksum is over the values themselves (SliceDigest).
        table_pair = (TABLE_HEADER, ch.table.encode())

        # Set when librdkafka refuses to produce because the transaction already failed (_STATE): a message sent
        # earlier was refused (too large, say); the flush below asks the producer why (_transaction_failure).
        refused: list[KafkaError] = []

        # Offsets per partition need a report per row (several partitions, or the redo naming a failed row).
        every_row_reports = self._report_every_row or self._data_partitions != 1
        # Otherwise the topic has one partition, named on every row: no partitioner hashing each key to find it,
        # and the offsets of a batch's first and last row span the rows between them even if partitions were
        # added to the topic since init.
        partition = -1 if every_row_reports else 0

        def send(rows: Iterable[tuple[bytes | None, bytes, int, bytes]], report: Callable[..., None] | None) -> None:
            if refused:
                return
            for key, value, wm, wm_text in rows:
                headers = [table_pair, (WATERMARK_HEADER, wm_text)]
                try:  # one C call per row, positional (keyword parsing costs much of the loop):
                    # topic, value, key, partition (-1: the partitioner), callback, on_delivery (its alias),
                    # timestamp, headers
                    produce(topic, value, key, partition, report, None, 0, headers)
                except (BufferError, KafkaException):
                    self._produce(topic, key, value, headers, report, wm, refused, partition)
                    if refused:
                        return

        def send_quietly(batch: MessageBatch, start: int, stop: int) -> None:
            """Rows [start, stop) without a delivery report: from C where it is attached (the hot path), each
            row librdkafka refuses through `send`, which waits out a full queue or says why."""
            if native is None or not native.supports(batch.keys, batch.values, batch.watermark_texts):
                send(batch.rows(start, stop), None)
                return
            while start < stop and not refused:
                done, _ = native.produce(batch.keys, batch.values, batch.watermark_texts, start, stop)
                start += done
                if start < stop:
                    send(batch.rows(start, start + 1), None)
                    start += 1

        native = None if every_row_reports else RowProducer.attach(self.producer, topic, ch.table, partition)
        try:
            self._call(self.producer.begin_transaction)
            self._txn_began, self._txn_rows = time.monotonic(), 0
            self.on_stage("begun")
            # Seconds per phase of this transaction: waiting for rows (read), producing them, flushing, committing.
            phases = self.last_phases = {"read_s": 0.0, "produce_s": 0.0, "flush_s": 0.0, "commit_s": 0.0}
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
                low, high = batch.watermark_bounds()
                if low <= slice_range.lo or high > slice_range.hi:
                    wm = low if low <= slice_range.lo else high
                    raise BadRowError(f"{ch.table}: row with watermark {wm} is outside slice {slice_range}",
                                      table=ch.table, watermark=wm)
                sizes = batch.sizes()
                at = int(sizes.argmax())
                biggest = int(sizes[at])
                if biggest > largest[0]:
                    largest = (biggest, batch.watermarks[at].as_py(), batch.values[at].as_py())
                if biggest > self.max_message_bytes:
                    column, hint = _column_hint(largest[2])
                    named = watermark_text(int(largest[1] or 0), slice_range.timestamps)
                    raise BadRowError(
                        f"{ch.table}: row with watermark {named} is {biggest} bytes as a message{hint}, over the "
                        f"producer's message.max.bytes ({self.max_message_bytes}); raise message.max.bytes on the "
                        f"producer and the topic (max.message.bytes), or {skip_advice(named)} (see docs/operations.md)",
                        table=ch.table, watermark=largest[1], column=column, entry=named, value=largest[2])
                if every_row_reports or n <= 2:
                    send(batch.rows(0, n), delivered)
                else:  # the first and the last row report their offsets, in order around the rest
                    send(batch.rows(0, 1), delivered)
                    send_quietly(batch, 1, n - 1)
                    send(batch.rows(n - 1, n), delivered)
                digest.update_arrow(batch.values)
                rows += n
                self._txn_rows = rows
                nbytes += int(sizes.sum())
                self._serve(self.producer.poll, 0)  # delivery reports so far
                now = time.monotonic()
                phases["produce_s"] += now - clock
                clock = now
                if errors or refused:
                    break
        finally:
            if native is not None:
                native.close()
        phases["read_s"] += time.monotonic() - clock  # the wait for the end of the rows
        clock = time.monotonic()
        self.on_stage("rows_produced")
        # Delivery of every row (uncommitted) before the progress record, so it can carry their offsets.
        # Short flushes: a failed delivery ends the wait at once instead of after the whole timeout.
        deadline = time.monotonic() + self.flush_timeout_s
        failure: KafkaError | None = None
        while True:
            left = 0 if refused else self._serve(self.producer.flush, 1.0)
            # A refused message without a delivery callback fails the transaction silently, and the messages
            # queued behind it then wait out message.timeout.ms: ask the producer instead of waiting.
            failure = self._transaction_failure()
            if failure is not None or errors:
                break
            if refused:  # refused, yet the transaction has not failed: say what was refused
                self._raise_for(refused[0])
            if not left:
                break
            if time.monotonic() > deadline:
                raise _AbortAndRedo(f"messages not delivered within {self.flush_timeout_s:.0f} s")
        phases["flush_s"] = time.monotonic() - clock
        self.on_stage("flushed")
        if failure is not None or errors:
            # The transaction's own error names the cause; a delivery report may only say its message was purged.
            err = failure if failure is not None else errors[0][0]
            if err.code() == KafkaError.INVALID_RECORD:
                raise TopicSettingsError(
                    f"{ch.table}: the broker refused a message of slice {slice_range} as invalid ({err.str()}): a "
                    f"compacted topic refuses messages without a key (is topic {ch.topic} compacted while the table "
                    "has `key: none`?), or a broker-side record check (a timestamp outside "
                    "message.timestamp.*.max.ms) failed. Nothing of the slice is visible; fix the topic's settings "
                    "or the table's `key:`")
            if err.code() in (KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE):
                size, wm, value = largest
                column, hint = _column_hint(value)
                named = watermark_text(int(wm or 0), slice_range.timestamps)
                raise BadRowError(
                    f"{ch.table}: the broker rejected a message as too large ({err.str()}); the largest row of slice "
                    f"{slice_range} has watermark {named} ({size} bytes{hint}). Raise the topic's max.message.bytes "
                    f"(and the producer's message.max.bytes) or {skip_advice(named)} (see docs/operations.md)",
                    table=ch.table, watermark=wm, column=column, entry=named, value=value)
            if _is_fenced(err) or err.fatal():
                raise PublisherFenced(f"{ch.table}: {_fatal_message(err)}")
            raise _AbortAndRedo(_fatal_message(err))
        if expected_rows is not None and rows != expected_rows:
            # The progress record would say "every row up to hi is sent" over rows that were not (or twice): a
            # driver reading a column narrower than the source stores it, a session time zone moving zone-less
            # times out of the range, rows deleted or rewritten in an append-only table. Abort instead.
            raise SliceRowsMismatch(
                f"{ch.table}: slice {slice_range}: the read gave {rows} rows but the source counts {expected_rows} "
                "in it; nothing of the slice is committed and progress has not moved. Likely causes: a column the "
                "JDBC driver reads narrower than the source stores it, a Spark session time zone other than UTC "
                "with zone-less timestamp watermarks, a `where:` whose result depends on the session's time zone "
                "(rowrelay counts in the database's default zone, Spark reads in UTC: write times with their "
                "offset), or rows deleted or changed inside the slice (rowrelay relays append-only tables). Fix "
                "the cause and run the slice again")
        record = ProgressRecord(
            table=ch.table, slice=slice_range.key, lo=slice_range.lo, hi=slice_range.hi, rows=rows, bytes=nbytes,
            checksum=digest.hexdigest(), topic=ch.topic,
            offsets={str(p): span for p, span in sorted(offsets.items())},
            transactional_id=ch.transactional_id, committed_at=datetime.now(UTC).isoformat(),
            transaction_s=round(time.monotonic() - self._txn_began, 3) if self._txn_began is not None else 0.0,
            columns=columns, schema_fingerprint=schema_fingerprint, where=where,
            skipped=None if skipped is None else [s.to_record() for s in skipped], skipped_rows=skipped_rows,
            **watermark_fields(watermark),
        )
        self._produce(ch.progress_topic, slice_range.key.encode(), record.to_json(), None, None, None,
                      partition=0)  # read at partition 0 whatever partitions the topic has
        self.on_stage("before_commit")
        clock = time.monotonic()
        self._commit()
        phases["commit_s"] = time.monotonic() - clock
        self._txn_began = None
        self.on_stage("committed")
        return record

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
        exception pending, which surfaces as a SystemError caused by it. Either becomes our error for it."""
        try:
            return fn(timeout)
        except (KafkaException, SystemError) as exc:
            cause = exc if isinstance(exc, KafkaException) else exc.__cause__
            if not isinstance(cause, KafkaException):
                raise
            self._raise_for(cause.args[0])
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


def publish_slice(channel: TableChannel, kafka_conf: dict[str, Any], slice_range: SliceRange,
                  batches: Callable[[], Iterable[Sequence[OutgoingMessage]]], *,
                  on_stage: StageHook | None = None) -> PublishResult:
    """Publish one slice exactly once: init (fence), check progress, one transaction with rows + progress."""
    publisher = SlicePublisher(channel, kafka_conf, on_stage=on_stage)
    try:
        return publisher.publish(slice_range, batches)
    finally:
        publisher.close()
