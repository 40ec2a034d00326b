"""The power-loss harness (tests/power_loss.py) on plain file operations, through compiled broker code, and
under a topic: what a topic answered after its fsync round is there after a power loss, what it wrote
after its last round is not."""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import os
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_nsq import compiled
from trio_nsq.broker.storage import files, segment_log, sync_group
from trio_nsq.broker.storage.backend import BackendError
from trio_nsq.broker.topic import DEAD_LETTERS_CHANNEL, Topic
from tests.power_loss import Event, PowerLoss, power_loss, write  # noqa: F401 (the fixture)
from tests.topic_owner import Owner, kill

CLIENT = 1
def names(d: Path) -> list[str]:
    return sorted(os.listdir(d))


# --- file content ---------------------------------------------------------------------------------


def test_what_was_there_at_the_start_is_durable(tmp_path):
    (tmp_path / "old").write_bytes(b"before")
    with PowerLoss(tmp_path) as disk:
        disk.crash()
    assert (tmp_path / "old").read_bytes() == b"before"


def test_an_append_survives_once_fsynced_and_not_before(power_loss):
    d = Path(power_loss.data_dir)
    f = d / "f"
    write(f, b"one")
    files.fsync_dir(str(d))
    write(f, b"two")
    write(f, b"three", fsync=False)
    assert f.read_bytes() == b"onetwothree"  # the page cache has it all
    power_loss.crash("strict")
    assert f.read_bytes() == b"onetwo"


def test_fdatasync_and_pwrite_count_too(power_loss):
    d = Path(power_loss.data_dir)
    fd = os.open(d / "f", os.O_RDWR | os.O_CREAT, 0o600)
    os.pwrite(fd, b"abc", 0)
    os.fdatasync(fd)
    os.pwrite(fd, b"def", 3)
    os.close(fd)
    files.fsync_dir(str(d))
    assert power_loss.durable(d / "f") == b"abc"
    power_loss.crash()
    assert (d / "f").read_bytes() == b"abc"


def test_a_new_name_needs_its_directory_fsynced(power_loss):
    d = Path(power_loss.data_dir)
    write(d / "kept", b"k")
    files.fsync_dir(str(d))
    write(d / "lost", b"fsynced, but its name never was")
    assert power_loss.durable_names() == ["kept"]
    power_loss.crash()
    assert names(d) == ["kept"]


def test_a_file_named_but_never_fsynced_comes_back_empty(power_loss):
    d = Path(power_loss.data_dir)
    write(d / "f", b"data", fsync=False)
    files.fsync_dir(str(d))
    power_loss.crash()
    assert (d / "f").read_bytes() == b""


def test_a_rename_over_a_file_is_undone_without_a_directory_fsync(tmp_path):
    (tmp_path / "meta").write_bytes(b"v1")
    with PowerLoss(tmp_path) as disk:
        files.write_synced(str(tmp_path / "meta.tmp"), b"v2")
        os.rename(tmp_path / "meta.tmp", tmp_path / "meta")
        assert (tmp_path / "meta").read_bytes() == b"v2"
        disk.crash()
        assert names(tmp_path) == ["meta"]
        assert (tmp_path / "meta").read_bytes() == b"v1"
        # the same with the directory fsynced after the rename: done
        files.write_synced(str(tmp_path / "meta.tmp"), b"v3")
        os.replace(tmp_path / "meta.tmp", tmp_path / "meta")
        files.fsync_dir(str(tmp_path))
        disk.crash()
        assert names(tmp_path) == ["meta"]
        assert (tmp_path / "meta").read_bytes() == b"v3"


def test_a_removed_file_comes_back_without_a_directory_fsync(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(name.encode() * 3)
    with PowerLoss(tmp_path) as disk:
        os.remove(tmp_path / "a")
        os.unlink(tmp_path / "b")
        disk.crash()
        assert names(tmp_path) == ["a", "b"]
        assert (tmp_path / "a").read_bytes() == b"aaa"
        os.remove(tmp_path / "a")
        files.fsync_dir(str(tmp_path))
        os.remove(tmp_path / "b")
        disk.crash()
        assert names(tmp_path) == ["b"]
        assert (tmp_path / "b").read_bytes() == b"bbb"


def test_a_removed_name_keeps_its_own_content_when_the_inode_number_is_reused(tmp_path):
    (tmp_path / "a").write_bytes(b"the old file")
    with PowerLoss(tmp_path) as disk:
        for i in range(20):  # a new file may get the freed inode number: the model must not mix them
            os.remove(tmp_path / ("a" if i == 0 else f"n{i - 1}"))
            write(tmp_path / f"n{i}", b"new %d" % i)
        disk.crash()
        assert names(tmp_path) == ["a"]
        assert (tmp_path / "a").read_bytes() == b"the old file"


def test_a_truncate_counts_once_fsynced(tmp_path):
    (tmp_path / "f").write_bytes(b"abcdef")
    (tmp_path / "g").write_bytes(b"abcdef")
    with PowerLoss(tmp_path) as disk:
        for mode in ("prefix", "zeros", "strict"):  # truncated below what was durable: strict in every mode
            os.truncate(tmp_path / "f", 3)
            fd = os.open(tmp_path / "g", os.O_WRONLY)
            os.ftruncate(fd, 2)
            os.write(fd, b"XY--more")
            os.close(fd)
            disk.crash(mode)
            assert (tmp_path / "f").read_bytes() == b"abcdef", mode
            assert (tmp_path / "g").read_bytes() == b"abcdef", mode
        os.truncate(tmp_path / "f", 3)
        fd = os.open(tmp_path / "f", os.O_WRONLY)
        os.fsync(fd)
        os.close(fd)
        disk.crash()
        assert (tmp_path / "f").read_bytes() == b"abc"


def test_a_file_made_behind_the_harness_back_is_followed_from_its_first_fsync(power_loss):
    d = Path(power_loss.data_dir)
    dir_fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    fd = os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=dir_fd)  # dir_fd=: passed through unseen
    os.write(fd, b"synced")
    os.fsync(fd)
    os.write(fd, b", not synced")
    os.fsync(dir_fd)
    os.close(fd)
    os.close(dir_fd)
    power_loss.crash("prefix")  # its writes were not all seen: strict
    assert (d / "f").read_bytes() == b"synced"


# --- the three modes ------------------------------------------------------------------------------


def test_prefix_keeps_some_of_the_unsynced_appends(tmp_path):
    (tmp_path / "f").write_bytes(b"head:")
    tail = bytes(range(65, 91)) * 4
    kept = set()
    with PowerLoss(tmp_path, seed=7) as disk:
        for _ in range(8):
            write(tmp_path / "f", tail, fsync=False)
            disk.crash("prefix")
            data = (tmp_path / "f").read_bytes()
            assert data == b"head:" + tail[:len(data) - 5]
            kept.add(len(data) - 5)
            os.truncate(tmp_path / "f", 5)
            fd = os.open(tmp_path / "f", os.O_WRONLY)
            os.fsync(fd)
            os.close(fd)
    assert len(kept) > 2 and max(kept) <= len(tail)


def test_prefix_is_seedable(tmp_path):
    def run(seed: int) -> bytes:
        with PowerLoss(tmp_path) as disk:
            write(tmp_path / "f", b"x" * 1000, fsync=False)
            disk.crash("prefix", seed=seed)
        data = (tmp_path / "f").read_bytes()
        os.truncate(tmp_path / "f", 0)
        return data
    (tmp_path / "f").write_bytes(b"")
    assert run(1) == run(1)
    assert len({len(run(s)) for s in range(5)}) > 1


def test_zeros_keeps_the_length_of_the_unsynced_appends_as_zeros(power_loss):
    d = Path(power_loss.data_dir)
    write(d / "f", b"synced", os.O_WRONLY | os.O_CREAT)
    files.fsync_dir(str(d))
    write(d / "f", b"-not-synced", fsync=False)
    write(d / "new", b"named, never fsynced", fsync=False)
    files.fsync_dir(str(d))
    power_loss.crash("zeros")
    assert (d / "f").read_bytes() == b"synced" + bytes(11)
    assert (d / "new").read_bytes() == bytes(20)


def test_a_file_written_in_place_falls_back_to_strict(tmp_path):
    (tmp_path / "f").write_bytes(b"0123456789")
    with PowerLoss(tmp_path) as disk:
        fd = os.open(tmp_path / "f", os.O_WRONLY)
        os.pwrite(fd, b"AB", 4)
        os.pwrite(fd, b"tail", 10)
        os.close(fd)
        disk.crash("zeros")
        assert (tmp_path / "f").read_bytes() == b"0123456789"


def test_a_file_written_through_a_file_object(power_loss):
    d = Path(power_loss.data_dir)
    with open(d / "f", "wb") as fh:
        fh.write(b"through open()")
        fh.flush()
        os.fsync(fh.fileno())
        fh.write(b" and more")
    (d / "g").write_bytes(b"through pathlib")  # io.open
    files.fsync_dir(str(d))
    power_loss.crash("prefix")  # writes not seen: strict
    assert (d / "f").read_bytes() == b"through open()"
    assert (d / "g").read_bytes() == b""


# --- failing fsync, descriptors after a crash, crashing again -------------------------------------


def test_fail_fsync_fails_the_selected_paths_only(power_loss):
    d = Path(power_loss.data_dir)
    for name in ("a", "b"):
        write(d / name, b"1")
    files.fsync_dir(str(d))
    power_loss.fail_fsync(lambda path: os.path.basename(path) == "a")
    with pytest.raises(OSError) as failed:
        write(d / "a", b"2")
    assert failed.value.errno == errno.EIO
    write(d / "b", b"2")
    assert power_loss.fsync_failures == [str(d / "a")]
    power_loss.crash()
    assert (d / "a").read_bytes() == b"1" and (d / "b").read_bytes() == b"12"
    # a failing directory fsync: the new name is not durable
    power_loss.fail_fsync(lambda path: path == power_loss.data_dir)
    write(d / "c", b"c")
    with pytest.raises(OSError):
        files.fsync_dir(str(d))
    power_loss.fail_fsync(None)
    write(d / "a", b"3")
    power_loss.crash()
    assert names(d) == ["a", "b"]
    assert (d / "a").read_bytes() == b"13"


def test_descriptors_open_at_the_crash_are_dead(power_loss):
    d = Path(power_loss.data_dir)
    write(d / "f", b"durable")
    files.fsync_dir(str(d))
    fd = os.open(d / "f", os.O_WRONLY | os.O_APPEND)
    dir_fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    power_loss.crash()
    for call in (lambda: os.write(fd, b"x"), lambda: os.writev(fd, [b"x"]), lambda: os.pwrite(fd, b"x", 0),
                 lambda: os.ftruncate(fd, 0), lambda: os.fsync(fd), lambda: os.fdatasync(fd),
                 lambda: os.fsync(dir_fd)):
        with pytest.raises(OSError) as dead:
            call()
        assert dead.value.errno == errno.EIO
    os.close(fd)
    os.close(dir_fd)
    assert (d / "f").read_bytes() == b"durable"
    fd = os.open(d / "f", os.O_WRONLY | os.O_APPEND)  # a new descriptor (likely the same number) works
    os.write(fd, b"!")
    os.fsync(fd)
    os.close(fd)
    assert (d / "f").read_bytes() == b"durable!"


def test_crash_twice(power_loss):
    d = Path(power_loss.data_dir)
    write(d / "f", b"1")
    files.fsync_dir(str(d))
    write(d / "f", b"2", fsync=False)
    power_loss.crash()
    write(d / "f", b"3")
    write(d / "g", b"g")
    power_loss.crash()
    assert names(d) == ["f"] and (d / "f").read_bytes() == b"13"
    write(d / "g", b"g")
    files.fsync_dir(str(d))
    power_loss.crash()
    assert names(d) == ["f", "g"] and power_loss.crashes == 3


def test_everything_is_restored_on_exit(tmp_path):
    wrapped = ("open", "write", "writev", "pwrite", "fsync", "fdatasync", "rename", "replace", "remove", "unlink",
               "truncate", "ftruncate", "close")
    before = {name: getattr(os, name) for name in wrapped}
    opens = (builtins.open, io.open)
    with PowerLoss(tmp_path):
        assert all(getattr(os, name) is not before[name] for name in wrapped)
        assert builtins.open is not opens[0] and io.open is not opens[1]
    assert {name: getattr(os, name) for name in wrapped} == before
    assert (builtins.open, io.open) == opens


# --- compiled code goes through the wrappers ------------------------------------------------------


def test_compiled_storage_calls_go_through_the_harness(power_loss):
    """mypyc compiles segment_log and sync_group (trio_nsq/compiled.py); their os.write, os.fsync and
    os.rename look the function up on the os module when they run, so the harness sees them. (Replacing
    the module's `os` global instead would not be seen by compiled code.)"""
    expected = compiled.why_not_compiled() is None  # compiled unless TRIO_NSQ_COMPILE=0 or no compiler
    running = set(compiled.compiled_modules())
    for module in (segment_log, sync_group):
        assert (module.__name__ in running) == expected, (module.__name__, running)
        assert module.__file__ is not None and module.__file__.endswith(".py") != expected
    d = power_loss.data_dir
    log = segment_log.SegmentLog("q", d, min_msg_size=1)
    log.append([b"record"])
    seg = log.file_name(0)
    # the CRC side file's header (the segment's start) and the batch's entry go first (checksums.py)
    crc = seg[:-4] + ".crc"
    assert power_loss.ops("write") == [Event("write", crc, 48), Event("write", crc, 16), Event("write", seg, 10)]
    files.fsync_file(seg)  # what a round does for each segment (sync_group._persist, below)
    assert [e.path for e in power_loss.ops("fsync")] == [seg]
    assert power_loss.durable(seg) is None  # fsynced, but its name is not durable yet
    group = sync_group.SyncGroup("q", d)
    plan = sync_group.RoundPlan(fsync=[seg], new_names=True)
    member = types.SimpleNamespace(deleted=False)  # what _replace asks of its member
    plan.replaces.append((member, log.meta_file_name(), b"meta"))  # type: ignore[arg-type]
    group._persist(plan)  # a round's worker: fsync, temp file written and renamed, directory fsynced
    log.close()
    assert power_loss.ops("rename")[0].path.endswith(f" -> {log.meta_file_name()}")
    assert [e.path for e in power_loss.ops("fsync")][-1] == d
    segment_log.remove_dropped(seg, True, "q")  # a bad segment is kept as .bad: a rename
    assert power_loss.ops("rename")[-1].path == f"{seg} -> {seg}.bad"
    power_loss.crash()
    # the rename to .bad was never made durable; the segment and the metadata were
    assert names(Path(d)) == ["q.diskqueue.000000.crc", "q.diskqueue.000000.dat", "q.diskqueue.meta.dat"]
    assert Path(seg).read_bytes() == b"\0\0\0\x06record"


# --- a topic ---------------------------------------------------------------------------------------


def bodies(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


def drain(topic: Topic, fin: bool) -> list[bytes]:
    channel = topic.get_channel("c")
    out = []
    while msgs := channel.take(64):
        for msg in msgs:
            msg.attempts += 1
        channel.start_in_flight_many(msgs, CLIENT, 0.0, 60.0)
        if fin:
            channel.finish_messages(CLIENT, [m.id for m in msgs])
        out.extend(m.body for m in msgs)
    return out


@pytest.mark.parametrize("mode", ["strict", "prefix", "zeros"])
def test_a_topic_keeps_what_it_answered_and_loses_what_came_after_its_last_round(power_loss, mode):
    """--mem-queue-size=0 --sync-every=1: a publish is answered after the fsync round that covers it. A
    power loss keeps every answered message and every FIN a round persisted; the messages written after
    the last round are gone (strict), or some of them (prefix, zeros: whole records only, in order)."""
    clock = trio.testing.MockClock()
    data = power_loss.data_dir

    def open_topic() -> Topic:
        """The topic and its channel, as nsqd.dat brings them back (before any round: a topic with no
        channel keeps nothing of its log)."""
        owner = Owner(data, clock, strict=True, mem_queue_size=0, sync_every=1, max_bytes_per_file=400)
        topic = Topic(owner, "t")  # type: ignore[arg-type]
        topic.get_channel("c")
        return topic

    answered, unanswered = bodies("a", 20), bodies("late", 6)

    async def before() -> Topic:
        topic = open_topic()
        channel = topic.get_channel("c")
        for at in range(0, 20, 5):
            published = topic.publish(answered[at:at + 5])
            assert published.sync is not None
            await published.sync.sync()  # the answer
        msgs = channel.take(3)
        channel.start_in_flight_many(msgs, CLIENT, 0.0, 60.0)
        channel.finish_messages(CLIENT, [m.id for m in msgs])
        await topic.group.sync_round()  # those FINs are persisted
        msgs = channel.take(2)
        channel.start_in_flight_many(msgs, CLIENT, 0.0, 60.0)
        channel.finish_messages(CLIENT, [m.id for m in msgs])  # these are not: they come back
        published = topic.publish(unanswered)  # written, never answered: no round covered it
        assert published.sync is not None
        return topic
    topic = trio.run(before, clock=clock)
    kill(topic)
    on_disk = b"".join(p.read_bytes() for p in Path(data).glob("t.diskqueue.0*.dat"))
    assert all(body in on_disk for body in unanswered)  # in the page cache: a kill -9 would keep them
    power_loss.crash(mode)

    async def after() -> list[bytes]:
        topic = open_topic()
        try:
            return drain(topic, fin=False)
        finally:
            kill(topic)
    found = trio.run(after, clock=clock)
    kept = answered[3:]
    assert found[:len(kept)] == kept, found
    late = found[len(kept):]
    if mode == "strict":
        assert late == []
    else:
        assert late == unanswered[:len(late)], late
    if mode == "strict":
        # and again: what the reopened topic answers survives the next power loss too
        async def more() -> Topic:
            topic = open_topic()
            published = topic.publish([b"b0", b"b1"])
            assert published.sync is not None
            await published.sync.sync()
            assert drain(topic, fin=True) == kept + [b"b0", b"b1"]
            topic.publish([b"b2"])  # unanswered
            return topic
        kill(trio.run(more, clock=clock))
        power_loss.crash("strict")
        # the FINs since the last round are undone: everything answered is back, b2 is not
        assert trio.run(after, clock=clock) == kept + [b"b0", b"b1"]


def test_a_dead_letter_move_survives_a_power_loss(power_loss):
    """A message past its attempts goes to the dead-letter topic's log, then is finished on its channel:
    in both after a crash between the two, never in neither. Under kill -9 that held even when the
    source topic's round persisted the FIN before the dead-letter topic's round (the page cache keeps the
    dead letter); under a power loss it is lost, unless the FIN waits for the dead-letter topic's round
    (issue 41: it does now)."""
    clock = trio.testing.MockClock()
    data = power_loss.data_dir

    def open_topics() -> tuple[Topic, Topic]:
        owner = Owner(data, clock, strict=True, mem_queue_size=0, sync_every=1)
        topic = Topic(owner, "t")  # type: ignore[arg-type]
        topic.get_channel("c").settings.update({"max_attempts": 1})  # as nsqd.dat brings it back
        topic.apply_settings()
        return topic, owner.topics["t-c-dlq"]

    async def move() -> tuple[Topic, Topic]:
        topic, dead = open_topics()
        await dead.group.sync_round()  # the dead-letter channel's cursor on disk (as POST /channel/config)
        published = topic.publish([b"m0"])
        assert published.sync is not None
        await published.sync.sync()
        channel = topic.get_channel("c")
        [msg] = channel.take(1)
        msg.attempts += 1
        channel.start_in_flight(msg, CLIENT, 0.0, 60.0)
        channel.requeue_message(CLIENT, msg.id, 0.0)  # past max_attempts: moved
        assert channel.dead_lettered_count == 1
        await topic.group.sync_round()  # the source's round (its FIN); the dead-letter topic's has not run
        return topic, dead
    topic, dead = trio.run(move, clock=clock)
    kill(topic)
    kill(dead)
    assert any(b"m0" in p.read_bytes() for p in Path(data).glob("t-c-dlq.diskqueue.0*.dat"))  # kill -9 keeps it
    power_loss.crash("strict")

    async def found() -> list[bytes]:
        topic, dead = open_topics()
        try:
            return [m.body for m in topic.get_channel("c").take(10) + dead.get_channel(DEAD_LETTERS_CHANNEL).take(10)]
        finally:
            kill(topic)
            kill(dead)
    assert b"m0" in trio.run(found, clock=clock), "the dead letter was lost with its FIN persisted"


def _dead_letter_topics(data: str, clock: trio.testing.MockClock) -> tuple[Topic, Topic]:
    owner = Owner(data, clock, mem_queue_size=0, sync_every=1)
    topic = Topic(owner, "t")  # type: ignore[arg-type]
    topic.get_channel("c").settings.update({"max_attempts": 1})  # as nsqd.dat brings it back
    topic.apply_settings()
    return topic, owner.topics["t-c-dlq"]


@contextlib.contextmanager
def _dead_letter_topics_reopened(data: str, clock: trio.testing.MockClock) -> Iterator[tuple[Topic, Topic]]:
    """The two topics opened again after the crash, killed (as a crash would) when the check is done."""
    topic, dead = _dead_letter_topics(data, clock)
    try:
        yield topic, dead
    finally:
        kill(topic)
        kill(dead)


def _killed_then_power_loss(power_loss: PowerLoss, *topics: Topic) -> None:
    for topic in topics:
        kill(topic)
    power_loss.crash("strict")


async def _published_and_moved(data: str, clock: trio.testing.MockClock) -> tuple[Topic, Topic]:
    """The two topics, one message published to t (durable) and moved to the dead letters (not yet)."""
    topic, dead = _dead_letter_topics(data, clock)
    await dead.group.sync_round()
    published = topic.publish([b"m0"])
    assert published.sync is not None
    await published.sync.sync()
    _move_one(topic)
    return topic, dead


def _move_one(topic: Topic) -> None:
    channel = topic.get_channel("c")
    [msg] = channel.take(1)
    msg.attempts += 1
    channel.start_in_flight(msg, CLIENT, 0.0, 60.0)
    channel.requeue_message(CLIENT, msg.id, 0.0)  # past max_attempts: moved


@pytest.mark.parametrize("dead_round", ["fails", "succeeds"])
def test_a_dead_letter_move_whose_copy_is_not_durable_is_not_finished(power_loss, dead_round):
    """Issue 41's recipe: the dead-letter topic's fsync fails (EIO) while the source's rounds succeed.
    The source must not persist the FIN of a message whose copy was never durable: after a power loss it
    is still on its channel. With the dead-letter round succeeding, the FIN follows it, and the message
    is in the dead-letter topic only."""
    clock = trio.testing.MockClock()
    data = power_loss.data_dir

    async def move() -> tuple[Topic, Topic]:
        topic, dead = await _published_and_moved(data, clock)
        channel = topic.get_channel("c")
        assert channel.dead_lettered_count == 1 and channel.dead_letters_pending == 1
        if dead_round == "fails":
            power_loss.fail_fsync(lambda path: "t-c-dlq" in path)
        for _ in range(2):  # both io loops' rounds, in either order
            with contextlib.suppress(BackendError):
                await dead.group.sync_round()
            await topic.group.sync_round()
        power_loss.fail_fsync(None)
        # the copy was not durable: not finished, moved again in a moment (deferred for the retry)
        assert channel.dead_letters_pending == 0
        assert len(channel.deferred) == (1 if dead_round == "fails" else 0)
        return topic, dead
    _killed_then_power_loss(power_loss, *trio.run(move, clock=clock))

    async def found() -> tuple[list[bytes], list[bytes]]:
        with _dead_letter_topics_reopened(data, clock) as (topic, dead):
            channel = topic.get_channel("c")
            source = channel.take(10)  # a message held for its retry is deferred until then
            clock.jump(2)
            channel.process_deferred_queue(trio.current_time())
            source += channel.take(10)
            return [m.body for m in source], [m.body for m in dead.get_channel(DEAD_LETTERS_CHANNEL).take(10)]
    source, dead_letters = trio.run(found, clock=clock)
    if dead_round == "fails":
        assert source == [b"m0"] and dead_letters == []
    else:
        assert source == [] and dead_letters == [b"m0"]


def test_a_redrive_is_finished_in_the_dead_letter_channel_after_its_copy_is_durable(power_loss):
    """The other way: a re-drive copies into the source channel's own queue (the source topic's round),
    and finishes in the dead-letter channel (its topic's round) only after. A power loss after the
    dead-letter topic's round and before the source's finds it still among the dead letters."""
    clock = trio.testing.MockClock()
    data = power_loss.data_dir

    async def redrive() -> tuple[Topic, Topic]:
        topic, dead = await _published_and_moved(data, clock)
        await dead.group.sync_round()
        await topic.group.sync_round()  # moved: finished on c, durable in the dead-letter topic
        dead_channel = dead.get_channel(DEAD_LETTERS_CHANNEL)
        assert topic.get_channel("c").redrive_from(dead_channel, 10) == 1
        await dead.group.sync_round()  # the source's round has not run: nothing finished there yet
        return topic, dead
    _killed_then_power_loss(power_loss, *trio.run(redrive, clock=clock))

    async def found() -> tuple[list[bytes], list[bytes]]:
        with _dead_letter_topics_reopened(data, clock) as (topic, dead):
            return ([m.body for m in topic.get_channel("c").take(10)],
                    [m.body for m in dead.get_channel(DEAD_LETTERS_CHANNEL).take(10)])
    source, dead_letters = trio.run(found, clock=clock)
    assert source == [] and dead_letters == [b"m0"]  # not lost: still a dead letter
