"""Long delays (issue 35; nsqio/nsq #348, #1397, #1499), in process under MockClock: a deferred publish a
channel reads stays in the topic's log until due, the channel keeping only its position and deadline
(DeferredIndex), so many deferred messages hold no bodies; they come when due and not before, through a
kill -9, an empty, a seek and a reclaim that frees the log they pin. The broker process with
--max-defer-time is tests/test_durability.py's; 1,000,000 messages are tests/bench/dpub.py's."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from trio_nsq.broker.channel import OWN, Channel
from trio_nsq.broker.message import Message
from trio_nsq.broker.topic import Topic
from tests.topic_owner import Owner, kill

CLIENT = 1
DAY = 86400.0


def open_topic(d: Path, clock: trio.testing.MockClock, **options: Any) -> Topic:
    return Topic(Owner(d, clock, **options), "t")  # type: ignore[arg-type]


def deliver(channel: Channel, fin: bool = True, batch: int = 2500) -> list[Message]:
    """Everything the channel delivers now, put in flight (and FIN'd unless told otherwise)."""
    out: list[Message] = []
    while msgs := channel.take(batch):
        for msg in msgs:
            msg.attempts += 1
        channel.start_in_flight_many(msgs, CLIENT, trio.current_time(), 60.0)
        if fin:
            channel.finish_messages(CLIENT, [m.id for m in msgs])
        out.extend(msgs)
    return out


def due(channel: Channel) -> None:
    """The queue scan's passes over the channel's deferred messages (it samples again at once while the
    channel has work: the index moves a bounded number a call)."""
    while channel.process_deferred_queue(trio.current_time()):
        pass


async def test_many_messages_deferred_for_a_day_hold_no_bodies_and_all_come_after_it(tmp_path, mock_clock):
    """200,000 DPUBs of 100 bytes deferred for a day, read by a channel (half as they come, half at once):
    what the channel keeps for them is a few dozen bytes each (their bodies stay in the log), the sync
    rounds meanwhile append a few bytes each (nothing is held per deferred record: the 1M DPUB that took
    173 s rewrote every held record each round), and once the day has passed every one is delivered,
    once."""
    n = 200_000
    topic = open_topic(tmp_path, mock_clock, mem_queue_size=0)
    channel = topic.get_channel("c")
    for at in range(0, n, 10_000):
        topic.publish([b"%07d" % i + b"x" * 93 for i in range(at, at + 10_000)], DAY)
        if at < n // 2:
            assert channel.take(100) == []  # read, every record deferred
        await topic.group.sync_round()
    gc.collect()
    blocks = sys.getallocatedblocks()
    assert channel.backend.reader is not None
    while channel.take(100) == [] and channel.backend.reader.more:  # 16,384 a turn
        pass
    gc.collect()
    # the objects reading 100,000 deferred records left: one a record (its position in the cursor's list
    # of records read); before, a Message, its body and its id (and a deadline entry), 4 and more
    kept = sys.getallocatedblocks() - blocks
    assert kept < 1.5 * (n // 2), kept / (n // 2)
    assert (len(channel.backend.deferred_records), len(channel.deferred), channel.deferred_count(), channel.depth()) == (n, 0, n, 0)
    # 16 bytes an entry in the index's runs, 16 by position (what reclaim looks up)
    assert channel.backend.deferred_records.nbytes() <= 32 * n + 64 * 1024
    assert os.path.getsize(tmp_path / "t:c.cursor.dat") < 1024
    mock_clock.jump(DAY - 1)
    due(channel)
    assert deliver(channel) == [] and channel.deferred_count() == n
    mock_clock.jump(1)
    due(channel)
    assert (channel.deferred_count(), channel.depth()) == (0, n)
    seen = bytearray(n)
    for msg in deliver(channel):
        assert msg.attempts == 1 and not seen[int(msg.body[:7])]
        seen[int(msg.body[:7])] = 1
    assert all(seen) and channel.depth() == 0
    await topic.group.sync_round()
    assert os.path.getsize(tmp_path / "t:c.cursor.dat") < 1024
    kill(topic)


class Waiter:
    """A consumer's pump waiting on the channel."""

    id = 7
    woken = 0

    def wake(self) -> None:
        self.woken += 1


async def test_a_long_run_of_deferred_records_is_read_in_turns(tmp_path, mock_clock):
    """A take reads at most LogReader.deferred_per_read deferred records (here 1,000 of 3,500): when that
    gives nothing, the pumps waiting on the channel are woken in the event loop's next turn to read on,
    and the message behind the run comes."""
    topic = open_topic(tmp_path, mock_clock, mem_queue_size=0)
    channel = topic.get_channel("c")
    assert channel.backend.reader is not None
    channel.backend.reader.deferred_per_read = 1000
    topic.publish([b"d%d" % i for i in range(3500)], 600.0)
    topic.publish([b"behind"])
    waiter = Waiter()
    turns = 0
    while not (msgs := channel.take(1)):
        turns += 1
        channel.waiters.add(waiter)  # what the pump does when it got nothing
        await trio.testing.wait_all_tasks_blocked()
        assert waiter.woken == turns and not channel.waiters
    assert [m.body for m in msgs] == [b"behind"] and turns == 3
    assert len(channel.backend.deferred_records) == 3500
    kill(topic)


async def test_a_turn_of_the_loop_reads_a_bounded_number_of_deferred_records(tmp_path, mock_clock):
    """What one take() does with deferred records is bounded so that an event-loop step stays well under
    100 ms compiled: it puts 16,384 in the index (and what the batch it read gives past that: 4,096 at
    most), not 65,536 (76-96 ms compiled, more under load). Records deferred all along the log are not
    moved to the own queue: moving some frees the log only up to the next (a copy of the log, for nothing
    freed: the bench of random day-long DPUBs moved most of 4M records that way)."""
    topic = open_topic(tmp_path, mock_clock, mem_queue_size=0, max_bytes_per_file=64 * 1024)
    channel = topic.get_channel("c")
    backend = channel.backend
    assert backend.reader is not None
    for i in range(70):
        topic.publish([b"%05d" % (i * 1000 + j) for j in range(1000)], 3600.0 + i)
    sizes = []
    while True:
        before = len(backend.deferred_records)
        assert channel.take(100) == []
        sizes.append(len(backend.deferred_records) - before)
        if not backend.reader.more:
            break
    assert 16_384 <= max(sizes) < 16_384 + 4_096 and sum(sizes) == 70_000  # (a batch read past the bound)
    topic.publish([b"behind"])
    for _ in range(20):
        backend.reclaim_wanted = True
        assert [m.body for m in channel.take(100)] in ([], [b"behind"])
    assert backend.own is None and len(backend.deferred_records) == 70_000
    kill(topic)


async def test_a_reclaim_moves_a_bounded_number_of_deferred_records_a_call(tmp_path, mock_clock):
    """A reclaim moves at most 1,024 records to the own queue a call (4,096 of them, read back, written and
    held, with a read turn, made the consumer's pump steps of 100-300 ms through a broker at 1.5M deferred),
    and moves them where that frees the log: 3,000 deferred records in front of 147,000 FIN'd ones."""
    topic = open_topic(tmp_path, mock_clock, mem_queue_size=0, max_bytes_per_file=64 * 1024)
    channel = topic.get_channel("c")
    backend = channel.backend
    assert backend.reader is not None
    topic.publish([b"d%05d" % j for j in range(3000)], 3600.0)  # moved 1,024 a call at most
    for i in range(150):
        topic.publish([b"n%05d" % (i * 980 + j) for j in range(980)])
    moved = []
    delivered = 0
    while True:  # the reader enters segment after segment: each time, a reclaim
        own = backend.own.segments.tail_index if backend.own is not None else 0
        msgs = channel.take(100)
        if not msgs:
            break
        channel.start_in_flight_many(msgs, 1, trio.current_time(), 60.0)
        channel.finish_messages(1, [m.id for m in msgs])
        delivered += len(msgs)
        moved.append((backend.own.segments.tail_index if backend.own is not None else 0) - own)
    assert delivered == 150 * 980
    # (a take reads twice at most, each read reclaims once at most); read back from the own queue into the
    # index, so its count does not change
    assert max(moved) == 2 * 1024 and sum(moved) == 3000 and len(backend.deferred_records) == 3000
    kill(topic)


async def test_deferred_records_through_kill_9(tmp_path, mock_clock):
    """At the kill: some deferred records due and taken (some FIN'd), some due and not taken yet, some
    still ahead. After the restart the unfinished due ones come at once, the others at their deadline,
    the FIN'd ones not again, and none is lost."""
    topic = open_topic(tmp_path, mock_clock, mem_queue_size=0, max_bytes_per_file=64 * 1024)
    channel = topic.get_channel("c")
    topic.publish([b"soon-%04d" % i for i in range(3000)], 100.0)
    topic.publish([b"late-%04d" % i for i in range(1000)], 200.0)
    topic.publish([b"now"])
    assert [m.body for m in deliver(channel)] == [b"now"]
    mock_clock.jump(150)
    due(channel)
    assert (channel.depth(), channel.deferred_count()) == (3000, 1000)
    taken = deliver(channel, fin=False, batch=1000)[:1000]
    channel.finish_messages(CLIENT, [m.id for m in taken[:500]])
    await topic.group.sync_round()
    kill(topic)

    topic = open_topic(tmp_path, mock_clock, mem_queue_size=0, max_bytes_per_file=64 * 1024)
    channel = topic.get_channel("c")
    again = deliver(channel)
    assert sorted(m.body for m in again) == sorted({b"soon-%04d" % i for i in range(3000)} - {m.body for m in taken[:500]})
    assert channel.deferred_count() == 1000
    assert {round(d, 3) for _, d in channel.backend.deferred_records.entries()} == {200.0}
    mock_clock.jump(49)
    due(channel)
    assert deliver(channel) == []
    mock_clock.jump(1)
    due(channel)
    assert sorted(m.body for m in deliver(channel)) == [b"late-%04d" % i for i in range(1000)]
    kill(topic)


async def test_taking_one_at_a_time_past_runs_of_deferred_records(tmp_path, mock_clock):
    """A consumer with RDY 1 over runs of deferred records in small segments: each take gives one message,
    in publish order; a run is read in growing batches, and what a batch read past the one message is
    given back (in its segment or across segments) and counted right: the depth after each take, the
    index the cursor is at, and after a kill -9 the same again."""
    topic = open_topic(tmp_path, mock_clock, mem_queue_size=0, max_bytes_per_file=1024)
    channel = topic.get_channel("c")
    plain: list[bytes] = []
    later = 0
    for i in range(40):
        topic.publish([b"d%02d-%03d" % (i, j) for j in range(i * 37 % 300)], 600.0)
        later += i * 37 % 300
        plain += [b"p%02d-%d" % (i, j) for j in range(i % 3 + 1)]
        topic.publish(plain[-(i % 3 + 1):])
    got: list[bytes] = []
    while msgs := channel.take(1):
        assert len(msgs) == 1
        channel.start_in_flight_many(msgs, CLIENT, trio.current_time(), 60.0)
        channel.finish_messages(CLIENT, [msgs[0].id])
        got.append(msgs[0].body)
        assert channel.depth() == len(plain) - len(got)
    assert got == plain
    assert channel.deferred_count() == later
    assert channel.backend.reader is not None and channel.backend.reader.cursor.read_index == topic.log.segments.tail_index  # type: ignore[union-attr]
    await topic.group.sync_round()
    kill(topic)

    topic = open_topic(tmp_path, mock_clock, mem_queue_size=0, max_bytes_per_file=1024)
    channel = topic.get_channel("c")
    assert (channel.depth(), channel.deferred_count()) == (0, later)
    assert channel.take(1) == [] and len(channel.backend.deferred_records) == later
    mock_clock.jump(600)
    due(channel)
    assert len({m.body for m in deliver(channel)}) == later
    kill(topic)


async def test_a_read_ahead_past_a_cut_segment_gives_back_with_the_right_index(tmp_path, mock_clock):
    """A batch read ahead through a run of deferred records crosses a segment a bad record cut (its
    rest is lost, so the index jumps past it) and is given back in a later segment: the index it goes
    back to is counted from that segment's first record, so the depth stays true."""
    topic = open_topic(tmp_path, mock_clock, mem_queue_size=0, max_bytes_per_file=1024)
    channel = topic.get_channel("c")
    topic.publish([b"d-%03d" % j for j in range(200)], 600.0)  # ~30 records a segment
    topic.publish([b"p-%d" % j for j in range(5)])
    assert topic.log is not None and topic.log.segments.write_file_num >= 6
    # the first record of segment 5 (read in the batch of 128 that reaches the plain ones): all of it lost
    with open(topic.log.segments.file_name(5), "r+b") as fh:
        fh.write(b"\xff\xff\xff\xff")
    got = []
    while msgs := channel.take(1):
        channel.start_in_flight_many(msgs, CLIENT, trio.current_time(), 60.0)
        channel.finish_messages(CLIENT, [msgs[0].id])
        got.append(msgs[0].body)
        assert channel.depth() == 5 - len(got)
    assert got == [b"p-%d" % j for j in range(5)]
    kill(topic)


async def test_empty_and_seek_drop_deferred_records(tmp_path, mock_clock):
    topic = open_topic(tmp_path, mock_clock, mem_queue_size=0, retention_time=DAY)
    channel = topic.get_channel("c")
    topic.publish([b"a%d" % i for i in range(10)], 60.0)
    topic.publish([b"b%d" % i for i in range(10)], 600.0)
    assert deliver(channel) == []
    mock_clock.jump(60)
    due(channel)
    assert (channel.depth(), channel.deferred_count()) == (10, 10)
    channel.empty()
    assert (channel.depth(), channel.deferred_count(), channel.backend.deferred_records.ready_count()) == (0, 0, 0)
    mock_clock.jump(600)
    due(channel)
    assert deliver(channel) == []
    await topic.group.sync_round()
    kill(topic)

    # a seek back delivers the log again: what is due at once, what is still ahead when due
    topic = open_topic(tmp_path, mock_clock, mem_queue_size=0, retention_time=DAY)
    channel = topic.get_channel("c")
    assert deliver(channel) == []
    topic.publish([b"c%d" % i for i in range(5)], 300.0)
    assert deliver(channel) == [] and channel.deferred_count() == 5
    assert topic.log is not None
    at = topic.log.seek_position("earliest")
    topic.log.reload_deadlines(at.position)
    channel.seek(at.position, at.index)
    assert sorted(m.body for m in deliver(channel)) == sorted(b"%s%d" % (x, i) for x in (b"a", b"b") for i in range(10))
    assert channel.deferred_count() == 5
    mock_clock.jump(300)
    due(channel)
    assert sorted(m.body for m in deliver(channel)) == [b"c%d" % i for i in range(5)]
    kill(topic)


async def test_deferred_publishes_that_pin_the_log_are_moved_and_come_at_their_deadline(tmp_path, mock_clock):
    """20 DPUBs for an hour while 20,000 messages flow through (read and FIN'd): the topic's log does not
    keep every segment behind them (reclaim reads them back and moves them to the channel's own queue,
    held with their deadline), and after a kill -9 they come at their deadline, from there, once."""
    topic = open_topic(tmp_path, mock_clock, mem_queue_size=0, max_bytes_per_file=16 * 1024)
    channel = topic.get_channel("c")
    topic.publish([b"later-%02d" % i for i in range(20)], 3600.0)
    assert deliver(channel) == [] and len(channel.backend.deferred_records) == 20
    most = 0
    for round_ in range(40):
        topic.publish([b"r%02d-%04d" % (round_, i) + b"x" * 40 for i in range(500)])
        assert len(deliver(channel)) == 500
        await topic.group.sync_round()
        most = max(most, len(list(tmp_path.glob("t.diskqueue.0*.dat"))))
    # at most 4,096 finished records of ~80 bytes wait behind them: ~20 segments (pinned, all ~100 stay)
    assert most <= 24, most
    assert channel.backend.own is not None and channel.deferred_count() == 20
    await topic.group.sync_round()
    kill(topic)

    topic = open_topic(tmp_path, mock_clock, mem_queue_size=0, max_bytes_per_file=16 * 1024)
    channel = topic.get_channel("c")
    assert deliver(channel) == []
    entries = channel.backend.deferred_records.entries()
    assert len(entries) == 20 and all(pos & OWN for pos, _ in entries)  # read from its own queue
    assert all(d == pytest.approx(3600.0, abs=1e-3) for _, d in entries)
    mock_clock.jump(3600 - trio.current_time())
    due(channel)
    assert sorted(m.body for m in deliver(channel)) == [b"later-%02d" % i for i in range(20)]
    assert channel.backend.own is None  # drained: its files went
    kill(topic)


async def test_an_ephemeral_channel_of_a_durable_topic_defers_records_too(tmp_path, mock_clock):
    topic = open_topic(tmp_path, mock_clock)
    channel = topic.get_channel("tail#ephemeral")
    topic.publish([b"x%d" % i for i in range(50)], 30.0)
    assert deliver(channel) == [] and len(channel.backend.deferred_records) == 50
    mock_clock.jump(30)
    due(channel)
    assert sorted(m.body for m in deliver(channel)) == sorted(b"x%d" % i for i in range(50))
    kill(topic)
