"""The exactly-once protocol between a table's slices and Kafka. Deliberately free of Dagster.

One table has one *channel*: a data topic, a single-partition compacted progress topic of its own and
one stable ``transactional.id``. Publishing a slice is:

1. ``init_transactions()``: takes a new producer epoch for the table. Kafka aborts (or finishes) any
   transaction a previous instance left open and fences that instance: its next produce/commit fails.
2. Read the table's committed progress, read_committed. Because (1) came first, no older transaction of
   ours can still change it, and because the progress topic belongs to this table alone, no other
   table's open transaction holds its last stable offset.
3. Progress already at or beyond the slice's ``hi`` -> the slice is committed: publish nothing.
   Progress not equal to the slice's ``lo`` -> an earlier slice is missing: refuse (slices commit in
   watermark order, so a gap can never be skipped).
4. One transaction: every row of the slice in watermark order, flush, then the progress record (with
   the offsets the rows got), then commit. Rows and progress become visible together or not at all.

A crash anywhere before the commit leaves nothing visible; a crash after it leaves the progress record
saying so, and the retry publishes nothing. Kafka, not the orchestrator, is the record of what was sent.
Any error raised while a transaction is open aborts it before it propagates: an open transaction holds the
topic's last stable offset, so every read_committed reader of the topic would wait for it. A commit that gets no
answer is the exception: neither aborted nor called again, its producer is fenced by a fresh one, and the progress
read after that says whether the slice committed.

Modules: `errors`, `clients` (Kafka client plumbing, failpoints), `records` (channels, progress records), `batches`
(messages and headers), `topics` (the only creator and checker of topics), `progress_log` (every read of a progress
topic), `readback` (published slices read back by their offsets), `preflight` (refusals before publishing),
`transaction` and `slice_rows` (one transaction and its rows), `publisher`, and `replay`. This package re-exports the
names callers use.
"""

from __future__ import annotations

from resources.exactly_once.batches import (
    REPLAY_HEADER,
    TABLE_HEADER,
    WATERMARK_HEADER,
    MessageBatch,
    OutgoingMessage,
    SliceDigest,
    message_watermark,
    slice_checksum,
    table_message_watermark,
)
from resources.exactly_once.clients import (
    DEFAULT_TRANSACTION_TIMEOUT_MS,
    FAST_READS,
    READ_BATCH,
    RETRIABLE_CALL_S,
    STAGES,
    StageHook,
    base_conf,
    broker_max_transaction_timeout_ms,
    call_retrying,
    env_failpoint,
    list_topics,
    outcome_unknown,
    transaction_timeout_ms,
    unreachable,
    with_error_cb,
)
from resources.exactly_once.errors import (
    BadRowError,
    BaselineMissing,
    KafkaAuthenticationError,
    KafkaUnavailable,
    ProducerSettingsError,
    ProgressMissing,
    ProgressShared,
    PublisherFenced,
    RelayError,
    SliceMessagesGone,
    SliceOutOfOrder,
    SliceRowsMismatch,
    TopicSettingsError,
    TransactionTimedOut,
    WatermarkChanged,
    largest_field,
    skip_advice,
)
from resources.exactly_once.preflight import (
    KafkaReads,
    Purpose,
    preflight,
    progress_missing,
    progress_recorded_refusal,
    progress_shared,
    topic_taken_back,
)
from resources.exactly_once.progress_log import (
    ProgressTail,
    ProgressTopicReader,
    find_slice_progress,
    partition_watermarks,
    progress_under_other_prefix,
    read_committed_progress,
    read_progress_history,
    read_progress_tail,
    read_records,
    records_in_range,
    tiles_by_range,
)
from resources.exactly_once.publisher import (
    SlicePublisher,
    publish_slice,
)
from resources.exactly_once.readback import (
    READ_BACK_GAP,
    PublishedSlice,
    messages_gone,
    pieces_in_range,
    read_back_slice,
    read_back_slices,
    read_piece_messages,
    read_published_messages,
    slice_reader,
    table_messages_high_watermark,
)
from resources.exactly_once.records import (
    BASELINE_PREFIX,
    KIND_TEXTS,
    RESET_PREFIX,
    START_MARK_KEYS,
    START_MARK_PREFIXES,
    LivePiece,
    ProgressRecord,
    PublishResult,
    ResetOutcome,
    TableChannel,
    live_pieces,
    live_records,
    recorded_watermark_kind,
    refuse_watermark_change,
    tiling,
    watermark_change,
    watermark_fields,
)
from resources.exactly_once.replay import (
    REPLAY_COMMIT_TIMEOUT_S,
    KindError,
    ReplayError,
    replay_records,
    replay_unknown_text,
    republish_range,
)
from resources.exactly_once.slice_rows import (
    SliceRows,
)
from resources.exactly_once.topics import (
    TOPICS_FIT_TTL_S,
    TopicsReady,
    ensure_topics,
    topic_end_offsets,
)
from resources.exactly_once.transaction import (
    Transaction,
)

__all__ = [
    "BASELINE_PREFIX",
    "BadRowError",
    "BaselineMissing",
    "DEFAULT_TRANSACTION_TIMEOUT_MS",
    "FAST_READS",
    "KIND_TEXTS",
    "KafkaAuthenticationError",
    "KafkaUnavailable",
    "KafkaReads",
    "KindError",
    "LivePiece",
    "MessageBatch",
    "OutgoingMessage",
    "ProducerSettingsError",
    "ProgressMissing",
    "ProgressRecord",
    "ProgressShared",
    "ProgressTail",
    "ProgressTopicReader",
    "PublishResult",
    "PublishedSlice",
    "PublisherFenced",
    "Purpose",
    "READ_BACK_GAP",
    "READ_BATCH",
    "REPLAY_COMMIT_TIMEOUT_S",
    "REPLAY_HEADER",
    "RESET_PREFIX",
    "RETRIABLE_CALL_S",
    "RelayError",
    "ReplayError",
    "ResetOutcome",
    "STAGES",
    "START_MARK_KEYS",
    "START_MARK_PREFIXES",
    "SliceDigest",
    "SliceMessagesGone",
    "SliceOutOfOrder",
    "SlicePublisher",
    "SliceRows",
    "SliceRowsMismatch",
    "StageHook",
    "TABLE_HEADER",
    "TOPICS_FIT_TTL_S",
    "TableChannel",
    "TopicSettingsError",
    "TopicsReady",
    "Transaction",
    "TransactionTimedOut",
    "WATERMARK_HEADER",
    "WatermarkChanged",
    "base_conf",
    "broker_max_transaction_timeout_ms",
    "call_retrying",
    "ensure_topics",
    "env_failpoint",
    "find_slice_progress",
    "largest_field",
    "list_topics",
    "live_pieces",
    "live_records",
    "message_watermark",
    "messages_gone",
    "outcome_unknown",
    "partition_watermarks",
    "pieces_in_range",
    "preflight",
    "progress_missing",
    "progress_recorded_refusal",
    "progress_shared",
    "progress_under_other_prefix",
    "publish_slice",
    "read_back_slice",
    "read_back_slices",
    "read_committed_progress",
    "read_piece_messages",
    "read_progress_history",
    "read_progress_tail",
    "read_published_messages",
    "read_records",
    "recorded_watermark_kind",
    "records_in_range",
    "refuse_watermark_change",
    "replay_records",
    "replay_unknown_text",
    "republish_range",
    "skip_advice",
    "slice_checksum",
    "slice_reader",
    "table_message_watermark",
    "table_messages_high_watermark",
    "tiles_by_range",
    "tiling",
    "topic_end_offsets",
    "topic_taken_back",
    "transaction_timeout_ms",
    "unreachable",
    "watermark_change",
    "watermark_fields",
    "with_error_cb",
]
