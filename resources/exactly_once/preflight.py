"""Checks before a table publishes: progress missing, recorded elsewhere, taken back or shared."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from resources.exactly_once.errors import ProgressMissing, ProgressShared
from resources.exactly_once.progress_log import progress_under_other_prefix, read_progress_history
from resources.exactly_once.readback import table_messages_high_watermark
from resources.exactly_once.records import ProgressRecord, TableChannel
from resources.slices import SliceRange, watermark_text


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
    None otherwise. No Kafka call: the publisher, a dry run, `status` and the lag check all ask this, so they refuse
    alike."""
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
    """`topic_taken_back` of the table's committed progress, for the publisher and a cut (`plan_cut`: a dry run
    refuses where the backfill would, and a backfill before it adds partitions). Reads the progress history only
    when the committed progress names another topic than the channel's (between a `topic:` change and the first
    commit after it)."""
    if not committed.topic or committed.topic == channel.topic:
        return None
    return topic_taken_back(channel, committed, read_progress_history(kafka_conf, channel, timeout))
