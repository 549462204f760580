"""resources/exactly_once/publisher.py: a progress record's failed commit, with a faked producer."""

from __future__ import annotations

import pytest

from resources.exactly_once import ProgressRecord
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX


class _CommitFailsProducer:
    """A producer whose commit fails as librdkafka's did when a reset fenced it mid-commit ("EndTxn commit failed:
    Unknown broker error", abortable), and whose abort then reports `abort_error` (None: the abort succeeds)."""

    def __init__(self, abort_error: object | None) -> None:
        self.abort_error = abort_error
        self.aborted = 0

    def begin_transaction(self, *args: object) -> None:
        return None

    def produce(self, *args: object, **kwargs: object) -> None:
        return None

    def commit_transaction(self, *args: object) -> None:
        from confluent_kafka import KafkaError, KafkaException

        raise KafkaException(KafkaError(KafkaError.UNKNOWN, "EndTxn commit failed: Unknown broker error",
                                        txn_requires_abort=True))

    def abort_transaction(self, *args: object) -> None:
        from confluent_kafka import KafkaException

        self.aborted += 1
        if self.abort_error is not None:
            raise KafkaException(self.abort_error)


@pytest.mark.parametrize("fenced", [True, False])
def test_a_progress_record_whose_commit_fails_is_a_relay_error_not_the_private_redo_signal(fenced: bool) -> None:
    """publish_progress_only (a reset, the `latest` baseline) let the publisher's private _AbortAndRedo escape when
    the commit failed abortably: a caller catching RelayError (the CLI, a sensor, a publisher being fenced) missed
    it. The failure is aborted and reported as PublisherFenced when a newer publisher fenced it, else RelayError."""
    from confluent_kafka import KafkaError

    from resources.exactly_once import PublisherFenced, RelayError, SlicePublisher, TableChannel

    channel = TableChannel.for_table("src.public.t", "t", prefix=PREFIX)
    publisher = SlicePublisher(channel, {"bootstrap.servers": "127.0.0.1:1"})  # never connects: the producer is faked
    real = publisher.producer
    fake = _CommitFailsProducer(KafkaError(KafkaError._FENCED, "fenced by a newer instance", fatal=True)
                                if fenced else None)
    publisher.producer, publisher._initialized = fake, True
    record = ProgressRecord(channel.table, "reset-0", 0, 0, 0, 0, "", channel.topic)
    try:
        with pytest.raises(RelayError) as raised:
            publisher.publish_progress_only(record, reset=True)
    finally:
        publisher.producer = real
        publisher.close()
    assert fake.aborted == 1
    assert isinstance(raised.value, PublisherFenced) == fenced, raised.value
    if not fenced:
        assert "not committed" in str(raised.value) and "Unknown broker error" in str(raised.value), raised.value
