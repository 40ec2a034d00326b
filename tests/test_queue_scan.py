"""The queue scan's decisions (broker/queue_scan.py, nsqd's queueScanLoop), in-process under MockClock.

queue_scan_loop runs against a stand-in for NSQD (options, all_channels, channels_generation) and
stand-in channels that note every scan and report work ("dirty") as each test scripts it. Every pass
is recorded, so each decision can be checked exactly: a pass every --queue-scan-interval, of
min(--queue-scan-selection-count, live channels) distinct channels, repeated at once while more than
--queue-scan-dirty-percent of them had work; exiting channels skipped; the channel list refreshed every
--queue-scan-refresh-interval or as soon as channels come or go; a pool of a quarter as many workers
as channels (1..--queue-scan-worker-pool-max).
"""

from __future__ import annotations

import itertools
import random

import pytest
import trio
import trio.testing

from trio_nsq.broker import queue_scan
from trio_nsq.broker.options import Options
from trio_nsq.broker.queue_scan import queue_scan_loop

INTERVAL = 1.0  # exact in binary: tick times are whole numbers


class FakeChannel:
    """Notes each scan: (time, name, dirty). `dirty` / `deferred_dirty`: how many more scans find work
    in its in-flight / deferred queue."""

    def __init__(self, name: str, scans: list[tuple[float, str, bool]], dirty: int = 0, deferred_dirty: int = 0) -> None:
        self.name = name
        self.scans = scans
        self.dirty = dirty
        self.deferred_dirty = deferred_dirty
        self.exiting = False
        self._in_flight = False

    def process_in_flight_queue(self, now: float) -> bool:
        self._in_flight = self.dirty > 0
        self.dirty -= self._in_flight
        return self._in_flight

    def process_deferred_queue(self, now: float) -> bool:
        deferred = self.deferred_dirty > 0
        self.deferred_dirty -= deferred
        self.scans.append((now, self.name, self._in_flight or deferred))
        return deferred


class Owner:
    """What queue_scan_loop reads of NSQD."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.channels: list[FakeChannel] = []
        self.channels_generation = 0
        self.scans: list[tuple[float, str, bool]] = []

    def add(self, n: int, *, dirty: int = 0, deferred_dirty: int = 0, bump: bool = True) -> list[FakeChannel]:
        new = [FakeChannel(f"c{len(self.channels) + i}", self.scans, dirty, deferred_dirty) for i in range(n)]
        self.channels += new
        if bump:  # as NSQD.notify_channel does
            self.channels_generation += 1
        return new

    def all_channels(self) -> list[FakeChannel]:
        return list(self.channels)

    def by_time(self) -> dict[float, list[tuple[str, bool]]]:
        """The scans of each instant, in order."""
        return {t: [(name, dirty) for _, name, dirty in group]
                for t, group in itertools.groupby(self.scans, key=lambda scan: scan[0])}


def options(**values: object) -> Options:
    opts = Options(queue_scan_interval=INTERVAL, queue_scan_refresh_interval=5.0, queue_scan_selection_count=4,
                   queue_scan_dirty_percent=0.25, queue_scan_worker_pool_max=4)
    for name, value in values.items():
        setattr(opts, name, value)
    return opts


async def run(nursery: trio.Nursery, owner: Owner) -> float:
    """Start the loop; returns its start time (its first pass is one interval later)."""
    nursery.start_soon(queue_scan_loop, owner)
    await trio.testing.wait_all_tasks_blocked()
    return trio.current_time()


def passes(owner: Owner, num: int) -> dict[float, list[list[tuple[str, bool]]]]:
    """Each instant's scans cut into its passes of `num` channels (a pass ends before the next starts)."""
    out = {}
    for t, scans in owner.by_time().items():
        assert len(scans) % num == 0, (t, scans)
        out[t] = [scans[i : i + num] for i in range(0, len(scans), num)]
    return out


def check_decisions(owner: Owner, num: int, dirty_percent: float) -> int:
    """Every pass is of `num` distinct channels; a pass with more than dirty_percent of them dirty is
    followed at once by another, one with no more than that ends the instant. Returns how many passes."""
    count = 0
    for t, group in passes(owner, num).items():
        for i, one in enumerate(group):
            assert len({name for name, _ in one}) == num, (t, one)
            again = sum(dirty for _, dirty in one) / num > dirty_percent
            assert again == (i < len(group) - 1), (t, i, one)
            count += 1
    return count


async def test_a_pass_every_interval_of_selection_count_distinct_channels(nursery, autojump_clock):
    owner = Owner(options())
    owner.add(10)
    t0 = await run(nursery, owner)
    await trio.sleep(3.5)
    got = passes(owner, 4)
    assert list(got) == [t0 + 1, t0 + 2, t0 + 3]  # none at the start: the first after one interval
    assert all(len(group) == 1 for group in got.values())  # all clean: one pass each
    assert check_decisions(owner, 4, 0.25) == 3


async def test_fewer_channels_than_the_selection_count_are_each_scanned_once_a_pass(nursery, autojump_clock):
    owner = Owner(options(queue_scan_selection_count=20))
    owner.add(3)
    t0 = await run(nursery, owner)
    await trio.sleep(2.5)
    assert {t: sorted(scans) for t, scans in owner.by_time().items()} == {
        t0 + 1: [("c0", False), ("c1", False), ("c2", False)],
        t0 + 2: [("c0", False), ("c1", False), ("c2", False)],
    }


async def test_more_than_dirty_percent_dirty_scans_again_at_once(nursery, autojump_clock):
    """Four channels, all sampled: two with work for three scans (50 % > 25 %) make four passes at the
    first tick (three dirty, one clean); the next tick is one pass again."""
    owner = Owner(options())
    owner.add(2, dirty=3)
    owner.add(2)
    t0 = await run(nursery, owner)
    await trio.sleep(2.5)
    got = passes(owner, 4)
    assert {t: len(group) for t, group in got.items()} == {t0 + 1: 4, t0 + 2: 1}
    assert [sum(dirty for _, dirty in one) for one in got[t0 + 1]] == [2, 2, 2, 0]
    check_decisions(owner, 4, 0.25)


async def test_exactly_dirty_percent_dirty_waits_for_the_next_interval(nursery, autojump_clock):
    """nsqd loops while the dirty share is *more* than the percentage: one of four (25 %) does not."""
    owner = Owner(options())
    (busy,) = owner.add(1, dirty=3)
    owner.add(3)
    t0 = await run(nursery, owner)
    await trio.sleep(4.5)
    assert {t: len(group) for t, group in passes(owner, 4).items()} == {t0 + k: 1 for k in (1, 2, 3, 4)}
    assert [dirty for _, name, dirty in owner.scans if name == busy.name] == [True, True, True, False]


async def test_due_deferred_messages_count_as_work(nursery, autojump_clock):
    owner = Owner(options())
    owner.add(2, deferred_dirty=1)
    owner.add(2)
    t0 = await run(nursery, owner)
    await trio.sleep(1.5)
    assert [sum(dirty for _, dirty in one) for one in passes(owner, 4)[t0 + 1]] == [2, 0]


async def test_the_dirty_loop_under_random_sampling(nursery, autojump_clock, monkeypatch):
    """Thirty channels, eight a pass, work scripted at random: every decision of every pass follows the
    rule, whatever the sample."""
    monkeypatch.setattr(queue_scan, "random", random.Random(34))
    script = random.Random(7)
    owner = Owner(options(queue_scan_selection_count=8))
    for _ in range(30):
        owner.add(1, dirty=script.choice([0, 0, 1, 3, 10]), deferred_dirty=script.choice([0, 0, 2]))
    await run(nursery, owner)
    await trio.sleep(60.5)
    count = check_decisions(owner, 8, 0.25)
    assert count > 60 + 5  # some instants did repeat
    assert all(ch.dirty <= 0 and ch.deferred_dirty <= 0 for ch in owner.channels)  # all work done


async def test_exiting_channels_are_not_scanned(nursery, autojump_clock):
    owner = Owner(options())
    a, b = owner.add(2)
    b.exiting = True
    t0 = await run(nursery, owner)
    await trio.sleep(1.5)
    assert owner.by_time() == {t0 + 1: [("c0", False)]}
    a.exiting = True
    await trio.sleep(3)
    assert list(owner.by_time()) == [t0 + 1]  # nothing live: no pass


async def test_a_new_channel_is_scanned_at_the_next_tick_when_channels_changed(nursery, autojump_clock):
    owner = Owner(options())
    owner.add(1)
    t0 = await run(nursery, owner)
    await trio.sleep(1.5)
    owner.add(1)  # generation bumped, as NSQD.notify_channel does
    await trio.sleep(1)
    assert owner.by_time()[t0 + 2] in ([("c0", False), ("c1", False)], [("c1", False), ("c0", False)])


async def test_without_a_change_notice_the_list_is_refreshed_every_refresh_interval(nursery, autojump_clock):
    owner = Owner(options())
    owner.add(1)
    t0 = await run(nursery, owner)
    await trio.sleep(1.5)
    owner.add(1, bump=False)
    await trio.sleep(4)
    first = min(t for t, name, _ in owner.scans if name == "c1")
    assert first == t0 + 5  # --queue-scan-refresh-interval after the start


def workers(nursery: trio.Nursery) -> int:
    """How many queue_scan_worker tasks the loop's nursery holds."""
    (loop_task,) = [t for t in nursery.child_tasks if t.name.endswith("queue_scan_loop")]
    (pool,) = loop_task.child_nurseries
    return len(pool.child_tasks)


@pytest.mark.parametrize(("channels", "expected"), [(1, 1), (7, 1), (8, 2), (12, 3), (40, 4)])
async def test_the_worker_pool_is_a_quarter_of_the_channels_within_its_bounds(nursery, autojump_clock, channels, expected):
    owner = Owner(options())
    owner.add(channels)
    await run(nursery, owner)
    assert workers(nursery) == expected


async def test_the_worker_pool_follows_the_channels(nursery, autojump_clock):
    owner = Owner(options())
    owner.add(40)
    await run(nursery, owner)
    assert workers(nursery) == 4
    del owner.channels[4:]
    owner.channels_generation += 1
    await trio.sleep(1.5)
    assert workers(nursery) == 1
    owner.add(8)
    await trio.sleep(1)
    assert workers(nursery) == 3
    # the pool's changes cost no scan: each instant still scans every channel once
    assert all(len(scans) == 4 for scans in owner.by_time().values())
