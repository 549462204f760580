"""Pure logic: slice keys, cutting slices, settling watermarks, the slice checksum, configuration validation."""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
from datetime import UTC, datetime

import pyarrow as pa
import pytest

from resources.config import ConfigError, parse_config, resolve_env, resolve_url_env
from resources.exactly_once import (
    MessageBatch,
    OutgoingMessage,
    ProgressRecord,
    SliceDigest,
    SliceOutOfOrder,
    live_records,
    slice_checksum,
    tiling,
)
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.slices import SliceRange, WatermarkCandidate, cut_slices, settle


def test_slice_key_round_trip_and_sorts_like_ranges() -> None:
    slices = [SliceRange(0, 100), SliceRange(100, 2_000), SliceRange(2_000, 10_000_000)]
    assert [SliceRange.from_key(s.key) for s in slices] == slices
    assert sorted(s.key for s in slices) == [s.key for s in slices]
    assert SliceRange(0, 100).key == "000000000000-000000000100"
    with pytest.raises(ValueError):
        SliceRange(5, 5)
    with pytest.raises(ValueError, match="not a slice partition key"):
        SliceRange.from_key("2024-01-01")


def test_timestamp_keys_before_the_year_1000_are_fixed_width_and_read_back() -> None:
    """glibc's strftime("%Y") writes year 500 as "500": such a key was refused as "not a slice partition key" by
    every run and tick, and the times messages suggested for `start_after` did not parse."""
    from resources.slices import datetime_to_micros, micros_text, parse_watermark

    first = datetime_to_micros(datetime(1, 1, 1, tzinfo=UTC))
    year_500 = datetime_to_micros(datetime(500, 3, 14, 1, 2, 3, 4, tzinfo=UTC))
    now = datetime_to_micros(datetime(2026, 11, 29, tzinfo=UTC))
    assert micros_text(first) == "0001-01-01T00:00:00.000000Z"
    assert micros_text(year_500) == "0500-03-14T01:02:03.000004Z"
    slices = [SliceRange(first, year_500, timestamps=True), SliceRange(year_500, now, timestamps=True)]
    assert [SliceRange.from_key(s.key) for s in slices] == slices
    assert sorted(s.key for s in slices) == [s.key for s in slices]
    assert parse_watermark(micros_text(year_500)) == year_500


def _table(ids: list[int]):
    ids = sorted(ids)

    def nth(after: int, n: int, upto: int) -> int | None:
        i = bisect.bisect_right(ids, after) + n - 1
        return ids[i] if i < len(ids) and ids[i] <= upto else None

    def mx(after: int, upto: int) -> int | None:
        within = [i for i in ids if after < i <= upto]
        return max(within) if within else None

    return nth, mx


def test_cut_slices_by_row_count_with_gaps() -> None:
    ids = [1, 2, 3, 10, 11, 50, 51, 52, 53, 1000]
    nth, mx = _table(ids)
    slices = cut_slices(0, 1000, 3, nth, mx)
    assert slices == [SliceRange(0, 3), SliceRange(3, 50), SliceRange(50, 53), SliceRange(53, 1000)]
    # Every id lands in exactly one slice.
    assert sorted(i for s in slices for i in ids if s.lo < i <= s.hi) == ids


def test_cut_slices_stops_at_safe_watermark_and_limit() -> None:
    nth, mx = _table(list(range(1, 101)))
    assert cut_slices(0, 45, 10, nth, mx) == [SliceRange(0, 10), SliceRange(10, 20), SliceRange(20, 30),
                                               SliceRange(30, 40), SliceRange(40, 45)]
    assert cut_slices(0, 100, 10, nth, mx, limit=2) == [SliceRange(0, 10), SliceRange(10, 20)]
    assert cut_slices(100, 100, 10, nth, mx) == []
    assert cut_slices(100, 150, 10, nth, mx) == []  # safe but no rows above 100


def test_settle_keeps_unfinished_candidates() -> None:
    cands = [WatermarkCandidate(10, 1.0), WatermarkCandidate(20, 2.0), WatermarkCandidate(30, 3.0)]
    safe, pending = settle(cands, lambda c: c.marker <= 2.0)
    assert safe == 20
    assert pending == [WatermarkCandidate(30, 3.0)]
    assert settle(cands, lambda c: False) == (None, cands)


BASE = {
    "sources": {"shop": {"url": "postgresql://u:${PW}@h/db"}},
    "tables": [{"source": "shop", "table": "public.orders", "watermark": "id"}],
    "kafka": {"bootstrap_servers": "k:9092"},
}


def test_sensor_cursor_keeps_a_candidates_log_position_and_reads_cursors_without_it() -> None:
    from orchestration.cutting import SensorState

    state = SensorState([WatermarkCandidate(5, 1.5, ("a|b",), 48132), WatermarkCandidate(9, 2.5)])
    assert SensorState.from_cursor(state.to_cursor()).pending == state.pending
    # A cursor written before log positions were kept: its candidates check the log position at the check.
    old = json.dumps({"pending": [[5, 1.5, ["a|b"]], [9, 2.5]]})
    assert SensorState.from_cursor(old).pending == [WatermarkCandidate(5, 1.5, ("a|b",)), WatermarkCandidate(9, 2.5)]


def test_config_defaults_and_names() -> None:
    import copy

    keyed = copy.deepcopy(BASE)  # the watermark and tie_break are read whatever `columns:` says: keys may use them
    keyed["tables"][0].update(columns=["a"], key=["id", "n"], tie_break="n")
    assert parse_config(keyed).tables[0].key == ["id", "n"]
    cfg = parse_config(BASE)
    t = cfg.tables[0]
    assert t.topic_name == "shop.public.orders"
    assert t.slice_max_rows == 100_000 and t.start_after is None and t.key == "none"
    assert cfg.spark.master == "local[*]"
    assert t.topic_shared_with == ()

    # Tables writing to one topic know of each other (a compacted topic is refused to them, test_edge_publish.py).
    shared = copy.deepcopy(BASE)
    shared["tables"] += [dict(BASE["tables"][0], table="public.refunds", topic="shop.public.orders"),
                         dict(BASE["tables"][0], table="public.carts")]
    from assets.identity import channel_for

    orders, refunds, carts = parse_config(shared).tables
    assert orders.topic_shared_with == ("shop.public.refunds",) and refunds.topic_shared_with == ("shop.public.orders",)
    assert carts.topic_shared_with == () and channel_for(refunds, PREFIX).shared_with == ("shop.public.orders",)


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: c["tables"][0].pop("watermark"), "tables[0].watermark: Field required"),
    (lambda c: c["tables"][0].update(source="nope"), "tables[0].source: 'nope' is not one of"),
    (lambda c: c["tables"][0].update(slice_max_rows=0), "tables[0].slice_max_rows"),
    (lambda c: c["tables"][0].update(key="random"), "tables[0].key"),
    (lambda c: c["tables"][0].update(topic="bad topic!"), "not a valid Kafka topic name"),
    (lambda c: c["tables"][0].update(colour="red"), "tables[0].colour: Extra inputs are not permitted"),
    # A typo names the key meant.
    (lambda c: c["tables"][0].update(slice_max_row=5), "tables[0].slice_max_row: Extra inputs are not permitted "
     "(did you mean 'slice_max_rows'?)"),
    (lambda c: c["sources"]["shop"].update(url="oracle://x"), "unsupported database 'oracle'"),
    (lambda c: c.pop("kafka"), "kafka: Field required"),
    (lambda c: c["tables"].append(dict(c["tables"][0])), "configured twice"),
    # A key column left out of `columns:` failed every run with a bare KeyError, retried forever.
    (lambda c: c["tables"][0].update(columns=["id", "a"], key=["b"]),
     "key columns ['b'] are not among the columns read (['id', 'a']); add them to `columns:`"),
    # The prefix names each progress topic: a '/' failed every run with librdkafka's "Unknown topic".
    (lambda c: c["kafka"].update(transactional_id_prefix="rr/stg"),
     "kafka.transactional_id_prefix: Value error, 'rr/stg' may hold only letters, digits"),
    (lambda c: c["kafka"].update(transactional_id_prefix="r" * 240), "characters, over Kafka's 249"),
    # Settings rowrelay owns: silently overridden, or failing every run as "Expected ... bool type, not str".
    (lambda c: c["kafka"].update(producer={"transactional.id": "prod"}),
     "'transactional.id' cannot be set: rowrelay sets it per table"),
    (lambda c: c["kafka"].update(producer={"delivery.report.only.error": True}),
     "'delivery.report.only.error' cannot be set"),
])
def test_config_errors_name_the_key(change, message) -> None:
    import copy

    data = copy.deepcopy(BASE)
    change(data)
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert message in str(info.value)


def test_env_interpolation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PW", "s3cret")
    assert resolve_env("postgresql://u:${PW}@h/db") == "postgresql://u:s3cret@h/db"
    assert resolve_env("${MISSING_VAR_X:-fallback}") == "fallback"
    monkeypatch.setenv("EMPTY_VAR_X", "")
    assert resolve_env("${EMPTY_VAR_X:-fallback}") == "fallback"  # as a shell does (it gave "")
    assert resolve_env("${EMPTY_VAR_X}") == ""
    monkeypatch.delenv("PW")
    with pytest.raises(ConfigError, match="PW is not set"):
        resolve_env("${PW}")


def test_url_variables_stay_in_their_part_of_the_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """A password spliced raw into a URL moved into the host at its '@' (a review found 'a@b' made the host
    'b@host', named in every error) or failed as a port ('a@b:c'). Each value is now taken literally in its part."""
    from sqlalchemy.engine import make_url

    from resources.source_database import SourceDatabaseResource, SourceError

    secret = "a@b:c/d?e#f%41+g h"
    monkeypatch.setenv("PW", secret)
    monkeypatch.setenv("USR", "us@er")
    monkeypatch.setenv("KEYPW", "k&y=1#")
    monkeypatch.setenv("HOST", "db.example")
    url = make_url(resolve_url_env("postgresql://${USR}:${PW}@${HOST}:5433/db?sslpassword=${KEYPW}&sslmode=require"))
    assert (url.username, url.password, url.host, url.port, url.database) == ("us@er", secret, "db.example", 5433, "db")
    assert dict(url.query) == {"sslpassword": "k&y=1#", "sslmode": "require"}
    assert make_url(resolve_url_env("postgresql://u:${NOPE_X:-p@ss}@h/db")).password == "p@ss"
    assert resolve_url_env("sqlite:///data/${HOST}.db") == "sqlite:///data/db.example.db"
    assert make_url(resolve_url_env("postgresql://u:lit%40eral@h/db")).password == "lit@eral"  # the URL's own escapes
    # A ${VAR} holding user:password, whole parameters, or a parameter's name (found by review).
    monkeypatch.setenv("CREDS", "app:s3:cr@t")
    monkeypatch.setenv("PARAMS", "sslmode=require&connect_timeout=5")
    monkeypatch.setenv("NAME", "sslmode")
    creds = make_url(resolve_url_env("postgresql://${CREDS}@h/db?${PARAMS}&${NAME}=verify-full"))
    assert (creds.username, creds.password) == ("app", "s3:cr@t")
    assert dict(creds.query) == {"sslmode": ("require", "verify-full"), "connect_timeout": "5"}
    assert make_url(resolve_url_env("postgresql://${USR}@h/db")).username == "us@er"
    source = SourceDatabaseResource(url="postgresql://u:${PW}@h:5432/db?sslpassword=${KEYPW}&sslmode=disable")
    assert source.safe_description == "postgresql://u:***@h:5432/db?sslmode=disable&sslpassword=***"
    with pytest.raises(SourceError, match=r"not a valid database URL \(ValueError; its variables: \$\{PW\}\)") as bad:
        _ = SourceDatabaseResource(url="postgresql://u:x@h:${PW}/db").sqlalchemy_url  # a port that is not one
    assert "a@b" not in str(bad.value)


def test_largest_field_names_the_column_behind_a_large_row() -> None:
    from resources.exactly_once import largest_field

    assert largest_field(b'{"id": 7, "note": "' + b"x" * 5000 + b'", "tag": "abc"}') == "note"
    assert largest_field(b'{"op":"insert","data":{"id":1,"blob":"' + b"y" * 900 + b'"},"source":{"table":"t"}}'
                         ) == "blob"
    assert largest_field(b"not json") is None


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


def test_slice_checksum_is_over_values_and_their_lengths_whatever_the_batches() -> None:
    """The documented formula; the same values in other batches give the same checksum, and the same bytes split
    into other values (or reordered) give another."""
    values = [b'{"id":1}', b'{"id":22}', b"", b'{"id":333}']
    lengths = b"".join(len(v).to_bytes(4, "little") for v in values)
    expected = hashlib.sha256(hashlib.sha256(b"".join(values)).digest() + hashlib.sha256(lengths).digest())
    assert slice_checksum(values) == expected.hexdigest()
    digest = SliceDigest()
    digest.update(values[:1])
    digest.update([])
    digest.update(values[1:])
    assert digest.hexdigest() == expected.hexdigest()
    assert slice_checksum([b'{"id":1}{"id":22}', b"", b'{"id":333}']) != expected.hexdigest()
    assert slice_checksum(list(reversed(values))) != expected.hexdigest()


def test_postgres_renders_dates_and_timestamps_except_watermark_and_tie_break_raw() -> None:
    from resources.source_database import ColumnInfo, TableShape

    def col(name: str, source_text: str = "") -> ColumnInfo:
        return ColumnInfo(name=name, type_name="X", nullable=True, is_json=False, is_integer=False,
                          source_text=source_text)

    shape = TableShape(dialect="postgresql", schema="public", name="t", watermark="at", watermark_kind="timestamp",
                       tie_break="seen", columns=(col("id"), col("at", "timestamp"), col("seen", "timestamptz"),
                                                  col("day", "date")))
    ts = "'YYYY-MM-DD\"T\"HH24:MI:SS.US'"
    expected = [
        '"id"', '"at"', '"seen"',  # the watermark and the tie_break: whole (the read filters and sorts on them)
        """CASE WHEN NOT (isfinite("day") AND "day" >= DATE '0001-01-01') AND isfinite("day") """
        """THEN "day" END AS "day\"""",
        # every finite timestamp rendered: a year from 10000 with its sign (past Spark's range too), a BC one as an
        # astronomical year (44 BC: -0043), as Spark gives a BC timestamptz
        f"""CASE WHEN isfinite("at") THEN CASE WHEN "at" >= TIMESTAMP '10000-01-01' THEN '+' || to_char("at", """
        f"""{ts}) WHEN "at" >= TIMESTAMP '0001-01-01' THEN to_char("at", {ts}) WHEN EXTRACT(YEAR FROM "at") = -1 """
        """THEN to_char("at", '"0000"-MM-DD"T"HH24:MI:SS.US') ELSE '-' || lpad(CAST(-1 - CAST(EXTRACT(YEAR FROM """
        """"at") AS int) AS text), 4, '0') || to_char("at", '-MM-DD"T"HH24:MI:SS.US') END """
        """WHEN NOT isfinite("at") THEN "at"::text END AS "__rowrelay_text_1\"""",
        """CASE WHEN isfinite("seen") AND "seen" >= TIMESTAMPTZ '0001-01-01 00:00:00+00' """
        """THEN CASE WHEN "seen" >= TIMESTAMPTZ '10000-01-01 00:00:00+00' THEN '+' ELSE '' END """
        f"""|| to_char("seen" AT TIME ZONE 'UTC', {ts}) || '+00:00' """
        """WHEN NOT isfinite("seen") THEN "seen"::text END AS "__rowrelay_text_2\"""",
        """CASE WHEN isfinite("day") AND "day" >= DATE '0001-01-01' THEN CASE WHEN "day" >= DATE '10000-01-01' """
        """THEN '+' || CAST("day" AS text) ELSE to_char("day", 'YYYY-MM-DD') END """
        """WHEN NOT isfinite("day") THEN "day"::text END AS "__rowrelay_text_3\"""",
    ]
    assert shape.rendered_select(lambda n: f'"{n}"') == ", ".join(expected)
    assert shape.source_texts == {"at": "__rowrelay_text_1", "seen": "__rowrelay_text_2", "day": "__rowrelay_text_3"}
    plain = TableShape(dialect="postgresql", schema=None, name="t", watermark="id", columns=(col("id"), col("v")))
    assert plain.rendered_select(lambda n: n) is None and plain.source_texts == {}


def test_slice_checksum_from_arrow_buffers_matches_the_values() -> None:
    """The publisher's digest straight from an Arrow batch's buffers (also sliced at an offset, and all-empty
    values without a data buffer) equals the documented formula over the same values."""
    values = [b'{"id":1}', b"", "{\"s\":\"é\u0000\"}".encode(), b'{"id":4444}', b"x" * 70_000]
    array = pa.array(values, pa.binary())
    for lo, hi in ((0, 5), (1, 4), (2, 3), (4, 5), (3, 3)):
        digest = SliceDigest()
        digest.update_arrow(array.slice(lo, hi - lo))
        assert digest.hexdigest() == slice_checksum(values[lo:hi]), (lo, hi)
    digest = SliceDigest()
    digest.update_arrow(pa.array([b"", b""], pa.binary()))
    assert digest.hexdigest() == slice_checksum([b"", b""])
    # Spark returns the large layouts (64-bit offsets) where spark.sql.execution.arrow.useLargeVarTypes is set.
    for kind in (pa.large_binary(), pa.string(), pa.large_string()):
        typed = pa.array([v.decode() for v in values] if pa.types.is_unicode(kind) or pa.types.is_large_unicode(kind)
                         else values, kind)
        digest = SliceDigest()
        digest.update_arrow(typed.slice(1, 3))
        assert digest.hexdigest() == slice_checksum(values[1:4]), kind
    with pytest.raises(TypeError):  # a null value has no bytes to hash: refused, as by `update`
        SliceDigest().update_arrow(pa.array([b"a", None], pa.binary()))


def test_message_batch_sizes_count_key_and_value_bytes() -> None:
    batch = MessageBatch.of([OutgoingMessage(b"k1", b"abc", 1), OutgoingMessage(None, b"de", 2),
                             OutgoingMessage(b"", b"", 3)])
    assert batch.sizes().tolist() == [5, 2, 0]
    assert batch.watermark_bounds() == (1, 3)
    assert list(batch.rows(1, 3)) == [(None, b"de", 2, b"2"), (b"", b"", 3, b"3")]


def test_out_of_order_says_whether_a_slice_waits_or_can_never_commit() -> None:
    """Progress inside a slice (after a reset) was reported as "the slice (250, 200] must commit first"."""
    waits = str(SliceOutOfOrder.at("t", SliceRange(200, 400), 100))
    assert "cannot commit yet" in waits and "(100, 200] must commit first" in waits
    never = str(SliceOutOfOrder.at("t", SliceRange(200, 400), 250))
    assert "can never commit as cut" in never and "again from 250" in never
    assert "(250, 200]" not in never and "must commit first" not in never


def test_a_run_whose_slices_do_not_follow_each_other_says_so() -> None:
    """Within a run, the slice before is the run's previous slice, not the committed progress the message named."""
    from assets.relay import slices_to_publish
    from resources.exactly_once import TableChannel

    channel = TableChannel.for_table("s.p.t", "t")
    assert slices_to_publish(channel, [SliceRange(5, 8), SliceRange(0, 5)], 0) == [SliceRange(0, 5), SliceRange(5, 8)]
    with pytest.raises(SliceOutOfOrder, match=r"slices \(0, 5\] and \(3, 8\] do not follow each other"):
        slices_to_publish(channel, [SliceRange(0, 5), SliceRange(3, 8)], 0)
    with pytest.raises(SliceOutOfOrder, match=r"\(2, 3\] must commit first; the run retries"):
        slices_to_publish(channel, [SliceRange(3, 8)], 2)


def test_slices_committed_before_a_failure_are_found_by_their_ranges() -> None:
    """The failure hook's slices: those inside the run's tag `<run>/first...last`, in watermark order, negative
    watermarks (whose keys do not sort as text) included; none without the tag, or with a tag of another run."""
    from assets.checks import committed_before_failure
    from resources.kafka_io_manager import COMMITTED_BEFORE_FAILURE_TAG
    from resources.slices import SliceRange

    keys = [SliceRange(lo, hi).key for lo, hi in [(20, 30), (-10, -5), (-5, 0), (0, 10), (10, 20), (-20, -10)]]
    tag = {COMMITTED_BEFORE_FAILURE_TAG: f"run-a/{SliceRange(-10, -5).key}...{SliceRange(0, 10).key}"}
    assert committed_before_failure(tag, keys, "run-a") == [SliceRange(-10, -5).key, SliceRange(-5, 0).key,
                                                            SliceRange(0, 10).key]
    assert committed_before_failure({}, keys, "run-a") == []
    # Dagster's retry of run-a copies its tags: the retry committed none of those slices.
    assert committed_before_failure(tag, keys, "run-b") == []


def test_verify_reads_progress_again_while_the_topic_shows_more() -> None:
    """A slice's rows can be visible a moment before its progress record (the two topics' commit markers are
    written one after the other): verify reads the progress again before calling such rows extra, and stops as
    soon as it covers them, or after its tries (then they are extra)."""
    from types import SimpleNamespace

    from resources.verify.compare import progress_after_reading

    def reader(his: list[int | None]):
        reads: list[int | None] = []

        def read():
            hi = his[min(len(reads), len(his) - 1)]
            reads.append(hi)
            return None if hi is None else SimpleNamespace(hi=hi)
        return read, reads

    read, reads = reader([10, 10, 20])
    assert progress_after_reading(read, 20, 5, pause_s=0) == 20 and len(reads) == 3
    read, reads = reader([10, 20])
    assert progress_after_reading(read, 30, 5, tries=4, pause_s=0) == 20 and len(reads) == 4  # 30 stays extra
    read, reads = reader([10])
    assert progress_after_reading(read, None, 5, pause_s=0) == 10 and len(reads) == 1  # nothing above: one read
    read, reads = reader([None])
    assert progress_after_reading(read, 7, 5, tries=2, pause_s=0) == 5 and len(reads) == 2  # no progress: floor


def test_verify_tells_messages_sent_before_a_reset_by_position() -> None:
    """Left out as sent before a reset at 10: messages at or below 10 written before the reset's recorded end of
    their partition; by watermark alone for a reset recorded without ends (earlier versions); a partition missing
    from the recorded ends was added after the reset, so none of it came before."""
    from resources.exactly_once import ProgressRecord
    from resources.verify.compare import reset_position, sent_before_reset

    reset = ProgressRecord("t", "reset-10", 10, 10, 0, 0, "", "topic", topic_ends={"0": 3})
    old = ProgressRecord("t", "reset-10", 10, 10, 0, 0, "", "topic")
    assert (reset_position(reset, 0), reset_position(reset, 1), reset_position(old, 0), reset_position(None, 0)) == \
        (3, 0, None, None)
    watermarks, offsets = [4, 9, 12, 8, 11], [0, 1, 2, 3, 4]  # 8 at offset 3: sent after the reset
    assert sent_before_reset(watermarks, offsets, 10, 3) == [True, True, False, False, False]
    assert sent_before_reset(watermarks, offsets, 10, None) == [True, True, False, True, False]
    assert sent_before_reset(watermarks, offsets, 10, 0) == [False] * 5
    no_topic = ProgressRecord("t", "reset-10", 10, 10, 0, 0, "", "topic", topic_ends={})  # reset before any publish
    assert reset_position(no_topic, 0) == 0


def test_verify_splits_a_topic_at_the_newest_reset() -> None:
    """After a reset back to 10 (the topic ended at offset 4): 4..12 sent before it, 11..12 sent again after it.
    Left out: 4 and 9; compared: the rest; only 11 and 12 after the reset can belong to a slice committed while
    verify read; the seam 12 -> 11 is no order violation (a message out of order on either side still is)."""
    from resources.exactly_once import ProgressRecord
    from resources.verify.compare import split_at_reset
    from resources.verify.topic import TopicWatermarks

    reading = TopicWatermarks(partitions={0: [4, 9, 11, 12, 11, 12]}, offsets={0: [0, 1, 2, 3, 4, 5]})
    split = split_at_reset(reading, ProgressRecord("t", "reset-10", 10, 10, 0, 0, "", "topic", topic_ends={"0": 4}))
    assert (split.before_start, split.kept, split.after_reset) == (2, {0: [11, 12, 11, 12]}, [11, 12])
    assert split.segments == [[11, 12], [11, 12]]
    unordered = TopicWatermarks(partitions={0: [4, 12, 11, 13]}, offsets={0: [0, 1, 2, 3]})
    assert split_at_reset(unordered, None).segments == [[4, 12, 11, 13]]  # no reset: one segment, 11 out of order
    assert split_at_reset(unordered, None).after_reset == [4, 12, 11, 13]
    # Two resets back: 1..60 sent, reset to 10 at offset 60, 11..40 sent, reset to 30 at offset 90, 31..60 sent. Both
    # seams (60 -> 11 and 40 -> 31) are resets', not order violations; verify used to exempt only the newest.
    wms = [*range(1, 61), *range(11, 41), *range(31, 61)]
    twice = TopicWatermarks(partitions={0: wms}, offsets={0: list(range(len(wms)))})
    older = ProgressRecord("t", "reset-10", 10, 10, 0, 0, "", "topic", topic_ends={"0": 60})
    newest = ProgressRecord("t", "reset-30", 30, 30, 0, 0, "", "topic", topic_ends={"0": 90})
    split = split_at_reset(twice, newest, [older])
    assert [seg == sorted(seg) for seg in split.segments] == [True, True, True]
    assert [len(seg) for seg in split.segments] == [30, 10, 30]  # those <= 30 sent before reset-30 left out
    assert [seg == sorted(seg) for seg in split_at_reset(twice, newest).segments] == [False, True]  # as before


def test_verify_compares_rows_sharing_a_watermark_value_one_by_one() -> None:
    """Rows sharing a watermark value (a tie_break table) are fingerprinted by their tie_break: at value 7 the topic
    holds row 1 twice and never row 2. Counted per value the two would even out (verify passed such a topic); the
    fingerprints differ, and row by row they are a duplicate and a missing row, while a message whose tie_break no
    row of its value has is extra. Values with one row are compared by count."""
    from collections import Counter
    from datetime import datetime
    from uuid import UUID

    from resources.verify.compare import compare_rows, tie_fingerprints
    from resources.verify.topic import HASH_MASK, NULL_TIE, message_tie, tie_hash, tie_text

    source = tie_fingerprints([(7, 1), (7, 2), (7, 3), (8, 4), (9, 5)], "n")
    assert source.counts == Counter({7: 3, 8: 1, 9: 1}) and source.unchecked is None
    assert set(source.fingerprints) == {7}  # one-row values need none
    assert source.fingerprints[7] == sum(map(tie_hash, ["1", "2", "3"])) & HASH_MASK
    assert sum(map(tie_hash, ["1", "1", "3"])) & HASH_MASK != source.fingerprints[7]  # the even count differs

    ties = {7: Counter({"1": 1, "2": 1, "3": 1})}
    even = compare_rows(source.counts, Counter({7: 3, 8: 1, 9: 1}), ties, {7: Counter({"1": 2, "3": 1})})
    assert (even.duplicates, even.missing, even.extra) == (Counter({7: 1}), Counter({7: 1}), Counter())
    clean = compare_rows(source.counts, Counter({7: 3, 8: 1, 9: 1}), ties, {7: Counter({"1": 1, "2": 1, "3": 1})})
    assert not (clean.duplicates or clean.missing or clean.extra or clean.by_count)
    stray = compare_rows(source.counts, Counter({7: 3, 8: 2, 10: 1}), ties, {7: Counter({"1": 1, "2": 1, "99": 1})})
    assert (stray.duplicates, stray.missing, stray.extra) == (Counter({8: 1}), Counter({7: 1, 9: 1}),
                                                              Counter({7: 1, 10: 1}))
    # Messages without the field (sent before a `columns:` change): that value by count, and said so.
    old = compare_rows(source.counts, Counter({7: 3, 8: 1, 9: 1}), ties, {7: Counter({None: 2, "3": 1})})
    assert not (old.duplicates or old.missing or old.extra) and old.by_count == [7]

    # The same texts on both sides: the driver's values and the message's JSON; NULL is no text.
    assert [tie_text(v) for v in (5, "a", None, UUID(int=1), True)] == \
        ["5", "a", NULL_TIE, "00000000-0000-0000-0000-000000000001", None]
    assert tie_text("null") != tie_text(None) and message_tie(b'{"n": null}', "n") == tie_text(None)
    assert message_tie(b'{"n": 5, "v": "x"}', "n") == "5"
    # An envelope is told by its shape: `envelope:` may have changed since the message was sent.
    assert message_tie(b'{"op": "insert", "data": {"n": "a"}, "source": {}}', "n") == "a"
    assert message_tie(b'{"op": "insert", "data": {"op": 5}, "source": {}}', "op") == "5"  # a column named op
    assert message_tie(b'{"op": 1, "data": {"n": 2}, "n": 3}', "n") == "3"  # no envelope: its own columns
    assert message_tie(b'{"v": 1}', "n") is None and message_tie(b"not json", "n") is None
    # A tie_break whose JSON text is not Python's (a timestamp): compared by count, and said so.
    timed = tie_fingerprints([(7, datetime(2026, 1, 1)), (7, datetime(2026, 1, 2))], "at")
    assert timed.fingerprints == {} and timed.unchecked is not None and "'at'" in timed.unchecked
    assert timed.counts == Counter({7: 2})


class _CommitFailsProducer:
    """A producer whose commit fails as librdkafka's did when a reset fenced it mid-commit ("EndTxn commit failed:
    Unknown broker error", abortable), and whose abort then reports `abort_error` (None: the abort succeeds)."""

    def __init__(self, abort_error: object | None) -> None:
        self.abort_error = abort_error
        self.aborted = 0

    def begin_transaction(self, *args: object) -> None:
        return None

    def produce(self, *args: object, **kwargs: object) -> None:
        return None

    def commit_transaction(self, *args: object) -> None:
        from confluent_kafka import KafkaError, KafkaException

        raise KafkaException(KafkaError(KafkaError.UNKNOWN, "EndTxn commit failed: Unknown broker error",
                                        txn_requires_abort=True))

    def abort_transaction(self, *args: object) -> None:
        from confluent_kafka import KafkaException

        self.aborted += 1
        if self.abort_error is not None:
            raise KafkaException(self.abort_error)


@pytest.mark.parametrize("fenced", [True, False])
def test_a_progress_record_whose_commit_fails_is_a_relay_error_not_the_private_redo_signal(fenced: bool) -> None:
    """publish_progress_only (a reset, the `latest` baseline) let the publisher's private _AbortAndRedo escape when
    the commit failed abortably: a caller catching RelayError (the CLI, a sensor, a publisher being fenced) missed
    it. The failure is aborted and reported as PublisherFenced when a newer publisher fenced it, else RelayError."""
    from confluent_kafka import KafkaError

    from resources.exactly_once import PublisherFenced, RelayError, SlicePublisher, TableChannel

    channel = TableChannel.for_table("src.public.t", "t")
    publisher = SlicePublisher(channel, {"bootstrap.servers": "127.0.0.1:1"})  # never connects: the producer is faked
    real = publisher.producer
    fake = _CommitFailsProducer(KafkaError(KafkaError._FENCED, "fenced by a newer instance", fatal=True)
                                if fenced else None)
    publisher.producer, publisher._initialized = fake, True
    record = ProgressRecord(channel.table, "reset-0", 0, 0, 0, 0, "", channel.topic)
    try:
        with pytest.raises(RelayError) as raised:
            publisher.publish_progress_only(record, reset=True)
    finally:
        publisher.producer = real
        publisher.close()
    assert fake.aborted == 1
    assert isinstance(raised.value, PublisherFenced) == fenced, raised.value
    if not fenced:
        assert "not committed" in str(raised.value) and "Unknown broker error" in str(raised.value), raised.value


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


def test_a_watermark_written_as_the_other_kind_is_refused() -> None:
    """`reset --after` / `replay --from --to` remember how a watermark was written: a time on an integer watermark
    or an integer on a timestamp one is refused with what it would have meant."""
    from orchestration.cli.arguments import watermark, watermark_kind_error

    assert watermark_kind_error("t", False, "--after", watermark("20")) is None
    assert watermark_kind_error("t", True, "--after", watermark("2026-11-23T07:00:00Z")) is None
    assert watermark_kind_error("t", True, "--after", 20) is None  # not from the command line: nothing to tell
    assert "would be 1970-01-01T00:29:24.547200Z" in watermark_kind_error("t", True, "--after", watermark("1764547200"))
    assert "read as 1767225600000000" in watermark_kind_error("t", False, "--to", watermark("2026-01-01"))
    assert watermark("-5") == -5 and not watermark("-5").is_time
    assert watermark("1_000") == 1000 and not watermark("1_000").is_time  # what int() takes is an integer
    assert "is past any time" in watermark_kind_error("t", True, "--after", watermark("300000000000000000"))


def test_a_repeated_kafka_log_line_is_let_through_once_per_window(monkeypatch) -> None:
    """A broker that was away made every client log each reconnect attempt: ~390 lines before the one error
    that says what is wrong. A line repeating one let through in the last 30 s (numbers aside) is dropped."""
    import logging

    from resources.exactly_once import clients as exactly_once

    clock = [100.0]
    monkeypatch.setattr(exactly_once.time, "monotonic", lambda: clock[0])
    repeats = exactly_once._RepeatsDropped(window_s=30.0)

    def passes(message: str) -> bool:
        return repeats.filter(logging.LogRecord("rowrelay.librdkafka", logging.ERROR, "", 0, message, None, None))

    assert passes("FAIL: Connect to 127.0.0.1:19099 failed (after 0ms in state CONNECT)")
    assert not passes("FAIL: Connect to 127.0.0.1:19099 failed (after 1ms in state CONNECT)")  # numbers aside
    assert passes("another line")
    assert passes("topic orders_2024: unknown") and passes("topic orders_2025: unknown")  # names keep their digits
    assert passes("FAIL [rdkafka#consumer-3] down") and not passes("FAIL [rdkafka#consumer-4] down")
    clock[0] += 31.0
    assert passes("FAIL: Connect to 127.0.0.1:19099 failed (after 0ms in state CONNECT)")  # once per window


def test_a_change_of_column_order_is_a_schema_change() -> None:
    """Reordered columns (`columns:` reordered, a MariaDB `ALTER ... AFTER`) change every message's field order
    and a hash_row key for the same data, but passed unnoticed, even with `on_schema_change: fail`."""
    from resources.source_database import schema_change

    before = [["id", "BIGINT"], ["a", "TEXT"], ["b", "TEXT"]]
    assert not schema_change(before, before)
    change = schema_change(before, [["b", "TEXT"], ["a", "TEXT"], ["id", "BIGINT"]])
    assert change and change.describe() == "reordered to b, a, id"
    # Added or dropped columns alone are not a reorder of the rest.
    assert schema_change(before, [["id", "BIGINT"], ["x", "INT"], ["b", "TEXT"]]).describe() == "added x; dropped a"
    assert schema_change(before, [["id", "BIGINT"], ["b", "TEXT"], ["a", "TEXT"], ["c", "INT"]]).describe() == (
        "added c; reordered to id, b, a")


def test_verify_expects_each_slice_by_the_row_filter_it_was_published_with() -> None:
    """`rowrelay verify` applied today's `where:` and `skip_watermarks` to all history: after adding a filter the
    rows sent before it looked extra, after removing a skip its row looked missing. Each slice's rows are now
    expected as its progress record says they were chosen; older records and uncovered ranges by today's."""
    from resources.verify.compare import FilterPiece, filter_pieces

    def rec(lo: int, hi: int, where: str | None, skipped: list[int] | None = None) -> ProgressRecord:
        return ProgressRecord("t", SliceRange(lo, hi).key, lo, hi, 1, 1, "", "topic", where=where, skipped=skipped)

    from resources.slices import RowSkip

    def skips(*watermarks: int) -> list[RowSkip]:
        return [RowSkip(w) for w in watermarks]

    history = [rec(0, 40, ""), rec(40, 100, "", [55]), rec(100, 150, "s <> 'draft'"), rec(150, 160, None)]
    assert filter_pieces(0, 170, history, "s <> 'draft'", skips(5, 155)) == [
        FilterPiece(0, 100, "", tuple(skips(55))),  # no filter then; 55 skipped then
        # The filter since; an old record and the range no slice covers yet take today's (its skip inside them).
        FilterPiece(100, 170, "s <> 'draft'", tuple(skips(155))),
    ]
    # The compared range cuts records; a gap between records takes today's filter (here none, as the slice before).
    assert filter_pieces(20, 120, [rec(0, 40, ""), rec(60, 150, "x")], None, skips(50)) == [
        FilterPiece(20, 60, "", tuple(skips(50))), FilterPiece(60, 120, "x", ())]
    assert filter_pieces(None, 10, [], "w", skips(3, 12)) == [FilterPiece(None, 10, "w", tuple(skips(3)))]
    # A row named by its tie_break, as a record keeps it, comes back as that row.
    row = RowSkip(70, (("uid", "7"),))
    assert filter_pieces(40, 100, [rec(40, 100, "", [row.to_record()])], None, []) == [
        FilterPiece(40, 100, "", (row,))]


def test_a_source_below_its_committed_progress_is_flagged() -> None:
    """A table re-created (ids restarted) before the runbook's reset: `status` said "caught up" and the lag check
    passed, while its new rows up to the old progress would count as sent and never be published."""
    from dagster import AssetCheckSeverity

    from assets.checks import lag_result
    from assets.lag import TableLag
    from resources.config import TableConfig

    table = TableConfig(source="src", table="public.orders", watermark="id")

    def lag(committed: int | None, top: int | None, checked: bool = True) -> TableLag:
        return TableLag(table=table.table_id, committed_hi=committed, source_max=top, lag_rows=0, lag_seconds=0.0,
                        lag_basis="caught_up", last_commit_at=None, newest_row=top, newest_checked=checked)

    assert lag(231, 231).source_behind is None and lag(None, 5).source_behind is None
    # Progress at a baseline or reset (not a published slice) may rightly sit above every row: not checked.
    assert lag(0, None, checked=False).source_behind is None and lag(500, 231, checked=False).source_behind is None
    assert "newest_row" not in lag(231, 150).as_dict()  # status --json keeps its fields
    assert lag_result(table, lag(231, 300)).passed
    behind = lag(231, 150)
    assert "the source's newest row (150) is below committed progress (231)" in (behind.source_behind or "")
    result = lag_result(table, behind)
    assert not result.passed and result.severity == AssetCheckSeverity.WARN
    assert "re-created" in (result.description or "") and "rowrelay reset" in (result.description or "")
    assert "the source table is empty (231)" in (lag(231, None).source_behind or "")


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


def test_reset_partitions_settle_below_cut_above_and_leave_a_changed_watermarks_history() -> None:
    from orchestration.reset import reset_partitions

    def keyed(*spans: tuple[int, int]) -> dict[str, SliceRange]:
        return {SliceRange(lo, hi).key: SliceRange(lo, hi) for lo, hi in spans}

    three = keyed((0, 10), (10, 20), (20, 30))
    back = reset_partitions(three, 15, 20, moved=False)  # back inside (10, 20]: its part below stays
    assert back.dropped == [SliceRange(10, 20).key, SliceRange(20, 30).key] and back.settled == []
    assert back.kept_below == {SliceRange(10, 20).key: SliceRange(10, 15)}
    forward = reset_partitions(three, 25, 10, moved=False)  # (10, 20] was cut, never committed: settled
    assert forward.settled == [SliceRange(10, 20).key] and forward.kept_below == {SliceRange(20, 30).key:
                                                                                   SliceRange(20, 25)}
    # A changed watermark: the old ranges are another column's. Committed ones below W stay as its history; none is
    # cut at W or settled (a statement in the wrong column); above W or never committed, they go.
    ids = keyed((0, 50), (50, 80), (80, 90))
    assert reset_partitions(ids, 1080, 80, moved=True) == type(back)([SliceRange(80, 90).key], {}, [])
    seqs = keyed((1000, 1080))
    assert reset_partitions(seqs, 50, 1080, moved=True).dropped == [SliceRange(1000, 1080).key]
    assert reset_partitions(seqs, 50, 1080, moved=False).kept_below == {}  # lo above W: nothing kept below


def test_wal_flushed_to_counts_a_page_header_not_yet_written() -> None:
    from resources.source_database import pg_lsn, wal_flushed_to

    assert pg_lsn("16/B374D848") == (0x16 << 32) | 0xB374D848
    assert wal_flushed_to(pg_lsn("0/3000100"), pg_lsn("0/3000100"))
    assert not wal_flushed_to(pg_lsn("0/30000F8"), pg_lsn("0/3000100"))
    # An insert position right after a page's header (short, or long at a segment's start): the last record ended
    # the page before, and a flush that reached the boundary is complete (an idle server never writes the header).
    assert wal_flushed_to(pg_lsn("0/3002000"), pg_lsn("0/3002018"))
    assert wal_flushed_to(pg_lsn("0/4000000"), pg_lsn("0/4000028"))
    assert not wal_flushed_to(pg_lsn("0/3001FF8"), pg_lsn("0/3002018"))
    assert not wal_flushed_to(pg_lsn("0/3002000"), pg_lsn("0/3002020"))


def test_the_recorded_slice_is_the_highest_not_the_latest_materialization() -> None:
    """A roll-up is recorded as a new materialization after the slices above it: the latest event named (0, 4]
    while (4, 6] had committed, and the refusal's reset point would have sent (4, 6] again (found by review)."""
    from dagster import AssetKey, AssetMaterialization, DagsterInstance

    from assets.records import last_recorded_slice

    key = AssetKey(["src", "public", "t"])
    with DagsterInstance.ephemeral() as instance:
        assert last_recorded_slice(instance, key) is None
        for lo, hi in ((0, 2), (2, 4), (4, 6), (0, 4)):
            instance.report_runless_asset_event(AssetMaterialization(key, partition=SliceRange(lo, hi).key))
        assert last_recorded_slice(instance, key) == SliceRange(4, 6)


def test_skip_watermarks_entries_name_a_value_or_one_row() -> None:
    """`skip_watermarks` takes a bare value (as before: valid only where it matches one row), or a mapping naming
    one row by its watermark and tie_break, or by its watermark and key columns; each entry's suggested text
    reads back as the same entry."""
    import yaml

    from resources.slices import RowSkip

    def table(**more: object) -> dict[str, object]:
        return {"source": "s", "table": "t", "watermark": "at", **more}

    def parsed(*tables: dict[str, object]):  # noqa: ANN202 - the config's tables
        return parse_config({"sources": {"s": {"url": "postgresql://u@h/d"}}, "tables": list(tables),
                             "kafka": {"bootstrap_servers": "k:9092"}, "spark": {"master": "local[1]"}}).tables

    (t,) = parsed(table(tie_break="uid", skip_watermarks=yaml.safe_load(
        "[7, 2026-11-23T07:00:00.5Z, {watermark: 2026-11-23T07:00:00Z, tie_break: 500},"
        " {watermark: 9, key: {region: 'eu', n: 3}}]")))
    at = 1_795_417_200_000_000  # 2026-11-23T07:00:00Z
    assert t.skip_rows == [RowSkip(7), RowSkip(at + 500_000), RowSkip(at, (("uid", "500"),)),
                           RowSkip(9, (("n", "3"), ("region", "eu")))]
    assert [s.watermark for s in t.skip_rows_in(8, at)] == [at, 9]
    # The text a stop message suggests reads back as the same row, through rowrelay.yaml.
    for skip, timestamps in ((RowSkip(at, (("uid", "500"),)), True), (RowSkip(7), False), (RowSkip(at), True),
                             (RowSkip(9, (("n", "3"), ("region", "e'u"))), False)):
        entry = skip.entry(timestamps, "uid")
        (again,) = parsed(table(tie_break="uid", skip_watermarks=yaml.safe_load(f"[{entry}]")))
        assert again.skip_rows == [skip], entry
    assert RowSkip(at, (("uid", "500"),)).entry(True, "uid") == (
        "{watermark: 2026-11-23T07:00:00.000000Z, tie_break: 500}")
    # A progress record keeps a bare value as the integer (as records always have), a row as a mapping.
    for skip in t.skip_rows:
        assert RowSkip.from_record(json.loads(json.dumps(skip.to_record()))) == skip
    assert RowSkip(7).to_record() == 7
    # One way to name the row; a tie_break entry needs the table's tie_break.
    with pytest.raises(ConfigError, match="tie_break: value` or by `key"):
        parsed(table(tie_break="uid", skip_watermarks=[{"watermark": 1, "tie_break": 2, "key": {"a": 1}}]))
    with pytest.raises(ConfigError, match="tie_break: value` or by `key"):
        parsed(table(skip_watermarks=[{"watermark": 1}]))
    with pytest.raises(ConfigError, match="has no `tie_break:`"):
        parsed(table(skip_watermarks=[{"watermark": 1, "tie_break": 2}]))
    with pytest.raises(ConfigError, match="skip_watermarks"):
        parsed(table(skip_watermarks=[{"watermark": 1, "key": {"a": 1}, "other": 3}]))
