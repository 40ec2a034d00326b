"""DeferredIndex (broker/storage/deferred_index.py): a channel's deferred records as (deadline, position), against a
model: every entry comes out once, when due and not before, earliest first; in-order deadlines take 16
bytes an entry; scattered ones stay in a bounded number of sorted runs, merged a bounded step at a time."""

from __future__ import annotations

import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from trio_nsq.broker.storage.deferred_index import FANOUT, MAX_OPEN, PENDING_MAX, DeferredIndex


def index() -> DeferredIndex:
    return DeferredIndex(lambda: 0.0)


def drain_ready(idx: DeferredIndex, n: int = 1000) -> list[int]:
    out: list[int] = []
    while got := idx.take_ready(n):
        out.extend(got)
    return out


def due_all(idx: DeferredIndex, now: float) -> int:
    """due() while it takes some (each call takes at most due_max): how many in all (removed ones too)."""
    total = 0
    while moved := idx.due(now):
        total += moved
    return total


def test_one_delay_is_one_run_of_32_bytes_an_entry():
    """16 bytes an entry in the run (deadline, position), 16 by position (position, deadline)."""
    idx = index()
    for i in range(100_000):
        idx.add(1000.0 + i * 0.001, i * 40)
    assert len(idx) == 100_000 and idx.ready_count() == 0
    assert len(idx._runs) == 1
    assert idx.nbytes() == 32 * 100_000
    # the first half is due: moved in order (16,384 a call at most), the rest still deferred
    assert idx.due(1000.0 + 49_999 * 0.001) == 16_384
    assert due_all(idx, 1000.0 + 49_999 * 0.001) == 50_000 - 16_384
    assert (len(idx), idx.ready_count()) == (50_000, 50_000)
    assert idx.take_ready(3) == [0, 40, 80]
    assert drain_ready(idx) == [i * 40 for i in range(3, 50_000)]
    assert idx.due(999.0) == 0  # nothing more before its deadline
    assert due_all(idx, 1e9) == 50_000 and len(idx) == 0
    assert drain_ready(idx) == [i * 40 for i in range(50_000, 100_000)]
    assert idx.nbytes() == 0  # the runs went with their entries, the chunks by position once all taken


def test_a_few_delays_are_a_few_runs_appended_to():
    """Publishers using three delays, interleaved: three runs, 32 bytes an entry (16 in the runs, 16 by
    position), nothing buffered or merged."""
    rng = random.Random(3)
    idx = index()
    expected = []
    for i in range(60_000):
        deadline = i * 0.001 + rng.choice([10.0, 60.0, 250.0])
        idx.add(deadline, i)
        expected.append((deadline, i))
    assert len(idx._runs) == 3 and not idx._merges and not idx._pending_deadlines
    assert idx.nbytes() == 32 * 60_000
    out: list[int] = []
    while idx.due(1e9):
        out.extend(drain_ready(idx))
    assert [expected[pos][0] for pos in out] == sorted(d for d, _ in expected)


def run_bound(count: int, max_open: int = MAX_OPEN, pending_max: int = PENDING_MAX, fanout: int = FANOUT) -> int:
    """The most runs `count` entries make: the open ones, and at each level fewer than `fanout` resting
    and one merge (`fanout` inputs and its output)."""
    levels = 1
    while pending_max * fanout ** levels < count:
        levels += 1
    return max_open + 2 * fanout * (levels + 1)


def test_scattered_deadlines_come_out_sorted_from_a_bounded_number_of_runs():
    rng = random.Random(7)
    idx = index()
    entries = [(rng.uniform(0, 1000), pos) for pos in range(60_000)]
    for deadline, pos in entries:
        idx.add(deadline, pos)
        assert len(idx._runs) <= run_bound(60_000)
    assert len(idx) == 60_000
    by_pos = dict((pos, deadline) for deadline, pos in entries)
    out: list[int] = []
    for now in range(0, 1001, 50):
        idx.due(float(now))
        got = drain_ready(idx)
        assert all(by_pos[pos] <= now for pos in got)
        assert all(by_pos[a] <= by_pos[b] for a, b in zip(got, got[1:]))  # earliest first within a batch
        out.extend(got)
        assert all(deadline > now for _, deadline in idx.entries())  # nothing due left behind
    assert sorted(out) == list(range(60_000))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 50)),
    st.tuples(st.just("due"), st.integers(0, 50)),
    st.tuples(st.just("take"), st.integers(1, 5)),
    st.tuples(st.just("remove"), st.integers(0, 3)),
    st.tuples(st.just("clear"), st.just(0)),
), max_size=300))
def test_against_a_model(ops):
    """Every entry added comes out once (due, then taken), never before its deadline, unless removed or
    cleared; counts and entries() agree with the model all along."""
    idx = index()
    deferred: dict[int, float] = {}
    ready: list[int] = []
    pos = 0
    for op, arg in ops:
        if op == "add":
            for _ in range(1 + arg % 3):  # runs of equal deadlines too
                idx.add(float(arg), pos)
                deferred[pos] = float(arg)
                pos += 1
        elif op == "due":
            due = sorted((d, p) for p, d in deferred.items() if d <= arg)
            before = idx.ready_count()
            assert idx.due(float(arg)) >= len(due)  # (and the removed ones it dropped)
            assert idx.ready_count() - before == len(due)
            for _, p in due:
                del deferred[p]
            ready.extend(p for _, p in due)
        elif op == "take":
            got = idx.take_ready(arg)
            assert set(got) <= set(ready) and len(set(got)) == len(got) == min(arg, len(ready))
            ready = [p for p in ready if p not in got]
        elif op == "remove":
            gone = {p for p in list(deferred) + ready if p % 4 == arg}
            assert sorted(idx.entries_in(gone)) == sorted([(p, deferred[p]) for p in deferred if p in gone]
                                                         + [(p, 0.0) for p in ready if p in gone])
            idx.remove(gone)
            deferred = {p: d for p, d in deferred.items() if p not in gone}
            ready = [p for p in ready if p not in gone]
        else:
            idx.clear()
            deferred.clear()
            ready.clear()
        assert len(idx) == len(deferred) and idx.ready_count() == len(ready)
        assert sorted(idx.entries()) == sorted(deferred.items())
    idx.due(1e9)
    assert sorted(drain_ready(idx)) == sorted(ready + list(deferred))


@pytest.mark.parametrize("bounds", [(2, 8, 2), (4, 32, 4), (16, 32, 8)])
@pytest.mark.parametrize("seed", [1, 2])
def test_scattered_deadlines_are_merged_as_they_come(seed, bounds):
    """Small bounds (so a few thousand entries make several levels): merging keeps up with the entries
    added (one merge a level at a time, fewer than `fanout` runs resting at a level), every run stays
    sorted all along, and what comes out is every entry, earliest first."""
    max_open, pending_max, fanout = bounds
    rng = random.Random(seed)
    idx = DeferredIndex(lambda: 0.0, max_open=max_open, pending_max=pending_max, fanout=fanout,
                        step=2 * fanout, work=8 * fanout, due_max=5 * fanout, slice_max=64)
    count = 3000
    merged: set[int] = set()
    for pos in range(count):
        idx.add(rng.uniform(0, 1000) if pos % 7 else 500.0 + pos * 1e-3, pos | (1 << 63))
        assert len(idx._runs) <= run_bound(count, max_open, pending_max, fanout)
        levels = [merge.level for merge in idx._merges]
        assert len(levels) == len(set(levels))
        merged.update(levels)
        resting = [run.level for run in idx._runs if run.kind == 1]  # resting: sealed, not in a merge
        assert all(resting.count(level) < fanout for level in resting)
    assert len(merged) >= 2, "the bounds are chosen so that merges of two levels or more are seen"
    for run in idx._runs:
        tail = run.deadlines[run.head:]
        assert all(a <= b for a, b in zip(tail, tail[1:]))
    deadlines = dict((pos, deadline) for pos, deadline in idx.entries())
    out: list[int] = []
    while idx.due(1e9):
        out.extend(drain_ready(idx))
    assert [deadlines[pos] for pos in out] == sorted(deadlines.values())  # earliest first, across calls
    assert sorted(out) == sorted(deadlines) and len(idx) == 0


def test_positions_are_unsigned_64_bit():
    idx = index()
    top = 2**64 - 1
    for i, pos in enumerate([top, 1 << 63, (1 << 63) | 5, 0, top - 1]):
        idx.add(10.0 - i, pos)
    assert sorted(idx.entries_in({top, 1 << 63, 7})) == [(1 << 63, 9.0), (top, 10.0)]
    idx.remove({(1 << 63) | 5})
    assert idx.due(100.0) == 5 and idx.ready_count() == 4  # the removed one dropped there
    assert drain_ready(idx) == [top - 1, 0, 1 << 63, top]


def test_reclaim_looks_up_and_removes_a_few_positions_without_a_pass_over_the_entries():
    """Reclaim asks a channel's index for the oldest few thousand positions it reads (RECLAIM_CHUNK) among
    millions of day-long random deadlines (merged runs, positions scattered in them), then removes those
    it moved: a lookup by position each, O(k log n). A pass over every entry (a set lookup each, the arrays
    holding some copied without them) took 240 + 372 ms for 1,000 positions at 4M, and allocated its
    masks and copies: what the two calls allocate here is bounded by k, not by n."""
    rng = random.Random(48)
    idx = index()
    n, k = 300_000, 1_000
    deadlines = [rng.uniform(3600.0, 86400.0) for _ in range(n)]
    for pos, deadline in enumerate(deadlines):
        idx.add(deadline, pos * 130)
    assert idx.due(3599.0) == 0
    assert len(idx._runs) > 1 and len(idx) == n
    wanted = {pos * 130 for pos in range(k)}  # the oldest: scattered over the runs
    tracemalloc.start()
    try:
        found = idx.entries_in(wanted)
        idx.remove(wanted)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sorted(found) == [(pos * 130, deadlines[pos]) for pos in range(k)]
    assert peak < 64 * 1024 + 300 * k, peak
    assert len(idx) == n - k and idx.entries_in(wanted) == []
    out: list[int] = []
    while idx.due(1e9):
        out.extend(drain_ready(idx))
    assert sorted(out) == [pos * 130 for pos in range(k, n)]
    assert len(idx) == 0 and idx.nbytes() == 0


def test_positions_in_chunks_out_of_order_and_removed_while_due():
    """By position: entries in read order fill chunks (freed once every entry in one is taken or
    removed), one below a chunk's last position is kept aside; a removed entry is dropped where it is met
    (merged, due, queued) and counted nowhere."""
    idx = DeferredIndex(lambda: 0.0, max_open=1, pending_max=4, fanout=2, step=2, work=3, due_max=3, chunk=3)
    for pos in range(20):
        idx.add(float(100 - pos), pos * 10)  # each before the last: the buffer, sorted runs, merges
    idx.add(50.5, 15)  # inside a chunk's span: aside
    assert len(idx._chunks) == 7 and idx._strays == {15: 50.5}
    assert sorted(idx.entries_in({15, 0, 190, 7})) == [(0, 100.0), (15, 50.5), (190, 81.0)]
    idx.remove({0, 10, 20, 15})  # the first chunk goes: nothing left in it
    assert len(idx._chunks) == 6 and not idx._strays and len(idx) == 17
    assert sorted(p for p, _ in idx.entries()) == [pos * 10 for pos in range(3, 20)]
    assert due_all(idx, 85.0) == 6 and idx.ready_count() == 5  # 190, 180, 170, 160, 150 (and 15, removed)
    idx.remove({180, 30})  # one due, one deferred
    assert idx.ready_count() == 4 and len(idx) == 11
    assert sorted(idx.entries_in({190, 180, 170, 30, 40})) == [(40, 96.0), (170, 0.0), (190, 0.0)]
    assert idx.take_ready(10) == [190, 170, 160, 150]
    assert [pos for _, pos in idx.earliest(3)] == [140, 130, 120]
    assert due_all(idx, 1e9) == 15 and idx.ready_count() == 11  # (0, 10, 20 and 30 dropped)
    assert drain_ready(idx) == [pos * 10 for pos in range(14, 3, -1)]
    assert len(idx) == 0 and idx.ready_count() == 0 and idx.nbytes() == 0 and not idx._chunks


# bounds of the index under test: tiny ones reach every path (buffers, sealed open runs, merges of
# several levels, due() moving part of what is due) in a few dozen entries
CONFIGS = [
    dict(max_open=1, pending_max=2, fanout=2, step=2, work=3, due_max=2, slice_max=3, chunk=1),
    dict(max_open=2, pending_max=4, fanout=3, step=5, work=8, due_max=6, slice_max=9, chunk=3),
    dict(max_open=4, pending_max=16, fanout=4, step=16, work=64, due_max=32, slice_max=64, chunk=8),
    dict(),
]
DELAYS = [10.0, 60.0, 250.0]
TOP = 2**64 - 1


class IndexMachine(RuleBasedStateMachine):
    """Random interleavings of every call against a plain model (a dict of the deferred entries, a list
    of the ready ones in the order due() moved them)."""

    @initialize(config=st.sampled_from(range(len(CONFIGS))))
    def start(self, config):
        self.idx = DeferredIndex(lambda: 0.0, **CONFIGS[config])
        self.deferred: dict[int, float] = {}
        self.ready: list[tuple[int, float, int]] = []  # (batch, deadline, position) in due order
        self.batch = 0
        self.clock = 0.0
        self.in_order = 0.0
        self.counter = 0
        self.taken = 0

    def _entries(self, mode, offsets, tag):
        deadlines, positions = [], []
        for offset in offsets:
            if mode == "in order":  # one delay: deadlines in the order they come
                self.in_order = max(self.in_order, self.clock + 100.0) + offset / 1000
                deadline = self.in_order
            elif mode == "few delays":
                deadline = self.clock + DELAYS[int(offset) % 3] + self.counter * 1e-6
            else:
                deadline = self.clock + (round(offset) if offset > 250 else offset)  # ties too
            self.counter += 1
            # positions as a log read forward gives them (increasing), decreasing, and scattered (inside
            # the span of positions added before: kept aside by position)
            pos = {"plain": self.counter, "own": (1 << 63) | self.counter, "top": TOP - self.counter,
                   "scattered": (1 << 62) + self.counter * 7919 % 10007}[tag]
            deadlines.append(deadline)
            positions.append(pos)
            self.deferred[pos] = deadline
        return deadlines, positions

    entries_strategy = dict(mode=st.sampled_from(["in order", "few delays", "scattered"]),
                            offsets=st.lists(st.floats(0, 300, allow_nan=False), min_size=1, max_size=30),
                            tag=st.sampled_from(["plain", "own", "top", "scattered"]))

    @rule(**entries_strategy)
    def add(self, mode, offsets, tag):
        for deadline, pos in zip(*self._entries(mode, offsets, tag)):
            self.idx.add(deadline, pos)

    @rule(**entries_strategy)
    def add_many(self, mode, offsets, tag):
        self.idx.add_many(*self._entries(mode, offsets, tag))

    @rule(advance=st.floats(0, 120, allow_nan=False))
    def due(self, advance):
        """What one due() moves: due, the earliest of what there is, and something when any is due."""
        self.clock += advance
        before = self.deferred
        ready = self.idx.ready_count()
        self.taken = self.idx.due(self.clock)
        left = dict(self.idx.entries())
        moved = [(before[pos], pos) for pos in before if pos not in left]
        assert len(moved) == self.idx.ready_count() - ready and self.taken >= len(moved)  # (removed ones too)
        assert left == {pos: d for pos, d in before.items() if pos in left}
        assert all(deadline <= self.clock for deadline, _ in moved)
        if moved and left:
            assert max(moved)[0] <= min(left.values())
        if not self.taken:
            assert all(deadline > self.clock for deadline in left.values())
        self.batch += 1
        self.ready.extend(sorted((self.batch, deadline, pos) for deadline, pos in moved))
        self.deferred = left

    @rule()
    def due_all(self):
        """due() again while it takes some: then nothing due is left."""
        self.due(0.0)
        while self.taken:
            self.due(0.0)
        assert all(deadline > self.clock for deadline in self.deferred.values())

    @rule(n=st.integers(1, 40))
    def take_ready(self, n):
        got = self.idx.take_ready(n)
        expected = self.ready[:min(n, len(self.ready))]
        order = {pos: (batch, deadline) for batch, deadline, pos in self.ready}
        assert len(got) == len(expected) and len(set(got)) == len(got)
        # in the order they became due (equal deadlines of one due() in any order)
        assert [order[pos] for pos in got] == [(batch, deadline) for batch, deadline, _ in expected]
        taken = set(got)
        self.ready = [entry for entry in self.ready if entry[2] not in taken]

    def _some(self, every, which):
        everything = sorted(self.deferred) + [pos for _, _, pos in self.ready]
        return {pos for i, pos in enumerate(everything) if i % every == which} | {12345}

    @rule(every=st.integers(1, 5), which=st.integers(0, 4))
    def entries_in(self, every, which):
        wanted = self._some(every, which)
        expected = [(p, d) for p, d in self.deferred.items() if p in wanted]
        expected += [(p, 0.0) for _, _, p in self.ready if p in wanted]
        assert sorted(self.idx.entries_in(wanted)) == sorted(expected)

    @rule(every=st.integers(1, 5), which=st.integers(0, 4))
    def remove(self, every, which):
        gone = self._some(every, which)
        self.idx.remove(gone)
        self.deferred = {p: d for p, d in self.deferred.items() if p not in gone}
        self.ready = [entry for entry in self.ready if entry[2] not in gone]

    @rule(which=st.integers(0, 10**6))
    def remove_one(self, which):
        everything = sorted(self.deferred) + [pos for _, _, pos in self.ready]
        if everything:
            self.remove(len(everything), which % len(everything))

    @rule()
    def clear(self):
        self.idx.clear()
        self.deferred = {}
        self.ready = []

    @rule(n=st.integers(0, 50))
    def earliest(self, n):
        got = self.idx.earliest(n)
        assert [d for d, _ in got] == sorted(self.deferred.values())[:n]
        assert len(set(got)) == len(got) and all(self.deferred[pos] == d for d, pos in got)

    @invariant()
    def agrees(self):
        if not hasattr(self, "idx"):
            return
        assert len(self.idx) == len(self.deferred) and self.idx.ready_count() == len(self.ready)
        assert sorted(self.idx.entries()) == sorted(self.deferred.items())
        # by position: every entry deferred or due once, with its state, nothing else; chunks in order
        idx = self.idx
        states = dict(idx._strays)
        for chunk in idx._chunks:
            live = [(pos, state) for pos, state in zip(chunk.positions, chunk.states) if state == state]
            assert chunk.live == len(live) > 0 and not states.keys() & dict(live).keys()
            states.update(live)
        assert states == {**self.deferred, **{pos: float("-inf") for _, _, pos in self.ready}}
        assert list(idx._firsts) == [chunk.positions[0] for chunk in idx._chunks] == sorted(idx._firsts)
        assert all(a.positions[-1] < b.positions[0] for a, b in zip(idx._chunks, idx._chunks[1:]))
        assert idx._dead >= 0 and idx._ready_dead >= 0
        for run in self.idx._runs:
            tail = run.deadlines[run.head:]
            assert all(a <= b for a, b in zip(tail, tail[1:]))

    def teardown(self):
        """Every entry comes out once: the ready ones, then the deferred ones when made due."""
        if not hasattr(self, "idx"):
            return
        out = drain_ready(self.idx)
        while self.idx.due(float("inf")):
            out.extend(drain_ready(self.idx))
        assert sorted(out) == sorted(list(self.deferred) + [pos for _, _, pos in self.ready])
        assert len(self.idx) == 0 and self.idx.ready_count() == 0


IndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                          derandomize=True)
test_index_machine = IndexMachine.TestCase
