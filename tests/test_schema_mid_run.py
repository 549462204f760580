"""Columns changed in the middle of a run: every slice is read with the shape its progress record names, on the
real stack (PostgreSQL and MariaDB; a local Spark session)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import text

from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from tests.pipeline import Harness, assert_exactly_once, read_topic, relay_config
from tests.test_errors import failure_text

pytestmark = pytest.mark.integration

ROWS, SLICE_ROWS = 1800, 300  # six slices in one run
DDL_AFTER_SLICES = 2  # the columns change once this many slices of the run are committed
# Slices the run may have read before the change landed: those committed, and the read-ahead's (its depth is the
# IO manager's prefetch_chunks, 2 by default; each slice here is one chunk).
MAY_PRECEDE = DDL_AFTER_SLICES + 2

CREATE = {
    "postgresql": "CREATE TABLE {t} (id bigserial PRIMARY KEY, a int NOT NULL, b int NOT NULL, d date NOT NULL)",
    "mariadb": "CREATE TABLE {t} (id BIGINT AUTO_INCREMENT PRIMARY KEY, a INT NOT NULL, b INT NOT NULL, "
               "d DATE NOT NULL)",
}
FILL = {
    "postgresql": "INSERT INTO {t} (a, b, d) SELECT g, 2 * g, DATE '2026-01-01' + (g % 300) "
                  "FROM generate_series(1, :n) g",
    "mariadb": "INSERT INTO {t} (a, b, d) SELECT seq, 2 * seq, DATE '2026-01-01' + INTERVAL (seq % 300) DAY "
               "FROM seq_1_to_{n}",
}
# PostgreSQL cannot move a column: two columns of one type swap names, so the list of columns reads reordered.
CHANGES = {
    ("postgresql", "add"): ["ALTER TABLE {t} ADD COLUMN extra text NOT NULL DEFAULT 'x'"],
    ("postgresql", "drop"): ["ALTER TABLE {t} DROP COLUMN b"],
    ("postgresql", "retype"): ["ALTER TABLE {t} ALTER COLUMN d TYPE timestamp USING d + time '10:30'"],
    ("postgresql", "reorder"): ["ALTER TABLE {t} RENAME COLUMN a TO tmp", "ALTER TABLE {t} RENAME COLUMN b TO a",
                                "ALTER TABLE {t} RENAME COLUMN tmp TO b"],
    ("mariadb", "add"): ["ALTER TABLE {t} ADD COLUMN extra VARCHAR(8) NOT NULL DEFAULT 'x'"],
    ("mariadb", "drop"): ["ALTER TABLE {t} DROP COLUMN b"],
    ("mariadb", "retype"): ["ALTER TABLE {t} MODIFY d DATETIME NOT NULL"],
    ("mariadb", "reorder"): ["ALTER TABLE {t} MODIFY b INT NOT NULL AFTER id"],
}
DESCRIBED = {"add": "added extra", "drop": "dropped b", "retype": "retyped d", "reorder": "reordered to"}
# `follow` for every change on both databases; `fail` for each change once (the file's run time is kept short).
# "between": the change lands once two slices are committed; "during_read": between the third slice's check of the
# columns and its read (the read raced the DDL: read again with the new columns).
CASES = [*((dialect, change, "follow", "between") for dialect in ("postgresql", "mariadb") for change in DESCRIBED),
         ("postgresql", "retype", "fail", "between"), ("postgresql", "add", "fail", "between"),
         ("mariadb", "reorder", "fail", "between"), ("postgresql", "retype", "follow", "during_read"),
         ("mariadb", "drop", "fail", "during_read")]


def expected_value(dialect: str, change: str, row_id: int, names: list[str]) -> dict[str, Any]:
    """The row as a message of a slice recorded with columns `names` holds it: the source's row under that shape.
    `d` is checked apart (its text depends on the recorded type)."""
    a, b = row_id, 2 * row_id
    if dialect == "postgresql" and change == "reorder" and names.index("b") < names.index("a"):
        a, b = b, a  # the names were swapped: the column now named b holds what a held
    row = {"id": row_id, "a": a, "b": b, "extra": "x"}
    return {n: row[n] for n in names if n != "d"}


def check_each_message_by_its_record(dialect: str, change: str, messages: list[Any], records: list[Any]) -> None:
    """Each message's fields are its slice's recorded columns, in order, holding the source row under them; a date
    recorded as a date is a date, a retyped one carries its time."""
    for m in messages:
        row_id = m.value["id"]
        (record,) = [r for r in records if r.lo < row_id <= r.hi]
        names = [n for n, _ in record.columns]
        assert list(m.value) == names, f"row {row_id}: fields {list(m.value)}, its slice records {names}"
        assert {k: v for k, v in m.value.items() if k != "d"} == expected_value(dialect, change, row_id, names), \
            f"row {row_id} of slice {record.slice} ({record.columns}): {m.value}"
        d_type = dict(record.columns)["d"]
        if d_type == "DATE":
            assert len(m.value["d"]) == 10, f"row {row_id}: {m.value['d']!r} in a slice recorded with d {d_type}"
        else:
            assert len(m.value["d"]) > 10, f"row {row_id}: {m.value['d']!r} in a slice recorded with d {d_type}"
            assert dialect != "postgresql" or "10:30" in m.value["d"], m.value


def ddl_after_commits(engine: Any, statements: list[str], after: int) -> Callable[[str], None]:
    """A publisher stage hook that changes the table's columns once `after` slices are committed."""
    seen = {"committed": 0}

    def on_stage(stage: str) -> None:
        if stage != "committed":
            return
        seen["committed"] += 1
        if seen["committed"] == after:
            with engine.begin() as conn:
                for statement in statements:
                    conn.execute(text(statement))

    return on_stage


def ddl_before_read(engine: Any, statements: list[str], slice_index: int) -> Callable[..., Any]:
    """SparkResource.read_slice that changes the table's columns right before the first read of slice
    `slice_index` (0-based; one chunk per slice), after that slice's columns were checked."""
    from resources.spark import SparkResource

    read_slice, done = SparkResource.read_slice, [False]

    def racing(self: Any, source: Any, shape: Any, chunk: Any, expected_rows: int, **more: Any) -> Any:
        if chunk.lo == slice_index * SLICE_ROWS and not done[0]:
            done[0] = True
            with engine.begin() as conn:
                for statement in statements:
                    conn.execute(text(statement))
        return read_slice(self, source, shape, chunk, expected_rows, **more)

    return racing


@pytest.mark.parametrize(("dialect", "change", "policy", "when"), CASES, ids=["-".join(c) for c in CASES])
def test_columns_changed_mid_run(request, services, dagster_instance, spark, name, monkeypatch, dialect: str,
                                 change: str, policy: str, when: str) -> None:
    """A run of six slices; its columns change after the first two are committed. Before: every later slice was
    read with the run's first shape and recorded with it (a retyped date published as a date, `fail` never
    stopped). Now: `fail` stops before the first slice of the new shape (nothing of it in Kafka, progress at the
    last slice of the old one); `follow` publishes the new rendering and records it; every message matches the
    columns its slice records."""
    from assets.identity import channel_for
    from assets.shape import table_shape
    from resources.exactly_once import live_records, publisher, read_progress_history
    from resources.kafka_io_manager import STOPPED_TAG
    from resources.source_database import SourceDatabaseResource
    from resources.spark import SparkResource

    database = request.getfixturevalue("pg_database" if dialect == "postgresql" else "mariadb_database")
    engine = request.getfixturevalue("pg_engine" if dialect == "postgresql" else "mariadb_engine")
    qualified = f"public.{name}" if dialect == "postgresql" else name
    with engine.begin() as conn:
        conn.execute(text(CREATE[dialect].format(t=name)))
        conn.execute(text(FILL[dialect].format(t=name, n=ROWS)), {"n": ROWS})
    cfg = relay_config(services, {"src": database}, [
        {"source": "src", "table": qualified, "watermark": "id", "slice_max_rows": SLICE_ROWS,
         "max_slices_per_run": 20, "settle_seconds": 0, "on_schema_change": policy}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    (run_key,) = h.cut(table)
    keys = h.expand(table, run_key)
    assert len(keys) == ROWS // SLICE_ROWS
    statements = [s.format(t=name) for s in CHANGES[(dialect, change)]]
    if when == "between":
        monkeypatch.setattr(publisher, "env_failpoint", ddl_after_commits(engine, statements, DDL_AFTER_SLICES))
    else:
        monkeypatch.setattr(SparkResource, "read_slice", ddl_before_read(engine, statements, DDL_AFTER_SLICES))
    result = h.run(table, run_key, raise_on_error=False)

    conf = {"bootstrap.servers": services.kafka_bootstrap}
    records = [r for r in live_records(read_progress_history(conf, channel_for(table, PREFIX))) if r.hi > r.lo]
    messages = read_topic(services.kafka_bootstrap, table.topic_name)
    progress = h.progress(table)
    assert progress is not None
    assert_exactly_once(messages, list(range(1, progress.hi + 1)))  # nothing of an unpublished slice is visible
    check_each_message_by_its_record(dialect, change, messages, records)
    source = SourceDatabaseResource(url=cfg.sources["src"].url)
    try:
        now = table_shape(source, table).schema_columns
    finally:
        source.dispose()
    old = records[0].columns
    assert old != now
    old_slices = [r for r in records if r.columns == old]
    # during_read: the slice before the raced one may be read alongside it and checked after the change: read
    # again then too (each chunk's check is after its read).
    low, high = (DDL_AFTER_SLICES, MAY_PRECEDE) if when == "between" else (DDL_AFTER_SLICES - 1, DDL_AFTER_SLICES)
    assert low <= len(old_slices) <= high, [r.columns for r in records]
    if policy == "fail":
        assert not result.success, "the run went on publishing after the columns changed"
        assert DESCRIBED[change] in failure_text(result) and "rowrelay schema accept" in failure_text(result)
        assert records == old_slices and progress.hi == old_slices[-1].hi < ROWS
        assert dagster_instance.get_run_by_id(result.run_id).tags.get(STOPPED_TAG) == "schema_change"
        return
    assert result.success, failure_text(result)
    assert progress.hi == ROWS
    assert records[-1].columns == now, "the run published the new columns' rows with the old columns"
    first_new = records[len(old_slices)]
    assert first_new.columns == now
    assert DESCRIBED[change] in h.materialization(table, first_new.slice)["schema_change"]
