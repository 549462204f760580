"""`rowrelay verify` finds duplicates, gaps, extras and order violations (and passes a clean topic)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from sqlalchemy import text

from orchestration.cli import main
from orchestration.verify import verify_table
from resources.config import RelayConfig, TableConfig
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from tests.pipeline import Harness, drained_then_moved_to_another_prefix, read_topic, relay_config, topic_names

pytestmark = pytest.mark.integration


def _inject(bootstrap: str, table: TableConfig, watermark: int | None) -> None:
    """A message in the table's topic as the table's publisher would send it (its two headers), or, with
    `watermark` None, a message with no rowrelay headers at all."""
    headers = [] if watermark is None else [("rowrelay.table", table.table_id.encode()),
                                            ("rowrelay.watermark", str(watermark).encode())]
    p = Producer({"bootstrap.servers": bootstrap})
    p.produce(table.topic_name, value=b'{"id": %d}' % (watermark or 0), headers=headers)
    p.flush(10)


def _relayed(services, pg_database, pg_engine, dagster_instance, name: str, rows: str, hi: int
             ) -> tuple[RelayConfig, Harness, TableConfig]:
    """Table `name` with the ids `SELECT g FROM <rows>` gives, relayed in 100-row slices up to watermark `hi`."""
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} SELECT g, 'v' FROM {rows}"))
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}", "watermark": "id",
                                                         "slice_max_rows": 100}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    h.drain(table, until_hi=hi)
    return cfg, h, table


def test_verify_reports_each_kind_of_defect(services, pg_database, pg_engine, dagster_instance, spark, name,
                                            tmp_path, capsys) -> None:
    cfg, _, table = _relayed(services, pg_database, pg_engine, dagster_instance, name,
                             "generate_series(1, 300) g WHERE g <> 150", 300)
    clean = verify_table(cfg, table)
    assert clean.ok and clean.source_rows == clean.messages == 299 and clean.committed_hi == 300

    config_file = tmp_path / "rowrelay.yaml"
    import yaml

    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    assert main(["--config", str(config_file), "verify"]) == 0
    assert "[OK]" in capsys.readouterr().out

    with pg_engine.begin() as conn:  # a row appearing below committed progress: a gap in the topic
        conn.execute(text(f"INSERT INTO {name} VALUES (150, 'late')"))
    _inject(services.kafka_bootstrap, table, 42)     # a duplicate, and out of order
    _inject(services.kafka_bootstrap, table, 99999)  # a message no source row explains
    report = verify_table(cfg, table)
    assert (report.duplicates, report.missing, report.extra) == (1, 1, 1)
    assert report.order_violations == 1
    assert report.examples["missing"] == [150] and report.examples["duplicates"] == [42]
    assert main(["--config", str(config_file), "verify", "--json"]) == 1


def test_verify_leaves_out_slices_committed_while_it_reads(services, pg_database, pg_engine, dagster_instance,
                                                           spark, name, monkeypatch) -> None:
    """On a live pipeline a slice can commit after verify read the progress and before it read the topic: its rows
    are not extra (they came with their progress record); a message above the progress read afterwards still is."""
    import resources.verify.table as cli

    cfg, h, table = _relayed(services, pg_database, pg_engine, dagster_instance, name, "generate_series(1, 100) g", 100)
    read_topic = cli.topic_watermarks

    def commit_a_slice_first(conf: dict, topic: str, table_id: str, **kwargs: Any) -> cli.TopicWatermarks:
        with pg_engine.begin() as conn:
            conn.execute(text(f"INSERT INTO {name} SELECT g, 'v' FROM generate_series(101, 150) g"))
        h.drain(table, until_hi=150)
        return read_topic(conf, topic, table_id, **kwargs)

    monkeypatch.setattr(cli, "topic_watermarks", commit_a_slice_first)
    report = verify_table(cfg, table)
    assert report.ok, report
    assert (report.committed_hi, report.source_rows, report.messages) == (100, 100, 100)

    _inject(services.kafka_bootstrap, table, 99999)  # no progress record covers it
    monkeypatch.setattr(cli, "topic_watermarks", read_topic)
    report = verify_table(cfg, table)
    assert (report.committed_hi, report.duplicates, report.missing, report.extra) == (150, 0, 0, 1)
    assert report.examples["extra"] == [99999]


def tables_sharing_a_topic(services, pg_database, pg_engine, name: str, rows: tuple[int, int], slice_max_rows: int
                           ) -> RelayConfig:
    """Tables {name}_a and {name}_b (ids 1..rows each) relayed to one topic, `name`: the config."""
    with pg_engine.begin() as conn:
        for suffix, count in zip(("a", "b"), rows, strict=True):
            conn.execute(text(f"CREATE TABLE {name}_{suffix} (id bigint PRIMARY KEY, v text)"))
            conn.execute(text(f"INSERT INTO {name}_{suffix} SELECT g, 'v' FROM generate_series(1, {count}) g"))
    return relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}_{suffix}", "watermark": "id", "topic": name,
         "slice_max_rows": slice_max_rows} for suffix in ("a", "b")])


def test_verify_keeps_to_the_tables_own_messages_in_a_shared_topic(services, pg_database, pg_engine,
                                                                   dagster_instance, spark, name) -> None:
    """Two tables with the same ids share one topic (`topic:`): verify compared the whole topic with each table and
    found every row twice, and a message without rowrelay headers crashed it. Now each table is compared with its
    own messages; the others are counted, and a message of this table that no row explains is still extra."""
    cfg = tables_sharing_a_topic(services, pg_database, pg_engine, name, rows=(100, 100), slice_max_rows=50)
    h = Harness(cfg, dagster_instance)
    for table in cfg.tables:
        h.drain(table, until_hi=100)
    first, second = cfg.tables
    _inject(services.kafka_bootstrap, first, None)  # another producer's message, no rowrelay headers
    for table in (first, second):
        report = verify_table(cfg, table)
        assert report.ok, report
        assert (report.source_rows, report.messages, report.other_messages) == (100, 100, 101)
    _inject(services.kafka_bootstrap, first, 99999)
    assert (verify_table(cfg, first).extra, verify_table(cfg, second).extra) == (1, 0)


def test_verify_compares_from_the_tables_baseline_or_reset(services, pg_database, pg_engine, dagster_instance,
                                                           spark, name) -> None:
    """`start_after: latest` and `rowrelay reset` leave rows at or below their baseline unsent on purpose: verify
    reported each of them missing. It now compares from the newest baseline or reset in the table's progress."""
    from assets.identity import channel_for
    from resources.exactly_once import SlicePublisher

    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'old' FROM generate_series(1, 50) g"))
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}",
                                                         "watermark": "id", "start_after": "latest"}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    assert h.baseline(table).hi == 50
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'new' FROM generate_series(1, 30) g"))  # 51..80
    h.drain(table, until_hi=80)
    report = verify_table(cfg, table)
    assert report.ok, report
    assert (report.compared_from, report.compared_from_record) == (50, "baseline-50")
    assert (report.source_rows, report.messages, report.missing) == (30, 30, 0)

    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'skipped' FROM generate_series(1, 20) g"))  # 81..100
    publisher = SlicePublisher(channel_for(table, PREFIX), {"bootstrap.servers": services.kafka_bootstrap})
    try:
        publisher.publish_reset(90, "test: skip 81..90")
    finally:
        publisher.close()
    h.drain(table, until_hi=100)
    report = verify_table(cfg, table)
    assert report.ok, report
    assert (report.compared_from, report.compared_from_record, report.before_start) == (90, "reset-90", 30)
    assert (report.source_rows, report.messages) == (10, 10)

    # The reset recorded where the topic ended: a row at or below it sent *after* it (which rowrelay never does)
    # is extra, not left out as sent before the reset.
    from confluent_kafka import Producer

    from resources.exactly_once import TABLE_HEADER, WATERMARK_HEADER

    stray = Producer({"bootstrap.servers": services.kafka_bootstrap})
    stray.produce(table.topic_name, b'{"id": 85}', b"85",
                  headers=[(TABLE_HEADER, channel_for(table, PREFIX).table.encode()), (WATERMARK_HEADER, b"85")])
    assert stray.flush(10) == 0
    report = verify_table(cfg, table)
    assert not report.ok and (report.extra, report.before_start) == (1, 30), report
    assert report.examples["extra"] == [85]


def test_verify_follows_a_changed_start_after_and_topic_as_the_publisher_does(services, pg_database, pg_engine,
                                                                           dagster_instance, spark, name) -> None:
    """`start_after` is where a table with no progress starts: raised once the table has progress, it changes
    nothing (the README says so; `rowrelay reset` moves a table), and verify compared from the new value, reporting
    every row sent before it extra. After a `topic:` change verify read the new topic and reported the rows sent to
    the old one missing. It now starts where the publisher did and compares the current topic's part."""
    from tests.pipeline import assert_exactly_once, read_topic

    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'x' FROM generate_series(1, 50) g"))
    spec = {"source": "src", "table": f"public.{name}", "watermark": "id", "start_after": 0}
    cfg = relay_config(services, {"src": pg_database}, [spec])
    h = Harness(cfg, dagster_instance)
    h.drain(h.table(), until_hi=50)

    cfg = relay_config(services, {"src": pg_database}, [{**spec, "start_after": 30}])
    h = Harness(cfg, dagster_instance)
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'y' FROM generate_series(1, 10) g"))  # 51..60
    h.drain(h.table(), until_hi=60)
    report = verify_table(cfg, h.table())
    assert report.ok and (report.compared_from, report.source_rows, report.messages) == (0, 60, 60), report

    cfg = relay_config(services, {"src": pg_database}, [{**spec, "topic": f"{name}.v2"}])
    h = Harness(cfg, dagster_instance)
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'z' FROM generate_series(1, 10) g"))  # 61..70
    h.drain(h.table(), until_hi=70)
    assert_exactly_once(read_topic(services.kafka_bootstrap, f"{name}.v2"), list(range(61, 71)))
    report = verify_table(cfg, h.table())
    assert report.ok and (report.compared_from, report.source_rows, report.messages) == (60, 10, 10), report
    assert report.compared_from_record == f"slices up to it went to ['src.public.{name}']"


def test_verify_after_a_reset_taken_while_another_producer_holds_the_topic_open(services, pg_database, pg_engine,
                                                                               dagster_instance, spark,
                                                                               name) -> None:
    """A reset records where the topic ended. Read `read_committed`, that end stopped at the first message of
    another producer's open transaction (another table sharing the topic, a replay), so the table's rows sent before
    the reset but stored after that message were reported extra. The log end is recorded now."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    from assets.identity import channel_for
    from resources.exactly_once import SlicePublisher, topic_end_offsets

    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' FROM generate_series(1, 10) g"))
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}",
                                                         "watermark": "id", "slice_max_rows": 10}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    h.drain(table, until_hi=10)
    other = Producer({"bootstrap.servers": services.kafka_bootstrap, "transactional.id": f"other-{name}",
                      "transaction.timeout.ms": 600_000})  # stays open however long the drains take
    other.init_transactions(30)
    other.begin_transaction()
    other.produce(table.topic_name, b"{}", b"x", headers=[("rowrelay.table", b"another.table")])
    assert other.flush(10) == 0
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' FROM generate_series(11, 30) g"))
    h.drain(table, until_hi=30)  # rows 11..30 stored after the open transaction's message
    # The scenario holds: read committed, the topic still ends at the open transaction's message.
    committed_end = Consumer({"bootstrap.servers": services.kafka_bootstrap, "group.id": f"lso-{name}",
                              "isolation.level": "read_committed"})
    try:
        _, lso = committed_end.get_watermark_offsets(TopicPartition(table.topic_name, 0), timeout=10)
    finally:
        committed_end.close()
    assert lso < topic_end_offsets({"bootstrap.servers": services.kafka_bootstrap}, table.topic_name)["0"]
    publisher = SlicePublisher(channel_for(table, PREFIX), {"bootstrap.servers": services.kafka_bootstrap})
    try:
        record, replaced = publisher.publish_reset(40, "test: skip 31..40")
    finally:
        publisher.close()
    assert replaced is not None and replaced.hi == 30
    other.commit_transaction(30)
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' FROM generate_series(31, 50) g"))
    h.drain(table, until_hi=50)
    report = verify_table(cfg, table)
    assert report.ok, report
    assert (report.compared_from_record, report.before_start, report.other_messages) == ("reset-40", 30, 1)
    assert (report.source_rows, report.messages) == (10, 10)


def test_backfill_command_publishes_the_backlog_in_range_runs(services, pg_database, pg_engine, dagster_home,
                                                               dagster_instance, spark, name, tmp_path, capsys,
                                                               monkeypatch) -> None:
    import yaml
    from dagster import RunsFilter

    from orchestration.factory import job_name
    from tests.pipeline import assert_exactly_once, read_topic

    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))

    def backfill(table_name: str) -> tuple[RelayConfig, TableConfig, Path, list[int | None]]:
        """A backlog of five slices through `rowrelay backfill`; returns each slice's `chunks_read_early`."""
        with pg_engine.begin() as conn:
            conn.execute(text(f"CREATE TABLE {table_name} (id bigserial PRIMARY KEY, v text)"))
            conn.execute(text(f"INSERT INTO {table_name} (v) SELECT 'r' || g FROM generate_series(1, 2500) g"))
        cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{table_name}",
                                                             "watermark": "id", "slice_max_rows": 500,
                                                             "max_slices_per_run": 3}])
        table = cfg.tables[0]
        config_file = tmp_path / f"{table_name}.yaml"
        config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
        assert main(["--config", str(config_file), "backfill", "--table", table.table_id]) == 0
        out = capsys.readouterr().out
        assert "5 new slice(s) cut; 5 slice(s) to publish" in out
        assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), list(range(1, 2501)))
        runs = dagster_instance.get_runs(RunsFilter(job_name=job_name(table)))
        assert len(runs) == 2  # 5 slices, at most 3 per run
        h = Harness(cfg, dagster_instance)
        keys = dagster_instance.get_dynamic_partitions(f"{table.dagster_name}__slices")
        assert [h.materialization(table, k)["rows"] for k in keys] == [500] * 5  # per-slice metadata in range runs
        # The run's own figures are named as the run's: a 500-row slice used to show "rows_published: 1500".
        first = h.materialization(table, keys[0])
        assert (first["run_slices"], first["run_rows_published"]) == (3, 1500) and "rows_published" not in first
        return cfg, table, config_file, [h.materialization(table, k).get("chunks_read_early") for k in keys]

    # The first three chunks (here one slice each) are read while Dagster loads (EarlyRead), the others by their
    # run. The early read cuts once, waiting ~1 s for the rows to be final, and gives up otherwise (best effort; the
    # backfill's own cut waits): a transaction holding an xid anywhere in the PostgreSQL cluster (the other pytest
    # worker's) holds both. Then all five slices are read by their runs, and a fresh table is tried again.
    for attempt in range(3):
        cfg, table, config_file, early = backfill(name if attempt == 0 else f"{name}_{attempt}")
        assert early in ([1, 1, 1, None, None], [None] * 5), early  # all three early chunks taken, or none
        if early == [1, 1, 1, None, None]:
            break
    assert early == [1, 1, 1, None, None], "the early read gave up three times"
    # Again, with nothing new: nothing to publish, nothing re-sent.
    assert main(["--config", str(config_file), "backfill", "--table", table.table_id]) == 0
    assert "0 new slice(s) cut; 0 slice(s) to publish" in capsys.readouterr().out
    assert len(read_topic(services.kafka_bootstrap, table.topic_name)) == 2500


def test_backfill_reads_early_only_the_slice_its_run_publishes_first(services, pg_database, pg_engine, dagster_home,
                                                                    dagster_instance, spark, name, tmp_path, capsys,
                                                                    monkeypatch) -> None:
    """The early read guesses the first slice from Kafka's progress alone; a partition already cut (here (0, 200],
    as a sensor would have) makes the run's first slice another one: the early chunks are dropped, the run reads
    its own, and every row is published exactly once."""
    import yaml

    from resources.slice_reads import EARLY_READS
    from resources.slices import SliceRange
    from tests.pipeline import assert_exactly_once, read_topic

    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    guessed: list[SliceRange] = []
    start = EARLY_READS.start

    def seen(frames):
        for frame in frames:
            guessed.append(frame.slice)
            yield frame

    monkeypatch.setattr(EARLY_READS, "start", lambda frames, *a: start(seen(frames), *a))

    def backfill(table_name: str) -> None:
        guessed.clear()
        with pg_engine.begin() as conn:
            conn.execute(text(f"CREATE TABLE {table_name} (id bigserial PRIMARY KEY, v text)"))
            conn.execute(text(f"INSERT INTO {table_name} (v) SELECT 'r' || g FROM generate_series(1, 1200) g"))
        cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{table_name}",
                                                             "watermark": "id", "slice_max_rows": 500}])
        table = cfg.tables[0]
        partitions = f"{table.dagster_name}__slices"
        dagster_instance.add_dynamic_partitions(partitions, [SliceRange(0, 200).key])
        config_file = tmp_path / f"{table_name}.yaml"
        config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
        assert main(["--config", str(config_file), "backfill", "--table", table.table_id]) == 0
        assert "2 new slice(s) cut; 3 slice(s) to publish" in capsys.readouterr().out
        assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), list(range(1, 1201)))
        h = Harness(cfg, dagster_instance)
        keys = dagster_instance.get_dynamic_partitions(partitions)
        assert keys[0] == SliceRange(0, 200).key
        assert [h.materialization(table, k)["rows"] for k in keys] == [200, 500, 500]
        assert all("chunks_read_early" not in h.materialization(table, k) for k in keys)

    # The early read did read, from another slice than the run's first. It gives up when the rows are not final
    # within ~1 s (a transaction holding an xid anywhere in the cluster: see the test above): a fresh table again.
    for attempt in range(3):
        backfill(name if attempt == 0 else f"{name}_{attempt}")
        if guessed:
            break
    assert guessed == [SliceRange(0, 500), SliceRange(500, 1000), SliceRange(1000, 1200)]


def test_cli_errors_say_what_to_do_instead_of_a_traceback(services, pg_database, pg_engine, dagster_home,
                                                          dagster_instance, spark, name, tmp_path, capsys,
                                                          monkeypatch) -> None:
    """Plausible mistakes ended in tracebacks (a table missing in `verify`, DAGSTER_HOME unset, a reset without a
    reason), one bad table hid every other in `status`, and a failed backfill said only "re-run backfill", also
    where re-running cannot help (a schema change the table is set to stop for)."""
    import yaml

    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' FROM generate_series(1, 20) g"))
    cfg = relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "id", "on_schema_change": "fail"},
        {"source": "src", "table": f"public.{name}_missing", "watermark": "id"}])
    config_file = tmp_path / "rowrelay.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    good, missing = (t.table_id for t in cfg.tables)

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(["--config", str(config_file), *argv])
        out, err = capsys.readouterr()
        assert "Traceback" not in err, err
        return code, out, err

    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    code, _, err = run("pools")
    assert code == 1 and "rowrelay: set DAGSTER_HOME to the directory holding rowrelay's dagster.yaml" in err
    # A backfill says so before anything (its early read created the table's topics, then it failed).
    code, _, err = run("backfill", "--table", good)
    assert code == 1 and "rowrelay: set DAGSTER_HOME" in err and "nothing was done" in err
    topics = topic_names(services.kafka_bootstrap)
    assert cfg.tables[0].topic_name not in topics and not [t for t in topics if t.endswith(good)]
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    code, _, err = run("verify", "--table", missing)
    assert code == 1 and f"rowrelay: {missing} not verified: table '{name}_missing' not found" in err
    code, out, err = run("status", "--json")  # the good table still reported, the bad one named, exit 1
    assert code == 1 and f"table '{name}_missing' not found" in err
    assert [row["table"] for row in json.loads(out)] == [good]
    code, out, err = run("verify", "--json")  # likewise: the good table's report, the bad one named, exit 1
    assert code == 1 and f"rowrelay: {missing} not verified: table '{name}_missing' not found" in err
    assert [r["table"] for r in json.loads(out)] == [good]
    code, _, err = run("reset", "--table", good, "--after", "5", "--reason", " ")
    assert code == 1 and "a reset needs a reason" in err

    assert run("backfill", "--table", good)[0] == 0
    with pg_engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {name} ADD COLUMN extra int"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' FROM generate_series(1, 5) g"))
    code, _, err = run("backfill", "--table", good)
    assert code == 1
    assert "Next: the table's columns changed and `on_schema_change: fail` stops it" in err
    assert "rowrelay schema accept" in err and "extra" in err, err
    # Only rowrelay's own line: Dagster's step-by-step log and the failure's stack traces stay in the run's log
    # (80 lines of them came before it, a terminal or not).
    assert "dagster - " not in err and "STEP_FAILURE" not in err, err

    # A misspelled producer setting: rowrelay's own error, not the librdkafka error under it.
    typo = cfg.model_dump(mode="json", exclude_none=True)
    typo["kafka"]["producer"] = {"mesage.max.bytes": 2000000}
    typo["tables"] = [{**typo["tables"][0], "on_schema_change": "follow"}]
    config_file.write_text(yaml.safe_dump(typo))
    code, _, err = run("backfill", "--table", good)
    assert code == 1 and 'kafka.producer: No such configuration property: "mesage.max.bytes"' in err, err
    assert "KafkaError{" not in err and "Next: fix `kafka.producer`" in err, err


def test_a_backfill_says_when_its_rows_are_not_final_and_counts_only_rows_it_sends(
        services, pg_database, pg_engine, dagster_home, dagster_instance, spark, name, tmp_path, capsys,
        monkeypatch) -> None:
    """A backfill whose wait for final rows ran out (a transaction still open below them) printed "0 slice(s) to
    publish", rows waiting, and said nothing of them; and its progress total counted rows `skip_watermarks` leaves
    out (it ended at 99/100 rows)."""
    import yaml

    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' FROM generate_series(1, 10) g"))
    cfg = relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "id", "skip_watermarks": [4]}])
    config_file = tmp_path / "rowrelay.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    table_id = cfg.tables[0].table_id
    assert main(["--config", str(config_file), "backfill", "--table", table_id]) == 0
    out = capsys.readouterr().out
    assert "10/10 rows" not in out and "9/9 rows (100%)" in out, out

    with pg_engine.connect() as open_below:  # takes id 11 and stays open: 12..13 wait for it
        open_below.execute(text(f"INSERT INTO {name} (v) VALUES ('open')"))
        with pg_engine.begin() as conn:
            conn.execute(text(f"INSERT INTO {name} (v) VALUES ('a'), ('b')"))
        code = main(["--config", str(config_file), "backfill", "--table", table_id, "--settle-timeout", "1"])
        open_below.rollback()
    err = capsys.readouterr().err
    assert code == 3  # nothing was final, so nothing published: exit 3 (orchestration/exits.py), not "done"
    assert f"rowrelay: warning: {table_id}: rows above 10 (up to 13) are not final after 1 s" in err, err
    assert "raise --settle-timeout" in err, err


def test_a_cli_backfill_waits_for_the_tables_running_run(dagster_instance, name, capsys, monkeypatch) -> None:
    """Two `rowrelay backfill`s of one table ran at once (fencing stopped one): the table's pool is enforced in the
    run queue, which a backfill's in-process runs bypass. Before each run a backfill now waits for the table's
    running runs; other tables' runs do not hold it."""
    import os
    import threading
    import time

    from dagster import DagsterRunStatus
    from dagster._core.test_utils import create_run_for_test  # Dagster's own test helper: a run in a given state

    import orchestration.backfill as cli
    from orchestration.backfill import wait_for_running_runs

    sleeps: list[float] = []  # this thread's polls: "no wait" is told by none, not by a clock on a shared machine
    real_sleep, caller = time.sleep, threading.get_ident()

    def counted_sleep(seconds: float) -> None:
        if threading.get_ident() == caller:
            sleeps.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(cli.time, "sleep", counted_sleep)
    job = f"relay_{name}"
    running = create_run_for_test(dagster_instance, job_name=job, status=DagsterRunStatus.STARTED)
    create_run_for_test(dagster_instance, job_name=f"{job}_other", status=DagsterRunStatus.STARTED)
    finished = threading.Timer(1.5, lambda: dagster_instance.report_run_failed(running))
    finished.start()
    started = time.monotonic()
    wait_for_running_runs(dagster_instance, job, "src.public.t", poll_s=0.2)
    assert time.monotonic() - started >= 1.4 and sleeps
    assert f"src.public.t: waiting for run(s) {running.run_id} of the table to finish" in capsys.readouterr().out
    finished.join()
    sleeps.clear()
    wait_for_running_runs(dagster_instance, job, "src.public.t", poll_s=0.2)  # nothing running: no wait
    assert sleeps == [] and capsys.readouterr().out == ""

    # A run left STARTED by a backfill whose process died (its pid tag names a process that is gone) was waited for
    # forever, and held the table's pool: it is marked failed, here and by the launcher's health check.
    import subprocess
    import uuid

    from assets.worker import worker_tags
    from orchestration.launcher import WORKER_TAG, WarmRunLauncher, in_process_worker_gone
    from resources.keys import WORKER_HOST_TAG, WORKER_PID_TAG

    gone = subprocess.Popen(["true"])
    gone.wait()

    def run_of(pid: int, job_suffix: str = "", **extra: str):  # a STARTED run whose own process tagged it
        run_id = str(uuid.uuid4())
        tags = {**worker_tags(run_id), WORKER_PID_TAG: str(pid), **extra}
        return create_run_for_test(dagster_instance, job_name=f"{job}{job_suffix}", run_id=run_id,
                                   status=DagsterRunStatus.STARTED, tags=tags)

    stale = run_of(gone.pid)
    health = WarmRunLauncher.check_run_worker_health(None, stale)  # type: ignore[arg-type]  # uses no launcher state
    assert health.status.value == "FAILED" and f"pid {gone.pid}" in health.msg
    alive = run_of(os.getpid(), "_alive")
    assert WarmRunLauncher.check_run_worker_health(None, alive).status.value == "RUNNING"  # type: ignore[arg-type]
    sleeps.clear()
    wait_for_running_runs(dagster_instance, job, "src.public.t", poll_s=0.2)
    assert sleeps == []  # the dead run was not waited for
    assert f"run {stale.run_id} was left running by a process that is gone: marked failed" in capsys.readouterr().out
    assert dagster_instance.get_run_by_id(stale.run_id).status == DagsterRunStatus.FAILURE
    # Not judged: a retry launched by the warm launcher (its parent's pid tag, copied, until its asset starts); a
    # run whose tags were copied from another run; a process of another pid namespace under the same host name.
    assert in_process_worker_gone(run_of(gone.pid, "_warm", **{WORKER_TAG: "{}"})) is None
    copied = create_run_for_test(dagster_instance, job_name=f"{job}_copied", status=DagsterRunStatus.STARTED,
                                 tags=dict(stale.tags))
    assert in_process_worker_gone(copied) is None
    elsewhere = run_of(gone.pid, "_ns", **{WORKER_HOST_TAG: stale.tags[WORKER_HOST_TAG].rsplit(":", 1)[0] + ":1"})
    assert in_process_worker_gone(elsewhere) is None


def _backfill_of_ten_row_slices(services, pg_database, pg_engine, dagster_home, name: str, tmp_path: Path,
                                rows: int) -> tuple[RelayConfig, list[str], dict[str, str]]:
    """A table of `rows` ids in 10-row slices, two per run, on Spark Connect: the config, the argv of a `rowrelay
    backfill` subprocess of it, and its environment."""
    import os
    import sys

    _serial_table(pg_engine, name, rows)
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}",
                                                         "watermark": "id", "slice_max_rows": 10,
                                                         "max_slices_per_run": 2, "settle_seconds": 0}],
                       spark_remote=True)
    argv = [sys.executable, "-m", "orchestration.cli", "--config", _config_file(cfg, tmp_path / "rowrelay.yaml"),
            "backfill", "--table", cfg.tables[0].table_id]
    return cfg, argv, {**os.environ, "DAGSTER_HOME": str(dagster_home)}


def _config_file(cfg: RelayConfig, path: Path) -> str:
    import yaml

    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    return str(path)


def _serial_table(engine, name: str, rows: int) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' || g FROM generate_series(1, {rows}) g"))


def test_a_reset_forward_settles_every_uncommitted_partition_below_it(
        services, pg_database, pg_engine, dagster_home, dagster_instance, name, tmp_path, capsys,
        monkeypatch) -> None:
    """Committed up to 75, then (75,85], (85,95], (95,100] cut and `reset --after 90`: the reset kept (85,90] of the
    straddling slice, materialized, but left (75,85] as it was. Its range is below progress now, so no run can
    commit it and no cut deletes it: unmaterialized forever. Every uncommitted partition at or below the reset is
    now materialized without a run, saying what became of its rows (an orphan (70,80] of a racing cut: published
    up to 75, the rest skipped)."""
    from resources.slices import SliceRange
    from tests.pipeline import read_topic

    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    _serial_table(pg_engine, name, 75)
    spec = {"source": "src", "table": f"public.{name}", "watermark": "id", "slice_max_rows": 100}
    cfg = relay_config(services, {"src": pg_database}, [spec])
    table = cfg.tables[0]
    config_file = _config_file(cfg, tmp_path / "a.yaml")
    assert main(["--config", config_file, "backfill", "--table", table.table_id]) == 0
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'n' || g FROM generate_series(76, 100) g"))
    smaller = relay_config(services, {"src": pg_database}, [{**spec, "slice_max_rows": 10}])
    config_file = _config_file(smaller, tmp_path / "b.yaml")
    partitions = f"{table.dagster_name}__slices"
    before = dagster_instance.get_dynamic_partitions(partitions)
    capsys.readouterr()
    # A dry run says what a backfill would cut, and changes nothing (it added the partitions before).
    assert main(["--config", config_file, "backfill", "--table", table.table_id, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "3 new slice(s) would be cut; 3 slice(s) would be published" in out, out
    assert dagster_instance.get_dynamic_partitions(partitions) == before
    assert Harness(smaller, dagster_instance).cut(smaller.tables[0])  # cut, not run
    assert dagster_instance.get_dynamic_partitions(partitions)[1:] == [
        SliceRange(75, 85).key, SliceRange(85, 95).key, SliceRange(95, 100).key]
    dagster_instance.add_dynamic_partitions(partitions, [SliceRange(70, 80).key])  # as a racing cut leaves one
    capsys.readouterr()

    assert main(["--config", config_file, "reset", "--table", table.table_id, "--after", "90",
                 "--reason", "skip 76-90"]) == 0
    out = capsys.readouterr().out
    assert "progress reset to 90 (was 75); 2 partition(s) above it deleted" in out, out
    assert "2 uncommitted partition(s) at or below it materialized as settled by the reset" in out, out
    h = Harness(cfg, dagster_instance)
    expected = {  # partition: (before_reset_of, published_up_to, what the description says)
        SliceRange(75, 85).key: (SliceRange(75, 85).key, 75, "never sent: skipped by rowrelay reset after 90"),
        SliceRange(70, 80).key: (SliceRange(70, 80).key, 75,
                                 "published up to 75 before rowrelay reset after 90, the rest skipped"),
        SliceRange(85, 90).key: (SliceRange(85, 95).key, 85, "never sent: skipped by rowrelay reset after 90"),
    }
    from assets.identity import asset_key

    descriptions = {r.asset_materialization.partition: r.asset_materialization.description
                    for r in dagster_instance.fetch_materializations(asset_key(table), limit=100).records}
    for key, (of, upto, what) in expected.items():
        meta = h.materialization(table, key)
        assert (meta["rowrelay/before_reset_of"], meta["rowrelay/published_up_to"], meta["reason"]) == (
            of, upto, "skip 76-90"), key
        assert what in descriptions[key], descriptions[key]

    assert main(["--config", config_file, "backfill", "--table", table.table_id]) == 0
    assert sorted(m.value["id"] for m in read_topic(services.kafka_bootstrap, table.topic_name)) == [
        *range(1, 76), *range(91, 101)]
    keys = dagster_instance.get_dynamic_partitions(partitions)
    assert SliceRange(90, 100).key in keys
    for key in keys:  # nothing left that no run will ever commit
        h.materialization(table, key)


def test_backfill_refuses_a_wait_that_never_ends_and_reset_takes_a_negative_watermark(
        services, pg_database, pg_engine, dagster_home, dagster_instance, name, tmp_path, capsys,
        monkeypatch) -> None:
    """`backfill --settle-timeout -5` was taken: a negative (or infinite, or NaN) wait is refused by argparse.
    Negative watermarks are real (a table whose `start_after` is below them): a negative --after is an ordinary
    reset (once a table has progress, `start_after` decides nothing, so it bounds no reset)."""
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} VALUES (-3, 'a'), (0, 'b'), (1, 'c'), (2, 'd')"))
    spec = {"source": "src", "table": f"public.{name}", "watermark": "id", "start_after": -4}
    negative = relay_config(services, {"src": pg_database}, [spec])
    table = negative.tables[0]
    config_file = _config_file(negative, tmp_path / "negative.yaml")

    for wait in ("-5", "inf", "nan"):
        with pytest.raises(SystemExit) as exited:
            main(["--config", config_file, "backfill", "--table", table.table_id, "--settle-timeout", wait])
        assert exited.value.code == 2
        assert f"--settle-timeout: {wait} is not a number of seconds >= 0" in capsys.readouterr().err
    h = Harness(negative, dagster_instance)
    assert h.progress(table) is None  # nothing ran

    assert main(["--config", config_file, "backfill", "--table", table.table_id]) == 0
    assert h.progress(table).hi == 2
    assert main(["--config", config_file, "reset", "--table", table.table_id, "--after", "-2", "--reason",
                 "re-send from -1"]) == 0
    assert "progress reset to -2 (was 2)" in capsys.readouterr().out
    assert (h.progress(table).slice, h.progress(table).hi) == ("reset--2", -2)
    assert main(["--config", config_file, "backfill", "--table", table.table_id]) == 0
    assert sorted(m.value["id"] for m in read_topic(services.kafka_bootstrap, table.topic_name)) == [-3, 0, 0, 1, 1,
                                                                                                      2, 2]


def test_replay_serves_the_part_of_a_slice_below_a_reset_inside_it(
        services, pg_database, pg_engine, dagster_home, dagster_instance, spark, name, tmp_path, capsys,
        monkeypatch) -> None:
    """Slices of 10 up to 75, `reset --after 65`, a backfill: rows 61-65 are committed and in the topic (the old
    slice (60,70] published them; the reset kept (60,65] as a partition), but replay refused every range ending at
    65 ("not a slice bound") or starting at 60: they could never be replayed. It now serves the old slice's
    messages at or below the reset. Wrong bounds are still refused, each one named properly."""
    from resources.slices import SliceRange
    from tests.pipeline import read_topic

    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    _serial_table(pg_engine, name, 75)
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}",
                                                         "watermark": "id", "slice_max_rows": 10, "key": ["id"]}])
    table = cfg.tables[0]
    config_file = _config_file(cfg, tmp_path / "rowrelay.yaml")
    assert main(["--config", config_file, "backfill", "--table", table.table_id]) == 0
    original = {m.watermark: m for m in read_topic(services.kafka_bootstrap, table.topic_name)}
    assert main(["--config", config_file, "reset", "--table", table.table_id, "--after", "65", "--reason",
                 "re-send 66-75"]) == 0
    assert main(["--config", config_file, "backfill", "--table", table.table_id]) == 0
    h = Harness(cfg, dagster_instance)
    progress = h.progress(table)
    assert progress.hi == 75
    capsys.readouterr()

    def replay(lo: int, hi: int) -> dict[str, Any]:
        code = main(["--config", config_file, "replay", "--table", table.table_id, "--from", str(lo), "--to",
                     str(hi), "--json"])
        out, err = capsys.readouterr()
        assert code == 0, err
        return json.loads(out)

    def copies(replay_id: str) -> list[Any]:
        return [m for m in read_topic(services.kafka_bootstrap, table.topic_name)
                if m.headers.get("rowrelay.replay") == replay_id.encode()]

    # Loading the partition the reset kept (`load_input`'s lookup) failed "has not been published": it is the old
    # slice's messages at or below the reset.
    from assets.identity import channel_for
    from resources.exactly_once import pieces_in_range, read_piece_messages

    kafka = {"bootstrap.servers": services.kafka_bootstrap}
    (kept,) = pieces_in_range(kafka, channel_for(table, PREFIX), SliceRange(60, 65))
    assert (kept.record.slice, kept.key) == (SliceRange(60, 70).key, SliceRange(60, 65).key)
    assert [int(dict(m.headers())["rowrelay.watermark"]) for m in read_piece_messages(kafka, kept)] == \
        [61, 62, 63, 64, 65]
    (whole,) = pieces_in_range(kafka, channel_for(table, PREFIX), SliceRange(50, 60))
    assert whole.key == whole.record.slice == SliceRange(50, 60).key
    assert pieces_in_range(kafka, channel_for(table, PREFIX), SliceRange(60, 70)) == []  # (65, 70] was sent again since
    # And through the IO manager, as a downstream asset loads the partition.
    from dagster import DynamicPartitionsDefinition, build_input_context, build_output_context

    from assets.identity import asset_key, partitions_for
    from resources.kafka_io_manager import channel_metadata

    def load(key: str) -> list[int]:
        context = build_input_context(
            upstream_output=build_output_context(definition_metadata=channel_metadata(channel_for(table, PREFIX))),
            asset_key=asset_key(table), partition_key=key, instance=dagster_instance,
            asset_partitions_def=DynamicPartitionsDefinition(name=partitions_for(table).name))
        frame = h.defs.resources["kafka_io_manager"].load_input(context).toPandas()
        return sorted(frame["watermark"])

    assert load(SliceRange(60, 65).key) == [61, 62, 63, 64, 65]
    assert load(SliceRange(50, 60).key) == list(range(51, 61))

    done = replay(60, 65)
    assert (done["rows"], done["slices"]) == (5, [SliceRange(60, 65).key])
    sent = copies(done["replay_id"])
    assert [m.watermark for m in sent] == [61, 62, 63, 64, 65]
    for m in sent:  # the messages the old slice published, headers and all
        o = original[m.watermark]
        assert (m.key, m.value) == (o.key, o.value)
        assert {k: v for k, v in m.headers.items() if k != "rowrelay.replay"} == o.headers
    done = replay(50, 65)
    assert done["slices"] == [SliceRange(50, 60).key, SliceRange(60, 65).key]
    assert [m.watermark for m in copies(done["replay_id"])] == list(range(51, 66))
    done = replay(60, 75)  # the part below the reset, then the new slice that re-sent the rows above it
    assert done["slices"] == [SliceRange(60, 65).key, SliceRange(65, 75).key]
    assert [m.watermark for m in copies(done["replay_id"])] == list(range(61, 76))
    assert replay(65, 75)["rows"] == 10

    refusals = {
        ("--from", "60", "--to", "70"): f"{table.table_id}: --to 70 is not a slice bound;",
        ("--from", "62", "--to", "65"): f"{table.table_id}: --from 62 is not a slice bound;",
        ("--from", "62", "--to", "68"): (f"{table.table_id}: --from 62 is not a slice bound and --to 68 is not a "
                                         "slice bound;"),
        ("--from", "60", "--to", "80"): "is not fully committed: committed progress ends at 75",
    }
    for bounds, message in refusals.items():
        assert main(["--config", config_file, "replay", "--table", table.table_id, *bounds]) == 1, bounds
        assert message in capsys.readouterr().err, bounds
    assert h.progress(table) == progress  # replay never touches progress


def test_schema_accept_with_nothing_changed_records_nothing(services, pg_database, pg_engine, dagster_home,
                                                            dagster_instance, name, tmp_path, capsys,
                                                            monkeypatch) -> None:
    """`schema accept` with the table's columns those of its committed progress wrote a record anyway and said
    "columns accepted (no change)". It now says there is nothing to accept and records nothing (exit 0: the
    table's current columns are the accepted ones, which is what the command is for)."""
    from assets.identity import channel_for
    from resources.exactly_once import read_progress_history

    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    _serial_table(pg_engine, name, 5)
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}",
                                                         "watermark": "id", "on_schema_change": "fail"}])
    table = cfg.tables[0]
    config_file = _config_file(cfg, tmp_path / "rowrelay.yaml")
    assert main(["--config", config_file, "backfill", "--table", table.table_id]) == 0
    kafka = {"bootstrap.servers": services.kafka_bootstrap}
    history = read_progress_history(kafka, channel_for(table, PREFIX))
    capsys.readouterr()
    assert main(["--config", config_file, "schema", "accept", "--table", table.table_id, "--reason", "x"]) == 0
    out = capsys.readouterr().out
    assert (f"{table.table_id}: nothing to accept: the table's columns are those of its committed progress "
            "(up to 5); nothing was recorded") in out, out
    assert read_progress_history(kafka, channel_for(table, PREFIX)) == history

    with pg_engine.begin() as conn:  # a real change is still recorded
        conn.execute(text(f"ALTER TABLE {name} ADD COLUMN extra int"))
    assert main(["--config", config_file, "schema", "accept", "--table", table.table_id, "--reason", "x"]) == 0
    assert "columns accepted (added extra)" in capsys.readouterr().out
    assert len(read_progress_history(kafka, channel_for(table, PREFIX))) == len(history) + 1


def test_an_interrupted_backfill_says_what_committed_and_how_to_continue(
        services, pg_database, pg_engine, dagster_home, dagster_instance, name, tmp_path) -> None:
    """Ctrl-C during a backfill printed `failed: dagster._core.errors.DagsterExecutionInterruptedError (details in
    the Dagster UI)`. It now says the backfill was interrupted, how far the table is committed and that running it
    again continues (exit 130, as for SIGINT)."""
    import re
    import signal
    import subprocess

    from tests.pipeline import ROOT, assert_exactly_once, read_topic

    cfg, argv, env = _backfill_of_ten_row_slices(services, pg_database, pg_engine, dagster_home, name, tmp_path, 60)
    table = cfg.tables[0]
    env["ROWRELAY_FAILPOINT"] = "sleep:begun:1.5"
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if re.search(r"committed up to \d+: 1/6 slices", line):  # one slice committed, the next one open
                proc.send_signal(signal.SIGINT)
                break
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    h = Harness(cfg, dagster_instance)
    committed = h.progress(table).hi
    assert 10 <= committed < 60, (committed, "".join(lines) + out)
    assert proc.returncode == 130, err
    assert "DagsterExecutionInterruptedError" not in err and "Traceback" not in err, err
    assert (f"rowrelay: {table.table_id}: backfill interrupted: committed up to {committed} ({committed // 10}/6 "
            "slices of this backfill); nothing of a slice that had not committed is visible. Run `rowrelay backfill "
            f"--table {table.table_id}` again to continue") in err, err

    env.pop("ROWRELAY_FAILPOINT")
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), list(range(1, 61)))


def test_a_backfill_killed_after_a_commit_has_its_committed_slice_recorded_by_the_next(
        services, pg_database, pg_engine, dagster_home, dagster_instance, spark, name, tmp_path) -> None:
    """A backfill SIGKILLed right after its first slice's commit left that slice committed in Kafka but without a
    materialization: its run recorded none, no retry of it comes, and the next backfill cuts on from Kafka's
    progress. The next backfill, which fails the dead run, now records it from its progress record."""
    import subprocess

    from assets.identity import asset_key, channel_for
    from resources.exactly_once import read_progress_history
    from resources.slices import SliceRange
    from tests.pipeline import ROOT, assert_exactly_once

    cfg, argv, env = _backfill_of_ten_row_slices(services, pg_database, pg_engine, dagster_home, name, tmp_path, 40)
    table = cfg.tables[0]
    killed = subprocess.run(argv, cwd=ROOT, env={**env, "ROWRELAY_FAILPOINT": "committed"}, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    h = Harness(cfg, dagster_instance)
    assert h.progress(table).hi == 10
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "marked failed; 1 slice(s) it committed recorded" in done.stdout, done.stdout
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), list(range(1, 41)))
    first = SliceRange(0, 10).key
    recorded = [r.asset_materialization for r in dagster_instance.fetch_materializations(asset_key(table),
                                                                                          limit=20).records
                if r.asset_materialization is not None and r.asset_materialization.partition == first]
    assert len(recorded) == 1 and recorded[0].metadata["rows"].value == 10, recorded
    assert recorded[0].metadata["checksum"].value == next(
        r for r in read_progress_history({"bootstrap.servers": services.kafka_bootstrap}, channel_for(table, PREFIX))
        if r.slice == first).checksum


def test_replay_pieces_follow_each_reset_inside_a_slice() -> None:
    """The pure part of the replay fix: a reset back inside a slice keeps the slice's part below it; a later reset
    further back cuts that part again; a reset at a slice bound or a reset forward changes nothing below it."""
    from resources.exactly_once import ProgressRecord, live_pieces
    from resources.slices import SliceRange

    def piece(lo: int, hi: int) -> ProgressRecord:
        return ProgressRecord("t", SliceRange(lo, hi).key, lo, hi, hi - lo, 0, "", "topic")

    def reset(at: int) -> ProgressRecord:
        return ProgressRecord("t", f"reset-{at}", at, at, 0, 0, "", "topic")

    def spans(history: list[ProgressRecord]) -> list[tuple[int, int, str]]:
        return [(p.lo, p.hi, p.key) for p in live_pieces(history)]

    history = [piece(0, 10), piece(10, 20), reset(15), piece(15, 25)]
    assert spans(history) == [(0, 10, SliceRange(0, 10).key), (10, 15, SliceRange(10, 15).key),
                              (15, 25, SliceRange(15, 25).key)]
    assert spans([*history, reset(12)]) == [(0, 10, SliceRange(0, 10).key), (10, 12, SliceRange(10, 12).key)]
    assert spans([*history, reset(10)]) == [(0, 10, SliceRange(0, 10).key)]
    assert spans([*history, reset(40)]) == spans(history)  # forward: nothing above progress to cut


def test_a_dry_run_backfill_changes_nothing(services, pg_database, pg_engine, dagster_home, dagster_instance, name,
                                            tmp_path, capsys, monkeypatch) -> None:
    """`--dry-run` added the partitions, and on a `start_after: latest` table with no progress recorded its
    baseline in Kafka, for good. It now only says what a
    backfill would do: no partition, no baseline, no pool."""
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    _serial_table(pg_engine, name, 30)
    spec = {"source": "src", "table": f"public.{name}", "watermark": "id", "slice_max_rows": 10}
    plain = relay_config(services, {"src": pg_database}, [spec])
    latest = relay_config(services, {"src": pg_database}, [{**spec, "start_after": "latest"}])
    h = Harness(plain, dagster_instance)
    table = h.table()
    partitions = f"{table.dagster_name}__slices"
    assert main(["--config", _config_file(plain, tmp_path / "a.yaml"), "backfill", "--table", table.table_id,
                 "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "3 new slice(s) would be cut; 3 slice(s) would be published" in out, out
    assert dagster_instance.get_dynamic_partitions(partitions) == []
    # A transaction open in the table's database while the dry run looks: like the backfill's baseline, the dry
    # run waits for it to end rather than answering "not final yet" at once (a CI run met another test's).
    with pg_engine.connect() as held:
        held.execute(text("SELECT txid_current()"))
        release = threading.Timer(2.5, held.rollback)
        release.start()
        try:
            assert main(["--config", _config_file(latest, tmp_path / "b.yaml"), "backfill", "--table",
                         table.table_id, "--dry-run"]) == 0
        finally:
            release.join()
    out = capsys.readouterr().out
    assert "its baseline is not recorded yet; a backfill or the sensor would record it at the safe watermark (30)" \
        in out, out
    assert h.progress(table) is None and dagster_instance.get_dynamic_partitions(partitions) == []
    assert read_topic(services.kafka_bootstrap, table.topic_name, timeout=2) == []
    from assets.identity import pool_name

    assert pool_name(table) not in dagster_instance.event_log_storage.get_concurrency_keys()


def test_a_dry_run_names_an_empty_latest_tables_baseline(services, pg_database, pg_engine, dagster_home,
                                                          dagster_instance, name, tmp_path, capsys,
                                                          monkeypatch) -> None:
    """An empty `start_after: latest` table: the backfill records its baseline at 0 at once (every row to come is
    new), but its dry run said "the safe watermark (not final yet)", as if it waited for something. It now names what
    the backfill records."""
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    _serial_table(pg_engine, name, 0)
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}", "watermark": "id",
                                                          "start_after": "latest"}])
    config_file = _config_file(cfg, tmp_path / "c.yaml")
    table = cfg.tables[0]
    assert main(["--config", config_file, "backfill", "--table", table.table_id, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would record it at 0 (the table is empty: every row it gets will be sent)" in out, out
    assert Harness(cfg, dagster_instance).progress(table) is None
    assert main(["--config", config_file, "backfill", "--table", table.table_id]) == 0
    baseline = Harness(cfg, dagster_instance).progress(table)
    assert baseline is not None and baseline.hi == 0, baseline


def test_a_dry_run_refuses_where_the_backfill_would(services, pg_database, pg_engine, dagster_home,
                                                   dagster_instance, spark, name, tmp_path, capsys,
                                                   monkeypatch) -> None:
    """A table whose messages are already in its topic under a new transactional_id_prefix (here `start_after:
    latest` too): the backfill refuses to send them again or to record a baseline over them (ProgressMissing). Its
    dry run said what it would cut and exited 0; it refuses the same way, and changes nothing."""
    from resources.config import parse_config

    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    _serial_table(pg_engine, name, 5)
    _, table, data = drained_then_moved_to_another_prefix(services, pg_database, dagster_instance, name, 5,
                                                          start_after="latest")
    moved = _config_file(parse_config(data), tmp_path / "moved.yaml")
    capsys.readouterr()
    for dry in (["--dry-run"], []):
        assert main(["--config", moved, "backfill", "--table", table.table_id, *dry]) == 1
        err = capsys.readouterr().err
        assert "committed progress is empty" in err and "already holds this table's messages up to watermark 5" \
            in err, err
    assert sorted(m.value["id"] for m in read_topic(services.kafka_bootstrap, table.topic_name)) == [1, 2, 3, 4, 5]


def test_a_reset_keeps_the_schema_check(services, pg_database, pg_engine, dagster_home, dagster_instance, spark,
                                        name, tmp_path, capsys, monkeypatch) -> None:
    """`on_schema_change: fail` compares a slice's columns with the last progress record's. A reset's record had
    none, so the first slice after any reset (the runbook's re-created table, most of all) published new columns
    unchecked. The reset now carries the columns last published; `schema accept` works over it.
    And a reset waits for a run of the table launched from the UI, as for the table's own job's."""
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    _serial_table(pg_engine, name, 20)
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}", "watermark": "id",
                                                          "on_schema_change": "fail"}])
    config_file = _config_file(cfg, tmp_path / "c.yaml")
    table = cfg.tables[0]
    assert main(["--config", config_file, "backfill", "--table", table.table_id]) == 0
    # A Materialize from the UI runs `__ASSET_JOB`: the reset counted only the table's own job's runs, went ahead
    # and fenced it. It is counted now.
    from dagster import DagsterRunStatus
    from dagster._core.test_utils import create_run_for_test  # Dagster's own test helper: a run in a given state

    from assets.identity import asset_key

    ui_run = create_run_for_test(dagster_instance, job_name="__ASSET_JOB", status=DagsterRunStatus.STARTED,
                                 asset_selection=frozenset({asset_key(table)}))
    capsys.readouterr()
    assert main(["--config", config_file, "reset", "--table", table.table_id, "--after", "20", "--reason",
                 "kept where it was"]) == 1
    assert f"1 run(s) of {table.table_id} are queued or running" in capsys.readouterr().err
    dagster_instance.report_run_canceled(ui_run)
    assert main(["--config", config_file, "reset", "--table", table.table_id, "--after", "20", "--reason",
                 "kept where it was"]) == 0
    with pg_engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {name} ADD COLUMN extra int"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' FROM generate_series(1, 5) g"))
    capsys.readouterr()
    assert main(["--config", config_file, "backfill", "--table", table.table_id]) == 1
    err = capsys.readouterr().err
    assert "columns changed since the last committed slice" in err or "on_schema_change: fail` stops it" in err, err
    assert "extra" in err, err
    assert len(read_topic(services.kafka_bootstrap, table.topic_name)) == 20
    assert main(["--config", config_file, "schema", "accept", "--table", table.table_id, "--reason", "new column"]) == 0
    assert main(["--config", config_file, "backfill", "--table", table.table_id]) == 0
    assert sorted(m.value["id"] for m in read_topic(services.kafka_bootstrap, table.topic_name)) == list(range(1, 26))
