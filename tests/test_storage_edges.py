"""The storage at its edges (issue 41), in process: each recovery path tested by damaging files, positions
and counts at the limits of their widths, what one stuck message costs, what reading a cursor file back
costs (lines run: linear in the file), a power loss after a kill -9, and the durable tail."""

from __future__ import annotations

import logging
import os
import random
import struct
import sys
import tracemalloc
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from trio_nsq.broker.channel import Channel
from trio_nsq.broker.storage import cursor_file
from trio_nsq.broker.storage.backend import BackendError
from trio_nsq.broker.storage.cursor import Cursor
from trio_nsq.broker.topic import Topic
from tests.power_loss import PowerLoss, power_loss  # noqa: F401 (the fixture)
from tests.topic_owner import CLIENT, Owner, deliver, drain, kill



def open_topic(d: Path, clock: trio.testing.MockClock | None = None, **options: Any) -> Topic:
    return Topic(Owner(d, clock, **options), "t")  # type: ignore[arg-type]


def meta_lines(d: Path, name: str = "t") -> list[str]:
    return (d / f"{name}.diskqueue.meta.dat").read_text().split("\n")


def go_record(i: int, body: bytes) -> bytes:
    message = struct.pack(">qH", 1_700_000_000_000_000_000 + i, 0) + b"%016x" % (0x18a685037a269000 + i) + body
    return struct.pack(">i", len(message)) + message


# --- item 1: a cursor past its log's end -------------------------------------------------------------


async def test_a_cursor_past_a_shorter_log_starts_afresh_and_skips_nothing_written_later(tmp_path, caplog):
    """The issue's recipe: 12 records, all but #6 finished, a round; the segment cut at record 3 and the
    metadata's read and write positions set there (a damaged disk, a backup copied file by file). The
    reopened cursor is past the log's end: it starts there, and its file's old ranges must not make it
    skip the records written later at those positions."""
    topic = open_topic(tmp_path, mem_queue_size=0)
    channel = topic.get_channel("c")
    topic.publish([b"old-%02d" % i for i in range(12)])
    msgs = deliver(channel)
    channel.finish_messages(CLIENT, [m.id for i, m in enumerate(msgs) if i != 6])
    await topic.group.sync_round()
    third = msgs[3].pos
    kill(topic)
    os.truncate(tmp_path / "t.diskqueue.000000.dat", third)
    lines = meta_lines(tmp_path)
    lines[1] = lines[2] = f"0,{third}"
    (tmp_path / "t.diskqueue.meta.dat").write_text("\n".join(lines))

    caplog.set_level(logging.INFO, logger="nsqd")
    topic = open_topic(tmp_path, mem_queue_size=0)
    channel = topic.get_channel("c")
    assert "past the log's end" in caplog.text
    await topic.group.sync_round()
    topic.publish([b"new-%02d" % i for i in range(12)])
    await topic.group.sync_round()
    kill(topic)
    topic = open_topic(tmp_path, mem_queue_size=0)
    channel = topic.get_channel("c")
    assert channel.depth() == 12
    assert drain(channel) == [b"new-%02d" % i for i in range(12)]
    kill(topic)


async def test_finished_ranges_past_a_cut_log_are_forgotten(tmp_path, caplog):
    """The same with the cursor's mark inside the log and its finished ranges past a cut: the ranges past
    the log's end go (and the file is written again), so a record written there later is delivered."""
    topic = open_topic(tmp_path, mem_queue_size=0)
    channel = topic.get_channel("c")
    topic.publish([b"old-%02d" % i for i in range(12)])
    msgs = deliver(channel)
    channel.finish_messages(CLIENT, [m.id for i, m in enumerate(msgs) if i != 2])  # #2 in flight
    await topic.group.sync_round()
    cut = msgs[8].pos
    kill(topic)
    os.truncate(tmp_path / "t.diskqueue.000000.dat", cut)
    lines = meta_lines(tmp_path)
    lines[2] = f"0,{cut}"
    (tmp_path / "t.diskqueue.meta.dat").write_text("\n".join(lines))
    caplog.set_level(logging.INFO, logger="nsqd")
    topic = open_topic(tmp_path, mem_queue_size=0)
    channel = topic.get_channel("c")
    assert "past the log's end" in caplog.text
    topic.publish([b"new-%02d" % i for i in range(6)])
    await topic.group.sync_round()
    kill(topic)
    topic = open_topic(tmp_path, mem_queue_size=0)
    channel = topic.get_channel("c")
    assert drain(channel) == [b"old-02"] + [b"new-%02d" % i for i in range(6)]
    kill(topic)


# --- item 3: positions at the limits of their width ----------------------------------------------------


def go_queue_at(d: Path, first: int, count: int = 30, per_file: int = 10) -> list[bytes]:
    """A topic queue as a long-lived Go nsqd leaves it: segments numbered from `first`, no line of ours."""
    bodies = [b"go-%05d" % i for i in range(count)]
    num = first
    for at in range(0, count, per_file):
        (d / f"t.diskqueue.{num:06d}.dat").write_bytes(b"".join(go_record(i, bodies[i]) for i in range(at, min(count, at + per_file))))
        num += 1
    last = (d / f"t.diskqueue.{num - 1:06d}.dat").stat().st_size
    (d / "t.diskqueue.meta.dat").write_text(f"{count}\n{first},0\n{num - 1},{last}\n")
    return bodies


@pytest.mark.parametrize("first", [(1 << 22) - 2, (1 << 23) - 2, (1 << 40) + 5])
async def test_a_go_queue_with_large_segment_numbers_loads_rolls_delivers_requeues_and_survives_kill_9(
        tmp_path, first):
    """Segment numbers only grow in go-diskqueue: a broker that ran long enough has numbers past 2**22 and
    2**23 (where `file << 40 | offset` met the own queue's tag, then overflowed 63 bits). Here they are
    names only: the positions start at 0."""
    old = go_queue_at(tmp_path, first)
    topic = open_topic(tmp_path, mem_queue_size=0, max_bytes_per_file=4096)
    channel = topic.get_channel("c")
    new = [b"new-%05d" % i + b"x" * 60 for i in range(2000)]  # ~50 more segments
    topic.publish(new)
    assert topic.log is not None and topic.log.segments.write_file_num > first + 40
    got: list[bytes] = []
    requeued: set[bytes] = set()
    while msgs := deliver(channel, 97):
        for msg in msgs:
            if len(got) % 13 == 0 and msg.body not in requeued:
                channel.requeue_message(CLIENT, msg.id, 0.0)
                requeued.add(msg.body)
            else:
                channel.finish_message(CLIENT, msg.id)
                got.append(msg.body)
        if len(got) > 1000 and not any(b.startswith(b"kill") for b in got):
            await topic.group.sync_round()
            kill(topic)  # kill -9 half way
            got.append(b"kill")
            topic = open_topic(tmp_path, mem_queue_size=0, max_bytes_per_file=4096)
            channel = topic.get_channel("c")
    await topic.group.sync_round()
    got.remove(b"kill")
    assert sorted(set(got)) == sorted(old + new) and len(requeued) > 100
    kill(topic)


def legacy_log(d: Path, first: int, count: int = 20) -> list[bytes]:
    """A log as trio-nsq-log 1 left it, at segment `first` (positions `first << 40 | offset`), with a
    channel's cursor that finished nothing yet."""
    bodies = [b"leg-%03d" % i for i in range(count)]
    (d / f"t.diskqueue.{first:06d}.dat").write_bytes(b"".join(go_record(i, b) for i, b in enumerate(bodies)))
    size = (d / f"t.diskqueue.{first:06d}.dat").stat().st_size
    start = first << 40
    (d / "t.diskqueue.meta.dat").write_text(
        f"{count}\n{first},0\n{first},{size}\ntrio-nsq-log 1\nepoch 1234\nsegments {first}:0\ntail {count}\n"
        f"dispatched {start} 0\n")
    return bodies


async def test_a_legacy_log_near_bit_62_requeues_and_survives_kill_9(tmp_path):
    """trio-nsq-log 1's positions at segment 2**22 - 2 are just under 2**62, where the own queue's tag
    was: a REQ there raised. The tag is bit 63 now, and later segments start where the last one ends."""
    first = (1 << 22) - 2
    bodies = legacy_log(tmp_path, first)
    topic = open_topic(tmp_path, mem_queue_size=0, max_bytes_per_file=200)
    channel = topic.get_channel("c")
    assert topic.log is not None and topic.log.segments.start == first << 40
    topic.publish([b"more-%03d" % i for i in range(20)])  # rolls: new segments start after the old one
    assert topic.log.segments.write_file_num > first + 2
    msgs = deliver(channel)
    assert [m.body for m in msgs] == bodies + [b"more-%03d" % i for i in range(20)]
    assert msgs[0].pos >= (1 << 62) - (1 << 42) and all(m.pos < (1 << 63) for m in msgs)
    for msg in msgs[::3]:
        channel.requeue_message(CLIENT, msg.id, 0.0)
    channel.finish_messages(CLIENT, [m.id for m in msgs[1::3] + msgs[2::3]])
    await topic.group.sync_round()
    kill(topic)
    topic = open_topic(tmp_path, mem_queue_size=0, max_bytes_per_file=200)
    again = deliver(topic.get_channel("c"))
    assert [(m.body, m.attempts) for m in again] == [(m.body, 2) for m in msgs[::3]]
    kill(topic)


async def test_a_legacy_log_past_what_its_positions_hold_starts_again_at_its_read_position(tmp_path, caplog):
    """trio-nsq-log 1 metadata naming segments past 2**23 (the round that wrote it could not persist the
    cursors: struct.error): the broker dies no more at open; positions start again from Go's read
    position, the cursor of the old epoch is refused, and everything is delivered (some twice)."""
    caplog.set_level(logging.INFO, logger="nsqd")
    first = (1 << 23) + 3
    bodies = legacy_log(tmp_path, first)
    (tmp_path / "t:c.cursor.dat").write_bytes(cursor_file.snapshot_file(5, 5, 0x1234, [], []))  # the old epoch
    topic = open_topic(tmp_path, mem_queue_size=0)
    assert "positions start again" in caplog.text
    channel = topic.get_channel("c")
    topic.dispatch()  # what the topic's pump does first
    assert drain(channel) == bodies
    await topic.group.sync_round()
    kill(topic)


async def test_the_log_refuses_appends_once_its_positions_are_used_up(tmp_path):
    """A position is 63 bits: a log whose next position would pass that refuses the append (the publisher
    gets E_PUB_FAILED), and the broker goes on."""
    start = (1 << 63) - 300
    (tmp_path / "t.diskqueue.000007.dat").write_bytes(b"")
    (tmp_path / "t.diskqueue.meta.dat").write_text(
        f"0\n7,0\n7,0\ntrio-nsq-log 2\nepoch 99\nsegments 7:0:{start}\ntail 0\n")
    topic = open_topic(tmp_path, mem_queue_size=0)
    channel = topic.get_channel("c")
    topic.publish([b"fits-%d" % i for i in range(5)])  # 5 x 37 bytes
    with pytest.raises(BackendError, match="positions are used up"):
        topic.publish([b"x" * 100 for _ in range(3)])
    assert drain(channel) == [b"fits-%d" % i for i in range(5)]  # none of the three past the limit
    await topic.group.sync_round()
    kill(topic)
    topic = open_topic(tmp_path, mem_queue_size=0)
    assert drain(topic.get_channel("c")) == []
    kill(topic)


def test_cursor_fields_at_their_width():
    """A range of more than 2**32 records is written in parts; attempts past 65,535 are written as 65,535
    (the wire's width); positions just under 2**63 go through."""
    cursor = Cursor(0, 0, 7)
    top = (1 << 63) - 100
    cursor.handed([0], 0, 10, 1)
    cursor.handed([top], 6_000_000_001, top + 10, 6_000_000_002)
    cursor.hold(0, 70_000, 0.0)
    data = cursor.snapshot()
    again, sound = Cursor.load(data, 7)
    assert sound == len(data)
    assert again.held == {0: (65_535, 0.0)} and again.hidden() == 6_000_000_000
    assert again.read_pos == 0 and again.read_index == 0
    skipped = [p for p in (5, 1 << 40, top - 1) if again.skip(p)]
    assert skipped == [5, 1 << 40, top - 1]  # every position between the two unfinished ones


# --- item 6: memory behind one stuck message --------------------------------------------------------


def cursor_entries(channel: Channel) -> int:
    """The entries the channel's cursor keeps for what it has read (FINs noted are applied first: at most
    FINISHED_LIMIT wait to be); those finished out of order are also in a set until they go."""
    reader = channel.backend.reader
    assert reader is not None
    cursor = reader.cursor
    cursor.unfinished()
    assert len(cursor._done) <= len(cursor._pos) - cursor._head
    return len(cursor._pos) - cursor._head


async def test_one_stuck_message_costs_one_entry_however_many_are_finished_behind_it(tmp_path):
    """120,000 messages FIN'd in order behind one held in flight: what the broker's heap grows by is not
    per message (it was ~100 bytes each: every position read since the oldest unfinished one, and a set
    entry for each finished one)."""
    topic = open_topic(tmp_path, mem_queue_size=0, max_bytes_per_file=1 << 20)
    channel = topic.get_channel("c")
    topic.publish([b"stuck"])
    [stuck] = deliver(channel, 1, timeout=600.0)

    async def batches(first: int, n: int) -> None:
        for batch in range(first, first + n):
            topic.publish([b"m-%06d" % (batch * 2000 + i) for i in range(2000)])
            msgs = deliver(channel, 2000)
            channel.finish_messages(CLIENT, [m.id for m in msgs])
            if batch % 10 == 9:
                await topic.group.sync_round()
    await batches(0, 10)  # the steady state's own allocations (buffers, the first rounds)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        await batches(10, 50)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 1_000_000, grown  # 100,000 messages: under 10 bytes each (it was 23 MB)
    await topic.group.sync_round()
    assert (tmp_path / "t:c.cursor.dat").stat().st_size < 128 * 1024  # snapshots keep it one range
    kill(topic)
    topic = open_topic(tmp_path, mem_queue_size=0, max_bytes_per_file=1 << 20)
    channel = topic.get_channel("c")
    assert channel.depth() == 1
    assert drain(channel) == [stuck.body]  # the 120,000 behind it were finished
    kill(topic)


async def test_fins_in_random_order_within_a_window_cost_the_window(tmp_path):
    topic = open_topic(tmp_path, mem_queue_size=0, max_bytes_per_file=1 << 20)
    channel = topic.get_channel("c")
    rng = random.Random(5)
    window = 2000
    most = 0
    for batch in range(60):
        topic.publish([b"m-%06d" % (batch * window + i) for i in range(window)])
        msgs = deliver(channel, window)
        rng.shuffle(msgs)
        for at in range(0, window, 100):
            channel.finish_messages(CLIENT, [m.id for m in msgs[at:at + 100]])
            most = max(most, cursor_entries(channel))
    assert most <= 2 * window + 4096 and cursor_entries(channel) == 0
    kill(topic)


# --- item 5: reading a cursor file back ------------------------------------------------------------


def lines_run(fn: Callable[[], Any], folder: str) -> int:
    """How many lines of the .py files in `folder` run while fn() runs."""
    count = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if not frame.f_code.co_filename.startswith(folder):
            return None
        if event == "line":
            count += 1
        return tracer
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def pure_storage(tmp_path: Path) -> Any:
    """The storage's cursor modules run from their .py files (a compiled module's lines are not seen),
    as package `pure_storage` in tmp_path: its Cursor class."""
    import importlib
    import trio_nsq.broker.storage as storage
    folder = tmp_path / "pure_storage"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    for source in Path(storage.__file__).parent.glob("*.py"):
        text = source.read_text().replace("trio_nsq.broker.storage.", "pure_storage.")
        (folder / source.name).write_text(text)
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module("pure_storage.cursor").Cursor, str(folder)
    finally:
        sys.path.remove(str(tmp_path))
        for name in [name for name in sys.modules if name.startswith("pure_storage")]:
            del sys.modules[name]


def gap_rounds(n: int) -> bytes:
    """A cursor file (trio-nsq-cursor 3) of n rounds, as a channel leaves it that finishes 3 records of
    every 4 it reads: each round's block holds the mark (the first record, never finished) and its FINs."""
    block = struct.Struct(">II")
    out = bytearray(b"trio-nsq-cursor 3\n")
    for i in range(n):
        body = struct.pack(">cqqQ", b"M", 0, 0, 3) + struct.pack(">cI", b"R", 3)
        body += b"".join(struct.pack(">qqI", p, p, 1) for p in (40 * i + 10, 40 * i + 20, 40 * i + 30))
        out += block.pack(len(body), zlib.crc32(body)) + body
    return bytes(out)


def test_reading_a_cursor_file_back_is_linear_in_its_size(tmp_path):
    """A file of 4x the rounds runs at most ~4.5x the lines (each round's mark filtered every range kept
    so far, and passing a range popped a list's head: 5k/10k/20k gaps loaded in 2.3/8.7/38 s)."""
    pure_cursor, folder = pure_storage(tmp_path)
    small, large = gap_rounds(2000), gap_rounds(8000)
    lines_small = lines_run(lambda: pure_cursor.load(small, 3), folder)
    lines_large = lines_run(lambda: pure_cursor.load(large, 3), folder)
    assert lines_large <= 4.5 * lines_small, (lines_small, lines_large)
    again, sound = Cursor.load(large, 3)
    assert sound == len(large) and again.hidden() == 3 * 8000
    assert [again.skip(p) for p in (0, 10, 20, 30, 40, 50)] == [False, True, True, True, False, True]
    # passing every range: linear too
    positions = [p for i in range(8000) for p in (40 * i, 40 * i + 10, 40 * i + 20, 40 * i + 30)]
    cursor, _ = pure_cursor.load(large, 3)
    small_cursor, _ = pure_cursor.load(small, 3)
    lines_skip_small = lines_run(lambda: [small_cursor.skip(p) for p in positions[:8000]], folder)
    lines_skip_large = lines_run(lambda: [cursor.skip(p) for p in positions], folder)
    assert lines_skip_large <= 4.5 * lines_skip_small, (lines_skip_small, lines_skip_large)


# --- item 7: the smaller ones -----------------------------------------------------------------------


async def test_segments_left_below_the_first_kept_are_removed_at_open(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="nsqd")
    topic = open_topic(tmp_path, mem_queue_size=0, max_bytes_per_file=100)
    channel = topic.get_channel("c")
    topic.publish([b"m-%03d" % i for i in range(40)])
    drain(channel)
    await topic.group.sync_round()
    assert topic.log is not None and topic.log.segments.first_file > 5
    first = topic.log.segments.first_file
    kill(topic)
    for num in range(first):  # what a crash between the metadata's write and the removals leaves
        (tmp_path / f"t.diskqueue.{num:06d}.dat").write_bytes(go_record(num, b"stale"))
    topic = open_topic(tmp_path, mem_queue_size=0, max_bytes_per_file=100)
    assert sorted(p.name for p in tmp_path.glob("t.diskqueue.0*.dat"))[0] == f"t.diskqueue.{first:06d}.dat"
    assert "left below the first segment" in caplog.text
    kill(topic)


async def test_removed_segments_stay_removed_after_a_power_loss(tmp_path, power_loss):  # noqa: F811
    topic = open_topic(power_loss.data_dir, mem_queue_size=0, max_bytes_per_file=100)
    channel = topic.get_channel("c")
    topic.publish([b"m-%03d" % i for i in range(40)])
    await topic.group.sync_round()
    drain(channel)
    await topic.group.sync_round()  # the segments go: removed, and the directory fsynced after
    left = sorted(p.name for p in Path(power_loss.data_dir).glob("t.diskqueue.0*.dat"))
    kill(topic)
    power_loss.crash("strict")
    assert sorted(p.name for p in Path(power_loss.data_dir).glob("t.diskqueue.0*.dat")) == left


async def test_a_record_of_zeros_past_the_write_position_ends_the_log_at_open(tmp_path, caplog):
    """A power loss can leave the unsynced end of a file as zeros under a length written back: the
    length check passes, the message id is not 16 hex digits. Cut there, never delivered."""
    topic = open_topic(tmp_path, mem_queue_size=0)
    channel = topic.get_channel("c")
    topic.publish([b"kept-%d" % i for i in range(3)])
    await topic.group.sync_round()
    topic.publish([b"recovered"])  # written after the last metadata: recovered (a kill -9 keeps it)
    kill(topic)
    with open(tmp_path / "t.diskqueue.000000.dat", "ab") as fh:
        fh.write(struct.pack(">i", 60) + bytes(60))  # zeros under a length that passes the check
        fh.write(go_record(8, b"after-the-zeros"))
    caplog.set_level(logging.INFO, logger="nsqd")
    topic = open_topic(tmp_path, mem_queue_size=0)
    assert "torn record" in caplog.text
    assert drain(topic.get_channel("c")) == [b"kept-%d" % i for i in range(3)] + [b"recovered"]
    kill(topic)


@pytest.mark.parametrize("mode", ["zeros", "prefix"])
async def test_the_unsynced_end_of_a_log_after_a_power_loss_is_never_a_message(power_loss, mode):  # noqa: F811
    d = Path(power_loss.data_dir)
    topic = open_topic(d, mem_queue_size=0)
    topic.get_channel("c")
    published = topic.publish([b"durable-%d" % i for i in range(5)])
    await topic.group.sync_round()
    topic.publish([b"lost-%d" % i for i in range(5)])  # no round
    kill(topic)
    for seed in range(5):
        power_loss.crash(mode, seed=seed)
        topic = open_topic(d, mem_queue_size=0)
        got = drain(topic.get_channel("c"))
        assert got[:5] == [b"durable-%d" % i for i in range(5)] and published.count == 5
        assert all(body.startswith(b"lost-") for body in got[5:])  # whole records only, in order
        kill(topic)


# --- a kill -9, then a power loss --------------------------------------------------------------------


async def test_records_a_kill_9_left_in_the_page_cache_are_fsynced_by_the_first_round(power_loss):  # noqa: F811
    """Records written after the last round were in the page cache when the process died; the restart
    finds them and hands them out. They must be fsynced (at open now, before the first round): else a
    power loss loses records the new process took for stored (and FINs it persisted for them), and their
    positions are given again."""
    d = Path(power_loss.data_dir)
    topic = open_topic(d, mem_queue_size=0)
    topic.get_channel("c")
    await topic.group.sync_round()
    topic.publish([b"unsynced-%d" % i for i in range(5)])
    kill(topic)  # kill -9: no round
    topic = open_topic(d, mem_queue_size=0)
    assert topic.log is not None
    tails = [topic.log.durable_tail.index]
    await topic.group.sync_round()
    tails.append(topic.log.durable_tail.index)
    kill(topic)
    power_loss.crash("strict")
    topic = open_topic(d, mem_queue_size=0)
    assert drain(topic.get_channel("c")) == [b"unsynced-%d" % i for i in range(5)]
    kill(topic)
    assert tails == [5, 5]  # fsynced at open (issue 48: the durable tail a reader saw never goes back)


# --- the durable tail --------------------------------------------------------------------------------


async def test_the_durable_tail_follows_the_rounds_and_stops_at_a_failed_one(tmp_path, monkeypatch):
    topic = open_topic(tmp_path, mem_queue_size=0)
    log = topic.log
    assert log is not None
    topic.get_channel("c")
    topic.publish([b"a", b"b"])
    assert (log.durable_tail.position, log.durable_tail.index) == (0, 0)  # written, not fsynced
    await topic.group.sync_round()
    assert (log.durable_tail.position, log.durable_tail.index) == (log.segments.tail, 2)
    synced = log.durable_tail
    topic.publish([b"c"])

    def eio(fd: int) -> None:
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(os, "fsync", eio)
    with pytest.raises(BackendError):
        await topic.group.sync_round()
    monkeypatch.undo()
    topic.publish([b"d"])
    await topic.group.sync_round()
    assert log.durable_tail == synced  # c's fsync failed: nothing past it is served until a restart
    kill(topic)
    topic = open_topic(tmp_path, mem_queue_size=0)
    assert topic.log is not None and topic.log.durable_tail.index == 4  # the files as they are, read again
    kill(topic)
