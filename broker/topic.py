"""Topic: where publishers put messages (nsqd/topic.go). Its messages are stored once, in its log.

A publish goes to the topic's memory queue while it has room (--mem-queue-size), and to its log (a
TopicLog: go-diskqueue's files) otherwise, in one write; a deferred publish always goes to the log, with
its deadline. The topic's message_pump hands what is in memory to every channel's memory queue, or, when
a durable channel has no room, writes it to the log once. Each channel reads the log through a cursor of
its own, so a message is written once whatever the number of channels.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from itertools import repeat
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import trio

from trio_nsq.broker.storage.backend import BackendError
from trio_nsq.broker.channel import Channel
from trio_nsq.broker.guid import GUIDFactory
from trio_nsq.broker.idempotency import IdempotencyKeys
from trio_nsq.broker.storage.channel_backend import OWN, ChannelBackend
from trio_nsq.broker.storage.log_reader import LogReader
from trio_nsq.broker.message import Message, encode_record
from trio_nsq.broker.quantile import Quantile
from trio_nsq.broker.queue_settings import QueueSettings, resolve
from trio_nsq.broker.storage.records import looks_like_message
from trio_nsq.broker.storage.data_dir import ChannelNames, topic_of
from trio_nsq.broker.storage.segment_log import Place, SegmentLog, list_dir
from trio_nsq.broker.storage.sync_group import SyncGroup
from trio_nsq.broker.storage.topic_log import TopicLog
from trio_nsq.shared.names import is_ephemeral, is_valid_channel_name
from trio_nsq.shared.protocol import MIN_VALID_MSG_LENGTH

if TYPE_CHECKING:
    from trio_nsq.broker.options import Options


class TopicOwner(Protocol):
    """What a Topic needs from the broker that holds it (NSQD): its options and data path, the wall clock
    deadlines kept across a restart are read from, its health, a task spawned in the broker's nursery, and
    to be told about channel changes and deletes, and a cursor's idle state to persist."""

    options: Options
    data_path: str
    clock: Callable[[], float]

    def set_health(self, error: str | None) -> None: ...

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None: ...

    def notify_channel(self, channel: Channel, created: bool) -> None: ...

    def persist_metadata(self, topic: str, channel: str = "") -> None:
        """A cursor's state changed (Channel.set_pins): nsqd.dat's line for it is written again."""

    def delete_topic(self, name: str) -> None: ...

    def get_topic(self, name: str) -> Topic: ...


class TopicFull(BackendError):
    """A publish would take the topic, or one of its channels, past its maximum depth, and the policy
    there is to refuse (E_PUB_FAILED over TCP, 503 TOPIC_FULL over HTTP)."""


class ReplicationError(BackendError):
    """Cluster mode: a publish the topic's replication refuses (`reason`: NOT_LEADER, NOT_ENOUGH_REPLICAS
    before the append, definite; NOT_ENOUGH_REPLICAS_AFTER_APPEND or NOT_LEADER_AFTER_APPEND once appended,
    when its replicas did not confirm it in time or the lead was lost: indeterminate). TCP answers E_PUB_FAILED with the message, HTTP
    503 {"message": reason}."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason} ({detail})" if detail else reason)
        self.reason = reason


class Syncable(Protocol):
    """What a publish's answer awaits (Published.sync): a SyncGroup's fsync, or its replicas' confirmation."""

    async def sync(self) -> None: ...


class ReplicaGate(Protocol):
    """A replicated topic's replication (replication/manager.py's TopicReplica), as the Topic uses it."""

    def admit(self) -> None:
        """Raises ReplicationError when this broker may not append now (not the leader, isr too small)."""

    def committed_after(self, end: int) -> Syncable:
        """What a publish whose records end at log position `end` awaits before its OK."""

    def dispatch_limit(self) -> int:
        """How far the log may be handed to the channels (the high watermark)."""

    def refuses_consumers(self) -> str | None:
        """Why a SUB here is refused (this broker does not lead the topic), or None."""

    def stats(self) -> dict[str, Any]:
        """/stats' "replication" key of the topic."""


log = logging.getLogger("nsqd")

# How many messages the pump moves per scheduling round: large enough to amortise the await,
# small enough that consumers' pumps get to run between rounds.
PUMP_BATCH = 512
# the channel a dead-letter topic gets, so what it receives waits for a re-drive (POST /channel/redrive)
DEAD_LETTERS_CHANNEL = "dead-letters"


@attrs.frozen
class Published:
    """What Topic.publish did: how many messages, and whether the answer must wait for an fsync."""

    count: int
    sync: Syncable | None  # --sync-every=1 and something went to disk (or replicated): await sync.sync() before OK
    all_durable: bool  # every message went to the log: after the fsync, all of them are durable
    in_log: bool = False  # every message went to the log (the answer may not wait for an fsync)


class Topic:
    """A topic (nsqd's Topic): its memory queue, its log, its channels and its message_pump. `run`,
    started by NSQD, owns a nursery with the sync group's io_loop and the message_pump. Publishers
    (ProtocolV2's PUB/MPUB/DPUB, the HTTP /pub and /mpub) call `publish` from their own tasks; it never
    awaits, so what is queued is consistent when the pump runs. Channel changes come from SUB and the
    HTTP API through get_channel/delete_channel."""

    def __init__(self, nsqd: TopicOwner, name: str, names: list[str] | None = None) -> None:
        """`names`: what the data directory held for this topic when the broker listed it at start
        (DataDir); None: it is listed here."""
        self.nsqd = nsqd
        self.name = name
        self.ephemeral = is_ephemeral(name)
        if names is None:
            names = [] if self.ephemeral else [n for n in list_dir(nsqd.data_path) if topic_of(n) == name]
        self._names = names
        self._channel_names = ChannelNames(names)
        opts = nsqd.options
        self.clock = nsqd.clock
        # publish timestamps (unix ns): the wall clock's, or the owner's clock where it has its own (a
        # test's MockClock), so that a message TTL is measured on one clock
        self.now_ns: Callable[[], int] = time.time_ns if self.clock is time.time else self._clock_ns
        self.mem_queue_size = opts.mem_queue_size
        self.sync_every = opts.sync_every
        self.max_bytes_per_file = opts.max_bytes_per_file
        self.channels: dict[str, Channel] = {}
        self.paused = False
        self.exiting = False
        self.guid = GUIDFactory(opts.node_id)
        self.memory: deque[Message] = deque()
        # one group commit for every file of the topic: its log, its channels' cursors and own queues
        self.group = SyncGroup(name, nsqd.data_path, sync_every=opts.sync_every, sync_timeout=opts.sync_timeout,
                               on_health=nsqd.set_health)
        self.log: TopicLog | None = None
        if not self.ephemeral:
            self.log = TopicLog(name, nsqd.data_path, self.group, max_bytes_per_file=opts.max_bytes_per_file,
                                min_msg_size=MIN_VALID_MSG_LENGTH, max_msg_size=opts.max_msg_size + MIN_VALID_MSG_LENGTH,
                                retention_time=opts.retention_time, retention_bytes=opts.retention_bytes,
                                clock=self.clock, names=names)
        # with retention, or once read by position, every message goes to the log (what is replayed or
        # read by position must be there): no memory queue
        self.retains = self.log is not None and bool(opts.retention_time or opts.retention_bytes or self.log.positional)
        # Idempotency-Keys accepted on /pub and /mpub; an ephemeral topic's stay in memory, as its messages
        self.idempotency = IdempotencyKeys(
            name, None if self.ephemeral else nsqd.data_path,
            window=opts.idempotency_window, max_keys=opts.max_idempotency_keys,
            log_holds=None if self.log is None else self.log.segments.holds_end,
        )
        # cluster mode (replication/manager.py attaches it): appends are gated, the channels get the log
        # up to the high watermark only
        self.replica: ReplicaGate | None = None
        # set by NSQD for a topic created at run time: asks the lookupds for the topic's channels
        self.channels_from_lookupd: Callable[[str], Awaitable[list[str]]] | None = None

        self.message_count = 0
        self.message_bytes = 0
        # not in nsqd: what POST /topic/config set here (apply_settings), and what the topic obeys
        self.settings = QueueSettings()
        self.max_depth = 0  # for a topic without channels; its channels have their own
        self.refuse_when_full = True
        self.limited = False  # the topic or a channel has a maximum depth: publish checks it
        self.refused_count = 0
        self.dropped_count = 0

        self._receiving = False  # the pump waits for messages and has room for them
        self._wake = trio.Event()
        self._scope: trio.CancelScope | None = None
        self.apply_settings()

    def __repr__(self) -> str:
        return f"Topic({self.name})"

    def _clock_ns(self) -> int:
        return int(self.clock() * 1e9)

    # --- task ---------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Owns the message_pump and the sync group's io_loop."""
        with trio.CancelScope() as self._scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.group.run)
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
        """Hand what is in the memory queue to every channel, in batches, while the topic has channels
        and is not paused (nsqd keeps messages in the topic until a channel exists); the log is handed
        over at the same moments (its channels read it themselves)."""
        while True:
            if not self.paused and self.channels:
                self.dispatch()
                if self.memory:
                    self._hand(PUMP_BATCH)
                    await trio.lowlevel.checkpoint()
                    continue
            self._wake = trio.Event()
            self._receiving = not self.paused and bool(self.channels)  # would take a message at once
            try:
                await self._wake.wait()
            finally:
                self._receiving = False

    def _hand(self, n: int) -> None:
        """Up to n messages from memory to every channel: in memory while every durable channel has room,
        the rest to the log, once, for every channel to read there."""
        memory = self.memory
        msgs = [memory.popleft() for _ in range(min(n, len(memory)))]
        channels = list(self.channels.values())
        room = len(msgs)
        if self.log is not None:
            for channel in channels:
                if not channel.ephemeral:
                    room = min(room, max(0, channel.memory_room()))
        head, rest = msgs[:room], msgs[room:]
        if rest:
            assert self.log is not None
            stored = 0
            try:
                self.log.append([msg.encode() for msg in rest])
                stored = len(rest)
            except BackendError as exc:
                stored = exc.stored
                log.error("TOPIC(%s): failed to write %d messages to its log, handing them over in memory - %s",
                          self.name, len(rest) - stored, exc)
            self._appended(stored)
            head.extend(rest[stored:])
        if head:
            # copies first: each channel's messages are its own (attempts, deadlines)
            copies = [[msg.copy() for msg in head] for _ in channels[1:]]
            channels[0].put_messages(head)
            for channel, copy in zip(channels[1:], copies):
                channel.put_messages(copy)

    def dispatch(self) -> None:
        """What the log holds that no channel was handed yet goes to the channels there are (a replicated
        topic's: up to its high watermark)."""
        log_ = self.log
        if log_ is not None and self.replica is not None:
            before = log_.dispatched.index
            log_.dispatch(upto=self.replica.dispatch_limit())
            n = log_.dispatched.index - before
            if n > 0:
                for channel in self.channels.values():
                    channel.message_count += n
                    channel.logs_grew()
            return
        if log_ is not None and log_.undispatched():
            n = log_.undispatched()
            log_.dispatch()
            for channel in self.channels.values():
                channel.message_count += n
                channel.logs_grew()

    def _appended(self, n: int) -> None:
        """n records were appended to the log: handed over at once unless the topic waits (paused, or no
        channel yet)."""
        if n and not self.paused and self.channels:
            self.dispatch()

    def dispatched_position(self) -> int:
        return self.log.dispatched.position if self.log is not None else 0

    def dispatched_index(self) -> int:
        return self.log.dispatched.index if self.log is not None else 0

    # --- publishing ---------------------------------------------------------------------------

    def depth(self) -> int:
        return len(self.memory) + self.backend_depth()

    def backend_depth(self) -> int:
        return self.log.undispatched() if self.log is not None else 0

    def publish(self, bodies: Sequence[bytes], deferred: float = 0.0) -> Published:
        """The one publish path of PUB, MPUB, DPUB, /pub and /mpub: new ids, queued in order (memory
        first, the rest in one log write; a deferred publish to the log with its deadline), counted.
        Raises BackendError when the log refuses (the callers answer E_PUB_FAILED, 503 ...). What the
        answer still waits for is in the result: with --sync-every=1, the fsync of the topic's sync group
        (the caller awaits it, or a TCP connection once for all the publishes of one read)."""
        if self.exiting:
            raise BackendError("exiting")
        replica = self.replica
        if replica is not None:
            replica.admit()  # (refused before anything is appended: definite)
        if self.limited:
            self._admit(len(bodies))
        # ids made in one batch, and one timestamp for the batch (a clock read per message cost more)
        ids = self.guid.new_ids(len(bodies))
        now = self.now_ns()
        room = self._memory_room()
        in_log = False
        if self.log is None:
            written = 0
            msgs = list(map(Message, ids, bodies, repeat(now)))
            if deferred:
                for msg in msgs:
                    msg.deferred = deferred
            self.memory.extend(msgs[:max(0, room)])  # an ephemeral topic's overflow is discarded
            self._counted(bodies)
        elif deferred or room <= 0:
            written = self._write(ids, bodies, now, deferred)
            in_log = True
        elif not self.memory and self._receiving and not self.paused and self._a_channel_is_full():
            # what _hand would do at once (every message to the log, for the channels to read there),
            # without making the Messages: producers outrunning their consumers spend most of their time
            # here. Still a memory publish as far as --sync-every=1 goes: the answer waits for no fsync.
            self._write(ids, bodies, now, 0.0)
            written = 0
            in_log = True
        else:
            memory = self.memory
            if room >= len(bodies):
                memory.extend(map(Message, ids, bodies, repeat(now)))
                written = 0
                self._counted(bodies)
            else:
                memory.extend(map(Message, ids[:room], bodies[:room], repeat(now)))
                self._counted(bodies[:room])
                written = self._write(ids[room:], bodies[room:], now, 0.0)
        if self.memory:
            if self._receiving and not self.paused and self.channels:
                # the pump waits with nothing before these: hand them over here, as it would, without
                # its wake-up (a task switch per PUB when producers send one message at a time)
                self.dispatch()
                self._hand(PUMP_BATCH)
            if self.memory:
                self._wake.set()
        if self.max_depth and not self.refuse_when_full and not self.channels:
            self._drop_over_depth()
        if replica is not None and self.log is not None:
            # every message is in the log (keep_whole_log): answered once its replicas have it
            return Published(len(bodies), replica.committed_after(self.log.segments.tail), True, True)
        sync: Syncable | None = self.group if written and self.sync_every == 1 else None
        return Published(len(bodies), sync, sync is not None and written == len(bodies), in_log)

    def keep_whole_log(self) -> None:
        """A positional reader came (the HTTP log API): from now on every message is written to the log,
        as with --mem-queue-size=0, and what waits in the memory queue for a channel goes there now, so
        that the log holds every message published after this call. Persisted in the log's metadata."""
        log_ = self.log
        if log_ is None or log_.positional:
            return
        log_.mark_positional()
        self.retains = True
        if self.memory:
            msgs = list(self.memory)
            self.memory.clear()
            stored = 0
            try:
                log_.append([msg.encode() for msg in msgs])
                stored = len(msgs)
            except BackendError as exc:
                stored = exc.stored
                log.error("TOPIC(%s): failed to move %d messages from memory to its log, they stay in memory - %s",
                          self.name, len(msgs) - stored, exc)
                self.memory.extend(msgs[stored:])
            self._appended(stored)
        log.info("TOPIC(%s): read by position: every message goes to its log", self.name)

    def _admit(self, n: int) -> None:
        """Raises TopicFull when n more messages would pass a maximum depth whose policy is to refuse:
        a channel's (what waits in the topic counts), or the topic's own while it has no channel."""
        depth = self.depth()
        if self.channels:
            for channel in self.channels.values():
                if channel.full_for(n, depth):
                    raise TopicFull(f"channel {channel.name} is at its maximum depth {channel.max_depth}")
        elif self.max_depth and self.refuse_when_full and depth + n > self.max_depth:
            self.refused_count += 1
            raise TopicFull(f"topic {self.name} is at its maximum depth {self.max_depth}")

    def _drop_over_depth(self) -> None:
        """drop-oldest for a topic without channels: its memory queue's oldest go (counted); what it wrote
        to its log waits there for a channel."""
        memory = self.memory
        while len(memory) > self.max_depth:
            memory.popleft()
            self.dropped_count += 1

    def apply_settings(self) -> None:
        """Its settings or the flags' changed: what the topic and each channel obey, resolved again."""
        opts = self.nsqd.options
        resolved = resolve(opts, self.settings, topic=self.name)
        self.mem_queue_size = resolved.mem_queue_size
        self.max_depth = resolved.max_depth
        self.refuse_when_full = resolved.refuse_when_full
        for channel in list(self.channels.values()):
            self._apply(channel)
        self._limits_changed()

    def _apply(self, channel: Channel) -> None:
        """What the channel obeys, resolved; its dead-letter topic made now if it has one, so that it is on
        disk before the first message goes there. A dead-letter topic's own channel neither limits
        attempts nor expires what it keeps."""
        channel.apply(resolve(self.nsqd.options, channel.settings, self.settings, topic=self.name, channel=channel.name))
        if channel.name == DEAD_LETTERS_CHANNEL:
            channel.max_attempts = 0
            channel.ttl_ns = 0
        elif channel.max_attempts or (channel.expired_to_dead_letter and channel.dead_letter_topic):
            self.nsqd.get_topic(channel.dead_letter_topic).dead_letters_channel()

    def _limits_changed(self) -> None:
        self.limited = bool(self.max_depth) or any(channel.max_depth for channel in self.channels.values())

    def dead_letter(self, topic_name: str, bodies: list[bytes]) -> tuple[int, SyncGroup]:
        """A channel's messages past their attempts (or expired) to the dead-letter topic: how many it
        stored, and the sync group whose round makes them durable (the channel finishes them after it)."""
        dead = self.nsqd.get_topic(topic_name)
        return dead.publish_dead_letters(bodies), dead.group

    def dead_letters_channel(self) -> Channel:
        """The channel a dead-letter topic keeps its messages in for a re-drive, made with the settings
        that name the topic (so it is on disk before a message is moved) or at the first dead letter; a
        round is asked for at once while its cursor is not on disk yet."""
        channel = self.get_channel(DEAD_LETTERS_CHANNEL)
        if channel.backend.reader is not None and not channel.backend.on_disk():
            self.group.request_round()
        return channel

    def publish_dead_letters(self, bodies: list[bytes]) -> int:
        """Dead letters from another topic's channel: into the log at once, whatever the memory queue's
        room (a kill -9 keeps them, and the channel finishes them only after); new ids, attempts 0. How
        many were stored (a failure is logged). None until the DEAD_LETTERS_CHANNEL's cursor is on disk:
        a kill -9 before would restart it at the log's end, past them (a round is asked for)."""
        if self.log is None or self.exiting:
            log.error("TOPIC(%s): cannot take %d dead letters (%s)", self.name, len(bodies),
                      "exiting" if self.exiting else "ephemeral")
            return 0
        if self.replica is not None:
            try:
                self.replica.admit()  # (cluster mode: only the topic's leader appends)
            except ReplicationError as refused:
                log.error("TOPIC(%s): cannot take %d dead letters here - %s", self.name, len(bodies), refused)
                return 0
        # asks for the round that puts it on disk if need be
        if not self.dead_letters_channel().backend.on_disk():
            return 0
        try:
            return self._write(self.guid.new_ids(len(bodies)), bodies, self.now_ns(), 0.0)
        except BackendError as exc:
            log.error("TOPIC(%s): failed to store %d dead letters - %s", self.name, len(bodies) - exc.stored, exc)
            return exc.stored

    def _write(self, ids: list[bytes], bodies: Sequence[bytes], now: int, deferred: float) -> int:
        """Into the log, in one write, with no Message made only to be encoded."""
        assert self.log is not None
        records = list(map(encode_record, repeat(now), repeat(0), ids, bodies))
        try:
            self.log.append(records, self.clock() + deferred if deferred > 0 else 0.0)
        except BackendError as exc:
            self._counted(bodies[:exc.stored])
            self._appended(exc.stored)
            raise
        self._counted(bodies)
        self._appended(len(records))
        return len(records)

    def _a_channel_is_full(self) -> bool:
        """A durable channel has no memory room: _hand sends everything to the log."""
        for channel in self.channels.values():
            if not channel.ephemeral and channel.memory_room() <= 0:
                return True
        return False

    def _memory_room(self) -> int:
        """How many messages the memory queue takes now. nsqd's memory queue is a Go channel of
        --mem-queue-size: a send to it also succeeds when the pump is waiting to receive. nsqd tries
        that hand-off only for what has no backend (an ephemeral topic's messages); with
        --mem-queue-size=0 it is the only way into its memory. With retention there is no memory queue."""
        if self.retains:
            return 0
        in_memory = len(self.memory)
        room = self.mem_queue_size - in_memory
        if self._receiving and self.log is None:
            room = max(room, PUMP_BATCH - in_memory)
        return room

    def _counted(self, bodies: Sequence[bytes]) -> None:
        if bodies:
            self.message_count += len(bodies)
            self.message_bytes += sum(map(len, bodies))

    # --- channels -----------------------------------------------------------------------------

    def get_channel(self, name: str) -> Channel:
        channel = self.channels.get(name)
        if channel is None:
            ephemeral = is_ephemeral(name)
            reader = None
            if self.log is not None:
                path_name = f"{self.name}:{name}"
                reader = self.log.reader_for(path_name, durable=not ephemeral,
                                             names=self._channel_names.of(path_name))
            backend = ChannelBackend(f"{self.name}:{name}", reader, partial(self._open_own, name),
                                     ephemeral=ephemeral, now=trio.current_time, wall=self.clock)
            channel = Channel(self, name, self.mem_queue_size, backend, self.clock)
            opts = self.nsqd.options
            self._apply(channel)
            if opts.e2e_processing_latency_percentiles:
                channel.e2e = Quantile(opts.e2e_processing_latency_window_time, opts.e2e_processing_latency_percentiles)
            self.channels[name] = channel
            self._limits_changed()
            log.info("TOPIC(%s): new channel(%s)", self.name, name)
            self.nsqd.notify_channel(channel, created=True)
            self._wake.set()
        return channel

    def _open_own(self, channel_name: str, create: bool) -> LogReader | None:
        """A durable channel's own queue, `<topic>:<channel>.diskqueue.*` (what Go nsqd calls the
        channel's disk queue): opened when its files are there, or made when `create`."""
        name = f"{self.name}:{channel_name}"
        data_path = self.nsqd.data_path
        names = self._channel_names.of(name)
        if not create and not any(entry.startswith(name + ".diskqueue.") for entry in names):
            return None
        opts = self.nsqd.options
        segments = SegmentLog(name, data_path, max_bytes_per_file=opts.max_bytes_per_file,
                              min_msg_size=MIN_VALID_MSG_LENGTH, max_msg_size=opts.max_msg_size + MIN_VALID_MSG_LENGTH,
                              on_write=self.group.wrote, valid_record=looks_like_message, names=names)
        start = Place(segments.start, segments.start_index())
        if segments.meta_found:
            start = Place(segments.position(*segments.meta_read), segments.meta_read_index)
        return LogReader(segments, name + ".diskqueue", self.group, start=start, tag=OWN, owns_log=True,
                         clock=self.clock, names=names)

    def get_existing_channel(self, name: str) -> Channel | None:
        return self.channels.get(name)

    def delete_channel(self, name: str) -> None:
        channel = self.channels.pop(name)  # KeyError(name) for a channel there is not
        channel.exit()
        self._limits_changed()
        log.info("TOPIC(%s): deleting channel %s", self.name, name)
        for client in list(channel.clients.values()):
            self.nsqd.spawn(client.close)
        channel.delete_files()  # the files are gone before the caller answers, as in nsqd
        self._channel_names.forget(f"{self.name}:{name}")
        if self.log is not None and channel.backend.reader is not None:
            self.log.forget(channel.backend.reader)
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

    def empty(self) -> None:
        """Drop what no channel was handed yet (nsqd's topic empty)."""
        self.memory.clear()
        if self.log is not None:
            self.log.empty()

    async def close(self) -> None:
        """A clean exit (nsqd's topic Close): what is in memory goes to disk (the topic's to its log,
        each channel's to its own queue), the last sync round persists it all, the files are closed."""
        self.exit()
        flushed = True  # every message held in memory is on disk now
        if self.log is not None and self.memory:
            msgs = list(self.memory)
            self.memory.clear()
            try:
                self.log.append([msg.encode() for msg in msgs])
                log.info("TOPIC(%s): flushed %d messages to its log", self.name, len(msgs))
            except BackendError as exc:
                log.error("TOPIC(%s): failed to flush %d of %d messages - %s",
                          self.name, len(msgs) - exc.stored, len(msgs), exc)
                flushed = False
            if not self.paused and self.channels:
                if self.replica is not None:
                    self.dispatch()  # (up to the high watermark)
                else:
                    self.log.dispatch()
        for channel in self.channels.values():
            if not channel.ephemeral:  # a durable channel of an ephemeral topic has its own queue too
                flushed = channel.flush_for_shutdown() and flushed
        flushed = await self.group.close() and flushed
        for channel in self.channels.values():
            channel.close()
        if self.log is not None:
            self.log.close()
        # after the messages: a key is never kept for messages lost
        self.idempotency.close(flushed=flushed)

    def delete(self) -> None:
        """Every file of the topic, now (NSQD's delete_topic, after its channels)."""
        if self.log is not None:
            self.log.delete()
        self.group.closed = True
        self.group.fail_waiting()  # what waits for a round of this topic gets none
        self.idempotency.delete()

