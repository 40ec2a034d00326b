"""Recovery at open after a crash (issue 48, findings 2, 3, 4, 7 and the minor one), in process under the
power-loss harness (tests/power_loss.py): a torn segment is a gap of positions, never a shift of the
next segment's; an Idempotency-Key is kept only with its messages (across a power loss, a clean exit
whose flush failed, the journal's own creation); a deadline attaches only to its own record; the
durable tail a reader was shown does not go back after a kill -9; a cut made at open stays cut."""

from __future__ import annotations

import errno
import logging
import os
import struct
from pathlib import Path
from typing import Any

import trio
import trio.testing

from trio_nsq.broker.storage import files
from trio_nsq.broker.topic import Topic
from tests.power_loss import PowerLoss, power_loss  # noqa: F401 (the fixture)
from tests.topic_owner import Owner, drain, kill


def open_topic(data: str, clock: trio.testing.MockClock, **options: Any) -> Topic:
    """The topic and its channel `c`, as nsqd.dat brings them back."""
    topic = Topic(Owner(data, clock, **options), "t")  # type: ignore[arg-type]
    topic.get_channel("c")
    return topic


def bodies(prefix: str, n: int) -> list[bytes]:
    """Bodies of 9 bytes: records of 39 bytes (4 + 26 + 9)."""
    return [f"{prefix}{i:08d}".encode()[-9:] for i in range(n)]


async def publish_once(topic: Topic, key: str, msgs: list[bytes]) -> None:
    """What POST /mpub with an Idempotency-Key does (broker/http/endpoints.py's _publish_now)."""
    async def publish() -> tuple[bool, int | None]:
        published = topic.publish(msgs)
        assert topic.log is not None
        end = topic.log.segments.tail if published.in_log else None
        if published.sync is not None:
            await published.sync.sync()
        return published.all_durable, end
    await topic.idempotency.publish_once(key, publish)


def test_a_torn_segment_leaves_a_gap_and_a_key_of_lost_messages_is_not_kept(tmp_path):
    """Finding 2: segment 0 torn by a power loss inside KA's messages, segment 1 (KB's, after a roll
    since the last metadata write) there: segment 1 must not move down over the lost positions, and KA
    is kept only if its messages are delivered. Over 40 seeds of the prefix mode (where the unsynced
    tails are cut differs with each), at least one of which tears segment 0 inside KA's messages."""
    clock = trio.testing.MockClock()
    options = dict(mem_queue_size=0, max_bytes_per_file=400)
    a_msgs, b_msgs = bodies("a", 3), bodies("b", 16)
    torn_inside_ka = 0
    for seed in range(40):
        data = tmp_path / f"seed{seed}"
        data.mkdir()
        with PowerLoss(data, seed=seed) as disk:
            async def before() -> tuple[Topic, int, int]:
                topic = open_topic(str(data), clock, **options)
                topic.publish(bodies("p", 3))
                await topic.group.sync_round()
                await publish_once(topic, "KA", a_msgs)
                await publish_once(topic, "KB", b_msgs)  # rolls to segment 1
                assert topic.log is not None
                segments = topic.log.segments
                assert segments.write_file_num == 2
                assert topic.idempotency._at == {"KA": 6 * 39, "KB": segments.tail}
                return topic, segments.start_of(1), segments.tail
            topic, start1, tail = trio.run(before, clock=clock)
            files.fsync_dir(str(data))  # another topic's round does this in life: segment 1's name is durable
            kill(topic)
            disk.crash("prefix")
            seg0 = data / "t.diskqueue.000000.dat"
            torn_inside_ka += 117 < seg0.stat().st_size < 117 + 3 * 39

            async def after() -> tuple[set[str], list[bytes], int]:
                topic = open_topic(str(data), clock, **options)
                try:
                    assert topic.log is not None
                    return (set(topic.idempotency.keys), drain(topic.get_channel("c")),
                            topic.log.segments.start_of(1))
                finally:
                    kill(topic)
            keys, delivered, new_start1 = trio.run(after, clock=clock)
        if "KA" in keys:
            assert set(a_msgs) <= set(delivered), f"seed {seed}: KA kept, its messages lost"
        if "KB" in keys:
            assert set(b_msgs) <= set(delivered), f"seed {seed}: KB kept, its messages lost"
        # a position given before the crash is never given to another record: segment 1 does not move down
        assert new_start1 >= start1, (seed, new_start1, start1)
    assert torn_inside_ka, "no seed tore segment 0 inside KA's messages: the recipe's state was not checked"


_DEADLINE = struct.Struct(">qd16s")


def test_a_deadline_attaches_only_to_the_record_with_its_message_id(tmp_path):
    """Finding 2, _load_deadlines: an entry names a position and a message id; a record at that position
    with another id (a position given again after a loss) is not deferred by it."""
    clock = trio.testing.MockClock()
    data = str(tmp_path)

    async def write() -> tuple[Topic, list[int]]:
        topic = open_topic(data, clock, mem_queue_size=0)
        assert topic.log is not None
        await topic.group.sync_round()  # the channel's cursor and the metadata: the records come after
        topic.publish(bodies("m", 3))
        return topic, [topic.log.segments.start_of(0) + 39 * i for i in range(3)]
    topic, positions = trio.run(write, clock=clock)
    kill(topic)
    with open(tmp_path / "t.diskqueue.deadlines.000000.dat", "wb") as fh:
        fh.write(_DEADLINE.pack(positions[1], clock.current_time() + 3600, b"f" * 16))  # another message's id

    async def after() -> list[bytes]:
        topic = open_topic(data, clock, mem_queue_size=0)
        try:
            return drain(topic.get_channel("c"))
        finally:
            kill(topic)
    assert trio.run(after, clock=clock) == bodies("m", 3)


def test_a_clean_exit_does_not_journal_a_key_whose_messages_failed_to_flush(tmp_path, monkeypatch, caplog):
    """Finding 3: default flags, the key's message in memory; at the exit the flush to the log fails
    (a full disk: the log's segment writes fail, so its append raises BackendError): the key must not be kept
    (a retry then publishes again)."""
    clock = trio.testing.MockClock()
    data = str(tmp_path)

    real_write, real_writev = os.write, os.writev

    def segment(fd: int) -> bool:
        name = os.readlink(f"/proc/self/fd/{fd}")
        return ".diskqueue." in name and name.endswith(".dat")

    def full_write(fd: int, data: Any) -> int:
        if segment(fd):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    def full_writev(fd: int, buffers: Any) -> int:
        if segment(fd):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_writev(fd, buffers)

    async def run() -> None:
        topic = open_topic(data, clock)
        await publish_once(topic, "K1", [b"message-1"])
        assert topic.memory and "K1" in topic.idempotency.keys
        with monkeypatch.context() as patch:
            # looked up on the os module when called, compiled or not (a batch is one write, a long run writev)
            patch.setattr(os, "writev", full_writev)
            patch.setattr(os, "write", full_write)
            await topic.close()
    with caplog.at_level(logging.ERROR, logger="nsqd"):
        trio.run(run, clock=clock)
    assert any("failed to flush 1 of 1 messages" in r.getMessage() for r in caplog.records)

    async def after() -> tuple[bool, list[bytes]]:
        topic = open_topic(data, clock)
        try:
            return "K1" in topic.idempotency.keys, drain(topic.get_channel("c"))
        finally:
            kill(topic)
    kept, delivered = trio.run(after, clock=clock)
    assert not kept or delivered == [b"message-1"], (kept, delivered)


def test_the_idempotency_journal_name_is_durable_with_its_first_key(power_loss):
    """Finding 4: --mem-queue-size=0 --sync-every=1: the key is journalled and fsynced after its
    message's round; the journal's creation must be durable too: after a power loss, key and message
    are both there, or neither."""
    clock = trio.testing.MockClock()
    data = power_loss.data_dir
    options = dict(mem_queue_size=0, sync_every=1)

    async def run() -> Topic:
        topic = open_topic(data, clock, **options)
        await publish_once(topic, "K1", [b"message-1"])
        assert topic.idempotency._durable == {"K1"}
        return topic
    kill(trio.run(run, clock=clock))
    power_loss.crash("strict")

    async def after() -> tuple[bool, list[bytes]]:
        topic = open_topic(data, clock, **options)
        try:
            return "K1" in topic.idempotency.keys, drain(topic.get_channel("c"))
        finally:
            kill(topic)
    kept, delivered = trio.run(after, clock=clock)
    assert (kept, delivered) in ((True, [b"message-1"]), (False, [])), (kept, delivered)


def test_the_durable_tail_does_not_go_back_after_a_kill(power_loss):
    """Finding 7: the durable tail a reader was shown (/log/positions `end`) is where the log still ends
    after a kill -9 (page cache kept), not the older write position the metadata holds; records recovered
    past it are fsynced at open, so it stays true through a power loss after the restart."""
    clock = trio.testing.MockClock()
    data = power_loss.data_dir
    options = dict(mem_queue_size=0)

    async def before() -> tuple[Topic, int]:
        topic = open_topic(data, clock, **options)
        assert topic.log is not None
        topic.publish(bodies("a", 3))
        await topic.group.sync_round()
        topic.publish(bodies("b", 3))
        await topic.group.sync_round()  # the metadata is not written again within META_INTERVAL
        shown = topic.log.durable_tail.position
        assert shown == topic.log.segments.tail
        topic.publish(bodies("c", 2))  # written, no round: not durable, not shown
        return topic, shown
    topic, shown = trio.run(before, clock=clock)
    kill(topic)

    async def reopen() -> tuple[int, int]:
        topic = open_topic(data, clock, **options)
        try:
            assert topic.log is not None
            return topic.log.durable_tail.position, topic.log.segments.tail
        finally:
            kill(topic)
    durable, tail = trio.run(reopen, clock=clock)
    assert durable >= shown, (durable, shown)
    assert durable == tail  # everything the kill left was fsynced at open
    power_loss.crash("strict")

    async def after() -> list[bytes]:
        topic = open_topic(data, clock, **options)
        try:
            return drain(topic.get_channel("c"))
        finally:
            kill(topic)
    assert trio.run(after, clock=clock) == bodies("a", 3) + bodies("b", 3) + bodies("c", 2)


async def _synced_then_rolled(data: str, clock: trio.testing.MockClock, options: dict[str, int], rolled: int) -> Topic:
    """Topic t with 3 records fsynced by a round, then `rolled` more that fill segment 0 (400 bytes) and
    roll to segment 1, with no round since."""
    topic = open_topic(data, clock, **options)
    topic.publish(bodies("a", 3))
    await topic.group.sync_round()
    topic.publish(bodies("b", rolled))
    return topic


def test_a_cut_made_at_open_survives_another_power_loss(power_loss, caplog):
    """Minor: a torn tail cut at open in a file that recovered no records must stay cut: a second power
    loss must not bring it back past a sealed segment's end (a read into it then fails)."""
    clock = trio.testing.MockClock()
    data = power_loss.data_dir
    options = dict(mem_queue_size=0, max_bytes_per_file=400)

    topic = trio.run(_synced_then_rolled, data, clock, options, 16, clock=clock)  # b not fsynced
    files.fsync_dir(data)
    kill(topic)
    power_loss.crash("zeros")  # the unsynced bytes of both segments read as zeros
    seg0 = Path(data) / "t.diskqueue.000000.dat"
    assert seg0.stat().st_size > 117

    async def second() -> Topic:
        topic = open_topic(data, clock, **options)  # cuts segment 0 at 117 (no record recovered)
        assert seg0.stat().st_size == 117
        published = topic.publish(bodies("c", 2))  # into segment 1: segment 0 is sealed
        assert published.count == 2
        await topic.group.sync_round()
        return topic
    kill(trio.run(second, clock=clock))
    power_loss.crash("strict")
    assert seg0.stat().st_size == 117  # the cut is durable

    async def third() -> list[bytes]:
        topic = open_topic(data, clock, **options)
        try:
            return drain(topic.get_channel("c"))
        finally:
            kill(topic)
    with caplog.at_level(logging.ERROR, logger="nsqd"):
        assert trio.run(third, clock=clock) == bodies("a", 3) + bodies("c", 2)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []



def test_deferred_records_of_a_segment_given_a_start_at_open_stay_deferred(tmp_path):
    """The other side of finding 2's gap: after a kill -9 (nothing lost) a segment the metadata did not
    name gets a start past the gap, so its deadline entries name old positions; they follow their
    message ids, and the deferred records stay deferred (passes on main too: a guard for the fix)."""
    clock = trio.testing.MockClock()
    data = str(tmp_path)
    options = dict(mem_queue_size=0, max_bytes_per_file=400)

    async def before() -> Topic:
        topic = open_topic(data, clock, **options)
        topic.publish(bodies("p", 3))
        await topic.group.sync_round()
        topic.publish(bodies("q", 8))  # fills segment 0, rolls: no round since
        topic.publish(bodies("d", 3), 3600.0)  # deferred, in segment 1
        topic.publish(bodies("r", 2))
        assert topic.log is not None and topic.log.segments.write_file_num == 1
        return topic
    kill(trio.run(before, clock=clock))

    async def after() -> tuple[list[bytes], list[bytes]]:
        topic = open_topic(data, clock, **options)
        try:
            channel = topic.get_channel("c")
            now = drain(channel)
            clock.jump(3601)
            channel.process_deferred_queue(trio.current_time())
            return now, drain(channel)
        finally:
            kill(topic)
    now, later = trio.run(after, clock=clock)
    assert now == bodies("p", 3) + bodies("q", 8) + bodies("r", 2)
    assert later == bodies("d", 3)


def test_a_position_served_after_a_kill_holds_its_record_through_a_later_power_loss(power_loss):
    """Finding 7's bound: the durable tail at open covers the recovered records of the segment the
    metadata names, not a segment given its start at this open (a later open, with another segment
    rolled since, may give it another start before the first round writes the metadata): every
    position served after the restart holds the same record after a power loss."""
    clock = trio.testing.MockClock()
    data = power_loss.data_dir
    options = dict(mem_queue_size=0, max_bytes_per_file=400)

    kill(trio.run(_synced_then_rolled, data, clock, options, 12, clock=clock))  # no round since b

    async def reopen() -> tuple[Topic, dict[int, bytes]]:
        topic = open_topic(data, clock, **options)
        assert topic.log is not None
        segments = topic.log.segments
        assert segments.write_file_num == 1
        reader = segments.reader(segments.start, segments.start_index())
        positions: list[int] = []
        records = reader.read(100, topic.log.durable_tail.position, positions)  # what /log/read serves
        reader.close()
        served = dict(zip(positions, records))
        assert len(served) >= 10  # segment 0's records, the recovered ones too
        topic.publish(bodies("c", 12))  # rolls to segment 2 (no round)
        return topic, served
    topic, served = trio.run(reopen, clock=clock)
    files.fsync_dir(data)  # another topic's round: segment 2's name is durable
    kill(topic)
    power_loss.crash("strict")

    async def after() -> dict[int, bytes]:
        topic = open_topic(data, clock, **options)
        try:
            assert topic.log is not None
            found: dict[int, bytes] = {}
            for pos in served:
                try:
                    found[pos] = topic.log.segments.read_at(pos)
                except (OSError, ValueError) as exc:
                    found[pos] = repr(exc).encode()
            return found
        finally:
            kill(topic)
    assert trio.run(after, clock=clock) == served
