"""A topic's log read by position (storage/log_index.py, the storage under the HTTP log API), in process
under MockClock: every record read back across segments with its position, positions checked to be
record boundaries, limits by records and bytes, times, splits, the durable tail, deadlines, the log id,
and the topic that writes every message to its log once read by position (across a restart)."""

from __future__ import annotations

import random
import struct
from array import array
from pathlib import Path
from typing import Any

import pytest
import trio.testing

from tests.topic_owner import Owner, drain, kill
from trio_nsq.broker.storage.log_index import INTERVAL, LogIndex, PositionError
from trio_nsq.broker.storage.segment_log import Place
from trio_nsq.broker.topic import Topic


def open_topic(d: Path, clock: trio.testing.MockClock | None = None, **options: Any) -> Topic:
    return Topic(Owner(d, clock, **options), "t")  # type: ignore[arg-type]


def read_all(index: LogIndex, first: Place, end: Place, max_bytes: int = 4096) -> list[tuple[int, bytes]]:
    """(position, record) of everything from `first` to `end`, read as a client does: from each answer's
    next position."""
    out = []
    place = first
    while place.position < end.position:
        block = index.read(place, end, end.position, max_bytes)
        assert block.position == place.position
        starts = list(block.starts)
        assert starts[0] == 0 and starts[-1] == block.size == sum(4 + struct.unpack_from(">i", block.data, s)[0] for s in starts[:-1])
        for a, b in zip(starts, starts[1:]):
            out.append((block.position + a, block.data[a + 4:b]))
        assert block.next > place.position
        place = Place(block.next, block.next_index)
    return out


def published(n: int, seed: int = 1) -> list[bytes]:
    rng = random.Random(seed)
    return [b"%06d-" % i + b"x" * rng.randrange(0, 700) for i in range(n)]


async def test_every_record_is_read_back_across_segments_with_positions_that_locate(tmp_path):
    topic = open_topic(tmp_path, mem_queue_size=0, max_bytes_per_file=20_000)
    log_ = topic.log
    assert log_ is not None
    bodies = published(600)
    for at in range(0, 600, 50):
        topic.publish(bodies[at:at + 50])
    await topic.group.sync_round()
    assert log_.segments.write_file_num >= 10  # many segments
    end = log_.durable_tail
    first = Place(log_.segments.start, log_.segments.start_index())
    got = read_all(log_.index, first, end, max_bytes=3000)
    assert [record[26:] for _, record in got] == bodies
    # each position is a boundary with its index, the bytes after one are not
    fresh = LogIndex(log_.segments)  # nothing walked yet: every check walks from a mark or a segment start
    for i, (pos, _) in enumerate(got):
        assert fresh.locate(pos, end) == Place(pos, i)
    for pos, _ in got[::37]:
        with pytest.raises(PositionError) as err:
            fresh.locate(pos + 1, end)
        assert err.value.code == "POSITION_NOT_A_RECORD"
    with pytest.raises(PositionError) as err:
        fresh.locate(end.position + 1, end)
    assert err.value.code == "POSITION_PAST_END"
    # the same range read twice: the same bytes
    assert read_all(LogIndex(log_.segments), first, end, max_bytes=10_000) == got
    kill(topic)


async def test_a_read_stops_at_a_record_boundary_within_its_limits(tmp_path):
    topic = open_topic(tmp_path, mem_queue_size=0)
    log_ = topic.log
    assert log_ is not None
    topic.publish([b"a" * 100] * 10 + [b"b" * 5000] + [b"c" * 10])
    await topic.group.sync_round()
    end = log_.durable_tail
    first = Place(0, 0)
    block = log_.index.read(first, end, end.position, 350)  # 130 bytes a record: two whole ones
    assert len(block) == 2 and block.size == 260 and block.next == 260 and block.next_index == 2
    # an `end` inside a record: the record is not returned
    block = log_.index.read(first, end, 300, 1 << 20)
    assert len(block) == 2
    # a limit below one record (even below its size prefix) still gives one record
    for tiny in (1, 3, 4, 100):
        block = log_.index.read(first, end, end.position, tiny)
        assert len(block) == 1 and block.size == 130
    # one record larger than the byte limit comes alone
    big = Place(1300, 10)
    block = log_.index.read(big, end, end.position, 100)
    assert len(block) == 1 and block.size == 4 + 26 + 5000
    # at the end: nothing, and the next position stays
    block = log_.index.read(end, end, end.position, 100)
    assert len(block) == 0 and block.next == end.position
    kill(topic)


async def test_nothing_past_the_durable_tail_is_served(tmp_path):
    topic = open_topic(tmp_path, mem_queue_size=0)
    log_ = topic.log
    assert log_ is not None
    topic.publish([b"one", b"two"])
    await topic.group.sync_round()
    end = log_.durable_tail
    topic.publish([b"three"])  # written, not fsynced yet
    assert log_.segments.tail > end.position == log_.durable_tail.position
    assert [r[26:] for _, r in read_all(log_.index, Place(0, 0), log_.durable_tail)] == [b"one", b"two"]
    with pytest.raises(PositionError) as err:
        log_.index.locate(log_.segments.tail, log_.durable_tail)
    assert err.value.code == "POSITION_PAST_END"
    await topic.group.sync_round()
    assert [r[26:] for _, r in read_all(log_.index, Place(0, 0), log_.durable_tail)] == [b"one", b"two", b"three"]
    kill(topic)


async def test_limits_by_records_and_bytes_and_splits_are_record_boundaries(tmp_path):
    topic = open_topic(tmp_path, mem_queue_size=0, max_bytes_per_file=300_000)
    log_ = topic.log
    assert log_ is not None
    bodies = published(3000, seed=2)
    topic.publish(bodies)
    await topic.group.sync_round()
    end = log_.durable_tail
    first = Place(0, 0)
    positions = [pos for pos, _ in read_all(log_.index, first, end, 1 << 20)] + [end.position]
    index = LogIndex(log_.segments)
    for start in (0, 17, 1500, 2999):
        place = Place(positions[start], start)
        for records in (1, 10, 999, 10_000):
            after = index.after(place, end, records, 1 << 62)
            assert after.index == min(3000, start + records) and after.position == positions[after.index]
        for max_bytes in (1, 5000, 100_000, 1 << 30):
            after = index.after(place, end, 1 << 62, max_bytes)
            # the last boundary within the bytes (one record at least)
            within = [i for i in range(start + 1, 3001) if positions[i] - positions[start] <= max_bytes]
            assert after.index == (within[-1] if within else start + 1)
    cuts = index.splits(first, end, end.position, 4)
    assert len(cuts) == 3 and cuts == sorted(cuts) and set(cuts) <= set(positions)
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [end.position])]
    assert max(sizes) - min(sizes) <= 2 * INTERVAL + 1000
    assert index.splits(first, end, end.position, 1) == []
    kill(topic)


async def test_the_first_record_at_or_after_a_time(tmp_path, mock_clock):
    topic = open_topic(tmp_path, clock=mock_clock, mem_queue_size=0, max_bytes_per_file=50_000)
    log_ = topic.log
    assert log_ is not None
    mock_clock.jump(1_000_000)
    for second in range(100):
        topic.publish([b"s%03d-%d" % (second, i) + b"y" * 300 for i in range(20)])
        mock_clock.jump(1)
    await topic.group.sync_round()
    end = log_.durable_tail
    records = read_all(log_.index, Place(0, 0), end, 1 << 20)
    for second in (0, 1, 37, 99):
        ns = int((1_000_000 + second) * 1e9)
        place = LogIndex(log_.segments).at_time(ns, end, log_.first_stamp)
        assert place.index == second * 20 and place.position == records[second * 20][0]
    assert log_.index.at_time(int(2_000_000 * 1e9), end, log_.first_stamp) == end
    assert log_.index.at_time(0, end, log_.first_stamp) == Place(0, 0)
    kill(topic)


async def test_deadlines_of_deferred_records_are_found_by_position(tmp_path, mock_clock):
    topic = open_topic(tmp_path, clock=mock_clock, mem_queue_size=0)
    log_ = topic.log
    assert log_ is not None
    topic.publish([b"now-%d" % i for i in range(5)])
    topic.publish([b"later-%d" % i for i in range(3)], 60.0)
    topic.publish([b"after"])
    await topic.group.sync_round()
    end = log_.durable_tail
    records = read_all(log_.index, Place(0, 0), end)
    found = log_.deadlines_between(0, end.position)
    assert [pos for pos, _ in found] == [pos for pos, _ in records[5:8]]
    assert {round(d) for _, d in found} == {round(mock_clock.current_time() + 60)}
    assert log_.deadlines_between(records[6][0], records[7][0]) == found[1:2]
    kill(topic)


async def test_a_topic_read_by_position_writes_every_message_to_its_log_and_remembers_it(tmp_path):
    topic = open_topic(tmp_path)  # default --mem-queue-size: messages go through memory
    log_ = topic.log
    assert log_ is not None
    channel = topic.get_channel("c")
    topic.publish([b"before"])
    assert log_.segments.tail == 0  # in memory only
    topic.publish([b"waiting"])
    topic.keep_whole_log()
    topic.publish([b"after-%d" % i for i in range(3)])
    await topic.group.sync_round()
    got = [r[26:] for _, r in read_all(log_.index, Place(0, 0), log_.durable_tail)]
    assert got[-3:] == [b"after-0", b"after-1", b"after-2"]
    assert len(drain(channel)) == 5  # the channel gets each message once either way
    log_id = log_.log_id
    assert log_.epoch_on_disk
    await topic.close()
    topic = open_topic(tmp_path)
    assert topic.log is not None and topic.log.positional and topic.retains
    assert topic.log.log_id == log_id and topic.log.epoch_on_disk
    topic.publish([b"again"])
    assert topic.log.segments.tail > 0 and not topic.memory
    kill(topic)


async def test_a_log_made_again_has_another_id_and_old_positions_go(tmp_path):
    topic = open_topic(tmp_path, mem_queue_size=0, max_bytes_per_file=1000)
    log_ = topic.log
    assert log_ is not None
    assert not log_.epoch_on_disk  # a new log: its id is not on disk before a round writes the metadata
    topic.publish([b"z" * 200] * 20)
    channel = topic.get_channel("c")
    topic.dispatch()
    await topic.group.sync_round()
    assert log_.epoch_on_disk
    first_id = log_.log_id
    assert len(drain(channel)) == 20
    await topic.group.sync_round()  # every channel is past the first segments: they go
    assert log_.segments.start > 0
    with pytest.raises(PositionError) as err:
        log_.index.locate(0, log_.durable_tail)
    assert err.value.code == "POSITION_GONE"
    topic.delete()
    kill(topic)
    topic = open_topic(tmp_path, mem_queue_size=0)
    assert topic.log is not None and topic.log.log_id != first_id
    kill(topic)


def test_the_offsets_trailer_is_what_arrow_takes():
    starts = array("i", [0, 30, 70])
    assert starts.tobytes() == struct.pack("<3i", 0, 30, 70)


async def test_marks_and_splits_depend_on_the_records_only_not_on_how_the_log_was_walked(tmp_path):
    """A replayed micro-batch is cut at the same places after a broker restart (its index built again,
    from other starting points): a mark is the first record at or past each multiple of INTERVAL."""
    topic = open_topic(tmp_path, mem_queue_size=0, max_bytes_per_file=1_000_000)
    log_ = topic.log
    assert log_ is not None
    topic.publish(published(4000, seed=3))
    await topic.group.sync_round()
    end = log_.durable_tail
    first = Place(0, 0)
    scanned = LogIndex(log_.segments)
    cuts = scanned.splits(first, end, end.position, 7)
    by_reads = LogIndex(log_.segments)
    read_all(by_reads, first, end, max_bytes=12_345)  # marks made while reading, in odd-sized blocks
    located = LogIndex(log_.segments)
    records = read_all(LogIndex(log_.segments), first, end, 1 << 20)
    located.locate(records[2500][0], end)  # a scan from the segment start to there, then on
    for index in (by_reads, located):
        assert index.splits(first, end, end.position, 7) == cuts
    for num, marks in scanned._marks.items():
        assert list(by_reads._marks[num].positions) == list(marks.positions)
        assert all((p - marks.base) % INTERVAL < 1000 for p in marks.positions)  # just past a multiple
    kill(topic)


async def test_a_log_read_by_position_marks_what_it_appends_as_a_walk_would(tmp_path):
    """Once the index exists, appends mark their records: splits and checks of what was written since
    walk nothing again, and the marks are the ones a walk of the files makes."""
    topic = open_topic(tmp_path, mem_queue_size=0, max_bytes_per_file=300_000)
    log_ = topic.log
    assert log_ is not None
    topic.publish(published(300, seed=4))  # before any positional reader: not marked at append
    await topic.group.sync_round()
    index = log_.index
    end = log_.durable_tail
    index.splits(Place(0, 0), end, end.position, 2)  # walks what is there
    for at in range(0, 3000, 250):
        topic.publish(published(250, seed=at)[:250])
    topic.publish([b"deferred"] * 3, 30.0)
    await topic.group.sync_round()
    end = log_.durable_tail
    assert log_.segments.write_file_num >= 3
    for num in log_.segments.segments():
        assert index._marks[num].scanned == log_.index._records_end(num)  # walked to the end by the appends
    fresh = LogIndex(log_.segments)
    assert fresh.splits(Place(0, 0), end, end.position, 5) == index.splits(Place(0, 0), end, end.position, 5)
    for num, marks in fresh._marks.items():
        mine = index._marks[num]
        assert (list(mine.positions), list(mine.indices), list(mine.stamps)) == \
            (list(marks.positions), list(marks.indices), list(marks.stamps))
        assert (mine.scanned, mine.scanned_index, mine.last) == (marks.scanned, marks.scanned_index, marks.last)
    kill(topic)
