"""DiskQueue against go-diskqueue: its exact files, loading its directories, a model test across rolls,
restarts and crashes, corruption, write errors, group commit and the io loop."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import struct
import tempfile
from collections import deque
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import trio_nsq.broker.diskqueue as diskqueue_module
from trio_nsq.broker.backend import BackendError
from trio_nsq.broker.diskqueue import DiskQueue

LOGGER = diskqueue_module.log.name


def rec(data: bytes) -> bytes:
    """A record as go-diskqueue writes it, built by hand."""
    return struct.pack(">i", len(data)) + data


def drain(dq: DiskQueue) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(dq.read_nowait())
        except trio.WouldBlock:
            return out


def data_file(d: Path, name: str, num: int) -> Path:
    return d / f"{name}.diskqueue.{num:06d}.dat"


def meta(d: Path, name: str) -> str:
    return (d / f"{name}.diskqueue.meta.dat").read_text()


def crash_copy(src: Path, dst: Path) -> Path:
    """What a new process finds after kill -9: the files as they are now (the page cache), whatever the
    queue had not yet persisted."""
    shutil.copytree(src, dst)
    return dst


def nsq_message(ts: int, attempts: int, msg_id: bytes, body: bytes) -> bytes:
    return struct.pack(">qH", ts, attempts) + msg_id + body


# --- go-diskqueue's bytes -------------------------------------------------------------------------


async def test_files_and_metadata_are_byte_for_byte_go_diskqueue(tmp_path):
    dq = DiskQueue("t", str(tmp_path), max_bytes_per_file=30, min_msg_size=0, max_msg_size=100)
    msgs = [b"", b"a" * 10, b"b" * 8, b"c", b"d" * 40, b"e"]
    for i, m in enumerate(msgs):
        dq.put(m)
        assert dq.depth() == i + 1
    # 4 + 14 + 12 = 30 == max: the third still fits (go rolls only when writePos+total > max);
    # "c" would pass 30: file 1; "d" is longer than a file: file 2 on its own; "e": file 3
    assert (dq.write_file_num, dq.write_pos) == (3, 5)
    await dq.close()
    assert data_file(tmp_path, "t", 0).read_bytes() == rec(b"") + rec(b"a" * 10) + rec(b"b" * 8)
    assert data_file(tmp_path, "t", 1).read_bytes() == rec(b"c")
    assert data_file(tmp_path, "t", 2).read_bytes() == rec(b"d" * 40)
    assert data_file(tmp_path, "t", 3).read_bytes() == rec(b"e")
    assert meta(tmp_path, "t") == "6\n0,0\n3,5\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "t.diskqueue.000000.dat", "t.diskqueue.000001.dat", "t.diskqueue.000002.dat",
        "t.diskqueue.000003.dat", "t.diskqueue.meta.dat"]

    # reading: positions move as records are taken, a finished file is deleted
    dq = DiskQueue("t", str(tmp_path), max_bytes_per_file=30, min_msg_size=0, max_msg_size=100)
    assert dq.depth() == 6
    assert [dq.read_nowait() for _ in range(2)] == msgs[:2]
    assert (dq.read_file_num, dq.read_pos) == (0, 18)
    assert dq.read_nowait() == msgs[2]
    assert (dq.read_file_num, dq.read_pos) == (1, 0)
    assert not data_file(tmp_path, "t", 0).exists()
    await dq.close()
    assert meta(tmp_path, "t") == "3\n1,0\n3,5\n"

    dq = DiskQueue("t", str(tmp_path), max_bytes_per_file=30, min_msg_size=0, max_msg_size=100)
    assert drain(dq) == msgs[3:]
    assert dq.depth() == 0
    await dq.close()
    assert meta(tmp_path, "t") == "0\n3,5\n3,5\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.diskqueue.000003.dat", "t.diskqueue.meta.dat"]


async def test_roll_and_resize_as_go_diskqueue_tests(tmp_path):
    # go-diskqueue's TestDiskQueueRoll: 11 messages of 10 bytes, files of 10 records
    msg = bytes(range(10))
    dq = DiskQueue("roll", str(tmp_path), max_bytes_per_file=10 * 14, min_msg_size=10, max_msg_size=1024)
    for i in range(11):
        dq.put(msg)
        assert dq.depth() == i + 1
    assert (dq.write_file_num, dq.write_pos) == (1, 14)
    for i in range(11, 0, -1):
        assert dq.read_nowait() == msg
        assert dq.depth() == i - 1
    await dq.close()

    # TestDiskQueueResize: files written with a smaller max_bytes_per_file read back after a resize
    dq = DiskQueue("resize", str(tmp_path), max_bytes_per_file=8 * 14, min_msg_size=10, max_msg_size=1024)
    for i in range(9):
        dq.put(bytes([i]) + msg[1:])
    assert (dq.write_file_num, dq.write_pos, dq.depth()) == (1, 14, 9)
    await dq.close()
    dq = DiskQueue("resize", str(tmp_path), max_bytes_per_file=10 * 14, min_msg_size=10, max_msg_size=1024)
    for i in range(10):
        dq.put(bytes([20 + i]) + msg[1:])
    assert (dq.write_file_num, dq.write_pos, dq.depth()) == (2, 14, 19)
    assert drain(dq) == [bytes([i]) + msg[1:] for i in [*range(9), *range(20, 30)]]
    assert dq.depth() == 0
    await dq.close()
    assert not list(tmp_path.glob("*.bad"))


async def test_loads_a_directory_written_by_go_nsqd(tmp_path):
    # a channel queue as Go nsqd leaves it: file 7 partly read, file 8 the write file
    name = "orders:billing"
    msgs = [nsq_message(1_700_000_000_000_000_000 + i, 1, b"%016x" % i, b"body-%d" % i) for i in range(5)]
    (tmp_path / f"{name}.diskqueue.000007.dat").write_bytes(rec(msgs[0]) + rec(msgs[1]) + rec(msgs[2]))
    (tmp_path / f"{name}.diskqueue.000008.dat").write_bytes(rec(msgs[3]) + rec(msgs[4]))
    first = len(rec(msgs[0]))
    size8 = len(rec(msgs[3]) + rec(msgs[4]))
    (tmp_path / f"{name}.diskqueue.meta.dat").write_text(f"4\n7,{first}\n8,{size8}\n")

    dq = DiskQueue(name, str(tmp_path), min_msg_size=26, max_msg_size=1024 * 1024 + 26)
    assert dq.depth() == 4
    assert dq.read_nowait() == msgs[1]
    assert dq.read_nowait() == msgs[2]
    assert not (tmp_path / f"{name}.diskqueue.000007.dat").exists()  # read through: deleted
    extra = nsq_message(1_700_000_000_000_000_099, 1, b"%016x" % 99, b"new")
    dq.put(extra)
    assert drain(dq) == [msgs[3], msgs[4], extra]
    assert dq.depth() == 0
    await dq.close()
    # appended in place, in the same format
    assert (tmp_path / f"{name}.diskqueue.000008.dat").read_bytes() == rec(msgs[3]) + rec(msgs[4]) + rec(extra)
    total = size8 + len(rec(extra))
    assert meta(tmp_path, name) == f"0\n8,{total}\n8,{total}\n"
    assert not list(tmp_path.glob("*.bad")) and not list(tmp_path.glob("*.tmp"))


# --- the model test -------------------------------------------------------------------------------


class DiskQueueMachine(RuleBasedStateMachine):
    """put / read / sync / empty / close+reopen / kill -9 + reopen, with files of at most 64 bytes,
    against a deque: same order, no loss, no duplicate, exact depth.

    After a crash, records read since the last persisted metadata may come back (at least once, as
    go-diskqueue): they must be a suffix of what was read since, in order, ahead of everything unread."""

    def __init__(self):
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="dq-machine-"))
        self.generation = 0
        self.dir = self.root / "0"
        self.dir.mkdir()
        self.model: deque[bytes] = deque()
        self.read_since_persist: list[bytes] = []
        self.n = 0
        self.dq = self._open()

    def _open(self) -> DiskQueue:
        return DiskQueue("m", str(self.dir), max_bytes_per_file=64, min_msg_size=1, max_msg_size=40)

    def _persisted(self, before: int) -> None:
        if self.dq.fsync_count > before:
            self.read_since_persist.clear()

    @rule(size=st.integers(1, 40))
    def put(self, size):
        self.n += 1
        data = (b"%d:" % self.n + b"x" * size)[:size]
        self.dq.put(data)
        self.model.append(data)

    @rule(times=st.integers(1, 4))
    def read(self, times):
        for _ in range(times):
            try:
                got = self.dq.read_nowait()
            except trio.WouldBlock:
                assert not self.model
                return
            assert got == self.model.popleft()
            self.read_since_persist.append(got)

    @rule()
    def sync(self):
        before = self.dq.fsync_count
        trio.run(self.dq.sync)
        self._persisted(before)

    @rule()
    def empty(self):
        before = self.dq.fsync_count
        trio.run(self.dq.empty)
        self.model.clear()
        self._persisted(before)

    @rule()
    def close_and_reopen(self):
        trio.run(self.dq.close)
        self.read_since_persist.clear()
        self.dq = self._open()

    def _crash(self) -> None:
        old = self.dq
        self.generation += 1
        self.dir = crash_copy(self.dir, self.root / str(self.generation))
        old.delete()  # the old process's files are gone with it; only the copy lives on
        self.dq = self._open()

    @precondition(lambda self: not self.read_since_persist)
    @rule()
    def crash_after_puts(self):
        # nothing read since the metadata was persisted: the reopened queue is exact
        self._crash()

    @precondition(lambda self: bool(self.read_since_persist))
    @rule()
    def crash_after_reads(self):
        replayable = list(self.read_since_persist)
        self._crash()
        got = drain(self.dq)
        unread = list(self.model)
        assert got[len(got) - len(unread):] == unread, "unread records lost or reordered"
        replayed = got[: len(got) - len(unread)]
        assert replayed == replayable[len(replayable) - len(replayed):], "replays must be the last records read"
        assert self.dq.depth() == 0
        self.model.clear()
        self.read_since_persist = got

    @invariant()
    def depth_is_exact(self):
        assert self.dq.depth() == len(self.model)

    @invariant()
    def no_bad_files(self):
        assert not list(self.dir.glob("*.bad"))

    def teardown(self):
        trio.run(self.dq.close)
        shutil.rmtree(self.root, ignore_errors=True)


TestDiskQueueMachine = DiskQueueMachine.TestCase
TestDiskQueueMachine.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)


# --- corruption -----------------------------------------------------------------------------------

GO_MSG = bytes([91] + [0] * 61 + [4] + [0] * 56 + [211])  # 120 bytes: 124 a record, 8 to a 1000-byte file


def go_corruption_queue(d: Path) -> DiskQueue:
    return DiskQueue("c", str(d), max_bytes_per_file=1000, min_msg_size=10, max_msg_size=1 << 10, sync_every=5)


@pytest.mark.parametrize("bad_length", [0, 9, -1, 1025, 0x7FFFFFF0])
async def test_impossible_length_keeps_the_file_as_bad_and_reads_on(tmp_path, caplog, bad_length):
    caplog.set_level(logging.INFO, logger=LOGGER)
    dq = go_corruption_queue(tmp_path)
    for i in range(25):
        dq.put(bytes([i]) + GO_MSG[1:])
    await dq.close()
    with open(data_file(tmp_path, "c", 1), "r+b") as fh:
        fh.seek(3 * 124)
        fh.write(struct.pack(">i", bad_length))
    dq = go_corruption_queue(tmp_path)
    assert dq.depth() == 25
    got = drain(dq)  # no exception
    assert [m[0] for m in got] == [*range(0, 11), *range(16, 25)]
    assert data_file(tmp_path, "c", 1).with_suffix(".dat.bad").exists()
    assert dq.depth() == 0  # the 5 lost records are written off at the tail
    assert f"invalid message read size ({bad_length})" in caplog.text
    assert "jump to next file and saving bad file as" in caplog.text
    assert "positive depth at tail (5), data loss, resetting 0" in caplog.text
    dq.put(GO_MSG)
    assert drain(dq) == [GO_MSG]
    await dq.close()


async def test_truncated_files_as_go_diskqueue_corruption_test(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    dq = go_corruption_queue(tmp_path)
    for _ in range(25):
        dq.put(GO_MSG)
    assert dq.depth() == 25
    os.truncate(data_file(tmp_path, "c", 1), 400)  # 3 whole records, then a torn one
    got = drain(dq)
    assert len(got) == 8 + 3 + 8 + 1 and all(m == GO_MSG for m in got)
    assert data_file(tmp_path, "c", 1).with_suffix(".dat.bad").exists()
    assert dq.depth() == 0
    assert "unexpected EOF reading a record (24 of 120 bytes)" in caplog.text

    # the current write file cut in the middle of a record: it is bad, and writing moves on as well
    dq.put(GO_MSG)
    dq.put(GO_MSG)
    os.truncate(data_file(tmp_path, "c", 3), 124 + 100)
    assert dq.depth() == 2
    assert drain(dq) == []
    assert dq.depth() == 0
    assert data_file(tmp_path, "c", 3).with_suffix(".dat.bad").exists()
    assert dq.write_file_num == 4
    dq.put(GO_MSG)
    assert drain(dq) == [GO_MSG]
    await dq.close()
    dq = go_corruption_queue(tmp_path)
    assert dq.depth() == 0 and drain(dq) == []
    await dq.close()


async def test_truncated_write_file_found_at_open(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    dq = DiskQueue("tr", str(tmp_path), min_msg_size=1)
    for i in range(4):
        dq.put(b"record-%d" % i)
    await dq.close()
    os.truncate(data_file(tmp_path, "tr", 0), 3 * 12 + 5)  # the metadata says 48 bytes
    dq = DiskQueue("tr", str(tmp_path), min_msg_size=1)
    assert dq.write_file_num == 1  # never writes into (or past the end of) a damaged file
    dq.put(b"later")
    assert drain(dq) == [b"record-0", b"record-1", b"record-2", b"later"]
    assert dq.depth() == 0
    assert data_file(tmp_path, "tr", 0).with_suffix(".dat.bad").exists()
    assert "shorter (41) than metadata writePos 48" in caplog.text
    await dq.close()


# --- write errors ---------------------------------------------------------------------------------


def test_size_limits_as_go_diskqueue(tmp_path):
    dq = DiskQueue("s", str(tmp_path), min_msg_size=2, max_msg_size=4)
    for bad in (b"x", b"xxxxx"):
        with pytest.raises(BackendError, match=r"invalid message write size \(\d\) minMsgSize=2 maxMsgSize=4"):
            dq.put(bad)
    dq.put(b"xx")
    dq.put(b"xxxx")
    assert dq.depth() == 2
    assert data_file(tmp_path, "s", 0).read_bytes() == rec(b"xx") + rec(b"xxxx")


async def test_write_error_is_a_backend_error_and_the_queue_recovers(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    dq = DiskQueue("w", str(tmp_path), max_bytes_per_file=20, min_msg_size=1)
    dq.put(b"first-acc")  # 13 bytes: the next record rolls to file 1
    blocker = data_file(tmp_path, "w", 1)
    blocker.mkdir()  # file 1 cannot be opened for writing
    for _ in range(2):
        with pytest.raises(BackendError, match="failed to write to disk queue w"):
            dq.put(b"refused")
    assert dq.depth() == 1
    assert "DISKQUEUE(w): failed to write - " in caplog.text and "Is a directory" in caplog.text
    blocker.rmdir()
    dq.put(b"third-acc")
    assert data_file(tmp_path, "w", 1).read_bytes() == rec(b"third-acc")
    assert dq.depth() == 2
    await dq.close()
    dq = DiskQueue("w", str(tmp_path), max_bytes_per_file=20, min_msg_size=1)
    assert drain(dq) == [b"first-acc", b"third-acc"]
    await dq.close()


def test_disk_full_short_write_is_cut_off(tmp_path, monkeypatch):
    dq = DiskQueue("f", str(tmp_path), min_msg_size=1)
    dq.put(b"kept")
    real_writev = os.writev

    def short_writev(fd, buffers):
        return os.write(fd, b"".join(buffers)[:3])  # the disk fills after 3 bytes

    monkeypatch.setattr(os, "writev", short_writev)
    with pytest.raises(BackendError, match="short write"):
        dq.put(b"partial")

    def enospc(fd, buffers):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "writev", enospc)
    with pytest.raises(BackendError, match="No space left on device"):
        dq.put(b"refused")
    monkeypatch.setattr(os, "writev", real_writev)
    assert dq.depth() == 1
    assert data_file(tmp_path, "f", 0).read_bytes() == rec(b"kept")  # no torn record left behind
    dq.put(b"after")
    assert data_file(tmp_path, "f", 0).read_bytes() == rec(b"kept") + rec(b"after")
    assert drain(dq) == [b"kept", b"after"]
    trio.run(dq.close)


async def test_data_directory_removed_then_restored(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    monkeypatch.setattr(diskqueue_module, "LINK_CHECK_INTERVAL", 0.0)
    d = tmp_path / "data"
    d.mkdir()
    dq = DiskQueue("gone", str(d), min_msg_size=1)
    dq.put(b"before")
    shutil.rmtree(d)
    with pytest.raises(BackendError):
        dq.put(b"while-missing")  # not swallowed by the unlinked file
    assert "was removed from the disk" in caplog.text
    d.mkdir()
    dq.put(b"restored")
    assert drain(dq) == [b"restored"]  # "before" went with the directory; reading goes on without error
    assert dq.depth() == 0
    await dq.close()
    dq = DiskQueue("gone", str(d), min_msg_size=1)
    assert dq.depth() == 0 and drain(dq) == []
    dq.put(b"again")
    assert drain(dq) == [b"again"]
    await dq.close()


# --- crash recovery -------------------------------------------------------------------------------


class KillNine:
    """A live queue in tmp_path/live and, from `kill_9()`, the queue a broker killed with -9 would open on
    a copy of its files as they are now; the fixture closes every queue whatever the test's outcome."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.dir = tmp_path / "live"
        self.queues: list[DiskQueue] = []
        self.max_bytes = 0

    def live(self, max_bytes: int) -> DiskQueue:
        self.dir.mkdir()
        self.max_bytes = max_bytes
        return self._open(self.dir)

    def kill_9(self) -> DiskQueue:
        return self._open(crash_copy(self.dir, self.tmp_path / "after-crash"))

    def _open(self, d: Path) -> DiskQueue:
        self.queues.append(DiskQueue("k", str(d), max_bytes_per_file=self.max_bytes, min_msg_size=1))
        return self.queues[-1]


@pytest.fixture
async def crash(tmp_path):
    k = KillNine(tmp_path)
    yield k
    for q in reversed(k.queues):
        await q.close()


async def test_kill_9_recovers_records_after_the_last_metadata_sync(crash):
    dq = crash.live(40)
    dq.put(b"synced-1")
    await dq.sync()
    assert meta(crash.dir, "k") == "1\n0,0\n0,12\n"
    for i in range(6):  # 14-byte records: two to a file, rolls the metadata has not seen
        dq.put(b"after-%04d" % i)
    with open(data_file(crash.dir, "k", dq.write_file_num), "ab") as fh:
        fh.write(struct.pack(">i", 50) + b"torn")
    again = crash.kill_9()
    assert again.depth() == 7
    assert drain(again) == [b"synced-1"] + [b"after-%04d" % i for i in range(6)]
    again.put(b"next")
    assert drain(again) == [b"next"]


async def test_kill_9_after_the_metadata_write_file_was_read_and_deleted(crash):
    dq = crash.live(30)
    dq.put(b"one-12345")  # 13 bytes
    await dq.sync()  # metadata: write file 0
    dq.put(b"two-12345")
    dq.put(b"three-123")  # file 1
    assert drain(dq) == [b"one-12345", b"two-12345", b"three-123"]  # file 0 read and deleted
    dq.put(b"four-1234")
    again = crash.kill_9()
    got = drain(again)
    assert got[-1] == b"four-1234" and set(got) <= {b"three-123", b"four-1234"}
    assert again.depth() == 0


async def test_kill_9_after_a_roll_the_metadata_never_saw_and_its_file_was_read(crash):
    dq = crash.live(30)
    dq.put(b"dropped")
    await dq.empty()
    assert meta(crash.dir, "k") == "0\n1,0\n1,0\n"  # the write file (1) has no file yet
    for m in (b"a-1234567", b"b-1234567", b"c-1234567"):  # 13 bytes: two to a file, c in file 2
        dq.put(m)
    assert drain(dq) == [b"a-1234567", b"b-1234567", b"c-1234567"]  # file 1 read and deleted
    dq.put(b"d-1234567")
    again = crash.kill_9()
    assert (again.write_file_num, again.write_pos) == (2, 26)  # file 2 found, not written over
    assert drain(again) == [b"c-1234567", b"d-1234567"]  # c again: read after the last metadata sync
    assert again.depth() == 0
    again.put(b"e")
    assert drain(again) == [b"e"]


async def test_kill_9_before_any_metadata_after_a_roll_and_a_read(crash):
    dq = crash.live(30)
    dq.put(b"a-1234567")
    dq.put(b"b-1234567")
    dq.put(b"c-1234567")  # file 1
    assert drain(dq) == [b"a-1234567", b"b-1234567", b"c-1234567"]  # file 0 deleted; no metadata yet
    dq.put(b"d-1234567")
    assert not (crash.dir / "k.diskqueue.meta.dat").exists()
    again = crash.kill_9()
    assert (again.read_file_num, again.write_file_num, again.write_pos) == (1, 1, 26)  # file 1 not reused
    assert again.depth() == 2
    assert drain(again) == [b"c-1234567", b"d-1234567"]


async def test_data_file_without_metadata_is_recovered_not_overwritten(tmp_path):
    data_file(tmp_path, "nm", 0).write_bytes(rec(b"a") + rec(b"bb"))
    dq = DiskQueue("nm", str(tmp_path), min_msg_size=1)
    assert dq.depth() == 2
    dq.put(b"ccc")
    assert drain(dq) == [b"a", b"bb", b"ccc"]
    await dq.close()


# --- reading --------------------------------------------------------------------------------------


async def test_reader_follows_the_writer_through_rolls_without_bad_files(tmp_path):
    dq = DiskQueue("f", str(tmp_path), max_bytes_per_file=28, min_msg_size=1)
    out = []
    for i in range(40):
        dq.put(b"m-%07d" % i)  # 14 bytes: a file holds exactly two
        if i % 2:
            out += drain(dq)  # caught up at the very end of the write file, then it rolls
    assert out == [b"m-%07d" % i for i in range(40)]
    assert not list(tmp_path.glob("*.bad"))
    assert [p.name for p in tmp_path.glob("*.dat")] == ["f.diskqueue.000019.dat"]
    await dq.close()


async def test_an_empty_read_leaves_the_queue_readable_once_a_record_comes(tmp_path):
    dq = DiskQueue("r", str(tmp_path), min_msg_size=1)
    with pytest.raises(trio.WouldBlock):
        dq.read_nowait()  # a reader finding nothing must not leave the queue stuck
    assert dq.depth() == 0
    dq.put(b"x")
    assert dq.depth() == 1 and dq.read_many(10) == [b"x"]
    await dq.close()


# --- sync -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_io_loop", [False, True])
async def test_group_commit_shares_fsyncs(tmp_path, with_io_loop):
    d = tmp_path / "live"
    d.mkdir()
    dq = DiskQueue("g", str(d), min_msg_size=1, sync_every=1)
    acked = []

    async def publisher(i):
        dq.put(b"p%03d" % i)
        await dq.sync()
        acked.append(i)

    async with trio.open_nursery() as nursery:
        if with_io_loop:
            await nursery.start(dq.run)
        async with trio.open_nursery() as publishers:
            for i in range(200):
                publishers.start_soon(publisher, i)
        nursery.cancel_scope.cancel()
    assert len(acked) == 200
    assert 1 <= dq.fsync_count <= 20, dq.fsync_count
    assert meta(d, "g") == f"200\n0,0\n0,{200 * 8}\n"  # the metadata was persisted with the data
    again = DiskQueue("g", str(crash_copy(d, tmp_path / "after")), min_msg_size=1)
    assert sorted(drain(again)) == [b"p%03d" % i for i in range(200)]
    await dq.close()


async def test_sync_with_nothing_new_is_free_and_failures_reach_every_waiter(tmp_path, monkeypatch, caplog):
    dq = DiskQueue("s", str(tmp_path), min_msg_size=1)
    await dq.sync()
    assert dq.fsync_count == 0
    dq.put(b"a")
    await dq.sync()
    await dq.sync()
    assert dq.fsync_count == 1

    real_fsync = os.fsync

    def broken(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", broken)
    errors = []

    async def publisher(i):
        dq.put(b"b%d" % i)
        try:
            await dq.sync()
        except BackendError as exc:
            errors.append(exc)

    before = dq.fsync_count
    async with trio.open_nursery() as nursery:
        for i in range(10):
            nursery.start_soon(publisher, i)
    assert len(errors) == 10 and "Input/output error" in str(errors[0])
    assert dq.fsync_count - before <= 2
    assert "DISKQUEUE(s) failed to sync" in caplog.text
    monkeypatch.setattr(os, "fsync", real_fsync)
    with pytest.raises(BackendError):
        await dq.sync()  # those records' fsync failed: a later success proves nothing about them
    dq.put(b"c")
    await dq.sync()  # the disk is back: new records are durable again, and the metadata with them
    assert meta(tmp_path, "s").startswith("12\n")
    await dq.close()


async def test_a_record_whose_fsync_failed_is_never_reported_durable(tmp_path, monkeypatch):
    """The io loop's round fails while a publisher has not yet asked for sync(): the publisher's later
    sync() must fail too, even though the fsync it would start now succeeds (Linux may have dropped the
    failed pages and marked them clean). Health follows: failing, then healthy after a good write."""
    health = []
    dq = DiskQueue("p", str(tmp_path), min_msg_size=1, sync_every=1, on_health=health.append)
    real_fsync = os.fsync

    def broken(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    dq.put(b"before")
    await dq.sync()
    monkeypatch.setattr(os, "fsync", broken)
    dq.put(b"lost")
    async with trio.open_nursery() as nursery:
        await nursery.start(dq.run)  # the io loop syncs at once (sync_every=1) and fails
        with trio.fail_after(5):
            while not health:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert health[-1] is not None and "Input/output error" in health[-1]
    monkeypatch.setattr(os, "fsync", real_fsync)
    with pytest.raises(BackendError):
        await dq.sync()
    dq.put(b"after")
    await dq.sync()
    assert health[-1] is None
    await dq.close()


async def wait_meta(d: Path, name: str, want: str) -> None:
    with trio.fail_after(5):
        while True:
            try:
                if meta(d, name) == want:
                    return
            except FileNotFoundError:
                pass
            await trio.sleep(0.005)


async def test_io_loop_syncs_every_n_reads_and_writes(tmp_path):
    dq = DiskQueue("l", str(tmp_path), min_msg_size=1, sync_every=10, sync_timeout=3600)
    async with trio.open_nursery() as nursery:
        await nursery.start(dq.run)
        for _ in range(9):
            dq.put(b"x")  # 5 bytes each
        await trio.sleep(0.05)
        assert dq.fsync_count == 0
        dq.put(b"x")  # the 10th
        await wait_meta(tmp_path, "l", "10\n0,0\n0,50\n")
        for _ in range(10):  # reads count too
            dq.read_nowait()
        await wait_meta(tmp_path, "l", "0\n0,50\n0,50\n")
        assert dq.fsync_count == 2
        nursery.cancel_scope.cancel()
    await dq.close()


async def test_io_loop_syncs_at_once_when_a_file_changes(tmp_path):
    dq = DiskQueue("l", str(tmp_path), max_bytes_per_file=10, min_msg_size=1, sync_every=2500, sync_timeout=3600)
    async with trio.open_nursery() as nursery:
        await nursery.start(dq.run)
        dq.put(b"12345")
        dq.put(b"12345")  # 9 + 9 > 10: a new write file
        await wait_meta(tmp_path, "l", "2\n0,0\n1,9\n")
        dq.read_nowait()  # file 0 is read through: deleted, the read file changes
        await wait_meta(tmp_path, "l", "1\n1,0\n1,9\n")
        assert dq.fsync_count == 2
        nursery.cancel_scope.cancel()
    await dq.close()


async def test_io_loop_syncs_on_timeout_only_when_something_happened(tmp_path):
    dq = DiskQueue("l", str(tmp_path), min_msg_size=1, sync_every=2500, sync_timeout=0.05)
    async with trio.open_nursery() as nursery:
        await nursery.start(dq.run)
        await trio.sleep(0.2)
        assert dq.fsync_count == 0  # nothing happened: nothing to sync
        dq.put(b"x")
        await wait_meta(tmp_path, "l", "1\n0,0\n0,5\n")
        count = dq.fsync_count
        await trio.sleep(0.2)
        assert dq.fsync_count == count  # idle again
        await dq.close()  # and run() ends by itself
    assert dq.fsync_count == count + 1


# --- empty, close, delete -------------------------------------------------------------------------


async def test_empty_close_and_delete(tmp_path):
    dq = DiskQueue("e", str(tmp_path), max_bytes_per_file=20, min_msg_size=1)
    for _ in range(5):
        dq.put(b"0123456789")  # one to a file: files 0-4
    await dq.empty()
    assert dq.depth() == 0 and drain(dq) == []
    assert meta(tmp_path, "e") == "0\n5,0\n5,0\n"
    assert not list(tmp_path.glob("e.diskqueue.0*.dat"))
    dq.put(b"fresh")
    await dq.close()
    await dq.close()  # twice is fine
    with pytest.raises(BackendError, match="exiting"):
        dq.put(b"too late")
    assert data_file(tmp_path, "e", 5).read_bytes() == rec(b"fresh")

    # neighbours whose names start the same way are not touched
    DiskQueue("e:ch", str(tmp_path), min_msg_size=1).put(b"keep")
    data_file(tmp_path, "e", 5).with_suffix(".dat.bad").write_bytes(b"kept for inspection")
    dq = DiskQueue("e", str(tmp_path), max_bytes_per_file=20, min_msg_size=1)
    assert drain(dq) == [b"fresh"]
    dq.put(b"one more")
    async with trio.open_nursery() as nursery:
        await nursery.start(dq.run)
        dq.delete()  # run() ends with it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.diskqueue.000005.dat.bad", "e:ch.diskqueue.000000.dat"]


# --- put_many: one writev per run, the same bytes as one put() per record ---------------------------


@given(sizes=st.lists(st.integers(1, 90), min_size=1, max_size=300),
       cuts=st.lists(st.integers(1, 700), max_size=10), max_file=st.integers(20, 400))
@settings(max_examples=60, deadline=None)
def test_put_many_writes_the_files_one_put_per_record_writes(sizes, cuts, max_file):
    records = [bytes([65 + i % 26]) * size for i, size in enumerate(sizes)]
    with tempfile.TemporaryDirectory() as one, tempfile.TemporaryDirectory() as many:
        a = DiskQueue("q", one, min_msg_size=1, max_bytes_per_file=max_file)
        for r in records:
            a.put(r)
        b = DiskQueue("q", many, min_msg_size=1, max_bytes_per_file=max_file)
        pos = 0
        for cut in cuts + [len(records)]:
            b.put_many(records[pos:pos + cut])
            pos += cut
        assert (a.write_file_num, a.write_pos, a.depth()) == (b.write_file_num, b.write_pos, b.depth())
        names = sorted(os.listdir(one))
        assert names == sorted(os.listdir(many))
        for name in names:
            assert Path(one, name).read_bytes() == Path(many, name).read_bytes(), name
        assert drain(b) == records
        a._shut()
        b._shut()


def test_put_many_stops_at_a_bad_record_and_keeps_those_before(tmp_path):
    dq = DiskQueue("b", str(tmp_path), min_msg_size=2, max_msg_size=10)
    with pytest.raises(BackendError) as info:
        dq.put_many([b"ok1", b"ok2", b"x", b"never"])
    assert info.value.stored == 2 and "invalid message write size (1)" in str(info.value)
    assert dq.depth() == 2 and drain(dq) == [b"ok1", b"ok2"]


def test_put_many_on_a_full_disk_keeps_whole_runs_only(tmp_path):
    """A writev that the disk cuts short is cut back to the run's start: the file ends on a record
    boundary and `stored` counts the earlier runs only."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        dq = DiskQueue("f", str(mnt), min_msg_size=1, max_bytes_per_file=300_000)
        records = [b"%06d" % i + b"y" * 994 for i in range(2000)]  # 2 MB of records, 1 MB of disk
        with pytest.raises(BackendError) as info:
            dq.put_many(records)
        stored = info.value.stored
        assert 0 < stored < len(records)
        assert dq.depth() == stored
        files = sorted(mnt.glob("f.diskqueue.*.dat"))
        assert sum(f.stat().st_size for f in files) == stored * 1004  # whole records only
        assert drain(dq) == records[:stored]
        dq._shut()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# --- more cases (merged from the first generation of these tests) ----------------------------------


async def test_files_roll_before_a_record_would_pass_max_bytes(tmp_path):
    dq = DiskQueue("t", str(tmp_path), max_bytes_per_file=30, min_msg_size=1, max_msg_size=100)
    msgs = [b"a" * 10, b"b" * 10, b"c" * 5, b"d" * 20]
    for m in msgs:
        dq.put(m)
    await dq.close()
    # 14 + 14 > 30? no: 28 fits; the third (9 bytes) would pass 30, so it starts file 1; the fourth
    # (24) would take file 1 to 33, so file 2
    assert (tmp_path / "t.diskqueue.000000.dat").read_bytes() == rec(msgs[0]) + rec(msgs[1])
    assert (tmp_path / "t.diskqueue.000001.dat").read_bytes() == rec(msgs[2])
    assert (tmp_path / "t.diskqueue.000002.dat").read_bytes() == rec(msgs[3])
    assert (tmp_path / "t.diskqueue.meta.dat").read_bytes() == b"4\n0,0\n2,24\n"
    assert not list(tmp_path.glob("*.tmp"))


async def test_loads_a_directory_in_go_diskqueue_format(tmp_path):
    # as a Go nsqd would leave it: two files, the first partly read already
    (tmp_path / "topic:chan.diskqueue.000003.dat").write_bytes(rec(b"old") + rec(b"one") + rec(b"two"))
    (tmp_path / "topic:chan.diskqueue.000004.dat").write_bytes(rec(b"three"))
    (tmp_path / "topic:chan.diskqueue.meta.dat").write_text("3\n3,7\n4,9\n")
    dq = DiskQueue("topic:chan", str(tmp_path), min_msg_size=1)
    assert dq.depth() == 3
    assert drain(dq) == [b"one", b"two", b"three"]
    assert dq.depth() == 0
    assert not (tmp_path / "topic:chan.diskqueue.000003.dat").exists()  # read files are deleted
    await dq.close()


async def test_recovers_records_written_after_the_last_metadata_sync(tmp_path):
    dq = DiskQueue("r", str(tmp_path), min_msg_size=1)
    dq.put(b"synced")
    await dq.sync()
    dq.put(b"after-1")
    dq.put(b"after-2")
    # kill -9: no close(); the metadata still says one record, the file holds three and a torn tail
    with open(tmp_path / "r.diskqueue.000000.dat", "ab") as fh:
        fh.write(struct.pack(">i", 50) + b"torn")
    again = DiskQueue("r", str(tmp_path), min_msg_size=1)
    assert again.depth() == 3
    assert drain(again) == [b"synced", b"after-1", b"after-2"]
    again.put(b"next")
    assert drain(again) == [b"next"]


async def test_corrupt_length_and_truncated_file_are_skipped(tmp_path):
    dq = DiskQueue("c", str(tmp_path), max_bytes_per_file=20, min_msg_size=1, max_msg_size=100)
    for i in range(6):
        dq.put(b"msg-%d-pad" % i)  # 14 bytes a record: one per file
    await dq.close()
    with open(tmp_path / "c.diskqueue.000001.dat", "r+b") as fh:
        fh.write(struct.pack(">i", 10_000))  # impossible length
    with open(tmp_path / "c.diskqueue.000003.dat", "r+b") as fh:
        fh.truncate(8)  # truncated record
    dq = DiskQueue("c", str(tmp_path), max_bytes_per_file=20, min_msg_size=1, max_msg_size=100)
    assert drain(dq) == [b"msg-0-pad", b"msg-2-pad", b"msg-4-pad", b"msg-5-pad"]
    assert (tmp_path / "c.diskqueue.000001.dat.bad").exists()
    assert (tmp_path / "c.diskqueue.000003.dat.bad").exists()
    assert dq.depth() == 0
    dq.put(b"later")
    assert drain(dq) == [b"later"]


async def test_write_error_is_a_backend_error_and_nothing_accepted_is_lost(tmp_path):
    data_dir = tmp_path / "d"
    data_dir.mkdir()
    dq = DiskQueue("w", str(data_dir), max_bytes_per_file=20, min_msg_size=1)
    dq.put(b"first-accepted")
    os.rename(data_dir, tmp_path / "moved")  # the next file cannot be created
    with pytest.raises(BackendError):
        dq.put(b"second-refused")
    assert dq.depth() == 1
    os.rename(tmp_path / "moved", data_dir)
    dq.put(b"third-accepted")
    assert drain(dq) == [b"first-accepted", b"third-accepted"]


async def test_io_loop_syncs_every_n_writes(tmp_path):
    dq = DiskQueue("l", str(tmp_path), min_msg_size=1, sync_every=10, sync_timeout=3600)
    async with trio.open_nursery() as nursery:
        await nursery.start(dq.run)
        for i in range(25):
            dq.put(b"x")
        with trio.fail_after(5):
            # fsync_count counts a round when it starts; the metadata lands when its thread is done
            while dq.fsync_count < 1 or not (tmp_path / "l.diskqueue.meta.dat").exists():
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()


async def test_empty_and_delete(tmp_path):
    dq = DiskQueue("e", str(tmp_path), max_bytes_per_file=20, min_msg_size=1)
    for i in range(5):
        dq.put(b"0123456789")
    await dq.empty()
    assert dq.depth() == 0 and drain(dq) == []
    dq.put(b"fresh")
    assert drain(dq) == [b"fresh"]
    dq.delete()
    assert not list(tmp_path.iterdir())
