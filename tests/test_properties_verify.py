"""Properties of the row comparison `rowrelay verify` makes (orchestration/cli.py `compare_rows`) and of the slice
checksum the parity check compares (resources/exactly_once.py `SliceDigest`), against a small model: the source
as a multiset of rows (watermark, tie_break), the topic as a multiset of messages (watermark, tie_break or none)."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
from hypothesis import given
from hypothesis import strategies as st

from resources.exactly_once import SliceDigest, slice_checksum
from resources.verify.compare import compare_rows

rows_st = st.lists(st.tuples(st.integers(1, 6), st.sampled_from("abcd")), max_size=25)


def inputs(source: list[tuple[int, str]], messages: list[tuple[int, str | None]], tied: set[int]):
    """compare_rows' arguments: counts per watermark; ties for the values compared row by row (`tied`)."""
    counts = Counter(w for w, _ in source)
    seen = Counter(w for w, _ in messages)
    source_ties = {w: Counter(t for v, t in source if v == w) for w in counts if w in tied}
    seen_ties = {w: Counter(t for v, t in messages if v == w) for w in source_ties}
    return counts, seen, source_ties, seen_ties


@st.composite
def topics(draw):
    """A source and a topic drawn from it: rows sent once, some dropped, some sent again, some messages no row
    explains (another watermark, or another tie_break), some without a tie_break (sent before a `columns:` change)."""
    source = draw(rows_st)
    messages: list[tuple[int, str | None]] = []
    for row in source:
        messages += [row] * draw(st.sampled_from([1, 1, 1, 0, 2]))
    messages += draw(st.lists(st.tuples(st.integers(1, 8), st.sampled_from("abcdz")), max_size=3))
    if draw(st.booleans()):
        messages = [(w, None) if draw(st.integers(0, 5)) == 0 else (w, t) for w, t in messages]
    return source, messages, draw(st.sets(st.integers(1, 8)))


@given(topics())
def test_differences_account_for_every_message_and_every_row(drawn):
    source, messages, tied = drawn
    counts, seen, source_ties, seen_ties = inputs(source, messages, tied)
    diff = compare_rows(counts, seen, source_ties, seen_ties)
    for w in set(counts) | set(seen):
        assert seen[w] - counts[w] == diff.extra[w] + diff.duplicates[w] - diff.missing[w], w
    for w in set(diff.extra) | set(diff.duplicates) | set(diff.missing):
        assert min(diff.extra[w], diff.duplicates[w], diff.missing[w]) >= 0
    # Row by row where every message of a value names its row: the exact multiset difference.
    for w, rows in source_ties.items():
        sent = seen_ties[w]
        if None in sent:
            assert w in diff.by_count
            continue
        assert diff.extra[w] == sum(k for t, k in sent.items() if t not in rows), w
        assert diff.duplicates[w] == sum(max(0, k - rows[t]) for t, k in sent.items() if t in rows), w
        assert diff.missing[w] == sum((rows - sent).values()), w


@given(rows_st, st.sets(st.integers(1, 6)), st.randoms(use_true_random=False))
def test_a_topic_equal_to_the_source_differs_in_nothing(source, tied, rng):
    messages: list[tuple[int, str | None]] = list(source)
    rng.shuffle(messages)
    diff = compare_rows(*inputs(source, messages, tied))
    assert not diff.extra and not diff.duplicates and not diff.missing


@given(rows_st.filter(bool), st.sets(st.integers(1, 6)), st.data())
def test_one_row_swapped_for_its_neighbour_is_seen_where_ties_are_compared(source, tied, data):
    """Same count per watermark, one message naming another row of its value: counts alone say nothing; row by row
    it is one missing and one extra (or duplicate)."""
    i = data.draw(st.integers(0, len(source) - 1))
    w, t = source[i]
    other = data.draw(st.sampled_from([x for x in "abcdz" if x != t]))
    messages: list[tuple[int, str | None]] = [*source[:i], (w, other), *source[i + 1:]]
    diff = compare_rows(*inputs(source, messages, tied))
    if w in tied and Counter(r for r in source if r[0] == w) != Counter(m for m in messages if m[0] == w):
        assert diff.missing[w] == 1 and diff.extra[w] + diff.duplicates[w] == 1, diff
    else:
        assert not diff.missing and not diff.extra and not diff.duplicates


values_st = st.lists(st.binary(max_size=12), max_size=20)


@given(values_st, st.lists(st.integers(0, 20), max_size=5))
def test_slice_checksum_is_the_same_for_any_batching_of_the_same_values(values, cuts):
    bounds = sorted({0, len(values), *(min(c, len(values)) for c in cuts)})
    digest = SliceDigest()
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        digest.update(values[lo:hi])
    assert digest.hexdigest() == slice_checksum(values)


@given(values_st, st.sampled_from([pa.binary(), pa.large_binary()]), st.integers(0, 5), st.integers(0, 5))
def test_slice_checksum_from_arrow_buffers_equals_the_values_own(values, kind, head, tail):
    """`update_arrow` reads the buffers directly: an array sliced out of a larger one (a batch of a bigger read)
    must give the checksum of its own values."""
    whole = pa.array([b"h" * i for i in range(head)] + values + [b"t"] * tail, type=kind)
    part = whole.slice(head, len(values))
    digest = SliceDigest()
    digest.update_arrow(part)
    assert digest.hexdigest() == slice_checksum(values)


@given(values_st, st.data())
def test_slice_checksums_differ_for_other_values_of_the_same_bytes(values, data):
    """The same bytes split into other values (a field moved across a message boundary) is another slice."""
    joined = b"".join(values)
    cuts = data.draw(st.lists(st.integers(0, len(joined)), max_size=len(values) + 2))
    bounds = [0, *sorted(cuts), len(joined)]
    other = [joined[lo:hi] for lo, hi in zip(bounds, bounds[1:], strict=False)]
    assert (slice_checksum(other) == slice_checksum(values)) == (other == values)
