"""Channel: one set of consumers of a topic's stream (nsqd/channel.go), a cursor over the topic's log.

A channel holds a bounded memory queue (messages its topic's pump handed over in memory, and requeued
ones), the in-flight table of messages sent to consumers and not yet FIN'd, the deferred queue (REQ with a
delay, an ephemeral topic's DPUB), and its backend (broker/storage/channel_backend.py): its reader of the
topic's log (where it is, what it finished, what it holds), maybe its own queue, and the index of deferred
records read from them (a DPUB's record, or one held with a deadline, stays in its log until due, and is
read back then). Its consumers' message pumps take messages in batches with take(); queue-scan workers
move timed-out and due messages back with process_in_flight_queue()/process_deferred_queue().

A message read from a log keeps its position (`Message.pos`; the own queue's carry OWN): FIN finishes it
there, REQ and a timeout hold it there with its attempts (and deadline), so a restart finds it again as
it was. A message from memory has none (-1): it lives in memory only, as in nsqd.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Protocol

import trio

from trio_nsq.broker.latency import LatencyHistogram
from trio_nsq.broker.message import Message
from trio_nsq.broker.pqueue import MISSING, NOT_OWNED, OWNED, MessagePQueue
from trio_nsq.broker.quantile import Quantile
from trio_nsq.broker.queue_settings import QueueSettings, Resolved
from trio_nsq.broker.storage.channel_backend import OWN, ChannelBackend
from trio_nsq.broker.storage.log_reader import Batch
from trio_nsq.broker.storage.sync_group import SyncGroup
from trio_nsq.shared.names import is_ephemeral
from trio_nsq.shared.options import format_duration

if TYPE_CHECKING:
    from trio_nsq.broker.topic import Topic

log = logging.getLogger("nsqd")

# how long a message no queue would take waits before the next try
RETRY_DELAY = 1.0
# messages a take() may find expired before it lets the event loop run (the rest in its next turn)
EXPIRED_PER_TURN = 65_536

__all__ = ["OWN", "Channel", "ChannelError", "Consumer"]


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
    """A channel (nsqd's Channel). Made by its Topic, which gives it its backend (its reader of the
    topic's log, none for an ephemeral topic, and how to open its own queue). The topic's message_pump
    calls `put_messages`; each consumer's ProtocolV2.message_pump calls `take` and
    `start_in_flight_many`; its io_loop calls finish/requeue/touch_message (FIN, REQ, TOUCH); the
    queue_scan workers call process_in_flight_queue and process_deferred_queue. None of them awaits, so
    each is atomic."""

    def __init__(self, topic: Topic, name: str, mem_queue_size: int, backend: ChannelBackend,
                 clock: Callable[[], float]) -> None:
        self.topic = topic
        self.topic_name = topic.name
        self.name = name
        self.ephemeral = is_ephemeral(name)
        self.mem_queue_size = mem_queue_size
        self.memory: deque[Message] = deque()
        self.backend = backend  # what it keeps in logs: the topic's (a cursor), its own queue
        self.clock = clock  # unix seconds: a deadline kept across a restart is one of these
        self.in_flight = MessagePQueue()
        self.deferred = MessagePQueue()
        # moves to the dead-letter topic waiting for its round before they are finished here
        self.dead_letters_pending = 0
        self._resets = 0  # empties and seeks so far: a finish decided before one does not apply after it
        self.clients: dict[int, Consumer] = {}
        self.paused = False
        self.exiting = False
        # not in nsqd: made by POST /log/commit, a positional reader's durable cursor, never a consumer's
        # (no SUB; a commit seeks it, which would drop a consumer's messages). In nsqd.dat as "cursor".
        self.cursor = False
        self.pins = True  # its position keeps the topic's log (not once idle past --cursor-idle-timeout)
        self.last_commit = 0.0  # (trio's clock) its last commit, or when it was made, adopted or loaded
        self.last_commit_ms: int | None = None  # (unix ms, for /stats) None: not committed since the start

        self.message_count = 0
        self.requeue_count = 0
        self.timeout_count = 0
        self.dropped_count = 0  # ephemeral overflow, as nsqd's dummy backend discards it; drop-oldest
        # not in nsqd: what POST /channel/config set here, and what the channel obeys (Topic.apply_settings)
        self.settings = QueueSettings()
        self.max_depth = 0  # 0: no limit
        self.refuse_when_full = True
        self.ttl_ns = 0  # 0: messages do not expire
        self.expired_to_dead_letter = False
        self.max_attempts = 0  # 0: no limit
        self.dead_letter_topic = ""
        self.dead_lettered_count = 0
        self.expired_count = 0
        self.refused_count = 0  # publishes refused because this channel was at its maximum depth

        # e2e processing latency (FIN time - publish time), when percentiles are configured
        self.e2e: Quantile | None = None
        # delivery-to-FIN latency (FIN time - delivery time), always kept: a fixed-size histogram
        self.fin_latency = LatencyHistogram()
        # consumers whose pump waits for messages; woken on put
        self.waiters: set[Consumer] = set()

    def __repr__(self) -> str:
        return f"Channel({self.topic_name}:{self.name})"

    def apply(self, resolved: Resolved) -> None:
        """The settings to obey now (the topic resolves them from the channel's, its own and the flags)."""
        self.mem_queue_size = resolved.mem_queue_size
        self.max_depth = resolved.max_depth
        self.refuse_when_full = resolved.refuse_when_full
        self.ttl_ns = int(resolved.message_ttl * 1e9)
        self.expired_to_dead_letter = resolved.expired_to_dead_letter
        self.dead_letter_topic = resolved.dead_letter_topic
        # no dead-letter topic (a default name would be too long): attempts are not limited
        self.max_attempts = resolved.max_attempts if resolved.dead_letter_topic else 0
        if self.max_depth and not self.refuse_when_full:
            self._drop_over_depth()

    # --- depth --------------------------------------------------------------------------------

    def depth(self) -> int:
        return len(self.memory) + self.backend.deferred_records.ready_count() + self.backend_depth()

    def backend_depth(self) -> int:
        """Messages waiting in the logs (the topic's and its own), not read yet: deferred publishes among
        them are counted deferred (deferred_count), as nsqd counts them once handed to the channel."""
        topic = self.topic
        return self.backend.depth(topic.dispatched_index(), topic.dispatched_position())

    def deferred_count(self) -> int:
        """Deferred messages: in the deferred queue, deferred records read, and deferred publishes in the log
        not read yet."""
        return len(self.deferred) + self.backend.deferred_count(self.topic.dispatched_position())

    def oldest_unfinished_timestamp(self) -> int | None:
        """The publish time (unix ns) of the oldest message the channel has not finished, if any: the
        record at a log cursor's mark-delete position, or one held in memory only (of those in flight or
        deferred, the ones due first: a look, not a scan of what may be hundreds of thousands)."""
        found = self.backend.oldest_timestamps(self.topic.dispatched_position())
        if self.memory:
            found.append(self.memory[0].timestamp)  # handed over in order: the front is the oldest
        for queue in (self.in_flight, self.deferred):
            found.extend(msg.timestamp for msg in queue.fronts() if msg.pos < 0)
        return min(found, default=None)

    def memory_room(self) -> int:
        """How many messages the topic's pump may hand over in memory now. nsqd's memory queue is a Go
        channel of --mem-queue-size: a send also succeeds when a consumer's pump waits to receive. nsqd
        tries that hand-off only where there is no backend (an ephemeral channel), and with
        --mem-queue-size=0 it is the only way in: here the subscribed consumers take up to their RDY
        room. All of them, not only those whose pump waits at this instant: a pump woken by the last
        batch may not have run yet, and the next batch would be dropped (a test saw 21 of 50)."""
        in_memory = len(self.memory)
        room = self.mem_queue_size - in_memory
        if self.ephemeral and self.clients:
            room = max(room, sum(client.ready_room() for client in self.clients.values()) - in_memory)
        return room

    # --- putting ------------------------------------------------------------------------------

    def put_messages(self, msgs: list[Message]) -> None:
        """New messages from the topic's pump, in memory (counted): deferred ones (an ephemeral topic's
        DPUB) wait for their delay, the rest go to the memory queue; what it has no room for goes to the
        channel's own queue, or, for an ephemeral channel, is dropped as nsqd's dummy backend drops it.
        It never fails: the topic has accepted the messages, so a write error keeps them here (deferred,
        retried) instead of losing them."""
        self.message_count += len(msgs)
        ready = [msg for msg in msgs if msg.deferred <= 0]
        if len(ready) < len(msgs):
            for msg in msgs:
                if msg.deferred > 0:
                    self.start_deferred_timeout(msg, msg.deferred)
                    msg.deferred = 0.0
        room = max(0, self.memory_room())
        self.memory.extend(ready[:room])
        rest = ready[room:]
        if rest:
            if self.ephemeral:
                self.dropped_count += len(rest)
            else:
                self._store(rest)
        if self.max_depth and not self.refuse_when_full:
            self._drop_over_depth()
        if self.waiters:
            self._wake_waiters()

    def _store(self, msgs: list[Message]) -> None:
        """Into the channel's own queue (no memory room, and no log of the topic's has them); what cannot
        be stored waits in the deferred queue for another try."""
        stored = self.backend.store([msg.encode() for msg in msgs])
        for msg in msgs[stored:]:
            self.deferred.push(msg, trio.current_time() + RETRY_DELAY)

    def logs_grew(self) -> None:
        """The topic appended to its log (and handed it over): consumers waiting may take it."""
        if self.max_depth and not self.refuse_when_full:
            self._drop_over_depth()
        if self.waiters:
            self._wake_waiters()

    def full_for(self, n: int, topic_depth: int) -> bool:
        """A publish of n messages would take this channel past its maximum depth and its policy is to
        refuse it (counted): what waits in the topic counts, as it is on its way here."""
        if self.max_depth and self.refuse_when_full and self.depth() + topic_depth + n > self.max_depth:
            self.refused_count += 1
            return True
        return False

    def _drop_over_depth(self) -> None:
        """drop-oldest: what is queued past the maximum depth goes, oldest first (the memory queue holds
        what came before what went to the log), finished where it was read from a log, counted dropped.
        Its own queue (requeued and reclaimed messages) is left alone."""
        over = self.depth() - self.max_depth
        if over <= 0:
            return
        memory = self.memory
        positions: list[int] = []
        dropped = 0
        while over > 0 and memory:
            msg = memory.popleft()
            if msg.pos >= 0:
                positions.append(msg.pos)
            dropped += 1
            over -= 1
        if positions:
            self._finish(positions)
        reader = self.backend.reader
        if over > 0 and reader is not None:
            end_index = self.topic.dispatched_index()
            dropped += self.backend.keep_up(end_index, self.topic.dispatched_position(),
                                            max(0, reader.depth(end_index) - over))
        self.dropped_count += dropped

    def _keep_up(self) -> None:
        """An ephemeral channel too far behind drops the oldest, as its memory queue would have no room
        for them in nsqd: checked when its consumers take (their RDY room counts) and by the queue scan
        (so one that never takes does not keep the log)."""
        self.dropped_count += self.backend.keep_up(self.topic.dispatched_index(), self.topic.dispatched_position(),
                                                   max(0, self.memory_room()))

    def _requeue(self, msg: Message) -> None:
        """Back in the queue (REQ without a delay, a timeout, a deferral that is due). One read from a log
        is held there with its attempts, so a restart delivers it as it is now."""
        pos = msg.pos
        if pos >= 0:
            self.backend.hold(pos, msg.attempts, 0.0)
        self.memory.append(msg)
        if self.waiters:
            self._wake_waiters()

    def _defer(self, msg: Message, timeout: float) -> None:
        """Deferred for `timeout` seconds (REQ with a delay). One read from a log is held there with its
        deadline, so a restart defers it again."""
        pos = msg.pos
        if pos >= 0:
            self.backend.hold(pos, msg.attempts, self.clock() + timeout)
        self.start_deferred_timeout(msg, timeout)

    def _wake_waiters(self) -> None:
        waiters = self.waiters
        self.waiters = set()
        for client in waiters:
            client.wake()

    # --- taking (consumer message pumps) -------------------------------------------------------

    def take(self, n: int) -> list[Message]:
        """Up to n messages: from the logs (deferred records now due, its own queue, the topic's) and from
        the memory queue, so neither starves. Records read with a deadline still ahead go to the index of
        deferred records instead."""
        out = self._take(n)
        if self.ttl_ns and out:
            out = self._unexpired(out, n)
        return out

    def _take(self, n: int) -> list[Message]:
        """take() before the TTL: half from the logs, the memory queue, the logs again."""
        out: list[Message] = []
        turn_over = self._read(out, (n + 1) // 2)
        memory = self.memory
        while memory and len(out) < n:
            out.append(memory.popleft())
        if not turn_over:
            self._read(out, n)
        return out

    def _unexpired(self, out: list[Message], n: int) -> list[Message]:
        """A message older than the TTL is not delivered: finished here, or dead-lettered, and counted;
        more are taken in its place, up to EXPIRED_PER_TURN a call (a backlog of a million expired ones is
        gone through a turn of the event loop at a time: a pump that got nothing is woken for the next)."""
        cutoff = int(self.clock() * 1e9) - self.ttl_ns
        fresh: list[Message] = []
        expired_now = 0
        while out:
            expired: list[Message] = []
            for msg in out:
                if msg.timestamp >= cutoff:
                    fresh.append(msg)
                else:
                    expired.append(msg)
            if not expired:
                break
            self.expired_count += len(expired)
            expired_now += len(expired)
            if self.expired_to_dead_letter and self.dead_letter_topic:
                self._dead_letter(expired, "expired")
            else:
                positions = [msg.pos for msg in expired if msg.pos >= 0]
                if positions:
                    self._finish(positions)
            want = n - len(fresh)
            if want <= 0:
                break
            if expired_now >= EXPIRED_PER_TURN:
                if not fresh:
                    trio.lowlevel.current_trio_token().run_sync_soon(self._wake_waiters)
                break
            out = self._take(want)
        return fresh

    def _read(self, out: list[Message], limit: int) -> bool:
        """Up to `limit` messages into `out` from the logs; True when a long run of deferred records
        stopped it (the rest is read in the event loop's next turn)."""
        backend = self.backend
        if backend.reader is not None:
            if self.ephemeral:
                self._keep_up()
            elif backend.reclaim_wanted:
                self._reclaim()
        batch = Batch()
        turn_over = backend.read(batch, limit - len(out), self.topic.dispatched_position())
        if batch:
            self._decode(batch, out)
        if turn_over and not out:
            # a long run of deferred records: the rest in the loop's next turn (a pump that got nothing
            # waits on the channel: woken then)
            trio.lowlevel.current_trio_token().run_sync_soon(self._wake_waiters)
        return turn_over

    def _decode(self, batch: Batch, out: list[Message]) -> None:
        """The batch's records as messages into `out`, with their positions (and the attempts or delay of
        those the batch says); a record that is not a message is logged and finished."""
        decode = Message.decode
        states = batch.states
        bad: list[int] = []
        for i, (data, pos) in enumerate(zip(batch.records, batch.positions)):
            try:
                msg = decode(data)
            except ValueError as exc:
                log.error("CHANNEL(%s): failed to decode message - %s", self.name, exc)
                bad.append(pos)
                continue
            msg.pos = pos
            if states:  # (most batches have none: no lookup per record then)
                state = states.get(i)
                if state is not None:
                    attempts, left = state
                    if attempts >= 0:
                        msg.attempts = attempts
                    if left > 0:
                        msg.deferred = left
            out.append(msg)
        if bad:
            self.backend.finish(bad)

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
        one's error. The logs hear of the run in one call each."""
        msgs, stopped = self.in_flight.pop_owned(msg_ids, client_id)
        error = None if stopped == OWNED else _not_applied(stopped)
        if self.e2e is not None:
            for msg in msgs:
                self.e2e.insert(msg.timestamp)
        if msgs:
            self.fin_latency.record_many(msgs, trio.current_time())
        positions = [msg.pos for msg in msgs if msg.pos >= 0]  # those read from a log
        if positions:
            self._finish(positions)
        return len(msgs), error

    def _finish(self, positions: list[int]) -> None:
        self.backend.finish(positions)

    def requeue_message(self, client_id: int, msg_id: bytes, timeout: float) -> None:
        msg = self._pop_in_flight(client_id, msg_id)
        self.requeue_count += 1
        if self.max_attempts and msg.attempts >= self.max_attempts:
            self._dead_letter([msg], "requeued")
        elif timeout <= 0:
            self._requeue(msg)
        else:
            self._defer(msg, timeout)

    def _dead_letter(self, msgs: list[Message], why: str) -> None:
        """Past its maximum attempts (or expired, when so set): to the dead-letter topic's log first, then
        finished here once that topic's round has fsynced the copy (the two topics have sync groups of
        their own: finishing at once could persist the FIN here before the copy there, and a power loss
        between would lose the message). So a crash, or a power loss, between the two leaves it in both
        (at least once), never in neither. What the dead-letter topic could not store stays here,
        deferred for a retry; so does a copy whose round failed."""
        stored, group = self.topic.dead_letter(self.dead_letter_topic, [msg.body for msg in msgs])
        for msg in msgs[stored:]:  # the dead-letter topic is not ready (or failed): again in a moment
            self._defer(msg, RETRY_DELAY)
        if not stored:
            return
        self.dead_lettered_count += stored
        moved = [msg for msg in msgs[:stored] if msg.pos >= 0]
        if moved:
            self.dead_letters_pending += len(moved)
            group.when_durable(partial(self._dead_lettered, moved, self._resets))
        log.info("CHANNEL(%s:%s): %d %s messages to dead-letter topic %s",
                 self.topic_name, self.name, stored, why, self.dead_letter_topic)

    def _dead_lettered(self, msgs: list[Message], resets: int, durable: bool) -> None:
        """The dead-letter topic's round for these copies ended: finished here if it fsynced them, else
        moved again in a moment (the copies may be there too: at least once). Not if the channel was
        emptied or sought since (its positions may have been read again)."""
        self.dead_letters_pending -= len(msgs)
        if self.exiting or resets != self._resets:
            return  # a restart finds them unfinished here and moves them again
        if durable:
            self._finish([msg.pos for msg in msgs])
            return
        self.dead_lettered_count -= len(msgs)
        for msg in msgs:
            self._defer(msg, RETRY_DELAY)

    def redrive_from(self, dead: Channel, limit: int) -> int:
        """Up to `limit` messages queued in `dead` (a dead-letter topic's channel) back into this channel,
        attempts reset: into its own queue (an ephemeral channel's memory), then finished there once this
        topic's round has fsynced the copies, so a crash or a power loss between the two repeats them (at
        least once) and loses none. How many moved."""
        msgs = dead.take(limit)
        if not msgs:
            return 0
        copies = [Message(msg.id, msg.body, msg.timestamp, 0) for msg in msgs]
        if self.ephemeral:
            self.memory.extend(copies)
            stored = len(copies)
            group: SyncGroup | None = None
        else:
            stored = self.backend.store([msg.encode() for msg in copies])
            group = self.topic.group
        for msg in msgs[stored:]:
            dead._requeue(msg)
        moved = [msg for msg in msgs[:stored] if msg.pos >= 0]
        if moved:
            if group is None:
                dead._finish([msg.pos for msg in moved])
            else:
                group.when_durable(partial(dead._redriven, moved, dead._resets))
        if self.waiters:
            self._wake_waiters()
        return stored

    def _redriven(self, msgs: list[Message], resets: int, durable: bool) -> None:
        """The round for the copies of these messages (re-driven from this dead-letter channel) ended:
        finished here if it fsynced them, else queued here again (not if emptied or sought since)."""
        if self.exiting or resets != self._resets:
            return
        if durable:
            self._finish([msg.pos for msg in msgs])
        else:
            for msg in msgs:
                self._requeue(msg)

    def drop_sampled(self, msg: Message) -> None:
        """A consumer's --sample-rate left this message out: as nsqd, it is done with."""
        if msg.pos >= 0:
            self._finish([msg.pos])

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

    # --- reclaim ------------------------------------------------------------------------------

    def _reclaim(self) -> None:
        """The backend found old records keeping the topic's log two or more segments behind the reader:
        it moves those the channel holds in memory (deferred, or requeued and queued) or in its index of
        deferred records to its own queue (ChannelBackend.reclaim), and the channel drops its copies of
        them, read back from there when due."""
        backend = self.backend
        pinning = backend.pinning()
        if not pinning or self.exiting:
            return
        wanted = set(pinning)
        now_wall = self.clock()
        now = trio.current_time()
        in_memory: dict[int, tuple[bytes, int, float]] = {}
        for msg in self.deferred.messages():
            if msg.pos in wanted:
                in_memory[msg.pos] = (msg.encode(), msg.attempts, now_wall + max(0.001, msg.pri - now))
        for msg in self.memory:
            if msg.pos in wanted:
                in_memory[msg.pos] = (msg.encode(), msg.attempts, 0.0)
        moved = backend.reclaim(pinning, in_memory)
        if not moved:
            return
        if any(msg.pos in moved for msg in self.memory):
            self.memory = deque(msg for msg in self.memory if msg.pos not in moved)
        for msg in [msg for msg in self.deferred.messages() if msg.pos in moved]:
            self.deferred.pop(msg.id)

    # --- queue scan ---------------------------------------------------------------------------

    def process_in_flight_queue(self, now: float) -> bool:
        if self.exiting:
            return False
        if self.cursor:
            self._check_idle(now)
        if self.ephemeral and self.backend.reader is not None:
            self._keep_up()
        expired = self.in_flight.pop_expired(now)
        for msg in expired:
            self.timeout_count += 1
            client = self.clients.get(msg.client_id)
            if client is not None:
                client.timed_out_message()
            if self.max_attempts and msg.attempts >= self.max_attempts:
                self._dead_letter([msg], "timed out")
            else:
                self._requeue(msg)
        return bool(expired)

    def process_deferred_queue(self, now: float) -> bool:
        if self.exiting:
            return False
        due = self.deferred.pop_expired(now)
        for msg in due:
            if self.max_attempts and msg.attempts >= self.max_attempts:
                self._dead_letter([msg], "deferred")  # its move was put off: not delivered again
            else:
                self._requeue(msg)
        # deferred records read from a log (no hold is written when they are due: a restart finds the
        # deadline past and delivers them, as it would now)
        moved = self.backend.due(now)
        if moved and self.waiters:
            self._wake_waiters()
        return bool(due) or moved > 0

    # --- clients ------------------------------------------------------------------------------

    def add_client(self, client: Consumer, max_channel_consumers: int) -> None:
        if self.exiting:
            raise ChannelError("exiting")
        if self.cursor:
            raise ChannelError(f"{self.topic_name}:{self.name} is a cursor of /log/commit, not a consumer's channel")
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
        self.backend.exiting = True

    def pause(self) -> None:
        """The caller persists the metadata (nsqd's /channel/pause does)."""
        self.paused = True

    def unpause(self) -> None:
        self.paused = False
        for client in self.clients.values():
            client.wake()

    def _drop_held(self) -> None:
        self._resets += 1
        self.memory.clear()
        self.in_flight.drain()
        self.deferred.drain()
        for client in self.clients.values():
            client.empty()

    def empty(self) -> None:
        """Drop everything queued, in flight and deferred (nsqd's /channel/empty): the cursors move to the
        end of what the topic has handed over."""
        self._drop_held()
        self.backend.empty(self.topic.dispatched_position(), self.topic.dispatched_index())

    def seek(self, pos: int, index: int) -> None:
        """Deliver the topic's log again from `pos` (a /channel/seek): what the channel held in memory, in
        flight or deferred is dropped (what of it is in the log after `pos` comes again from there), its
        own queue is emptied, and the cursor restarts at `pos` with nothing finished after it."""
        self._drop_held()
        self.backend.seek(pos, index)
        if self.waiters:
            self._wake_waiters()

    # --- a positional reader's cursor (POST /log/commit) ------------------------------------------

    def make_cursor(self) -> None:
        """Made by /log/commit, or adopted (`adopt=true`: an older trio-nsq's cursor has no flag). The
        caller persists the metadata."""
        self.cursor = True
        self.last_commit = trio.current_time()

    def commit(self, pos: int, index: int) -> None:
        """A cursor's commit: everything before `pos` finished (seek), and it keeps the log again from
        there if it was idle (the caller has checked that `pos` is still in the log)."""
        self.seek(pos, index)
        self.last_commit = trio.current_time()
        self.last_commit_ms = int(self.clock() * 1000)
        if not self.pins:
            self.set_pins(True)
            self.topic.nsqd.persist_metadata(self.topic_name, self.name)  # (nsqd.dat's "cursor_idle")
            log.info("CHANNEL(%s:%s): cursor committed at %d: it keeps the topic's log from there again",
                     self.topic_name, self.name, pos)

    def _check_idle(self, now: float) -> None:
        """The queue scan's look at a cursor: not committed for --cursor-idle-timeout, it stops keeping
        the topic's log (an abandoned query's cursor would keep it for ever)."""
        timeout = self.topic.nsqd.options.cursor_idle_timeout
        if self.pins and timeout and now - self.last_commit >= timeout:
            self.set_pins(False)
            self.topic.nsqd.persist_metadata(self.topic_name, self.name)  # idle after a restart too
            reader = self.backend.reader
            log.warning("CHANNEL(%s:%s): cursor not committed for %s (--cursor-idle-timeout): it no longer keeps "
                        "the topic's log (from %d) until its next commit",
                        self.topic_name, self.name, format_duration(timeout),
                        -1 if reader is None else reader.mark_delete())

    def set_pins(self, pins: bool) -> None:
        """Whether the cursor's position keeps the topic's log (the loader sets nsqd.dat's "cursor_idle")."""
        self.pins = pins
        log_ = self.topic.log
        reader = self.backend.reader
        if log_ is not None and reader is not None:
            if pins:
                log_.idle.discard(reader)
            else:
                log_.idle.add(reader)
            log_.group.changed()  # a round drops the segments it no longer keeps

    def flush_for_shutdown(self) -> bool:
        """At a clean exit: what the channel holds in memory only (handed over in memory, in flight or
        deferred, requeued) goes to its own queue, a deferred one held there with its deadline. What was
        read from a log stays there (its cursor has it, with its attempts and deadline). Whether nothing
        was lost."""
        now_wall = self.clock()
        now = trio.current_time()
        plain = [msg for msg in self.memory if msg.pos < 0]
        plain.extend(msg for msg in self.in_flight.drain() if msg.pos < 0)
        deferred = [msg for msg in self.deferred.drain() if msg.pos < 0]
        self.memory.clear()
        if not (plain or deferred):
            return True
        stored = self.backend.store([msg.encode() for msg in plain]) if plain else 0
        # a deferred one is held with its deadline: the restart's reader defers it again
        holds = [(msg.attempts, now_wall + max(0.001, msg.pri - now)) for msg in deferred]
        stored_deferred = self.backend.store([msg.encode() for msg in deferred], holds) if deferred else 0
        lost = len(plain) - stored + len(deferred) - stored_deferred
        if lost:
            log.error("CHANNEL(%s): %d messages held in memory lost at exit", self.name, lost)
        if stored + stored_deferred:
            log.info("CHANNEL(%s): flushed %d messages to its own queue", self.name, stored + stored_deferred)
        return not lost

    def close(self) -> None:
        self.backend.close()

    def delete_files(self) -> None:
        """The channel's cursor file and own queue go now (nsqd removes them before it answers)."""
        self.backend.delete_files()
