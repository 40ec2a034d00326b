"""The streaming source `spark.readStream.format("nsq")`: a `DataSourceStreamReader` whose messages are
received and FIN'd in the driver process Spark keeps for the source, and handed to Spark by executor
tasks as Arrow record batches.

Why there: a message can only be FIN'd on the connection that received it, and Spark tells a source that
a micro-batch is done by calling `commit(end)` in that driver process, after the tasks are gone (and NSQ
cannot read a range again by offset, as Kafka's source does). So the Fetcher (fetcher.py: several
connections per broker, on a Trio thread) lives there; the tasks only carry what it received.

Offsets are `{"batch": n}`: a count of micro-batches, not positions in NSQ (a channel has none).
- `latestOffset(start)` takes what arrived (up to max_messages_per_batch / max_bytes_per_batch), files it
  under batch start+1 and turns it into one record batch; nothing arrived: the offset stays (or moves by
  one empty batch, so that Spark commits the last one now).
- `partitions(start, end)` slices that record batch into the tasks' partitions; `read()` yields a slice.
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
from itertools import chain
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.types import BinaryType, IntegerType, StringType, StructField, StructType, TimestampType

if TYPE_CHECKING:
    from trio_nsq.shared.spark.fetcher import Chunk, Fetcher

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


def to_record_batch(settings: ReadSettings, chunks: list[Chunk]):
    """The messages as one Arrow record batch of SCHEMA (Spark takes it as it is: no row tuples), cut
    column-wise out of their frames (`[timestamp ns:int64 BE][attempts:uint16 BE][id:16][body]`): no
    Python work per message."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from trio_nsq.shared.client.connection import MAX_FRAME_SIZE  # (here: the tasks that only hand over
    # a slice need neither trio nor the client)

    schema = pa.schema([
        pa.field("value", pa.binary(), False), pa.field("topic", pa.string(), False),
        pa.field("channel", pa.string(), False), pa.field("id", pa.string(), False),
        pa.field("timestamp", pa.timestamp("us", tz="UTC"), False), pa.field("attempts", pa.int32(), False),
        pa.field("nsqd_address", pa.string(), False)])
    frames = pa.array(list(chain.from_iterable(chunk.frames for chunk in chunks)), pa.binary())
    n = len(frames)

    def big_endian(start: int, code: str, arrow_type):
        """The fixed-width big-endian integer at `start` of every frame, as an Arrow array."""
        values = array.array(code)
        width = values.itemsize
        column = pc.binary_slice(frames, start, start + width).cast(pa.binary(width))
        values.frombytes(memoryview(column.buffers()[1])[:width * n])
        if sys.byteorder == "little":
            values.byteswap()
        return pa.Array.from_buffers(arrow_type, n, [None, pa.py_buffer(values)])

    return pa.record_batch([
        pc.binary_slice(frames, 26, MAX_FRAME_SIZE),
        pa.array([settings.topic] * n, pa.string()),
        pa.array([settings.channel] * n, pa.string()),
        pc.binary_slice(frames, 10, 26).cast(pa.string()),  # ids are ASCII
        pc.divide(big_endian(0, "q", pa.int64()), 1000).cast(pa.timestamp("us", tz="UTC")),
        big_endian(8, "H", pa.uint16()).cast(pa.int32()),
        pa.array(list(chain.from_iterable([chunk.conn.address] * len(chunk.frames) for chunk in chunks)),
                 pa.string()),
    ], schema=schema)


class RowsPartition(InputPartition):
    """A slice of a micro-batch's messages, as an Arrow IPC stream: planned on the driver, where the
    messages were received, and pickled into the task that hands them to Spark. (IPC, because a pickled
    slice of a record batch carries the whole batch's buffers: every task would get every row.)"""

    def __init__(self, rows) -> None:
        self.ipc: bytes | None = None
        if rows is not None:
            import pyarrow as pa

            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, rows.schema) as writer:
                writer.write_batch(rows)
            self.ipc = sink.getvalue().to_pybytes()

    def rows(self):
        import pyarrow as pa

        return None if self.ipc is None else pa.ipc.open_stream(self.ipc).read_next_batch()


class NSQStreamReader(DataSourceStreamReader):
    """Called by Spark: `latestOffset`, `partitions` and `commit` on the driver, in the one Python process
    Spark keeps for the source (where the Fetcher lives); `read` in executor tasks."""

    def __init__(self, settings: ReadSettings, partitions: int = 2) -> None:
        self.settings = settings
        self.slices = partitions
        self._fetcher: Fetcher | None = None
        self._planned: dict[int, Any] = {}  # batch -> its record batch, until its commit

    @property
    def fetcher(self) -> Fetcher:
        if self._fetcher is None:  # started on first use, in the process that keeps the reader
            from trio_nsq.shared.spark.fetcher import Fetcher

            self._fetcher = Fetcher(self.settings)
            log.info("nsq source: consuming %s/%s", self.settings.topic, self.settings.channel)
            # Spark runs the first micro-batch whatever the first latestOffset says: once connected, it
            # carries what the channel holds instead of nothing (a broker that is down costs this once)
            self._fetcher.wait_connected(timeout=2.0)
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
        self._planned[batch] = to_record_batch(self.settings, messages)
        return {"batch": batch}

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        first, last = int(start["batch"]) + 1, int(end["batch"])
        planned = [self._planned[b] for b in range(first, last + 1) if b in self._planned]
        if not planned:
            if last >= first and self._fetcher is None:
                # a batch planned by an earlier run of the query and not committed: its messages went back
                # to nsqd when that run's connections closed, and come again in later batches
                log.warning("nsq source: batches %d..%d of an earlier run are replayed empty; nsqd delivers "
                            "their messages again", first, last)
            return [RowsPartition(None)]
        import pyarrow as pa

        rows = pa.Table.from_batches(planned).combine_chunks().to_batches()[0] if len(planned) > 1 else planned[0]
        step = -(-rows.num_rows // self.slices)
        return [RowsPartition(rows.slice(i, step)) for i in range(0, rows.num_rows, step)]

    def read(self, partition: InputPartition) -> Iterator:
        assert isinstance(partition, RowsPartition)
        rows = partition.rows()
        if rows is not None:
            yield rows

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
