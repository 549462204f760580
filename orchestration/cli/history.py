"""`rowrelay history compact`: the slice-history policy applied now."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from dagster import DagsterInstance

from orchestration.compaction import iter_compact
from orchestration.tables import kafka_conf, select_tables
from resources.config import RelayConfig


def cmd_history(config: RelayConfig, args: argparse.Namespace) -> int:
    """`history compact`: apply the slice-history policy now (the history sensor does it every few minutes).
    `--full` reads the whole progress topic (what the sensor does on a table's first compaction)."""
    tables = select_tables(config, args.table)
    with DagsterInstance.get() as instance:
        results = []
        for result in iter_compact(instance, tables, kafka_conf(config), config.kafka.transactional_id_prefix,
                                   full=args.full):
            results.append(result)
            if not args.json:
                print(result.line(), flush=True)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    return 0
