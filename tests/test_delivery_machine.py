"""The delivery core (Topic, Channel, their disk queues) under trio's MockClock, against a model, with
crashes: a hypothesis state machine interleaves PUB/MPUB, DPUB, taking (a consumer's delivery), FIN, REQ
with and without a delay, TOUCH, timeouts and due deferrals (clock jumps), channel empty, the io loop's
sync rounds and kill -9 (every in-memory object dropped, the files reopened as they are: the page cache
survives a killed process). Files are small, so records roll over files and reclaim copies them.

The flags are the guarantee's: --mem-queue-size=0 --sync-every=1 (a publish is answered after its
fsync round). What a crash may undo: whatever a channel did since its last completed sync round (a FIN,
a REQ, a timeout's requeue). So after a restart every message not finished by a completed round is
there exactly once, in a state it had since that round (its attempts, and its deadline if one is
still ahead): a FIN or REQ since then may be undone, once, never duplicated, and nothing is lost.
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

from trio_nsq.broker.backend import BackendQueue
from trio_nsq.broker.channel import RETRY_DELAY, Channel
from trio_nsq.broker.diskqueue import DiskQueue
from trio_nsq.broker.options import Options
from trio_nsq.broker.topic import Topic

TIMEOUT = 10.0  # the consumer's msg timeout
MAX_TIMEOUT = 25.0  # --max-msg-timeout (TOUCH is capped by it)
CLIENT = 1
# a state a message may be found in after a restart: (attempts in its record, deadline or None)
State = tuple[int, float | None]


class Owner:
    """What Topic needs of NSQD: options, the data path, disk queues made as NSQD makes them (a
    channel's keeps a cursor), with files small enough to roll every few records."""

    def __init__(self, data_path: str, clock: trio.testing.MockClock) -> None:
        self.data_path = data_path
        self.clock = clock
        self.options = Options()
        self.options.mem_queue_size = 0
        self.options.sync_every = 1
        self.options.node_id = 1
        self.queues: list[DiskQueue] = []

    def make_backend(self, topic_name: str, channel_name: str | None = None) -> BackendQueue:
        name = topic_name if channel_name is None else f"{topic_name}:{channel_name}"
        dq = DiskQueue(name, self.data_path, max_bytes_per_file=160, sync_every=1,
                       cursor=channel_name is not None, clock=self.clock.current_time)
        self.queues.append(dq)
        return dq

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        raise AssertionError("no clients here")

    def notify_channel(self, channel: Channel, created: bool) -> None:
        return None

    def delete_topic(self, name: str) -> None:
        return None


class Entry:
    """The model of one published message."""

    def __init__(self, deadline: float | None) -> None:
        self.handed = False  # the topic pump gave it to the channel
        self.cur: State | None = (0, deadline)  # None: finished
        self.since_round: list[State | None] = [self.cur]  # states since the channel's last round
        self.delivered = 0  # attempts of the delivery in flight (0: not in flight)
        self.in_flight_deadline = 0.0
        self.delivery_ts = 0.0
        self.deferred_until: float | None = deadline  # in memory: deferred until then

    def become(self, state: State | None) -> None:
        self.cur = state
        self.since_round.append(state)


class DeliveryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="trio-nsq-machine-")
        self.clock = trio.testing.MockClock()
        self.model: dict[bytes, Entry] = {}
        self.crashes = 0
        self._open()

    def _open(self) -> None:
        self.owner = Owner(self.dir, self.clock)
        self.topic = Topic(self.owner, "t", self.owner.make_backend("t"))  # type: ignore[arg-type]
        self.channel = self.topic.get_channel("c")

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
        for dq in self.owner.queues:
            dq._shut()
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- rules --------------------------------------------------------------------------------

    @rule(n=st.integers(1, 4), delay=st.sampled_from([0.0, 0.0, 5.0, 30.0]))
    def publish(self, n: int, delay: float) -> None:
        """PUB (n=1), MPUB, DPUB: answered once the topic's round has fsynced them."""
        async def pub() -> None:
            published = self.topic.publish([b"m%d" % (len(self.model) + i) for i in range(n)], delay)
            assert published.sync is not None
            await published.sync.sync()
        before = set(self.model)
        self.run(pub)
        deadline = self.now() + delay if delay else None
        new = self._peek_topic_ids(n)
        assert len(new) == n and not (set(new) & before)
        for msg_id in new:
            self.model[msg_id] = Entry(deadline)

    def _peek_topic_ids(self, n: int) -> list[bytes]:
        backend = self.topic.queue.backend
        assert isinstance(backend, DiskQueue)
        key = (backend.write_file_num << 40) | backend.write_pos
        ids: list[bytes] = []
        # the last n records of the topic's queue: scan its write file(s) from their start
        for num in range(max(0, backend.write_file_num - 4), backend.write_file_num + 1):
            try:
                with open(backend.file_name(num), "rb") as fh:
                    data = fh.read()
            except FileNotFoundError:
                continue
            pos = 0
            while pos + 4 <= len(data) and ((num << 40) | pos) < key:
                length = int.from_bytes(data[pos:pos + 4], "big")
                ids.append(data[pos + 14:pos + 30])
                pos += 4 + length
        return ids[-n:]

    @rule()
    def pump(self) -> None:
        """The topic's message_pump hands what it has to the channel."""
        def hand() -> None:
            while self.topic._copy(64):  # the pump's step: raw records with --mem-queue-size=0
                pass
        self.run(hand)
        for entry in self.model.values():
            entry.handed = True

    @rule(n=st.integers(1, 5))
    def take(self, n: int) -> None:
        """A consumer's message pump: the messages go in flight with their attempts counted."""
        now = self.now()

        def deliver() -> list[bytes]:
            msgs = self.channel.take(n)
            for msg in msgs:
                msg.attempts += 1
                self.channel.start_in_flight(msg, CLIENT, now, TIMEOUT)
            return [msg.id for msg in msgs]
        for msg_id in self.run(deliver):
            entry = self.model[msg_id]
            assert entry.handed and entry.cur is not None and not entry.delivered, msg_id
            assert entry.deferred_until is None or entry.deferred_until <= now, (msg_id, entry.deferred_until, now)
            entry.deferred_until = None
            entry.delivered = entry.cur[0] + 1
            entry.in_flight_deadline = now + TIMEOUT
            entry.delivery_ts = now

    def in_flight(self) -> list[bytes]:
        return sorted(k for k, e in self.model.items() if e.delivered)

    @precondition(lambda self: self.in_flight())
    @rule(data=st.data())
    def fin(self, data: st.DataObject) -> None:
        msg_id = data.draw(st.sampled_from(self.in_flight()))
        self.run(lambda: self.channel.finish_message(CLIENT, msg_id))
        entry = self.model[msg_id]
        entry.delivered = 0
        entry.become(None)

    @precondition(lambda self: self.in_flight())
    @rule(data=st.data(), delay=st.sampled_from([0.0, 3.0, 40.0]))
    def req(self, data: st.DataObject, delay: float) -> None:
        msg_id = data.draw(st.sampled_from(self.in_flight()))
        self.run(lambda: self.channel.requeue_message(CLIENT, msg_id, delay))
        entry = self.model[msg_id]
        attempts, entry.delivered = entry.delivered, 0
        deadline = self.now() + delay if delay else None
        entry.deferred_until = deadline
        entry.become((attempts, deadline))

    @precondition(lambda self: self.in_flight())
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        msg_id = data.draw(st.sampled_from(self.in_flight()))
        self.run(lambda: self.channel.touch_message(CLIENT, msg_id, TIMEOUT, MAX_TIMEOUT))
        entry = self.model[msg_id]
        entry.in_flight_deadline = min(self.now() + TIMEOUT, entry.delivery_ts + MAX_TIMEOUT)

    @rule(dt=st.sampled_from([1.0, 4.0, 11.0, 35.0]))
    def advance(self, dt: float) -> None:
        """Time passes; the queue scan requeues timed-out messages and moves due deferred ones back."""
        self.clock.jump(dt)
        now = self.now()
        self.run(lambda: (self.channel.process_in_flight_queue(now), self.channel.process_deferred_queue(now)))
        for entry in self.model.values():
            if entry.delivered and entry.in_flight_deadline <= now:
                attempts, entry.delivered = entry.delivered, 0
                entry.become((attempts, None))
            elif entry.deferred_until is not None and entry.deferred_until <= now and entry.handed:
                entry.deferred_until = None
                assert entry.cur is not None
                entry.become((entry.cur[0], None))

    @rule()
    def empty(self) -> None:
        """/channel/empty: everything the channel has goes (and its own round persists that)."""
        self.run(self.channel.empty)
        for entry in self.model.values():
            if entry.handed:
                entry.delivered = 0
                entry.deferred_until = None
                entry.cur = None
                entry.since_round = [None]

    @rule(topic=st.booleans(), channel=st.booleans())
    def sync_round(self, topic: bool, channel: bool) -> None:
        """The io loops' rounds (with --sync-every=1 one follows every change): fsync and metadata. The
        topic's and the channel's are independent (a crash may come between them, in either order)."""
        queues = [q.backend for q, on in ((self.topic.queue, topic), (self.channel.queue, channel)) if on]

        async def rounds() -> None:
            for dq in queues:
                assert isinstance(dq, DiskQueue)
                if dq._needs_sync:
                    await dq._sync_round()
        self.run(rounds)
        if channel:
            for entry in self.model.values():
                entry.since_round = [entry.cur]

    @rule()
    def crash(self) -> None:
        """kill -9 and a restart on the same files; then everything comes back, and is checked."""
        for dq in self.owner.queues:
            dq._shut()
        self.crashes += 1
        self._open()
        now = self.now()

        def recover() -> tuple[list[Any], list[Any]]:
            taken = []
            while self.topic._copy(64):  # the pump's step: raw records with --mem-queue-size=0
                pass
            while msgs := self.channel.take(64):
                taken.extend(msgs)
            return taken, list(self.channel.deferred._items.values())
        taken, deferred = self.run(recover)
        seen: dict[bytes, State] = {}
        for msg in taken:
            assert msg.id not in seen, f"{msg.id!r} delivered twice after a restart"
            seen[msg.id] = (msg.attempts, None)
        for msg in deferred:
            assert msg.id not in seen, f"{msg.id!r} both deferred and delivered after a restart"
            seen[msg.id] = (msg.attempts, msg.pri)
        assert len(deferred) == len({m.id for m in deferred})
        for msg_id, entry in self.model.items():
            allowed = {self._norm(s, now) for s in entry.since_round}
            got = seen.pop(msg_id, None)
            if got is None:
                assert None in allowed, f"{msg_id!r} lost: it may be in {allowed}"
                entry.cur = None
            else:
                state = self._norm(got, now)
                assert any(self._same(state, a) for a in allowed), f"{msg_id!r} came back as {state}, not one of {allowed}"
                entry.cur = state
            entry.since_round = [entry.cur]
            entry.handed = True
            entry.delivered = 0
            entry.deferred_until = None if entry.cur is None else entry.cur[1]
        assert not seen, f"messages never published came back: {seen}"
        # everything taken goes in flight again (a consumer was waiting)
        for msg in taken:
            msg.attempts += 1
            self.channel.start_in_flight(msg, CLIENT, now, TIMEOUT)
            entry = self.model[msg.id]
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
        assert sorted(self.channel.in_flight._items) == self.in_flight()


DeliveryMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, derandomize=True, database=None, deadline=None,
    suppress_health_check=list(HealthCheck),
)
test_delivery_survives_crashes = DeliveryMachine.TestCase


def test_records_a_channel_queue_refuses_wait_deferred_and_are_not_lost(tmp_path):
    """The pump's record hand-through (--mem-queue-size=0) when a channel's disk queue refuses them: the
    messages are kept deferred and retried, as put_messages keeps them; none is lost or doubled."""
    clock = trio.testing.MockClock()
    owner = Owner(str(tmp_path), clock)
    topic = Topic(owner, "t", owner.make_backend("t"))  # type: ignore[arg-type]
    channel = topic.get_channel("c")
    refusing = channel.queue.backend
    assert isinstance(refusing, DiskQueue)
    bodies = [b"m%d" % i for i in range(3)]

    async def main() -> list[tuple[bytes, bytes]]:
        published = topic.publish(bodies)
        assert published.sync is not None
        refusing.max_msg_size = 20  # shorter than any record: every write fails
        assert channel.takes_records()
        assert topic._copy(64) == 3
        assert len(channel.deferred) == 3 and channel.message_count == 3 and refusing.depth() == 0
        refusing.max_msg_size = 1024
        clock.jump(RETRY_DELAY)
        assert channel.process_deferred_queue(trio.current_time())
        assert refusing.depth() == 3 and len(channel.deferred) == 0
        return [(msg.id, msg.body) for msg in channel.take(10)]

    try:
        got = trio.run(main, clock=clock)
    finally:
        for dq in owner.queues:
            dq._shut()
    assert [body for _, body in got] == bodies and len({msg_id for msg_id, _ in got}) == 3
