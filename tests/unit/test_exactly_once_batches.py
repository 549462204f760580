"""resources/exactly_once/batches.py: the slice checksum and message batches."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pytest

from resources.exactly_once import MessageBatch, OutgoingMessage, SliceDigest, slice_checksum


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
