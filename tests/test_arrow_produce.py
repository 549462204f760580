"""The publisher's C produce loop (resources/arrow_produce.py) on the real broker: the same messages as through
confluent-kafka's produce(), byte for byte, for every shape of Arrow column a slice brings (null and empty keys,
batches sliced at an offset, non-ASCII and NUL bytes), with the CreateTime it names; a full local queue; the Python
path wherever the loop is not attached, a stale build of it included; partitions added while a publisher lives;
and glibc's fastbins off in a process that loads the loop."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewPartitions

from resources import arrow_produce
from resources.arrow_produce import QUEUE_FULL, RowProducer
from resources.exactly_once import (
    MessageBatch,
    SlicePublisher,
    TableChannel,
    slice_checksum,
)
from resources.slices import SliceRange
from tests.conftest import partition_ends
from tests.pipeline import visible_progress

pytestmark = pytest.mark.integration

Raw = tuple[bytes | None, bytes, list[tuple[str, bytes]]]


def _record_batch(lo: int, hi: int) -> pa.RecordBatch:
    """Rows (lo, hi]: every 7th without a key, every 11th with an empty key, values with non-ASCII and NUL bytes."""
    wms, pad = list(range(lo + 1, hi + 1)), "x"
    keys = [None if i % 7 == 0 else b"" if i % 11 == 0 else b'{"id":%d}' % i for i in wms]
    values = [f'{{"id":{i},"s":"é\u0000{pad * (i % 50)}"}}' for i in wms]
    return pa.record_batch({"key": pa.array(keys, pa.binary()),
                            "value": pa.array([v.encode() for v in values], pa.binary()),
                            "watermark": pa.array(wms, pa.int64()),
                            "watermark_text": pa.array([str(i).encode() for i in wms], pa.binary())})


def _batches(lo: int, hi: int) -> Callable[[], Iterator[MessageBatch]]:
    """The rows in uneven batches, each a slice of one record batch (Arrow offsets other than 0), one of 2 rows."""
    whole = _record_batch(lo, hi)
    cuts = [0, 2, 4, 131, 2000, hi - lo]

    def batches() -> Iterator[MessageBatch]:
        for a, b in zip(cuts, cuts[1:], strict=False):
            yield MessageBatch.from_arrow(whole.slice(a, b - a))
    return batches


def _raw(bootstrap: str, topic: str, timestamps: list[tuple[int, int]] | None = None) -> list[Raw]:
    """The topic's committed messages; each one's (timestamp type, timestamp) appended to `timestamps` if given."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"raw-{uuid.uuid4().hex}",
                         "isolation.level": "read_committed", "enable.auto.commit": False})
    try:
        _, high = partition_ends(bootstrap, topic)
        consumer.assign([TopicPartition(topic, 0, 0)])
        out: list[Raw] = []
        deadline = time.monotonic() + 60
        while consumer.position([TopicPartition(topic, 0)])[0].offset < high:
            assert time.monotonic() < deadline, f"{topic} not read to its end ({high}) in 60 s: a transaction open?"
            for msg in consumer.consume(1000, 1.0):
                if not msg.error():
                    out.append((msg.key(), msg.value(), msg.headers()))
                    if timestamps is not None:
                        timestamps.append(msg.timestamp())
        return out
    finally:
        consumer.close()


def _watermarks(messages: list[Raw]) -> list[int]:
    """Each message's rowrelay.watermark header, in topic order."""
    return [int(dict(headers)["rowrelay.watermark"]) for _, _, headers in messages]


def _publish(services, table: str, topic: str, rows: int, again: bool = False, **producer: str
             ) -> tuple[list[Raw], str]:
    """Publish rows (0, rows] of table `arrow.public.<table>` to `topic` (its own progress and transactional id).
    `again`: the table is published under another prefix already; this deployment sends it again deliberately
    (a baseline at 0, as `rowrelay reset --after 0` records), or publishing would be refused."""
    conf = {"bootstrap.servers": services.kafka_bootstrap, **producer}
    channel = TableChannel.for_table(f"arrow.public.{table}", topic, prefix=f"rowrelay-{topic}")
    publisher = SlicePublisher(channel, conf)
    try:
        if again:
            publisher.publish_reset(0, "a second deployment of the table, for the comparison")
        result = publisher.publish(SliceRange(0, rows), _batches(0, rows))
    finally:
        publisher.close()
    assert result.progress.rows == rows
    assert visible_progress(conf, channel, rows).hi == rows
    return _raw(services.kafka_bootstrap, topic), result.progress.checksum


def _record_c_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every RowProducer.produce call from now on, as (rows produced, librdkafka's error for the next row)."""
    calls: list[tuple[int, int]] = []
    produce = RowProducer.produce

    def recorded(self: RowProducer, *args: object) -> tuple[int, int]:
        calls.append(produce(self, *args))
        return calls[-1]

    monkeypatch.setattr(RowProducer, "produce", recorded)
    return calls


def test_c_loop_produces_the_messages_confluent_kafka_would(services, name, monkeypatch) -> None:
    rows, calls = 3000, _record_c_calls(monkeypatch)
    before_ms = time.time_ns() // 1_000_000
    native, native_checksum = _publish(services, name, name, rows)
    after_ms = time.time_ns() // 1_000_000
    # Every batch's first and last row report their offsets through confluent-kafka; the rest came from C.
    sizes = [len(b) for b in _batches(0, rows)()]
    assert sizes == [2, 2, 127, 1869, 1000]
    from_c = sum(done for done, _ in calls)
    assert from_c == sum(n - 2 for n in sizes if n > 2), "the rows between first and last did not come from C"

    calls.clear()
    monkeypatch.setattr(RowProducer, "attach", classmethod(lambda cls, *args: None))  # as without the library
    python, python_checksum = _publish(services, name, f"{name}_py", rows, again=True)
    assert calls == []

    assert native == python
    assert native_checksum == python_checksum == slice_checksum([value for _, value, _ in native])
    expected = _record_batch(0, rows).to_pylist()
    assert [(k, v) for k, v, _ in native] == [(r["key"], r["value"]) for r in expected]
    assert [h for _, _, h in native] == [[("rowrelay.table", f"arrow.public.{name}".encode()),
                                          ("rowrelay.watermark", r["watermark_text"])] for r in expected]
    assert native[6][0] is None and native[10][0] == b""  # no key, and an empty one: not the same in Kafka

    # The CreateTime the C loop names (the clock read once per 1,024 rows) is right: in milliseconds, within the
    # publish, in the order the rows were produced, like librdkafka's own per message. (Were the tag dropped,
    # librdkafka's own clock would pass this too: the saving is measured, not tested.)
    timestamps: list[tuple[int, int]] = []
    _raw(services.kafka_bootstrap, name, timestamps)
    assert {kind for kind, _ in timestamps} == {TIMESTAMP_CREATE_TIME}
    times = [t for _, t in timestamps]
    assert before_ms <= times[0] and times[-1] <= after_ms and times == sorted(times), (before_ms, after_ms)


def test_full_local_queue_waits_and_loses_nothing(services, name, monkeypatch) -> None:
    rows, calls = 20_000, _record_c_calls(monkeypatch)
    messages, checksum = _publish(services, name, name, rows, **{"queue.buffering.max.messages": "500",
                                                           "linger.ms": "5"})
    assert QUEUE_FULL in [err for _, err in calls], "the local queue never filled: the test did not reach the wait"
    assert _watermarks(messages) == list(range(1, rows + 1))
    assert checksum == slice_checksum([value for _, value, _ in messages])


def test_c_loop_attaches_to_the_locked_confluent_kafka_only_where_checked(services, monkeypatch) -> None:
    producer = Producer({"bootstrap.servers": services.kafka_bootstrap})
    row_producer = RowProducer.attach(producer, "any-topic", "t", 0)
    assert row_producer is not None, "the locked confluent-kafka must take the C loop (CHECKED_VERSIONS)"
    row_producer.close()
    assert RowProducer.attach(object(), "any-topic", "t", 0) is None  # not a Producer: its memory is never read
    # Restored after the test (the loaded library, not failed): later tests in this process keep the C loop.
    monkeypatch.setattr(arrow_produce._Native, "_loaded", None)
    monkeypatch.setattr(arrow_produce._Native, "_failed", False)
    monkeypatch.setattr(arrow_produce, "CHECKED_VERSIONS", frozenset({"0.0.0"}))
    assert RowProducer.attach(producer, "any-topic", "t", 0) is None  # an unchecked version: confluent-kafka's path
    producer.flush(5)


@pytest.mark.parametrize("stale", ["int64_t produce_rows(void) { return 0; }",  # built before the ABI number
                                   "int produce_rows_abi(void) { return 1; }"], ids=["no-abi", "abi-1"])
def test_a_library_built_from_another_produce_rows_c_is_refused(services, name, monkeypatch, tmp_path,
                                                               stale: str) -> None:
    """A produce_rows.so left from an older source (its arguments no longer line up: calling it would crash the
    process) is not loaded: the rows go through confluent-kafka, all of them."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build a stale library with")
    source = tmp_path / "stale.c"
    source.write_text("#include <stdint.h>\n" + stale + "\n")
    library = tmp_path / "produce_rows.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    monkeypatch.setattr(arrow_produce, "LIBRARY", library)
    monkeypatch.setattr(arrow_produce._Native, "_loaded", None)  # restored after the test, as above
    monkeypatch.setattr(arrow_produce._Native, "_failed", False)
    calls = _record_c_calls(monkeypatch)
    messages, checksum = _publish(services, name, name, 3000)
    assert arrow_produce._Native._failed and calls == []  # refused at load; no row went through it
    assert _watermarks(messages) == list(range(1, 3001))
    assert checksum == slice_checksum([value for _, value, _ in messages])


_FASTBIN_PROBE = """
import ctypes, sys
from resources import arrow_produce

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "publisher":  # what a publishing process does: load the C loop
    assert arrow_produce._Native.get() is not None, "the C produce loop did not load"
# librdkafka's shape: many small chunks allocated, then freed together (past the per-thread cache's 7 per size).
chunks = [libc.malloc(48) for _ in range(2_000)]
for chunk in chunks:
    libc.free(chunk)
print(libc.mallinfo2().fsmblks)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="fastbins are glibc's")
def test_publishing_process_frees_small_chunks_without_fastbins() -> None:
    def fastbin_bytes(mode: str) -> int:
        return int(subprocess.run([sys.executable, "-c", _FASTBIN_PROBE, mode], check=True, capture_output=True,
                                  text=True, cwd=Path(arrow_produce.__file__).parents[1]).stdout)

    assert fastbin_bytes("plain") > 0, "the probe never reached glibc's fastbins: it cannot tell the setting apart"
    assert fastbin_bytes("publisher") == 0


def test_partitions_added_after_init_leave_every_row_in_the_one_the_offsets_name(services, name) -> None:
    """A publisher made for a one-partition topic names partition 0 on every row, from C and from Python: when
    partitions are added while it lives (a warm worker), its rows do not spread over partitions that its offsets,
    taken from each batch's first and last row, would not cover."""
    conf = {"bootstrap.servers": services.kafka_bootstrap, "topic.metadata.refresh.interval.ms": "100"}
    channel = TableChannel.for_table(f"arrow.public.{name}", name, prefix=f"rowrelay-{name}")
    publisher = SlicePublisher(channel, conf)
    try:
        publisher.publish(SliceRange(0, 2500), _batches(0, 2500))
        admin = AdminClient({"bootstrap.servers": services.kafka_bootstrap})
        admin.create_partitions([NewPartitions(name, 4)])[name].result(timeout=30)
        deadline = time.monotonic() + 30
        while len(publisher.producer.list_topics(name, timeout=5).topics[name].partitions) < 4:
            assert time.monotonic() < deadline, "the producer never saw the new partitions"
            time.sleep(0.1)
        time.sleep(0.5)  # a few of its own metadata refreshes (100 ms)
        publisher.publish(SliceRange(2500, 5000), _batches(2500, 5000))
    finally:
        publisher.close()
    assert [partition_ends(services.kafka_bootstrap, name, p)[1] for p in (1, 2, 3)] == [0, 0, 0]
    messages = _raw(services.kafka_bootstrap, name)
    assert _watermarks(messages) == list(range(1, 5001))
    progress = visible_progress(conf, channel, 5000)  # offset 2500 is the first slice's commit marker
    assert progress.hi == 5000 and progress.offsets == {"0": [2501, 5000]}, progress.offsets
