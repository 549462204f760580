"""Every stop reason, the errors that set it, and its tags: the values are the STOPPED_TAG texts sensors compare."""

from __future__ import annotations

import pytest

from resources.exactly_once import BadRowError, PublisherFenced, SliceOutOfOrder, TransactionTimedOut
from resources.keys import STOPPED_TAG
from resources.source_database import SchemaChanged, SourceError
from resources.stops import (
    ADVICE,
    RETRY_ON_FAILURE_TAG,
    SkipOfManyRows,
    StopReason,
    inherited_stop_cleared,
    stop_reason,
    stopped_tags,
)


@pytest.mark.parametrize(("exc", "reason"), [
    (TransactionTimedOut("t"), "transaction_timeout"),
    (PublisherFenced("t"), "fenced"),
    (BadRowError("t", table="t", watermark=1), "bad_row"),
    (SchemaChanged("t"), "schema_change"),
    (SkipOfManyRows("t"), "skip_of_many_rows"),
    (SourceError("t"), "source"),
])
def test_an_error_that_stops_a_run_has_its_reason(exc: Exception, reason: str) -> None:
    assert stop_reason(exc) == reason


def test_an_error_a_retry_may_fix_has_none() -> None:
    assert stop_reason(SliceOutOfOrder("t")) is None
    assert stop_reason(RuntimeError("t")) is None


def test_every_reason_has_advice() -> None:
    assert set(ADVICE) == set(StopReason)
    assert StopReason.TIMED_OUT.advice.startswith("the table's sensor")


def test_stop_tags_are_plain_text_and_a_copied_stop_is_cleared() -> None:
    tags = stopped_tags(StopReason.BAD_ROW)
    assert tags == {STOPPED_TAG: "bad_row", RETRY_ON_FAILURE_TAG: "false"}
    assert type(tags[STOPPED_TAG]) is str
    assert inherited_stop_cleared(tags, retry_default=True) == {STOPPED_TAG: "", RETRY_ON_FAILURE_TAG: "true"}
    assert inherited_stop_cleared({}, retry_default=True) == {}
