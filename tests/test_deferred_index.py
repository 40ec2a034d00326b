"""DeferredIndex (broker/storage/deferred_index.py): a channel's deferred records as (deadline, position), against a
model: every entry comes out once, when due and not before, earliest first; in-order deadlines take 16
bytes an entry; scattered ones stay in a bounded number of sorted runs."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from trio_nsq.broker.storage.deferred_index import MAX_RUNS, DeferredIndex


def index() -> DeferredIndex:
    return DeferredIndex(lambda: 0.0)


def drain_ready(idx: DeferredIndex, n: int = 1000) -> list[int]:
    out: list[int] = []
    while got := idx.take_ready(n):
        out.extend(got)
    return out


def test_one_delay_is_one_run_of_16_bytes_an_entry():
    idx = index()
    for i in range(100_000):
        idx.add(1000.0 + i * 0.001, i * 40)
    assert len(idx) == 100_000 and idx.ready_count() == 0
    assert len(idx._runs) == 1
    assert idx.nbytes() == 16 * 100_000
    # the first half is due: moved in order, the rest still deferred
    assert idx.due(1000.0 + 49_999 * 0.001) == 50_000
    assert (len(idx), idx.ready_count()) == (50_000, 50_000)
    assert idx.take_ready(3) == [0, 40, 80]
    assert drain_ready(idx) == [i * 40 for i in range(3, 50_000)]
    assert idx.due(999.0) == 0  # nothing more before its deadline
    assert idx.due(1e9) == 50_000 and len(idx) == 0
    assert drain_ready(idx) == [i * 40 for i in range(50_000, 100_000)]
    assert idx.nbytes() == 0  # the runs went with their entries


def test_scattered_deadlines_come_out_sorted_from_a_bounded_number_of_runs():
    rng = random.Random(7)
    idx = index()
    entries = [(rng.uniform(0, 1000), pos) for pos in range(60_000)]
    for deadline, pos in entries:
        idx.add(deadline, pos)
        assert len(idx._runs) <= MAX_RUNS + 1
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
            assert idx.due(float(arg)) == len(due)
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
