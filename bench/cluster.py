"""rowrelay's runs on clusters, beside the same runs on the stack's single box:
- the one-slice run on a two-worker Spark standalone cluster, beside the same slice on the stack's `local[2]`
  Connect server (the memory part's run): rows per second and how many executors ran the read's tasks, as Spark's
  REST API counts them;
- the 1M-row backfill in 1M-row slices to a private three-node Kafka cluster with a production cluster's settings
  (replication 3, `min.insync.replicas=2`), beside the single broker's (the rowrelay part's median).

On one two-core machine the cluster's executors or brokers share the cores the single box has to itself: the
figures say what the cluster path costs here, not what a cluster of real machines gains.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

from bench.run import Stack, load_table, log, run_rowrelay
from stack.kafka_cluster import start_cluster
from stack.local import free_ports
from stack.spark_cluster import attached_cluster

WORKERS = 2
WARM_ROWS = 200_000  # an untimed slice first: the executors' JVMs start and compile the read, as local[2]'s had


def cluster_slice(stack: Stack, table: str, rows: int, workdir: Path) -> dict[str, Any]:
    """`table`'s `rows` as one slice, read through a Connect server on a private cluster of WORKERS workers."""
    warm = f"{table}_warm"
    load_table(stack, warm, WARM_ROWS)
    with attached_cluster(workdir / "spark-cluster", WORKERS) as spark:
        log(f"cluster: an untimed {WARM_ROWS:,}-row slice first, on {WORKERS} workers through {spark.remote}")
        run_rowrelay(stack, warm, WARM_ROWS, WARM_ROWS, workdir, "clusterwarm", spark_remote=spark.remote)
        log(f"cluster: {rows:,}-row slice on {WORKERS} workers")
        before = spark.tasks_by_executor()
        run = run_rowrelay(stack, table, rows, rows, workdir, "cluster", spark_remote=spark.remote)
        after = spark.tasks_by_executor()
        run["tasks_by_executor"] = {e: n - before.get(e, 0) for e, n in after.items() if n > before.get(e, 0)}
        run["executors_used"] = len(run["tasks_by_executor"])
        run["workers"] = WORKERS
    with stack.connect() as conn:
        conn.execute(f"DROP TABLE IF EXISTS {warm}")
    return run


def kafka_cluster_backfill(stack: Stack, table: str, rows: int, slice_rows: int, workdir: Path) -> dict[str, Any]:
    """`table`'s backfill (`rows`, in `slice_rows` slices) to a private three-node Kafka cluster."""
    ports = free_ports(6)
    base = workdir / "kafka-cluster"
    shutil.rmtree(base, ignore_errors=True)  # a fresh cluster each run: its nodes are formatted anew
    cluster = start_cluster(base, ports[:3], ports[3:])
    try:
        log(f"kafka cluster: {rows:,} rows in {slice_rows:,}-row slices to {cluster.bootstrap}")
        run = run_rowrelay(dataclasses.replace(stack, bootstrap=cluster.bootstrap), table, rows, slice_rows, workdir,
                           "kcluster")
        run["brokers"] = len(cluster.nodes)
    finally:
        cluster.kill_all()
    return run
