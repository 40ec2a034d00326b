"""broker/pqueue.py: the in-flight/deferred queue (dict by id + heap by deadline, lazy deletion).

What a channel relies on: pop_expired hands back exactly the messages whose deadline has passed,
earliest first; pop(id) (FIN/REQ) and a re-push (TOUCH) make the old heap entry
stale without touching the heap; and the heap is compacted so its size follows the live set.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trio_nsq.broker import pqueue
from trio_nsq.broker.message import Message
from trio_nsq.broker.pqueue import _COMPACT_MIN, MessagePQueue


def _msg(i: int) -> Message:
    return Message(b"%016x" % i, b"body-%d" % i, timestamp=i, attempts=1)


def _ids(msgs: list[Message]) -> list[bytes]:
    return [m.id for m in msgs]


def _heap_bound_holds(q: MessagePQueue) -> bool:
    return q.entry_count <= 2 * len(q) + _COMPACT_MIN


def test_pop_expired_returns_due_messages_earliest_first():
    q = MessagePQueue()
    msgs = [_msg(i) for i in range(10)]
    deadlines = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0, 4.0, 6.0, 0.5]
    for m, d in zip(msgs, deadlines):
        q.push(m, d)
    assert q.next_deadline() == 0.5
    assert _ids(q.pop_expired(0.4)) == []
    assert _ids(q.pop_expired(3.0)) == _ids([msgs[9], msgs[1], msgs[5], msgs[3]])  # <= now is due
    assert len(q) == 6 and msgs[3].id not in q and msgs[0].id in q
    assert _ids(q.pop_expired(100.0)) == _ids([msgs[7], msgs[0], msgs[8], msgs[4], msgs[6], msgs[2]])
    assert len(q) == 0 and q.next_deadline() is None and q.pop_expired(1e9) == []


def test_equal_deadlines_all_come_out_together():
    # a delivery batch shares one trio.current_time(), so equal deadlines are common; their relative
    # order is not promised (Go's heap does not promise it either)
    q = MessagePQueue()
    msgs = [_msg(i) for i in range(50)]
    for m in reversed(msgs):
        q.push(m, 1.0)
    q.push(_msg(99), 1.5)
    assert sorted(_ids(q.pop_expired(1.0))) == sorted(_ids(msgs))
    assert _ids(q.pop_expired(2.0)) == [_msg(99).id]


def test_push_records_the_deadline_on_the_message():
    q = MessagePQueue()
    m = _msg(1)
    q.push(m, 12.5)
    assert m.pri == 12.5 and q.get(m.id) is m


def test_pop_by_id_makes_the_heap_entry_stale():
    q = MessagePQueue()
    a, b, c = _msg(1), _msg(2), _msg(3)
    q.push(a, 1.0)
    q.push(b, 2.0)
    q.push(c, 3.0)
    assert q.pop(a.id) is a  # FIN
    assert q.pop(a.id) is None  # twice: nothing
    assert q.pop(b"0" * 16) is None  # never there
    assert q.entry_count == 3  # lazily: the heap is not searched
    assert a.id not in q and len(q) == 2
    assert q.next_deadline() == 2.0  # the stale head is skipped
    assert _ids(q.pop_expired(10.0)) == [b.id, c.id]


def test_a_popped_message_pushed_again_is_due_only_at_its_new_deadline():
    # REQ to the deferred queue and back, or FIN then a redelivery of the same object
    q = MessagePQueue()
    m = _msg(1)
    q.push(m, 1.0)
    q.pop(m.id)
    q.push(m, 5.0)
    assert _ids(q.pop_expired(4.0)) == []  # its old entry (1.0) is stale, not due
    assert _ids(q.pop_expired(5.0)) == [m.id]
    assert q.pop_expired(100.0) == []  # exactly once


def test_touch_moves_the_deadline_later():
    q = MessagePQueue()
    a, b = _msg(1), _msg(2)
    q.push(a, 1.0)
    q.push(b, 2.0)
    q.push(a, 10.0)  # TOUCH: a re-push of a message in flight
    assert len(q) == 2
    assert q.next_deadline() == 2.0
    assert _ids(q.pop_expired(9.0)) == [b.id]
    assert _ids(q.pop_expired(10.0)) == [a.id]


def test_repush_can_also_move_the_deadline_earlier():
    q = MessagePQueue()
    a, b = _msg(1), _msg(2)
    q.push(a, 10.0)
    q.push(b, 5.0)
    q.push(a, 1.0)
    assert _ids(q.pop_expired(1.0)) == [a.id]
    assert _ids(q.pop_expired(10.0)) == [b.id]


def test_many_touches_of_one_message_deliver_it_once():
    q = MessagePQueue()
    m = _msg(1)
    for i in range(5000):
        q.push(m, float(i))
        assert _heap_bound_holds(q)
    assert len(q) == 1
    assert _ids(q.pop_expired(1e9)) == [m.id]
    assert q.pop_expired(1e9) == [] and q.entry_count == 0


def test_a_message_moved_to_another_queue_is_stale_in_the_first():
    # REQ with a delay: pop from in-flight, push to deferred; later the same object is in flight again
    in_flight, deferred = MessagePQueue(), MessagePQueue()
    m = _msg(1)
    in_flight.push(m, 1.0)
    deferred.push(in_flight.pop(m.id), 2.0)
    assert in_flight.pop_expired(100.0) == []
    in_flight.push(deferred.pop_expired(2.0)[0], 50.0)
    assert deferred.pop_expired(100.0) == []
    assert _ids(in_flight.pop_expired(100.0)) == [m.id]


def test_drain_empties_everything_and_old_entries_stay_dead():
    q = MessagePQueue()
    msgs = [_msg(i) for i in range(100)]
    for i, m in enumerate(msgs):
        q.push(m, float(i))
    q.pop(msgs[0].id)
    drained = q.drain()
    assert sorted(_ids(drained)) == sorted(_ids(msgs[1:]))
    assert len(q) == 0 and q.next_deadline() is None and q.pop_expired(1e9) == []
    q.push(msgs[5], 3.0)  # the queue is usable again
    assert _ids(q.pop_expired(3.0)) == [msgs[5].id]


def test_next_deadline_discards_stale_heads():
    q = MessagePQueue()
    msgs = [_msg(i) for i in range(10)]
    for i, m in enumerate(msgs):
        q.push(m, float(i))
    for m in msgs[:9]:
        q.pop(m.id)
    assert q.next_deadline() == 9.0
    assert q.entry_count == 1


# --- memory -----------------------------------------------------------------------------------------


def test_heap_stays_bounded_over_100k_push_pop_with_a_live_window():
    # a consumer with ~1000 in flight, FINning the oldest as each new one is delivered
    q = MessagePQueue()
    window = 1000
    for i in range(100_000):
        q.push(_msg(i), float(i))
        assert _heap_bound_holds(q)
        if i >= window:
            q.pop(b"%016x" % (i - window))
            assert _heap_bound_holds(q)
    assert len(q) == window


def test_heap_stays_bounded_over_100k_immediate_fins():
    q = MessagePQueue()
    for i in range(100_000):
        m = _msg(i)
        q.push(m, float(i))
        q.pop(m.id)
        assert _heap_bound_holds(q)
    assert len(q) == 0


def test_heap_stays_bounded_over_100k_touches():
    q = MessagePQueue()
    msgs = [_msg(i) for i in range(100)]
    for m in msgs:
        q.push(m, 0.0)
    for i in range(100_000):
        q.push(msgs[i % 100], float(i))
        assert _heap_bound_holds(q)


def test_compaction_keeps_order_and_contents():
    q = MessagePQueue()
    msgs = [_msg(i) for i in range(5000)]
    for i, m in enumerate(msgs):
        q.push(m, float(5000 - i))
    for m in msgs[::2]:
        q.pop(m.id)
    for m in msgs[1:1000:2]:  # re-push some: the stale entries now outnumber the live ones
        q.push(m, float(10_000 + int(m.id, 16)))
    assert _heap_bound_holds(q)
    out = q.pop_expired(1e9)
    pris = [m.pri for m in out]
    assert pris == sorted(pris)
    assert sorted(_ids(out)) == sorted(_ids(msgs[1::2]))


def test_heap_is_bounded_after_the_consumer_fins_everything():
    """The module promises 'memory stays within twice the number of messages held'. A burst of 100k
    in flight all FINned leaves the queue empty, yet every FINned message (body included) stays
    referenced by its stale heap entry until its deadline passes (msg_timeout, 60 s by default, up to
    --max-msg-timeout), because compaction only runs on push."""
    q = MessagePQueue()
    for i in range(100_000):
        q.push(_msg(i), 1000.0 + i)
    for i in range(100_000):
        q.pop(b"%016x" % i)
    assert len(q) == 0
    heap_entries = q.entry_count
    assert heap_entries <= _COMPACT_MIN, f"{heap_entries} heap entries kept for 0 messages held"


# --- model ------------------------------------------------------------------------------------------


def _assert_expired(got: list[Message], model: dict[bytes, tuple[float, int]], now: float) -> None:
    """pop_expired gave exactly the model's due messages, each at its latest deadline, earliest first
    (equal deadlines in any order)."""
    assert sorted(_ids(got)) == sorted(k for k, (pri, _) in model.items() if pri <= now)
    assert [m.pri for m in got] == [model[m.id][0] for m in got]
    assert [m.pri for m in got] == sorted(m.pri for m in got)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["push", "push", "lane", "lane", "many", "pop", "owned", "expire", "next", "drain"]),
            st.integers(0, 30),
            st.integers(0, 60),
        ),
        max_size=120,
    )
)
def test_against_a_dict_and_sorted_model(ops):
    q = MessagePQueue()
    msgs = {k: _msg(k) for k in range(31)}
    model: dict[bytes, tuple[float, int]] = {}  # id -> (deadline, push order)
    order = 0
    clock = 0.0  # lane pushes: deadline = clock + timeout, the clock never going back
    for op, key, t in ops:
        m = msgs[key]
        if op == "push":
            q.push(m, float(t))
            model[m.id] = (float(t), order)
            order += 1
        elif op == "lane":
            clock += t % 3
            timeout = float((5, 10, 20)[t % 3])
            q.push(m, clock + timeout, lane=timeout)
            model[m.id] = (clock + timeout, order)
            order += 1
        elif op == "many":  # a message pump's batch: one deadline, one lane (some of another client)
            clock += t % 3
            timeout = float((5, 10, 20)[t % 3])
            batch = [msgs[(key + i) % 31] for i in range(1 + t % 4)]
            for i, b in enumerate(batch):
                b.client_id = 2 if (t + i) % 5 == 0 else 1
            q.push_many(batch, clock + timeout, timeout)
            for b in batch:
                model[b.id] = (clock + timeout, order)
                order += 1
        elif op == "pop":
            got = q.pop(m.id)
            assert (got is m) == (m.id in model) and (got is None) == (m.id not in model)
            model.pop(m.id, None)
        elif op == "owned":  # a run of FINs by client 1: popped up to the first missing or not its own
            run = [msgs[(key + i) % 31] for i in range(1 + t % 4)]
            want = []
            why = pqueue.OWNED
            for r in run:
                if r.id not in model:
                    why = pqueue.MISSING
                    break
                if r.client_id != 1:
                    why = pqueue.NOT_OWNED
                    break
                want.append(r)
                del model[r.id]
            got, stopped = q.pop_owned([r.id for r in run], 1)
            assert got == want and stopped == why
        elif op == "expire":
            got = q.pop_expired(float(t))
            _assert_expired(got, model, float(t))
            for m_ in got:
                del model[m_.id]
        elif op == "next":
            assert q.next_deadline() == (min(p for p, _ in model.values()) if model else None)
        else:
            assert sorted(_ids(q.drain())) == sorted(model)
            model.clear()
        assert len(q) == len(model)
        assert set(q._items) == set(model)
        for k in msgs.values():
            assert (k.id in q) == (k.id in model)
    _assert_expired(q.pop_expired(1e9), model, 1e9)


class PQueueMachine(RuleBasedStateMachine):
    """The same model as a state machine, with many messages so compaction is exercised."""

    def __init__(self) -> None:
        super().__init__()
        self.q = MessagePQueue()
        self.model: dict[bytes, tuple[float, int]] = {}
        self.msgs = [_msg(i) for i in range(3000)]
        self.order = 0
        self.now = 0.0

    def _push(self, m: Message, pri: float) -> None:
        self.q.push(m, pri)
        self.model[m.id] = (pri, self.order)
        self.order += 1

    @rule(start=st.integers(0, 2999), n=st.integers(1, 1500), spread=st.integers(0, 100))
    def push_many(self, start, n, spread):
        for i in range(n):
            self._push(self.msgs[(start + i) % 3000], self.now + (i * 7919) % (spread + 1))

    @rule(start=st.integers(0, 2999), n=st.integers(1, 1500), timeout=st.sampled_from([30, 60]))
    def deliver_many(self, start, n, timeout):
        """Put in flight as a consumer's pump does: deadline now + msg_timeout, in that timeout's lane."""
        for i in range(n):
            m = self.msgs[(start + i) % 3000]
            self.q.push(m, self.now + timeout, lane=float(timeout))
            self.model[m.id] = (self.now + timeout, self.order)
            self.order += 1

    @rule(start=st.integers(0, 2999), n=st.integers(1, 1500), step=st.integers(1, 5))
    def fin_many(self, start, n, step):
        for i in range(0, n, step):
            m = self.msgs[(start + i) % 3000]
            assert (self.q.pop(m.id) is m) == (m.id in self.model)
            self.model.pop(m.id, None)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def touch(self, data):
        key = data.draw(st.sampled_from(sorted(self.model)))
        self._push(self.q._items[key], self.now + data.draw(st.integers(0, 200)))

    @rule(dt=st.integers(0, 50))
    def scan(self, dt):
        self.now += dt
        got = self.q.pop_expired(self.now)
        _assert_expired(got, self.model, self.now)
        for m in got:
            del self.model[m.id]

    @invariant()
    def entries_stay_bounded(self):
        assert _heap_bound_holds(self.q)

    @invariant()
    def same_contents(self):
        assert len(self.q) == len(self.model)
        assert set(self.q._items) == set(self.model)

    @invariant()
    def next_deadline_is_the_models(self):
        expected = min((p for p, _ in self.model.values()), default=None)
        assert self.q.next_deadline() == expected


TestPQueueMachine = PQueueMachine.TestCase
TestPQueueMachine.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)


@pytest.mark.parametrize("n", [0, 1, _COMPACT_MIN, _COMPACT_MIN + 1, 3 * _COMPACT_MIN])
def test_sizes_around_the_compaction_threshold(n):
    q = MessagePQueue()
    msgs = [_msg(i) for i in range(n)]
    for m in msgs:
        q.push(m, 1.0)
    for m in msgs:
        q.push(m, 2.0)  # every first entry goes stale
        assert _heap_bound_holds(q)
    assert _ids(q.pop_expired(1.5)) == []
    assert _ids(q.pop_expired(2.0)) == _ids(msgs)


def test_in_order_fins_keep_a_lane_short_without_compaction():
    """The consumer's common case: one msg_timeout, FINs in delivery order. Each FIN drops its entry
    at the front of the lane, so the entries follow the messages in flight (here at most 100)."""
    q = MessagePQueue()
    msgs = [_msg(i) for i in range(100_000)]
    now = 0.0
    for i, m in enumerate(msgs):
        now += 0.001
        q.push(m, now + 60.0, lane=60.0)
        if i >= 100:
            assert q.pop(msgs[i - 100].id) is msgs[i - 100]
            assert q.entry_count == 100
    assert [m.id for m in q.pop_expired(now + 60.0)] == [m.id for m in msgs[-100:]]
    assert q.entry_count == 0 and len(q) == 0


def test_a_push_out_of_lane_order_goes_to_the_heap_and_still_comes_out_in_order():
    q = MessagePQueue()
    a, b, c = _msg(1), _msg(2), _msg(3)
    q.push(a, 70.0, lane=60.0)
    q.push(b, 65.0, lane=60.0)  # earlier than the lane's last: the heap takes it
    q.push(c, 61.0)
    assert q.next_deadline() == 61.0
    assert _ids(q.pop_expired(100.0)) == [c.id, b.id, a.id]


# --- merged from test_unit_core.py -----------------------------------------------------------


def _plain_msg(i: int) -> Message:
    return Message(b"%016x" % i, b"body")


def test_pqueue_expiry_order_and_stale_entries():
    q = MessagePQueue()
    msgs = [_plain_msg(i) for i in range(5)]
    for i, m in enumerate(msgs):
        q.push(m, 10.0 - i)
    q.pop(msgs[2].id)  # FIN
    q.push(msgs[4], 20.0)  # TOUCH moves the earliest one later
    assert [m.id for m in q.pop_expired(9.5)] == [msgs[3].id, msgs[1].id]
    assert [m.id for m in q.pop_expired(100)] == [msgs[0].id, msgs[4].id]
    assert len(q) == 0 and q.next_deadline() is None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "pop", "expire"]), st.integers(0, 20), st.integers(0, 100))))
def test_pqueue_against_a_model(ops):
    q, model, msgs = MessagePQueue(), {}, {}
    for op, key, t in ops:
        m = msgs.setdefault(key, _plain_msg(key))
        if op == "push":
            q.push(m, float(t))
            model[m.id] = float(t)
        elif op == "pop":
            assert (q.pop(m.id) is not None) == (m.id in model)
            model.pop(m.id, None)
        else:
            got = [x.id for x in q.pop_expired(float(t))]
            due = sorted((p, k) for k, p in model.items() if p <= t)
            assert sorted(got) == sorted(k for _, k in due)
            assert [model[k] for k in got] == sorted(model[k] for k in got)
            for k in got:
                del model[k]
        assert len(q) == len(model)


def test_expired_messages_taken_leave_the_stale_entries_bounded():
    """The state machine's find: messages put in flight, pushed again with deadlines due now (their lane
    entries go stale), then taken as expired: the queue holds few live ones and ~1,600 stale entries, so
    taking them must compact as a FIN or a push does."""
    machine = PQueueMachine()
    steps = [lambda: machine.deliver_many(start=0, n=1, timeout=30),
             lambda: machine.push_many(start=437, n=706, spread=1),
             lambda: machine.deliver_many(start=1, n=907, timeout=30),
             lambda: machine.push_many(start=1, n=908, spread=0),
             lambda: machine.scan(dt=0)]
    for step in steps:
        step()
        machine.entries_stay_bounded()
        machine.next_deadline_is_the_models()  # drops stale entries at the heap's front, as the machine did
        machine.same_contents()
