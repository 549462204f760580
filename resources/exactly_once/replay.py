"""Replay: an explicit, recorded republish of a table's committed range, read back from its data topic by the offsets
its progress records hold (never from the source), in one transaction of the replay's own transactional id. A replay
never writes the table's progress."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import confluent_kafka
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from resources.errors import RowrelayError
from resources.exactly_once.batches import REPLAY_HEADER, message_watermark
from resources.exactly_once.clients import base_conf, call_retrying, outcome_unknown, transaction_timeout_ms
from resources.exactly_once.progress_log import read_committed_progress, read_progress_history
from resources.exactly_once.readback import read_published_messages
from resources.exactly_once.records import LivePiece, ProgressRecord, TableChannel, live_pieces
from resources.slices import is_timestamp_key, watermark_text

# The refusal for --from or --to written as the other kind of watermark than the table's: (timestamps, flag, value)
# -> the message, or None. The command line knows how each was written.
KindError = Callable[[bool, str, int], str | None]

REPLAY_COMMIT_TIMEOUT_S = 60  # one commit_transaction call of a replay; retried (call_retrying) while retriable


class ReplayError(RowrelayError, ValueError):
    """A replay request that cannot be served as asked; the message says what to fix. Nothing was produced."""


def replay_records(history: list[ProgressRecord], committed_hi: int | None, table_id: str, lo: int, hi: int,
                   kind_error: KindError | None = None) -> list[LivePiece]:
    """The committed pieces (slices, or a slice's part below a reset inside it) that exactly cover (lo, hi], in
    order, or a ReplayError. For a timestamp watermark (the slices' keys are times) the errors name UTC times, as
    --from and --to take them."""
    # Resets (lo == hi) carry no messages, and a reset back supersedes the slices above it (live_pieces): after a
    # table was re-created and reset, the old table's slices are not the range's, even where their bounds fit.
    pieces = {(p.lo, p.hi): p for p in live_pieces(history)}
    timestamps = any(is_timestamp_key(p.record.slice) for p in pieces.values())

    def text(value: int) -> str:
        return watermark_text(value, timestamps)

    if pieces and kind_error is not None and (wrong := next(filter(None, (
            kind_error(timestamps, flag, value) for flag, value in (("--from", lo), ("--to", hi)))), None)):
        raise ReplayError(wrong)
    if hi <= lo:
        raise ReplayError(f"--to ({text(hi)}) must be greater than --from ({text(lo)})")
    if committed_hi is None or hi > committed_hi:
        raise ReplayError(f"{table_id}: range ({text(lo)}, {text(hi)}] is not fully committed: committed progress "
                          f"ends at {text(committed_hi) if committed_hi is not None else 'nothing yet'}")
    los, his = sorted({a for a, _ in pieces}), sorted({b for _, b in pieces})
    bad = ([f"--from {text(lo)}"] if lo not in los else []) + ([f"--to {text(hi)}"] if hi not in his else [])
    if bad:
        def near(values: list[int], v: int) -> str:
            return ", ".join(map(text, sorted(sorted(values, key=lambda x: abs(x - v))[:5])))
        raise ReplayError(f"{table_id}: {' and '.join(f'{b} is not a slice bound' for b in bad)}; slice lower "
                          f"bounds near --from: [{near(los, lo)}], upper bounds near --to: [{near(his, hi)}]")
    chain, at = [], lo
    while at < hi:
        nxt = [p for (a, b), p in pieces.items() if a == at and b <= hi]
        if not nxt:
            raise ReplayError(f"{table_id}: no committed slice starts at {text(at)} within ({text(lo)}, {text(hi)}] "
                              "(progress records compacted away or a reset in between); pick bounds inside one run "
                              "of slices")
        piece = max(nxt, key=lambda p: p.hi)
        chain.append(piece)
        at = piece.hi
    return chain


def replay_unknown_text(table_id: str, rows: int, error: str, target: str, replay_id: str) -> str:
    """A replay whose commit still failed with a retriable error after its retries: it may have committed."""
    return (f"{table_id}: the replay's transaction ({rows} messages produced) did not confirm its commit ({error}): "
            "outcome unknown, the commit may still complete in the background. Check topic "
            f"{target} for messages with header rowrelay.replay={replay_id} before running the replay again (if "
            "they are there, the range was replayed, and running it again sends it twice)")


def republish_range(channel: TableChannel, kafka_conf: dict[str, Any], lo: int, hi: int, *, target: str,
                 transactional_id: str, kind_error: KindError | None = None) -> dict[str, Any]:
    """Republish the committed messages of the slices covering (lo, hi] of `channel` to topic `target` in one
    transaction of `transactional_id`, each with its original headers plus `rowrelay.replay`."""
    history = read_progress_history(kafka_conf, channel)
    committed = read_committed_progress(kafka_conf, channel)
    records = replay_records(history, committed.hi if committed else None, channel.table, lo, hi, kind_error)
    _check_target(kafka_conf, channel, target, records)
    replay = _Replay(channel.table, kafka_conf, target, transactional_id, f"replay-{uuid.uuid4().hex[:12]}")
    replay.run(records)
    return {"table": channel.table, "replay_id": replay.replay_id, "from": int(lo), "to": int(hi),
            "rows": replay.rows, "topic": target, "slices": [piece.key for piece in records]}


def _check_target(kafka_conf: dict[str, Any], channel: TableChannel, target: str, records: list[LivePiece]) -> None:
    """The replay's topic exists (a replay never creates one) and has every partition the range's messages are in."""
    meta = AdminClient(base_conf(kafka_conf)).list_topics(target, timeout=30).topics.get(target)
    if meta is None or meta.error is not None or not meta.partitions:
        raise ReplayError(f"topic {target!r} does not exist; create it first (rowrelay never creates a replay "
                          "target) or pass an existing --topic")
    needed = max((int(p) for piece in records for p in piece.record.offsets), default=0)
    if needed >= len(meta.partitions):
        raise ReplayError(f"topic {target!r} has {len(meta.partitions)} partition(s); the range's messages are in "
                          f"partition {needed} of {channel.topic}: give --topic a topic with at least {needed + 1}")


@dataclass
class _Replay:
    """One replay's transaction on its own producer."""

    table_id: str
    kafka_conf: dict[str, Any]
    target: str
    transactional_id: str
    replay_id: str
    rows: int = 0
    timeout_ms: int = 0
    began: float = 0.0
    producer: confluent_kafka.Producer = field(init=False)
    marker: tuple[str, bytes] = field(init=False)

    def run(self, records: list[LivePiece]) -> None:
        # The publisher's transaction timeout (the user's, else 10 minutes), not librdkafka's 60 s: a replay of a
        # large range is one transaction. `confluent_kafka.Producer` is looked up when the replay runs.
        self.timeout_ms = transaction_timeout_ms(self.kafka_conf)
        self.producer = confluent_kafka.Producer({
            "queue.buffering.max.messages": 500_000, **self.kafka_conf, "transactional.id": self.transactional_id,
            "enable.idempotence": True, "transaction.timeout.ms": self.timeout_ms})
        self.marker = (REPLAY_HEADER, self.replay_id.encode())
        self.began = time.monotonic()
        try:
            self.producer.init_transactions(60)  # fences an earlier replay of this table that is still open
            self.producer.begin_transaction()
            self._transaction(records)
        finally:
            with contextlib.suppress(KafkaException):
                self.producer.flush(5)

    def _transaction(self, records: list[LivePiece]) -> None:
        committing = False
        try:
            for piece in records:
                self._send_piece(piece)
            committing = True
            # Called again on a retriable error (a timeout: the commit goes on in the background, and calling it
            # again awaits its outcome); an abort then would be refused while the commit could still complete.
            call_retrying(self.producer.commit_transaction, REPLAY_COMMIT_TIMEOUT_S)
        except BaseException as exc:
            if committing and isinstance(exc, KafkaException) and outcome_unknown(exc.args[0]):
                raise ReplayError(replay_unknown_text(self.table_id, self.rows, exc.args[0].str(), self.target,
                                                      self.replay_id)) from None
            with contextlib.suppress(KafkaException):
                self.producer.abort_transaction(30)
            if isinstance(exc, KafkaException):
                raise self._failed(exc) from None
            raise

    def _failed(self, exc: KafkaException) -> ReplayError:
        elapsed = time.monotonic() - self.began
        cause = (f"it was open {elapsed:.0f} s, past transaction.timeout.ms ({self.timeout_ms} ms), so Kafka "
                 "aborted it: replay the range in parts (--from/--to), or raise kafka.producer "
                 "transaction.timeout.ms up to the brokers' transaction.max.timeout.ms"
                 if elapsed * 1000 >= 0.9 * self.timeout_ms else "run the replay again")
        return ReplayError(f"{self.table_id}: the replay's transaction ({self.rows} messages produced) failed: "
                           f"{exc.args[0].str() if exc.args else exc}; nothing was replayed, {cause}")

    def _send_piece(self, piece: LivePiece) -> None:
        read = 0
        for msg in read_published_messages(self.kafka_conf, piece.record):
            read += 1  # the whole slice is read, a piece cut by a reset too: its count checks the read
            wm = message_watermark(msg) if piece.hi < piece.record.hi else None
            if wm is not None and wm > piece.hi:
                continue  # above a reset inside the slice: sent again by a later slice, not this range's
            self._produce(msg)
            self.rows += 1
            self.producer.poll(0)
        if read != piece.record.rows:
            raise ReplayError(f"{self.table_id}: read {read} messages of slice {piece.record.slice}, but "
                              f"its progress record says {piece.record.rows}; nothing was replayed")

    def _produce(self, msg: Any) -> None:
        # Same partition as the original: per partition, consumers see watermark order again.
        while True:
            try:
                self.producer.produce(self.target, msg.value(), msg.key(), partition=msg.partition(),
                                      headers=[*(msg.headers() or []), self.marker])
                return
            except BufferError:  # the local queue is full: let deliveries drain it, then produce the message
                self.producer.poll(0.5)
