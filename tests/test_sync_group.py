"""SyncGroup: group commit over a topic's files, failures that reach every waiter and are never reported
durable afterwards, health, and when the io_loop syncs (every N changes, at once on a roll, on a timeout
only when something happened). Members are a TopicLog and its channels' cursors, as in a broker."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
import trio

from trio_nsq.broker.storage.backend import BackendError
from trio_nsq.broker.message import encode_record
from trio_nsq.broker.storage.cursor import Cursor
from trio_nsq.broker.storage.sync_group import META_INTERVAL, SyncGroup
from trio_nsq.broker.storage.topic_log import TopicLog


def record(body: bytes, i: int = 0) -> bytes:
    """A message's record (a topic's log holds messages: what is not one past the persisted write
    position is taken for what a power loss left, and cut off at open)."""
    return encode_record(1, 0, b"%016x" % i, body)


def open_log(d: Path, group: SyncGroup, max_bytes: int = 1 << 20) -> TopicLog:
    return TopicLog("g", str(d), group, max_bytes_per_file=max_bytes, min_msg_size=1, max_msg_size=1024)


def go_lines(d: Path, name: str) -> str:
    return "".join(line + "\n" for line in (d / f"{name}.diskqueue.meta.dat").read_text().split("\n")[:3])


@pytest.mark.parametrize("with_io_loop", [False, True])
async def test_group_commit_shares_fsyncs(tmp_path, with_io_loop):
    d = tmp_path / "live"
    d.mkdir()
    group = SyncGroup("g", str(d), sync_every=1)
    log = open_log(d, group)
    reader = log.reader_for("g:c", durable=True)
    acked = []

    async def publisher(i):
        log.append([record(b"p%03d" % i, i)])
        await group.sync()
        acked.append(i)

    async with trio.open_nursery() as nursery:
        if with_io_loop:
            await nursery.start(group.run)
        async with trio.open_nursery() as publishers:
            for i in range(200):
                publishers.start_soon(publisher, i)
        nursery.cancel_scope.cancel()
    assert len(acked) == 200
    assert 1 <= group.fsync_count <= 20, group.fsync_count
    assert (d / "g.diskqueue.meta.dat").exists() and (d / "g:c.cursor.dat").exists()
    after = shutil.copytree(d, tmp_path / "after")
    again = open_log(after, SyncGroup("g", str(after)))
    positions: list[int] = []
    records = again.segments.reader(0, 0).read(1000, again.segments.tail, positions)
    assert sorted(r[26:] for r in records) == [b"p%03d" % i for i in range(200)]
    assert reader.cursor.read_pos == 0
    log.close()
    again.close()


async def test_sync_with_nothing_new_is_free_and_failures_reach_every_waiter(tmp_path, monkeypatch, caplog):
    group = SyncGroup("s", str(tmp_path))
    log = open_log(tmp_path, group)
    await group.sync()
    assert group.fsync_count == 0
    log.append([b"a"])
    await group.sync()
    await group.sync()
    assert group.fsync_count == 1

    real_fsync = os.fsync

    def broken(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", broken)
    errors = []

    async def publisher(i):
        log.append([b"b%d" % i])
        try:
            await group.sync()
        except BackendError as exc:
            errors.append(exc)

    before = group.fsync_count
    async with trio.open_nursery() as nursery:
        for i in range(10):
            nursery.start_soon(publisher, i)
    assert len(errors) == 10 and "Input/output error" in str(errors[0])
    assert group.fsync_count - before <= 2
    assert "DISKQUEUE(s) failed to sync" in caplog.text
    monkeypatch.setattr(os, "fsync", real_fsync)
    with pytest.raises(BackendError):
        await group.sync()  # those records' fsync failed: a later success proves nothing about them
    log.append([b"c"])
    await group.sync()  # the disk is back: new records are durable again, and the metadata with them
    assert go_lines(tmp_path, "g").startswith("12\n")
    log.close()


async def test_a_record_whose_fsync_failed_is_never_reported_durable(tmp_path, monkeypatch):
    """The io loop's round fails while a publisher has not yet asked for sync(): the publisher's later
    sync() must fail too, even though the fsync it would start now succeeds (Linux may have dropped the
    failed pages and marked them clean). Health follows: failing, then healthy after a good round."""
    health: list[str | None] = []
    group = SyncGroup("p", str(tmp_path), sync_every=1, on_health=health.append)
    log = open_log(tmp_path, group)

    def broken(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    log.append([b"before"])
    await group.sync()
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", broken)
    log.append([b"lost"])
    async with trio.open_nursery() as nursery:
        await nursery.start(group.run)  # the io loop syncs at once (sync_every=1) and fails
        with trio.fail_after(5):
            while not health:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert health[-1] is not None and "Input/output error" in health[-1]
    monkeypatch.setattr(os, "fsync", real_fsync)
    with pytest.raises(BackendError):
        await group.sync()
    log.append([b"after"])
    await group.sync()
    assert health[-1] is None
    log.close()


async def wait_go_lines(d: Path, name: str, want: str) -> None:
    with trio.fail_after(5):
        while True:
            try:
                if go_lines(d, name) == want:
                    return
            except FileNotFoundError:
                pass
            await trio.sleep(0.005)


async def wait_rounds(group: SyncGroup, n: int) -> None:
    with trio.fail_after(5):
        while group.fsync_count < n or group._round is not None:
            await trio.sleep(0.005)


async def test_a_round_of_fins_appends_the_cursor_and_writes_metadata_only_now_and_then(tmp_path):
    """Rounds that only persist FINs append a few bytes to the cursor's file; the log's metadata is
    written when a segment rolls or goes, at the last round, and at most every META_INTERVAL otherwise."""
    now = [100.0]
    group = SyncGroup("m", str(tmp_path), clock=lambda: now[0])
    log = open_log(tmp_path, group)
    reader = log.reader_for("g:c", durable=True)
    log.append([encode_record(0, 0, b"%016d" % i, b"x") for i in range(50)])
    log.dispatch()
    await group.sync_round()
    meta = tmp_path / "g.diskqueue.meta.dat"
    cursor_file = tmp_path / "g:c.cursor.dat"
    first, size = meta.stat().st_ino, cursor_file.stat().st_size
    for _ in range(5):
        batch = reader.read(10, log.segments.tail)
        reader.finish_many(batch.positions)
        await group.sync_round()
        assert meta.stat().st_ino == first  # not rewritten
        assert cursor_file.stat().st_size > size  # a block appended
        size = cursor_file.stat().st_size
    assert go_lines(tmp_path, "g") == "50\n0,0\n0,1550\n"  # Go's view: stale, so more comes again
    now[0] += META_INTERVAL
    group.changed()
    await group.sync_round()
    assert meta.stat().st_ino != first and go_lines(tmp_path, "g") == "0\n0,1550\n0,1550\n"
    await group.close()
    log.close()


async def test_io_loop_syncs_every_n_changes(tmp_path):
    group = SyncGroup("l", str(tmp_path), sync_every=10, sync_timeout=3600)
    log = open_log(tmp_path, group)
    reader = log.reader_for("g:c", durable=True)
    record = encode_record(0, 0, b"0" * 16, b"x")  # 27 bytes, 31 with its length
    async with trio.open_nursery() as nursery:
        await nursery.start(group.run)
        for _ in range(9):
            log.append([record])
        await trio.sleep(0.05)
        assert group.fsync_count == 0
        log.append([record])  # the 10th
        log.dispatch()
        await wait_rounds(group, 1)
        batch = reader.read(10, log.segments.tail)
        reader.finish_many(batch.positions)  # a channel's FINs count too
        await wait_rounds(group, 2)
        cursor, _ = Cursor.load((tmp_path / "g:c.cursor.dat").read_bytes(), log.segments.epoch)
        assert cursor.read_pos == 310  # the FINs are what that round persisted
        nursery.cancel_scope.cancel()
    log.close()


async def test_io_loop_syncs_at_once_when_a_file_rolls(tmp_path):
    group = SyncGroup("l", str(tmp_path), sync_every=2500, sync_timeout=3600)
    log = open_log(tmp_path, group, max_bytes=10)
    async with trio.open_nursery() as nursery:
        await nursery.start(group.run)
        log.append([b"12345"])
        log.append([b"12345"])  # 9 + 9 > 10: a new write file
        await wait_go_lines(tmp_path, "g", "2\n0,0\n1,9\n")
        assert group.fsync_count == 1
        nursery.cancel_scope.cancel()
    log.close()


async def test_io_loop_syncs_on_timeout_only_when_something_happened(tmp_path):
    group = SyncGroup("l", str(tmp_path), sync_every=2500, sync_timeout=0.05)
    log = open_log(tmp_path, group)
    async with trio.open_nursery() as nursery:
        await nursery.start(group.run)
        await trio.sleep(0.2)
        assert group.fsync_count == 0  # nothing happened: nothing to sync
        log.append([b"x"])
        await wait_go_lines(tmp_path, "g", "1\n0,0\n0,5\n")
        count = group.fsync_count
        await trio.sleep(0.2)
        assert group.fsync_count == count  # idle again
        await group.close()  # and run() ends by itself
    assert group.fsync_count == count + 1
    log.close()
