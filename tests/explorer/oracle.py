"""The explorer's own check, independent of `rowrelay verify`: the topic read by a read_committed consumer against
the model and the source rows; then `verify` must agree with it."""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Engine

from orchestration.verify import verify_table
from resources.config import RelayConfig, TableConfig
from resources.exactly_once import REPLAY_HEADER, TABLE_HEADER, WATERMARK_HEADER
from resources.slices import datetime_to_micros
from tests.explorer.model import TableModel
from tests.pipeline import Consumed, read_topic


def source_rows(engine: Engine, table: TableConfig) -> dict[str, dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(text(f"SELECT * FROM {table.table_name}")).mappings().all()
    return {r["tok"]: dict(r) for r in rows}


def watermark_of(value: Any) -> int:
    return datetime_to_micros(value) if isinstance(value, datetime) else int(value)


def payload_problems(msg: Consumed, row: dict[str, Any], table: TableConfig, table_id: str,
                     added: frozenset[str] | set[str]) -> list[str]:
    """The message's value equals the source row column by column (a column added later may be absent from a
    message published before it, where the row holds NULL in it); its headers name the table and the row's
    watermark."""
    out = []
    absent = set(row) - set(msg.value)
    if set(msg.value) - set(row) or absent - {c for c in added if row[c] is None}:
        out.append(f"columns {sorted(msg.value)} != source {sorted(row)}")
    for col, want in row.items():
        if col in absent:
            continue
        got = msg.value.get(col)
        if isinstance(want, datetime):
            got = datetime.fromisoformat(got) if isinstance(got, str) else got
        if got != want:
            out.append(f"{col}: sent {msg.value.get(col)!r}, source {want!r}")
    if msg.headers.get(TABLE_HEADER) != table_id.encode():
        out.append(f"header {TABLE_HEADER} {msg.headers.get(TABLE_HEADER)!r}")
    wm = watermark_of(row[table.watermark])
    if msg.headers.get(WATERMARK_HEADER) != str(wm).encode():
        out.append(f"header {WATERMARK_HEADER} {msg.headers.get(WATERMARK_HEADER)!r}, row's {wm}")
    return [f"tok {row['tok']}: {p}" for p in out]


def order_problems(messages: list[Consumed], table: TableConfig) -> list[str]:
    """Within each partition, offsets follow (watermark, tie_break)."""
    out = []
    by_partition: dict[int, list[Consumed]] = {}
    for m in sorted(messages, key=lambda m: (m.partition, m.offset)):
        by_partition.setdefault(m.partition, []).append(m)
    for p, ms in by_partition.items():
        keys = [(m.watermark, m.value.get(table.tie_break or "id")) for m in ms]
        bad = [i for i in range(1, len(keys)) if keys[i] < keys[i - 1]]
        if bad:
            out.append(f"partition {p}: {len(bad)} messages out of order, first at offset {ms[bad[0]].offset}: "
                       f"{keys[bad[0] - 1]} then {keys[bad[0]]}")
    return out


def replay_problems(copies: list[Consumed], rows: dict[str, dict[str, Any]], model: TableModel,
                    table: TableConfig) -> list[str]:
    """Each `rowrelay replay` copied exactly the source rows of its range (lo, hi], once each, values unchanged."""
    out = []
    by_id: dict[str, list[str]] = {}
    for m in copies:
        by_id.setdefault(m.headers[REPLAY_HEADER].decode(), []).append(m.value.get("tok"))
        row = rows.get(m.value.get("tok"))
        if row is None or any(m.value.get(c) != v for c, v in row.items() if not isinstance(v, datetime)
                              and c in m.value):
            out.append(f"replay copy {m.value} differs from its source row {row}")
    for replay_id, (lo, hi) in model.replays.items():
        want = sorted(t for t, r in rows.items() if lo < watermark_of(r[table.watermark]) <= hi)
        if sorted(by_id.pop(replay_id, [])) != want:
            out.append(f"replay {replay_id} of ({lo}, {hi}] did not copy its {len(want)} rows exactly once")
    out.extend(f"replay copies nobody made: {rid}" for rid in by_id)
    return out


def check_table(config: RelayConfig, table: TableConfig, engine: Engine, model: TableModel,
                table_id: str, bootstrap: str, added: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Every problem found: [] when the topic holds each row the model must send exactly once, in order, equal to
    its source row, nothing else, and `verify` agrees."""
    must = model.must_send()
    rows = source_rows(engine, table)
    problems = []
    if set(rows) != must:  # the model and the source disagree: the explorer's own bug, or a source's
        problems.append(f"model vs source: only in source {sorted(set(rows) - must)[:5]}, "
                        f"only in model {sorted(must - set(rows))[:5]}")
    messages = read_topic(bootstrap, table.topic_name)
    copies = [m for m in messages if REPLAY_HEADER in m.headers]
    messages = [m for m in messages if REPLAY_HEADER not in m.headers]
    problems.extend(replay_problems(copies, rows, model, table))
    seen = Counter(m.value.get("tok") for m in messages)
    dupes = sorted(t for t, n in seen.items() if n > 1)
    missing = sorted(must - set(seen))
    extra = sorted(str(t) for t in set(seen) - must)
    for label, toks in (("duplicated", dupes), ("missing", missing), ("extra", extra)):
        if toks:
            problems.append(f"{len(toks)} {label} rows, e.g. {toks[:5]}")
    if missing:
        lost = sorted((watermark_of(rows[t][table.watermark]), rows[t]["id"]) for t in missing if t in rows)
        problems.append(f"missing rows' (watermark, id): {lost[:5]}")
    for m in messages:
        if m.value.get("tok") in rows:
            problems.extend(payload_problems(m, rows[m.value["tok"]], table, table_id, added)[:3])
    problems.extend(order_problems(messages, table))
    report = verify_table(config, table)
    if report.ok != (not problems):
        problems.append(f"verify disagrees with the oracle: {report}")
    elif not report.ok:
        problems.append(f"verify: {report}")
    return problems
