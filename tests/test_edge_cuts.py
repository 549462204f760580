"""Issue 9, items 3-6 at the cut: baselines, start points, partitions that disagree with Kafka, reset.

Each test drives the real pipeline (sensor ticks, runs, the `rowrelay` CLI) on the real stack.
"""

from __future__ import annotations

import threading
import time

import pytest
import yaml
from sqlalchemy import create_engine, event, text

from assets.identity import asset_key, channel_for
from orchestration.cli import main
from orchestration.cutting import SensorState, cached_table_shape, latest_baseline
from resources.exactly_once import ProgressRecord, read_committed_progress, read_progress_history
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.slices import RowSkip, SliceRange
from resources.source_database import SETTLED_ANSWERS, SourceDatabaseResource
from tests.pipeline import Harness, assert_exactly_once, read_topic, relay_config

pytestmark = pytest.mark.integration


def _pg_table(engine, name: str, rows: int) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        if rows:
            conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' || g FROM generate_series(1, {rows}) g"))


def _table_cfg(name: str, **extra) -> dict:
    return {"source": "src", "table": f"public.{name}", "watermark": "id", **extra}


def _ids(services, table) -> list[int]:
    return sorted(m.value["id"] for m in read_topic(services.kafka_bootstrap, table.topic_name))


def test_start_after_changed_before_first_commit_heals(services, pg_database, pg_engine, dagster_instance, spark,
                                                       name) -> None:
    """Slices cut from 0, then `start_after: 5` before anything committed: no partition starts at 5, so every
    run failed "out of order" forever. The sensor now deletes the partitions that can never commit and cuts
    again from Kafka's progress."""
    _pg_table(pg_engine, name, 10)
    first = Harness(relay_config(services, {"src": pg_database}, [_table_cfg(name)]), dagster_instance)
    assert first.cut(first.table()) == ["000000000000-000000000010"]  # cut, never run
    moved = Harness(relay_config(services, {"src": pg_database}, [_table_cfg(name, start_after=5)]),
                    dagster_instance)
    table = moved.table()
    moved.drain(table, until_hi=10, timeout=60)
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), list(range(6, 11)))
    keys = dagster_instance.get_dynamic_partitions(f"{table.dagster_name}__slices")
    assert keys == ["000000000005-000000000010"]  # the orphan is gone, the range re-cut from progress


def test_start_after_latest_set_before_first_commit_sends_no_history(services, pg_database, pg_engine,
                                                                    dagster_instance, spark, name) -> None:
    """Slices cut from 0, then `start_after: latest` before anything committed (the first load failed, or was
    still queued): the old slices still made a chain from 0, the sensor resumed it, its runs published it, and the
    whole history `latest` skips was sent. A run of such a slice is refused now, sending nothing,
    and the sensor records the baseline and deletes those slices."""
    from tests.test_errors import failure_text

    _pg_table(pg_engine, name, 300)
    first = Harness(relay_config(services, {"src": pg_database}, [_table_cfg(name)]), dagster_instance)
    (old,) = first.cut(first.table())  # cut, never run
    latest = Harness(relay_config(services, {"src": pg_database}, [_table_cfg(name, start_after="latest")]),
                     dagster_instance)
    table = latest.table()
    refused = latest.run(table, old, raise_on_error=False)  # queued before the change, run after it
    assert not refused.success
    said = failure_text(refused)
    assert "start_after is latest, and no baseline is recorded yet" in said and "Nothing was sent" in said, said
    assert read_topic(services.kafka_bootstrap, table.topic_name) == [] and latest.progress(table) is None
    with pg_engine.begin() as conn:  # rows 301-310 arrive before the sensor's next tick
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'n' || g FROM generate_series(1, 10) g"))
    assert latest.baseline(table).hi == 310
    assert dagster_instance.get_dynamic_partitions(f"{table.dagster_name}__slices") == []  # the old slice: gone
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v) VALUES ('after')"))
    latest.drain(table, until_hi=311, timeout=60)
    assert _ids(services, table) == [311]


def _recreated_with_the_old_max_pending(services, pg_database, pg_engine, dagster_instance, name):
    """A table of ids 1..10 whose max the sensor's cursor keeps pending (a transaction held an xid through the
    tick), then dropped and re-created with ids 1..3. Returns the harness and the table."""
    _pg_table(pg_engine, name, 10)
    h = Harness(relay_config(services, {"src": pg_database}, [_table_cfg(name)]), dagster_instance)
    table = h.table()
    with pg_engine.connect() as holder:
        holder.begin()
        holder.execute(text(f"INSERT INTO {name} (v) VALUES ('open')"))  # holds an xid: the max 10 stays pending
        assert h.tick(table) == []
        assert [c.watermark for c in SensorState.from_cursor(h.cursors[table.table_id]).pending] == [10]
        holder.rollback()
    with pg_engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {name}"))
    _pg_table(pg_engine, name, 3)  # ids 1..3
    return h, table


def test_a_recreated_table_is_not_cut_on_the_old_tables_pending_max(services, pg_database, pg_engine,
                                                                   dagster_instance, spark, name) -> None:
    """The sensor's cursor keeps the maxima still waiting for open transactions. A table re-created with lower ids
    (before anything of it committed, or after `rowrelay reset`) still had the old table's max pending: its waits
    had ended, so it turned final at once and the range up to it was cut over the new table's open transactions,
    whose rows then committed inside a cut range and were never sent. A pending max above the table's max now goes."""
    h, table = _recreated_with_the_old_max_pending(services, pg_database, pg_engine, dagster_instance, name)
    with pg_engine.connect() as writer:
        writer.begin()
        writer.execute(text(f"INSERT INTO {name} (v) VALUES ('late')"))  # id 4, open
        with pg_engine.begin() as conn:
            conn.execute(text(f"INSERT INTO {name} (v) VALUES ('early')"))  # id 5, committed
        assert h.tick(table) == [], "cut while id 4 was still uncommitted"
        writer.commit()
    h.drain(table, until_hi=5, timeout=60)
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), [1, 2, 3, 4, 5])


def test_a_recreated_table_past_the_old_pending_max_is_not_cut_on_it(services, pg_database, pg_engine,
                                                                      dagster_instance, spark, name) -> None:
    """As above, but the new table's ids pass the old pending max (10) before the next tick, while its id 4 is still
    uncommitted: the old candidate was kept (only one above the new max went), its waits had ended, so it turned
    final at once and (0, 10] was cut without id 4, never to be sent. A candidate now belongs to
    the incarnation of the table it was seen in (PostgreSQL: oid and relfilenode)."""
    h, table = _recreated_with_the_old_max_pending(services, pg_database, pg_engine, dagster_instance, name)
    with pg_engine.connect() as writer:
        writer.begin()
        writer.execute(text(f"INSERT INTO {name} (v) VALUES ('late')"))  # id 4, open
        with pg_engine.begin() as conn:
            conn.execute(text(f"INSERT INTO {name} (v) SELECT 'early' FROM generate_series(5, 12)"))  # 5..12
        # Other sessions' commits flush the WAL past id 4's open insert, as on any server in use (the stack's
        # server commits asynchronously, and left alone it keeps that last page unflushed, which alone made the old
        # candidate wait here).
        stop = threading.Event()

        def commit_others() -> None:
            while not stop.wait(0.05):
                with pg_engine.begin() as other:
                    other.execute(text("SET LOCAL synchronous_commit = on"))
                    other.execute(text("SELECT txid_current()"))

        flowing = threading.Thread(target=commit_others, daemon=True)
        flowing.start()
        try:
            assert h.tick(table) == [], "cut on the old table's max while id 4 was still uncommitted"
        finally:
            stop.set()
            flowing.join()
        writer.commit()
    h.drain(table, until_hi=12, timeout=60)
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), list(range(1, 13)))


def test_racing_cuts_heal_without_loss_or_duplicate(services, pg_database, pg_engine, dagster_instance, spark,
                                                    name) -> None:
    """Two cutters raced on a first load (CLI backfill and sensor): (0, 100] committed while (0, 200] also exists.
    Nothing started at 100 any more; the table now heals and every row arrives once."""
    _pg_table(pg_engine, name, 300)
    h = Harness(relay_config(services, {"src": pg_database}, [_table_cfg(name)]), dagster_instance)
    table = h.table()
    partitions = f"{table.dagster_name}__slices"
    dagster_instance.add_dynamic_partitions(partitions, [SliceRange(0, 100).key, SliceRange(0, 200).key])
    h.run(table, SliceRange(0, 100).key)
    h.drain(table, until_hi=300, timeout=60)
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), list(range(1, 301)))
    assert SliceRange(0, 200).key not in dagster_instance.get_dynamic_partitions(partitions)


def test_latest_baseline_waits_for_open_transactions(services, pg_database, pg_engine, dagster_instance, spark,
                                                     name) -> None:
    """`start_after: latest` took the max it saw as its baseline, though a lower id was still uncommitted: that row
    committed after the baseline and was never sent. The baseline is now a safe watermark."""
    _pg_table(pg_engine, name, 1)
    h = Harness(relay_config(services, {"src": pg_database}, [_table_cfg(name, start_after="latest")]),
                dagster_instance)
    table = h.table()
    with pg_engine.connect() as holder:
        tx = holder.begin()
        holder.execute(text(f"INSERT INTO {name} (v) VALUES ('late')"))  # id 2, open
        with pg_engine.begin() as conn:
            conn.execute(text(f"INSERT INTO {name} (v) VALUES ('early')"))  # id 3, committed
        assert h.tick(table) == []
        assert h.progress(table) is None, "baseline recorded while a lower id was still uncommitted"
        tx.commit()  # id 2 commits now: before any baseline
    assert h.baseline(table).hi == 3  # every id <= 3 is committed: the baseline is 3
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v) VALUES ('new')"))  # id 4: after it
    h.drain(table, until_hi=4, timeout=60)
    history = read_progress_history({"bootstrap.servers": services.kafka_bootstrap}, channel_for(table, PREFIX))
    assert history[0].slice == "baseline-3"
    assert _ids(services, table) == [4]


def test_a_tick_holding_rows_for_an_open_transaction_says_which(services, pg_database, pg_engine, dagster_instance,
                                                                name) -> None:
    """A session left idle in transaction holds new rows back (correctly), but the tick said only "Sensor function
    returned an empty result" in the UI: nothing about rows waiting, or on what. Its skip message
    now names the rows held, the transaction (its backend's pid) and the runbook entry."""
    _pg_table(pg_engine, name, 3)
    h = Harness(relay_config(services, {"src": pg_database}, [_table_cfg(name)]), dagster_instance)
    table = h.table()
    with pg_engine.connect() as holder:
        holder.begin()
        pid = holder.execute(text("SELECT pg_backend_pid()")).scalar()  # open, no xid: only its vxid holds the cut
        # Another pytest worker's transaction, older than the max, may hold the cluster's xmin for a tick or two
        # (the message then names that one): tick until the message names the holder, as it must while it is open.
        deadline = time.monotonic() + 30
        while True:
            assert h.tick(table) == [], "cut while a transaction open when the max was seen was still open"
            message = h.skip_messages[table.table_id] or ""
            if f"(pid {pid})" in message or time.monotonic() > deadline:
                break
        assert f"{table.table_id}: rows above 0 (up to 3) are not final yet, so they are not cut" in message, message
        assert f"(pid {pid}), open in the table's database when the max was seen, is still open" in message, message
        assert 'docs/operations.md, "New rows are not cut"' in message, message
        holder.rollback()
    assert h.cut(table) == [SliceRange(0, 3).key], h.skip_messages[table.table_id]


def test_a_prepared_transaction_holds_the_rows_it_may_still_commit_below_the_max(services, pg_database, pg_engine,
                                                                               dagster_instance, spark, name) -> None:
    """PostgreSQL releases a transaction's virtual xid lock at PREPARE TRANSACTION. A transaction that drew id 4 (no
    xid yet) while id 5 committed was waited for by its vxid; it then inserted 4 (its xid, taken after the max was
    seen, is above the marker, so the xmin part passes) and prepared: the check saw its vxid gone and cut up to 5,
    and COMMIT PREPARED made row 4 visible below the cut, never sent. A prepared transaction of
    the table's database whose xid is at or above the marker now holds the cut, and the tick names its gid."""
    _pg_table(pg_engine, name, 3)
    h = Harness(relay_config(services, {"src": pg_database}, [_table_cfg(name)]), dagster_instance)
    table = h.table()
    gid = f"{name}_2pc"
    two_phase = create_engine(pg_database, isolation_level="AUTOCOMMIT")  # BEGIN and PREPARE spelled out
    try:
        with two_phase.connect() as writer, two_phase.connect() as admin:
            for _ in range(5):
                writer.execute(text("BEGIN"))
                drawn = writer.execute(text(f"SELECT nextval('{name}_id_seq')")).scalar()
                # A checkpoint since the sequence's last logged value makes nextval write WAL, which takes an xid
                # (below the marker: the xmin part would hold it). Draw again: the next one is not logged.
                if writer.execute(text("SELECT pg_current_xact_id_if_assigned()")).scalar() is None:
                    break
                writer.execute(text("ROLLBACK"))
            else:
                pytest.fail("every nextval took a transaction id")
            with pg_engine.begin() as conn:
                above = conn.execute(text(f"INSERT INTO {name} (v) VALUES ('above') RETURNING id")).scalar()
            assert h.tick(table) == [], "cut while a transaction open when the max was seen was still open"
            writer.execute(text(f"INSERT INTO {name} (id, v) VALUES ({drawn}, 'prepared')"))  # its xid: now
            writer.execute(text(f"PREPARE TRANSACTION '{gid}'"))  # its vxid lock is released here
            # Another pytest worker's transaction may hold the cluster's xmin for a tick or two (the message then
            # names that one): tick until the message names the prepared transaction, as it must while prepared.
            deadline = time.monotonic() + 30
            while True:
                assert h.tick(table) == [], f"cut up to {above} while prepared {gid!r} could commit id {drawn} below"
                message = h.skip_messages[table.table_id] or ""
                if gid in message or time.monotonic() > deadline:
                    break
            assert f"{table.table_id}: rows above 0 (up to {above}) are not final yet" in message, message
            assert f"prepared transaction '{gid}'" in message, message
            assert "COMMIT PREPARED or ROLLBACK PREPARED" in message, message
            assert 'docs/operations.md, "New rows are not cut"' in message, message
            admin.execute(text(f"COMMIT PREPARED '{gid}'"))
        h.drain(table, until_hi=above, timeout=60)
        assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), [1, 2, 3, drawn, above])
    finally:
        with two_phase.connect() as admin:  # a prepared transaction left behind would hold every later cut
            if admin.execute(text("SELECT 1 FROM pg_prepared_xacts WHERE gid = :gid"), {"gid": gid}).first():
                admin.execute(text(f"ROLLBACK PREPARED '{gid}'"))
        two_phase.dispose()


def test_a_baseline_never_overwrites_progress_committed_meanwhile(services, pg_database, pg_engine, dagster_instance,
                                                                 spark, name) -> None:
    """`start_after: latest`, two cutters (the sensor and a `rowrelay backfill`) that both read empty progress: one
    records its baseline and publishes past it, then the other records its own, higher, baseline. That baseline
    replaced the progress, and the rows between were never sent. A baseline is now recorded only if the progress
    is still empty once its publisher has fenced every other; otherwise the progress that stands is kept."""
    _pg_table(pg_engine, name, 3)
    h = Harness(relay_config(services, {"src": pg_database}, [_table_cfg(name, start_after="latest")]),
                dagster_instance)
    table = h.table()
    assert h.baseline(table).hi == 3  # the first cutter's baseline
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v) VALUES ('a'), ('b')"))  # ids 4, 5: published
    h.drain(table, until_hi=5, timeout=60)
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v) VALUES ('c'), ('d')"))  # ids 6, 7: not cut yet
    # The second cutter read the empty progress before all that, and records its baseline now (at 7, the safe
    # watermark of this moment).
    source = SourceDatabaseResource(url=h.config.sources["src"].url)
    conf = {"bootstrap.servers": services.kafka_bootstrap}
    standing, state = None, SensorState()
    try:
        deadline = time.monotonic() + 60  # not 20 tries: the other pytest worker may hold an xid for seconds
        while standing is None and time.monotonic() < deadline:
            standing, state = latest_baseline(source, cached_table_shape(source, table), table,
                                              channel_for(table, PREFIX), conf, state)
            if standing is None:
                time.sleep(0.2)
    finally:
        source.dispose()
    assert h.progress(table).hi == 5, "a baseline recorded over committed progress"
    assert [r.slice for r in read_progress_history(conf, channel_for(table, PREFIX))].count("baseline-7") == 0
    assert standing is not None and (standing.lo, standing.hi) == (3, 5), standing
    h.drain(table, until_hi=7, timeout=60)
    assert _ids(services, table) == [4, 5, 6, 7]


def test_rows_at_or_below_zero_are_refused_unless_start_after_says(services, pg_database, pg_engine,
                                                                   dagster_instance, spark, name) -> None:
    """With `start_after` unset, watermarks <= 0 were skipped silently; now the table refuses to start, saying what
    to set, and `start_after` below them sends them."""
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigint PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} VALUES (-3, 'a'), (0, 'b'), (1, 'c'), (2, 'd')"))
    h = Harness(relay_config(services, {"src": pg_database}, [_table_cfg(name)]), dagster_instance)
    with pytest.raises(Exception, match=r"rows with watermark <= 0 exist \(the lowest is -3\).*start_after: -4"):
        h.tick(h.table())
    assert h.progress(h.table()) is None
    assert read_topic(services.kafka_bootstrap, h.table().topic_name) == []
    below = Harness(relay_config(services, {"src": pg_database}, [_table_cfg(name, start_after=-4)]), dagster_instance)
    assert below.cut(below.table()) != []  # cut, never run
    # `start_after` unset again before anything committed: those slices were deleted as orphans and the table was cut
    # from 0, skipping -3 and 0 without a word. Refused as before any cut.
    with pytest.raises(Exception, match=r"rows with watermark <= 0 exist \(the lowest is -3\)"):
        Harness(relay_config(services, {"src": pg_database}, [_table_cfg(name)]), dagster_instance).tick(h.table())
    h = below
    h.drain(h.table(), until_hi=2, timeout=60)
    assert _ids(services, h.table()) == [-3, 0, 1, 2]


def test_new_prefix_refuses_to_resend_and_reset_sets_a_baseline(services, pg_database, pg_engine, dagster_home,
                                                                dagster_instance, spark, name, tmp_path,
                                                                monkeypatch, capsys) -> None:
    """A new `transactional_id_prefix` gave the table an empty progress topic while its data topic stayed: the
    next backfill sent the whole table again. Now it refuses with what to do, and `rowrelay reset` records a
    deliberate baseline."""
    _pg_table(pg_engine, name, 3)
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))

    def config_file(prefix: str, **table: str) -> str:
        cfg = relay_config(services, {"src": pg_database}, [_table_cfg(name, **table)])
        data = cfg.model_dump(mode="json", exclude_none=True)
        data["kafka"]["transactional_id_prefix"] = prefix
        path = tmp_path / f"{prefix}.yaml"
        path.write_text(yaml.safe_dump(data))
        return str(path)

    old, new = config_file("rowrelay"), config_file("renamed")
    table_id = f"src.public.{name}"
    assert main(["--config", old, "backfill", "--table", table_id]) == 0
    table = relay_config(services, {"src": pg_database}, [_table_cfg(name)]).tables[0]
    assert _ids(services, table) == [1, 2, 3]
    capsys.readouterr()

    assert main(["--config", new, "backfill", "--table", table_id]) == 1
    assert _ids(services, table) == [1, 2, 3], "history re-sent under a new transactional_id_prefix"
    conf = {"bootstrap.servers": services.kafka_bootstrap}
    renamed = channel_for(table, "renamed")
    assert read_committed_progress(conf, renamed) is None
    # The prefix and the topic changed together: the new topic holds nothing to tell, but the old progress topic does.
    moved = config_file("moved", topic=f"{name}_moved")
    capsys.readouterr()
    assert main(["--config", moved, "backfill", "--table", table_id]) == 1
    said = capsys.readouterr().err
    assert (f"progress topic _rowrelay.progress.{table_id} holds this table's committed progress up to watermark 3 "
            f"(its rows went to topic {table.topic_name})") in said, said
    assert f"`rowrelay reset --table {table_id} --after 3`" in said, said
    assert read_topic(services.kafka_bootstrap, f"{name}_moved", timeout=3.0) == []
    # `verify` says the same, rather than comparing nothing ("0 source rows, 0 messages [OK]") or extras.
    for config in (new, moved):
        assert main(["--config", config, "verify", "--table", table_id]) == 1
        said = capsys.readouterr().err
        assert "not verified" in said and f"`rowrelay reset --table {table_id} --after 3`" in said, said

    assert main(["--config", new, "reset", "--table", table_id, "--after", "3", "--reason", "prefix renamed"]) == 0
    assert "progress reset to 3" in capsys.readouterr().out
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v) VALUES ('after reset')"))
    assert main(["--config", new, "backfill", "--table", table_id]) == 0
    assert _ids(services, table) == [1, 2, 3, 4]
    history = read_progress_history(conf, renamed)
    assert (history[0].slice, history[0].hi, history[0].reset_reason) == ("reset-3", 3, "prefix renamed")
    assert history[-1].hi == 4
    observed = [r.asset_observation for r in dagster_instance.fetch_observations(asset_key(table), limit=10).records]
    assert any(o is not None and o.metadata["rowrelay/reset_after"].value == 3 for o in observed)


def test_reset_inside_a_slice_keeps_the_part_below_as_a_partition(services, pg_database, pg_engine, dagster_home,
                                                                   dagster_instance, spark, name, tmp_path,
                                                                   monkeypatch, capsys) -> None:
    """A reset at W inside a committed slice (or roll-up) (lo, hi] deleted its partition and left (lo, W] without
    one, though its rows were published: the part below W is now a partition of its own, materialized."""
    _pg_table(pg_engine, name, 5)
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    cfg = relay_config(services, {"src": pg_database}, [_table_cfg(name)])
    path = tmp_path / "rowrelay.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    table_id = f"src.public.{name}"
    assert main(["--config", str(path), "backfill", "--table", table_id]) == 0
    table = cfg.tables[0]
    partitions = f"{table.dagster_name}__slices"
    assert dagster_instance.get_dynamic_partitions(partitions) == [SliceRange(0, 5).key]
    assert main(["--config", str(path), "reset", "--table", table_id, "--after", "2", "--reason", "re-send 3-5"]) == 0
    assert dagster_instance.get_dynamic_partitions(partitions) == [SliceRange(0, 2).key]
    (record,) = dagster_instance.fetch_materializations(asset_key(table), limit=10).records[:1]
    assert record.asset_materialization.partition == SliceRange(0, 2).key
    assert record.asset_materialization.metadata["rowrelay/before_reset_of"].value == SliceRange(0, 5).key
    assert record.asset_materialization.metadata["rowrelay/published_up_to"].value == 2
    assert "published before rowrelay reset" in record.asset_materialization.description
    assert main(["--config", str(path), "backfill", "--table", table_id]) == 0  # rows 3-5 again, as asked
    assert _ids(services, table) == [1, 2, 3, 3, 4, 4, 5, 5]
    assert dagster_instance.get_dynamic_partitions(partitions) == [SliceRange(0, 2).key, SliceRange(2, 5).key]

    # Forward, inside a partition cut but never published: its part below W is recorded as skipped, not published.
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' || g FROM generate_series(6, 10) g"))  # ids 6-10
    assert Harness(cfg, dagster_instance).cut(table) == [SliceRange(5, 10).key]
    assert main(["--config", str(path), "reset", "--table", table_id, "--after", "8", "--reason", "skip 6-8"]) == 0
    (record,) = dagster_instance.fetch_materializations(asset_key(table), limit=10).records[:1]
    assert record.asset_materialization.partition == SliceRange(5, 8).key
    assert record.asset_materialization.metadata["rowrelay/published_up_to"].value == 5
    assert "never sent: skipped by rowrelay reset" in record.asset_materialization.description


def test_reset_reports_the_progress_it_replaced_while_a_publisher_keeps_committing(
        services, pg_database, pg_engine, dagster_home, dagster_instance, name, tmp_path, monkeypatch, capsys) -> None:
    """`rowrelay reset --force` read the progress it replaced before fencing the running publisher, so a slice
    committed in between was missing from what it reported (and from how it recorded a straddled partition). It is
    now read after the fence: exactly the record just before the reset's own in the progress topic."""
    import threading

    from resources.exactly_once import RelayError, SlicePublisher

    _pg_table(pg_engine, name, 0)
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    cfg = relay_config(services, {"src": pg_database}, [_table_cfg(name)])
    path = tmp_path / "rowrelay.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    table = cfg.tables[0]
    channel = channel_for(table, PREFIX)
    running = SlicePublisher(channel, {"bootstrap.servers": services.kafka_bootstrap})
    committed: list[int] = []
    fenced: list[Exception] = []

    def keep_committing() -> None:  # a run's publisher, one small slice after another, until it is fenced
        try:
            for hi in range(1, 100_000):
                running.publish_progress_only(ProgressRecord(channel.table, SliceRange(hi - 1, hi).key, hi - 1, hi,
                                                             0, 0, "", channel.topic))
                committed.append(hi)
        except RelayError as exc:
            fenced.append(exc)

    worker = threading.Thread(target=keep_committing, daemon=True)
    worker.start()
    deadline = time.monotonic() + 30
    while len(committed) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(committed) >= 5, "the running publisher committed nothing"
    assert main(["--config", str(path), "reset", "--table", table.table_id, "--after", "0", "--force",
                 "--reason", "while a publisher runs"]) == 0
    worker.join(30)
    assert fenced and not worker.is_alive(), "the reset did not fence the running publisher"
    history = read_progress_history({"bootstrap.servers": services.kafka_bootstrap}, channel)
    at = next(i for i, r in enumerate(history) if r.slice == "reset-0")
    replaced = history[at - 1].hi
    assert replaced == committed[-1], (replaced, committed[-1])
    out = capsys.readouterr().out
    assert f"progress reset to 0 (was {replaced})" in out, out
    (record,) = dagster_instance.fetch_observations(asset_key(table), limit=5).records
    observation = record.asset_observation
    assert observation.metadata["previous_progress"].value == replaced


def test_transaction_timeout_bounds_slice_size() -> None:
    """Slices are cut no larger than the table's recent rate can publish in half the transaction timeout."""
    from orchestration.cutting import slice_rows_limit

    def rec(rows: int, seconds: float) -> ProgressRecord:
        return ProgressRecord("t", "k", 0, rows, rows, 0, "", "topic", transaction_s=seconds)

    assert slice_rows_limit(100_000, [], 60_000) == 100_000  # no history: the configured size
    assert slice_rows_limit(100_000, [rec(10_000, 1.0)], 60_000) == 100_000  # 10k rows/s: 300k fit in 30 s
    assert slice_rows_limit(100_000, [rec(10_000, 10.0)], 60_000) == 30_000  # 1k rows/s: 30k rows in 30 s
    assert slice_rows_limit(100_000, [rec(10_000, 1000.0)], 60_000) == 1_000  # never below 1000 rows
    assert slice_rows_limit(100_000, [rec(10, 100.0)], 60_000) == 100_000  # too few rows to judge
    # A configured size under 1000 holds whatever the history (it was raised to 1000 once slices of 1000 rows had
    # committed: a lowered slice_max_rows, e.g. for wide rows, was ignored).
    assert slice_rows_limit(100, [rec(5_000, 2.0)], 600_000) == 100
    assert slice_rows_limit(100, [rec(10_000, 1000.0)], 60_000) == 100



def test_slice_that_outlives_the_transaction_timeout_is_cut_again_smaller(services, pg_database, pg_engine,
                                                                          dagster_instance, spark, name,
                                                                          monkeypatch) -> None:
    """A slice whose transaction outlives `transaction.timeout.ms` can never commit as cut: its run stops with
    "transaction timed out" (not "fenced") and the sensor cuts the range again at a quarter of its rows. A later
    slice the re-cut gives again stays (deleting and adding one key in a tick failed the tick, every tick)."""
    from dagster import RunsFilter

    from orchestration.factory import job_name
    from resources.kafka_io_manager import STOPPED_TAG

    _pg_table(pg_engine, name, 4100)
    cfg = relay_config(services, {"src": pg_database}, [_table_cfg(name, slice_max_rows=4000)],
                       producer={"transaction.timeout.ms": "2000"})
    h = Harness(cfg, dagster_instance)
    table = h.table()
    key, tail = SliceRange(0, 4000).key, SliceRange(4000, 4100).key
    assert h.cut(table) == [f"{key}...{tail}"]
    # Longer than the 2 s timeout plus the broker's 2 s check for timed-out transactions (stack/local.py).
    monkeypatch.setenv("ROWRELAY_FAILPOINT", "sleep:rows_produced:5.5")
    result = h.run(table, key, raise_on_error=False)
    assert not result.success
    (run,) = dagster_instance.get_runs(RunsFilter(job_name=job_name(table)))
    assert run.tags[STOPPED_TAG] == "transaction_timeout"
    assert read_topic(services.kafka_bootstrap, table.topic_name) == [] and h.progress(table) is None
    monkeypatch.delenv("ROWRELAY_FAILPOINT")
    # A transaction holding an xid while the sensor re-cuts (any busy source): the range was final when first cut,
    # so it is cut again smaller at once. It used to wait for that transaction, and a later tick re-cut it whole.
    with pg_engine.connect() as busy:
        busy.execute(text(f"CREATE TEMP TABLE busy_{name} (x int)"))
        busy.execute(text(f"INSERT INTO busy_{name} VALUES (1)"))
        assert h.tick(table) == [f"{SliceRange(0, 1000).key}...{tail}"], h.skip_messages
        busy.rollback()
    keys = dagster_instance.get_dynamic_partitions(f"{table.dagster_name}__slices")
    assert keys == [SliceRange(lo, lo + 1000).key for lo in range(0, 4000, 1000)] + [tail]  # in chain order
    h.drain(table, until_hi=4100, timeout=60)
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), list(range(1, 4101)))


def test_a_slice_of_one_watermark_value_that_outlives_the_timeout_waits_for_a_human(
        services, pg_database, pg_engine, dagster_home, dagster_instance, spark, name, monkeypatch) -> None:
    """A slice whose rows share one watermark value cannot be cut smaller (a slice never splits a value): the
    re-cut after a timeout was the same slice, which timed out again, for as long as the timeout each time, forever.
    The sensor now keeps it and says what to do; a run with a larger timeout publishes it."""
    from orchestration.cli import main

    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (batch bigint NOT NULL, v text)"))
        conn.execute(text(f"INSERT INTO {name} SELECT 1, 'r' || g FROM generate_series(1, 3000) g"))
    cfg = relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "batch", "key": "none"}],
        producer={"transaction.timeout.ms": "2000"})
    h = Harness(cfg, dagster_instance)
    table = h.table()
    (key,) = h.cut(table)
    assert key == SliceRange(0, 1).key
    monkeypatch.setenv("ROWRELAY_FAILPOINT", "sleep:rows_produced:5.5")
    assert not h.run(table, key, raise_on_error=False).success
    monkeypatch.delenv("ROWRELAY_FAILPOINT")
    for _ in range(2):  # no run, the same message, tick after tick
        assert h.tick(table) == []
        said = h.skip_messages[table.table_id] or ""
        assert (f"slice {key} outlived transaction.timeout.ms and cannot be cut smaller: its 3000 rows share one "
                "batch value. Raise kafka.producer transaction.timeout.ms") in said, said
        assert f"`rowrelay backfill --table {table.table_id}`" in said, said
    assert dagster_instance.get_dynamic_partitions(f"{table.dagster_name}__slices") == [key]
    assert read_topic(services.kafka_bootstrap, table.topic_name, timeout=3.0) == []
    # As the message says: the timeout raised, the backfill publishes the slice.
    raised = relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "batch", "key": "none"}])
    path = Harness(raised, dagster_instance).config_file()
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    assert main(["--config", str(path), "backfill", "--table", table.table_id]) == 0
    assert len(read_topic(services.kafka_bootstrap, table.topic_name)) == 3000
    assert h.progress(table).hi == 1


def test_settled_rows_are_asked_about_once_and_a_recount_asks_again(services, pg_database, pg_engine, name) -> None:
    """A backfill's early read, its cut, its bar and its run ask the source the same questions about one slice of
    settled rows: each is asked once per process (SETTLED_ANSWERS). A question not marked settled (the
    slice_parity recount, a lag) is asked every time, and sees the source as it is now."""
    _pg_table(pg_engine, name, 10)
    cfg = relay_config(services, {"src": pg_database}, [_table_cfg(name)])
    source = SourceDatabaseResource(url=cfg.sources["src"].url)
    shape = source.table_shape("public", name, "id")
    filtered = source.table_shape("public", name, "id", where="id % 2 = 0")
    asked: list[str] = []
    event.listen(source.engine, "before_cursor_execute", lambda conn, cursor, sql, *rest: asked.append(sql))
    try:
        assert source.count_rows(shape, 0, 10, settled=True) == 10
        assert source.nth_watermark(shape, 0, 4, 10, settled=True) == 4
        assert len(asked) == 2
        assert source.count_rows(shape, 0, 10, settled=True) == 10
        assert source.nth_watermark(shape, 0, 4, 10, settled=True) == 4
        assert len(asked) == 2, asked[2:]  # answered without the source

        # Another range, another n, the skip list: other questions, asked.
        assert source.count_rows(shape, 0, 9, settled=True) == 9
        assert source.count_rows(shape, 0, 10, [RowSkip(3)], settled=True) == 9
        assert source.nth_watermark(shape, 0, 5, 10, settled=True) == 5
        assert len(asked) == 5

        # Rows removed below the watermark (which an append-only table never does): a settled question keeps its
        # answer for the process; the recount (not settled) asks again and sees the source now.
        with pg_engine.begin() as conn:
            conn.execute(text(f"DELETE FROM {name} WHERE id = 2"))
        assert source.count_rows(shape, 0, 10, settled=True) == 10
        assert source.count_rows(shape, 0, 10) == 9
        assert source.nth_watermark(shape, 0, 4, 10) == 5
        assert len(asked) == 7

        # The table's `where:` is part of the question.
        assert source.count_rows(filtered, 0, 10, settled=True) == 4
        assert len(asked) == 8
    finally:
        SETTLED_ANSWERS.clear()
        source.dispose()


def test_a_retry_whose_slices_were_deleted_does_not_hold_the_table(services, pg_database, pg_engine,
                                                                  dagster_instance, spark, name, monkeypatch) -> None:
    """An admin deleted a queued run's partitions in the UI; the sensor cut the range again (its last slice, short
    before, now longer), and Dagster's retry of a run on the old slices was created but could never be queued
    ("Nonexistent partition keys"): five retries in a row, each failed by run monitoring after 120 s, while the
    sensor counted them as queued and held the table ~10 minutes. Now such a run is canceled
    (a canceled run is not retried) and the table's slices go on."""
    from dagster import DagsterRunStatus
    from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG
    from dagster._core.test_utils import create_run_for_test  # Dagster's own test helper: a run in a given state

    from orchestration import sensors
    from orchestration.factory import job_name

    _pg_table(pg_engine, name, 25)
    h = Harness(relay_config(services, {"src": pg_database}, [_table_cfg(name, slice_max_rows=10,
                                                                           settle_seconds=0)]), dagster_instance)
    table = h.table()
    first, last = h.cut(table)[0].split("...")
    assert last == "000000000020-000000000025"
    stuck = create_run_for_test(dagster_instance, job_name=job_name(table), status=DagsterRunStatus.NOT_STARTED,
                                tags={ASSET_PARTITION_RANGE_START_TAG: first, ASSET_PARTITION_RANGE_END_TAG: last})
    partitions = sensors.partitions_for(table).name
    for key in dagster_instance.get_dynamic_partitions(partitions):
        dagster_instance.delete_dynamic_partition(partitions, key)
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' FROM generate_series(1, 10)"))
    assert h.cut(table) == [f"{first}...000000000030-000000000035"]  # cut again: (20, 25] is no slice any more
    h.tick(table)  # within the grace a run just created is let be queued
    assert "still queued or running" in (h.skip_messages[table.table_id] or "")
    monkeypatch.setattr(sensors, "UNSTARTED_GRACE_S", 0.0)  # as 30 s later
    h.tick(table)
    canceled = dagster_instance.get_run_by_id(stuck.run_id)
    assert canceled is not None and canceled.status == DagsterRunStatus.CANCELED
    assert "still queued or running" not in (h.skip_messages[table.table_id] or "")
