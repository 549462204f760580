"""Whether a table may be cut, published, checked or verified: its refusals (progress missing, recorded elsewhere,
taken back or shared, a changed watermark, a missing baseline), decided once by `preflight` for every caller."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from resources.exactly_once.errors import (
    BaselineMissing,
    ProgressMissing,
    ProgressShared,
    PublisherFenced,
    RelayError,
    WatermarkChanged,
)
from resources.exactly_once.progress_log import (
    progress_under_other_prefix,
    read_committed_progress,
    read_progress_history,
)
from resources.exactly_once.readback import table_messages_high_watermark
from resources.exactly_once.records import ProgressRecord, TableChannel, watermark_change
from resources.slices import SliceRange, watermark_text


class Purpose(Enum):
    """What the caller is about to do with the table; `checks` says what each asks before it."""

    CUT = "cut"  # the cut planner: a backfill, the sensor, a dry run
    PUBLISH = "publish"  # the publisher, once it has fenced every other
    CHECK = "check"  # the lag check and its sensor
    STATUS = "status"  # `rowrelay status`, before it measures the lag (CHECK)
    VERIFY = "verify"  # `rowrelay verify`, before it compares

    @property
    def checks(self) -> Checks:
        return _CHECKS[self]


@dataclass(frozen=True)
class Checks:
    """The refusals a purpose asks for beyond the ones every purpose asks (a changed watermark where the caller
    names it, Dagster's recorded slices over empty progress where it gives them). The Kafka reads happen only where
    the caller passes `kafka` (a dry run that does not refuse, a publisher that already asked, a lag without Kafka)."""

    published: bool  # empty progress: were the table's rows published all the same (`progress_missing`)?
    overtaken: bool  # ... and if so, did a newer publisher commit since the empty progress was read?
    shared: bool  # committed progress for another topic: taken back from another deployment (`progress_shared`)?
    baseline: bool  # a slice of a `start_after: latest` table over empty progress: its baseline comes first
    recorded_before_baseline_only: bool = False  # Dagster's slices asked only of a table awaiting its baseline


_CHECKS = {
    Purpose.CUT: Checks(published=True, overtaken=False, shared=True, baseline=False),
    Purpose.PUBLISH: Checks(published=True, overtaken=True, shared=True, baseline=True),
    Purpose.CHECK: Checks(published=True, overtaken=False, shared=False, baseline=False),
    # Before the lag (CHECK) asks Kafka: a table awaiting its `latest` baseline over Dagster's slices is refused as
    # the cut refuses its baseline, whatever the data topic holds.
    Purpose.STATUS: Checks(published=False, overtaken=False, shared=False, baseline=False,
                           recorded_before_baseline_only=True),
    Purpose.VERIFY: Checks(published=True, overtaken=False, shared=False, baseline=False),
}


@dataclass(frozen=True)
class KafkaReads:
    """What `preflight` asks Kafka, as callables: a caller adds what it knows (the lag check's cache), a test passes
    fakes."""

    published: Callable[[TableChannel, bool], ProgressMissing | None]  # `progress_missing` of (channel, timestamps)
    history: Callable[[TableChannel], Sequence[ProgressRecord]]  # the progress records, oldest first
    committed: Callable[[TableChannel], ProgressRecord | None]  # the committed progress, read now
    pause: Callable[[float], None] = time.sleep

    @classmethod
    def of(cls, kafka_conf: dict[str, Any], timeout: float = 30.0) -> KafkaReads:
        return cls(published=lambda ch, timestamps: progress_missing(kafka_conf, ch, timestamps, timeout),
                   history=lambda ch: read_progress_history(kafka_conf, ch, timeout),
                   committed=lambda ch: read_committed_progress(kafka_conf, ch))


def preflight(purpose: Purpose, committed: ProgressRecord | None, channel: TableChannel | None = None, *,
              watermark: tuple[str, str] | None = None, timestamps: bool = False,
              recorded: SliceRange | Callable[[], SliceRange | None] | None = None,
              kafka: KafkaReads | None = None, publishing: SliceRange | None = None) -> RelayError | None:
    """The refusal that stops `purpose` for the table, or None: the caller raises it (or reports it). `committed`:
    the table's committed progress (None: empty); `channel`: its Kafka channel (None: a lag measured without Kafka,
    which checks the committed progress alone); `watermark`: the (column, kind) the caller reads the table by, where
    it knows it; `timestamps`: the watermark is a time (the remedies name one); `recorded`: the highest slice the
    orchestrator recorded as committed, or a callable asked only after Kafka's answer (a Dagster instance);
    `kafka`: None where Kafka must not be asked; `publishing`: the slice about to be published."""
    checks = purpose.checks
    if committed is not None:
        if watermark is not None and (why := watermark_change(committed, *watermark)):
            return WatermarkChanged(why)
        if checks.shared and kafka is not None and channel is not None:
            return _shared(channel, committed, kafka)
        return None
    if channel is None:
        return None
    if checks.published and kafka is not None and (missing := kafka.published(channel, timestamps)) is not None:
        return (_overtaken(channel, kafka) if checks.overtaken else None) or missing
    if not checks.recorded_before_baseline_only or channel.baseline_required:
        slice_range = recorded() if callable(recorded) else recorded
        if (missing := progress_recorded_refusal(channel, slice_range)) is not None:
            return missing
    if checks.baseline and publishing is not None and channel.baseline_required:
        # Cut before `start_after` became `latest`: the whole history would be sent.
        return BaselineMissing(
            f"{channel.table}: start_after is latest, and no baseline is recorded yet: slice "
            f"{publishing} was cut before (under another start_after) and would send rows `latest` skips. "
            "Nothing was sent; the table's sensor (or `rowrelay backfill`) records the baseline at the "
            "newest final row and deletes such slices")
    return None


def _shared(channel: TableChannel, committed: ProgressRecord, kafka: KafkaReads) -> ProgressShared | None:
    """`topic_taken_back` of the committed progress; the history is read only when the committed progress names
    another topic than the channel's (between a `topic:` change and the first commit after it)."""
    if not committed.topic or committed.topic == channel.topic:
        return None
    return topic_taken_back(channel, committed, kafka.history(channel))


def _overtaken(channel: TableChannel, kafka: KafkaReads) -> PublisherFenced | None:
    """The empty progress a publisher read is stale when a newer publisher fenced it and committed since (this one
    stalled in between): the messages in the topic are that one's, and this one stops as fenced. Read a few times:
    the commit marker on the progress partition may follow the data partitions' by a moment."""
    for attempt in range(3):
        if (now := kafka.committed(channel)) is not None:
            return PublisherFenced(
                f"{channel.table}: another publisher took over transactional id {channel.transactional_id} "
                f"and committed progress up to {now.hi_text} since this one read it; this one stops without "
                "publishing")
        if attempt < 2:
            kafka.pause(1.0)
    return None


def progress_missing(kafka_conf: dict[str, Any], channel: TableChannel, timestamps: bool = False,
                     timeout: float = 30.0) -> ProgressMissing | None:
    """For a table whose committed progress is empty: the refusal if its rows were published all the same (its data
    topic holds its messages, or another transactional_id_prefix's progress topic holds its progress), so that
    publishing would send them again; None if nothing of it was published. `timestamps`: the table's watermark is
    a time, so the remedy names one (`rowrelay reset --after` refuses a time's microseconds)."""
    ch = channel
    in_topic = table_messages_high_watermark(kafka_conf, ch, timeout)
    if in_topic is not None and in_topic > ch.start_after:
        at = watermark_text(in_topic, timestamps)
        return ProgressMissing(
            f"{ch.table}: committed progress is empty (progress topic {ch.progress_topic}, transactional id "
            f"{ch.transactional_id}), but topic {ch.topic} already holds this table's messages up to watermark "
            f"{at}: publishing would send them again. Restore the old transactional_id_prefix if it was "
            f"changed, or run `rowrelay reset --table {ch.table} --after {at}` to set a new baseline "
            f"deliberately ({at} is the last watermark of this table already in the topic; a lower value "
            "sends rows again: only for a re-created table whose ids restarted)",
            table=ch.table, topic_watermark=in_topic)
    if in_topic is None and (elsewhere := progress_under_other_prefix(kafka_conf, ch, timeout)) is not None:
        # The prefix and the topic changed together: the new topic is empty, but the table has committed progress
        # under the old prefix.
        name, record = elsewhere
        at = record.hi_text
        return ProgressMissing(
            f"{ch.table}: committed progress is empty (progress topic {ch.progress_topic}, transactional id "
            f"{ch.transactional_id}), but progress topic {name} holds this table's committed progress up to "
            f"watermark {at} (its rows went to topic {record.topic}): publishing would send them again. "
            "Restore the transactional_id_prefix that wrote it if it was changed, or run `rowrelay reset "
            f"--table {ch.table} --after {at}` to continue from there under this prefix (a lower value, "
            "`--after 0` included, sends rows again deliberately: another deployment of the same table)",
            table=ch.table, topic_watermark=record.hi)
    return None


def progress_recorded_refusal(channel: TableChannel, recorded: SliceRange | None) -> ProgressMissing | None:
    """For a table whose committed progress is empty: the refusal if the orchestrator recorded slices of it as
    committed above `start_after` (`recorded`: the highest, e.g. Dagster's materializations), since publishing would
    send them again (the progress topic deleted after the data topic's messages expired: Kafka shows nothing);
    None otherwise. No Kafka call: `preflight` asks it for every purpose, so they refuse alike."""
    ch = channel
    if recorded is None or recorded.hi <= ch.start_after:
        return None
    at = watermark_text(recorded.hi, recorded.timestamps)
    return ProgressMissing(
        f"{ch.table}: committed progress is empty (progress topic {ch.progress_topic}), but the slices of "
        f"this table recorded as committed reach watermark {at} (Dagster's materializations): the progress "
        "topic was deleted or its records expired, and the data topic no longer shows those rows, so "
        f"publishing would send them again. Run `rowrelay reset --table {ch.table} --after {at}` to continue "
        "after them (a lower value, `--after 0` included, sends rows again deliberately: a new cluster or "
        "topic meant to get the whole table); nothing was sent", table=ch.table, topic_watermark=recorded.hi)


def topic_taken_back(channel: TableChannel, committed: ProgressRecord, history: Sequence[ProgressRecord]
                     ) -> ProgressShared | None:
    """The refusal if the table's progress was last written for another topic after earlier records of this
    channel's topic (`history`: the progress records, oldest first, `committed` the newest). A `topic:` change moves
    a table once (the new topic gets the rows after it); progress going back and forth is two deployments (staging
    and production on one cluster) sharing one transactional_id prefix with their own topics: each would continue
    from the other's progress and skip the rows the other had sent, with every backfill exiting 0."""
    ch = channel
    if not committed.topic or committed.topic == ch.topic or not any(r.topic == ch.topic for r in history[:-1]):
        return None
    at = committed.hi_text
    return ProgressShared(
        f"{ch.table}: its committed progress was last written for topic {committed.topic} (slice "
        f"{committed.slice}, committed {committed.committed_at}), after earlier slices of this run's topic "
        f"{ch.topic}: two deployments relaying this table under one transactional id ({ch.transactional_id}) "
        "take turns, each skipping the rows the other sent. Give each deployment its own "
        "kafka.transactional_id_prefix. If `topic:` was moved back on purpose, run `rowrelay reset --table "
        f"{ch.table} --after {at}` to continue in {ch.topic} from there; nothing was sent")


def progress_shared(kafka_conf: dict[str, Any], channel: TableChannel, committed: ProgressRecord,
                    timeout: float = 30.0) -> ProgressShared | None:
    """`topic_taken_back` of the table's committed progress, read from Kafka (`preflight` asks it of a publish and a
    cut)."""
    return _shared(channel, committed, KafkaReads.of(kafka_conf, timeout))
