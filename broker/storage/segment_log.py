"""SegmentLog: go-diskqueue's files as an append-only log that any number of readers read by position.

Files, in the data directory (byte for byte those of github.com/nsqio/go-diskqueue, so Go nsqd reads them):
- segments `<name>.diskqueue.%06d.dat`: records `[length int32 BE][bytes]`; a record goes to a new file
  when the current one is not empty and the record would take it past max_bytes_per_file (a file ends at
  most max_bytes_per_file long, or holds a single longer record);
- meta `<name>.diskqueue.meta.dat`: "depth\\nreadFileNum,readPos\\nwriteFileNum,writePos\\n", written to a
  temp file, fsynced and renamed. Its owner says what the read position is (the oldest record a reader
  still needs: what Go nsqd would deliver from) and may add lines after Go's three (`trio-nsq-log 1`:
  the log's epoch, the first record index of each segment, the index at the write position, and the
  owner's own lines); Go's Fscanf reads the three and stops.

A record's position is `file << 40 | offset`: stable, ordered as the log, the same on every copy of the
files. Each record also has an index (its number in the log), so the records between two positions are
counted by a subtraction. What go-diskqueue did that stays: the put size check, when a file rolls, a
record length outside [min, max] or a short read cutting the file there (Go renames it `.bad` and
skips to the next; the write file rolls when it is the one cut), a torn record at the end cut off.

What is not go-diskqueue's: reading does not consume (readers are SegmentReaders with a position of their
own); files go only when the owner says so (drop_before), after the metadata that no longer needs them is
persisted; a kill -9 loses nothing written (records past the persisted write position are recovered at
open, in order, with their indices); fsync is not done here but by the owner's sync round (SyncGroup),
which asks `unsynced_files()`. Temp files a crash left behind are removed at open.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import time
from collections.abc import Callable, Sequence

from trio_nsq.broker.storage.backend import BackendError
from trio_nsq.broker.storage.files import close_quietly, remove_quietly
from trio_nsq.shared.protocol import INT32, int32_at

log = logging.getLogger("nsqd")

POS_SHIFT = 40
OFFSET_MASK = (1 << POS_SHIFT) - 1
# how often append() checks that its write file still has a name on disk
LINK_CHECK_INTERVAL = 0.1
# records per writev: two buffers each, within Linux's IOV_MAX of 1024
_IOV_RECORDS = 512
# a reader's block: it drains records in batches, so fewer, larger reads
_READ_BUFFER = 256 * 1024
EXT_HEADER = "trio-nsq-log 1"


def position(num: int, offset: int) -> int:
    return (num << POS_SHIFT) | offset


def numbered_files(data_path: str, stem: str) -> list[int]:
    """The numbers N of the files `<stem>.N.dat` in data_path (N written with six digits or more), in
    order; none when the directory cannot be read. A log's segments, and a topic log's deadline files."""
    mine = re.compile(re.escape(stem) + r"\.(\d{6,})\.dat\Z")
    try:
        names = os.listdir(data_path)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(mine.match, names) if m is not None)


class SegmentLog:
    """Owned by a TopicLog (a topic's messages) or a LogReader (a channel's own queue); they append, read
    through SegmentReaders, and tell it which files may go. Synchronous: writes go straight to the OS from
    the event loop (microseconds); fsync is the sync round's, in a thread."""

    def __init__(
        self,
        name: str,
        data_path: str,
        *,
        max_bytes_per_file: int = 100 * 1024 * 1024,
        min_msg_size: int = 26,
        max_msg_size: int = 1024 * 1024 + 26,
        on_write: Callable[[int, str | None], None] | None = None,
    ) -> None:
        self.name = name
        self.data_path = data_path
        self.max_bytes_per_file = max_bytes_per_file
        self.min_msg_size = min_msg_size
        self.max_msg_size = max_msg_size
        # told of every append (records stored, or the error that stopped it) and of a roll (0, None)
        self._on_write = on_write

        self.write_file_num = 0
        self.write_pos = 0
        self.tail_index = 0  # the index the next record gets
        self.first_file = 0  # the oldest segment kept
        self._first_index: dict[int, int] = {0: 0}  # segment -> index of its first record
        self._cut: dict[int, int] = {}  # segment -> where a bad record cut it
        self._write_fd: int | None = None
        self._last_link_check = 0.0
        self._unsynced_from: int | None = None  # the first segment written since the last round
        self._files_changed = False  # a segment was created, dropped or cut since the last round
        self.closed = False
        self.appended = 0  # records appended by this process

        # what the metadata said: Go's read position and depth, and our lines after them
        self.meta_read = (0, 0)
        self.meta_read_index = 0
        self.meta_depth = 0
        self.meta_found = False  # a metadata file was there
        self.epoch = 0  # ties cursor files to these files: 0 until an extension is found or made
        self.extension: dict[str, str] = {}  # our owner's lines (`key value`)

        self._remove_temp_files()
        self._retrieve_metadata()
        self._recover_tail()

    def __repr__(self) -> str:
        return f"SegmentLog({self.name})"

    # --- files --------------------------------------------------------------------------------

    def file_name(self, num: int) -> str:
        return os.path.join(self.data_path, f"{self.name}.diskqueue.{num:06d}.dat")

    def meta_file_name(self) -> str:
        return os.path.join(self.data_path, f"{self.name}.diskqueue.meta.dat")

    def _existing_files(self) -> list[int]:
        return numbered_files(self.data_path, f"{self.name}.diskqueue")

    def _remove_temp_files(self) -> None:
        """A crash during a metadata write leaves `<meta>.<random>.tmp`: never read, so removed."""
        temp = re.compile(re.escape(self.name) + r"\.diskqueue\.meta\.dat\.\d+\.tmp\Z")
        try:
            names = os.listdir(self.data_path)
        except OSError:
            return
        for entry in names:
            if temp.match(entry):
                remove_quietly(os.path.join(self.data_path, entry))

    def _retrieve_metadata(self) -> None:
        path = self.meta_file_name()
        try:
            with open(path, "rb") as fh:
                lines = fh.read().decode("ascii").split("\n")
            depth = int(lines[0])
            read_num, read_pos = (int(x) for x in lines[1].split(","))
            write_num, write_pos = (int(x) for x in lines[2].split(","))
        except FileNotFoundError:
            self.epoch = random.getrandbits(63) or 1
            return
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            log.error("DISKQUEUE(%s) failed to retrieveMetaData - %s: %s", self.name, path, exc)
            self.epoch = random.getrandbits(63) or 1
            return
        self.meta_found = True
        self.meta_depth = depth
        self.meta_read = (read_num, read_pos)
        self.write_file_num, self.write_pos = write_num, write_pos
        if not self._load_extension(lines[3:]):
            # written by Go (or before trio-nsq kept a log): count the records from the read position
            self.epoch = random.getrandbits(63) or 1
            self._count_go_queue(read_num, read_pos)

    def _load_extension(self, lines: list[str]) -> bool:
        if not lines or lines[0] != EXT_HEADER:
            return False
        ext: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                key, _, value = line.partition(" ")
                ext[key] = value
        try:
            epoch = int(ext.pop("epoch"), 16)
            first = {int(k): int(v) for k, v in (x.split(":") for x in ext.pop("segments").split(" ") if x)}
            tail = int(ext.pop("tail"))
        except (KeyError, ValueError) as exc:
            log.error("DISKQUEUE(%s) ignoring unreadable log state in %s - %s", self.name, self.meta_file_name(), exc)
            return False
        self.epoch = epoch
        self._first_index = first or {self.write_file_num: tail}
        self._first_index.setdefault(self.write_file_num, tail)
        self.first_file = min(self._first_index)
        self.tail_index = tail
        self.extension = ext
        return True

    def _count_go_queue(self, read_num: int, read_pos: int) -> None:
        """Indices for a queue Go wrote: go-diskqueue deletes a file once read, so the read file still
        holds its records from offset 0; count them to the persisted write position."""
        self.first_file = read_num
        index = 0
        self._first_index = {}
        for num in range(read_num, self.write_file_num + 1):
            self._first_index[num] = index
            end = self.write_pos if num == self.write_file_num else None
            try:
                size = os.path.getsize(self.file_name(num))
            except OSError:
                continue
            _, count = self._scan(num, 0, size if end is None else min(end, size))
            index += count
            if num == read_num:
                self.meta_read_index = self._count_before(num, read_pos)
        self.tail_index = index

    def _count_before(self, num: int, offset: int) -> int:
        try:
            size = os.path.getsize(self.file_name(num))
        except OSError:
            return 0
        return self._scan(num, 0, min(offset, size))[1]

    def _recover_tail(self) -> None:
        """Count in the records written after the metadata was last persisted: past the write position in
        the write file, then in the files a roll had started since."""
        num, pos = self.write_file_num, self.write_pos
        recovered = 0
        while True:
            path = self.file_name(num)
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                later = [n for n in self._existing_files() if n > num]
                if later:
                    log.warning("DISKQUEUE(%s) %s is missing (metadata writePos %d), recovering from %s",
                                self.name, path, pos, self.file_name(later[0]))
                    num, pos = later[0], 0
                    self.write_file_num, self.write_pos = num, 0
                    self._first_index[num] = self.tail_index
                    continue
                if pos == 0:
                    break
                log.error("DISKQUEUE(%s) %s is missing (metadata writePos %d), moving to a new file",
                          self.name, path, pos)
                size = -1
            if size < pos:
                if size >= 0:
                    log.error("DISKQUEUE(%s) %s is shorter (%d) than metadata writePos %d, moving to a new file",
                              self.name, path, size, pos)
                num, pos = num + 1, 0
                self.write_file_num, self.write_pos = num, 0
                self._first_index[num] = self.tail_index
                continue
            end, count = self._scan(num, pos, size)
            if end < size:
                log.warning("DISKQUEUE(%s) cutting %d bytes of a torn record off the end of %s",
                            self.name, size - end, path)
                os.truncate(path, end)
            if count:
                log.info("DISKQUEUE(%s) recovered %d records past writePos %d in %s (written after the "
                         "last metadata sync)", self.name, count, pos, path)
            recovered += count
            self.tail_index += count
            self.write_file_num, self.write_pos = num, end
            num, pos = num + 1, 0
            if not os.path.exists(self.file_name(num)):
                break
            self._first_index[num] = self.tail_index
        if self.write_file_num not in self._first_index:
            self._first_index[self.write_file_num] = self.tail_index - self._count_before(self.write_file_num, self.write_pos)
        if self.first_file > self.write_file_num:
            self.first_file = self.write_file_num

    def _scan(self, num: int, pos: int, size: int) -> tuple[int, int]:
        """(end of the last whole, valid record from pos, how many records) in segment num up to size."""
        count = 0
        if size <= pos:
            return pos, 0
        with open(self.file_name(num), "rb") as fh:
            fh.seek(pos)
            while pos + 4 <= size:
                header = fh.read(4)
                if len(header) < 4:
                    break
                (length,) = INT32.unpack(header)
                if length < self.min_msg_size or length > self.max_msg_size or pos + 4 + length > size:
                    break
                fh.seek(length, os.SEEK_CUR)
                pos += 4 + length
                count += 1
        return pos, count

    # --- metadata -----------------------------------------------------------------------------

    def meta_bytes(self, read_pos: int, read_index: int, extra: Sequence[str] = ()) -> bytes:
        """The metadata file: Go's three lines with this read position (and the depth from it to the
        tail), then ours."""
        segments = " ".join(f"{num}:{self._first_index[num]}" for num in sorted(self._first_index))
        lines = [f"{self.tail_index - read_index}", f"{read_pos >> POS_SHIFT},{read_pos & OFFSET_MASK}",
                 f"{self.write_file_num},{self.write_pos}", EXT_HEADER, f"epoch {self.epoch:x}",
                 f"segments {segments}", f"tail {self.tail_index}", *extra, ""]
        return "\n".join(lines).encode()

    def take_unsynced(self) -> list[str]:
        """The segments written since the last call (a sync round fsyncs them)."""
        first = self._unsynced_from
        self._unsynced_from = None
        if first is None:
            return []
        return [self.file_name(n) for n in range(first, self.write_file_num + 1)]

    def take_files_changed(self) -> bool:
        """Whether a segment was created, dropped or cut since the last call (the metadata must say so,
        and the directory be fsynced)."""
        changed, self._files_changed = self._files_changed, False
        return changed

    def unsynced_again(self, paths: list[str]) -> None:
        """A round that was to fsync these failed: the next one does them again."""
        if paths:
            first = int(paths[0].rsplit(".", 2)[-2])
            self._unsynced_from = first if self._unsynced_from is None else min(first, self._unsynced_from)

    # --- positions ----------------------------------------------------------------------------

    @property
    def tail(self) -> int:
        """The position the next record gets (unless it rolls)."""
        return position(self.write_file_num, self.write_pos)

    @property
    def start(self) -> int:
        return position(self.first_file, 0)

    def start_index(self) -> int:
        return self._first_index.get(self.first_file, self.tail_index)

    def index_of_file(self, num: int) -> int:
        """The index of segment num's first record (the tail's index past the last segment)."""
        while num <= self.write_file_num:
            index = self._first_index.get(num)
            if index is not None:
                return index
            num += 1
        return self.tail_index

    def segment_bytes(self) -> int:
        """The bytes of every segment kept."""
        total = 0
        for num in range(self.first_file, self.write_file_num):
            total += self._size(num)
        return total + self.write_pos

    def _size(self, num: int) -> int:
        if num == self.write_file_num:
            return self.write_pos
        cut = self._cut.get(num)
        if cut is not None:
            return cut
        try:
            return os.path.getsize(self.file_name(num))
        except OSError:
            return 0

    def segments(self) -> list[int]:
        return list(range(self.first_file, self.write_file_num + 1))

    def segment_mtime(self, num: int) -> float:
        try:
            return os.path.getmtime(self.file_name(num))
        except OSError:
            return 0.0

    # --- writing ------------------------------------------------------------------------------

    def append(self, records: Sequence[bytes], positions: list[int] | None = None) -> None:
        """Append records in order, one writev per run that goes to the same file (the same records,
        files and rolls as go-diskqueue's one put each). Raises BackendError (with `.stored`, how many of
        the first records were stored) at the first record that cannot be stored. `positions` gets each
        stored record's position."""
        if self.closed:
            raise BackendError("exiting")
        if self._write_fd is not None:
            now = time.monotonic()
            if now - self._last_link_check >= LINK_CHECK_INTERVAL:
                self._check_write_file_linked(now)
        min_size, max_size, max_file = self.min_msg_size, self.max_msg_size, self.max_bytes_per_file
        pack = INT32.pack
        n = len(records)
        stored = 0
        while stored < n:
            length = len(records[stored])
            if self.write_pos > 0 and self.write_pos + 4 + length > max_file:
                self._next_write_file()
            # the run: records that fit in this file (a first record alone may be longer than a file)
            iov: list[bytes] = []
            pos = self.write_pos
            end = stored
            bad = None
            base = self.write_file_num << POS_SHIFT
            while end < n and len(iov) < _IOV_RECORDS * 2:
                data = records[end]
                length = len(data)
                if length < min_size or length > max_size:
                    bad = (f"invalid message write size ({length}) "
                           f"minMsgSize={min_size} maxMsgSize={max_size}")
                    break
                if (pos > self.write_pos or end > stored) and pos + 4 + length > max_file:
                    break
                iov.append(pack(length))
                iov.append(data)
                if positions is not None:
                    positions.append(base | pos)
                pos += 4 + length
                end += 1
            if iov:
                try:
                    self._write_run(iov, pos - self.write_pos, end - stored, stored)
                except BackendError:
                    if positions is not None:
                        del positions[len(positions) - (end - stored):]  # not stored
                    raise
                stored = end
            if bad is not None:
                raise BackendError(bad, stored)

    def next_position(self, length: int) -> int:
        """The position append() gives a record of `length` bytes now."""
        if self.write_pos > 0 and self.write_pos + 4 + length > self.max_bytes_per_file:
            return position(self.write_file_num + 1, 0)
        return self.tail

    def _write_run(self, iov: list[bytes], total: int, count: int, stored: int) -> None:
        """One writev of `count` records to the write file; on failure none of them counts."""
        try:
            fd = self._write_fd
            if fd is None:
                fd = self._open_write_file()
            written = os.writev(fd, iov)
            if written != total:
                # disk full part way: cut the piece off so the file still ends on a record boundary
                try:
                    os.ftruncate(fd, self.write_pos)
                except OSError:
                    pass  # the next open seeks to write_pos and writes over it
                raise OSError(errno.ENOSPC, f"short write ({written} of {total} bytes)")
        except OSError as exc:
            self._close_write_fd()
            log.error("DISKQUEUE(%s): failed to write - %s", self.name, exc)
            error = f"failed to write to disk queue {self.name} - {exc}"
            if self._on_write is not None:
                self._on_write(0, error)
            raise BackendError(error, stored) from None
        self.write_pos += total
        self.tail_index += count
        self.appended += count
        if self._unsynced_from is None:
            self._unsynced_from = self.write_file_num
        if self._on_write is not None:
            self._on_write(count, None)

    def _open_write_file(self) -> int:
        path = self.file_name(self.write_file_num)
        if self.write_pos == 0:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            self._files_changed = True
        else:
            # records before write_pos must be there: never create it, nor write past its end
            try:
                fd = os.open(path, os.O_WRONLY)
            except FileNotFoundError:
                log.error("DISKQUEUE(%s) %s is missing (writePos %d), moving to a new file",
                          self.name, path, self.write_pos)
                self._next_write_file()
                return self._open_write_file()
            try:
                size = os.fstat(fd).st_size
                if size < self.write_pos:
                    log.error("DISKQUEUE(%s) %s is shorter (%d) than writePos %d, moving to a new file",
                              self.name, path, size, self.write_pos)
                    os.close(fd)
                    self._next_write_file()
                    return self._open_write_file()
                os.lseek(fd, self.write_pos, os.SEEK_SET)
            except OSError:
                os.close(fd)
                raise
        log.info("DISKQUEUE(%s): writeOne() opened %s", self.name, path)
        self._write_fd = fd
        self._last_link_check = time.monotonic()
        return fd

    def _next_write_file(self) -> None:
        """Roll: later records go to the next file (the owner's round fsyncs both)."""
        if self.write_pos > 0 and self._unsynced_from is None:
            self._unsynced_from = self.write_file_num
        self._close_write_fd()
        self.write_file_num += 1
        self.write_pos = 0
        self._first_index[self.write_file_num] = self.tail_index
        if self._on_write is not None:
            self._on_write(0, None)

    def _check_write_file_linked(self, now: float) -> None:
        """A write file deleted under us (rm -rf of the data directory) would swallow writes into an
        unlinked inode: notice it, at most LINK_CHECK_INTERVAL late, and reopen (which then fails loudly)."""
        self._last_link_check = now
        try:
            linked = self._write_fd is not None and os.fstat(self._write_fd).st_nlink > 0
        except OSError:
            linked = False
        if not linked:
            log.error("DISKQUEUE(%s) %s was removed from the disk", self.name, self.file_name(self.write_file_num))
            self._close_write_fd()

    def _close_write_fd(self) -> None:
        close_quietly(self._write_fd)
        self._write_fd = None

    # --- reading ------------------------------------------------------------------------------

    def reader(self, pos: int, index: int) -> SegmentReader:
        return SegmentReader(self, pos, index)

    def end_of(self, num: int) -> int:
        """Where the records of segment num end as far as readers go (the write position for the write
        file; -1: its size, found when opened)."""
        if num == self.write_file_num:
            return self.write_pos
        return self._cut.get(num, -1)

    def cut(self, num: int, offset: int, why: str) -> None:
        """A bad record at `offset` of segment num: nothing past it can be read (there is no telling
        where a next record would start). The write file rolls so that later records are readable."""
        if num in self._cut:
            return
        log.error("DISKQUEUE(%s) %s at %d of %s: the rest of the file is lost, it is kept as .bad once read",
                  self.name, why, offset, self.file_name(num))
        self._cut[num] = offset
        self._files_changed = True
        if num == self.write_file_num:
            self._next_write_file()

    def read_at(self, pos: int) -> bytes:
        """The record at `pos` (reclaim, seek, an age in /stats); raises OSError or ValueError."""
        with open(self.file_name(pos >> POS_SHIFT), "rb") as fh:
            fh.seek(pos & OFFSET_MASK)
            header = fh.read(4)
            if len(header) < 4:
                raise ValueError("unexpected EOF reading a record length")
            (length,) = INT32.unpack(header)
            if length < self.min_msg_size or length > self.max_msg_size:
                raise ValueError(f"invalid message read size ({length})")
            data = fh.read(length)
            if len(data) < length:
                raise ValueError("unexpected EOF reading a record")
            return data

    # --- dropping -----------------------------------------------------------------------------

    def droppable(self, before: int) -> list[tuple[str, bool]]:
        """The files of the segments before segment `before` (never the write file), for the owner to
        remove once the metadata no longer naming them is persisted; they are forgotten now. Each with
        whether it is to be kept as `.bad` instead (a bad record cut it: go-diskqueue keeps such files)."""
        before = min(before, self.write_file_num)
        dropped: list[tuple[str, bool]] = []
        if before > self.first_file:
            self._files_changed = True
        for num in range(self.first_file, before):
            dropped.append((self.file_name(num), num in self._cut))
            self._first_index.pop(num, None)
            self._cut.pop(num, None)
        self.first_file = max(self.first_file, before)
        return dropped

    def skip_to_new_file(self) -> None:
        """Everything so far is dropped (an empty topic): writing goes on in a new file."""
        if self.write_pos > 0:
            self._next_write_file()

    def close(self) -> None:
        self.closed = True
        self._close_write_fd()

    def remove_files(self) -> None:
        """Every file of this log (a deleted topic or channel), now."""
        self.close()
        mine = re.compile(re.escape(self.name) + r"\.diskqueue\.(\d{6,}\.dat(\.bad)?|meta\.dat(\.\d+\.tmp)?)\Z")
        try:
            names = os.listdir(self.data_path)
        except OSError as exc:
            log.error("DISKQUEUE(%s) failed to list %s - %s", self.name, self.data_path, exc)
            return
        for entry in names:
            if mine.match(entry):
                failed = remove_quietly(os.path.join(self.data_path, entry))
                if failed is not None:
                    log.error("DISKQUEUE(%s) failed to remove %s - %s", self.name, entry, failed)


def remove_dropped(path: str, bad: bool, name: str) -> None:
    """Remove a dropped file (a segment a bad record cut is renamed `.bad` instead, as go-diskqueue keeps
    it); one that is gone already is no error."""
    if bad:
        try:
            os.rename(path, path + ".bad")
        except OSError as exc:
            log.error("DISKQUEUE(%s) failed to rename bad diskqueue file %s - %s", name, path, exc)
        return
    failed = remove_quietly(path)
    if failed is not None:
        log.error("DISKQUEUE(%s) failed to Remove(%s) - %s", name, path, failed)


class SegmentReader:
    """One reader's place in a SegmentLog: the position and index of the next record, the open segment
    and a block read from it (records are cut from 256 KiB preads). Owned by a LogReader."""

    __slots__ = ("log", "file_num", "pos", "index", "_fd", "_buf", "_buf_at", "_file_end")

    def __init__(self, segments: SegmentLog, pos: int, index: int) -> None:
        self.log = segments
        self.file_num = pos >> POS_SHIFT
        self.pos = pos & OFFSET_MASK
        self.index = index
        self._fd: int | None = None
        self._buf = b""
        self._buf_at = 0
        self._file_end = -1

    @property
    def position(self) -> int:
        return (self.file_num << POS_SHIFT) | self.pos

    def seek(self, pos: int, index: int) -> None:
        self.close()
        self.file_num = pos >> POS_SHIFT
        self.pos = pos & OFFSET_MASK
        self.index = index

    def close(self) -> None:
        self._buf = b""
        if self._fd is not None:
            close_quietly(self._fd)
            self._fd = None

    def read(self, limit: int, upto: int, positions: list[int]) -> list[bytes]:
        """Up to `limit` records before position `upto`; `positions` gets theirs. A bad record cuts its
        file (SegmentLog.cut) and reading goes on in the next one: logged, never raised."""
        out: list[bytes] = []
        segments = self.log
        if segments.closed:
            return out
        upto_file = upto >> POS_SHIFT
        while len(out) < limit:
            num = self.file_num
            if num > upto_file or (num == upto_file and self.pos >= (upto & OFFSET_MASK)):
                break
            if num < segments.first_file:
                self._next_file(segments.first_file)
                continue
            try:
                data = self._read_one(num)
            except (OSError, ValueError) as exc:
                if isinstance(exc, FileNotFoundError) and num < segments.write_file_num:
                    log.error("DISKQUEUE(%s) %s is missing, reading on from the next file",
                              segments.name, segments.file_name(num))
                else:
                    segments.cut(num, self.pos, str(exc))
                self._next_file(num + 1)
                continue
            if data is None:
                if num >= segments.write_file_num:
                    break  # at the tail
                self._next_file(num + 1)
                continue
            positions.append((num << POS_SHIFT) | self.pos)
            out.append(data)
            self.pos += 4 + len(data)
            self.index += 1
        return out

    def rewind(self, pos: int, index: int) -> None:
        """Back to `pos` (read before, not used after all), the record with index `index`: in the same
        segment the open file and its block are kept."""
        if pos >> POS_SHIFT != self.file_num:
            self.seek(pos, index)
            return
        self.pos = pos & OFFSET_MASK
        self.index = index

    def fetch(self, pos: int) -> bytes:
        """The record at `pos`, out of order (a deferred record read back when it is due), through this
        reader's block, so records near each other cost one pread. For a reader that reads nothing else
        (its index is not kept). Raises OSError or ValueError."""
        num = pos >> POS_SHIFT
        if num != self.file_num:
            self.close()
            self.file_num = num
        self.pos = pos & OFFSET_MASK
        data = self._read_one(num)
        if data is None:
            raise ValueError(f"no record at {num}:{self.pos}")
        return data

    def _next_file(self, num: int) -> None:
        self.close()
        self.file_num = num
        self.pos = 0
        self.index = self.log.index_of_file(num)

    def _read_one(self, num: int) -> bytes | None:
        """The next record, or None where the segment ends."""
        segments = self.log
        fd = self._fd
        if fd is None:
            path = segments.file_name(num)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self._fd = fd
            self._buf = b""
            self._file_end = -1
        end = segments.end_of(num)
        if end < 0:
            if self._file_end < 0:
                self._file_end = os.fstat(fd).st_size  # sealed: it ends where the file does
            end = self._file_end
        pos = self.pos
        if pos >= end:
            return None
        buf = self._buf
        at = pos - self._buf_at
        if at < 0 or at + 4 > len(buf):
            buf = self._fill(fd, pos, _READ_BUFFER)
            at = 0
            if len(buf) < 4:
                raise ValueError(f"unexpected EOF reading a record length ({len(buf)} of 4 bytes)")
        length = int32_at(buf, at)
        if length < segments.min_msg_size or length > segments.max_msg_size:
            raise ValueError(f"invalid message read size ({length})")
        stop = at + 4 + length
        if stop > len(buf):
            buf = self._fill(fd, pos, max(_READ_BUFFER, 4 + length))
            at, stop = 0, 4 + length
            if stop > len(buf):
                raise ValueError(f"unexpected EOF reading a record ({len(buf) - 4} of {length} bytes)")
        if pos + 4 + length > end:
            raise ValueError(f"a record ({length} bytes) past the end of the file ({end})")
        return buf[at + 4:stop]

    def _fill(self, fd: int, pos: int, size: int) -> bytes:
        """The block at `pos` (records are only ever appended, so what was read stays true)."""
        self._buf = b""  # a failed read leaves nothing stale
        buf = os.pread(fd, size, pos)
        self._buf = buf
        self._buf_at = pos
        return buf
