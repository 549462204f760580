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
from resources.exactly_once import KafkaReads, Purpose, preflight, read_progress_history
from resources.slices import SliceRange
from resources.verify import VerifyReport, verify_channel


def _recorded_slice(table: TableConfig) -> SliceRange | None:
    """The highest slice Dagster recorded as committed for the table."""
    with DagsterInstance.get() as instance:
        return last_recorded_slice(instance, asset_key(table))


def verify_table(config: RelayConfig, table: TableConfig) -> VerifyReport:
    """Compare the topic with the source rows up to the table's committed progress."""
    conf = kafka_conf(config)
    channel = channel_for(table, config.kafka.transactional_id_prefix)
    history = read_progress_history(conf, channel)  # oldest first: the last record is the committed progress
    shape = reflect_table(config, table)
    # A comparison in another column's (or kind's) sense would be meaningless; rows published under progress this
    # table no longer reads leave nothing to compare. Empty progress and an empty topic, but Dagster may record
    # committed slices: the progress topic lost after the data topic's messages expired. Comparing from start_after
    # to start_after would find nothing and say OK while every run refuses; the run's refusal, with its remedy, says
    # what happened. Verify needs no Dagster instance otherwise: then Kafka alone.
    recorded = partial(_recorded_slice, table) if os.environ.get("DAGSTER_HOME") else None
    if (refused := preflight(Purpose.VERIFY, history[-1] if history else None, channel, watermark=shape.watermark_id,
                             timestamps=shape.timestamps, recorded=recorded, kafka=KafkaReads.of(conf))) is not None:
        raise refused
    return verify_channel(conf, channel, table, history, partial(table_source, config, table))
