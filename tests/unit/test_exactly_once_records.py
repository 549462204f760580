"""resources/exactly_once/records.py: progress records, their history and watermark."""

from __future__ import annotations

import dataclasses
import json

from resources.exactly_once import ProgressRecord, live_records, tiling
from resources.slices import SliceRange


def test_progress_record_json_is_every_field_sorted_and_reads_back() -> None:
    """The progress record's bytes on Kafka: every field by name, keys sorted, nested values as they are (the
    format records already on Kafka were written in), and the same record back from them."""
    record = ProgressRecord("src.public.t", "000000000010-000000000020", 10, 20, 10, 1234, "ab" * 32, "t.topic",
                            {"0": [5, 14], "1": [7, 7]}, "rowrelay-src.public.t", "2026-11-24T16:00:00+00:00", 0.25,
                            columns=[["id", "bigint"], ["note", "text"]], schema_fingerprint="f1")
    raw = record.to_json()
    assert raw == json.dumps(dataclasses.asdict(record), sort_keys=True).encode()
    assert list(json.loads(raw)) == sorted(f.name for f in dataclasses.fields(ProgressRecord))
    assert ProgressRecord.from_json(raw) == record


def test_a_reset_back_supersedes_the_slices_above_it() -> None:
    """After a reset back (a re-created table, say), the old slices above the reset are not the range's any more,
    even where their bounds fit it: replay, loading a slice and the parity check must take the new ones."""
    def rec(lo: int, hi: int, tag: str = "") -> ProgressRecord:
        return ProgressRecord("t", SliceRange(lo, hi).key if hi > lo else f"reset-{hi}", lo, hi, hi - lo, 0, tag, "t")

    history = [rec(0, 100, "old"), rec(100, 200, "old"), rec(200, 300, "old"), rec(150, 150),  # reset back to 150
               rec(150, 250, "new"), rec(250, 300, "new"), rec(500, 500),  # a reset forward supersedes nothing
               rec(500, 600, "new")]
    live = live_records(history)
    assert [(r.lo, r.hi, r.checksum) for r in live] == [
        (0, 100, "old"), (150, 150, ""), (150, 250, "new"), (250, 300, "new"), (500, 500, ""), (500, 600, "new")]
    assert [r.checksum for r in tiling(SliceRange(150, 300), live)] == ["new", "new"]
    assert tiling(SliceRange(200, 300), live) is None  # only an old slice started there
    # The first records found for a range used to be taken when they tiled it: the old slice, for (200, 300].
    assert [r.checksum for r in tiling(SliceRange(200, 300), history[:3])] == ["old"]
    # A second reset back, below the first: everything above it goes, earlier resets stay (records without range).
    again = live_records([*history, rec(50, 50), rec(50, 120, "newer")])
    assert [(r.lo, r.hi) for r in again] == [(150, 150), (500, 500), (50, 50), (50, 120)]


def test_watermark_change_names_another_column_or_kind_and_accepts_what_it_cannot_tell() -> None:
    from resources.exactly_once import watermark_change

    ts_key = SliceRange(1_700_000_000_000_000, 1_700_000_001_000_000, timestamps=True).key
    by_id = ProgressRecord("s.p.t", "000000000000-000000000050", 0, 50, 50, 1, "", "t", watermark="id",
                           watermark_kind="integer")
    assert watermark_change(by_id, "id", "integer") is None
    moved = watermark_change(by_id, "seq", "integer")
    assert moved is not None and "column 'id'" in moved and "now 'seq'" in moved and "rowrelay reset" in moved
    assert "a timestamp" in (watermark_change(by_id, "id", "timestamp") or "")
    zoneless = ProgressRecord("s.p.t", ts_key, 1_700_000_000_000_000, 1_700_000_001_000_000, 5, 1, "", "t",
                              watermark="created_at", watermark_kind="timestamp")
    retyped = watermark_change(zoneless, "created_at", "timestamptz")
    assert retyped is not None and "2023-11-14T22:13:21" in retyped and "keep UTC" in retyped
    # Records of versions before the fields: a slice's key still tells an integer from a time, not the zone.
    old_int = dataclasses.replace(by_id, watermark=None, watermark_kind=None)
    old_time = dataclasses.replace(zoneless, watermark=None, watermark_kind=None)
    assert watermark_change(old_int, "seq", "integer") is None
    assert "an integer column" in (watermark_change(old_int, "created_at", "timestamptz") or "")
    assert "an integer column" in (watermark_change(old_time, "id", "integer") or "")
    assert watermark_change(old_time, "created_at", "timestamptz") is None
    # A baseline or reset without the fields (its key is an integer either way): nothing to compare.
    assert watermark_change(ProgressRecord("s.p.t", "reset-5", 5, 5, 0, 0, "", "t"), "created_at", "timestamp") is None
    # Written with them, a reset sets the table's watermark from then on.
    reset = ProgressRecord("s.p.t", "reset-1080", 1080, 1080, 0, 0, "", "t", watermark="seq", watermark_kind="integer")
    assert watermark_change(reset, "seq", "integer") is None and watermark_change(reset, "id", "integer")
    assert ProgressRecord.from_json(reset.to_json()) == reset
