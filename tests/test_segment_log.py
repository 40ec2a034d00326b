"""SegmentLog against go-diskqueue: its exact files, loading its directories, recovery after kill -9,
corruption, write errors; readers by position."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import struct
from pathlib import Path

import pytest

import trio_nsq.broker.storage.segment_log as segment_log_module
from trio_nsq.broker.storage.backend import BackendError
from trio_nsq.broker.storage.segment_log import SegmentLog, remove_dropped

LOGGER = segment_log_module.log.name


def rec(data: bytes) -> bytes:
    """A record as go-diskqueue writes it, built by hand."""
    return struct.pack(">i", len(data)) + data


def data_file(d: Path, name: str, num: int) -> Path:
    return d / f"{name}.diskqueue.{num:06d}.dat"


def go_lines(d: Path, name: str) -> str:
    """The metadata's first three lines: what Go nsqd reads."""
    return "".join(line + "\n" for line in (d / f"{name}.diskqueue.meta.dat").read_text().split("\n")[:3])


def write_meta(log: SegmentLog, read_pos: int = -1, read_index: int = -1) -> None:
    """What a sync round does for the log's owner (no fsync needed here)."""
    if read_pos < 0:
        read_pos, read_index = log.start, log.start_index()
    Path(log.meta_file_name()).write_bytes(log.meta_bytes(read_pos, read_index))


def read_all(log: SegmentLog, pos: int = -1, index: int = -1) -> list[bytes]:
    if pos < 0:
        pos, index = log.start, log.start_index()
    reader = log.reader(pos, index)
    out: list[bytes] = []
    try:
        while records := reader.read(1 << 20, log.tail, []):  # a call stops where records were lost
            out.extend(records)
        return out
    finally:
        reader.close()


def crash_copy(src: Path, dst: Path) -> Path:
    """What a new process finds after kill -9: the files as they are now (the page cache)."""
    shutil.copytree(src, dst)
    return dst


def nsq_message(ts: int, attempts: int, msg_id: bytes, body: bytes) -> bytes:
    return struct.pack(">qH", ts, attempts) + msg_id + body


# --- go-diskqueue's bytes -------------------------------------------------------------------------


def test_files_and_metadata_are_byte_for_byte_go_diskqueue(tmp_path):
    log = SegmentLog("t", str(tmp_path), max_bytes_per_file=30, min_msg_size=0, max_msg_size=100)
    msgs = [b"", b"a" * 10, b"b" * 8, b"c", b"d" * 40, b"e"]
    positions: list[int] = []
    for m in msgs:
        log.append([m], positions)
    # 4 + 14 + 12 = 30 == max: the third still fits (go rolls only when writePos+total > max);
    # "c" would pass 30: file 1; "d" is longer than a file: file 2 on its own; "e": file 3
    assert (log.write_file_num, log.write_pos, log.tail_index) == (3, 5, 6)
    # positions run on through the files: each starts where the last one ended
    assert positions == [0, 4, 18, 30, 35, 79]
    assert [log.start_of(n) for n in range(4)] == [0, 30, 35, 79]
    assert [log.split(p) for p in positions] == [(0, 0), (0, 4), (0, 18), (1, 0), (2, 0), (3, 0)]
    write_meta(log)
    log.close()
    assert data_file(tmp_path, "t", 0).read_bytes() == rec(b"") + rec(b"a" * 10) + rec(b"b" * 8)
    assert data_file(tmp_path, "t", 1).read_bytes() == rec(b"c")
    assert data_file(tmp_path, "t", 2).read_bytes() == rec(b"d" * 40)
    assert data_file(tmp_path, "t", 3).read_bytes() == rec(b"e")
    assert go_lines(tmp_path, "t") == "6\n0,0\n3,5\n"
    # and beside each segment its CRC side file (checksums.py), a name Go nsqd never opens
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "t.diskqueue.000000.crc", "t.diskqueue.000000.dat", "t.diskqueue.000001.crc", "t.diskqueue.000001.dat",
        "t.diskqueue.000002.crc", "t.diskqueue.000002.dat", "t.diskqueue.000003.crc", "t.diskqueue.000003.dat",
        "t.diskqueue.meta.dat"]

    # reopened: the same tail, indices, and every record readable by position
    log = SegmentLog("t", str(tmp_path), max_bytes_per_file=30, min_msg_size=0, max_msg_size=100)
    assert (log.write_file_num, log.write_pos, log.tail_index) == (3, 5, 6)
    assert read_all(log) == msgs
    assert read_all(log, 30, 3) == msgs[3:]
    assert [log.index_of_file(n) for n in range(5)] == [0, 3, 4, 5, 6]
    # a reader at the second record of file 0 (index 1); the metadata's read position is the owner's
    write_meta(log, 18, 2)
    assert go_lines(tmp_path, "t") == "4\n0,18\n3,5\n"
    # files before the oldest one needed go after the metadata naming them no more
    dropped = log.drop_before(2)
    assert [(Path(p).name, bad) for p, bad in dropped] == [
        ("t.diskqueue.000000.dat", False), ("t.diskqueue.000000.crc", False),
        ("t.diskqueue.000001.dat", False), ("t.diskqueue.000001.crc", False)]
    write_meta(log)
    for path, bad in dropped:
        remove_dropped(path, bad, log.name)
    assert go_lines(tmp_path, "t") == "2\n2,0\n3,5\n"
    log.close()
    log = SegmentLog("t", str(tmp_path), max_bytes_per_file=30, min_msg_size=0, max_msg_size=100)
    assert (log.first_file, log.start_index()) == (2, 4)
    assert read_all(log) == msgs[4:]
    log.close()


def test_roll_and_resize_as_go_diskqueue_tests(tmp_path):
    # go-diskqueue's TestDiskQueueRoll: 11 messages of 10 bytes, files of 10 records
    msg = bytes(range(10))
    log = SegmentLog("roll", str(tmp_path), max_bytes_per_file=10 * 14, min_msg_size=10, max_msg_size=1024)
    for _ in range(11):
        log.append([msg])
    assert (log.write_file_num, log.write_pos, log.tail_index) == (1, 14, 11)
    assert read_all(log) == [msg] * 11
    write_meta(log)
    log.close()

    # TestDiskQueueResize: files written with a smaller max_bytes_per_file read back after a resize
    log = SegmentLog("resize", str(tmp_path), max_bytes_per_file=8 * 14, min_msg_size=10, max_msg_size=1024)
    log.append([bytes([i]) + msg[1:] for i in range(9)])
    assert (log.write_file_num, log.write_pos) == (1, 14)
    write_meta(log)
    log.close()
    log = SegmentLog("resize", str(tmp_path), max_bytes_per_file=10 * 14, min_msg_size=10, max_msg_size=1024)
    log.append([bytes([20 + i]) + msg[1:] for i in range(10)])
    assert (log.write_file_num, log.write_pos, log.tail_index) == (2, 14, 19)
    assert read_all(log) == [bytes([i]) + msg[1:] for i in [*range(9), *range(20, 30)]]
    log.close()
    assert not list(tmp_path.glob("*.bad"))


def test_fetch_reads_records_back_by_position_in_any_order(tmp_path):
    """A deferred record is read back by its position when due (LogReader.read_back): out of order,
    across segments, the write file included; a position where no record is raises."""
    log = SegmentLog("back", str(tmp_path), max_bytes_per_file=10 * 14, min_msg_size=10, max_msg_size=1024)
    records = [bytes([i]) * 10 for i in range(25)]
    positions: list[int] = []
    log.append(records, positions)
    assert log.write_file_num == 2
    fetcher = log.reader(positions[0], 0)
    try:
        order = [24, 3, 4, 17, 0, 12, 11, 24]
        assert [fetcher.fetch(positions[i]) for i in order] == [records[i] for i in order]
        with pytest.raises(ValueError):
            fetcher.fetch(log.tail)  # the end: nothing there yet
    finally:
        fetcher.close()
    log.close()


def test_loads_a_directory_written_by_go_nsqd(tmp_path):
    # a queue as Go nsqd leaves it: file 7 partly read, file 8 the write file, no line of ours
    name = "orders:billing"
    msgs = [nsq_message(1_700_000_000_000_000_000 + i, 1, b"%016x" % i, b"body-%d" % i) for i in range(5)]
    data_file(tmp_path, name, 7).write_bytes(rec(msgs[0]) + rec(msgs[1]) + rec(msgs[2]))
    data_file(tmp_path, name, 8).write_bytes(rec(msgs[3]) + rec(msgs[4]))
    first = len(rec(msgs[0]))
    size8 = len(rec(msgs[3]) + rec(msgs[4]))
    (tmp_path / f"{name}.diskqueue.meta.dat").write_text(f"4\n7,{first}\n8,{size8}\n")

    log = SegmentLog(name, str(tmp_path), min_msg_size=26, max_msg_size=1024 * 1024 + 26)
    assert log.meta_found and log.meta_read == (7, first)
    read_pos, read_index = log.position(7, first), log.meta_read_index
    assert read_pos == first  # a queue Go wrote: positions start at 0 at its read file
    assert log.tail_index - read_index == 4  # Go's depth, counted
    assert read_all(log, read_pos, read_index) == msgs[1:]
    extra = nsq_message(1_700_000_000_000_000_099, 1, b"%016x" % 99, b"new")
    log.append([extra])
    assert read_all(log, read_pos, read_index) == msgs[1:] + [extra]
    write_meta(log, read_pos, read_index)
    log.close()
    # appended in place, in the same format
    assert data_file(tmp_path, name, 8).read_bytes() == rec(msgs[3]) + rec(msgs[4]) + rec(extra)
    assert go_lines(tmp_path, name) == f"5\n7,{first}\n8,{size8 + len(rec(extra))}\n"
    assert not list(tmp_path.glob("*.bad")) and not list(tmp_path.glob("*.tmp"))


# --- crash recovery -------------------------------------------------------------------------------


def test_kill_9_recovers_records_after_the_last_metadata_write(tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    log = SegmentLog("k", str(live), max_bytes_per_file=40, min_msg_size=1)
    log.append([b"synced-1"])
    write_meta(log)
    for i in range(6):  # 14-byte records: two to a file, rolls the metadata has not seen
        log.append([b"after-%04d" % i])
    with open(data_file(live, "k", log.write_file_num), "ab") as fh:
        fh.write(struct.pack(">i", 50) + b"torn")
    again = SegmentLog("k", str(crash_copy(live, tmp_path / "after")), max_bytes_per_file=40, min_msg_size=1)
    assert again.tail_index == 7
    assert read_all(again) == [b"synced-1"] + [b"after-%04d" % i for i in range(6)]
    again.append([b"next"])
    assert read_all(again)[-1] == b"next" and again.tail_index == 8
    log.close()
    again.close()


def test_kill_9_before_any_metadata_after_rolls(tmp_path):
    data_file(tmp_path, "nm", 0).write_bytes(rec(b"a") + rec(b"bb"))
    data_file(tmp_path, "nm", 1).write_bytes(rec(b"ccc"))
    log = SegmentLog("nm", str(tmp_path), min_msg_size=1)
    assert (log.write_file_num, log.tail_index, log.index_of_file(1)) == (1, 3, 2)
    log.append([b"dddd"])
    assert read_all(log) == [b"a", b"bb", b"ccc", b"dddd"]
    log.close()


def test_a_missing_or_short_write_file_is_never_written_into(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    log = SegmentLog("tr", str(tmp_path), min_msg_size=1)
    log.append([b"record-%d" % i for i in range(4)])
    write_meta(log)
    log.close()
    os.truncate(data_file(tmp_path, "tr", 0), 3 * 12 + 5)  # the metadata says 48 bytes
    log = SegmentLog("tr", str(tmp_path), min_msg_size=1)
    assert log.write_file_num == 1  # never writes into (or past the end of) a damaged file
    log.append([b"later"])
    assert read_all(log) == [b"record-0", b"record-1", b"record-2", b"later"]
    assert "shorter (41) than metadata writePos 48" in caplog.text
    log.close()


def test_temp_files_a_crash_left_are_removed_at_open(tmp_path):
    (tmp_path / "x.diskqueue.meta.dat.123456.tmp").write_text("0\n0,0\n0,0\n")
    (tmp_path / "x.diskqueue.meta.dat.99.tmp").write_text("")
    (tmp_path / "y.diskqueue.meta.dat.5.tmp").write_text("")  # another log's: not ours to remove
    SegmentLog("x", str(tmp_path), min_msg_size=1).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["y.diskqueue.meta.dat.5.tmp"]


# --- corruption -----------------------------------------------------------------------------------

GO_MSG = bytes([91] + [0] * 61 + [4] + [0] * 56 + [211])  # 120 bytes: 124 a record, 8 to a 1000-byte file


@pytest.mark.parametrize("bad_length", [0, 9, -1, 1025, 0x7FFFFFF0])
def test_impossible_length_cuts_the_file_and_reading_goes_on(tmp_path, caplog, bad_length):
    caplog.set_level(logging.INFO, logger=LOGGER)
    log = SegmentLog("c", str(tmp_path), max_bytes_per_file=1000, min_msg_size=10, max_msg_size=1 << 10)
    log.append([bytes([i]) + GO_MSG[1:] for i in range(25)])
    write_meta(log)
    log.close()
    with open(data_file(tmp_path, "c", 1), "r+b") as fh:
        fh.seek(3 * 124)
        fh.write(struct.pack(">i", bad_length))
    log = SegmentLog("c", str(tmp_path), max_bytes_per_file=1000, min_msg_size=10, max_msg_size=1 << 10)
    got = read_all(log)  # no exception
    assert [m[0] for m in got] == [*range(0, 11), *range(16, 25)]
    assert f"invalid message read size ({bad_length})" in caplog.text
    assert [r.levelname for r in caplog.records if "the rest of the file is lost" in r.message] == ["ERROR"]
    # a second reader finds the same cut, and says nothing more
    assert [m[0] for m in read_all(log)] == [*range(0, 11), *range(16, 25)]
    assert caplog.text.count("the rest of the file is lost") == 1
    # once dropped, the cut file stays as .bad (go-diskqueue's evidence), the others go; side files all go
    for path, bad in log.drop_before(3):
        remove_dropped(path, bad, log.name)
    assert sorted(p.name for p in tmp_path.glob("c.diskqueue.0*")) == [
        "c.diskqueue.000001.dat.bad", "c.diskqueue.000003.crc", "c.diskqueue.000003.dat"]
    log.close()


def test_a_truncated_write_file_rolls_the_writer(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    log = SegmentLog("c", str(tmp_path), max_bytes_per_file=1000, min_msg_size=10, max_msg_size=1 << 10)
    log.append([GO_MSG, GO_MSG])
    os.truncate(data_file(tmp_path, "c", 0), 124 + 100)  # the second record torn under the writer
    assert read_all(log) == [GO_MSG]
    assert "unexpected EOF reading a record" in caplog.text
    assert log.write_file_num == 1  # later records go where a reader can find them
    log.append([GO_MSG])
    assert read_all(log) == [GO_MSG, GO_MSG]
    log.close()


# --- write errors ---------------------------------------------------------------------------------


def test_size_limits_as_go_diskqueue(tmp_path):
    log = SegmentLog("s", str(tmp_path), min_msg_size=2, max_msg_size=4)
    for bad in (b"x", b"xxxxx"):
        with pytest.raises(BackendError, match=r"invalid message write size \(\d\) minMsgSize=2 maxMsgSize=4"):
            log.append([bad])
    with pytest.raises(BackendError) as exc:
        log.append([b"xx", b"xxx", b"x", b"xxxx"])
    assert exc.value.stored == 2  # those before the bad one stay, as a row of single puts would
    assert data_file(tmp_path, "s", 0).read_bytes() == rec(b"xx") + rec(b"xxx")
    log.close()


def test_write_error_is_a_backend_error_and_the_log_recovers(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    health: list[tuple[int, str | None]] = []
    log = SegmentLog("w", str(tmp_path), max_bytes_per_file=20, min_msg_size=1,
                     on_write=lambda n, err: health.append((n, err)))
    log.append([b"first-acc"])  # 13 bytes: the next record rolls to file 1
    blocker = data_file(tmp_path, "w", 1)
    blocker.mkdir()  # file 1 cannot be opened for writing
    for _ in range(2):
        with pytest.raises(BackendError, match="failed to write to disk queue w"):
            log.append([b"refused"])
    assert log.tail_index == 1
    assert health[-1][1] is not None and "Is a directory" in health[-1][1]
    blocker.rmdir()
    log.append([b"third-acc"])
    assert health[-1] == (1, None)
    assert data_file(tmp_path, "w", 1).read_bytes() == rec(b"third-acc")
    assert read_all(log) == [b"first-acc", b"third-acc"]
    log.close()


def test_disk_full_short_write_is_cut_off(tmp_path, monkeypatch):
    log = SegmentLog("f", str(tmp_path), min_msg_size=1)
    log.append([b"kept"])
    real_write = os.write

    def to_segment(fd):
        return os.readlink(f"/proc/self/fd/{fd}").endswith(".dat")

    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, data[:3] if to_segment(fd) else data))
    with pytest.raises(BackendError, match="short write"):
        log.append([b"partial"])

    def enospc(fd, data):
        if to_segment(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", enospc)
    with pytest.raises(BackendError, match="No space left on device"):
        log.append([b"refused"])
    monkeypatch.setattr(os, "write", real_write)
    assert data_file(tmp_path, "f", 0).read_bytes() == rec(b"kept")  # no torn record left behind
    log.append([b"after"])
    assert read_all(log) == [b"kept", b"after"]
    log.close()


def test_data_directory_removed_then_restored(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    monkeypatch.setattr(segment_log_module, "LINK_CHECK_INTERVAL", 0.0)
    d = tmp_path / "data"
    d.mkdir()
    log = SegmentLog("gone", str(d), min_msg_size=1)
    log.append([b"before"])
    shutil.rmtree(d)
    with pytest.raises(BackendError):
        log.append([b"while-missing"])  # not swallowed by the unlinked file
    assert "was removed from the disk" in caplog.text
    d.mkdir()
    log.append([b"restored"])
    assert read_all(log, log.start_of(1), 1) == [b"restored"]
    log.close()


# --- reading --------------------------------------------------------------------------------------


def test_readers_follow_the_writer_through_rolls_each_at_its_own_place(tmp_path):
    log = SegmentLog("f", str(tmp_path), max_bytes_per_file=28, min_msg_size=1)
    fast = log.reader(0, 0)
    slow = log.reader(0, 0)
    got_fast: list[bytes] = []
    for i in range(40):
        log.append([b"m-%07d" % i])  # 13 bytes: a file of 28 holds exactly two
        if i % 2:
            positions: list[int] = []
            got_fast += fast.read(100, log.tail, positions)  # caught up at the very end of a file
            assert fast.index == log.tail_index
    assert got_fast == [b"m-%07d" % i for i in range(40)]
    positions = []
    assert slow.read(100, log.tail, positions) == got_fast and slow.index == 40
    assert positions[:3] == [0, 13, 26]
    assert slow.read(100, log.tail, []) == []  # at the tail: nothing, and still there
    log.append([b"late"])
    assert slow.read(100, log.tail, []) == [b"late"]
    assert not list(tmp_path.glob("*.bad"))
    fast.close()
    slow.close()
    log.close()


def test_a_reader_stops_where_it_is_told(tmp_path):
    log = SegmentLog("u", str(tmp_path), min_msg_size=1)
    positions: list[int] = []
    log.append([b"a", b"b", b"c"], positions)
    reader = log.reader(0, 0)
    assert reader.read(10, positions[2], []) == [b"a", b"b"]  # not past what is handed over
    assert reader.read(10, log.tail, []) == [b"c"]
    reader.close()
    log.close()
