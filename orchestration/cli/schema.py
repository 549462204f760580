"""`rowrelay schema accept`: a table's changed columns accepted after on_schema_change: fail stopped it."""

from __future__ import annotations

import argparse
import sys

from assets.identity import channel_for
from orchestration.tables import kafka_conf, reflect_table, select_tables
from resources.config import RelayConfig
from resources.exactly_once import RelayError, SlicePublisher, read_committed_progress
from resources.source_database import SourceError, schema_change


def cmd_schema(config: RelayConfig, args: argparse.Namespace) -> int:
    """`schema accept`: a human accepts the table's current columns after a change stopped it (on_schema_change:
    fail). Recorded in Kafka's progress (the same committed range, the new columns, the reason); progress does not
    move, and the sensor's next retry of the waiting slice publishes with the new columns."""
    (table,) = select_tables(config, args.table)
    try:
        shape = reflect_table(config, table)
    except SourceError as exc:
        print(f"rowrelay: {exc}", file=sys.stderr)
        return 1
    channel = channel_for(table, config.kafka.transactional_id_prefix)
    committed = read_committed_progress(kafka_conf(config), channel)
    if committed is not None and [list(c) for c in committed.columns] == shape.schema_columns:
        # Nothing stops the table for its columns (a run compares these), so a record would only add noise to its
        # progress. Exit 0: what the command is for holds, the current columns are the accepted ones.
        print(f"{table.table_id}: nothing to accept: the table's columns are those of its committed progress (up to "
              f"{shape.watermark_text(committed.hi)}); nothing was recorded", flush=True)
        return 0
    publisher = SlicePublisher(channel, kafka_conf(config))
    try:
        before = committed.columns if committed else []
        record = publisher.accept_schema(shape.schema_columns, shape.fingerprint, args.reason)
    except RelayError as exc:
        print(f"rowrelay: {exc}", file=sys.stderr)
        return 1
    finally:
        publisher.close()
    change = schema_change(before, shape.schema_columns).describe() or "no change"
    print(f"{table.table_id}: columns accepted ({change}); fingerprint {record.schema_fingerprint}; progress stays "
          f"at {shape.watermark_text(record.hi)}", flush=True)
    return 0
