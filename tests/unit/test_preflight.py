"""resources/exactly_once/preflight.py: which refusal stops each purpose, Kafka's answers faked (no stack)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from resources.exactly_once import (
    BaselineMissing,
    KafkaReads,
    ProgressMissing,
    ProgressRecord,
    ProgressShared,
    PublisherFenced,
    Purpose,
    TableChannel,
    WatermarkChanged,
    preflight,
)
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.slices import SliceRange

TABLE = "src.public.t"


def _channel(*, latest: bool = False, topic: str = "t") -> TableChannel:
    return TableChannel.for_table(TABLE, topic, prefix=PREFIX, start_after=5, baseline_required=latest)


def _record(lo: int, hi: int, topic: str = "t", watermark: tuple[str, str] = ("id", "integer")) -> ProgressRecord:
    return ProgressRecord(TABLE, f"{lo}-{hi}", lo, hi, hi - lo, 0, "", topic, watermark=watermark[0],
                          watermark_kind=watermark[1])


class FakeKafka:
    """Kafka's answers, and which questions were asked."""

    def __init__(self, *, in_topic: int | None = None, history: Sequence[ProgressRecord] = (),
                 committed: ProgressRecord | None = None) -> None:
        self.in_topic, self.history_records, self.committed_now = in_topic, list(history), committed
        self.asked: list[str] = []

    def published(self, channel: TableChannel, timestamps: bool) -> ProgressMissing | None:
        self.asked.append("published")
        if self.in_topic is None:
            return None
        return ProgressMissing(f"{channel.table}: committed progress is empty (in topic)", table=channel.table,
                               topic_watermark=self.in_topic)

    def history(self, channel: TableChannel) -> Sequence[ProgressRecord]:
        self.asked.append("history")
        return self.history_records

    def committed(self, channel: TableChannel) -> ProgressRecord | None:
        self.asked.append("committed")
        return self.committed_now

    def reads(self) -> KafkaReads:
        return KafkaReads(published=self.published, history=self.history, committed=self.committed,
                          pause=lambda _s: self.asked.append("pause"))


def test_every_purpose_refuses_a_changed_watermark_before_asking_kafka() -> None:
    kafka = FakeKafka()
    for purpose in Purpose:
        refused = preflight(purpose, _record(0, 10), _channel(), watermark=("id", "timestamp"), kafka=kafka.reads())
        assert isinstance(refused, WatermarkChanged), purpose
    assert kafka.asked == []
    assert preflight(Purpose.CHECK, _record(0, 10), watermark=("id", "integer")) is None  # no channel: progress alone


@pytest.mark.parametrize("purpose", [Purpose.CUT, Purpose.PUBLISH, Purpose.CHECK, Purpose.VERIFY])
def test_empty_progress_over_published_rows_is_refused_where_kafka_is_asked(purpose: Purpose) -> None:
    kafka = FakeKafka(in_topic=42)
    refused = preflight(purpose, None, _channel(), kafka=kafka.reads())
    assert isinstance(refused, ProgressMissing) and refused.topic_watermark == 42
    # The publisher also asks whether a newer publisher committed since (three reads, a pause between them).
    assert kafka.asked == (["published", "committed", "pause", "committed", "pause", "committed"]
                           if purpose is Purpose.PUBLISH else ["published"])
    assert preflight(purpose, None, _channel(), kafka=None) is None  # a dry run that does not refuse


def test_status_never_asks_kafka() -> None:
    kafka = FakeKafka(in_topic=42)
    assert preflight(Purpose.STATUS, None, _channel(), kafka=kafka.reads()) is None
    assert kafka.asked == []


def test_a_publisher_overtaken_since_it_read_empty_progress_stops_as_fenced() -> None:
    kafka = FakeKafka(in_topic=42, committed=_record(0, 50))
    refused = preflight(Purpose.PUBLISH, None, _channel(), kafka=kafka.reads())
    assert isinstance(refused, PublisherFenced)
    assert str(refused) == (f"{TABLE}: another publisher took over transactional id rowrelay.{TABLE} and committed "
                            "progress up to 50 since this one read it; this one stops without publishing")


def test_slices_recorded_over_empty_progress_are_refused_after_kafka_and_lazily() -> None:
    recorded = SliceRange(5, 30)
    for purpose in (Purpose.CUT, Purpose.PUBLISH, Purpose.CHECK, Purpose.VERIFY):
        refused = preflight(purpose, None, _channel(), recorded=recorded, kafka=FakeKafka().reads())
        assert isinstance(refused, ProgressMissing) and refused.topic_watermark == 30, purpose
        assert "recorded as committed reach watermark 30" in str(refused)
    asked: list[str] = []

    def lazily() -> SliceRange:
        asked.append("recorded")
        return recorded

    refused = preflight(Purpose.VERIFY, None, _channel(), recorded=lazily, kafka=FakeKafka(in_topic=42).reads())
    assert isinstance(refused, ProgressMissing) and refused.topic_watermark == 42 and asked == []
    assert preflight(Purpose.CUT, None, _channel(), recorded=SliceRange(0, 5)) is None  # at start_after: nothing


def test_status_asks_for_recorded_slices_only_of_a_table_awaiting_its_baseline() -> None:
    recorded = SliceRange(5, 30)
    assert preflight(Purpose.STATUS, None, _channel(), recorded=recorded) is None
    assert isinstance(preflight(Purpose.STATUS, None, _channel(latest=True), recorded=recorded), ProgressMissing)


def test_only_the_publisher_refuses_a_slice_before_the_baseline() -> None:
    slice_range = SliceRange(0, 10)
    refused = preflight(Purpose.PUBLISH, None, _channel(latest=True), publishing=slice_range)
    assert isinstance(refused, BaselineMissing) and "slice (0, 10] was cut before" in str(refused)
    assert preflight(Purpose.PUBLISH, None, _channel(latest=True)) is None  # a progress record alone
    assert preflight(Purpose.CUT, None, _channel(latest=True), publishing=slice_range) is None


def test_a_topic_taken_back_is_refused_by_the_cut_and_the_publisher() -> None:
    committed = _record(20, 30, topic="other")
    history = [_record(0, 10), _record(10, 20, topic="other"), committed]
    for purpose in Purpose:
        kafka = FakeKafka(history=history)
        refused = preflight(purpose, committed, _channel(), kafka=kafka.reads())
        asks = purpose in (Purpose.CUT, Purpose.PUBLISH)
        assert isinstance(refused, ProgressShared) if asks else refused is None, purpose
        assert kafka.asked == (["history"] if asks else [])
    kafka = FakeKafka(history=history)  # progress for the channel's own topic: no history read
    assert preflight(Purpose.CUT, _record(0, 10), _channel(), kafka=kafka.reads()) is None and kafka.asked == []
    moved = [_record(0, 10, topic="old"), _record(10, 20, topic="old")]  # a `topic:` change moves the table once
    kafka = FakeKafka(history=moved)
    assert preflight(Purpose.CUT, moved[-1], _channel(), kafka=kafka.reads()) is None and kafka.asked == ["history"]
