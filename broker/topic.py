"""Topic: where publishers put messages; its message_pump copies each one to every channel (nsqd/topic.go)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import trio

from trio_nsq.broker.backend import BackendError, BackendQueue
from trio_nsq.broker.channel import Channel
from trio_nsq.broker.guid import GUIDFactory
from trio_nsq.broker.idempotency import IdempotencyKeys
from trio_nsq.broker.message import Message, encode_record
from trio_nsq.broker.message_queue import MessageQueue
from trio_nsq.broker.quantile import Quantile
from trio_nsq.shared.names import is_ephemeral, is_valid_channel_name

if TYPE_CHECKING:
    from trio_nsq.broker.options import Options


class TopicOwner(Protocol):
    """What a Topic needs from the broker that holds it (NSQD): its options and data path, a backend per
    queue, a task spawned in the broker's nursery, and to be told about channel changes and deletes."""

    options: Options
    data_path: str

    def make_backend(self, topic_name: str, channel_name: str | None = None) -> BackendQueue: ...

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None: ...

    def notify_channel(self, channel: Channel, created: bool) -> None: ...

    def delete_topic(self, name: str) -> None: ...

log = logging.getLogger("nsqd")

# How many messages the pump moves per scheduling round: large enough to amortise the await,
# small enough that consumers' pumps get to run between rounds.
PUMP_BATCH = 512


@attrs.frozen
class Published:
    """What Topic.publish did: how many messages, and whether the answer must wait for an fsync."""

    count: int
    sync: BackendQueue | None  # --sync-every=1 and something went to disk: await sync.sync() before OK
    all_durable: bool  # every message went to the disk queue: after the fsync, all of them are durable


class Topic:
    """A topic (nsqd's Topic): its MessageQueue, its channels and its message_pump. `run`, started by
    NSQD, owns a nursery with the backend's io_loop, each Channel's `run` and the message_pump, which
    copies every message to every channel. Publishers (ProtocolV2's PUB/MPUB/DPUB, the HTTP /pub and
    /mpub) call `publish` from their own tasks; it never awaits, so what is queued is consistent when the
    pump runs. Channel changes come from SUB and the HTTP API through get_channel/delete_channel."""

    def __init__(self, nsqd: TopicOwner, name: str, backend: BackendQueue) -> None:
        self.nsqd = nsqd
        self.name = name
        self.ephemeral = is_ephemeral(name)
        self.queue = MessageQueue(f"TOPIC({name})", backend, self.ephemeral)
        self.mem_queue_size = nsqd.options.mem_queue_size
        self.sync_every = nsqd.options.sync_every
        self.channels: dict[str, Channel] = {}
        self.paused = False
        self.exiting = False
        self.guid = GUIDFactory(nsqd.options.node_id)
        # Idempotency-Keys accepted on /pub and /mpub; an ephemeral topic's stay in memory, as its messages
        self.idempotency = IdempotencyKeys(
            name, None if self.ephemeral else nsqd.data_path,
            window=nsqd.options.idempotency_window, max_keys=nsqd.options.max_idempotency_keys,
        )
        # set by NSQD for a topic created at run time: asks the lookupds for the topic's channels
        self.channels_from_lookupd: Callable[[str], Awaitable[list[str]]] | None = None

        self.message_count = 0
        self.message_bytes = 0

        self.waiting_for_room = False
        self._receiving = False  # the pump waits for messages and has room for them
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._scope: trio.CancelScope | None = None
        self._started = trio.Event()

    def __repr__(self) -> str:
        return f"Topic({self.name})"

    # --- task ---------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Owns the message_pump, the backend's io_loop and every channel's tasks."""
        with trio.CancelScope() as self._scope:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.queue.backend.run)
                for channel in self.channels.values():
                    nursery.start_soon(channel.run)
                self._started.set()
                task_status.started()
                if self.channels_from_lookupd is not None:
                    # as nsqd's GetTopic: the channels consumers have elsewhere exist before the pump
                    # starts, so they get every message published here (publishers are not held up)
                    for name in await self.channels_from_lookupd(self.name):
                        if not is_ephemeral(name) and is_valid_channel_name(name):
                            self.get_channel(name)
                nursery.start_soon(self.message_pump)

    def cancel(self) -> None:
        if self._scope is not None:
            self._scope.cancel()

    def wake(self) -> None:
        self._wake.set()

    async def message_pump(self) -> None:
        """Drain the topic in batches and copy every message to every channel.

        It only reads while the topic has channels and is not paused (nsqd keeps messages in the topic
        until a channel exists), and only as many as every channel can take, so a full channel makes
        the topic wait instead of losing messages.
        """
        while True:
            batch = 0
            if not self.paused and self.channels:
                room = min(ch.room() for ch in self.channels.values())
                batch = min(PUMP_BATCH, room)
                self.waiting_for_room = room == 0 and self.depth() > 0
            if not (batch and self._copy(batch)):
                self._wake = trio.Event()
                self._receiving = batch > 0  # it would take a message at once (see _memory_room)
                try:
                    await self._wake.wait()
                finally:
                    self._receiving = False
                continue
            await trio.lowlevel.checkpoint()

    def _copy(self, n: int) -> int:
        """Copy up to n messages to every channel; how many were taken from the topic.

        Where every one of them would only be encoded again for the channels' disk queues (the topic's
        memory queue is empty, its disk records have no deadlines, every channel's memory is full:
        --mem-queue-size=0), the records go through as they are, without a Message each."""
        channels = list(self.channels.values())
        queue = self.queue
        if not queue.memory and not queue.backend.has_deadlines() and all(ch.takes_records() for ch in channels):
            positions: list[int] = []
            records = queue.take_records(n, positions)
            if records:
                for channel in channels:
                    channel.put_records(records, positions)
            return len(records)
        msgs: list[Message] = []
        queue.take_memory(msgs, n)
        queue.take_backend(msgs, n)
        if msgs:
            # copies first: each channel takes its messages' topic positions (see Channel.put_messages)
            copies = [[msg.copy() for msg in msgs] for _ in channels[1:]]
            channels[0].put_messages(msgs)
            for channel, copy in zip(channels[1:], copies):
                channel.put_messages(copy)
        return len(msgs)

    # --- publishing ---------------------------------------------------------------------------

    def depth(self) -> int:
        return self.queue.depth()

    def publish(self, bodies: Sequence[bytes], deferred: float = 0.0) -> Published:
        """The one publish path of PUB, MPUB, DPUB, /pub and /mpub: new ids, queued in order (memory
        first, the rest in one backend write), counted. Raises BackendError when the backend refuses
        (the callers answer E_PUB_FAILED, 503 ...). What the answer still waits for is in the result:
        with --sync-every=1, the fsync of `sync` (the caller awaits it, or a TCP connection once for all
        the publishes of one read)."""
        if self.exiting:
            raise BackendError("exiting")
        # ids made in one batch, and one timestamp for the batch (a clock read per message cost more)
        ids = self.guid.new_ids(len(bodies))
        now = time.time_ns()
        if self.ephemeral or self._memory_room(deferred > 0) > 0:
            msgs = list(map(Message, ids, bodies, repeat(now)))
            if deferred:
                for msg in msgs:
                    msg.deferred = deferred
            written = self._put(msgs)
        else:
            written = self._write(ids, bodies, now, deferred)
        sync = self.queue.backend if written and self.sync_every == 1 else None
        return Published(len(bodies), sync, sync is not None and written == len(bodies))

    def _put(self, msgs: list[Message]) -> int:
        """Queue messages in order (memory first, the rest in one backend write); how many went to the
        backend. On BackendError the ones before the failing one stay queued (as nsqd) and are counted."""
        if not msgs:
            return 0
        room = max(0, self._memory_room(msgs[0].deferred > 0))
        try:
            past_memory = self.queue.put(msgs, room)  # an ephemeral topic's overflow is discarded
        except BackendError as exc:
            self._counted([msg.body for msg in msgs[:room + exc.stored]])
            raise
        self._counted([msg.body for msg in msgs])
        return 0 if self.ephemeral else past_memory

    def _write(self, ids: list[bytes], bodies: Sequence[bytes], now: int, deferred: float) -> int:
        """_put when the memory queue has no room (always, with --mem-queue-size=0): the records go to
        the disk queue in one write, with no Message made only to be encoded."""
        records = list(map(encode_record, repeat(now), repeat(0), ids, bodies))
        try:
            self.queue.backend.put_many(records, deferred)
        except BackendError as exc:
            self._counted(bodies[:exc.stored])
            raise
        self._counted(bodies)
        return len(records)

    def _memory_room(self, deferred: bool) -> int:
        """How many messages the memory queue takes now. nsqd's memory queue is a Go channel of
        --mem-queue-size: a send to it also succeeds when the pump is waiting to receive. nsqd tries
        that hand-off only for what the backend cannot hold as it is: an ephemeral topic's messages
        (no backend) and deferred ones (nsqd's disk record loses the delay; ours keeps it, so a deferred
        message of a topic with a disk queue goes there and survives a crash); with --mem-queue-size=0
        it is the only way into memory."""
        in_memory = len(self.queue.memory)
        room = self.mem_queue_size - in_memory
        if self._receiving and (self.ephemeral or (deferred and not self.queue.backend.stores)):
            room = max(room, PUMP_BATCH - in_memory)
        return room

    def _counted(self, bodies: Sequence[bytes]) -> None:
        if bodies:
            self.message_count += len(bodies)
            self.message_bytes += sum(map(len, bodies))
            self._wake.set()

    # --- channels -----------------------------------------------------------------------------

    def get_channel(self, name: str) -> Channel:
        channel = self.channels.get(name)
        if channel is None:
            channel = Channel(self, name, self.nsqd.make_backend(self.name, name), self.mem_queue_size)
            opts = self.nsqd.options
            if opts.e2e_processing_latency_percentiles:
                channel.e2e = Quantile(opts.e2e_processing_latency_window_time, opts.e2e_processing_latency_percentiles)
            self.channels[name] = channel
            if self._nursery is not None:
                self._nursery.start_soon(channel.run)
            log.info("TOPIC(%s): new channel(%s)", self.name, name)
            self.nsqd.notify_channel(channel, created=True)
            self._wake.set()
        return channel

    def get_existing_channel(self, name: str) -> Channel | None:
        return self.channels.get(name)

    def delete_channel(self, name: str) -> None:
        channel = self.channels.pop(name, None)
        if channel is None:
            raise KeyError(name)
        channel.exit()
        log.info("TOPIC(%s): deleting channel %s", self.name, name)
        for client in list(channel.clients.values()):
            self.nsqd.spawn(client.close)
        channel.cancel()
        channel.queue.backend.delete()  # the files are gone before the caller answers, as in nsqd
        self.nsqd.notify_channel(channel, created=False)
        self._wake.set()
        if not self.channels and self.ephemeral and not self.exiting:
            self.nsqd.delete_topic(self.name)

    # --- admin --------------------------------------------------------------------------------

    def pause(self) -> None:
        """The caller persists the metadata (nsqd's /topic/pause does, so a crash cannot undo it)."""
        self.paused = True

    def unpause(self) -> None:
        self.paused = False
        self._wake.set()

    def exit(self) -> None:
        """The broker is exiting or deleting the topic: publishes fail from now on, and so do its
        channels' FIN/REQ/TOUCH bookkeeping."""
        self.exiting = True
        for channel in self.channels.values():
            channel.exit()

    async def empty(self) -> None:
        await self.queue.empty()
