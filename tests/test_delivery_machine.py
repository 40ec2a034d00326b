"""The delivery core (Topic, its log, Channels and their cursors) under trio's MockClock, against a model,
with crashes: a hypothesis state machine interleaves PUB/MPUB, DPUB, taking (a consumer's delivery), FIN,
REQ with and without a delay, TOUCH, timeouts and due deferrals (clock jumps), channel empty, seek, the
sync rounds, kill -9 (every in-memory object dropped, the files reopened as they are: the page cache
survives a killed process) and power losses (tests/power_loss.py: every file cut back to what was
fsynced, every name whose directory was not fsynced dropped; or the unsynced end of a file kept in part,
or as zeros), on two channels of one topic. Files are small, so records roll over files.
Channel c1 limits attempts to MAX_ATTEMPTS: a message requeued or timed out past them goes to its
dead-letter topic, and every message moved there is found there after any crash (at least once). The
move is finished on c1 only once the dead-letter topic's round has fsynced the copy (the two topics'
rounds are not ordered otherwise): until then the model keeps it as it was.

The flags are the guarantee's: --mem-queue-size=0 --sync-every=1 (a publish is answered after its
fsync round), and a retention long enough that a seek finds every message. What a crash may undo:
whatever a channel did since the last completed sync round (a FIN, a REQ, a timeout's requeue). So after
a restart every message not finished by a completed round is there exactly once per channel, in a state
it had since that round (its attempts, and its deadline if one is still ahead): a FIN or REQ since then
may be undone, once, never duplicated, and nothing is lost.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import trio.testing
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trio_nsq.broker.channel import Channel
from trio_nsq.broker.message import Message
from trio_nsq.broker.topic import DEAD_LETTERS_CHANNEL, Topic
from tests.power_loss import PowerLoss
from tests.topic_owner import Owner, kill

TIMEOUT = 10.0  # the consumer's msg timeout
MAX_TIMEOUT = 25.0  # --max-msg-timeout (TOUCH is capped by it)
CLIENT = 1
CHANNELS = ("c0", "c1")
LIMITED = "c1"  # the channel with max_attempts
MAX_ATTEMPTS = 1  # every requeue and timeout on c1 moves the message (c0 keeps them)
DEAD_TOPIC = "t-c1-dlq"
# a state a message may be found in after a restart: (attempts in its record, deadline or None)
State = tuple[int, float | None]


def machine_owner(data_path: str, clock: trio.testing.MockClock) -> Owner:
    """The topic's owner: the durable flags, files small enough to roll every few records, everything
    retained (a seek to the start finds every message), and no health error ever."""
    return Owner(data_path, clock, strict=True, mem_queue_size=0, sync_every=1, max_bytes_per_file=160,
                 retention_time=1e9)


class Entry:
    """The model of one published message on one channel."""

    def __init__(self, deadline: float | None) -> None:
        self.dpub = deadline  # its DPUB deadline (a replay after a seek defers it again if still ahead)
        self.cur: State | None = (0, deadline)  # None: finished
        self.since_round: list[State | None] = [self.cur]  # states since the last round
        self.delivered = 0  # attempts of the delivery in flight (0: not in flight)
        self.in_flight_deadline = 0.0
        self.delivery_ts = 0.0
        self.deferred_until: float | None = deadline  # in memory: deferred until then

    def become(self, state: State | None) -> None:
        self.cur = state
        self.since_round.append(state)


def deferred_messages(channel: Channel) -> list[tuple[bytes, int, float]]:
    """(id, attempts, deadline) of what the channel holds deferred: messages in its deferred queue, and the
    records its index of deferred records points at (read back from their log to see them)."""
    out = [(msg.id, msg.attempts, msg.pri) for msg in channel.deferred.messages()]
    for pos, deadline in channel.backend.deferred_records.entries():
        batch = channel.backend._reader_of(pos).read_back([pos])
        [msg] = [Message.decode(data) for data in batch.records]
        attempts = batch.states[0][0] if 0 in batch.states else msg.attempts
        out.append((msg.id, attempts, deadline))
    return out


class DeliveryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="trio-nsq-machine-")
        self.clock = trio.testing.MockClock()
        self.model: dict[str, dict[bytes, Entry]] = {name: {} for name in CHANNELS}
        self.published = 0
        self.crashes = 0
        self.bodies: dict[bytes, bytes] = {}  # message id -> body (bodies are unique)
        self.dead: set[bytes] = set()  # bodies moved to the dead-letter topic
        self.durable_dead: set[bytes] = set()  # ... whose copy a round of the dead-letter topic fsynced
        self.pending: set[bytes] = set()  # ids on c1 moved, not finished until the dead-letter topic's round
        self.disk = PowerLoss(self.dir)
        self.disk.__enter__()
        self._open()

    def _open(self) -> None:
        self.owner = machine_owner(self.dir, self.clock)
        self.topic = Topic(self.owner, "t")  # type: ignore[arg-type]
        self.channels = {name: self.topic.get_channel(name) for name in CHANNELS}
        # c1's setting, as nsqd.dat brings it back; its dead-letter topic made with it and on disk before
        # anything moves (POST /channel/config waits for that round)
        self.channels[LIMITED].settings.update({"max_attempts": MAX_ATTEMPTS})
        self.topic.apply_settings()
        self.dead_topic = self.owner.topics[DEAD_TOPIC]
        self.run(self.dead_topic.group.sync_round)

    def _moved(self, ch: str, msg_id: bytes, attempts: int) -> bool:
        """Whether a requeue or a timeout at these attempts moves the message to the dead-letter topic
        (then it is finished on its channel, and noted)."""
        if ch != LIMITED or attempts < MAX_ATTEMPTS:
            return False
        self.pending.add(msg_id)  # finished once the dead-letter topic's round has the copy
        self.dead.add(self.bodies[msg_id])
        return True

    def run(self, fn: Callable[[], Any]) -> Any:
        async def main() -> Any:
            result = fn()
            if isinstance(result, Awaitable):
                result = await result
            return result
        return trio.run(main, clock=self.clock)

    def now(self) -> float:
        return self.clock.current_time()

    def teardown(self) -> None:
        kill(self.topic)
        kill(self.dead_topic)
        self.disk.__exit__(None, None, None)
        shutil.rmtree(self.dir, ignore_errors=True)

    def persisted(self) -> None:
        """A round completed: what every channel did so far is what a crash finds."""
        for model in self.model.values():
            for entry in model.values():
                entry.since_round = [entry.cur]

    # --- rules --------------------------------------------------------------------------------

    @rule(n=st.integers(1, 4), delay=st.sampled_from([0.0, 0.0, 5.0, 30.0]))
    def publish(self, n: int, delay: float) -> None:
        """PUB (n=1), MPUB, DPUB: answered once the topic's round has fsynced them (the round persists
        the channels' cursors too: one group commit for the topic's files)."""
        async def pub() -> None:
            published = self.topic.publish([b"m%d" % (self.published + i) for i in range(n)], delay)
            assert published.sync is not None
            await published.sync.sync()
        self.run(pub)
        self.published += n
        self.persisted()
        deadline = self.now() + delay if delay else None
        new = self._last_ids(n)
        assert len(new) == n
        self.bodies.update(zip(new, (b"m%d" % (self.published - n + i) for i in range(n))))
        for model in self.model.values():
            assert not (set(new) & set(model))
            for msg_id in new:
                model[msg_id] = Entry(deadline)

    def _last_ids(self, n: int) -> list[bytes]:
        assert self.topic.log is not None
        segments = self.topic.log.segments
        reader = segments.reader(segments.start, segments.start_index())
        positions: list[int] = []
        records = reader.read(1 << 20, segments.tail, positions)
        reader.close()
        return [data[10:26] for data in records[-n:]]

    @rule(ch=st.sampled_from(CHANNELS), n=st.integers(1, 5))
    def take(self, ch: str, n: int) -> None:
        """A consumer's message pump: the messages go in flight with their attempts counted."""
        now = self.now()
        channel = self.channels[ch]

        def deliver() -> list[bytes]:
            msgs = channel.take(n)
            for msg in msgs:
                msg.attempts += 1
                channel.start_in_flight(msg, CLIENT, now, TIMEOUT)
            return [msg.id for msg in msgs]
        for msg_id in self.run(deliver):
            entry = self.model[ch][msg_id]
            assert entry.cur is not None and not entry.delivered, msg_id
            assert entry.deferred_until is None or entry.deferred_until <= now, (msg_id, entry.deferred_until, now)
            entry.deferred_until = None
            entry.delivered = entry.cur[0] + 1
            entry.in_flight_deadline = now + TIMEOUT
            entry.delivery_ts = now

    def in_flight(self, ch: str) -> list[bytes]:
        return sorted(k for k, e in self.model[ch].items() if e.delivered)

    def any_in_flight(self) -> list[tuple[str, bytes]]:
        return [(ch, k) for ch in CHANNELS for k in self.in_flight(ch)]

    @precondition(lambda self: self.any_in_flight())
    @rule(data=st.data())
    def fin(self, data: st.DataObject) -> None:
        ch, msg_id = data.draw(st.sampled_from(self.any_in_flight()))
        self.run(lambda: self.channels[ch].finish_message(CLIENT, msg_id))
        entry = self.model[ch][msg_id]
        entry.delivered = 0
        entry.become(None)

    @precondition(lambda self: self.any_in_flight())
    @rule(data=st.data(), delay=st.sampled_from([0.0, 3.0, 40.0]))
    def req(self, data: st.DataObject, delay: float) -> None:
        ch, msg_id = data.draw(st.sampled_from(self.any_in_flight()))
        self.run(lambda: self.channels[ch].requeue_message(CLIENT, msg_id, delay))
        entry = self.model[ch][msg_id]
        attempts, entry.delivered = entry.delivered, 0
        if self._moved(ch, msg_id, attempts):
            return
        deadline = self.now() + delay if delay else None
        entry.deferred_until = deadline
        entry.become((attempts, deadline))

    @precondition(lambda self: self.any_in_flight())
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        ch, msg_id = data.draw(st.sampled_from(self.any_in_flight()))
        self.run(lambda: self.channels[ch].touch_message(CLIENT, msg_id, TIMEOUT, MAX_TIMEOUT))
        entry = self.model[ch][msg_id]
        entry.in_flight_deadline = min(self.now() + TIMEOUT, entry.delivery_ts + MAX_TIMEOUT)

    @rule(dt=st.sampled_from([1.0, 4.0, 11.0, 35.0]))
    def advance(self, dt: float) -> None:
        """Time passes; the queue scan requeues timed-out messages and moves due deferred ones back."""
        self.clock.jump(dt)
        now = self.now()
        for ch, channel in self.channels.items():
            self.run(lambda: (channel.process_in_flight_queue(now), channel.process_deferred_queue(now)))
            for msg_id, entry in self.model[ch].items():
                if entry.delivered and entry.in_flight_deadline <= now:
                    attempts, entry.delivered = entry.delivered, 0
                    if not self._moved(ch, msg_id, attempts):
                        entry.become((attempts, None))
                elif entry.deferred_until is not None and entry.deferred_until <= now and entry.cur is not None:
                    entry.deferred_until = None
                    entry.become((entry.cur[0], None))

    @rule(ch=st.sampled_from(CHANNELS))
    def empty(self, ch: str) -> None:
        """/channel/empty: everything the channel has goes, persisted before it is answered."""
        channel = self.channels[ch]

        async def empty() -> None:
            channel.empty()
            await self.topic.group.sync_round()
        self.run(empty)
        self.persisted()
        for entry in self.model[ch].values():
            entry.delivered = 0
            entry.deferred_until = None
            entry.cur = None
            entry.since_round = [None]
        if ch == LIMITED:
            self.pending.clear()  # the channel no longer finishes them: everything is finished already

    @rule(ch=st.sampled_from(CHANNELS))
    def seek_to_earliest(self, ch: str) -> None:
        """/channel/seek?to=earliest: every message comes again, from its record (attempts 0; a DPUB's
        deadline if still ahead), and what the channel held is dropped; persisted before the answer."""
        channel = self.channels[ch]
        assert self.topic.log is not None

        async def seek() -> None:
            at = self.topic.log.seek_position("earliest")
            self.topic.log.reload_deadlines(at.position)
            channel.seek(at.position, at.index)
            await self.topic.group.sync_round()
        self.run(seek)
        self.persisted()
        if ch == LIMITED:
            self.pending.clear()  # delivered again from the log: the moves no longer finish them
        now = self.now()
        for entry in self.model[ch].values():
            ahead = entry.dpub if entry.dpub is not None and entry.dpub > now else None
            entry.delivered = 0
            entry.deferred_until = ahead
            entry.cur = (0, ahead)
            entry.since_round = [entry.cur]

    @rule()
    def sync_round(self) -> None:
        """The io loops' rounds (with --sync-every=1 one follows every change): the dead-letter topic's
        (the moves it makes durable are finished on c1 then), then the topic's: fsync and metadata."""
        self.run(self.dead_topic.group.sync_round)
        for msg_id in self.pending:
            self.model[LIMITED][msg_id].become(None)
            self.durable_dead.add(self.bodies[msg_id])
        self.pending.clear()
        self.run(self.topic.group.sync_round)
        self.persisted()

    @rule()
    def crash(self) -> None:
        """kill -9 and a restart on the same files; then everything comes back, and is checked."""
        kill(self.topic)
        kill(self.dead_topic)
        self.restart_and_check(self.dead)

    @rule(mode=st.sampled_from(["strict", "prefix", "zeros"]), seed=st.integers(0, 1 << 16))
    def power_loss(self, mode: str, seed: int) -> None:
        """A power loss: what no completed round fsynced is gone (or, in the other modes, the unsynced end
        of a file is there in part, or as zeros); then everything every completed round persisted comes
        back, and is checked as after a kill -9. A move to the dead-letter topic is there if that
        topic's round made the copy durable; if not, it is still on c1."""
        kill(self.topic)
        kill(self.dead_topic)
        self.disk.crash(mode, seed=seed)
        self.restart_and_check(self.durable_dead)

    def restart_and_check(self, dead_letters: set[bytes]) -> None:
        """Open the files again; what is found must be what the model allows (`dead_letters`: the moves
        the dead-letter topic must hold)."""
        self.crashes += 1
        self.pending.clear()  # a move not finished comes back on c1, and is in the dead-letter topic too
        self._open()
        now = self.now()
        dead = self.dead_topic.get_channel(DEAD_LETTERS_CHANNEL)

        def take_dead_letters() -> list[bytes]:
            """What the dead-letter topic holds, kept in flight (so a later crash finds it again)."""
            bodies = []
            while msgs := dead.take(64):
                for msg in msgs:
                    dead.start_in_flight(msg, CLIENT, now, 1e9)
                bodies.extend(msg.body for msg in msgs)
            return bodies
        found = self.run(take_dead_letters)
        # a move a crash cut short (or a FIN of it undone) may have been made twice: at least once
        assert dead_letters <= set(found), f"dead letters lost: {dead_letters - set(found)}"
        assert set(found) <= self.dead, f"in the dead-letter topic without a move: {set(found) - self.dead}"
        self.dead, self.durable_dead = set(found), set(found)  # the opening round made them durable
        for ch, channel in self.channels.items():
            def recover() -> tuple[list[Any], list[tuple[bytes, int, float]]]:
                taken = []
                while msgs := channel.take(64):
                    taken.extend(msgs)
                return taken, deferred_messages(channel)
            taken, deferred = self.run(recover)
            self._check(ch, channel, taken, deferred, now)

    def _check(self, ch: str, channel: Channel, taken: list[Any], deferred: list[tuple[bytes, int, float]],
               now: float) -> None:
        seen: dict[bytes, State] = {}
        for msg in taken:
            assert msg.id not in seen, f"{ch}: {msg.id!r} delivered twice after a restart"
            seen[msg.id] = (msg.attempts, None)
        for msg_id, attempts, deadline in deferred:
            assert msg_id not in seen, f"{ch}: {msg_id!r} both deferred and delivered after a restart"
            seen[msg_id] = (attempts, deadline)
        assert len(deferred) == len({msg_id for msg_id, _, _ in deferred})
        for msg_id, entry in self.model[ch].items():
            allowed = {self._norm(s, now) for s in entry.since_round}
            got = seen.pop(msg_id, None)
            if got is None:
                assert None in allowed, f"{ch}: {msg_id!r} lost: it may be in {allowed}"
                entry.cur = None
            else:
                state = self._norm(got, now)
                assert any(self._same(state, a) for a in allowed), f"{ch}: {msg_id!r} came back as {state}, not one of {allowed}"
                entry.cur = state
            entry.since_round = [entry.cur]
            entry.delivered = 0
            entry.deferred_until = None if entry.cur is None else entry.cur[1]
        assert not seen, f"{ch}: messages never published came back: {seen}"
        # everything taken goes in flight again (a consumer was waiting)
        for msg in taken:
            msg.attempts += 1
            channel.start_in_flight(msg, CLIENT, now, TIMEOUT)
            entry = self.model[ch][msg.id]
            entry.delivered = msg.attempts
            entry.in_flight_deadline = now + TIMEOUT
            entry.delivery_ts = now

    @staticmethod
    def _norm(state: State | None, now: float) -> State | None:
        if state is None:
            return None
        attempts, deadline = state
        return (attempts, deadline if deadline is not None and deadline > now else None)

    @staticmethod
    def _same(a: State | None, b: State | None) -> bool:
        if a is None or b is None:
            return a is b
        if a[0] != b[0] or (a[1] is None) != (b[1] is None):
            return False
        return a[1] is None or b[1] is None or abs(a[1] - b[1]) < 1e-6

    @invariant()
    def in_flight_matches(self) -> None:
        for ch, channel in self.channels.items():
            assert sorted(channel.in_flight._items) == self.in_flight(ch)


DeliveryMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, derandomize=True, database=None, deadline=None,
    suppress_health_check=list(HealthCheck),
)
test_delivery_survives_crashes = DeliveryMachine.TestCase
