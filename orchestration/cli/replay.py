"""`rowrelay replay`: a committed range republished once more, recorded on the table's asset."""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from typing import Any

from dagster import AssetObservation, DagsterInstance

from assets.identity import asset_key, channel_for
from orchestration.cli.arguments import watermark_kind_error
from orchestration.cli.errors import dagster_home_set
from orchestration.tables import kafka_conf, select_tables
from resources.config import RelayConfig, TableConfig
from resources.errors import RowrelayError
from resources.exactly_once import republish_range
from resources.keys import REPLAY_ID
from resources.slices import is_timestamp_key, watermark_text


def replay_range(config: RelayConfig, table: TableConfig, lo: int, hi: int, topic: str | None) -> dict[str, Any]:
    """Republish the committed messages of the slices covering (lo, hi] to `topic` (default: the table's) in one
    transaction of the table's replay transactional id (`resources.exactly_once.replay`)."""
    prefix = config.kafka.transactional_id_prefix
    return republish_range(channel_for(table, prefix), kafka_conf(config), lo, hi, target=topic or table.topic_name,
                           transactional_id=f"{prefix}.replay.{table.table_id}",
                           kind_error=partial(watermark_kind_error, table.table_id))


def cmd_replay(config: RelayConfig, args: argparse.Namespace) -> int:
    """An explicit, recorded republish of a committed range, for a consumer that lost data."""
    (table,) = select_tables(config, args.table)
    if not dagster_home_set():
        return 1
    with DagsterInstance.get() as instance:
        try:
            done = replay_range(config, table, args.from_, args.to, args.topic)
        except RowrelayError as exc:
            print(f"rowrelay: {exc}", file=sys.stderr)
            return 1
        timestamps = any(map(is_timestamp_key, done["slices"]))
        span = f"({watermark_text(args.from_, timestamps)}, {watermark_text(args.to, timestamps)}]"
        instance.report_runless_asset_event(AssetObservation(
            asset_key=asset_key(table),
            description=f"rowrelay replay {done['replay_id']}: {span} republished to {done['topic']}",
            metadata={REPLAY_ID: done["replay_id"], "from": int(args.from_), "to": int(args.to),
                      "rows": done["rows"], "topic": done["topic"], "slices": len(done["slices"])}))
    if args.json:
        print(json.dumps(done, indent=2))
    else:
        print(f"{table.table_id}: replayed {span} = {len(done['slices'])} slice(s), "
              f"{done['rows']} messages to {done['topic']} with header rowrelay.replay={done['replay_id']}; "
              "progress unchanged", flush=True)
    return 0
