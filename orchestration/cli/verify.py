"""`rowrelay verify`: each table's topic compared with its source rows, as text or JSON; exit 1 on any difference."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from orchestration.cli.errors import each_table
from orchestration.tables import select_tables
from orchestration.verify import verify_table
from resources.config import RelayConfig


def cmd_verify(config: RelayConfig, args: argparse.Namespace) -> int:
    reports, failed = each_table(config, select_tables(config, args.table), lambda t: verify_table(config, t),
                                 "not verified")
    if args.json:
        print(json.dumps([{**asdict(r), "ok": r.ok} for r in reports], indent=2))
    else:
        for r in reports:
            print(f"{r.table} -> {r.topic}: committed up to {r.text(r.committed_hi)}, {r.source_rows} source rows, "
                  f"{r.messages} messages; duplicates {r.duplicates}, missing {r.missing}, extra {r.extra}, "
                  f"order violations {r.order_violations} [{'OK' if r.ok else 'FAIL'}]")
            if r.compared_from_record:
                print(f"  compared from {r.text(r.compared_from)} ({r.compared_from_record}); {r.before_start} "
                      "messages at or below it left out")
            if r.skipped_rows:
                print(f"  {r.skipped_rows} source rows skipped (skip_watermarks, as each slice recorded): not sent, "
                      "by design")
            if r.rows_by_tie_break:
                print(f"  {r.rows_by_tie_break} source rows share a watermark value: compared by tie_break too "
                      "(a fingerprint per value; row by row where one differs)")
            if r.tie_break_unchecked:
                print(f"  rows sharing a watermark value compared by count only: {r.tie_break_unchecked}")
            if r.replayed or r.other_messages:
                print(f"  left out: {r.replayed} replayed copies, {r.other_messages} messages of other tables or "
                      "producers")
            for kind, values in r.examples.items():
                shown = values if r.watermark_kind == "integer" else ", ".join(map(r.text, values))
                print(f"  {kind}: e.g. watermarks {shown}")
    return 0 if all(r.ok for r in reports) and not failed else 1
