"""Why a run stopped for good: the STOPPED_TAG values, the errors that set each, and what a human does next.

A stopped run is one a retry cannot fix: the asset or the Kafka IO manager tags it (`stopped_tags`), the table's
sensor backs off from it and Dagster's run retries leave it. Tags and tests compare the plain strings, so each
value is the tag's text."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

from resources.exactly_once import (
    BadRowError,
    BaselineMissing,
    ProducerSettingsError,
    ProgressMissing,
    ProgressShared,
    PublisherFenced,
    SliceRowsMismatch,
    TopicSettingsError,
    TransactionTimedOut,
    WatermarkChanged,
)
from resources.keys import STOPPED_TAG
from resources.source_database import SchemaChanged, SourceError


class SkipOfManyRows(SourceError):
    """A `skip_watermarks` entry matches more than one row: a skip leaves out one row, never its neighbours."""


class StopReason(StrEnum):
    """A STOPPED_TAG value."""

    SOURCE = "source"
    SCHEMA_CHANGE = "schema_change"
    SKIP_OF_MANY_ROWS = "skip_of_many_rows"
    BAD_ROW = "bad_row"
    TIMED_OUT = "transaction_timeout"
    PROGRESS_MISSING = "progress_missing"
    BASELINE_MISSING = "baseline_missing"
    PRODUCER_SETTINGS = "producer_settings"
    TOPIC_SETTINGS = "topic_settings"
    ROWS_MISMATCH = "rows_mismatch"
    FENCED = "fenced"
    WATERMARK_CHANGED = "watermark_changed"
    PROGRESS_SHARED = "progress_shared"

    @property
    def advice(self) -> str:
        """What to do after a run stopped for this reason (the sensor's skip message, a failed backfill)."""
        return ADVICE[self]


# Dagster's documented run tag: a run that fails with it "false" is not re-executed by run retries
# (dagster.yaml run_retries), which would otherwise repeat a stopped run five times.
RETRY_ON_FAILURE_TAG = "dagster/retry_on_asset_or_op_failure"


def stopped_tags(reason: str) -> dict[str, str]:
    """The tags of a run stopped for `reason`: the sensor backs off, and Dagster's run retries leave it."""
    return {STOPPED_TAG: str(reason), RETRY_ON_FAILURE_TAG: "false"}


def inherited_stop_cleared(tags: Mapping[str, str], retry_default: bool) -> dict[str, str]:
    """Tags that undo a stop a run copied from the run it re-executes (the UI's Re-execute copies the parent's
    tags): the run has not stopped, so the sensor must not back off from it as stopped, and Dagster's run retries
    treat it as the instance says (`retry_default`: dagster.yaml run_retries.retry_on_asset_or_op_failure). Dagster
    cannot delete a run tag; an empty STOPPED_TAG means not stopped. Empty when nothing was copied."""
    if not tags.get(STOPPED_TAG):
        return {}
    return {STOPPED_TAG: "", RETRY_ON_FAILURE_TAG: "true" if retry_default else "false"}


# The errors that stop a run, each with its reason; the first that matches wins.
STOP_REASONS: tuple[tuple[type[Exception], StopReason], ...] = (
    (TransactionTimedOut, StopReason.TIMED_OUT),  # before PublisherFenced: the coordinator's abort looks like one
    (ProgressMissing, StopReason.PROGRESS_MISSING),
    (BaselineMissing, StopReason.BASELINE_MISSING),
    (ProducerSettingsError, StopReason.PRODUCER_SETTINGS),
    (TopicSettingsError, StopReason.TOPIC_SETTINGS),
    (SliceRowsMismatch, StopReason.ROWS_MISMATCH),
    (PublisherFenced, StopReason.FENCED),
    (WatermarkChanged, StopReason.WATERMARK_CHANGED),
    (ProgressShared, StopReason.PROGRESS_SHARED),
    (BadRowError, StopReason.BAD_ROW),
    (SchemaChanged, StopReason.SCHEMA_CHANGE),
    (SkipOfManyRows, StopReason.SKIP_OF_MANY_ROWS),
    (SourceError, StopReason.SOURCE),  # after its subclasses above
)
STOPPING_ERRORS: tuple[type[Exception], ...] = tuple(cls for cls, _ in STOP_REASONS)


def stop_reason(exc: BaseException) -> StopReason | None:
    """Why `exc` stops its run for good; None: a retry may fix it."""
    return next((reason for cls, reason in STOP_REASONS if isinstance(exc, cls)), None)


ADVICE: dict[StopReason, str] = {
    StopReason.SCHEMA_CHANGE: "the table's columns changed and `on_schema_change: fail` stops it: check the change, "
                              "then `rowrelay schema accept --table ID --reason ...` and run it again",
    StopReason.BASELINE_MISSING: "the slice was cut before `start_after: latest`: the next tick (or `rowrelay "
                                 "backfill`) records the baseline and deletes such slices; nothing to do",
    StopReason.FENCED: "another publisher of the table took over (the daemon's run or a backfill): it publishes the "
                       "slices; nothing is lost",
    StopReason.BAD_ROW: "fix the row (or list its watermark in `skip_watermarks`) and run it again",
    StopReason.SKIP_OF_MANY_ROWS: "a bare `skip_watermarks` value matches several rows: name the one row as the "
                                  "run's message shows and run it again",
    StopReason.SOURCE: "fix what the run's message names and run it again",
    StopReason.ROWS_MISMATCH: "the source's rows changed under the read: see the run's message, fix the cause, and "
                              "run it again",
    StopReason.PROGRESS_MISSING: "see docs/operations.md (\"A table dropped and re-created\": progress missing) "
                                 "before anything runs again",
    StopReason.PRODUCER_SETTINGS: "fix `kafka.producer` as the run's message says and run it again",
    StopReason.TOPIC_SETTINGS: "fix the topic's settings (or the table's `key:`) as the run's message says and run "
                               "it again",
    StopReason.PROGRESS_SHARED: "two deployments share the table's progress: give each its own "
                                "`kafka.transactional_id_prefix` (or `rowrelay reset` if `topic:` was moved back on "
                                "purpose; see the run's message)",
    StopReason.WATERMARK_CHANGED: "the table's watermark column or its type changed since its progress was recorded: "
                                  "put it back, or set where the new one stands with `rowrelay reset` (see the run's "
                                  "message)",
    StopReason.TIMED_OUT: "the table's sensor (with the daemon) cuts the slice smaller and runs it again; without it, "
                          "lower `slice_max_rows` or raise `transaction.timeout.ms`",
}
