"""The streaming source `spark.readStream.format("nsq")`: a `SimpleDataSourceStreamReader` holding a Trio
`Consumer` (shared/client) on a thread of its own.

Why the simple reader: a message can only be FIN'd on the connection that received it, and Spark tells
a source that a micro-batch is done by calling `commit(end)` on the driver, in the one long-lived Python
process that also calls `read()`. `SimpleDataSourceStreamReader` reads on the driver in that same process
(Spark caches what `read()` returned and ships it with the batch's single partition), so the consumer,
its connections and the messages waiting for their FIN all live where `commit()` runs. The partitioned
`DataSourceStreamReader` reads in executor tasks, which cannot FIN on the driver's connections (and
NSQ cannot read a range again by offset).

Offsets are `{"batch": n}`: a count of micro-batches, not positions in NSQ (a channel has none).
- `read(start)` takes up to `max_messages_per_batch` of the messages that arrived, files them under
  batch start+1 and returns them as one Arrow record batch; nothing arrived: the offset stays.
- the messages stay in flight on the broker meanwhile: a task TOUCHes them every msg_timeout / 2.
- `commit(end)` FINs every message of the batches up to `end`, each on its own connection.
- the process ends (query stopped or crashed): the connections close and, once their msg_timeout has
  passed since the last TOUCH, nsqd gives the messages they held to another consumer. On restart from a checkpoint, Spark replays a batch that was planned
  but not committed through `readBetweenOffsets`: its messages are no longer ours (nsqd has them back
  and delivers them again, to this query or to another consumer of the channel), so that batch is
  replayed empty and its messages arrive in later batches, with `attempts` one higher.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pyspark.sql.datasource import SimpleDataSourceStreamReader
from pyspark.sql.types import BinaryType, IntegerType, StringType, StructField, StructType, TimestampType

if TYPE_CHECKING:
    import trio

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
    max_in_flight: int
    msg_timeout: int | None  # ms, asked for in IDENTIFY; None: the broker's --msg-timeout


class _Held:
    """A message handed to Spark and waiting for its batch's commit; its handler task waits on `done`."""

    __slots__ = ("message", "done")

    def __init__(self, message, done: trio.Event) -> None:
        self.message = message
        self.done = done  # made in the Trio thread


class ConsumerThread:
    """A Trio run on a daemon thread holding one Consumer. Spark's thread talks to it through
    trio.from_thread; the thread dies with the process (the Python worker Spark started for the
    source), which closes the sockets: what was not FIN'd times out on nsqd and is delivered again."""

    def __init__(self, settings: ReadSettings) -> None:
        self.settings = settings
        # messages received, not yet taken by read(): at most max_in_flight (that is all nsqd sends)
        self.arrived: deque[_Held] = deque()
        self.batches: dict[int, list[_Held]] = {}  # batch number -> messages handed to Spark in it
        self._token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="nsq-source", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure

    def _run(self) -> None:
        import trio

        try:
            trio.run(self._main)
        except BaseException as exc:  # noqa: BLE001 - reported to the thread that waits for the start
            self._failure = exc
            self._ready.set()
            log.error("nsq source: consumer thread ended: %r", exc)

    async def _main(self) -> None:
        import trio

        from trio_nsq.shared.client.consumer import Consumer

        s = self.settings
        identify = {"msg_timeout": s.msg_timeout} if s.msg_timeout else {}
        # every message waits in its handler until its batch commits: one worker per message in flight;
        # a handler never fails, so there is no backoff and no giving up (max_attempts=0)
        async with Consumer(s.topic, s.channel, self._handle, nsqd_tcp_addresses=s.nsqd_tcp_addresses,
                            lookupd_http_addresses=s.lookupd_http_addresses, max_in_flight=s.max_in_flight,
                            concurrency=s.max_in_flight, max_attempts=0, identify=identify,
                            lookupd_poll_interval=15.0) as consumer:
            self.consumer = consumer
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            while True:
                await self._touch_held()

    async def _handle(self, message) -> None:
        import trio

        held = _Held(message, trio.Event())
        self.arrived.append(held)
        await held.done.wait()  # returns at commit: the Consumer FINs it on its connection

    async def _touch_held(self) -> None:
        """TOUCH what Spark holds every msg_timeout / 2, so nsqd keeps it in flight until the commit.
        (nsqd stops honouring TOUCH at --max-msg-timeout after the delivery: a batch must commit by then.)"""
        import trio

        timeouts = [conn.msg_timeout for conn in self.consumer.connections.values()] or [60_000]
        await trio.sleep(min(timeouts) / 2000)
        from trio_nsq.shared.client.connection import NSQConnectionError

        conns = set()
        for held in list(self.arrived) + [h for batch in list(self.batches.values()) for h in batch]:
            conn = held.message.conn
            if not held.done.is_set() and not conn.is_closed:
                try:
                    conn.touch(held.message.id)
                except NSQConnectionError:
                    continue  # nsqd has it back already
                conns.add(conn)
        for conn in conns:
            try:
                await conn.drain()
            except NSQConnectionError:
                pass

    def call(self, fn, *args):
        import trio

        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    # --- run in the Trio thread (through call) -----------------------------------------------------

    def take(self, batch: int) -> list:
        n = min(len(self.arrived), self.settings.max_messages_per_batch)
        held = [self.arrived.popleft() for _ in range(n)]
        if held:  # (a read planned twice for one batch adds to it)
            self.batches.setdefault(batch, []).extend(held)
        return [h.message for h in held]

    def holding(self, batch: int) -> bool:
        """Whether messages of batches before `batch` still wait for their commit."""
        return any(b < batch for b in self.batches)

    def commit(self, upto: int) -> int:
        finished = 0
        for batch in sorted(b for b in self.batches if b <= upto):
            for held in self.batches.pop(batch):
                held.done.set()
                finished += 1
        return finished


def to_record_batch(settings: ReadSettings, messages: list):
    import pyarrow as pa

    schema = pa.schema([
        pa.field("value", pa.binary(), False), pa.field("topic", pa.string(), False),
        pa.field("channel", pa.string(), False), pa.field("id", pa.string(), False),
        pa.field("timestamp", pa.timestamp("us", tz="UTC"), False), pa.field("attempts", pa.int32(), False),
        pa.field("nsqd_address", pa.string(), False)])
    n = len(messages)
    return pa.record_batch([
        pa.array([m.body for m in messages], pa.binary()),
        pa.array([settings.topic] * n, pa.string()),
        pa.array([settings.channel] * n, pa.string()),
        pa.array([m.id.decode("ascii") for m in messages], pa.string()),
        pa.array([m.timestamp // 1000 for m in messages], pa.timestamp("us", tz="UTC")),
        pa.array([m.attempts for m in messages], pa.int32()),
        pa.array([m.conn.address for m in messages], pa.string()),
    ], schema=schema)


class NSQStreamReader(SimpleDataSourceStreamReader):
    def __init__(self, settings: ReadSettings) -> None:
        self.settings = settings
        self._consumer: ConsumerThread | None = None

    @property
    def consumer(self) -> ConsumerThread:
        if self._consumer is None:  # started on first use, in the process that keeps the reader
            self._consumer = ConsumerThread(self.settings)
            log.info("nsq source: consuming %s/%s", self.settings.topic, self.settings.channel)
        return self._consumer

    def initialOffset(self) -> dict:
        return {"batch": 0}

    def read(self, start: dict) -> tuple[Iterator, dict]:
        batch = int(start["batch"]) + 1
        messages = self.consumer.call(self.consumer.take, batch)
        if not messages:
            if self.consumer.call(self.consumer.holding, batch):
                # Spark commits a batch to its source only when it plans the next one: an empty batch
                # now gets the last one FIN'd without waiting for more data
                return iter(()), {"batch": batch}
            return iter(()), start
        return iter([to_record_batch(self.settings, messages)]), {"batch": batch}

    def readBetweenOffsets(self, start: dict, end: dict) -> Iterator:
        # a batch planned by an earlier run of the query and not committed: its messages went back to
        # nsqd when that run's connections closed, and come again in later batches
        if start != end:
            log.warning("nsq source: batches %s..%s of an earlier run are replayed empty; nsqd delivers their "
                        "messages again", start.get("batch"), end.get("batch"))
        return iter(())

    def commit(self, end: dict) -> None:
        if self._consumer is not None:
            self._consumer.call(self._consumer.commit, int(end["batch"]))
