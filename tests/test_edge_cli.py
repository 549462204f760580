"""Edges of the CLI: a `start_after: latest` table whose progress topic was lost, a backfill of a
trickle-batched table, a replay whose commit timed out, a replay after the data topic was re-created, and
slices cut before `start_after: latest`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import confluent_kafka
import pytest
from confluent_kafka import KafkaError, KafkaException

from orchestration.cli import main
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.slices import SliceRange
from tests.pipeline import Harness, assert_exactly_once, read_topic, relay_config
from tests.test_cli import tables_sharing_a_topic
from tests.test_cli_refusals import config_file_for, lag_check_result, lose_progress_and_messages, serial_table

pytestmark = pytest.mark.integration


# --------------------------------------------------------------------------- a `latest` table's progress lost


def test_a_latest_tables_progress_lost_after_its_messages_expired_is_refused_not_given_a_new_baseline(
        services, pg_database, pg_engine, dagster_home, dagster_instance, spark, name, tmp_path, capsys,
        monkeypatch) -> None:
    """A `start_after: latest` table relayed up to 5, then its progress topic deleted once the data topic's messages
    had aged out, and rows 6-7 written: the next tick (and `rowrelay backfill`) recorded a new baseline at 7, so
    rows 6-7 were never sent and nothing said so. Dagster's record of the committed slices
    refuses it now, as for any table, with the same remedy; a fresh sensor cursor no longer deletes the committed
    slices' partitions as orphans either."""

    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    serial_table(pg_engine, name, 3)
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}",
                                                         "watermark": "id", "start_after": "latest"}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    assert h.baseline(table).hi == 3
    serial_table(pg_engine, name, 2, start=4)
    assert h.drain(table, until_hi=5) == [SliceRange(3, 5).key]
    lose_progress_and_messages(services, table)
    serial_table(pg_engine, name, 2, start=6)  # rows 6-7: a baseline at 7 would skip them
    partitions = f"{table.dagster_name}__slices"
    keys = dagster_instance.get_dynamic_partitions(partitions)
    refusal = ("slices of this table recorded as committed reach watermark 5 (Dagster's materializations)",
               f"rowrelay reset --table {table.table_id} --after 5")

    def refused_tick() -> str:
        with pytest.raises(Exception) as ticked:
            h.tick(table)
        return str(ticked.value)

    said = refused_tick()  # the sensor, with its cursor
    if "Unknown topic or partition" in said:  # the process's progress reader saw its topic go: read afresh next
        said = refused_tick()
    assert all(part in said for part in refusal), said
    assert h.progress(table) is None
    h.cursors.pop(table.table_id)  # a fresh cursor: the committed slices' partitions are not orphans to delete
    said = refused_tick()
    assert all(part in said for part in refusal), said
    assert dagster_instance.get_dynamic_partitions(partitions) == keys

    config_file = config_file_for(cfg, tmp_path / "c.yaml")
    capsys.readouterr()
    for dry in (["--dry-run"], []):
        assert main(["--config", config_file, "backfill", "--table", table.table_id, *dry]) == 1, dry
        out, err = capsys.readouterr()
        assert all(part in err for part in refusal), (dry, out, err)
    assert main(["--config", config_file, "status", "--table", table.table_id]) == 1
    err = capsys.readouterr().err
    assert all(part in err for part in refusal), err
    assert h.progress(table) is None
    assert dagster_instance.get_dynamic_partitions(partitions) == keys
    assert read_topic(services.kafka_bootstrap, table.topic_name, timeout=2) == []
    # The lag check refuses too (it passed as "awaiting_baseline" over the gap).
    from dagster import AssetCheckSeverity

    result = lag_check_result(h, table, dagster_instance)
    assert not result.passed and result.severity == AssetCheckSeverity.ERROR, result.description
    assert all(part in (result.description or "") for part in refusal), result.description

    # The remedy named: continue after 5, and rows 6-7 are sent.
    assert main(["--config", config_file, "reset", "--table", table.table_id, "--after", "5", "--reason",
                 "progress topic lost"]) == 0
    assert main(["--config", config_file, "backfill", "--table", table.table_id]) == 0
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), [6, 7])


# --------------------------------------------------------------------------- a backfill of a trickle-batched table


def test_a_backfill_cuts_final_rows_of_a_trickle_batched_table_at_once(
        services, pg_database, pg_engine, dagster_home, dagster_instance, spark, name, tmp_path, capsys,
        monkeypatch) -> None:
    """`min_slice_rows: 1000` with 200 final rows: the sensor holds them back (trickle batching), and so did the
    backfill, which shares its cut: it waited out --settle-timeout, warned that the rows were not final ("a
    transaction ... is open", false) and exited 0 having published nothing. A backfill is an
    explicit "publish now": it cuts every final row at once, and warns only of rows that are not final."""
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    serial_table(pg_engine, name, 200)
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}",
                                                         "watermark": "id", "min_slice_rows": 1000,
                                                         "max_slice_delay_seconds": 3600}])
    table = cfg.tables[0]
    h = Harness(cfg, dagster_instance)
    assert h.tick(table) == []  # the sensor still batches: 200 rows wait for 1000 (or an hour)
    assert dagster_instance.get_dynamic_partitions(f"{table.dagster_name}__slices") == []
    config_file = config_file_for(cfg, tmp_path / "c.yaml")
    capsys.readouterr()
    started = time.monotonic()
    assert main(["--config", config_file, "backfill", "--table", table.table_id, "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "1 new slice(s) would be cut; 1 slice(s) would be published" in out, (out, err)
    assert "not final" not in out + err, (out, err)
    assert main(["--config", config_file, "backfill", "--table", table.table_id]) == 0
    out, err = capsys.readouterr()
    elapsed = time.monotonic() - started
    assert "not final" not in out + err, (out, err)
    assert "1 new slice(s) cut; 1 slice(s) to publish" in out, (out, err)
    assert elapsed < 45, f"{elapsed:.0f} s: the backfill waited for trickle batching"
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), list(range(1, 201)))
    assert h.progress(table).hi == 200
    assert h.tick(table) == []  # the sensor's next tick finds nothing more to cut


# --------------------------------------------------------------------------- a replay whose commit timed out


def _relayed_200(services, pg_database, pg_engine, dagster_instance, dagster_home, name: str, tmp_path: Path,
                 monkeypatch) -> tuple[Any, str]:
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    serial_table(pg_engine, name, 200)
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}", "watermark": "id",
                                                         "slice_max_rows": 100}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    h.drain(table, until_hi=200)
    return table, config_file_for(cfg, tmp_path / "c.yaml")


class _QuickCommit(confluent_kafka.Producer):
    """The real producer on the real broker, but its commit given no time to wait: librdkafka answers _TIMED_OUT
    (retriable) and goes on committing in the background, as it does when a commit outlives its timeout in
    production. (Given 1 ms, a commit whose messages were already delivered often completes in time.)"""

    made: list[_QuickCommit] = []
    answers: list[int | None] = []

    def __init__(self, conf: dict[str, Any]) -> None:
        super().__init__(conf)
        _QuickCommit.made.append(self)

    def commit_transaction(self, *args: Any) -> None:
        try:
            super().commit_transaction(0)
        except KafkaException as exc:
            _QuickCommit.answers.append(exc.args[0].code())
            raise
        _QuickCommit.answers.append(None)


def _quick_commits(monkeypatch) -> type[_QuickCommit]:
    """From now on, producers made through `confluent_kafka.Producer` (the replay imports it when it runs)."""
    _QuickCommit.made, _QuickCommit.answers = [], []
    monkeypatch.setattr(confluent_kafka, "Producer", _QuickCommit)
    return _QuickCommit


def _replayed(bootstrap: str, topic: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for m in read_topic(bootstrap, topic):
        if "rowrelay.replay" in m.headers:
            out.setdefault(m.headers["rowrelay.replay"].decode(), []).append(m.watermark)
    return out


def test_a_replay_whose_commit_times_out_calls_it_again_and_succeeds(
        services, pg_database, pg_engine, dagster_home, dagster_instance, spark, name, tmp_path, capsys,
        monkeypatch) -> None:
    """commit_transaction timed out (retriable: the commit goes on in the background); the replay tried to abort,
    which librdkafka refuses then, and said "nothing was replayed, run the replay again": run
    again, the range went out twice. The commit is now called again on a retriable error, as the publisher does."""
    table, config_file = _relayed_200(services, pg_database, pg_engine, dagster_instance, dagster_home, name,
                                      tmp_path, monkeypatch)
    quick_commit = _quick_commits(monkeypatch)
    capsys.readouterr()
    code = main(["--config", config_file, "replay", "--table", table.table_id, "--from", "0", "--to", "200"])
    out, err = capsys.readouterr()
    assert KafkaError._TIMED_OUT in quick_commit.answers, quick_commit.answers  # the commit did time out
    assert code == 0, (out, err)
    assert "replayed (0, 200]" in out, out
    replays = _replayed(services.kafka_bootstrap, table.topic_name)
    assert len(replays) == 1 and next(iter(replays.values())) == list(range(1, 201)), replays


def test_a_replay_whose_commit_outcome_is_unknown_says_so_not_nothing_was_replayed(
        services, pg_database, pg_engine, dagster_home, dagster_instance, spark, name, tmp_path, capsys,
        monkeypatch) -> None:
    """The commit still timed out after its retries (here: no time for any): its outcome is unknown, as the commit
    may complete in the background, and here it does. "nothing was replayed, run the replay again" was false; the
    message now says the outcome is unknown and which replay id to look for before running it again."""
    from resources.exactly_once import clients

    table, config_file = _relayed_200(services, pg_database, pg_engine, dagster_instance, dagster_home, name,
                                      tmp_path, monkeypatch)
    monkeypatch.setattr(clients, "RETRIABLE_CALL_S", 0.0)  # one call, no retry
    quick_commit = _quick_commits(monkeypatch)
    capsys.readouterr()
    code = main(["--config", config_file, "replay", "--table", table.table_id, "--from", "0", "--to", "200"])
    out, err = capsys.readouterr()
    assert quick_commit.answers == [KafkaError._TIMED_OUT], quick_commit.answers
    assert code == 1, (out, err)
    assert "nothing was replayed" not in err, err
    assert "outcome unknown" in err and "before running the replay again" in err, err
    # Wait for the background commit (as the broker would finish it), then the id the message named is there.
    confluent_kafka.cimpl.Producer.commit_transaction(quick_commit.made[0], 30)
    replays = _replayed(services.kafka_bootstrap, table.topic_name)
    assert len(replays) == 1, replays
    replay_id, watermarks = next(iter(replays.items()))
    assert f"rowrelay.replay={replay_id}" in err and f"topic {table.topic_name}" in err, err
    assert watermarks == list(range(1, 201))


# ------------------------------------------------------------- a replay after the data topic was re-created


def test_a_replay_after_the_data_topic_was_recreated_refuses_the_messages_now_at_those_offsets(
        services, pg_database, pg_engine, dagster_home, dagster_instance, spark, name, tmp_path, capsys,
        monkeypatch) -> None:
    """Ids 1-200 relayed, the data topic deleted, the next runs re-create it and relay 201-400 at offsets 0-199
    again: `rowrelay replay --from 0 --to 100` read slice (0, 100]'s recorded offsets, found the count it expected
    and replayed ids 201-300 as that range, exit 0. A message outside the slice's range at its
    offsets now stops the replay, nothing produced; `load_input` and `slice_parity` read through the same check."""
    from confluent_kafka.admin import AdminClient

    from resources.exactly_once import SliceMessagesGone, read_published_messages

    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    serial_table(pg_engine, name, 200)
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}",
                                                         "watermark": "id", "slice_max_rows": 100, "key": ["id"]}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    h.drain(table, until_hi=200)
    first = h.progress(table)
    admin = AdminClient({"bootstrap.servers": services.kafka_bootstrap})
    admin.delete_topics([table.topic_name])[table.topic_name].result(timeout=30)
    deadline = time.monotonic() + 30
    while table.topic_name in admin.list_topics(timeout=10).topics:
        assert time.monotonic() < deadline, "the data topic was not deleted"
        time.sleep(0.2)
    serial_table(pg_engine, name, 200, start=201)
    h.drain(table, until_hi=400)  # the first run re-creates the topic
    assert [m.watermark for m in read_topic(services.kafka_bootstrap, table.topic_name)] == list(range(201, 401))

    config_file = config_file_for(cfg, tmp_path / "c.yaml")
    capsys.readouterr()
    assert main(["--config", config_file, "replay", "--table", table.table_id, "--from", "0", "--to", "100"]) == 1
    err = capsys.readouterr().err
    assert "the topic no longer holds the slice's messages" in err and "watermark 201" in err, err
    assert not [m for m in read_topic(services.kafka_bootstrap, table.topic_name) if "rowrelay.replay" in m.headers]
    with pytest.raises(SliceMessagesGone):  # what load_input and slice_parity read through
        list(read_published_messages({"bootstrap.servers": services.kafka_bootstrap}, first))

    # Deleted again and left empty: `verify` tells the rows missing. The offsets its slices name are not in the
    # log, so it does not wait for them as for another producer's open transaction (`TopicHeldOpen`).
    from confluent_kafka.admin import NewTopic

    from orchestration.verify import verify_table

    admin.delete_topics([table.topic_name])[table.topic_name].result(timeout=30)
    deadline = time.monotonic() + 30
    while True:
        try:
            admin.create_topics([NewTopic(table.topic_name, 1, 1)])[table.topic_name].result(timeout=30)
            break
        except KafkaException:  # still being deleted
            assert time.monotonic() < deadline, "the data topic could not be created again"
            time.sleep(0.5)
    report = verify_table(cfg, table)
    assert not report.ok and report.messages == 0 and report.missing == 400, report


# ------------------------------------------------------------- `start_after: latest` set over slices a run is using


def test_a_backfill_beside_a_running_run_deletes_the_slices_cut_before_start_after_latest(
        services, pg_database, pg_engine, dagster_home, dagster_instance, spark, name, tmp_path, capsys,
        monkeypatch) -> None:
    """Slices cut from 0, then `start_after: latest`, and a backfill while a run of the table is running: the
    backfill recorded the baseline but, beside an active run, deleted nothing, and no later tick did (they lie
    below the baseline, where only committed slices are looked for): a run of one then materialized "already
    committed" for rows never sent. They go with the baseline now: no run can publish them."""
    from dagster import DagsterRunStatus
    from dagster._core.test_utils import create_run_for_test  # Dagster's own test helper: a run in a given state

    from orchestration.factory import job_name

    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    serial_table(pg_engine, name, 30)
    spec = {"source": "src", "table": f"public.{name}", "watermark": "id", "slice_max_rows": 10}
    first = Harness(relay_config(services, {"src": pg_database}, [spec]), dagster_instance)
    assert first.cut(first.table()) == [f"{SliceRange(0, 10).key}...{SliceRange(20, 30).key}"]  # one run, never run
    cfg = relay_config(services, {"src": pg_database}, [{**spec, "start_after": "latest"}])
    table = cfg.tables[0]
    running = create_run_for_test(dagster_instance, job_name=job_name(table), status=DagsterRunStatus.STARTED)
    try:
        assert main(["--config", config_file_for(cfg, tmp_path / "c.yaml"), "backfill", "--table",
                     table.table_id]) == 0
    finally:
        dagster_instance.report_run_canceled(running)
    progress = Harness(cfg, dagster_instance).progress(table)
    assert progress is not None and (progress.slice, progress.hi) == ("baseline-30", 30)
    assert dagster_instance.get_dynamic_partitions(f"{table.dagster_name}__slices") == []
    assert read_topic(services.kafka_bootstrap, table.topic_name) == []


def test_verify_waits_for_another_tables_open_transaction_in_a_shared_topic(
        services, pg_database, pg_engine, dagster_instance, name) -> None:
    """Tables A and B share a topic; B's slice has its transaction open while A commits one. read_committed, no
    consumer sees A's slice until B's transaction ends: `verify` of A read the topic only that far and reported A's
    committed rows missing, exit 1. It now waits for the topic to show every committed slice of
    the table, and says what holds it if that does not come in time."""
    import threading

    from sqlalchemy import text

    from assets.identity import channel_for
    from orchestration.verify import verify_table
    from resources.exactly_once import OutgoingMessage, SlicePublisher
    from resources.verify.topic import TopicHeldOpen, topic_watermarks

    cfg = tables_sharing_a_topic(services, pg_database, pg_engine, name, rows=(10, 0), slice_max_rows=10)
    harness = Harness(cfg, dagster_instance)
    a, b = cfg.tables
    harness.drain(a, until_hi=10)

    # B's publisher mid-slice: one message produced in its open transaction.
    conf = {"bootstrap.servers": services.kafka_bootstrap}
    release, started = threading.Event(), threading.Event()

    def batches():
        yield [OutgoingMessage(b'{"id":1}', b'{"id":1,"v":"b"}', 1)]
        started.set()
        release.wait(120)
        yield [OutgoingMessage(b'{"id":2}', b'{"id":2,"v":"b"}', 2)]

    publisher = SlicePublisher(channel_for(b, PREFIX), conf)
    writer = threading.Thread(target=publisher.publish, args=(SliceRange(0, 2), batches), daemon=True)
    writer.start()
    try:
        assert started.wait(60)
        time.sleep(1.0)  # B's message is in the topic, uncommitted
        with pg_engine.begin() as conn:
            conn.execute(text(f"INSERT INTO {name}_a SELECT g, 'v' FROM generate_series(11, 20) g"))
        harness.drain(a, until_hi=20)  # A's second slice commits behind B's open transaction

        # Not told missing: held, and said so.
        with pytest.raises(TopicHeldOpen, match=rf"{name}\[0\] is readable \(read_committed\) only up to offset \d+, "
                                                r"below the committed messages .*a transaction of another producer "
                                                r"is open there .*try again once it ends"):
            topic_watermarks(conf, name, a.table_id, timeout=2,
                             committed_ends={0: harness.progress(a).offsets["0"][1] + 1})
        # verify waits for it: B's transaction ends meanwhile, and A is whole.
        threading.Timer(2.0, release.set).start()
        report = verify_table(cfg, a)
        assert report.ok and report.messages == 20 and report.other_messages == 2, report
    finally:
        release.set()
        writer.join(60)
        publisher.close()
