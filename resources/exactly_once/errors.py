"""Errors the protocol raises, and the advice they carry."""

from __future__ import annotations

import json

from resources.errors import RowrelayError
from resources.slices import SliceRange, watermark_text


class RelayError(RowrelayError):
    """Base class: a slice could not be published. The message says what to do."""


class SliceOutOfOrder(RelayError):
    """The slice does not start where the table's committed progress ends."""

    @classmethod
    def at(cls, table: str, slice_range: SliceRange, committed_hi: int, then: str = "") -> SliceOutOfOrder:
        """Why the slice cannot commit where the progress ends: a gap before it, or progress inside it."""
        at = watermark_text(committed_hi, slice_range.timestamps)
        if committed_hi < slice_range.lo:
            return cls(f"{table}: slice {slice_range} cannot commit yet: committed progress ends at {at}, "
                       f"so the slice ({at}, {watermark_text(slice_range.lo, slice_range.timestamps)}] must commit "
                       f"first{then}")
        return cls(f"{table}: slice {slice_range} can never commit as cut: committed progress ends at {at}, "
                   "inside it (a reset, or a racing cut); the sensor or the next `rowrelay backfill` deletes it and "
                   f"cuts the range again from {at} once no run of the table is active")


class PublisherFenced(RelayError):
    """A newer publisher took over this table's transactional id; this one must stop."""


def skip_advice(entry: str) -> str:
    """How a stop message tells a user to leave a row out: the one place its wording lives (`BadRowError.naming`
    finds it by this text)."""
    return f"leave the row out with skip_watermarks: [{entry}]"


class BadRowError(RelayError):
    """A row cannot be sent (too large, unserializable). Nothing of the slice is visible.

    `entry`: the skip_watermarks entry the message suggests (`skip_advice`), by the row's watermark alone; the
    table's run names the row itself where others share its watermark (`naming`). `value`: the row's message, where
    known (a row too large), so that its tie_break or key can be read from it; `tie`: its tie_break's text, where
    the read that stopped at it named it."""

    def __init__(self, message: str, *, table: str, watermark: int | None, column: str | None = None,
                 entry: str | None = None, value: bytes | None = None, tie: str | None = None) -> None:
        super().__init__(message)
        self.table = table
        self.watermark = watermark
        self.column = column
        self.entry = entry
        self.value = value
        self.tie = tie

    def naming(self, advice: str) -> BadRowError:
        """The same error, its skip advice replaced by `advice` (one that names the row, not only its value)."""
        if self.entry is None or skip_advice(self.entry) not in str(self):
            return self
        return BadRowError(str(self).replace(skip_advice(self.entry), advice), table=self.table,
                           watermark=self.watermark, column=self.column, entry=self.entry, value=self.value,
                           tie=self.tie)


class SliceRowsMismatch(RelayError):
    """The rows read for a slice are not the rows the source counts in it: the read lost or gained rows, so the
    slice is aborted before its progress record. Nothing of it is visible and progress does not move."""


class KafkaUnavailable(RelayError):
    """Transient: the broker did not answer in time. Retrying later is safe."""


class ProducerSettingsError(RelayError):
    """The producer settings (kafka.producer) cannot work; a retry fails the same way until they are changed."""


class KafkaAuthenticationError(ProducerSettingsError):
    """The broker refused the client's login (SASL credentials, mechanism, TLS settings): not transient."""


class TransactionTimedOut(RelayError):
    """The slice's transaction outlived transaction.timeout.ms: Kafka aborted it. Nothing of it is visible."""


class ProgressMissing(RelayError):
    """The table's committed progress is empty, yet its data topic already holds its messages."""

    def __init__(self, message: str, *, table: str, topic_watermark: int) -> None:
        super().__init__(message)
        self.table = table
        self.topic_watermark = topic_watermark  # the highest watermark of the table already in the topic


class SliceMessagesGone(RelayError):
    """A committed slice's recorded offsets hold other messages of its table: its data topic was re-created."""


class BaselineMissing(RelayError):
    """A `start_after: latest` table has no baseline in its progress yet: a slice cut before it (under another
    `start_after`) would send the history `latest` skips."""


class ProgressShared(RelayError):
    """The table's progress moved to another topic and back: two deployments share it under one
    transactional_id_prefix, each skipping the rows the other sent."""


class WatermarkChanged(RelayError):
    """The table's watermark is another column, or another kind of column, than the one its committed progress was
    measured in: the progress value would be read in another sense, sending rows again or skipping rows for good."""


def largest_field(value: bytes) -> str | None:
    """The field of a JSON message whose value takes the most bytes: names the column behind a too-large row."""
    try:
        obj = json.loads(value)
    except ValueError:
        return None
    if isinstance(obj, dict) and isinstance(obj.get("data"), dict) and "op" in obj:
        obj = obj["data"]  # envelope
    if not isinstance(obj, dict) or not obj:
        return None
    return max(obj, key=lambda k: len(json.dumps(obj[k])))


def _column_hint(value: bytes | None) -> tuple[str | None, str]:
    column = largest_field(value) if value is not None else None
    return column, (f", mostly column {column!r}" if column else "")


class _AbortAndRedo(Exception):
    """Internal: the transaction must be aborted and the slice sent again."""


class _CommitUnknown(Exception):
    """Internal: commit_transaction failed without telling whether the transaction committed (`outcome_unknown`)."""


# The last refused login per bootstrap address. librdkafka reports a failed SASL/TLS login only to error_cb
# (served by poll()); the call that needed the broker just times out as "Broker transport failure".


class TopicSettingsError(RelayError):
    """A topic that exists with settings the table cannot be relayed with; a retry fails the same way."""
