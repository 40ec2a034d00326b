"""DiskQueue alone: go-diskqueue's exact bytes, loading its files, a model test, corruption, errors, group commit."""

from __future__ import annotations

import shutil

import os
import struct
from collections import deque

import pytest
import trio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from broker.backend import BackendError
from broker.diskqueue import DiskQueue


def record(data: bytes) -> bytes:
    return struct.pack(">i", len(data)) + data


def drain(dq: DiskQueue) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(dq.read_nowait())
        except trio.WouldBlock:
            return out


async def test_files_are_byte_for_byte_go_diskqueue(tmp_path):
    dq = DiskQueue("t", str(tmp_path), max_bytes_per_file=30, min_msg_size=1, max_msg_size=100)
    msgs = [b"a" * 10, b"b" * 10, b"c" * 5, b"d" * 20]
    for m in msgs:
        dq.put(m)
    await dq.close()
    # 14 + 14 > 30? no: 28 fits; the third (9 bytes) would pass 30, so it starts file 1; the fourth
    # (24) would take file 1 to 33, so file 2
    assert (tmp_path / "t.diskqueue.000000.dat").read_bytes() == record(msgs[0]) + record(msgs[1])
    assert (tmp_path / "t.diskqueue.000001.dat").read_bytes() == record(msgs[2])
    assert (tmp_path / "t.diskqueue.000002.dat").read_bytes() == record(msgs[3])
    assert (tmp_path / "t.diskqueue.meta.dat").read_bytes() == b"4\n0,0\n2,24\n"
    assert not list(tmp_path.glob("*.tmp"))


async def test_loads_a_directory_in_go_diskqueue_format(tmp_path):
    # as a Go nsqd would leave it: two files, the first partly read already
    (tmp_path / "topic:chan.diskqueue.000003.dat").write_bytes(record(b"old") + record(b"one") + record(b"two"))
    (tmp_path / "topic:chan.diskqueue.000004.dat").write_bytes(record(b"three"))
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


class DiskQueueModel(RuleBasedStateMachine):
    """put/read/close+reopen against a deque: same order, no loss, no duplicate, exact depth."""

    def __init__(self):
        super().__init__()
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="dq-model-")
        self.model: deque[bytes] = deque()
        self.dq = self._open()
        self.n = 0

    def _open(self) -> DiskQueue:
        return DiskQueue("m", self.dir, max_bytes_per_file=64, min_msg_size=1, max_msg_size=40)

    @rule(size=st.integers(1, 40))
    def put(self, size):
        self.n += 1
        data = (b"%d:" % self.n + b"x" * size)[:size]
        self.dq.put(data)
        self.model.append(data)

    @rule()
    def read(self):
        try:
            got = self.dq.read_nowait()
        except trio.WouldBlock:
            assert not self.model
        else:
            assert got == self.model.popleft()

    @rule()
    def reopen(self):
        trio.run(self.dq.close)
        self.dq = self._open()

    @precondition(lambda self: True)
    @invariant()
    def depth(self):
        assert self.dq.depth() == len(self.model)

    def teardown(self):
        self.dq.delete()
        shutil.rmtree(self.dir, ignore_errors=True)  # the directory too: tests leave nothing in /tmp


TestDiskQueueModel = DiskQueueModel.TestCase
TestDiskQueueModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


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


def test_size_limits(tmp_path):
    dq = DiskQueue("s", str(tmp_path), min_msg_size=2, max_msg_size=4)
    for bad in (b"x", b"xxxxx"):
        with pytest.raises(BackendError):
            dq.put(bad)
    assert dq.depth() == 0


async def test_group_commit_shares_fsyncs(tmp_path):
    dq = DiskQueue("g", str(tmp_path), min_msg_size=1, sync_every=1)
    done = []

    async def publisher(i):
        dq.put(b"p%d" % i)
        await dq.sync()
        done.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(200):
            nursery.start_soon(publisher, i)
    assert len(done) == 200
    assert 1 <= dq.fsync_count <= 20, dq.fsync_count
    # everything acknowledged is in the files the metadata describes
    again = DiskQueue("g", str(tmp_path), min_msg_size=1)
    assert sorted(drain(again)) == sorted(b"p%d" % i for i in range(200))


async def test_io_loop_syncs_every_n_writes(tmp_path):
    dq = DiskQueue("l", str(tmp_path), min_msg_size=1, sync_every=10, sync_timeout=3600)
    async with trio.open_nursery() as nursery:
        await nursery.start(dq.run)
        for i in range(25):
            dq.put(b"x")
        with trio.fail_after(5):
            while dq.fsync_count < 1:
                await trio.sleep(0.01)
        assert (tmp_path / "l.diskqueue.meta.dat").exists()
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
