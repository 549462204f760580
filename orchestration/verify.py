"""`rowrelay verify` of a configured table: the refusals that make a comparison meaningless (a changed
watermark, missing progress), then the comparison itself (resources.verify)."""

from __future__ import annotations

import os
from functools import partial

from dagster import DagsterInstance

from assets.identity import asset_key, channel_for
from assets.records import last_recorded_slice
from orchestration.tables import kafka_conf, reflect_table, table_source
from resources.config import RelayConfig, TableConfig
from resources.exactly_once import (
    progress_missing,
    progress_recorded_refusal,
    read_progress_history,
    refuse_watermark_change,
)
from resources.verify import VerifyReport, verify_channel


def verify_table(config: RelayConfig, table: TableConfig) -> VerifyReport:
    """Compare the topic with the source rows up to the table's committed progress."""
    conf = kafka_conf(config)
    channel = channel_for(table, config.kafka.transactional_id_prefix)
    history = read_progress_history(conf, channel)  # oldest first: the last record is the committed progress
    progress = history[-1] if history else None
    if progress is not None:  # a comparison in another column's (or kind's) sense would be meaningless
        refuse_watermark_change(progress, reflect_table(config, table).watermark_id)
    elif (missing := progress_missing(conf, channel, reflect_table(config, table).timestamps)) is not None:
        raise missing  # its rows were published under progress this table no longer reads: nothing to compare
    elif os.environ.get("DAGSTER_HOME"):  # verify needs no Dagster instance otherwise: then Kafka alone
        # Empty progress and an empty topic, but Dagster may record committed slices: the progress topic lost after
        # the data topic's messages expired. Comparing from start_after to start_after would find nothing and say
        # OK while every run refuses; the run's refusal, with its remedy, says what happened.
        with DagsterInstance.get() as instance:
            recorded = last_recorded_slice(instance, asset_key(table))
        if (refused := progress_recorded_refusal(channel, recorded)) is not None:
            raise refused
    return verify_channel(conf, channel, table, history, partial(table_source, config, table))
