"""Defects the schedule explorer (tests/explorer) found, each pinned by a focused test on the real stack."""

from __future__ import annotations

import threading

import pytest

from resources.exactly_once import PublisherFenced, SlicePublisher, TableChannel, publish_slice
from resources.slices import SliceRange
from tests.pipeline import read_topic
from tests.test_exactly_once import _rows

pytestmark = pytest.mark.integration


def test_a_publisher_overtaken_after_reading_empty_progress_stops_as_fenced(services, name) -> None:
    """A table's first publisher reads empty progress, then stalls (a frozen worker, a long GC pause) while a newer
    one publishes the first slice. Resumed, it must stop as fenced, never report the progress topic as lost: that
    refusal is not retried and tells the operator to `rowrelay reset` a table whose progress is fine."""
    conf = {"bootstrap.servers": services.kafka_bootstrap}
    channel = TableChannel.for_table(f"overtaken.public.{name}", name)
    paused, resume = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def hold(stage: str) -> None:
        if stage == "progress_read":
            paused.set()
            resume.wait(60)

    def first() -> None:
        try:
            outcome["a"] = SlicePublisher(channel, conf, on_stage=hold).publish(SliceRange(0, 50), _rows(0, 50))
        except Exception as exc:  # noqa: BLE001 - the outcome is asserted below
            outcome["a"] = exc

    a = threading.Thread(target=first)
    a.start()
    assert paused.wait(60), "publisher A never read its progress"
    b = publish_slice(channel, conf, SliceRange(0, 50), _rows(0, 50))
    resume.set()
    a.join(60)
    assert not b.already_committed and b.progress.rows == 50
    assert isinstance(outcome["a"], PublisherFenced), repr(outcome["a"])
    assert sorted(int(m.key) for m in read_topic(services.kafka_bootstrap, name)) == list(range(1, 51))
