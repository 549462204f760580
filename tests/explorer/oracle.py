"""The explorer's own check, independent of `rowrelay verify`: the topic read by a read_committed consumer against
the model and the source rows; then `verify` must agree with it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Engine

from assets.identity import channel_for
from orchestration.tables import kafka_conf
from orchestration.verify import verify_table
from resources.config import RelayConfig, TableConfig
from resources.exactly_once import REPLAY_HEADER, TABLE_HEADER, WATERMARK_HEADER, ProgressRecord, read_progress_history
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.slices import datetime_to_micros
from tests.explorer.model import TableModel, admits
from tests.pipeline import Consumed, read_topic


def source_rows(engine: Engine, table: TableConfig) -> dict[str, dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(text(f"SELECT * FROM {table.table_name}")).mappings().all()
    return {r["tok"]: dict(r) for r in rows}


def watermark_of(value: Any) -> int:
    return datetime_to_micros(value) if isinstance(value, datetime) else int(value)


@dataclass(frozen=True)
class Columns:
    """The table's column changes the schedule made: added, later dropped, retyped from bigint to text."""

    added: frozenset[str] = frozenset()
    dropped: frozenset[str] = frozenset()
    retyped: frozenset[str] = frozenset()


def same_value(col: str, got: Any, want: Any, columns: Columns) -> bool:
    if isinstance(want, datetime):
        got = datetime.fromisoformat(got) if isinstance(got, str) else got
    if col in columns.retyped and got is not None and want is not None:  # sent as a number before, text after
        return str(got) == str(want)
    return bool(got == want)


def payload_problems(msg: Consumed, row: dict[str, Any], table: TableConfig, table_id: str,
                     columns: Columns) -> list[str]:
    """The message's value equals the source row column by column (a column added later may be absent from a
    message published before it, where the row holds NULL in it; a column dropped since is in messages published
    before); its headers name the table and the row's watermark."""
    out = []
    absent = set(row) - set(msg.value)
    if set(msg.value) - set(row) - columns.dropped or absent - {c for c in columns.added if row.get(c) is None}:
        out.append(f"columns {sorted(msg.value)} != source {sorted(row)}")
    for col, want in row.items():
        if col in absent:
            continue
        got = msg.value.get(col)
        if not same_value(col, got, want, columns):
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
                    table: TableConfig, columns: Columns) -> list[str]:
    """Each `rowrelay replay` copied exactly the source rows of its range (lo, hi] that the range's `where:`
    admitted, once each, values unchanged."""
    out = []
    by_id: dict[str, list[str]] = {}
    for m in copies:
        by_id.setdefault(m.headers[REPLAY_HEADER].decode(), []).append(m.value.get("tok"))
        row = rows.get(m.value.get("tok"))
        if row is None or any(not same_value(c, m.value.get(c), v, columns) for c, v in row.items()
                              if not isinstance(v, datetime) and c in m.value):
            out.append(f"replay copy {m.value} differs from its source row {row}")
    for replay_id, (lo, hi, where) in model.replays.items():
        want = sorted(t for t, r in rows.items() if lo < watermark_of(r[table.watermark]) <= hi
                      and t in model.committed - model.skipped and admits(where, r["v"]))
        if sorted(by_id.pop(replay_id, [])) != want:
            out.append(f"replay {replay_id} of ({lo}, {hi}] did not copy its {len(want)} rows exactly once")
    out.extend(f"replay copies nobody made: {rid}" for rid in by_id)
    return out


def shape_problems(messages: list[Consumed], history: list[ProgressRecord], columns: Columns) -> list[str]:
    """Each message carries the columns its slice's progress record says it was read with (a NULL may be left
    out), a retyped column rendered as that record's type: a number under BIGINT, text under a text type."""
    out: list[str] = []
    spans = [(int(p), first, last, r) for r in history if r.columns for p, (first, last) in r.offsets.items()]
    for m in messages:
        record = next((r for p, first, last, r in spans if p == m.partition and first <= m.offset <= last), None)
        if record is None:
            continue
        shape = {name: kind.upper() for name, kind in record.columns}
        if set(m.value) - set(shape) or any(m.value.get(c) is not None for c in set(shape) - set(m.value)):
            out.append(f"tok {m.value.get('tok')}: columns {sorted(m.value)}, its slice {record.slice} was read "
                       f"with {sorted(shape)}")
        for col in columns.retyped & set(m.value):
            got = m.value[col]
            if got is not None and isinstance(got, str) != ("INT" not in shape.get(col, "")):
                out.append(f"tok {m.value.get('tok')}: {col} sent as {got!r}, its slice {record.slice} read it as "
                           f"{shape.get(col)}")
        if len(out) > 5:
            break
    return out


def segments(messages: list[Consumed], resets: list[ProgressRecord]) -> list[list[Consumed]]:
    """The messages cut at each reset's position in their partition: segment k came after the k-th reset (segment 0
    before any)."""
    out: list[list[Consumed]] = [[] for _ in range(len(resets) + 1)]
    for m in sorted(messages, key=lambda m: (m.partition, m.offset)):
        ends = [int((r.topic_ends or {}).get(str(m.partition), 0)) for r in resets]
        out[sum(m.offset >= e for e in ends)].append(m)
    return out


@dataclass
class Expected:
    """What `rowrelay verify` must then report, as the oracle counts it from the topic and the resets: after a reset
    back, each message above the newest reset's W sent before its position is a duplicate of a row re-sent after
    it (docs/operations.md: "which they are"), or extra where today's filter no longer admits that row; those at or
    below W sent before it are left out (`before_start`)."""

    duplicates: int = 0
    extra: int = 0
    before_start: int = 0


def reset_problems(parts: list[list[Consumed]], resets: list[ProgressRecord], must: set[str], committed: set[str],
                   rows: dict[str, dict[str, Any]], table: TableConfig) -> tuple[list[str], Expected]:
    """After the newest reset to W: each row to send above W exactly once, none at or below W, nothing else. Before
    it: each row to send at or below W sent at least once, and only committed rows (a reset back re-sends those above
    it, so they may appear again). Between resets: nothing at or below the reset's W, no row twice, in order."""
    out = []
    last_w = resets[-1].hi if resets else None

    def wm(t: str) -> int:
        return watermark_of(rows[t][table.watermark])

    above = {t for t in must if t in rows and (last_w is None or wm(t) > last_w)}
    seen = Counter(m.value.get("tok") for m in parts[-1])
    for label, toks in (("duplicated", sorted(t for t, n in seen.items() if n > 1)),
                        ("missing", sorted(above - set(seen))),
                        ("extra", sorted(str(t) for t in set(seen) - above))):
        if toks:
            where = f" after the reset to {last_w}" if resets else ""
            out.append(f"{len(toks)} {label} rows{where}, e.g. {toks[:5]}")
            if label == "missing":
                out.append(f"missing rows' (watermark, id): {sorted((wm(t), rows[t]['id']) for t in toks)[:5]}")
    earlier = [m for part in parts[:-1] for m in part]
    lost = sorted(must - above - {m.value.get("tok") for m in earlier})
    if lost:
        out.append(f"{len(lost)} rows at or below the reset to {last_w} never sent before it, e.g. {lost[:5]}")
    stray = sorted({str(m.value.get("tok")) for m in earlier} - committed)
    if stray:
        out.append(f"{len(stray)} rows sent before the newest reset that no writer committed, e.g. {stray[:5]}")
    for k, part in enumerate(parts[:-1]):
        twice = sorted(t for t, n in Counter(m.value.get("tok") for m in part).items() if n > 1)
        if twice:
            out.append(f"{len(twice)} rows sent twice between reset {k} and the next, e.g. {twice[:5]}")
    for k, part in enumerate(parts):
        if k:
            below = [m.value.get("tok") for m in part if m.watermark <= resets[k - 1].hi]
            if below:
                out.append(f"{len(below)} rows at or below reset {k}'s {resets[k - 1].hi} sent after it: {below[:5]}")
        out.extend(f"after reset {k}: {p}" if k else p for p in order_problems(part, table))
    expected = Expected()
    if last_w is not None:
        for m in earlier:
            if m.watermark <= last_w:
                expected.before_start += 1
            elif m.value.get("tok") in above:
                expected.duplicates += 1
            else:
                expected.extra += 1
    return out, expected


def verify_disagrees(report: Any, expected: Expected, oracle_ok: bool) -> str | None:
    """`rowrelay verify` agrees when the oracle found nothing wrong and verify counts what the resets left (no
    missing rows, no order violation), or when both found something."""
    counts = {"duplicates": report.duplicates, "extra": report.extra, "missing": report.missing,
              "order_violations": report.order_violations, "before_start": report.before_start}
    want = {"duplicates": expected.duplicates, "extra": expected.extra, "missing": 0, "order_violations": 0,
            "before_start": expected.before_start}
    if oracle_ok and counts != want:
        return f"verify disagrees with the oracle: it counts {counts}, the oracle {want}: {report}"
    if not oracle_ok and counts == want and report.ok:
        return f"verify disagrees with the oracle: it found nothing wrong: {report}"
    return None


def check_table(config: RelayConfig, table: TableConfig, engine: Engine, model: TableModel,
                table_id: str, bootstrap: str, columns: Columns = Columns()) -> list[str]:
    """Every problem found: [] when the topic holds each row the model must send exactly once (after the newest
    reset; before it, at least once each), in order, equal to its source row, nothing else, and `verify` agrees."""
    committed = model.must_send()
    rows = source_rows(engine, table)
    problems = []
    # The model and the source disagree: the explorer's own bug, or a source's.
    if set(rows) - model.skipped != committed:
        problems.append(f"model vs source: only in source {sorted(set(rows) - committed)[:5]}, "
                        f"only in model {sorted(committed - set(rows))[:5]}")
    must = {t for t in committed if t in rows
            and admits(model.where_for(watermark_of(rows[t][table.watermark])), rows[t]["v"])}
    messages = read_topic(bootstrap, table.topic_name)
    copies = [m for m in messages if REPLAY_HEADER in m.headers]
    messages = [m for m in messages if REPLAY_HEADER not in m.headers]
    problems.extend(replay_problems(copies, rows, model, table, columns))
    history = read_progress_history(kafka_conf(config), channel_for(table, PREFIX))
    resets = [r for r in history if r.topic_ends is not None]  # each names its W and where the topic ended
    problems.extend(shape_problems(messages, history, columns))
    if len(resets) != len(model.resets) or [r.hi for r in resets] != model.resets:
        problems.append(f"progress records resets at {[r.hi for r in resets]}, the schedule made {model.resets}")
    found, expected = reset_problems(segments(messages, resets), resets, must, committed, rows, table)
    problems.extend(found)
    for m in messages:
        if m.value.get("tok") in rows:
            problems.extend(payload_problems(m, rows[m.value["tok"]], table, table_id, columns)[:3])
    report = verify_table(config, table)
    disagreement = verify_disagrees(report, expected, not problems)
    if disagreement:
        problems.append(disagreement)
    elif problems:
        problems.append(f"verify: {report}")
    return problems
