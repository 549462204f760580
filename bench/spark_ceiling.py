"""The Spark ceiling: a table read through rowrelay's own slice path into Python, without Kafka.

The run's own read (`build_table_slices`: reflection and table check, the slice's count, then its chunks through
`SparkResource.read_slice` and the JSON/key expressions of `message_columns`) and the same chunked
read-ahead into produce-ready Arrow batches (`ReadAhead`) as a run, then nothing: what Spark can deliver on this
machine, for `make bench` to set rowrelay's end-to-end figure against.

    python -m bench.spark_ceiling --url URL --table public.t --rows N [--remote sc://...]

Prints one JSON line: {"rows", "seconds" (process launch -> last row in Python), "read_seconds" (the read
alone, after imports and the Spark connection)}.

With `--publish-table ID` the rows also go to Kafka exactly as a run publishes them (`SlicePublisher`: the run's
publisher, its C produce loop and one transaction with the progress record of table ID; its topics and fencing
made while Spark connects), without Dagster: no instance, no run, no cut. `make bench` times it to visibility
like a backfill, to show what the orchestration around the same read and publish costs.
"""

from __future__ import annotations

import time

LAUNCHED = time.monotonic()  # before the heavy imports below: the figure is from process launch, like a run's

import gc  # noqa: E402

gc.disable()  # as `rowrelay backfill` starts (orchestration/cli.py, end_of_startup): no collection until the read

import os  # noqa: E402

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as orchestration/cli.py sets it before numpy loads

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from concurrent.futures import Future, ThreadPoolExecutor  # noqa: E402

from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX  # noqa: E402


def read_all(url: str, table: str, rows: int, remote: str | None, master: str,
             publish_table: str | None = None, bootstrap: str | None = None) -> tuple[int, float]:
    from assets.identity import channel_for
    from assets.relay import build_table_slices
    from orchestration.backfill import end_of_startup
    from resources.config import TableConfig
    from resources.exactly_once import SlicePublisher, TableChannel
    from resources.kafka_io_manager import KafkaIOManager
    from resources.slice_reads import ReadAhead
    from resources.slices import SliceRange
    from resources.source_database import SourceDatabaseResource
    from resources.spark import SparkResource

    starting: tuple[SlicePublisher, Future[None]] | None = None  # the publisher and its topics and fencing
    if publish_table:
        # As a backfill's early read does: topics and fencing while Spark connects, not after the read starts.
        publisher = SlicePublisher(TableChannel.for_table(publish_table, publish_table, prefix=PREFIX),
                                   {"bootstrap.servers": bootstrap})
        pool = ThreadPoolExecutor(max_workers=1)
        starting = publisher, pool.submit(publisher.init)
        pool.shutdown(wait=False)  # not waiting: the init runs on while Spark connects
    spark = SparkResource(remote=remote) if remote else SparkResource(master=master)
    source = SourceDatabaseResource(url=url)
    config = TableConfig(source="bench", table=table, watermark="id", key=["id"])
    # The run's own read (build_table_slices: table check, then per slice its count and chunked Spark reads).
    slices = build_table_slices(source, spark, config, channel_for(config, PREFIX), [SliceRange(0, rows)], 0)
    spark.get_session()
    end_of_startup()  # what startup built stays out of later collections, as in a backfill
    # The IO manager's defaults: the ceiling reads in the same chunks with the same read-ahead as a run.
    defaults = KafkaIOManager.model_fields
    chunk_rows, prefetch = defaults["chunk_rows"].default, defaults["prefetch_chunks"].default
    started = time.monotonic()
    assert slices.read is not None
    frame = slices.read(slices.pending[0])
    ahead = ReadAhead([frame], chunk_rows, prefetch)
    count = 0
    try:
        if starting is not None:
            publisher, init = starting
            init.result(timeout=60)  # raises its own error, if it failed
            count = publisher.publish(slices.pending[0], lambda: ahead.batches(frame)).progress.rows
        else:
            for batch in ahead.batches(frame):
                count += len(batch)
    finally:
        ahead.close()
        source.dispose()
        if starting is not None:
            starting[0].close()
    return count, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--table", required=True, help="schema.table, watermark column id")
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--remote", default=None, help="Spark Connect URL (default: a local session)")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--publish-table", default=None, help="also publish the rows as table ID's slice (0, rows]")
    parser.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers for --publish-table")
    args = parser.parse_args(argv)
    count, read_seconds = read_all(args.url, args.table, args.rows, args.remote, args.master, args.publish_table,
                                   args.bootstrap)
    print(json.dumps({"rows": count, "seconds": round(time.monotonic() - LAUNCHED, 3),
                      "read_seconds": round(read_seconds, 3)}))
    return 0 if count == args.rows else 1


if __name__ == "__main__":
    sys.exit(main())
