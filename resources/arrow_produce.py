"""The publisher's per-row loop in C: rows produced straight from a batch's Arrow buffers.

Through confluent-kafka, each row costs a Python call with its header list and tuples, a per-message state that a
delivery event frees later (taking the GIL per message), and a topic lookup by name: about 1.4 s per 1M rows here,
plus the Arrow -> Python bytes conversion before it. `RowProducer` hands librdkafka the Arrow buffers instead:
resources/native/produce_rows.c calls `rd_kafka_producev` once per row, with the same value, key and the two
headers of the message contract, on the same producer (same librdkafka instance, same transaction), with the GIL
released. It names the partition (the publisher attaches it to one-partition topics only, so librdkafka's
partitioner need not hash every key to find partition 0) and the CreateTime (the wall clock read once per 1,024
rows instead of librdkafka's gettimeofday per row).

confluent-kafka does not expose its `rd_kafka_t`: `_handle_of` reads it from the Producer object (its C struct's
first field), checked against librdkafka's own record of its owner, and only for the confluent-kafka versions it was
checked with (`CHECKED_VERSIONS`). Wherever the library is not built (no C compiler at install) or the check fails,
`RowProducer.attach` returns None and the publisher produces every row through confluent-kafka: the same messages,
slower.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import platform
from pathlib import Path
from typing import Any

import confluent_kafka
import pyarrow as pa

log = logging.getLogger(__name__)

LIBRARY = Path(__file__).resolve().parent / "native" / "produce_rows.so"
# confluent-kafka versions whose Producer object was checked to hold its rd_kafka_t right after the object header.
CHECKED_VERSIONS = frozenset({"2.16.1"})
QUEUE_FULL = -184  # RD_KAFKA_RESP_ERR__QUEUE_FULL
# produce_rows_abi() of the produce_rows.c this module calls: 2 added the partition argument.
ABI = 2


class _BinaryColumn(ctypes.Structure):
    _fields_ = [("offsets", ctypes.c_void_p), ("data", ctypes.c_void_p), ("validity", ctypes.c_void_p),
                ("bit_offset", ctypes.c_int64)]


_EMPTY = ctypes.create_string_buffer(1)  # data of a column whose values are all empty: a key b"" is not "no key"


def _column(array: pa.Array) -> _BinaryColumn:
    """The C view of an Arrow binary array; the array must outlive the call that uses it."""
    validity, offsets, data = array.buffers()
    return _BinaryColumn(offsets.address + 4 * array.offset,
                         data.address if data is not None and data.size else ctypes.addressof(_EMPTY),
                         validity.address if validity is not None and array.null_count else None, array.offset)


M_MXFAST = 1  # glibc's mallopt parameter: the largest request served from fastbins (0: none)


def _without_fastbins() -> None:
    """Turn glibc's fastbins off for this process (a no-op elsewhere).

    librdkafka allocates about five small chunks per message (the message with its payload, the header list and
    each header) and the delivery reports free them 100k at a time. With fastbins, each free that merged into a
    large free region made glibc consolidate every fastbin again: `malloc_consolidate` and `unlink_chunk` were
    19 % of a publishing process's samples in `perf`. Without fastbins, small chunks still go through the
    per-thread cache, and Python's own objects through pymalloc, so nothing else of note changes."""
    if platform.libc_ver()[0] != "glibc":
        return
    with contextlib.suppress(AttributeError, OSError):  # not glibc after all
        ctypes.CDLL(None).mallopt(M_MXFAST, 0)


class _Native:
    """librdkafka (the copy confluent-kafka loaded) and the produce_rows library, loaded once per process."""

    _loaded: _Native | None = None
    _failed = False

    def __init__(self) -> None:
        path = next((line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                     if "librdkafka" in line.rsplit("/", 1)[-1]), None)
        if path is None:
            raise OSError("librdkafka is not loaded in this process")
        # The same file confluent-kafka loaded: dlopen returns that instance, not a second one.
        self.rdkafka = rdkafka = ctypes.CDLL(path)
        rdkafka.rd_kafka_opaque.restype = ctypes.c_void_p
        rdkafka.rd_kafka_opaque.argtypes = [ctypes.c_void_p]
        rdkafka.rd_kafka_type.restype = ctypes.c_int
        rdkafka.rd_kafka_type.argtypes = [ctypes.c_void_p]
        rdkafka.rd_kafka_topic_new.restype = ctypes.c_void_p
        rdkafka.rd_kafka_topic_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        rdkafka.rd_kafka_topic_destroy.restype = None
        rdkafka.rd_kafka_topic_destroy.argtypes = [ctypes.c_void_p]
        self.producev = ctypes.cast(rdkafka.rd_kafka_producev, ctypes.c_void_p).value
        _without_fastbins()
        self.lib = lib = ctypes.CDLL(str(LIBRARY))  # CDLL: the call releases the GIL
        # A library built from an older produce_rows.c (make install keeps none when cc fails, but a copy made
        # another way might) takes other arguments: calling it would crash the process, not fail the call.
        abi = getattr(lib, "produce_rows_abi", None)
        if abi is None or abi() != ABI:
            raise OSError(f"{LIBRARY} was built from another version of produce_rows.c (make install rebuilds it)")
        column = ctypes.POINTER(_BinaryColumn)
        lib.produce_rows.restype = ctypes.c_int64
        lib.produce_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, column,
                                     column, column,
                                     ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.POINTER(ctypes.c_int)]

    @classmethod
    def get(cls) -> _Native | None:
        if cls._loaded is None and not cls._failed:
            version = confluent_kafka.__version__
            if version not in CHECKED_VERSIONS:
                log.warning("rowrelay: confluent-kafka %s is not one the C produce loop was checked with (%s); "
                            "producing through confluent-kafka", version, ", ".join(sorted(CHECKED_VERSIONS)))
                cls._failed = True
            elif not LIBRARY.exists():
                log.warning("rowrelay: %s is not built (make install builds it with a C compiler); producing "
                            "through confluent-kafka", LIBRARY)
                cls._failed = True
            else:
                try:
                    cls._loaded = cls()
                except OSError as exc:
                    log.warning("rowrelay: the C produce loop cannot load (%s); producing through confluent-kafka",
                                exc)
                    cls._failed = True
        return cls._loaded

    def handle_of(self, producer: Any) -> int | None:
        """The producer's rd_kafka_t, if its object holds it where checked (see the module docstring)."""
        if not isinstance(producer, confluent_kafka.Producer):  # only its C struct may be read this way
            return None
        rk = ctypes.c_void_p.from_address(id(producer) + object.__basicsize__).value
        # confluent-kafka registers the Producer object as librdkafka's opaque: the handle is this producer's.
        if rk and self.rdkafka.rd_kafka_type(rk) == 0 and self.rdkafka.rd_kafka_opaque(rk) == id(producer):
            return rk
        return None


class RowProducer:
    """Produces a batch's rows to one partition of one producer's topic from C; `close` when the producer is done
    with."""

    def __init__(self, native: _Native, producer: Any, rk: int, topic: str, table: str, partition: int) -> None:
        self._native, self._producer, self._rk = native, producer, rk  # the producer is kept alive with its handle
        self._partition = partition
        self._rkt: int | None = native.rdkafka.rd_kafka_topic_new(rk, topic.encode(), None)
        if not self._rkt:
            raise OSError(f"librdkafka refused a handle for topic {topic}")
        self._table = table.encode()
        self._error = ctypes.c_int()

    @classmethod
    def attach(cls, producer: Any, topic: str, table: str, partition: int) -> RowProducer | None:
        """A RowProducer for `producer` that produces to `partition` of `topic`, or None where rows must go through
        confluent-kafka (see above)."""
        native = _Native.get()
        if native is None:
            return None
        rk = native.handle_of(producer)
        if rk is None:
            log.warning("rowrelay: confluent-kafka's Producer does not hold its handle where checked; producing "
                        "through confluent-kafka")
            _Native._failed, _Native._loaded = True, None
            return None
        try:
            return cls(native, producer, rk, topic, table, partition)
        except OSError as exc:
            log.warning("rowrelay: %s; producing through confluent-kafka", exc)
            return None

    @staticmethod
    def supports(keys: pa.Array, values: pa.Array, watermark_texts: pa.Array) -> bool:
        """Whether these columns can be produced from C: binary with 32-bit offsets, no null value or watermark
        (a null key is no key)."""
        return (all(a.type == pa.binary() for a in (keys, values, watermark_texts)) and values.null_count == 0
                and watermark_texts.null_count == 0)

    def produce(self, keys: pa.Array, values: pa.Array, watermark_texts: pa.Array, start: int, stop: int
                ) -> tuple[int, int]:
        """Produce rows [start, stop) (see `supports`). Returns (rows produced, librdkafka's error for the next
        row): fewer rows than asked means that row was not produced (QUEUE_FULL: the local queue is full)."""
        if self._rkt is None:
            raise RuntimeError("RowProducer is closed")
        done = self._native.lib.produce_rows(
            self._native.producev, self._rk, self._rkt, self._partition, ctypes.byref(_column(keys)),
            ctypes.byref(_column(values)),
            ctypes.byref(_column(watermark_texts)), self._table, len(self._table), start, stop,
            ctypes.byref(self._error))
        return done, self._error.value

    def close(self) -> None:
        if self._rkt is not None:
            self._native.rdkafka.rd_kafka_topic_destroy(self._rkt)
            self._rkt = None
