"""Names a table gets in Kafka and Dagster from its schema and table names (no Dagster import: the exactly-once
protocol names progress topics with it)."""

from __future__ import annotations

import hashlib
import re

# What both a Kafka topic name and a part of a Dagster asset key accept: the key is free text to Dagster, but its op
# name (AssetKey.to_python_identifier: parts joined by "__", "-" and "." made "_") must follow the name rule.
_PORTABLE = re.compile(r"[A-Za-z0-9_.-]+")
_PORTABLE_REFUSED = re.compile(r"[^A-Za-z0-9_.-]")

# `kafka.transactional_id_prefix` when the config names none: a table's transactional id and progress topic are
# named under it, so everything that reads or writes them must be handed the deployment's prefix, never assume this.
DEFAULT_TRANSACTIONAL_ID_PREFIX = "rowrelay"


def portable_name(name: str) -> str:
    """A schema or table name (or a table id) as a Dagster asset key part or in a Kafka topic name. Unchanged where
    both accept it (existing deployments keep their asset keys, partitions, run history, sensor cursors and topics);
    otherwise each refused character (a space, non-ASCII, $, ...) becomes "_" and a hash of the true name is
    appended, so that "a b" and "a_b" (or "ä" and "ö") never share a name."""
    if _PORTABLE.fullmatch(name):
        return name
    return f"{_PORTABLE_REFUSED.sub('_', name)}_{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def progress_topic_suffix(table: str) -> str:
    """What a table's progress topic ends with under any transactional_id_prefix (`_<prefix>` before it). A table
    id Kafka refuses in a topic name (a space, non-ASCII) is mapped, as its default data topic is."""
    return f".progress.{portable_name(table)}"


def progress_topic_name(prefix: str, table: str) -> str:
    """The table's progress topic under `kafka.transactional_id_prefix` `prefix`."""
    return f"_{prefix}{progress_topic_suffix(table)}"
