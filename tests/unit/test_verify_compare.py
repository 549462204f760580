"""resources/verify/compare.py: what verify compares, leaves out and expects (no stack)."""

from __future__ import annotations

from resources.exactly_once import ProgressRecord
from resources.slices import SliceRange


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
