"""Every `rowrelay/*` run tag, materialization metadata key and instance key, in one place (no Dagster import).

Tags are read back by sensors, the launcher, hooks and the CLI, so a key is written here once and imported
wherever it is set or read; tests may spell them out, as a user of the tags would."""

from __future__ import annotations

# -- run tags -------------------------------------------------------------------------------------------------
# Set on a run that failed for a reason a retry cannot fix (bad row, source error, fenced): the sensor backs off.
STOPPED_TAG = "rowrelay/stopped"
# On a run that failed at slice k: the first and last of the slices it committed before k, as
# `<run id>/<first>...<last>` (keys in chain order), for the asset's failure hook, which checks their parity
# (assets/checks.py). The run id: Dagster's retry of the run copies its tags, but not what it committed.
COMMITTED_BEFORE_FAILURE_TAG = "rowrelay/committed_before_failure"
# The run's process, as its worker records it for run monitoring.
WORKER_PID_TAG = "rowrelay/worker_pid"
# Where that pid means the run's process: the host name, its boot and the pid namespace (containers on one host can
# share a host name, not a pid namespace).
WORKER_HOST_TAG = "rowrelay/worker_host"
# The run that set them: run retries copy a run's tags, and a retry must not be judged by its parent's dead pid.
WORKER_RUN_TAG = "rowrelay/worker_run"
# The warm launcher's worker: JSON {pid, host, start, server_pid}: what health checks and terminate use.
WARM_WORKER_TAG = "rowrelay/warm_worker"
# A run the CLI's backfill launched (value "cli").
BACKFILL_TAG = "rowrelay/backfill"
# A run the sensor requested to resume slices a failed run left unpublished.
RESUME_TAG = "rowrelay/resume"

# -- materialization metadata -----------------------------------------------------------------------------------
# A slice committed by a run that failed later (its run id): committed all the same.
RUN_FAILED_LATER = "rowrelay/run_failed_later"
# Written by `rowrelay reset` on the slice it superseded, and on the baseline it set.
BEFORE_RESET_OF = "rowrelay/before_reset_of"
PUBLISHED_UP_TO = "rowrelay/published_up_to"
RESET_AFTER = "rowrelay/reset_after"
# Written by `rowrelay replay`.
REPLAY_ID = "rowrelay/replay_id"
# The asset's definition metadata: its watermark column, and the channel load_input finds its slices by.
WATERMARK = "rowrelay/watermark"
CHANNEL_TABLE = "rowrelay/table"
CHANNEL_TOPIC = "rowrelay/topic"
CHANNEL_PROGRESS_TOPIC = "rowrelay/progress_topic"
CHANNEL_TRANSACTIONAL_ID = "rowrelay/transactional_id"
CHANNEL_START_AFTER = "rowrelay/start_after"
CHANNEL_METADATA = (CHANNEL_TABLE, CHANNEL_TOPIC, CHANNEL_PROGRESS_TOPIC, CHANNEL_TRANSACTIONAL_ID,
                    CHANNEL_START_AFTER)


def history_note_key(partitions_name: str) -> str:
    """The instance key under which history compaction notes a partitions definition's last roll-up."""
    return f"rowrelay/history/{partitions_name}"
