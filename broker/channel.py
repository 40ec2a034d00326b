"""Channel: one set of consumers of a topic's stream (nsqd/channel.go), a cursor over the topic's log.

A channel holds a bounded memory queue (messages its topic's pump handed over in memory, and requeued
ones), its reader of the topic's log (a LogReader: where it is, what it finished, what it holds), maybe
its own queue (another LogReader, over the go-diskqueue files `<topic>:<channel>.diskqueue.*`), the
in-flight table of messages sent to consumers and not yet FIN'd, the deferred queue (REQ with a delay, an
ephemeral topic's DPUB) and the index of deferred records read from its logs (a DeferredIndex: a DPUB's
record, or one held with a deadline, stays in its log until due, and is read back then). Its consumers'
message pumps take messages in batches with take(); queue-scan workers move timed-out and due messages
back with process_in_flight_queue()/process_deferred_queue().

A message read from a log keeps its position (`Message.pos`; the own queue's carry OWN): FIN finishes it
there, REQ and a timeout hold it there with its attempts (and deadline), so a restart finds it again as
it was. A message from memory has none (-1): it lives in memory only, as in nsqd.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import trio

from trio_nsq.broker.storage.backend import BackendError
from trio_nsq.broker.storage.cursor import FINISHED_LIMIT
from trio_nsq.broker.latency import LatencyHistogram
from trio_nsq.broker.storage.deferred_index import DeferredIndex
from trio_nsq.broker.storage.log_reader import LogReader
from trio_nsq.broker.message import Message
from trio_nsq.broker.pqueue import MISSING, NOT_OWNED, OWNED, MessagePQueue
from trio_nsq.broker.quantile import Quantile
from trio_nsq.broker.queue_settings import QueueSettings, Resolved
from trio_nsq.broker.storage.segment_log import POS_SHIFT
from trio_nsq.shared.names import is_ephemeral

if TYPE_CHECKING:
    from trio_nsq.broker.topic import Topic

log = logging.getLogger("nsqd")

# how long a message no queue would take waits before the next try
RETRY_DELAY = 1.0
# the tag of positions in a channel's own queue (a topic log position is below it)
OWN = 1 << 62
# messages a take() may find expired before it lets the event loop run (the rest in its next turn)
EXPIRED_PER_TURN = 65_536
# reclaim copies records that pin the topic's log only when that frees this many times what it writes
RECLAIM_RATIO = 4
# deferred records reclaim reads back at a time
RECLAIM_CHUNK = 4096
_OFFSET_MASK = (1 << POS_SHIFT) - 1


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
    """A channel (nsqd's Channel). Made by its Topic, which gives it its reader of the topic's log (none
    for an ephemeral topic) and opens its own queue on demand (`open_own`). The topic's message_pump
    calls `put_messages`; each consumer's ProtocolV2.message_pump calls `take` and
    `start_in_flight_many`; its io_loop calls finish/requeue/touch_message (FIN, REQ, TOUCH); the
    queue_scan workers call process_in_flight_queue and process_deferred_queue. None of them awaits, so
    each is atomic."""

    def __init__(self, topic: Topic, name: str, mem_queue_size: int, reader: LogReader | None,
                 open_own: Callable[[bool], LogReader | None], clock: Callable[[], float]) -> None:
        self.topic = topic
        self.topic_name = topic.name
        self.name = name
        self.ephemeral = is_ephemeral(name)
        self.mem_queue_size = mem_queue_size
        self.memory: deque[Message] = deque()
        self.reader = reader  # its place in the topic's log
        self._open_own = open_own
        self.own: LogReader | None = open_own(False) if not self.ephemeral else None
        self.clock = clock  # unix seconds: a deadline kept across a restart is one of these
        self.in_flight = MessagePQueue()
        self.deferred = MessagePQueue()
        # deferred records read from its logs, by deadline: read back when due
        self.deferred_records = DeferredIndex(trio.current_time)
        self.clients: dict[int, Consumer] = {}
        self.paused = False
        self.exiting = False

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
        self._reclaim_after = 0  # reclaim looks again past this many waiting finished positions
        self._read_file = -1  # the segment the topic's reader was in when reclaim last looked

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
        return len(self.memory) + self.deferred_records.ready_count() + self.backend_depth()

    def backend_depth(self) -> int:
        """Messages waiting in the logs (the topic's and its own), not read yet: deferred publishes among
        them are counted deferred (deferred_count), as nsqd counts them once handed to the channel."""
        depth = 0
        if self.reader is not None:
            depth += self.reader.depth(self.topic.dispatched_index())
            depth -= self.reader.deferred_ahead(self.topic.dispatched_position())
        if self.own is not None:
            depth += self.own.depth(self.own.segments.tail_index)
        return depth

    def deferred_count(self) -> int:
        """Deferred messages: in the deferred queue, deferred records read, and deferred publishes in the log
        not read yet."""
        ahead = self.reader.deferred_ahead(self.topic.dispatched_position()) if self.reader is not None else 0
        return len(self.deferred) + len(self.deferred_records) + ahead

    def oldest_unfinished_timestamp(self) -> int | None:
        """The publish time (unix ns) of the oldest message the channel has not finished, if any: the
        record at a log cursor's mark-delete position, or one held in memory only (of those in flight or
        deferred, the ones due first: a look, not a scan of what may be hundreds of thousands)."""
        found: list[int] = []
        for reader, end in ((self.reader, self.topic.dispatched_position()), (self.own, -1)):
            if reader is not None:
                mark = reader.mark_delete()
                if mark < (reader.segments.tail if end < 0 else end):
                    timestamp = reader.timestamp_at(mark)
                    if timestamp is not None:
                        found.append(timestamp)
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
        """Into the channel's own queue (no memory room, and no log of the topic's has them)."""
        own = self._own()
        stored = 0
        if own is not None:
            try:
                own.append([msg.encode() for msg in msgs], [])
                stored = len(msgs)
            except BackendError as exc:
                stored = exc.stored
                log.error("CHANNEL(%s): failed to put %d messages - %s", self.name, len(msgs) - stored, exc)
        for msg in msgs[stored:]:
            self.deferred.push(msg, trio.current_time() + RETRY_DELAY)

    def _drop_own_if_drained(self) -> None:
        """A channel's own queue that holds nothing more goes, files and all (it is made again when
        needed): a channel does not keep a queue of its own for what was in its memory at one restart."""
        own = self.own
        if own is not None and own.drained():
            own.delete()
            self.own = None

    def _own(self) -> LogReader | None:
        if self.own is None and not self.ephemeral:
            self.own = self._open_own(True)
        return self.own

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
        reader = self.reader
        if over > 0 and reader is not None:
            end_index = self.topic.dispatched_index()
            before = reader.dropped
            reader.skip_to_lag(end_index, self.topic.dispatched_position(), max(0, reader.depth(end_index) - over))
            dropped += reader.dropped - before
        self.dropped_count += dropped

    def _keep_up(self) -> None:
        """An ephemeral channel too far behind drops the oldest, as its memory queue would have no room
        for them in nsqd: checked when its consumers take (their RDY room counts) and by the queue scan
        (so one that never takes does not keep the log)."""
        reader = self.reader
        assert reader is not None
        before = reader.dropped
        reader.skip_to_lag(self.topic.dispatched_index(), self.topic.dispatched_position(),
                           max(0, self.memory_room()))
        self.dropped_count += reader.dropped - before

    def _requeue(self, msg: Message) -> None:
        """Back in the queue (REQ without a delay, a timeout, a deferral that is due). One read from a log
        is held there with its attempts, so a restart delivers it as it is now."""
        pos = msg.pos
        if pos >= 0:
            self._reader_of(pos).hold(pos, msg.attempts, 0.0)
        self.memory.append(msg)
        if self.waiters:
            self._wake_waiters()

    def _defer(self, msg: Message, timeout: float) -> None:
        """Deferred for `timeout` seconds (REQ with a delay). One read from a log is held there with its
        deadline, so a restart defers it again."""
        pos = msg.pos
        if pos >= 0:
            self._reader_of(pos).hold(pos, msg.attempts, self.clock() + timeout)
        self.start_deferred_timeout(msg, timeout)

    def _reader_of(self, pos: int) -> LogReader:
        reader = self.own if pos & OWN else self.reader
        assert reader is not None, pos
        return reader

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
        records = self.deferred_records
        if records.ready_count() and len(out) < limit:
            self._read_due(out, records.take_ready(limit - len(out)))
        reader = self.reader
        if reader is not None:
            if self.ephemeral:
                self._keep_up()
            elif reader.reader.file_num != self._read_file:
                # the reader moved to another segment: is an old record keeping two or more behind it?
                self._read_file = reader.reader.file_num
                if (reader.mark_delete() >> POS_SHIFT) < self._read_file - 1:
                    self._reclaim(self._read_file << POS_SHIFT)
        for reader, upto in ((self.own, -1), (self.reader, self.topic.dispatched_position())):
            while reader is not None and len(out) < limit:
                msgs = reader.read(limit - len(out), reader.segments.tail if upto < 0 else upto, records)
                out.extend(msgs)
                if reader.more:
                    # a long run of deferred records: the rest in the loop's next turn (a pump that got
                    # nothing waits on the channel: woken then)
                    if not out:
                        trio.lowlevel.current_trio_token().run_sync_soon(self._wake_waiters)
                    return True
                if not msgs:
                    break
        return False

    def _read_due(self, out: list[Message], positions: list[int]) -> None:
        """Deferred records that are due, read back from their logs (own queue positions carry OWN)."""
        if any(pos & OWN for pos in positions):
            out.extend(self._reader_of(OWN).read_back([pos for pos in positions if pos & OWN]))
            positions = [pos for pos in positions if not pos & OWN]
        if positions:
            out.extend(self._reader_of(0).read_back(positions))

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
        reader = self.reader
        own = self.own
        if own is not None and any(pos & OWN for pos in positions):
            own.finish_many([pos for pos in positions if pos & OWN])
            positions = [pos for pos in positions if not pos & OWN]
            self._drop_own_if_drained()
        if positions and reader is not None:
            reader.finish_many(positions)
            cursor = reader.cursor
            if cursor.waiting_at_most() > max(FINISHED_LIMIT, self._reclaim_after) and \
                    cursor.finished_waiting() > max(FINISHED_LIMIT, self._reclaim_after):
                # back off: look again once twice as many wait (set here, not by the look a segment
                # change makes: one that fails on the batch being read must not put this one off)
                self._reclaim_after = 2 * cursor.finished_waiting()
                self._reclaim(cursor.middle())

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
        finished here, so a crash between the two leaves it in both (at least once), never in neither.
        What the dead-letter topic could not store stays here, deferred for a retry."""
        stored = self.topic.dead_letter(self.dead_letter_topic, [msg.body for msg in msgs])
        for msg in msgs[stored:]:  # the dead-letter topic is not ready (or failed): again in a moment
            self._defer(msg, RETRY_DELAY)
        if stored:
            self.dead_lettered_count += stored
            positions = [msg.pos for msg in msgs[:stored] if msg.pos >= 0]
            if positions:
                self._finish(positions)
            log.info("CHANNEL(%s:%s): %d %s messages to dead-letter topic %s",
                     self.topic_name, self.name, stored, why, self.dead_letter_topic)

    def redrive_from(self, dead: Channel, limit: int) -> int:
        """Up to `limit` messages queued in `dead` (a dead-letter topic's channel) back into this channel,
        attempts reset: into its own queue (an ephemeral channel's memory), then finished there, so a
        crash between the two repeats them (at least once) and loses none. How many moved."""
        msgs = dead.take(limit)
        if not msgs:
            return 0
        copies = [Message(msg.id, msg.body, msg.timestamp, 0) for msg in msgs]
        stored = len(copies)
        own = self._own()
        if own is not None:
            try:
                own.append([msg.encode() for msg in copies], [])
            except BackendError as exc:
                stored = exc.stored
                log.error("CHANNEL(%s): failed to redrive %d messages - %s", self.name, len(msgs) - stored, exc)
        else:
            self.memory.extend(copies)
        positions = [msg.pos for msg in msgs[:stored] if msg.pos >= 0]
        if positions:
            dead._finish(positions)
        for msg in msgs[stored:]:
            dead._requeue(msg)
        if self.waiters:
            self._wake_waiters()
        return stored

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

    def _reclaim(self, cutoff: int) -> None:
        """A few records deferred or requeued long ago keep the topic's log from being dropped behind them
        (a message deferred for an hour, a poison message requeued again and again), and keep thousands
        of finished positions waiting behind them: move those before `cutoff` to the channel's own queue
        (held there with their attempts and deadline, read back from there), so the topic's log is free.
        Only when that frees RECLAIM_RATIO times what it writes: a consumer's in-flight window is not
        copied around, and in-flight messages are not moved (their timeout ends the wait)."""
        reader = self.reader
        assert reader is not None
        cursor = reader.cursor
        if self.ephemeral or self.exiting:
            return
        pinning = set(cursor.unfinished_before(cutoff))
        if not pinning:
            return
        mark = cursor.mark_delete()
        freed = ((cutoff >> POS_SHIFT) - (mark >> POS_SHIFT)) * self.topic.max_bytes_per_file
        freed += (cutoff & _OFFSET_MASK) - (mark & _OFFSET_MASK)
        moved = [msg for msg in self.deferred.messages() if msg.pos in pinning]
        moved.extend(msg for msg in self.memory if msg.pos in pinning)
        size = sum(34 + len(msg.body) for msg in moved)
        now_wall = self.clock()
        now = trio.current_time()
        # deferred records read from the log (due or not): a position and a deadline each, read back here
        index = self.deferred_records
        records = [(pos, now_wall + max(0.001, deadline - now) if deadline else 0.0)
                   for pos, deadline in index.entries_in(pinning)] if len(index) or index.ready_count() else []
        if len(moved) + len(records) < len(pinning) or (size + 34 * len(records)) * RECLAIM_RATIO > freed:
            return  # some are in flight, or it would not pay
        for at in range(0, len(records), RECLAIM_CHUNK):
            size += sum(34 + len(msg.body) for msg in reader.read_back([pos for pos, _ in records[at:at + RECLAIM_CHUNK]]))
            if size * RECLAIM_RATIO > freed:
                return
        own = self._own()
        if own is None:
            return
        deadlines = [now_wall + max(0.001, msg.pri - now) if msg.id in self.deferred else 0.0 for msg in moved]
        stored = self._move_to_own(own, moved, deadlines)
        all_stored = stored == len(moved)
        moved = moved[:stored]
        ids = {msg.id for msg in moved}
        if any(msg.id in ids for msg in self.memory):
            self.memory = deque(msg for msg in self.memory if msg.id not in ids)
        for msg in moved:
            self.deferred.pop(msg.id)
        done = [msg.pos for msg in moved]
        gone: set[int] = set()
        if all_stored and records:
            for at in range(0, len(records), RECLAIM_CHUNK):
                chunk = dict(records[at:at + RECLAIM_CHUNK])
                msgs = reader.read_back(list(chunk))
                stored = self._move_to_own(own, msgs, [chunk[msg.pos] for msg in msgs])
                gone.update(msg.pos for msg in msgs[:stored])
                if stored < len(msgs):
                    break
            index.remove(gone)
            done.extend(gone)
        if done:
            log.info("CHANNEL(%s): moved %d deferred or requeued messages to its own queue to free the topic's log",
                     self.name, len(done))
            reader.finish_many(done)
        self._reclaim_after = 0

    def _move_to_own(self, own: LogReader, msgs: list[Message], deadlines: list[float]) -> int:
        """Copy messages to the channel's own queue, each held there with its attempts and deadline (unix
        seconds, 0: none): how many were (the first ones; the rest stay where they are)."""
        positions: list[int] = []
        try:
            own.append([msg.encode() for msg in msgs], positions)
        except BackendError:
            pass  # logged; tried again later
        for msg, deadline, new in zip(msgs, deadlines, positions):
            own.hold(new | OWN, msg.attempts, deadline)
        return len(positions)

    # --- queue scan ---------------------------------------------------------------------------

    def process_in_flight_queue(self, now: float) -> bool:
        if self.exiting:
            return False
        if self.ephemeral and self.reader is not None:
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
        records = self.deferred_records
        moved = records.due(now) if len(records) else 0
        if moved and self.waiters:
            self._wake_waiters()
        return bool(due) or moved > 0

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

    def _drop_held(self) -> None:
        self.memory.clear()
        self.in_flight.drain()
        self.deferred.drain()
        self.deferred_records.clear()
        for client in self.clients.values():
            client.empty()

    def empty(self) -> None:
        """Drop everything queued, in flight and deferred (nsqd's /channel/empty): the cursors move to the
        end of what the topic has handed over."""
        self._drop_held()
        if self.reader is not None:
            self.reader.reset(self.topic.dispatched_position(), self.topic.dispatched_index())
        if self.own is not None:
            self.own.reset(self.own.segments.tail, self.own.segments.tail_index)
            self._drop_own_if_drained()

    def seek(self, pos: int, index: int) -> None:
        """Deliver the topic's log again from `pos` (a /channel/seek): what the channel held in memory, in
        flight or deferred is dropped (what of it is in the log after `pos` comes again from there), its
        own queue is emptied, and the cursor restarts at `pos` with nothing finished after it."""
        assert self.reader is not None
        self._drop_held()
        self.reader.reset(pos, index)
        if self.own is not None:
            self.own.reset(self.own.segments.tail, self.own.segments.tail_index)
            self._drop_own_if_drained()
        if self.waiters:
            self._wake_waiters()

    def flush_for_shutdown(self) -> None:
        """At a clean exit: what the channel holds in memory only (handed over in memory, in flight or
        deferred, requeued) goes to its own queue, a deferred one held there with its deadline. What was
        read from a log stays there (its cursor has it, with its attempts and deadline)."""
        now_wall = self.clock()
        now = trio.current_time()
        plain = [msg for msg in self.memory if msg.pos < 0]
        plain.extend(msg for msg in self.in_flight.drain() if msg.pos < 0)
        deferred = [msg for msg in self.deferred.drain() if msg.pos < 0]
        self.memory.clear()
        if not (plain or deferred):
            return
        own = self._own()
        if own is None:
            log.error("CHANNEL(%s): %d messages held in memory lost at exit", self.name, len(plain) + len(deferred))
            return
        msgs = plain + deferred
        positions: list[int] = []
        try:
            own.append([msg.encode() for msg in msgs], positions)
        except BackendError as exc:
            log.error("CHANNEL(%s): failed to flush %d of %d messages - %s",
                      self.name, len(msgs) - exc.stored, len(msgs), exc)
        # a deferred one is held with its deadline: the restart's reader defers it again
        for msg, pos in zip(msgs[len(plain):], positions[len(plain):]):
            own.hold(pos | OWN, msg.attempts, now_wall + max(0.001, msg.pri - now))
        if positions:
            log.info("CHANNEL(%s): flushed %d messages to its own queue", self.name, len(positions))

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        if self.own is not None:
            self.own.close()

    def delete_files(self) -> None:
        """The channel's cursor file and own queue go now (nsqd removes them before it answers)."""
        if self.reader is not None:
            self.reader.delete()
        if self.own is not None:
            self.own.delete()
