"""A segment's start is known at open (issue 48, after parts B and C): each side file begins with a header
that records its segment's start position, first index and the log's epoch before the segment gets its
first record. A segment the metadata does not name yet (a roll since its last write) takes its start from
there: a kill -9 keeps every position and every key exactly; a power loss that cut the segment before it
leaves a gap up to the recorded start, never a shift. A segment missing below one that is there (POSIX
orders no two names without a directory fsync) is a gap that readers skip, and no key is kept for
records that may have begun in it."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import trio
import trio.testing

from trio_nsq.broker.storage import files
from trio_nsq.broker.topic import Topic
from tests.power_loss import PowerLoss, power_loss  # noqa: F401 (the fixture)
from tests.test_recovery_edges import bodies, open_topic, publish_once
from tests.topic_owner import drain, kill

OPTIONS = dict(mem_queue_size=0, max_bytes_per_file=400)
PLAIN, A_MSGS, B_MSGS = bodies("p", 3), bodies("a", 3), bodies("b", 12)


def served(topic: Topic) -> dict[int, bytes]:
    """Every record of the log by position, as /log/read serves them (from the log's first position)."""
    assert topic.log is not None
    segments = topic.log.segments
    reader = segments.reader(segments.start, segments.start_index())
    positions: list[int] = []
    records: list[bytes] = []
    try:
        while more := reader.read(1000, segments.tail, positions):  # a call stops where records were lost
            records += more
    finally:
        reader.close()
    return {pos: record[26:] for pos, record in zip(positions, records)}  # the bodies (26: a message's header)


async def keys_across_a_roll(data: str, clock: trio.testing.MockClock, *, round_first: bool = True,
                             round_last: bool = False) -> tuple[Topic, int, dict[int, bytes]]:
    """Three plain messages (a round: the metadata names segment 0), KA's 3 and KB's 12 (KB rolls to
    segment 1; its first 4 messages end segment 0), journalled with where they end, no round since."""
    topic = open_topic(data, clock, **OPTIONS)
    topic.publish(PLAIN)
    if round_first:
        await topic.group.sync_round()
    await publish_once(topic, "KA", A_MSGS)
    await publish_once(topic, "KB", B_MSGS)
    if round_last:
        await topic.group.sync_round()
    assert topic.log is not None
    segments = topic.log.segments
    assert segments.write_file_num == 1
    if not round_last:
        assert topic.idempotency._at == {"KA": 6 * 39, "KB": segments.tail}
    return topic, segments.start_of(1), served(topic)


async def reopened(data: str, clock: trio.testing.MockClock) -> tuple[int, set[str], list[bytes], dict[int, bytes]]:
    """After the restart: segment 1's start, the keys kept, what channel `c` delivers, what the log serves."""
    topic = open_topic(data, clock, **OPTIONS)
    try:
        assert topic.log is not None
        return (topic.log.segments.start_of(1), set(topic.idempotency.keys), drain(topic.get_channel("c")),
                served(topic))
    finally:
        kill(topic)


def test_side_files_begin_with_their_segments_start(tmp_path):
    """The header is there before the segment's first record, and says where the segment starts."""
    from trio_nsq.broker.storage.checksums import HEADER, MAGIC  # (not on main: this test fails there)
    clock = trio.testing.MockClock()
    topic, start1, _ = trio.run(keys_across_a_roll, str(tmp_path), clock, clock=clock)
    assert topic.log is not None
    epoch = topic.log.segments.epoch
    kill(topic)
    for num, start, index in ((0, 0, 0), (1, start1, 3 + 3 + 4)):
        header = (tmp_path / f"t.diskqueue.{num:06d}.crc").read_bytes()[:HEADER.size]
        magic, found_epoch, found_num, found_start, found_index, _, _ = HEADER.unpack(header)
        assert (magic, found_epoch, found_num, found_start, found_index) == (MAGIC, epoch, num, start, index)


def test_a_kill_right_after_a_roll_keeps_every_key_and_every_position(tmp_path):
    """Problem 2 of part F: default flags, a kill -9 within the metadata's interval after a roll (the page
    cache kept, no round since): segment 1 keeps its start, every record its position, both keys are kept
    (on main segment 1 started past a gap, so KB's position fell in it and the key was dropped: a retry
    duplicated its 16 messages)."""
    clock = trio.testing.MockClock()
    data = str(tmp_path)
    topic, start1, before = trio.run(keys_across_a_roll, data, clock, clock=clock)
    kill(topic)
    new_start1, keys, delivered, after = trio.run(reopened, data, clock, clock=clock)
    assert keys == {"KA", "KB"}
    assert new_start1 == start1
    assert delivered == PLAIN + A_MSGS + B_MSGS
    assert after == before


def test_a_kill_before_the_first_round_keeps_every_position(tmp_path):
    """The same with no metadata yet (a kill -9 before the log's first round): the side files' epoch is
    the log's, and segment 1 keeps its recorded start."""
    clock = trio.testing.MockClock()
    data = str(tmp_path)

    async def before() -> tuple[Topic, int, dict[int, bytes]]:
        return await keys_across_a_roll(data, clock, round_first=False)
    topic, start1, served_before = trio.run(before, clock=clock)
    kill(topic)
    assert not (tmp_path / "t.diskqueue.meta.dat").exists()
    new_start1, keys, _, after = trio.run(reopened, data, clock, clock=clock)  # (no cursor file for `c` yet)
    assert new_start1 == start1
    assert keys == {"KA", "KB"}
    assert after == served_before


def sync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def test_a_power_loss_that_cut_a_segment_leaves_a_gap_up_to_the_next_ones_recorded_start(power_loss):
    """A power loss cut segment 0 at a record boundary (its fsynced end: KA's messages and KB's first 4
    lost) while segment 1, its side file and both names are durable: segment 1 starts where it was
    recorded (a gap before it, not a shift: on main it started past a floor), its records keep their
    positions, and neither key is kept (KA's messages are gone, KB's first ones too)."""
    clock = trio.testing.MockClock()
    data = power_loss.data_dir
    topic, start1, before = trio.run(keys_across_a_roll, data, clock, clock=clock)
    files.fsync_dir(data)
    for name in ("t.diskqueue.000001.dat", "t.diskqueue.000001.crc"):
        sync_file(Path(data) / name)
    kill(topic)
    power_loss.crash("strict")
    assert (Path(data) / "t.diskqueue.000000.dat").stat().st_size == 3 * 39  # cut at the round's end

    new_start1, keys, delivered, after = trio.run(reopened, data, clock, clock=clock)
    assert new_start1 == start1
    assert keys == set()
    assert delivered == PLAIN + B_MSGS[4:]
    assert after == {pos: body for pos, body in before.items() if body in PLAIN or pos >= start1}


def lose_segment_0(data: Path) -> None:
    """What a power loss leaves when segment 1's name was durable and segment 0's was not."""
    for name in ("t.diskqueue.000000.dat", "t.diskqueue.000000.crc"):
        os.remove(data / name)


def test_a_missing_first_segment_without_metadata_is_not_renumbered(tmp_path):
    """Part E's finding, no metadata yet: segment 0's name was lost, segment 1's kept. Segment 1 keeps its
    recorded start (on main it was renumbered to start at 0: KA's position landed inside KB's records
    and KA was kept with its messages gone), and no key is kept for records that began in segment 0."""
    clock = trio.testing.MockClock()

    async def before() -> tuple[Topic, int, dict[int, bytes]]:
        return await keys_across_a_roll(str(tmp_path), clock, round_first=False)
    topic, start1, served_before = trio.run(before, clock=clock)
    kill(topic)
    lose_segment_0(tmp_path)
    new_start1, keys, _, after = trio.run(reopened, str(tmp_path), clock, clock=clock)  # (no cursor file yet)
    assert keys == set()
    assert new_start1 == start1
    assert after == {pos: body for pos, body in served_before.items() if pos >= start1}


def test_a_reader_skips_a_missing_lower_segment(tmp_path, caplog):
    """Part E's finding with the metadata durable (it names segments 0 and 1), segment 0's name lost: a
    channel whose cursor is in segment 0 reads on from segment 1's start (go-diskqueue does so when its
    read file is gone, with one ERROR line), and no key is kept for records that began in segment 0."""
    clock = trio.testing.MockClock()

    async def before() -> tuple[Topic, int, dict[int, bytes]]:
        return await keys_across_a_roll(str(tmp_path), clock, round_last=True)
    topic, start1, served_before = trio.run(before, clock=clock)
    kill(topic)
    assert "segments 0:0:0 1:10:" in (tmp_path / "t.diskqueue.meta.dat").read_text()
    lose_segment_0(tmp_path)
    with caplog.at_level(logging.WARNING, logger="nsqd"):
        new_start1, keys, delivered, after = trio.run(reopened, str(tmp_path), clock, clock=clock)
    assert delivered == B_MSGS[4:]
    assert new_start1 == start1
    assert keys == set()
    assert after == {pos: body for pos, body in served_before.items() if pos >= start1}
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    # one line per reader: the channel's, and the one that read the log by position
    assert len(errors) == 2 and all("t.diskqueue.000000.dat is missing, reading on" in e for e in errors), errors


def test_the_metadata_never_names_a_segment_a_power_loss_lost(tmp_path):
    """A round after a roll fsyncs the directory before it renames the log's metadata into place: in no
    crash state does the metadata name a segment holding records whose name is gone (on main the rename
    could be durable while segment 0's creation was not: its readers then met a missing file)."""
    checked = 0
    for state in _crash_states_of_k(tmp_path, (PLAIN, None), (A_MSGS, "KA"), (B_MSGS, "KB")):  # B rolls to 1
        found = dict(state)
        meta = found.get("k.diskqueue.meta.dat")
        if not meta:
            continue
        lines = meta.decode().split("\n")
        write_num, write_pos = (int(x) for x in lines[2].split(","))
        named = [int(entry.split(":")[0]) for line in lines if line.startswith("segments ")
                 for entry in line[len("segments "):].split(" ") if entry]
        for num in named:
            if num < write_num or write_pos > 0:
                assert f"k.diskqueue.{num:06d}.dat" in found, (num, meta, sorted(found))
                checked += 1
    assert checked > 0


def test_the_metadata_never_says_a_channels_messages_were_handed_to_it_without_its_cursor(tmp_path):
    """A channel made, messages handed to it, the first round: its first cursor file is made durable
    before the topic's metadata (which says "dispatched all") is renamed into place. On main both renames
    shared one directory fsync: a power loss could keep the metadata and not the cursor's name, and the
    channel, found without a cursor, started where everything was handed already (part E's "audit
    delivers none of k-B-5..15")."""
    checked = 0
    for state in _crash_states_of_k(tmp_path, (PLAIN, None)):
        found = dict(state)
        meta = found.get("k.diskqueue.meta.dat")
        if meta and b"\ndispatched all\n" in meta and meta.startswith(b"3\n"):  # 3 records, all handed
            assert "k:audit.cursor.dat" in found, sorted(found)
            checked += 1
    assert checked > 0


def _crash_states_of_k(tmp_path: Path, *publishes: tuple[list[bytes], str | None]) -> Any:
    """Every crash state (tests/crash_states.py) of: topic k and its channel audit made, `publishes`
    (bodies, key) in turn, then k's sync round."""
    from tests.crash_states import crash_states, record

    async def scenario(w: Any) -> None:
        await w.create_topic("k")
        await w.create_channel("k", "audit")
        for messages, key in publishes:
            await w.publish("k", messages, key=key)
        await w.nsqd.topics["k"].group.sync_round()
    return crash_states(record(str(tmp_path / "record"), scenario, dict(OPTIONS))).states
