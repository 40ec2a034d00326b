"""The streaming source `spark.readStream.format("nsq")`: a `DataSourceStreamReader` whose messages are
received and FIN'd in the driver process Spark keeps for the source, and handed to Spark by executor
tasks as Arrow record batches.

Why there: a message can only be FIN'd on the connection that received it, and Spark tells a source that
a micro-batch is done by calling `commit(end)` in that driver process, after the tasks are gone (and NSQ
cannot read a range again by offset, as Kafka's source does). So the Fetcher (fetcher.py: several
connections per broker, on a Trio thread) lives there; the tasks only carry what it received.

Offsets are `{"batch": n}`: a count of micro-batches, not positions in NSQ (a channel has none).
- `latestOffset(start)` takes what arrived (up to max_messages_per_batch / max_bytes_per_batch) and files
  it under batch start+1; nothing arrived: the offset stays (or moves by one empty batch, so that Spark
  commits the last one now).
- `partitions(start, end)` cuts the batch's frames into the tasks' partitions, joined, not decoded
  (`Frames`); `read()`, in the task, cuts them column-wise into one Arrow record batch.
- `commit(end)` FINs every message of the batches up to `end`, each on its own connection.
- `stop()`, or the process ending: what was not committed goes back to nsqd (REQ, or msg_timeout after
  the connections close). On restart from a checkpoint, Spark replays a batch that was planned but not
  committed: its messages are no longer ours, so that batch is replayed empty and its messages arrive in
  later batches, with `attempts` one higher.
"""
from __future__ import annotations

import array
import logging
import sys
from itertools import accumulate, chain
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.types import BinaryType, IntegerType, StringType, StructField, StructType, TimestampType

if TYPE_CHECKING:
    from trio_nsq.spark.fetcher import Chunk, Fetcher

log = logging.getLogger("trio_nsq.spark")

SCHEMA = StructType([
    StructField("value", BinaryType(), False),
    StructField("topic", StringType(), False),
    StructField("channel", StringType(), False),
    StructField("id", StringType(), False),
    StructField("timestamp", TimestampType(), False),
    StructField("attempts", IntegerType(), False),
    StructField("nsqd_address", StringType(), False),
])


def arrow_schema():
    """SCHEMA as the Arrow schema of the record batches `read()` hands to Spark (pyarrow is imported here:
    the tasks need it, the driver's planning does not)."""
    import pyarrow as pa

    return pa.schema([
        pa.field("value", pa.binary(), False), pa.field("topic", pa.string(), False),
        pa.field("channel", pa.string(), False), pa.field("id", pa.string(), False),
        pa.field("timestamp", pa.timestamp("us", tz="UTC"), False), pa.field("attempts", pa.int32(), False),
        pa.field("nsqd_address", pa.string(), False)])


@dataclass(frozen=True)
class ReadSettings:
    topic: str
    channel: str
    nsqd_tcp_addresses: tuple[str, ...]
    lookupd_http_addresses: tuple[str, ...]
    max_messages_per_batch: int
    max_bytes_per_batch: int
    max_in_flight: int
    msg_timeout: int | None  # ms, asked for in IDENTIFY; None: the broker's --msg-timeout


def address_runs(chunks: list[Chunk]) -> list[tuple[str, int]]:
    """Which broker sent the chunks' messages, in order: (address, count), one run per broker change."""
    runs: list[tuple[str, int]] = []
    for chunk in chunks:
        if runs and runs[-1][0] == chunk.conn.address:
            runs[-1] = (chunk.conn.address, runs[-1][1] + len(chunk.frames))
        elif chunk.frames:
            runs.append((chunk.conn.address, len(chunk.frames)))
    return runs


class Frames(InputPartition):
    """Messages as they came on the wire, for a task to turn into rows: their frames joined into one
    bytes (`data`), where each starts (`offsets`: int32, one more than there are frames), and which
    broker sent them (`addresses`: (address, count) runs, in order).

    Why frames, not rows: a micro-batch is planned on the driver, in the one process that holds the
    connections; cutting its record batch there (and an Arrow IPC stream per task) put that work between
    two micro-batches, on one core. Joining frames is one C call; the tasks cut the columns side by side."""

    def __init__(self, frames: list[bytes], addresses: list[tuple[str, int]]) -> None:
        self.data = b"".join(frames)
        if len(self.data) >= 1 << 31:
            raise ValueError("nsq source: over 2 GiB of messages in one task; lower max_bytes_per_batch")
        self.offsets = array.array("i", accumulate(map(len, frames), initial=0)).tobytes()
        self.addresses = addresses

    @classmethod
    def split(cls, chunks: list[Chunk], parts: int) -> list[Frames]:
        """The chunks' messages in `parts` partitions of about as many messages each, in order (more
        partitions where that would put over 1 GiB in one: a partition's offsets are int32)."""
        frames = list(chain.from_iterable(chunk.frames for chunk in chunks))
        runs = address_runs(chunks)
        parts = max(parts, -(-sum(map(len, frames)) // (1 << 30)))
        step = max(1, -(-len(frames) // parts))
        out = []
        for first in range(0, len(frames), step):
            part, room = [], step  # the runs of frames[first:first + step]
            while room and runs:
                address, count = runs[0]
                take = min(count, room)
                part.append((address, take))
                room -= take
                if take == count:
                    runs.pop(0)
                else:
                    runs[0] = (address, count - take)
            out.append(cls(frames[first:first + step], part))
        return out or [cls([], [])]

    def __len__(self) -> int:
        return len(self.offsets) // 4 - 1

    def record_batch(self, settings: ReadSettings):
        """The messages as one Arrow record batch of SCHEMA (Spark takes it as it is: no row tuples), cut
        column-wise out of the frames (`[timestamp ns:int64 BE][attempts:uint16 BE][id:16][body]`): no
        Python work per message."""
        import pyarrow as pa
        import pyarrow.compute as pc

        from trio_nsq.client.connection import MAX_FRAME_SIZE  # (here: the tasks need no trio)

        n = len(self)
        frames = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(self.offsets), pa.py_buffer(self.data)])

        def big_endian(start: int, code: str, arrow_type):
            """The fixed-width big-endian integer at `start` of every frame, as an Arrow array."""
            values = array.array(code)
            width = values.itemsize
            column = pc.binary_slice(frames, start, start + width).cast(pa.binary(width))
            values.frombytes(memoryview(column.buffers()[1])[:width * n])
            if sys.byteorder == "little":
                values.byteswap()
            return pa.Array.from_buffers(arrow_type, n, [None, pa.py_buffer(values)])

        def same(value: str, count: int):
            return pa.repeat(pa.scalar(value, pa.string()), count)  # (no Python list of `count` strings)

        return pa.record_batch([
            pc.binary_slice(frames, 26, MAX_FRAME_SIZE),
            same(settings.topic, n),
            same(settings.channel, n),
            pc.binary_slice(frames, 10, 26).cast(pa.string()),  # ids are ASCII
            pc.divide(big_endian(0, "q", pa.int64()), 1000).cast(pa.timestamp("us", tz="UTC")),
            big_endian(8, "H", pa.uint16()).cast(pa.int32()),
            pa.concat_arrays([same(address, count) for address, count in self.addresses] or [same("", 0)]),
        ], schema=arrow_schema())


def to_record_batch(settings: ReadSettings, chunks: list[Chunk]):
    """The chunks' messages as one Arrow record batch of SCHEMA."""
    frames = list(chain.from_iterable(chunk.frames for chunk in chunks))
    return Frames(frames, address_runs(chunks)).record_batch(settings)


class NSQStreamReader(DataSourceStreamReader):
    """Called by Spark: `latestOffset`, `partitions` and `commit` on the driver, in the one Python process
    Spark keeps for the source (where the Fetcher lives); `read` in executor tasks."""

    def __init__(self, settings: ReadSettings, partitions: int = 2) -> None:
        self.settings = settings
        self.slices = partitions
        self._fetcher: Fetcher | None = None
        self._planned: dict[int, list[Chunk]] = {}  # batch -> its messages, until its commit

    @property
    def fetcher(self) -> Fetcher:
        if self._fetcher is None:  # started on first use, in the process that keeps the reader
            from trio_nsq.spark.fetcher import Fetcher

            self._fetcher = Fetcher(self.settings)
            log.info("nsq source: consuming %s/%s", self.settings.topic, self.settings.channel)
            # Spark runs the first micro-batch whatever the first latestOffset says: once connected, and
            # once what the channel held has come (up to a batch), it carries that instead of nothing or a
            # part (each micro-batch costs Spark a fixed ~0.2 s; a broker that is down costs this once)
            if self._fetcher.wait_connected(timeout=2.0):
                self._fetcher.wait_settled(self.settings.max_messages_per_batch, quiet=0.05, timeout=1.0)
        return self._fetcher

    def initialOffset(self) -> dict:
        return {"batch": 0}

    def latestOffset(self, start: dict, limit=None) -> dict:
        batch = int(start["batch"]) + 1
        if batch in self._planned:  # asked again for the same start: the same batch
            return {"batch": batch}
        messages = self.fetcher.call(self.fetcher.take, batch)
        if not messages:
            if self.fetcher.call(self.fetcher.holding, batch):
                # Spark commits a batch to its source only when it plans the next one: an empty batch
                # now gets the last one FIN'd without waiting for more data
                return {"batch": batch}
            return start
        self._planned[batch] = messages
        return {"batch": batch}

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        first, last = int(start["batch"]) + 1, int(end["batch"])
        planned = [chunk for b in range(first, last + 1) for chunk in self._planned.get(b, ())]
        if not planned and last >= first and self._fetcher is None:
            # a batch planned by an earlier run of the query and not committed: its messages went back
            # to nsqd when that run's connections closed, and come again in later batches
            log.warning("nsq source: batches %d..%d of an earlier run are replayed empty; nsqd delivers "
                        "their messages again", first, last)
        return list(Frames.split(planned, self.slices))

    def read(self, partition: InputPartition) -> Iterator:
        assert isinstance(partition, Frames)
        if len(partition):
            yield partition.record_batch(self.settings)

    def commit(self, end: dict) -> None:
        for batch in [b for b in self._planned if b <= int(end["batch"])]:
            del self._planned[batch]
        if self._fetcher is not None:
            self._fetcher.call(self._fetcher.commit, int(end["batch"]))

    def stop(self) -> None:
        """The query stops (or failed): what was not committed is REQ'd, so nsqd delivers it again at
        once instead of after msg_timeout, and the connections close (the process may outlive the query)."""
        if self._fetcher is not None:
            fetcher, self._fetcher = self._fetcher, None
            fetcher.close(requeue_held=True)
