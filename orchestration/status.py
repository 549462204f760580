"""`rowrelay status` of a configured table: its lag behind the source and its active runs."""

from __future__ import annotations

import os

from dagster import DagsterInstance, RunsFilter

from assets.identity import asset_key, channel_for
from assets.lag import TableLag, measure_lag
from assets.records import last_recorded_slice
from orchestration.factory import first_run_at, job_name
from orchestration.instance import runs_of_table
from orchestration.runs import ACTIVE
from orchestration.tables import kafka_conf
from resources.config import RelayConfig, TableConfig
from resources.exactly_once import Purpose, preflight, read_committed_progress
from resources.source_database import SourceDatabaseResource


def active_runs(tables: list[TableConfig]) -> dict[str, int] | None:
    """Queued or running runs per table on the Dagster instance, of its job or the UI's Materialize (as `reset`
    counts them); None without DAGSTER_HOME."""
    if not os.environ.get("DAGSTER_HOME"):
        return None
    with DagsterInstance.get() as instance:
        active = instance.get_runs(RunsFilter(statuses=ACTIVE))
        return {t.table_id: len(runs_of_table(active, t, job_name(t))) for t in tables}


def table_status(config: RelayConfig, table: TableConfig) -> TableLag:
    channel = channel_for(table, config.kafka.transactional_id_prefix)
    progress = read_committed_progress(kafka_conf(config), channel)
    first_run = recorded = None
    if progress is None and os.environ.get("DAGSTER_HOME"):  # as the lag check measures a table never committed
        with DagsterInstance.get() as instance:
            first_run = first_run_at(instance, table)
            # Slices Dagster recorded as committed over empty progress: the run refuses, so status says why.
            recorded = last_recorded_slice(instance, asset_key(table))
        # measure_lag counts no lag before a `latest` baseline; over those slices the cut refuses it (`cut`).
        if (refused := preflight(Purpose.STATUS, progress, channel, recorded=recorded)) is not None:
            raise refused
    source = SourceDatabaseResource.for_source(config.sources[table.source])
    try:
        # Progress missing over rows already published is raised, as `verify` does: the next run refuses too.
        return measure_lag(source, table, progress, channel.start_after, first_run,
                           published=(kafka_conf(config), channel), recorded=recorded)
    finally:
        source.dispose()
