"""What a slice publishes: messages, batches, their checksum, and the headers every message carries."""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa


def message_watermark(msg: Any) -> int | None:
    """A published message's watermark, from its `rowrelay.watermark` header; None without one."""
    value = next((v for k, v in msg.headers() or () if k == WATERMARK_HEADER), None)
    return None if value is None else int(value)


@dataclass(frozen=True)
class OutgoingMessage:
    key: bytes | None
    value: bytes
    watermark: int


_U32 = next(code for code in "IL" if array(code).itemsize == 4)  # an unsigned 32-bit array typecode


# Arrow's variable-size binary layouts: their offsets' type (Spark returns the large ones where
# spark.sql.execution.arrow.useLargeVarTypes is set).
_OFFSET_TYPES = {pa.binary(): np.int32, pa.string(): np.int32, pa.large_binary(): np.int64,
                 pa.large_string(): np.int64}


class SliceDigest:
    """A slice's checksum, fed with its message values batch by batch in watermark order: the sha256 of two sha256
    digests, of the values concatenated and of their lengths (unsigned 32-bit little-endian), so any split of the
    same bytes into other values gives another checksum.

    Two hashes over whole batches, not one per row: hashlib releases the GIL for large inputs and uses the CPU's
    SHA instructions, where a per-row sha256 in Spark cost about a seventh of its CPU per slice."""

    def __init__(self) -> None:
        self._values, self._lengths = hashlib.sha256(), hashlib.sha256()

    def update(self, values: Sequence[bytes]) -> None:
        self._values.update(b"".join(values))
        lengths = array(_U32, map(len, values))
        if sys.byteorder == "big":
            lengths.byteswap()
        self._lengths.update(lengths)

    def update_arrow(self, values: pa.Array) -> None:
        """`update` from an Arrow binary or string array, straight from its buffers where it can (no nulls)."""
        offset_type = _OFFSET_TYPES.get(values.type)
        if offset_type is None or values.null_count:
            self.update(values.to_pylist())  # other layouts (views), or a null value: refused as `update` does
            return
        _, offsets_buffer, data = values.buffers()
        offsets = np.frombuffer(offsets_buffer, dtype=offset_type, count=len(values) + 1,
                                offset=np.dtype(offset_type).itemsize * values.offset)
        if data is not None:
            self._values.update(memoryview(data)[offsets[0]:offsets[-1]])
        self._lengths.update(np.diff(offsets).astype("<u4").tobytes())

    def hexdigest(self) -> str:
        return hashlib.sha256(self._values.digest() + self._lengths.digest()).hexdigest()


def slice_checksum(values: Iterable[bytes]) -> str:
    """The checksum of a slice whose message values, in watermark order, are `values` (what a consumer computes
    to check a slice from its messages alone)."""
    digest = SliceDigest()
    digest.update(list(values))
    return digest.hexdigest()


class MessageBatch:
    """A run of messages in watermark order, as Arrow columns: key (binary; null: no key), value (binary),
    watermark (int64) and watermark_text (binary: the watermark header's value, str(watermark).encode()). The
    publisher produces them from the buffers (resources/arrow_produce.py): no Python object per row, except for
    the few rows it produces through confluent-kafka."""

    def __init__(self, keys: pa.Array, values: pa.Array, watermarks: pa.Array, watermark_texts: pa.Array) -> None:
        self.keys, self.values, self.watermarks, self.watermark_texts = keys, values, watermarks, watermark_texts

    @classmethod
    def of(cls, messages: Sequence[OutgoingMessage]) -> MessageBatch:
        return cls(keys=pa.array([m.key for m in messages], pa.binary()),
                   values=pa.array([m.value for m in messages], pa.binary()),
                   watermarks=pa.array([m.watermark for m in messages], pa.int64()),
                   watermark_texts=pa.array([str(m.watermark).encode() for m in messages], pa.binary()))

    @classmethod
    def from_arrow(cls, batch: pa.RecordBatch) -> MessageBatch:
        column = batch.column
        return cls(column("key"), column("value"), column("watermark"), column("watermark_text"))

    def __len__(self) -> int:
        return len(self.values)

    def watermark_bounds(self) -> tuple[int, int]:
        import pyarrow.compute as pc

        bounds = pc.min_max(self.watermarks).as_py()
        return bounds["min"], bounds["max"]

    def sizes(self) -> np.ndarray:
        """Bytes of each row's key and value (as the producer's message.max.bytes counts them)."""
        import pyarrow.compute as pc

        keys = pc.binary_length(self.keys).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        return keys + pc.binary_length(self.values).to_numpy(zero_copy_only=False).astype(np.int64)

    def rows(self, start: int, stop: int) -> Iterator[tuple[bytes | None, bytes, int, bytes]]:
        """Rows [start, stop) as Python objects (key, value, watermark, watermark text)."""
        n = max(0, stop - start)
        return zip(self.keys.slice(start, n).to_pylist(), self.values.slice(start, n).to_pylist(),
                   self.watermarks.slice(start, n).to_pylist(), self.watermark_texts.slice(start, n).to_pylist(),
                   strict=True)


# Progress records of no range, keyed by these prefixes (`publish_baseline`, `publish_reset`): where a table starts
# sending, not a slice that published rows.


TABLE_HEADER, WATERMARK_HEADER, REPLAY_HEADER = "rowrelay.table", "rowrelay.watermark", "rowrelay.replay"

# A stage hook lets tests pause or crash the publisher at exact points of the protocol.


def table_message_watermark(headers: list[tuple[str, bytes]] | None, table: bytes) -> tuple[bool, int | None]:
    """Whether the table's publisher sent the message (its `rowrelay.table` header, and not a `rowrelay replay`
    copy), and its watermark (None without a `rowrelay.watermark` header): one pass over the headers, as this runs
    per message of every read-back."""
    own, wm = False, None
    for key, value in headers or ():
        if key == REPLAY_HEADER:
            return False, None
        if key == TABLE_HEADER:
            own = value == table
        elif key == WATERMARK_HEADER and value:
            wm = int(value)
    return own, wm
