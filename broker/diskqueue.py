"""DiskQueue: go-diskqueue's files and behaviour, as a Trio-friendly BackendQueue.

Files, in the data directory (byte for byte those of github.com/nsqio/go-diskqueue):
- data `<name>.diskqueue.%06d.dat`: records `[length int32 BE][bytes]`; a record goes to a new file when
  the current one is not empty and the record would take it past max_bytes_per_file (so a file ends
  at most max_bytes_per_file long, or holds a single record that is longer);
- meta `<name>.diskqueue.meta.dat`: "depth\\nreadFileNum,readPos\\nwriteFileNum,writePos\\n", written to
  `<meta>.<random>.tmp`, fsynced and renamed over the old one.

What is the same as go-diskqueue: the put size check, when a file rolls, how a reader knows a file is
finished (maxBytesPerFileRead: its size once it is no longer the write file), deleting a file once it is
read, a record length outside [min, max] or a short read renaming the file to `.bad` and skipping to the
next one (the write file too if it was the one being read), the depth reset at the tail
(checkTailCorruption), a sync every sync_every reads+writes, after a file change, or every sync_timeout
when anything happened.

Differences, on purpose:
- put_many() and read_many() are synchronous: the write (one writev per run of records, unbuffered)
  and the reads go straight to the OS from the event loop, which costs microseconds; every fsync runs in a worker thread,
  so the loop never waits for the disk to flush. A roll does not fsync in put() as Go's writeOne does:
  it wakes the io loop, which syncs at once.
- sync() is a group commit: every caller waiting at one moment shares one fsync round. A record that a
  failed round covered is never reported durable afterwards, even if a later fsync succeeds: Linux may
  drop the dirty pages of a failed write-back and mark them clean, so the later fsync proves nothing about
  them. A publish waiting for them is answered with an error.
- The queue reports its health to its owner (`on_health`, nsqd's SetHealth): a failed write or fsync
  says what failed, the next one that succeeds says healthy again.
- Opening recovers records written after the last metadata sync (a kill -9): the write file is scanned
  past the recorded write position, then any later files a roll had begun; a torn record at the end is
  cut off. go-diskqueue instead starts a new write file and lets the reader salvage what it can with a
  stale depth. Either way no records are lost; here the depth stays exact.
- A write file that vanished (data directory removed) is noticed within LINK_CHECK_INTERVAL and the
  next put fails loudly instead of writing into an unlinked file; a write file found shorter than the
  write position is not written into (which would leave a hole of zeros): writing moves to a new file.
- The directory is fsynced after the metadata rename, so new data files and the metadata survive a crash.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import struct
import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Sequence
from itertools import islice, takewhile

import trio

from trio_nsq.broker.backend import BackendError
from trio_nsq.broker.files import close_quietly, fsync_dir, remove_quietly, write_synced
from trio_nsq.shared.protocol import INT32, int32_at

log = logging.getLogger("nsqd")

# how often put() checks that its write file still has a name on disk
LINK_CHECK_INTERVAL = 0.1
# records per writev: two buffers each, within Linux's IOV_MAX of 1024
_IOV_RECORDS = 512
# the read file's buffer: a reader drains records in batches, so fewer, larger reads
_READ_BUFFER = 256 * 1024
# a record's position: its file number and offset in one int (file << 40 | offset), ordered as the queue
POS_SHIFT = 40
_OFFSET_MASK = (1 << POS_SHIFT) - 1
# cursor: when more finished positions than this wait behind an unfinished one, the oldest unfinished
# records are copied to the tail so the finished set (and the metadata that carries it) stays small
FINISHED_LIMIT = 4096
# reclaim copies unfinished records only when that frees at least this many times the bytes it writes
RECLAIM_RATIO = 4
# cursor: retired handed-out positions are dropped from the front of the list once more than this many
# (and most of the list) are retired
_HANDED_TRIM = 4096
# the metadata's extension after go-diskqueue's three lines (Go's Fscanf reads those and stops); version 2
# writes the finished positions as hex of big-endian int64s (every sync round writes up to thousands:
# struct packs them ~4x faster than decimal text); version 1 (decimal, space-separated) is still read
_EXT_HEADER = b"trio-nsq-cursor 2"
_EXT_HEADER_V1 = b"trio-nsq-cursor 1"
# the journal (`<name>.diskqueue.journal.dat`): one entry per record written with a deadline or in place
# of another (REQ, a timeout, DPUB, reclaim), appended (not fsynced: a kill -9 keeps the page cache, as
# it keeps the record) before the record: its position, the position it replaces (-1: none), its message
# id, its deadline (0: none). A crash before the next round finds the pair in it for every record past
# the persisted write position, so the record keeps its deadline and the one it replaced stays finished.
_JOURNAL = struct.Struct(">qq16sd")
# a journal with entries still needed is rewritten with only those once it grows past this
_JOURNAL_REWRITE = 64 * 1024


class _SyncRound:
    """One fsync round: the records it covers, and how it ended."""

    __slots__ = ("writes", "done", "error")

    def __init__(self, writes: int) -> None:
        self.writes = writes
        self.done = trio.Event()
        self.error: str | None = None


class DiskQueue:
    stores = True  # BackendQueue: it holds what the memory queue has no room for

    def __init__(
        self,
        name: str,
        data_path: str,
        *,
        max_bytes_per_file: int = 100 * 1024 * 1024,
        min_msg_size: int = 26,
        max_msg_size: int = 1024 * 1024 + 26,
        sync_every: int = 2500,
        sync_timeout: float = 2.0,
        on_health: Callable[[str | None], None] | None = None,
        cursor: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.name = name
        self._on_health = on_health
        self._failing = False  # the last write or fsync failed (reported through on_health)
        self.data_path = data_path
        self.max_bytes_per_file = max_bytes_per_file
        self.min_msg_size = min_msg_size
        self.max_msg_size = max_msg_size
        self.sync_every = max(1, sync_every)
        self.sync_timeout = sync_timeout

        # go-diskqueue's persisted state
        self._depth = 0
        self.read_file_num = 0
        self.read_pos = 0
        self.write_file_num = 0
        self.write_pos = 0
        # where the read file ends: its size once it is no longer the write file (maxBytesPerFileRead)
        self._max_bytes_per_file_read = 0

        # the read file's descriptor and a block read from it (records are cut from it: a buffered file's
        # two reads per record cost more than the record), which starts at _read_buf_at in the file
        self._read_fd: int | None = None
        self._read_buf = b""
        self._read_buf_at = 0
        self._write_fd: int | None = None
        self._last_link_check = 0.0

        self.fsync_count = 0  # fsync rounds started (data files, metadata, directory)
        self._count = 0  # reads + writes since the last round (go-diskqueue's count)
        self._needs_sync = False  # something to persist (go-diskqueue's needSync, or count > 0)
        # a round is due now (sync_every reached or a file changed): state, not just the wake event,
        # so a wake that arrives while run() waits out someone else's round is not lost
        self._sync_due = False
        self._writes = 0  # records put so far; group commit compares against it
        self._synced_writes = 0  # records covered by a successful round
        self._failed_writes = 0  # records covered by a failed round: never durable as far as we know
        self._unsynced_from: int | None = None  # first data file written since the last round
        self._round: _SyncRound | None = None  # the round in flight
        self._wake = trio.Event()  # wakes run() early: sync_every reached or a file changed
        self._closed = False
        self._deleted = False
        # the metadata rename (in an fsync thread) and delete() (in the loop) exclude each other
        self._files_lock = threading.Lock()

        # positions handed to the owner (read_many's `positions`) and deadlines of deferred records (a
        # `clock()` time, unix seconds by default), persisted in the metadata's extension
        self.clock = clock
        self._deadlines: dict[int, float] = {}
        # cursor mode (a channel's queue): reading does not consume. The persisted read position is the
        # mark-delete position (the oldest unfinished record); finish(pos) retires a record.
        self.cursor = cursor
        self.upstream = -1  # the highest topic position this channel has taken (Channel's no-copy rule)
        # positions read (handed out, or skipped as finished), in order: those from _head on are not retired
        # yet. A list and an index rather than a deque: a run of FINs that continues the front is then
        # found and retired by comparing slices (in C, mostly by identity) instead of per element
        self._handed: list[int] = []
        self._head = 0
        self._claimed: deque[int] = deque()  # positions written by hold(), in order
        self._claimed_set: set[int] = set()  # held positions the reader has not passed yet: it skips them
        self._finished: set[int] = set()  # finished positions at or past the mark-delete position
        self._fins: list[int] = []  # FINs noted by finish_many, not applied yet (see there)
        self._moved: dict[int, int] = {}  # reclaim: a held record's first position -> where it is now
        self._moved_from: dict[int, int] = {}
        self._hidden = 0  # unread records the reader will skip (held, or finished before a restart)
        self._oldest_file = 0  # the lowest data file number that may still exist (cursor mode)
        self._reclaim_after = 0  # finish() tries reclaim past this many finished positions (back-off)
        # cursor mode: the message ids of records recovered past the persisted write position (written
        # after the last sync round, so `upstream` may not cover them): the channel skips them once
        self.recovered_ids: set[bytes] = set()
        # the journal's entries not yet covered by a persisted write position: (position, entry)
        self._journal: list[tuple[int, bytes]] = []
        self._journal_fd: int | None = None
        self._journal_size = 0

        self._meta_loaded = False
        self._retrieve_metadata()
        self._recover_tail()
        if cursor:
            self._oldest_file = min(self.read_file_num, self._lowest_existing_file())

    def __repr__(self) -> str:
        return f"DiskQueue({self.name})"

    # --- files --------------------------------------------------------------------------------

    def file_name(self, num: int) -> str:
        return os.path.join(self.data_path, f"{self.name}.diskqueue.{num:06d}.dat")

    def meta_file_name(self) -> str:
        return os.path.join(self.data_path, f"{self.name}.diskqueue.meta.dat")

    def journal_file_name(self) -> str:
        return os.path.join(self.data_path, f"{self.name}.diskqueue.journal.dat")

    def _meta_text(self) -> bytes:
        """go-diskqueue's three lines; in cursor mode the read position is the mark-delete position and the
        depth counts every record from there. Our state follows only when there is some (Go ignores it)."""
        if not self.cursor:
            if self._deadlines:
                read_key = (self.read_file_num << POS_SHIFT) | self.read_pos
                self._deadlines = {k: d for k, d in self._deadlines.items() if k >= read_key}
            text = b"%d\n%d,%d\n%d,%d\n" % (
                self._depth, self.read_file_num, self.read_pos, self.write_file_num, self.write_pos)
            if not self._deadlines:
                return text
            return text + self._ext_text()
        self._pop_finished()
        mark = self.mark_delete()
        depth = self._depth + len(self._handed) - self._head + len(self._claimed) - len(self._claimed_set)
        text = b"%d\n%d,%d\n%d,%d\n" % (
            depth, mark >> POS_SHIFT, mark & _OFFSET_MASK, self.write_file_num, self.write_pos)
        if self.upstream < 0 and not self._finished and not self._deadlines:
            return text
        return text + self._ext_text()

    def _ext_text(self) -> bytes:
        finished = self._finished
        return b"%s\nupstream %d\nfinished %s\ndeadlines %s\n" % (
            _EXT_HEADER, self.upstream,
            struct.pack(f">{len(finished)}q", *finished).hex().encode(),
            " ".join(f"{k}:{d!r}" for k, d in self._deadlines.items()).encode())

    def _load_ext(self, lines: list[str]) -> None:
        """Our state after the three lines (absent in a Go-written file: nothing finished, nothing
        deferred). Whatever it holds refers to this very metadata, written in one rename."""
        header = lines[3].encode() if len(lines) >= 7 else b""
        if header not in (_EXT_HEADER, _EXT_HEADER_V1):
            return
        try:
            upstream = int(lines[4].split(" ", 1)[1])
            if header == _EXT_HEADER_V1:
                finished = {int(x) for x in lines[5].split(" ")[1:] if x}
            else:
                packed = bytes.fromhex(lines[5].split(" ", 1)[1])
                finished = set(struct.unpack(f">{len(packed) // 8}q", packed))
            deadlines = {int(k): float(d) for k, d in (x.split(":") for x in lines[6].split(" ")[1:] if x)}
        except (ValueError, IndexError, struct.error) as exc:
            log.error("DISKQUEUE(%s) ignoring unreadable cursor state in %s - %s",
                      self.name, self.meta_file_name(), exc)
            return
        self._deadlines = deadlines
        if self.cursor:
            self.upstream = upstream
            mark = (self.read_file_num << POS_SHIFT) | self.read_pos
            self._finished = {k for k in finished if k >= mark}
            self._hidden = len(self._finished)

    def _retrieve_metadata(self) -> None:
        path = self.meta_file_name()
        try:
            with open(path, "rb") as fh:
                lines = fh.read().decode("ascii").split("\n")
            depth = int(lines[0])
            read_num, read_pos = (int(x) for x in lines[1].split(","))
            write_num, write_pos = (int(x) for x in lines[2].split(","))
        except FileNotFoundError:
            return
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            log.error("DISKQUEUE(%s) failed to retrieveMetaData - %s: %s", self.name, path, exc)
            return
        self._meta_loaded = True
        self._depth = depth
        self.read_file_num, self.read_pos = read_num, read_pos
        self.write_file_num, self.write_pos = write_num, write_pos
        self._load_ext(lines)
        if self.cursor:
            # the depth counted from the mark-delete position; what the reader skips is not queued
            self._depth = max(0, depth)

    def _recover_tail(self) -> None:
        """Count in the records written after the metadata was last persisted: past the write position
        in the write file, then in the files a roll had started since."""
        num, pos = self.write_file_num, self.write_pos
        persisted = (num << POS_SHIFT) | pos
        tail: dict[int, bytes] = {}
        recovered = 0
        while True:
            path = self.file_name(num)
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                # read and deleted after the metadata was written (or no metadata was ever written):
                # later files may hold newer records, and their numbers must not be written over
                later = self._next_existing_file(num)
                if later is not None:
                    log.warning("DISKQUEUE(%s) %s is missing (metadata writePos %d), recovering from %s",
                                self.name, path, pos, self.file_name(later))
                    if not self._meta_loaded and self.read_file_num == num:
                        self.read_file_num, self.read_pos = later, 0
                    num, pos = later, 0
                    self.write_file_num, self.write_pos = num, 0
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
                continue
            end, count = self._scan_records(path, pos, size, num, tail)
            if end < size:
                log.warning("DISKQUEUE(%s) cutting %d bytes of a torn record off the end of %s",
                            self.name, size - end, path)
                os.truncate(path, end)
            if count:
                log.warning("DISKQUEUE(%s) recovered %d records past writePos %d in %s (written after the "
                            "last metadata sync)", self.name, count, pos, path)
            recovered += count
            self.write_file_num, self.write_pos = num, end
            num, pos = num + 1, 0
        self._depth += recovered
        if self.cursor:
            self.recovered_ids.update(tail.values())
        self._replay_journal(persisted, tail)

    def _replay_journal(self, persisted: int, tail: dict[int, bytes]) -> None:
        """Deadlines and replaced records of the recovered records (`tail`: position -> message id): a
        journal entry counts when its record is there, past the persisted write position."""
        try:
            with open(self.journal_file_name(), "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return
        mark = (self.read_file_num << POS_SHIFT) | self.read_pos
        self._journal_size = len(data)
        applied = 0
        for offset in range(0, len(data) - _JOURNAL.size + 1, _JOURNAL.size):
            entry = data[offset:offset + _JOURNAL.size]
            new, old, msg_id, deadline = _JOURNAL.unpack(entry)
            if new < persisted or tail.get(new) != msg_id:
                continue  # covered by the metadata, or its record never written
            applied += 1
            self._journal.append((new, entry))
            if deadline > 0:
                self._deadlines[new] = deadline
            if self.cursor and old >= mark and old not in self._finished:
                self._finished.add(old)  # replaced by `new`: the reader skips it
                self._hidden += 1
                self._deadlines.pop(old, None)
        if applied:
            log.warning("DISKQUEUE(%s) journal: %d recovered records keep their deadline or replace an older one",
                        self.name, applied)

    def _existing_files(self) -> list[int]:
        mine = re.compile(re.escape(self.name) + r"\.diskqueue\.(\d{6,})\.dat\Z")
        try:
            names = os.listdir(self.data_path)
        except OSError:
            return []
        return [int(m.group(1)) for m in map(mine.match, names) if m is not None]

    def _next_existing_file(self, num: int) -> int | None:
        """The lowest data file number above num on disk, if any."""
        return min((n for n in self._existing_files() if n > num), default=None)

    def _lowest_existing_file(self) -> int:
        return min(self._existing_files(), default=self.read_file_num)

    def _scan_records(self, path: str, pos: int, size: int, num: int, ids: dict[int, bytes]) -> tuple[int, int]:
        """(end of the last whole, valid record from pos, how many records); `ids` gets each record's
        position and message id (bytes 10-26 of an NSQ message)."""
        count = 0
        if size == pos:
            return pos, 0
        with open(path, "rb") as fh:
            fh.seek(pos)
            while True:
                header = fh.read(4)
                if len(header) < 4:
                    break
                (length,) = INT32.unpack(header)
                if length < self.min_msg_size or length > self.max_msg_size or pos + 4 + length > size:
                    break
                if length >= 26:
                    ids[(num << POS_SHIFT) | pos] = fh.read(26)[10:]
                    fh.seek(length - 26, os.SEEK_CUR)
                else:
                    fh.seek(length, os.SEEK_CUR)
                pos += 4 + length
                count += 1
        return pos, count

    # --- writing ------------------------------------------------------------------------------

    def put(self, data: bytes) -> None:
        """Append one record (go-diskqueue's writeOne); raises BackendError if it cannot be stored."""
        self.put_many((data,))

    def put_many(self, records: Sequence[bytes], delay: float = 0.0, positions: list[int] | None = None) -> None:
        """Append records in order, one writev per run of records that goes to the same file.

        The same records, files and rolls as one put() each; only the system calls are fewer. Raises
        BackendError (with `.stored`, how many of the first records were stored) at the first record that
        cannot be stored: those before it stay, as a row of put() calls would have left them.
        `delay` > 0 (a deferred publish): each record keeps its deadline, read back by delay_of().
        `positions` gets each stored record's position."""
        if delay > 0 and positions is None:
            positions = []
        try:
            self._put_many(records, positions)
        finally:
            if delay > 0 and positions:
                deadline = self.clock() + delay
                for key in positions:
                    self._deadlines[key] = deadline
                # after the records (their positions are known only now): a kill -9 between the two
                # writes costs these records their delay, never the records
                self._journal_append(b"".join(
                    _JOURNAL.pack(key, -1, data[10:26], deadline) for key, data in zip(positions, records)))

    def _put_many(self, records: Sequence[bytes], positions: list[int] | None) -> None:
        if self._closed:
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
            while end < n and len(iov) < _IOV_RECORDS * 2:
                data = records[end]
                length = len(data)
                if length < min_size or length > max_size:
                    bad = (f"invalid message write size ({length}) "
                           f"minMsgSize={min_size} maxMsgSize={max_size}")
                    break
                if pos > self.write_pos or end > stored:
                    if pos + 4 + length > max_file:
                        break
                iov.append(pack(length))
                iov.append(data)
                if positions is not None:
                    positions.append((self.write_file_num << POS_SHIFT) | pos)
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
            self._health(error)
            raise BackendError(error, stored) from None
        if self._failing:
            self._health(None)
        self.write_pos += total
        self._depth += count
        self._writes += count
        if self._unsynced_from is None:
            self._unsynced_from = self.write_file_num
        self._counted(count)

    def _open_write_file(self) -> int:
        path = self.file_name(self.write_file_num)
        if self.write_pos == 0:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
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
        """Roll: later records go to the next file (whose data the io loop fsyncs along with this one's)."""
        if self.read_file_num == self.write_file_num:
            self._max_bytes_per_file_read = self.write_pos
        self._close_write_fd()
        self.write_file_num += 1
        self.write_pos = 0
        self._file_changed()

    def _next_key(self, length: int) -> int:
        """The position put() gives a record of `length` bytes now."""
        if self.write_pos > 0 and self.write_pos + 4 + length > self.max_bytes_per_file:
            return (self.write_file_num + 1) << POS_SHIFT
        return (self.write_file_num << POS_SHIFT) | self.write_pos

    def _journal_append(self, entries: bytes) -> None:
        """Append journal entries; no fsync (see _JOURNAL). A
        journal that cannot be written costs a crash's deadlines, not the record: logged, not raised."""
        try:
            if self._journal_fd is None:
                self._journal_fd = os.open(self.journal_file_name(), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                self._journal_size = os.fstat(self._journal_fd).st_size
            os.write(self._journal_fd, entries)
        except OSError as exc:
            log.error("DISKQUEUE(%s) failed to write the journal - %s", self.name, exc)
            return
        self._journal_size += len(entries)
        for offset in range(0, len(entries), _JOURNAL.size):
            entry = entries[offset:offset + _JOURNAL.size]
            self._journal.append((_JOURNAL.unpack(entry)[0], entry))

    def _trim_journal(self, persisted: int) -> None:
        """A round persisted the write position `persisted`: entries before it are needed no more."""
        if not self._journal_size:
            return
        live = [(key, entry) for key, entry in self._journal if key >= persisted]
        self._journal = live
        if live and self._journal_size < _JOURNAL_REWRITE:
            return
        try:
            if self._journal_fd is None:
                self._journal_fd = os.open(self.journal_file_name(), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            if not live:
                os.ftruncate(self._journal_fd, 0)
                self._journal_size = 0
                return
            # still needed entries: a new file renamed over the old one, so a crash finds one or the other
            path = self.journal_file_name()
            tmp = f"{path}.{random.getrandbits(63)}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            data = b"".join(entry for _, entry in live)
            os.write(fd, data)
            os.rename(tmp, path)
            close_quietly(self._journal_fd)
            self._journal_fd = fd
            self._journal_size = len(data)
        except OSError as exc:
            log.error("DISKQUEUE(%s) failed to trim the journal - %s", self.name, exc)

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

    def _counted(self, n: int = 1) -> None:
        self._needs_sync = True
        self._count += n
        if self._count >= self.sync_every:
            self._sync_due = True
            self._wake.set()

    def _file_changed(self) -> None:
        """go-diskqueue syncs whenever the read or write file changes."""
        self._needs_sync = True
        self._sync_due = True
        self._wake.set()

    # --- reading ------------------------------------------------------------------------------

    def depth(self) -> int:
        return self._depth - self._hidden

    def _has_unread(self) -> bool:
        return self.read_file_num < self.write_file_num or self.read_pos < self.write_pos

    def read_nowait(self) -> bytes:
        """Take the next record; raises trio.WouldBlock when there is none."""
        records = self.read_many(1)
        if not records:
            raise trio.WouldBlock
        return records[0]

    def read_many(self, limit: int, positions: list[int] | None = None) -> list[bytes]:
        """Take up to `limit` records (fewer when the queue runs out); `positions` gets their positions.
        Corruption is logged and skipped (the file becomes `.bad`), never raised. In cursor mode the
        reader skips held records and those finished before a restart, and a record read stays stored
        until finish()."""
        out: list[bytes] = []
        if self._closed:
            return out
        cursor = self.cursor
        hand = self._handed.append  # bound once
        while len(out) < limit and self._has_unread():  # each read error skips at least one whole file
            key = (self.read_file_num << POS_SHIFT) | self.read_pos
            try:
                data = self._read_one()
            except (OSError, ValueError) as exc:
                log.error("DISKQUEUE(%s) reading at %d of %s - %s",
                          self.name, self.read_pos, self.file_name(self.read_file_num), exc)
                self._close_read_file()
                self._handle_read_error()
                continue
            if data is None:
                # read to its end while it was still the write file, which has rolled since
                self._finish_read_file()
                self._check_tail_corruption()
                continue
            self._move_forward(4 + len(data))
            if cursor:
                if self._hidden:  # some unread records are to be skipped: is this one?
                    if key in self._claimed_set:  # held (in flight or deferred): its owner has it
                        self._claimed_set.discard(key)
                        self._hidden -= 1
                        continue
                    hand(key)
                    if key in self._finished:  # finished before a restart
                        self._hidden -= 1
                        continue
                else:
                    hand(key)
            out.append(data)
            if positions is not None:
                positions.append(key)
        return out

    def _read_one(self) -> bytes | None:
        """The next record, or None if the read file is finished (Go would take its EOF for a read
        error and keep a finished file as `.bad`)."""
        fd = self._read_fd
        if fd is None:
            path = self.file_name(self.read_file_num)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                # a finished file ends at its size; the write file at most at max_bytes_per_file
                self._max_bytes_per_file_read = self.max_bytes_per_file
                if self.read_file_num < self.write_file_num:
                    self._max_bytes_per_file_read = os.fstat(fd).st_size
            except OSError:
                os.close(fd)
                raise
            self._read_fd = fd
            self._read_buf = b""
            log.info("DISKQUEUE(%s): readOne() opened %s", self.name, path)
        pos = self.read_pos
        if self.read_file_num < self.write_file_num and pos >= self._max_bytes_per_file_read:
            if pos > self._max_bytes_per_file_read:
                log.warning("DISKQUEUE(%s) readPos %d is past the end (%d) of %s, nothing left in it",
                            self.name, pos, self._max_bytes_per_file_read, self.file_name(self.read_file_num))
            return None
        buf = self._read_buf
        at = pos - self._read_buf_at
        if at < 0 or at + 4 > len(buf):
            buf = self._fill_read_buf(fd, pos, _READ_BUFFER)
            at = 0
            if len(buf) < 4:
                raise ValueError(f"unexpected EOF reading a record length ({len(buf)} of 4 bytes)")
        length = int32_at(buf, at)
        if length < self.min_msg_size or length > self.max_msg_size:
            # corrupt: there is no telling where a next record would start
            raise ValueError(f"invalid message read size ({length})")
        end = at + 4 + length
        if end > len(buf):
            buf = self._fill_read_buf(fd, pos, max(_READ_BUFFER, 4 + length))
            at, end = 0, 4 + length
            if end > len(buf):
                raise ValueError(f"unexpected EOF reading a record ({len(buf) - 4} of {length} bytes)")
        return buf[at + 4 : end]

    def _fill_read_buf(self, fd: int, pos: int, size: int) -> bytes:
        """The block at `pos` (records are only ever appended, so what was read stays true)."""
        self._read_buf = b""  # a failed read leaves nothing stale
        buf = os.pread(fd, size, pos)
        self._read_buf = buf
        self._read_buf_at = pos
        return buf

    def _move_forward(self, total: int) -> None:
        self.read_pos += total
        self._depth -= 1
        if not self.cursor:  # in cursor mode reading changes nothing persisted: finish() counts
            self._counted()
        if self.read_file_num < self.write_file_num and self.read_pos >= self._max_bytes_per_file_read:
            self._finish_read_file()
        self._check_tail_corruption()

    def _finish_read_file(self) -> None:
        """The read file is read to its end: delete it and go on with the next (in cursor mode the file
        goes once the mark-delete position has passed it, after the metadata saying so is persisted)."""
        self._close_read_file()
        old = self.file_name(self.read_file_num)
        self.read_file_num += 1
        self.read_pos = 0
        if self.cursor:
            self._maybe_reclaim()
            return
        self._file_changed()
        try:
            os.remove(old)
        except OSError as exc:
            log.error("DISKQUEUE(%s) failed to Remove(%s) - %s", self.name, old, exc)

    def _close_read_file(self) -> None:
        self._read_buf = b""
        if self._read_fd is not None:
            close_quietly(self._read_fd)
            self._read_fd = None

    def _handle_read_error(self) -> None:
        """As go-diskqueue's handleReadError: keep the bad file as `.bad` and jump to the next file (the
        write file too, if it is the one that could not be read)."""
        if self.read_file_num == self.write_file_num:
            self._close_write_fd()
            self.write_file_num += 1
            self.write_pos = 0
        bad = self.file_name(self.read_file_num)
        log.warning("DISKQUEUE(%s) jump to next file and saving bad file as %s.bad", self.name, bad)
        try:
            os.rename(bad, bad + ".bad")
        except OSError as exc:
            log.error("DISKQUEUE(%s) failed to rename bad diskqueue file %s to %s.bad - %s",
                      self.name, bad, bad, exc)
        self.read_file_num += 1
        self.read_pos = 0
        self._file_changed()
        self._check_tail_corruption()

    def _check_tail_corruption(self) -> None:
        if self._has_unread():
            return
        # at the end of the queue: depth must be 0
        if self._depth != 0:
            if self._depth < 0:
                log.error("DISKQUEUE(%s) negative depth at tail (%d), metadata corruption, resetting 0...",
                          self.name, self._depth)
            else:
                log.error("DISKQUEUE(%s) positive depth at tail (%d), data loss, resetting 0...",
                          self.name, self._depth)
            self._depth = 0
            self._needs_sync = True
        if self.read_file_num != self.write_file_num or self.read_pos != self.write_pos:
            if self.read_file_num > self.write_file_num:
                log.error("DISKQUEUE(%s) readFileNum > writeFileNum (%d > %d), corruption, skipping to next "
                          "writeFileNum and resetting 0...", self.name, self.read_file_num, self.write_file_num)
            if self.read_pos > self.write_pos:
                log.error("DISKQUEUE(%s) readPos > writePos (%d > %d), corruption, skipping to next "
                          "writeFileNum and resetting 0...", self.name, self.read_pos, self.write_pos)
            self._skip_to_next_rw_file()

    def _skip_to_next_rw_file(self) -> None:
        self._close_read_file()
        self._close_write_fd()
        first = self.read_file_num
        self._apply_fins()
        if self.cursor and (self._head < len(self._handed) or self._claimed):
            # records handed out before here stay until finished (their files go with the mark-delete)
            first = max(first, (self.mark_delete() >> POS_SHIFT) + 1)
        for num in range(first, self.write_file_num + 1):
            failed = remove_quietly(self.file_name(num))
            if failed is not None:
                log.error("DISKQUEUE(%s) failed to remove data file - %s", self.name, failed)
        self.write_file_num += 1
        self.write_pos = 0
        self.read_file_num = self.write_file_num
        self.read_pos = 0
        self._depth = 0
        self._unsynced_from = None
        self._file_changed()

    # --- cursor (a channel's queue) ----------------------------------------------------------

    def mark_delete(self) -> int:
        """The oldest position that may hold an unfinished record: the read position, or the first
        unfinished record handed out or held before it."""
        self._apply_fins()
        mark = (self.read_file_num << POS_SHIFT) | self.read_pos
        if self._head < len(self._handed) and self._handed[self._head] < mark:
            mark = self._handed[self._head]
        if self._claimed and self._claimed[0] < mark:
            mark = self._claimed[0]
        return mark

    def has_deadlines(self) -> bool:
        return bool(self._deadlines)

    def delay_of(self, pos: int) -> float:
        """Seconds until the deadline of the deferred record at `pos` (<= 0: none, or due)."""
        deadline = self._deadlines.get(self._moved.get(pos, pos))  # reclaim may have moved it meanwhile
        return 0.0 if deadline is None else deadline - self.clock()

    def hold(self, data: bytes, delay: float = 0.0, old: int = -1) -> int:
        """Append a record its owner already holds (deferred for `delay` seconds, or in flight): the reader
        skips it; it is delivered from here only after a restart. `old`: the record it replaces, finished
        with it. Returns its position."""
        key = self._replace(data, self.clock() + delay if delay > 0 else 0.0, old)
        if self.cursor:
            self._claimed.append(key)
            self._claimed_set.add(key)
            self._hidden += 1
        self.finish(old)
        return key

    def rewrite(self, data: bytes, old: int) -> int:
        """Append a record in place of the one at `old` (REQ, a timeout: the message with its attempts),
        which is finished; the reader reads the new one. Returns its position."""
        key = self._replace(data, 0.0, old)
        self.finish(old)
        return key

    def _replace(self, data: bytes, deadline: float, old: int) -> int:
        """Journal, then write, a record that has a deadline (> 0) or replaces `old` (see _JOURNAL)."""
        if old >= 0:
            old = self._moved.get(old, old)
        new = self._next_key(len(data))
        if deadline or (self.cursor and old >= 0):
            self._journal_append(_JOURNAL.pack(new, old, data[10:26], deadline))
        positions: list[int] = []
        self._put_many((data,), positions)
        if deadline:
            self._deadlines[positions[0]] = deadline
        return positions[0]

    def finish(self, pos: int) -> None:
        """The record at `pos` is done with (FIN, or written again elsewhere): never delivered again once
        the next sync round has persisted that. No fsync of its own."""
        self.finish_many([pos])

    def finish_many(self, positions: list[int]) -> None:
        """finish() of each position in turn: a run of FINs is one call (negative positions: none).

        The hot path of a channel read from disk, so it only notes them: they are applied in bulk
        (_apply_fins) before anything reads the cursor (the mark-delete position, a sync round's
        metadata, reclaim, a held record's finish), or once FINISHED_LIMIT positions wait."""
        if not self.cursor:
            return
        fins = self._fins
        fins.extend(positions)
        self._counted(len(positions))
        if len(fins) + len(self._finished) > FINISHED_LIMIT:
            self._apply_fins()
            finished = self._finished
            if len(finished) > FINISHED_LIMIT and len(finished) > self._reclaim_after:
                self._maybe_reclaim()

    def _apply_fins(self) -> None:
        """Apply the FINs finish_many noted, in order."""
        positions = self._fins
        if not positions:
            return
        self._fins = []
        if self._claimed or self._moved:
            for pos in positions:
                self._finish_any(pos)
            return
        # the common case (FINs of records read, none held or moved): every position is one handed out
        # (or, finished before or emptied since, is before the front). Consumers FIN mostly in the order
        # they were sent, so most of the sorted run continues the front: it is retired without the set
        handed = self._handed
        head = self._head
        end = len(handed)
        if head == end:
            return  # every one finished already, or emptied since
        finished = self._finished
        if finished:
            head = self._retire_finished(head)
        positions.sort()
        first = 0
        if head == end:
            first = len(positions)  # all of them before the front
        elif positions[0] < handed[head]:
            first = bisect_left(positions, handed[head])
        n = min(len(positions) - first, end - head)
        if n > 0 and positions[first:first + n] != handed[head:head + n]:
            # the longest run that matches (positions are unique and a subset of handed[head:], so once
            # one differs all later ones do): binary search, each probe one comparison
            lo, hi = 0, n - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if positions[first + mid] == handed[head + mid]:
                    lo = mid
                else:
                    hi = mid - 1
            n = lo + 1 if positions[first] == handed[head] else 0
            if n and positions[first:first + n] != handed[head:head + n]:
                n = 0  # not in order after all: the set below handles every case
        head += n
        if first + n < len(positions):
            finished.update(positions[first + n:])
        if finished:
            head = self._retire_finished(head)
        self._set_head(head)
        if self._deadlines:
            for pos in positions:
                self._deadlines.pop(pos, None)

    def _set_head(self, head: int) -> None:
        """The handed positions before `head` are retired: they go in bulk once they are most of the list."""
        if head > _HANDED_TRIM and head * 2 > len(self._handed):
            del self._handed[:head]
            head = 0
        self._head = head

    def _retire_finished(self, head: int) -> int:
        """Move `head` past the finished positions at the front of the handed ones, dropping them from the
        finished set (found in C: per element in compiled code, each position would be boxed again)."""
        front = list(takewhile(self._finished.__contains__, islice(self._handed, head, None)))
        if front:
            self._finished.difference_update(front)
        return head + len(front)

    def _finish_any(self, pos: int) -> None:
        """finish() of a position that may be held, or moved by reclaim (counted by finish_many)."""
        if pos < 0:
            return
        moved = self._moved.pop(pos, None)
        if moved is not None:
            del self._moved_from[moved]
            pos = moved
        if pos in self._finished or pos < self.mark_delete():
            return  # already finished, or emptied since
        self._finished.add(pos)
        if self._deadlines:
            self._deadlines.pop(pos, None)
        self._pop_finished()

    def _pop_finished(self) -> None:
        """Move the mark-delete position past finished records."""
        self._apply_fins()
        finished = self._finished
        handed = self._handed
        claimed = self._claimed
        if not claimed:
            if finished:
                self._set_head(self._retire_finished(self._head))
            return
        # both in position order: retire the lower front while it is finished, so that every finished
        # position past the mark-delete position stays in the set (and is persisted)
        read_key = (self.read_file_num << POS_SHIFT) | self.read_pos
        head = self._head
        end = len(handed)
        try:
            while True:
                if claimed and claimed[0] < read_key and (head == end or claimed[0] < handed[head]):
                    if claimed[0] not in finished:
                        return
                    finished.discard(claimed.popleft())
                elif head < end and handed[head] in finished:
                    finished.discard(handed[head])
                    head += 1
                else:
                    return
        finally:
            self._set_head(head)

    def _maybe_reclaim(self) -> None:
        """Copy the few unfinished records that pin old files (a message held for an hour, a poison
        message deferred again and again) to the tail, so the files behind them can go and the finished
        set stays small: when the mark-delete position is two files behind the reader, everything
        unfinished before the read file moves; when too many finished positions wait behind unfinished
        ones, those in the older half do. Only when they are few (RECLAIM_RATIO): a consumer's in-flight
        window is not copied around."""
        self._pop_finished()
        mark = self.mark_delete()
        if (mark >> POS_SHIFT) < self.read_file_num - 1:
            cutoff = self.read_file_num << POS_SHIFT
        elif len(self._finished) > FINISHED_LIMIT and self._head < len(self._handed):
            cutoff = self._handed[(self._head + len(self._handed)) // 2]
        else:
            return
        finished = self._finished
        read_key = (self.read_file_num << POS_SHIFT) | self.read_pos
        pinning = [k for k in islice(self._handed, self._head, None) if k < cutoff and k not in finished]
        pinning.extend(k for k in self._claimed if k < cutoff and k < read_key and k not in finished)
        freed = 0
        for num in range(mark >> POS_SHIFT, cutoff >> POS_SHIFT):
            try:
                freed += os.path.getsize(self.file_name(num))
            except OSError:
                pass
        if (cutoff & _OFFSET_MASK) and self.read_file_num > cutoff >> POS_SHIFT:
            freed += cutoff & _OFFSET_MASK  # the older part of the finished set, in the file cutoff is in
        if not pinning or len(pinning) * (4 + self.min_msg_size) * RECLAIM_RATIO > freed:
            # would not pay even if every record were the smallest (a consumer's in-flight window, all in
            # the read file): no reads; finish() tries again once the finished set has doubled
            self._reclaim_after = 2 * len(finished)
            return
        records: list[tuple[int, bytes | None]] = []
        size = 0
        for key in pinning:
            try:
                data: bytes | None = self._read_at(key)
            except (OSError, ValueError) as exc:
                log.error("DISKQUEUE(%s) cannot copy the record at %d of %s, giving it up - %s",
                          self.name, key & _OFFSET_MASK, self.file_name(key >> POS_SHIFT), exc)
                data = None
            records.append((key, data))
            size += 4 + (len(data) if data is not None else 0)
        if size * RECLAIM_RATIO > freed:
            self._reclaim_after = 2 * len(finished)
            return  # mostly unfinished (a consumer's in-flight window): copying would not pay
        log.info("DISKQUEUE(%s) moving %d unfinished records to the tail to free older files",
                 self.name, len(pinning))
        for key, data in records:
            if data is None:
                finished.add(key)
                continue
            deadline = self._deadlines.get(key)
            try:
                new = self._replace(data, 0.0 if deadline is None else deadline, key)
            except BackendError:
                return  # logged; tried again later
            self._deadlines.pop(key, None)
            self._claimed.append(new)
            self._claimed_set.add(new)
            self._hidden += 1
            first = self._moved_from.pop(key, key)
            self._moved[first] = new
            self._moved_from[new] = first
            finished.add(key)
        self._pop_finished()
        self._counted()

    def _read_at(self, key: int) -> bytes:
        with open(self.file_name(key >> POS_SHIFT), "rb") as fh:
            fh.seek(key & _OFFSET_MASK)
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

    def _reset_cursor(self) -> None:
        self._fins.clear()
        self._handed.clear()
        self._head = 0
        self._claimed.clear()
        self._claimed_set.clear()
        self._finished.clear()
        self._moved.clear()
        self._moved_from.clear()
        self._deadlines.clear()
        self._hidden = 0

    # --- sync ---------------------------------------------------------------------------------

    async def sync(self) -> None:
        """Return once every record put before this call is fsynced (and the metadata with it).

        Group commit: a caller arriving while a round is in flight waits for it, and then the first of
        those still not covered starts the next round for all of them."""
        target = self._writes
        while self._synced_writes < target:
            if target <= self._failed_writes:
                raise BackendError(f"failed to sync disk queue {self.name}")
            current = self._round
            if current is not None:
                await current.done.wait()
                if current.error is not None and current.writes >= target:
                    raise BackendError(current.error)
                continue
            if self._closed:
                raise BackendError("exiting")
            await self._sync_round()

    async def _sync_round(self) -> None:
        """fsync the data files written since the last round, then persist the metadata, in a thread.
        Only one round runs at a time; raises BackendError if it failed."""
        assert self._round is None
        current = self._round = _SyncRound(self._writes)
        meta = self._meta_text()
        persisted = (self.write_file_num << POS_SHIFT) | self.write_pos
        dead: list[str] = []
        if self.cursor:
            # files wholly behind the mark-delete position go once the metadata saying so is persisted
            mark_file = self.mark_delete() >> POS_SHIFT
            dead = [self.file_name(n) for n in range(self._oldest_file, mark_file)]
            self._oldest_file = max(self._oldest_file, mark_file)
        first = self._unsynced_from
        files = [] if first is None else [self.file_name(n) for n in range(first, self.write_file_num + 1)]
        self._unsynced_from = None
        count, needs_sync = self._count, self._needs_sync
        self._count = 0
        self._needs_sync = False
        self._sync_due = False
        self.fsync_count += 1
        ok = False
        try:
            await trio.to_thread.run_sync(self._fsync_and_persist, files, meta, dead)
            ok = True
        except OSError as exc:
            current.error = f"failed to sync disk queue {self.name} - {exc}"
            log.error("DISKQUEUE(%s) failed to sync - %s", self.name, exc)
            self._failed_writes = max(self._failed_writes, current.writes)
            self._health(current.error)
            raise BackendError(current.error) from None
        finally:
            if not ok:
                # not durable: the next round must do these files and this metadata again
                if dead:
                    self._oldest_file = min(self._oldest_file, self._lowest_existing_file())
                if first is not None:
                    self._unsynced_again(first)
                self._count += count
                self._needs_sync = self._needs_sync or needs_sync
                # not due again at once: a failing disk is retried every sync_timeout, not in a loop
            else:
                self._synced_writes = max(self._synced_writes, current.writes)
                if self._failing:
                    self._health(None)
                if not self._closed:
                    self._trim_journal(persisted)
            self._round = None
            current.done.set()

    def _unsynced_again(self, first: int) -> None:
        # a method of its own: in _sync_round mypy still narrows the attribute to the None it assigned
        # before the await, and compiled code would trust that over the file number a put() stored since
        self._unsynced_from = first if self._unsynced_from is None else min(first, self._unsynced_from)

    def _health(self, error: str | None) -> None:
        self._failing = error is not None
        if self._on_health is not None:
            self._on_health(error)

    def _fsync_and_persist(self, files: list[str], meta: bytes, dead: Sequence[str] = ()) -> None:
        """In a worker thread. fsync goes through a descriptor of our own (fsync flushes the file, not the
        descriptor), so the event loop may close or replace its write descriptor meanwhile."""
        for path in files:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                continue  # read and deleted meanwhile, or renamed .bad: nothing to keep
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        # persistMetaData: a temp file, fsynced, renamed over the old one
        path = self.meta_file_name()
        tmp = f"{path}.{random.getrandbits(63)}.tmp"
        try:
            write_synced(tmp, meta)
            with self._files_lock:
                if self._deleted:
                    os.remove(tmp)  # deleted meanwhile: no metadata may come back
                    return
                os.rename(tmp, path)
        except OSError:
            try:
                os.remove(tmp)
            except OSError:
                pass
            raise
        fsync_dir(self.data_path)  # the rename and any new data file's name
        for path in dead:
            failed = remove_quietly(path)
            if failed is not None:
                log.error("DISKQUEUE(%s) failed to Remove(%s) - %s", self.name, path, failed)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The io_loop: fsync and metadata after sync_every reads+writes, after a file change, or every
        sync_timeout seconds when anything happened; ends when the queue is closed or deleted."""
        task_status.started()
        while not self._closed:
            if not self._wake.is_set() and not self._sync_due:
                with trio.move_on_after(self.sync_timeout):
                    await self._wake.wait()
            self._wake = trio.Event()
            if self._closed:
                break
            if self._round is not None:
                # a sync() round is under way: it covers what woke us up; anything since wakes us again
                await self._round.done.wait()
                continue
            if self._needs_sync:
                try:
                    await self._sync_round()
                except BackendError:
                    pass  # logged; the next round tries again

    async def _wait_round(self) -> None:
        while self._round is not None:
            await self._round.done.wait()

    # --- admin --------------------------------------------------------------------------------

    async def empty(self) -> None:
        """Drop every record (go-diskqueue's Empty: delete the files, skip to a new file, depth 0)."""
        if self._closed:
            return
        log.info("DISKQUEUE(%s): emptying", self.name)
        with trio.CancelScope(shield=True):
            await self._wait_round()
            if self.cursor:
                self._reset_cursor()
                self.read_file_num = min(self.read_file_num, self._oldest_file)
            self._deadlines.clear()
            self._skip_to_next_rw_file()
            self._oldest_file = self.read_file_num
            try:
                await self._sync_round()
            except BackendError:
                pass  # logged; run() or the next sync() tries again

    async def close(self) -> None:
        """Final fsync and metadata, then release the files; a new DiskQueue on the same files resumes
        exactly here."""
        if self._closed:
            return
        log.info("DISKQUEUE(%s): closing", self.name)
        with trio.CancelScope(shield=True):
            await self._wait_round()
            try:
                await self._sync_round()
            except BackendError:
                pass  # logged
        self._shut()

    def delete(self) -> None:
        """Remove every data file of this queue and its metadata, now: nsqd removes them before it
        answers, so a queue of the same name created next starts empty (and its files stay its own).
        An fsync round still running in its thread finds the queue deleted and writes no metadata."""
        log.info("DISKQUEUE(%s): deleting", self.name)
        self._shut()
        with self._files_lock:
            self._deleted = True
            self._remove_files()

    def _shut(self) -> None:
        self._closed = True
        self._close_read_file()
        self._close_write_fd()
        close_quietly(self._journal_fd)
        self._journal_fd = None
        self._wake.set()

    def _remove_files(self) -> None:
        mine = re.compile(re.escape(self.name) + r"\.diskqueue\.(\d{6,}\.dat|(meta|journal)\.dat(\.\d+\.tmp)?)\Z")
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
