"""The `rowrelay` command's arguments: its subcommands, and the types of the values they take."""

from __future__ import annotations

import argparse
from math import isfinite

from resources.slices import micros_text, parse_watermark

COMMAND_SUMMARIES = {
    "verify": "compare a topic with its source table: duplicates, missing, extra, order; exit 1 on any",
    "status": "committed progress, source max, lag and active runs of each table",
    "pools": "create each table's pool (limit 1) on the Dagster instance",
    "backfill": "cut the backlog into slices and run them now, in this process",
    "reset": "set a deliberate new baseline: rows after it are sent, the rest never",
    "replay": "republish committed slices once more, marked rowrelay.replay",
    "history": "roll up old committed slices now: fewer partitions",
    "schema": "accept a table's changed columns after on_schema_change: fail stopped it",
}


def build_parser(description: str) -> argparse.ArgumentParser:
    """The `rowrelay` command's arguments: one subcommand per `COMMAND_SUMMARIES` entry."""
    parser = argparse.ArgumentParser(prog="rowrelay", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    settings = parser.add_mutually_exclusive_group()
    settings.add_argument("--config", help="rowrelay.yaml (default: $ROWRELAY_CONFIG or ./rowrelay.yaml)")
    settings.add_argument("--defs", metavar="PATH", help="a Dagster project's defs.yaml (or its folder) declaring "
                          "the rowrelay component: its attributes instead of rowrelay.yaml")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, summary in COMMAND_SUMMARIES.items():
        p = sub.add_parser(name, help=summary, description=summary)
        if name == "schema":
            p.add_argument("action", choices=["accept"], help="accept: record the table's current columns after a "
                           "change stopped it (on_schema_change: fail)")
            p.add_argument("--table", required=True, help="<source>.<schema>.<table>")
            p.add_argument("--reason", required=True, help="why the change is fine (kept in the progress record)")
        elif name == "history":
            p.add_argument("action", choices=["compact"], help="compact: roll up old committed slices now")
            p.add_argument("--table", help="<source>.<schema>.<table> (default: all)")
            p.add_argument("--full", action="store_true", help="read the whole progress topic (first compaction "
                           "of an existing deployment); default: the last few days")
        elif name == "replay":
            p.add_argument("--table", required=True, help="<source>.<schema>.<table>")
            p.add_argument("--from", dest="from_", metavar="FROM", required=True, type=watermark,
                           help="lower bound (exclusive): a committed slice's lower bound (a time for a timestamp "
                           "watermark, e.g. 2026-11-23T07:00:00Z)")
            p.add_argument("--to", required=True, type=watermark,
                           help="upper bound (inclusive): a committed slice's upper bound")
            p.add_argument("--topic", help="an existing topic to replay to (default: the table's topic)")
        elif name == "reset":
            p.add_argument("--table", required=True, help="<source>.<schema>.<table>")
            p.add_argument("--after", required=True, type=watermark, help="the new baseline: rows with watermark > "
                           "AFTER are sent, rows at or below it never (a time for a timestamp watermark)")
            p.add_argument("--reason", default="manual reset", help="recorded with the reset")
            p.add_argument("--force", action="store_true", help="reset even while runs of the table are active")
        elif name == "backfill":
            p.add_argument("--table", required=True, help="<source>.<schema>.<table>")
            p.add_argument("--dry-run", action="store_true",
                           help="say what would be cut and published; change nothing (no partition, no baseline)")
            p.add_argument("--settle-timeout", type=seconds, default=60.0,
                           help="seconds to wait, beyond the table's settle_seconds, for the newest rows to become "
                           "final (open transactions end); default 60")
        else:
            p.add_argument("--table", help="<source>.<schema>.<table> (default: all)")
        if name in ("verify", "status", "replay", "history"):
            p.add_argument("--json", action="store_true", help="machine-readable output for scripts")
    return parser


class WatermarkArg(int):
    """A watermark given on the command line, remembering whether it was written as a time: `--after 2026-01-01`
    on an integer watermark is a mistake to refuse, not the integer 1767225600000000 (after which no row would ever
    be sent), and `--after 1764547200` on a timestamp watermark is not 1970-01-01T00:29:24.547200Z."""

    text: str
    is_time: bool


def watermark(text: str) -> WatermarkArg:
    """argparse type: an integer watermark or an ISO-8601 time (its error message names both)."""
    try:
        value = WatermarkArg(parse_watermark(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    value.text, value.is_time = text, not _is_integer(text)
    return value


def seconds(text: str) -> float:
    """argparse type: a duration in seconds, 0 or more and finite (a negative wait has no meaning; NaN and
    infinity never end one)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds >= 0")
    return value


def _is_integer(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def watermark_kind_error(table_id: str, timestamps: bool, flag: str, value: int) -> str | None:
    """The refusal for a watermark written as the other kind than the table's (a time for an integer watermark, an
    integer for a timestamp one); None when it matches, or when it was not given on the command line."""
    if not isinstance(value, WatermarkArg) or value.is_time == timestamps:
        return None
    if timestamps:
        try:
            meaning = f"would be {micros_text(value)}"
        except (OverflowError, ValueError):
            meaning = "is past any time"
        return (f"{table_id}: {flag} {value.text} is an integer, but the table's watermark is a timestamp: give a "
                f"time such as 2026-11-23T07:00:00Z (read as microseconds since 1970, {value.text} {meaning})")
    return (f"{table_id}: {flag} {value.text} is a time, but the table's watermark is an integer: give an integer "
            f"(the time would be read as {int(value)})")
