"""A commit whose outcome is unknown: the broker paused (SIGSTOP) while commit_transaction waits for its answer, past
the commit's timeout, then resumed. On a private broker: the shared one is never paused."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest

from resources.exactly_once import OutgoingMessage, SlicePublisher, TableChannel, clients, read_progress_history
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.slices import SliceRange
from tests.pipeline import read_topic, visible_progress
from tests.private_kafka import PrivateKafka, private_kafka

pytestmark = pytest.mark.integration

COMMIT_TIMEOUT_S = 3.0
PAUSE_S = COMMIT_TIMEOUT_S + 5.0  # the commit has timed out well before the broker answers again


def _rows(lo: int, hi: int):
    def batches():
        yield [OutgoingMessage(str(i).encode(), f'{{"id":{i}}}'.encode(), i) for i in range(lo + 1, hi + 1)]
    return batches


@pytest.fixture(scope="module")
def broker() -> Iterator[PrivateKafka]:
    with private_kafka() as started:
        yield started


@pytest.mark.parametrize("delivered", [True, False], ids=["endtxn-sent", "record-undelivered"])
def test_a_commit_that_times_out_while_the_broker_is_paused_publishes_the_slice_once(
        broker: PrivateKafka, delivered: bool, monkeypatch) -> None:
    """The broker is paused right before commit_transaction; the commit times out (outcome unknown), then the
    broker resumes. `endtxn-sent`: rows and progress record delivered first, so the EndTxn waits in the paused
    broker's socket and commits when it resumes. The publisher aborted and sent the slice again on the same
    producer without reading progress (librdkafka refused: the run failed as "aborted 3 times" over a slice that
    had committed). It now ends that producer, fences it with a fresh one (init_transactions settles the open
    transaction) and reads the progress again: the slice is there once, and is not sent again.
    `record-undelivered`: the progress record still on its way when the broker stops; whichever way the broker
    settles the transaction, the slice is in the topic once."""
    monkeypatch.setattr(clients, "RETRIABLE_CALL_S", 0.0)  # a commit is never called again on the same producer
    conf = {"bootstrap.servers": broker.bootstrap}
    table = f"paused_{uuid.uuid4().hex[:8]}"
    channel = TableChannel.for_table(f"paused.public.{table}", table, prefix=PREFIX)
    timers: list[threading.Timer] = []

    def pause_before_commit(stage: str) -> None:
        if stage == "before_commit" and not timers:
            if delivered:
                assert publisher.producer.flush(30) == 0  # only the EndTxn is left to send
            broker.pause()
            timers.append(threading.Timer(PAUSE_S, broker.resume))
            timers[0].start()

    publisher = SlicePublisher(channel, conf, on_stage=pause_before_commit, commit_timeout_s=COMMIT_TIMEOUT_S)
    try:
        result = publisher.publish(SliceRange(0, 500), _rows(0, 500))
    finally:
        for timer in timers:
            timer.join()
        publisher.close()
    assert timers, "the broker was never paused"
    copies = Counter(m.watermark for m in read_topic(broker.bootstrap, channel.topic))
    twice = sorted(wm for wm, n in copies.items() if n > 1)
    assert not twice, f"{len(twice)} rows in the topic twice, e.g. {twice[:5]}"
    assert sorted(copies) == list(range(1, 501))
    progress = visible_progress(conf, channel, 500)
    assert progress is not None and (progress.lo, progress.hi, progress.rows) == (0, 500, 500), progress
    assert [r.slice for r in read_progress_history(conf, channel)] == [SliceRange(0, 500).key]
    assert (result.progress.lo, result.progress.hi, result.progress.rows) == (0, 500, 500), result
    assert not result.already_committed, result  # committed by this publisher
    if delivered:  # the EndTxn waited in the paused broker's socket and went first: the commit landed, and was found
        assert result.attempts == 1, result
