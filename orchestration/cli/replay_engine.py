"""The replay engine: a committed range republished once more, marked rowrelay.replay."""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any

from orchestration.cli.arguments import watermark_kind_error
from orchestration.tables import kafka_conf
from resources.config import RelayConfig, TableConfig
from resources.exactly_once import LivePiece, live_pieces, message_watermark, read_committed_progress
from resources.slices import is_timestamp_key, watermark_text


class ReplayError(ValueError):
    """A replay request that cannot be served as asked; the message says what to fix. Nothing was produced."""


def replay_records(history: list[Any], committed_hi: int | None, table_id: str, lo: int, hi: int
                   ) -> list[LivePiece]:
    """The committed pieces (slices, or a slice's part below a reset inside it) that exactly cover (lo, hi], in
    order, or a ReplayError. For a timestamp watermark (the slices' keys are times) the errors name UTC times, as
    --from and --to take them."""
    # Resets (lo == hi) carry no messages, and a reset back supersedes the slices above it (live_pieces): after a
    # table was re-created and reset, the old table's slices are not the range's, even where their bounds fit.
    pieces = {(p.lo, p.hi): p for p in live_pieces(history)}
    timestamps = any(is_timestamp_key(p.record.slice) for p in pieces.values())

    def text(value: int) -> str:
        return watermark_text(value, timestamps)

    if pieces and (wrong := next(filter(None, (watermark_kind_error(table_id, timestamps, flag, value)
                                                for flag, value in (("--from", lo), ("--to", hi)))), None)):
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


def replay_range(config: RelayConfig, table: TableConfig, lo: int, hi: int, topic: str | None) -> dict[str, Any]:
    """Republish the committed messages of the slices covering (lo, hi] to `topic` (default: the table's) in one
    transaction of the replay's own transactional id, each with its original headers plus `rowrelay.replay`. Reads
    the data topic by the recorded offsets, never the source; never writes the table's progress."""
    from confluent_kafka import KafkaException, Producer
    from confluent_kafka.admin import AdminClient

    from assets.relay import channel_for
    from resources.exactly_once import (
        REPLAY_HEADER,
        base_conf,
        call_retrying,
        outcome_unknown,
        read_progress_history,
        read_published_messages,
        transaction_timeout_ms,
    )

    channel = channel_for(table, config.kafka.transactional_id_prefix)
    conf = kafka_conf(config)
    target = topic or table.topic_name
    history = read_progress_history(conf, channel)
    committed = read_committed_progress(conf, channel)
    records = replay_records(history, committed.hi if committed else None, table.table_id, lo, hi)
    meta = AdminClient(base_conf(conf)).list_topics(target, timeout=30).topics.get(target)
    if meta is None or meta.error is not None or not meta.partitions:
        raise ReplayError(f"topic {target!r} does not exist; create it first (rowrelay never creates a replay "
                          "target) or pass an existing --topic")
    needed = max((int(p) for piece in records for p in piece.record.offsets), default=0)
    if needed >= len(meta.partitions):
        raise ReplayError(f"topic {target!r} has {len(meta.partitions)} partition(s); the range's messages are in "
                          f"partition {needed} of {channel.topic}: give --topic a topic with at least {needed + 1}")
    replay_id = f"replay-{uuid.uuid4().hex[:12]}"
    # The publisher's transaction timeout (the user's, else 10 minutes), not librdkafka's 60 s: a replay of a large
    # range is one transaction, and the broker aborted it after a minute with a bare KafkaException (found by review).
    timeout_ms = transaction_timeout_ms(conf)
    producer = Producer({"queue.buffering.max.messages": 500_000, **conf,
                         "transactional.id": f"{config.kafka.transactional_id_prefix}.replay.{table.table_id}",
                         "enable.idempotence": True, "transaction.timeout.ms": timeout_ms})
    marker = (REPLAY_HEADER, replay_id.encode())
    rows = 0
    began = time.monotonic()
    committing = False

    def produce(msg: Any) -> None:
        # Same partition as the original: per partition, consumers see watermark order again.
        while True:
            try:
                producer.produce(target, msg.value(), msg.key(), partition=msg.partition(),
                                 headers=[*(msg.headers() or []), marker])
                return
            except BufferError:  # the local queue is full: let deliveries drain it, then produce the message
                producer.poll(0.5)

    try:
        producer.init_transactions(60)  # fences an earlier replay of this table that is still open
        producer.begin_transaction()
        try:
            for piece in records:
                read = 0
                for msg in read_published_messages(conf, piece.record):
                    read += 1  # the whole slice is read, a piece cut by a reset too: its count checks the read
                    wm = message_watermark(msg) if piece.hi < piece.record.hi else None
                    if wm is not None and wm > piece.hi:
                        continue  # above a reset inside the slice: sent again by a later slice, not this range's
                    produce(msg)
                    rows += 1
                    producer.poll(0)
                if read != piece.record.rows:
                    raise ReplayError(f"{table.table_id}: read {read} messages of slice {piece.record.slice}, but "
                                      f"its progress record says {piece.record.rows}; nothing was replayed")
            committing = True
            # Called again on a retriable error (a timeout: the commit goes on in the background), as the publisher
            # does. It was aborted at once instead, which librdkafka refuses then, and the replay said "nothing was
            # replayed, run the replay again" while the commit could still complete (found by review).
            call_retrying(producer.commit_transaction, REPLAY_COMMIT_TIMEOUT_S)
        except BaseException as exc:
            if committing and isinstance(exc, KafkaException) and outcome_unknown(exc.args[0]):
                raise ReplayError(replay_unknown_text(table.table_id, rows, exc.args[0].str(), target,
                                                      replay_id)) from None
            with contextlib.suppress(KafkaException):
                producer.abort_transaction(30)
            if isinstance(exc, KafkaException):
                elapsed = time.monotonic() - began
                cause = (f"it was open {elapsed:.0f} s, past transaction.timeout.ms ({timeout_ms} ms), so Kafka "
                         "aborted it: replay the range in parts (--from/--to), or raise kafka.producer "
                         "transaction.timeout.ms up to the brokers' transaction.max.timeout.ms"
                         if elapsed * 1000 >= 0.9 * timeout_ms else "run the replay again")
                raise ReplayError(f"{table.table_id}: the replay's transaction ({rows} messages produced) failed: "
                                  f"{exc.args[0].str() if exc.args else exc}; nothing was replayed, {cause}") from None
            raise
    finally:
        with contextlib.suppress(KafkaException):
            producer.flush(5)
    return {"table": table.table_id, "replay_id": replay_id, "from": int(lo), "to": int(hi), "rows": rows,
            "topic": target,
            "slices": [piece.key for piece in records]}


REPLAY_COMMIT_TIMEOUT_S = 60  # one commit_transaction call of a replay; retried (call_retrying) while retriable


def replay_unknown_text(table_id: str, rows: int, error: str, target: str, replay_id: str) -> str:
    """A replay whose commit still failed with a retriable error after its retries: it may have committed."""
    return (f"{table_id}: the replay's transaction ({rows} messages produced) did not confirm its commit ({error}): "
            "outcome unknown, the commit may still complete in the background. Check topic "
            f"{target} for messages with header rowrelay.replay={replay_id} before running the replay again (if "
            "they are there, the range was replayed, and running it again sends it twice)")
