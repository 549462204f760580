"""`rowrelay` command line: verify a topic against its source table, show progress, set up pools.

    rowrelay verify [--table ID] [--json]   # duplicates, missing, extra, order violations; exit 1 on any
    rowrelay status [--table ID] [--json]   # committed progress, source max, lag (rows, seconds), active runs
    rowrelay pools [--table ID]             # create each table's pool (limit 1) on the Dagster instance
    rowrelay backfill --table ID            # cut the backlog into slices and run them now, in this process
    rowrelay reset --table ID --after W     # deliberate new baseline: rows after W are sent, the rest never
    rowrelay replay --table ID --from A --to B [--topic T]
                                            # republish committed slices (A, B] once more, marked rowrelay.replay
    rowrelay history compact [--table ID] [--full]
                                            # roll up old committed slices now (hour, then day): fewer partitions
    rowrelay schema accept --table ID --reason TEXT
                                            # accept a table's changed columns (on_schema_change: fail stopped it)
"""

from __future__ import annotations

import os

# numpy's OpenBLAS starts a thread per core at import, and they spin: CPU time of a backfill on two cores for
# linear algebra rowrelay never does. Before anything imports numpy (the publisher does, once a command loads).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402

from orchestration.cli.arguments import COMMAND_SUMMARIES, build_parser  # noqa: E402
from orchestration.cli.errors import STORAGE_RETRY_LINES, dagster_home_problem, user_error  # noqa: E402
from orchestration.exits import FAILED, INTERRUPTED, USAGE, bound_process_end, finish  # noqa: E402
from resources.config import ConfigError, RelayConfig, load_component_config, load_config  # noqa: E402

Command = Callable[[RelayConfig, argparse.Namespace], int]

# The module of orchestration.cli that holds each command's `cmd_<name>`.
COMMAND_MODULES = {"verify": "verify", "status": "status", "pools": "status", "backfill": "backfill",
                   "reset": "reset", "replay": "replay", "history": "history", "schema": "schema"}


def command(name: str) -> Command:
    """The command `name`, its module imported now, for start-up time: a command's module imports Dagster, the
    assets and the source drivers it needs, so `rowrelay --help` or an argument mistake answers without them, and
    a backfill imports them with the garbage collector off (`end_of_startup`). The one place the CLI imports late."""
    module = importlib.import_module(f"orchestration.cli.{COMMAND_MODULES[name]}")
    return getattr(module, f"cmd_{name}")


def main(argv: list[str] | None = None) -> int:
    """The `rowrelay` command; called without `argv` it is the process (the entry point, `python -m`), whose end it
    bounds (exits.bound_process_end, exits.finish); a caller passing `argv` keeps its own process as it is."""
    own_process = argv is None
    if own_process:
        bound_process_end(next((a for a in sys.argv[1:] if a in COMMAND_SUMMARIES), "rowrelay"))
    code = run_command(argv)
    return finish(code) if own_process else code


def run_command(argv: list[str] | None) -> int:
    args = build_parser(__doc__ or "").parse_args(argv)
    collecting = gc.isenabled()
    if args.cmd == "backfill":
        gc.disable()  # until its startup is over (end_of_startup)
    config = None
    logging.getLogger().addFilter(STORAGE_RETRY_LINES)  # once: the same filter object is not added twice
    try:
        config = load_component_config(args.defs) if args.defs else load_config(args.config)
        if (problem := dagster_home_problem()) is not None:
            raise ConfigError(problem)
        return command(args.cmd)(config, args)
    except KeyboardInterrupt:  # Ctrl-C: not a defect, no traceback (a backfill's runs say what committed)
        print(f"rowrelay: {args.cmd} interrupted", file=sys.stderr)
        return INTERRUPTED
    except ConfigError as exc:
        print(f"rowrelay: {exc}", file=sys.stderr)
        return USAGE
    except Exception as exc:
        message = user_error(exc, config)
        if message is None:
            raise  # a defect: its traceback is what to report
        print(f"rowrelay: {message}", file=sys.stderr)
        return FAILED
    finally:
        if collecting:  # a backfill that ended before its runs (an error, --dry-run, nothing to do)
            gc.enable()


__all__ = ["main", "run_command"]
