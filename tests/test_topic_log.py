"""A topic's log and its channels' cursors, in process under MockClock: fan-out written once, what a new
channel gets, segments dropped once every channel is past them (or kept by retention), seek, deferred
publishes across a restart, a record held for an hour not pinning the log, the metadata Go nsqd reads,
and recovery that tells the truth (no ERROR when nothing is lost, no temp files left)."""

from __future__ import annotations

import logging
import os
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from trio_nsq.broker.channel import Channel
from trio_nsq.broker.message import Message
from trio_nsq.broker.topic import Topic
from trio_nsq.broker.storage.topic_log import SeekError
from tests.topic_owner import Owner, kill

CLIENT = 1


def open_topic(d: Path, name: str = "t", clock: trio.testing.MockClock | None = None, **options: Any) -> Topic:
    return Topic(Owner(d, clock, **options), name)  # type: ignore[arg-type]


def drain(channel: Channel, fin: bool = True, now: float = 0.0) -> list[Message]:
    """Everything the channel delivers now (in flight, then FIN'd unless told otherwise)."""
    out: list[Message] = []
    while msgs := channel.take(500):
        for msg in msgs:
            msg.attempts += 1
        channel.start_in_flight_many(msgs, CLIENT, now, 60.0)
        if fin:
            channel.finish_messages(CLIENT, [m.id for m in msgs])
        out.extend(msgs)
    return out


def files(d: Path, pattern: str) -> list[str]:
    return sorted(p.name for p in d.glob(pattern))


def segment_bytes(d: Path, name: str = "t") -> int:
    return sum(p.stat().st_size for p in d.glob(f"{name}.diskqueue.0*.dat"))


# --- written once ---------------------------------------------------------------------------------


async def test_fan_out_to_8_channels_is_written_once(tmp_path):
    topic = open_topic(tmp_path, mem_queue_size=0)
    channels = [topic.get_channel(f"c{i}") for i in range(8)]
    bodies = [b"%06d" % i + b"x" * 194 for i in range(10_000)]  # 200 bytes
    for at in range(0, len(bodies), 200):
        topic.publish(bodies[at:at + 200])
    await topic.group.sync_round()
    # one record per message ([length][timestamp][attempts][id][body]: 30 bytes around 200)
    assert segment_bytes(tmp_path) == 10_000 * 230
    assert not files(tmp_path, "t:*.diskqueue.*")  # no channel has a queue of its own
    for channel in channels:
        assert channel.depth() == 10_000 and channel.message_count == 10_000
    for channel in channels:
        assert [m.body for m in drain(channel)] == bodies
    await topic.group.sync_round()
    # every channel is past every segment: only the write file is left, and the cursors are small
    assert segment_bytes(tmp_path) == 10_000 * 230  # one 100 MB segment: still the write file
    assert sum(p.stat().st_size for p in tmp_path.glob("t:*.cursor.dat")) < 8 * 200
    kill(topic)


async def test_a_new_channel_gets_what_the_topic_still_holds(tmp_path):
    """As nsqd: messages wait in the topic until a channel exists (and while it is paused); a channel
    created later gets only what the topic has not handed over yet."""
    topic = open_topic(tmp_path, mem_queue_size=0)
    topic.publish([b"early-%d" % i for i in range(5)])
    assert topic.depth() == 5
    a = topic.get_channel("a")
    topic.dispatch()  # the pump's step when a channel appears
    assert topic.depth() == 0 and a.depth() == 5
    topic.publish([b"one", b"two"])
    b = topic.get_channel("b")
    assert b.depth() == 0 and a.depth() == 7
    topic.pause()
    topic.publish([b"paused-%d" % i for i in range(3)])
    c = topic.get_channel("c")
    assert (topic.depth(), a.depth(), b.depth(), c.depth()) == (3, 7, 0, 0)
    topic.unpause()
    topic.dispatch()
    assert (topic.depth(), a.depth(), b.depth(), c.depth()) == (0, 10, 3, 3)
    assert [m.body for m in drain(c)] == [b"paused-0", b"paused-1", b"paused-2"]
    # a restart keeps the line: the topic's undelivered part and each channel's place
    topic.pause()
    topic.publish([b"after"])
    await topic.group.sync_round()
    kill(topic)
    topic = open_topic(tmp_path, mem_queue_size=0)
    a, b, c = (topic.get_channel(n) for n in "abc")
    assert (topic.depth(), a.depth(), b.depth(), c.depth()) == (1, 10, 3, 0)
    kill(topic)


async def test_a_publish_to_a_waiting_pump_is_handed_over_at_once(tmp_path):
    """The topic's pump waits with nothing queued: a publish hands its messages to the channels itself
    (a task switch per PUB saved when producers send one at a time); paused, the topic keeps them, as
    nsqd does, until unpaused."""
    topic = open_topic(tmp_path)
    a = topic.get_channel("a")
    async with trio.open_nursery() as nursery:
        await nursery.start(topic.run)
        await trio.testing.wait_all_tasks_blocked()
        topic.publish([b"one"])
        assert (topic.depth(), a.depth()) == (0, 1)  # no checkpoint since the publish
        topic.pause()
        topic.publish([b"two"])
        assert (topic.depth(), a.depth()) == (1, 1)
        topic.unpause()
        await trio.testing.wait_all_tasks_blocked()
        assert (topic.depth(), a.depth()) == (0, 2)
        assert [m.body for m in drain(a)] == [b"one", b"two"]
        topic.cancel()
    kill(topic)


async def test_a_publish_past_a_full_channel_goes_to_the_log_in_order(tmp_path):
    """A durable channel's memory is full and the pump waits: a publish goes straight to the log (what
    _hand would do with it, without the Messages), in publish order; an ephemeral channel beside it keeps
    what its memory holds and drops the rest, as nsqd's does. (Memory and the log are two sources, as
    nsqd's memory queue and backend are: the order between them is not kept.)"""
    topic = open_topic(tmp_path, mem_queue_size=3)
    a, tail = topic.get_channel("a"), topic.get_channel("tail#ephemeral")
    async with trio.open_nursery() as nursery:
        await nursery.start(topic.run)
        await trio.testing.wait_all_tasks_blocked()
        for i in range(8):
            topic.publish([b"m%d" % i])
        assert topic.depth() == 0 and len(topic.memory) == 0
        assert len(a.memory) == 3 and a.depth() == 8  # 3 in memory, 5 in the log
        assert topic.log is not None and topic.log.undispatched() == 0
        assert topic.message_count == 8
        got = [m.body for m in drain(a)]
        assert sorted(got) == [b"m%d" % i for i in range(8)]
        assert [b for b in got if b >= b"m3"] == [b"m%d" % i for i in range(3, 8)]  # the log's, in order
        assert [m.body for m in drain(tail)] == [b"m0", b"m1", b"m2"] and tail.dropped_count == 5
        topic.cancel()
    kill(topic)
    topic = open_topic(tmp_path, mem_queue_size=3)  # what went to the log is there after a kill -9
    assert topic.get_channel("a").depth() == 0


async def test_segments_go_once_every_channel_is_past_them(tmp_path):
    topic = open_topic(tmp_path, mem_queue_size=0, max_bytes_per_file=1024)
    fast, slow = topic.get_channel("fast"), topic.get_channel("slow")
    topic.publish([b"m%04d" % i + b"x" * 100 for i in range(100)])  # ~135 bytes each: 7 to a file
    await topic.group.sync_round()
    segments = len(files(tmp_path, "t.diskqueue.0*.dat"))
    assert segments >= 14
    drain(fast)
    await topic.group.sync_round()
    assert len(files(tmp_path, "t.diskqueue.0*.dat")) == segments  # slow has not read them
    taken = drain(slow, fin=False)
    slow.finish_messages(CLIENT, [m.id for m in taken[:50]])
    await topic.group.sync_round()
    left = len(files(tmp_path, "t.diskqueue.0*.dat"))
    assert segments // 2 - 1 <= left <= segments // 2 + 2
    slow.finish_messages(CLIENT, [m.id for m in taken[50:]])
    await topic.group.sync_round()
    assert len(files(tmp_path, "t.diskqueue.0*.dat")) == 1  # the write file
    kill(topic)


async def test_retention_keeps_what_every_channel_finished_until_it_is_old_or_too_much(tmp_path, mock_clock):
    """A segment is old once the next one's first record was published before the retention time: the
    records' own timestamps, not the files' times (a backup restored with new times, or files touched by
    a copy, are neither kept longer nor dropped sooner)."""
    topic = open_topic(tmp_path, clock=mock_clock, mem_queue_size=0, max_bytes_per_file=1024, retention_time=3600.0)
    channel = topic.get_channel("c")
    topic.publish([b"m%04d" % i + b"x" * 100 for i in range(100)])
    drain(channel)
    await topic.group.sync_round()
    names = files(tmp_path, "t.diskqueue.0*.dat")
    assert len(names) >= 14  # all kept: finished, but not an hour old
    for name in names:  # files that look two hours old (mtime): their records are not
        os.utime(tmp_path / name, (time.time() - 7200, time.time() - 7200))
    topic.group.changed()
    await topic.group.sync_round()
    assert files(tmp_path, "t.diskqueue.0*.dat") == names
    mock_clock.jump(1800)
    topic.publish([b"n%04d" % i + b"x" * 100 for i in range(30)])  # half an hour later: 4 more segments
    drain(channel)
    mock_clock.jump(2000)  # the first 100 are now over an hour old, the 30 not
    for name in files(tmp_path, "t.diskqueue.0*.dat"):  # restored from a backup: every file new
        os.utime(tmp_path / name)
    topic.group.changed()
    await topic.group.sync_round()
    kept = files(tmp_path, "t.diskqueue.0*.dat")
    # the old segments went but the last (the next one's first record is new); the new ones stay
    assert kept[0] == names[-1] and len(kept) == len(files(tmp_path, "t.diskqueue.0*.dat"))
    assert 4 <= len(kept) - 1 <= 5
    kill(topic)

    # by size: what is beyond the limit goes, oldest first
    topic = open_topic(tmp_path, clock=mock_clock, mem_queue_size=0, max_bytes_per_file=1024, retention_bytes=3000)
    topic.get_channel("c")
    topic.group.changed()
    await topic.group.sync_round()
    left = files(tmp_path, "t.diskqueue.0*.dat")
    assert 3 <= len(left) <= 4 and left[-1] == kept[-1]
    kill(topic)


# --- seek -----------------------------------------------------------------------------------------


async def seek(topic: Topic, channel: Channel, to: str | int) -> None:
    """What /channel/seek does: the position, the deadlines there, the channel, a round."""
    assert topic.log is not None
    at = topic.log.seek_position(to)
    topic.log.reload_deadlines(at.position)
    channel.seek(at.position, at.index)
    await topic.group.sync_round()


async def test_seek_replays_in_publish_order_and_survives_a_kill(tmp_path):
    topic = open_topic(tmp_path, max_bytes_per_file=4096, retention_time=3600.0)
    channel = topic.get_channel("c")
    first = [b"first-%03d" % i for i in range(100)]
    second = [b"second-%03d" % i for i in range(100)]
    topic.publish(first)
    await trio.sleep(0)
    between = time.time_ns()
    while time.time_ns() == between:
        pass
    topic.publish(second)
    assert [m.body for m in drain(channel)] == first + second
    await seek(topic, channel, "earliest")
    assert channel.depth() == 200
    replay = drain(channel)
    assert [m.body for m in replay] == first + second and all(m.attempts == 1 for m in replay)
    await seek(topic, channel, between)
    assert [m.body for m in drain(channel)] == second
    await seek(topic, channel, "latest")
    assert drain(channel) == []
    # a seek is persisted before it is answered: kill -9 right after it, and the channel is still there
    await seek(topic, channel, between)
    kill(topic)
    topic = open_topic(tmp_path, max_bytes_per_file=4096, retention_time=3600.0)
    channel = topic.get_channel("c")
    assert [m.body for m in drain(channel)] == second
    kill(topic)


async def test_seek_drops_what_the_channel_held_and_refuses_a_time_before_the_log(tmp_path):
    topic = open_topic(tmp_path, mem_queue_size=0, max_bytes_per_file=1024, retention_bytes=2048)
    channel = topic.get_channel("c")
    topic.publish([b"m%04d" % i + b"x" * 100 for i in range(100)])
    taken = drain(channel, fin=False)[:10]
    channel.requeue_message(CLIENT, taken[0].id, 30.0)  # deferred
    await seek(topic, channel, "latest")
    assert len(channel.in_flight) == 0 and len(channel.deferred) == 0 and channel.depth() == 0
    # FINs of what was in flight before the seek do not apply any more
    _, error = channel.finish_messages(CLIENT, [taken[1].id])
    assert error is not None and str(error) == "ID not in flight"
    await topic.group.sync_round()  # retention by size drops the oldest segments
    assert topic.log is not None and topic.log.segments.first_file > 0
    with pytest.raises(SeekError):
        topic.log.seek_position(1)  # 1970: before anything kept
    kill(topic)


# --- deferred -------------------------------------------------------------------------------------


async def test_a_deferred_publish_is_written_once_and_keeps_its_deadline_across_kill_9(tmp_path, mock_clock):
    clock = mock_clock
    topic = open_topic(tmp_path, clock=clock, mem_queue_size=0, max_bytes_per_file=2048)
    a, b = topic.get_channel("a"), topic.get_channel("b")
    topic.publish([b"later-%d" % i for i in range(20)], 3600.0)
    topic.publish([b"now"])
    await topic.group.sync_round()
    for channel in (a, b):
        # read, and held as positions and deadlines (the bodies stay in the log)
        assert [m.body for m in drain(channel)] == [b"now"] and len(channel.backend.deferred_records) == 20
        assert len(channel.deferred) == 0 and channel.deferred_count() == 20
    await topic.group.sync_round()
    assert len(files(tmp_path, "t.diskqueue.deadlines.*.dat")) == 1
    assert not files(tmp_path, "t:*.diskqueue.*")  # nothing written per channel
    kill(topic)
    clock.jump(1800)
    topic = open_topic(tmp_path, clock=clock, mem_queue_size=0, max_bytes_per_file=2048)
    a = topic.get_channel("a")
    assert drain(a) == [] and len(a.backend.deferred_records) == 20
    assert {round(d, 3) for _, d in a.backend.deferred_records.entries()} == {3600.0}  # the same deadline
    clock.jump(1801)
    assert a.process_deferred_queue(trio.current_time())
    assert a.deferred_count() == 0 and a.depth() == 20
    assert sorted(m.body for m in drain(a)) == sorted(b"later-%d" % i for i in range(20))
    kill(topic)


async def test_a_message_deferred_for_an_hour_does_not_pin_the_log(tmp_path, mock_clock):
    """One message requeued for an hour while 20,000 flow through (read and FIN'd): the topic's log does
    not keep every segment behind it, and a kill -9 still finds the held message with its attempts and
    deadline."""
    clock = mock_clock
    topic = open_topic(tmp_path, clock=clock, mem_queue_size=0, max_bytes_per_file=16 * 1024)
    channel = topic.get_channel("c")
    topic.publish([b"poison"])
    [poison] = drain(channel, fin=False)
    channel.requeue_message(CLIENT, poison.id, 3600.0)
    most = 0
    for round_ in range(40):
        topic.publish([b"r%02d-%04d" % (round_, i) + b"x" * 40 for i in range(500)])
        drain(channel)
        await topic.group.sync_round()
        most = max(most, len(files(tmp_path, "t.diskqueue.0*.dat")))
    # 20,000 records of ~80 bytes are ~100 segments of 16 KiB: a pinned log would keep them all
    assert most <= 12, most
    reader = channel.backend.reader
    assert reader is not None and reader.cursor.unfinished() == 0  # the poison message moved out of the log
    await topic.group.sync_round()
    kill(topic)
    topic = open_topic(tmp_path, clock=clock, mem_queue_size=0, max_bytes_per_file=16 * 1024)
    channel = topic.get_channel("c")
    assert drain(channel) == []
    [(_, deadline)] = channel.backend.deferred_records.entries()
    assert deadline == pytest.approx(3600.0, abs=1e-3)  # the deadline the REQ gave it
    clock.jump(3600)
    channel.process_deferred_queue(trio.current_time())
    [held] = drain(channel)
    assert (held.body, held.attempts) == (b"poison", 2)  # its first delivery's and this one
    kill(topic)


# --- Go nsqd --------------------------------------------------------------------------------------


def go_read(d: Path, name: str) -> list[bytes]:
    """What Go nsqd's diskqueue reads from a directory: from the metadata's read position to its write
    position (its three lines only), in go-diskqueue's format; message bodies."""
    lines = (d / f"{name}.diskqueue.meta.dat").read_text().split("\n")
    depth = int(lines[0])
    read_num, read_pos = (int(x) for x in lines[1].split(","))
    write_num, write_pos = (int(x) for x in lines[2].split(","))
    out = []
    num, pos = read_num, read_pos
    while (num, pos) < (write_num, write_pos):
        path = d / f"{name}.diskqueue.{num:06d}.dat"
        data = path.read_bytes()
        if pos >= len(data):
            num, pos = num + 1, 0
            continue
        (length,) = struct.unpack_from(">i", data, pos)
        out.append(data[pos + 4 + 26:pos + 4 + length])
        pos += 4 + length
    assert depth == len(out), (name, depth, len(out))
    return out


async def test_go_nsqd_finds_every_unfinished_message_of_every_channel(tmp_path):
    """8 channels, some drained, some half, some holding deferred messages, then a clean exit: the
    topic's log from its metadata's read position (what Go nsqd copies to every channel) and each
    channel's own queue (what Go reads as the channel's queue) hold every message not finished."""
    topic = open_topic(tmp_path, max_bytes_per_file=2048, mem_queue_size=50)
    channels = [topic.get_channel(f"c{i}") for i in range(8)]
    bodies = [b"m%03d" % i for i in range(300)]
    topic.publish(bodies)
    topic._hand(100)  # 50 in memory (the pump's room), the rest to the log once
    unfinished: dict[str, set[bytes]] = {}
    for i, channel in enumerate(channels):
        taken = drain(channel, fin=False)
        if i < 3:
            done = taken
        elif i < 6:
            done = taken[: len(taken) // 2]
        else:
            done = taken[:100]
            for msg in taken[100:150]:
                channel.requeue_message(CLIENT, msg.id, 600.0)
        channel.finish_messages(CLIENT, [m.id for m in done])
        unfinished[channel.name] = set(bodies) - {m.body for m in done}
    await topic.close()
    from_topic = set(go_read(tmp_path, "t"))
    for channel in channels:
        own = set(go_read(tmp_path, f"t:{channel.name}")) if (tmp_path / f"t:{channel.name}.diskqueue.meta.dat").exists() else set()
        missing = unfinished[channel.name] - from_topic - own
        assert not missing, (channel.name, sorted(missing)[:5])


# --- recovery tells the truth ---------------------------------------------------------------------


async def test_repeated_kill_9_with_small_files_logs_no_loss_and_leaves_no_temp_files(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="nsqd")
    published: list[bytes] = []
    finished: set[bytes] = set()
    for run in range(15):
        topic = open_topic(tmp_path, mem_queue_size=0, sync_every=1, max_bytes_per_file=512)
        channel = topic.get_channel("c")
        got = drain(channel, fin=False)
        batch = [b"k%02d-%03d" % (run, i) for i in range(40)]
        published.extend(batch)
        p = topic.publish(batch)
        assert p.sync is not None
        await p.sync.sync()
        got += drain(channel, fin=False)
        channel.finish_messages(CLIENT, [m.id for m in got[: len(got) // 2]])
        finished.update(m.body for m in got[: len(got) // 2])
        if run % 3 == 0:
            await topic.group.sync_round()
        kill(topic)
    topic = open_topic(tmp_path, mem_queue_size=0, sync_every=1, max_bytes_per_file=512)
    left = {m.body for m in drain(topic.get_channel("c"))}
    assert set(published) - finished <= left  # nothing lost (FINs since a round may come again)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors
    assert not files(tmp_path, "*.tmp")
    kill(topic)
