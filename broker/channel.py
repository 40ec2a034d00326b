"""Channel: a topic's copy of the stream for one set of consumers (nsqd/channel.go).

A channel holds a bounded memory queue that overflows to its backend queue, the in-flight table of
messages sent to consumers and not yet FIN'd, and the deferred queue (DPUB, REQ with a delay). Its
consumers' message pumps take messages in batches with take(); queue-scan workers move timed-out and
due messages back with process_in_flight_queue()/process_deferred_queue().
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import trio

from trio_nsq.broker.backend import BackendError, BackendQueue
from trio_nsq.broker.message import Message
from trio_nsq.broker.message_queue import MessageQueue
from trio_nsq.broker.pqueue import MISSING, NOT_OWNED, OWNED, MessagePQueue
from trio_nsq.broker.quantile import Quantile
from trio_nsq.shared.names import is_ephemeral

if TYPE_CHECKING:
    from trio_nsq.broker.topic import Topic

log = logging.getLogger("nsqd")

# how long a message no queue would take waits before the next try
RETRY_DELAY = 1.0


def _messages(records: list[bytes], positions: list[int]) -> list[Message]:
    """Records decoded (the topic pump's take_records checked their size), with their topic positions."""
    msgs = [Message.decode(data) for data in records]
    for msg, pos in zip(msgs, positions):
        msg.pos = pos
    return msgs


class ChannelError(Exception):
    """A FIN/REQ/TOUCH that does not apply (nsqd's "ID not in flight" and friends)."""


def _not_applied(stopped: int) -> ChannelError:
    """Why a FIN, REQ or TOUCH does not apply (MessagePQueue.pop_owned's MISSING or NOT_OWNED), as nsqd says it."""
    return ChannelError("ID not in flight" if stopped == MISSING else "client does not own message")


class Consumer(Protocol):
    id: int

    def wake(self) -> None: ...

    def ready_room(self) -> int:
        """How many more messages the consumer may have in flight now (RDY − in flight)."""

    def timed_out_message(self) -> None: ...

    def empty(self) -> None: ...

    async def close(self) -> None: ...


class Channel:
    """A channel (nsqd's Channel): its MessageQueue, in-flight and deferred priority queues, and its
    consumers. `run` (in the Topic's nursery) owns the backend's io_loop. The topic's message_pump calls
    `put_messages`; each consumer's ProtocolV2.message_pump calls `take` and `start_in_flight`; its
    io_loop calls finish/requeue/touch_message (FIN, REQ, TOUCH); the queue_scan workers call
    process_in_flight_queue and process_deferred_queue. None of them awaits, so each is atomic."""

    def __init__(self, topic: Topic, name: str, backend: BackendQueue, mem_queue_size: int) -> None:
        self.topic = topic
        self.topic_name = topic.name
        self.name = name
        self.ephemeral = is_ephemeral(name)
        self.mem_queue_size = mem_queue_size
        self.queue = MessageQueue(f"CHANNEL({name})", backend, self.ephemeral)
        self.in_flight = MessagePQueue()
        self.deferred = MessagePQueue()
        self.clients: dict[int, Consumer] = {}
        self.paused = False
        self.exiting = False

        self.message_count = 0
        self.requeue_count = 0
        self.timeout_count = 0
        self.dropped_count = 0  # ephemeral overflow, as nsqd's dummy backend discards it

        # e2e processing latency (FIN time - publish time), when percentiles are configured
        self.e2e: Quantile | None = None
        # consumers whose pump waits for messages; woken on put
        self.waiters: set[Consumer] = set()
        self._closed = trio.Event()
        self._scope: trio.CancelScope | None = None

    def __repr__(self) -> str:
        return f"Channel({self.topic_name}:{self.name})"

    # --- task ---------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Owns the backend's io_loop; cancelled when the channel is deleted or the topic exits."""
        with trio.CancelScope() as self._scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.queue.backend.run)
                task_status.started()
        self._closed.set()

    def cancel(self) -> None:
        if self._scope is not None:
            self._scope.cancel()

    # --- putting ------------------------------------------------------------------------------

    def depth(self) -> int:
        return self.queue.depth()

    def room(self) -> int:
        """How many messages put() can take now (the topic pump waits when 0): unbounded with a real
        backend or for an ephemeral channel, else what is left of the memory queue."""
        if self.ephemeral or self.queue.backend.stores:
            return 1 << 30
        return max(0, self.mem_queue_size - len(self.queue.memory))

    def _memory_room(self) -> int:
        """How many messages the memory queue takes now. nsqd's memory queue is a Go channel of
        --mem-queue-size: a send to it also succeeds when a consumer's pump is waiting to receive. nsqd
        tries that hand-off only where there is no backend (an ephemeral channel), and with
        --mem-queue-size=0 it is the only way in: here the subscribed consumers take up to their RDY
        room. All of them, not only those whose pump waits at this instant: a pump woken by the last
        batch may not have run yet, and the next batch would be dropped (a test saw 21 of 50)."""
        in_memory = len(self.queue.memory)
        room = self.mem_queue_size - in_memory
        if self.ephemeral and self.clients:
            room = max(room, sum(client.ready_room() for client in self.clients.values()) - in_memory)
        return room

    def put(self, msg: Message) -> None:
        """Into the memory queue, or the backend when it is full; raises BackendError if neither takes it."""
        if self.queue.put([msg], max(0, self._memory_room())) and self.ephemeral:
            self.dropped_count += 1  # no room and no backend: as nsqd's dummy backend, discarded
            return
        if self.waiters:
            self._wake_waiters()

    def put_messages(self, msgs: list[Message]) -> None:
        """New messages from the topic pump (counted): deferred ones wait for their DPUB delay, the rest
        go to the memory queue and what overflows to the backend in one write.

        It never fails: the topic has accepted the messages already, so a backend error keeps them here
        (deferred, retried) instead of losing them. Messages the topic read from its disk queue carry their
        topic position: those this channel took before a crash (its queue persisted how far) are skipped,
        so a restart hands nothing over twice."""
        if msgs and msgs[-1].pos >= 0:
            msgs = self._from_topic_disk(msgs)
        self.message_count += len(msgs)
        ready = [msg for msg in msgs if msg.deferred <= 0]
        if len(ready) < len(msgs):
            for msg in msgs:
                if msg.deferred > 0:
                    self._defer(msg, msg.deferred)
        room = max(0, self._memory_room())
        try:
            past_memory = self.queue.put(ready, room)
        except BackendError as exc:
            for msg in ready[room + exc.stored:]:
                self._requeue(msg)
        else:
            if self.ephemeral:
                self.dropped_count += past_memory
        if self.waiters:
            self._wake_waiters()

    def takes_records(self) -> bool:
        """Whether put_records may have the topic's next batch: every message would go to this channel's
        disk queue as it was read from the topic's (no memory room, a queue that keeps the topic position)."""
        return self.queue.backend.cursor and self._memory_room() <= 0

    def put_records(self, records: list[bytes], positions: list[int]) -> None:
        """put_messages for records the topic pump read from its disk queue (`positions`, in order), none
        deferred, when takes_records(): written to the disk queue as they are, with no Message each."""
        backend = self.queue.backend
        if positions[0] <= backend.upstream or backend.recovered_ids:
            # the first batches after a restart: some may have been taken before it (_from_topic_disk)
            self.put_messages(_messages(records, positions))
            return
        backend.upstream = positions[-1]
        self.message_count += len(records)
        try:
            backend.put_many(records)
        except BackendError as exc:
            for msg in _messages(records[exc.stored:], []):
                self._requeue(msg)
        if self.waiters:
            self._wake_waiters()

    def _from_topic_disk(self, msgs: list[Message]) -> list[Message]:
        """Drop what this channel already took before a crash; note how far it has taken (persisted with
        this channel's records, in the same sync round); the positions were the topic's, not ours."""
        backend = self.queue.backend
        taken = backend.upstream
        last = msgs[-1].pos  # taken now, even if all of them are skipped
        if backend.cursor:
            if 0 <= msgs[0].pos <= taken or msgs[-1].pos <= taken:
                fresh = [msg for msg in msgs if msg.pos < 0 or msg.pos > taken]
                log.info("CHANNEL(%s): skipping %d messages taken from the topic before a restart",
                         self.name, len(msgs) - len(fresh))
                msgs = fresh
            ids = backend.recovered_ids
            if ids:
                # records written after the last sync round (their `upstream` not persisted): the topic's
                # first messages after a restart may be those; they come first and in order
                fresh = []
                for msg in msgs:
                    if msg.pos >= 0 and ids:
                        if msg.id in ids:
                            ids.discard(msg.id)
                            continue
                        ids.clear()
                    fresh.append(msg)
                if len(fresh) < len(msgs):
                    log.info("CHANNEL(%s): skipping %d messages it had stored past its last sync",
                             self.name, len(msgs) - len(fresh))
                msgs = fresh
            if last > taken:
                backend.upstream = last
        for msg in msgs:
            msg.pos = -1
        return msgs

    def _requeue(self, msg: Message) -> None:
        """Put a message in the queue; if neither memory nor backend takes it, keep it deferred and
        retry in a second rather than lose it. One stored in this channel's queue is written again (with
        its attempts) and its old record finished, in one sync round, so one of the two always survives."""
        pos = msg.pos
        if pos >= 0:
            try:
                self.queue.backend.rewrite(msg.encode(), pos)
            except BackendError as exc:
                log.error("CHANNEL(%s): failed to put msg(%s) - %s", self.name, msg.id.decode(), exc)
                self.deferred.push(msg, trio.current_time() + RETRY_DELAY)
                return
            msg.pos = -1
            if self.waiters:
                self._wake_waiters()
            return
        try:
            self.put(msg)
        except BackendError as exc:
            log.error("CHANNEL(%s): failed to put msg(%s) - %s", self.name, msg.id.decode(), exc)
            self.deferred.push(msg, trio.current_time() + RETRY_DELAY)

    def _defer(self, msg: Message, timeout: float) -> None:
        """Deferred for `timeout` seconds (DPUB, REQ with a delay). With a cursor queue the message is
        written with its deadline (and the record it came from finished), so a restart defers it again."""
        backend = self.queue.backend
        if backend.cursor:
            try:
                msg.pos = backend.hold(msg.encode(), timeout, msg.pos)
            except BackendError as exc:
                # its old record (if any) stays: a restart delivers it at once, early rather than never
                log.error("CHANNEL(%s): failed to store deferred msg(%s) - %s", self.name, msg.id.decode(), exc)
        self.start_deferred_timeout(msg, timeout)

    def _wake_waiters(self) -> None:
        waiters = self.waiters
        self.waiters = set()
        for client in waiters:
            client.wake()

    # --- taking (consumer message pumps) -------------------------------------------------------

    def take(self, n: int) -> list[Message]:
        """Up to n messages: from the memory queue, and from the backend so neither starves."""
        out: list[Message] = []
        queue = self.queue
        queue.take_backend(out, (n + 1) // 2)
        queue.take_memory(out, n)
        queue.take_backend(out, n)
        if queue.backend.has_deadlines():
            out = self._restore_deferred(out, n)
        if out and self.topic.waiting_for_room:
            self.topic.wake()
        return out

    def _restore_deferred(self, out: list[Message], n: int) -> list[Message]:
        """Records read back with a deadline still ahead (deferred before a restart) wait in the deferred
        queue, keeping their records; the rest of `out` is filled from the queue."""
        while True:
            ready = [msg for msg in out if msg.deferred <= 0]
            if len(ready) == len(out):
                return out
            for msg in out:
                if msg.deferred > 0:
                    self.start_deferred_timeout(msg, msg.deferred)
                    msg.deferred = 0.0
            out = ready
            if len(out) >= n or not self.queue.backend.depth():
                return out
            self.queue.take_backend(out, n)

    # --- in flight ----------------------------------------------------------------------------

    def start_in_flight(self, msg: Message, client_id: int, now: float, timeout: float) -> None:
        msg.client_id = client_id
        msg.delivery_ts = now
        self.in_flight.push(msg, now + timeout, lane=timeout)

    def start_in_flight_many(self, msgs: list[Message], client_id: int, now: float, timeout: float) -> None:
        """start_in_flight() of a message pump's batch: one deadline for all of them."""
        for msg in msgs:
            msg.client_id = client_id
            msg.delivery_ts = now
        self.in_flight.push_many(msgs, now + timeout, timeout)

    def _pop_in_flight(self, client_id: int, msg_id: bytes) -> Message:
        msgs, stopped = self.in_flight.pop_owned([msg_id], client_id)
        if not msgs:
            raise _not_applied(stopped)
        return msgs[0]

    def finish_message(self, client_id: int, msg_id: bytes) -> None:
        finished, error = self.finish_messages(client_id, [msg_id])
        if error is not None:
            raise error

    def finish_messages(self, client_id: int, msg_ids: list[bytes]) -> tuple[int, ChannelError | None]:
        """FIN of each id in turn, up to the first that does not apply: how many were finished, and that
        one's error. The backend hears of the run in one call (its records are finished in the same
        order as one call each would, and nothing else runs in between)."""
        msgs, stopped = self.in_flight.pop_owned(msg_ids, client_id)
        error = None if stopped == OWNED else _not_applied(stopped)
        if self.e2e is not None:
            for msg in msgs:
                self.e2e.insert(msg.timestamp)
        positions = [msg.pos for msg in msgs if msg.pos >= 0]  # those read from the backend
        if positions:
            self.queue.backend.finish_many(positions)
        return len(msgs), error

    def requeue_message(self, client_id: int, msg_id: bytes, timeout: float) -> None:
        msg = self._pop_in_flight(client_id, msg_id)
        self.requeue_count += 1
        if timeout <= 0:
            self._requeue(msg)
        else:
            self._defer(msg, timeout)

    def drop_sampled(self, msg: Message) -> None:
        """A consumer's --sample-rate left this message out: as nsqd, it is done with."""
        if msg.pos >= 0:
            self.queue.backend.finish(msg.pos)

    def touch_message(self, client_id: int, msg_id: bytes, timeout: float, max_msg_timeout: float) -> None:
        msg = self.in_flight.get(msg_id)
        if msg is None or msg.client_id != client_id:
            raise _not_applied(MISSING if msg is None else NOT_OWNED)
        deadline = trio.current_time() + timeout
        # a message may not be held longer than max-msg-timeout since its delivery
        deadline = min(deadline, msg.delivery_ts + max_msg_timeout)
        self.in_flight.push(msg, deadline)

    def start_deferred_timeout(self, msg: Message, timeout: float) -> None:
        self.deferred.push(msg, trio.current_time() + timeout, lane=timeout)

    # --- queue scan ---------------------------------------------------------------------------

    def process_in_flight_queue(self, now: float) -> bool:
        if self.exiting:
            return False
        expired = self.in_flight.pop_expired(now)
        for msg in expired:
            self.timeout_count += 1
            client = self.clients.get(msg.client_id)
            if client is not None:
                client.timed_out_message()
            self._requeue(msg)
        return bool(expired)

    def process_deferred_queue(self, now: float) -> bool:
        if self.exiting:
            return False
        due = self.deferred.pop_expired(now)
        for msg in due:
            self._requeue(msg)
        return bool(due)

    # --- clients ------------------------------------------------------------------------------

    def add_client(self, client: Consumer, max_channel_consumers: int) -> None:
        if self.exiting:
            raise ChannelError("exiting")
        if client.id in self.clients:
            return
        if max_channel_consumers and len(self.clients) >= max_channel_consumers:
            raise ChannelError(
                f"consumers for {self.topic_name}:{self.name} exceeds limit of {max_channel_consumers}"
            )
        self.clients[client.id] = client

    def remove_client(self, client: Consumer) -> None:
        if self.clients.pop(client.id, None) is None:
            return
        self.waiters.discard(client)
        if not self.clients and self.ephemeral and not self.exiting:
            self.topic.delete_channel(self.name)

    # --- admin --------------------------------------------------------------------------------

    def exit(self) -> None:
        """The broker is exiting, or the channel or its topic is being deleted: see Topic.exit."""
        self.exiting = True

    def pause(self) -> None:
        """The caller persists the metadata (nsqd's /channel/pause does)."""
        self.paused = True

    def unpause(self) -> None:
        self.paused = False
        for client in self.clients.values():
            client.wake()

    async def empty(self) -> None:
        """Drop everything queued and in flight (nsqd's /channel/empty)."""
        self.in_flight.drain()
        self.deferred.drain()
        for client in self.clients.values():
            client.empty()
        await self.queue.empty()

    def drain_for_shutdown(self) -> list[Message]:
        """Everything the channel holds outside its backend, for writing to disk at exit. With a cursor
        queue, in-flight and deferred messages already stored stay where they are (a deferred one keeps
        its deadline), and deferred ones not stored yet are written with theirs."""
        out = self.queue.drain_memory()
        backend = self.queue.backend
        if not backend.cursor:
            out.extend(self.in_flight.drain())
            out.extend(self.deferred.drain())
            return out
        out.extend(msg for msg in self.in_flight.drain() if msg.pos < 0)
        now = trio.current_time()
        for msg in self.deferred.drain():
            if msg.pos < 0:
                try:
                    msg.pos = backend.hold(msg.encode(), max(msg.pri - now, 0.001))
                except BackendError:
                    out.append(msg)  # logged by the queue; written plain below if it can be
        return out
