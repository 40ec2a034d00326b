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
from collections.abc import Callable, Sequence
from typing import BinaryIO

import trio

from trio_nsq.broker.backend import BackendError
from trio_nsq.broker.files import close_quietly, fsync_dir, write_synced

log = logging.getLogger("nsqd")

_LEN = struct.Struct(">i")
# how often put() checks that its write file still has a name on disk
LINK_CHECK_INTERVAL = 0.1
# records per writev: two buffers each, within Linux's IOV_MAX of 1024
_IOV_RECORDS = 512
# the read file's buffer: a reader drains records in batches, so fewer, larger reads
_READ_BUFFER = 256 * 1024


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

        self._read_file: BinaryIO | None = None
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

        self._meta_loaded = False
        self._retrieve_metadata()
        self._recover_tail()

    def __repr__(self) -> str:
        return f"DiskQueue({self.name})"

    # --- files --------------------------------------------------------------------------------

    def file_name(self, num: int) -> str:
        return os.path.join(self.data_path, f"{self.name}.diskqueue.{num:06d}.dat")

    def meta_file_name(self) -> str:
        return os.path.join(self.data_path, f"{self.name}.diskqueue.meta.dat")

    def _meta_text(self) -> bytes:
        return b"%d\n%d,%d\n%d,%d\n" % (
            self._depth, self.read_file_num, self.read_pos, self.write_file_num, self.write_pos)

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

    def _recover_tail(self) -> None:
        """Count in the records written after the metadata was last persisted: past the write position
        in the write file, then in the files a roll had started since."""
        num, pos = self.write_file_num, self.write_pos
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
            end, count = self._scan_records(path, pos, size)
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

    def _next_existing_file(self, num: int) -> int | None:
        """The lowest data file number above num on disk, if any."""
        mine = re.compile(re.escape(self.name) + r"\.diskqueue\.(\d{6,})\.dat\Z")
        try:
            names = os.listdir(self.data_path)
        except OSError:
            return None
        nums = [int(m.group(1)) for m in map(mine.match, names) if m is not None]
        return min((n for n in nums if n > num), default=None)

    def _scan_records(self, path: str, pos: int, size: int) -> tuple[int, int]:
        """(end of the last whole, valid record from pos, how many records)."""
        count = 0
        if size == pos:
            return pos, 0
        with open(path, "rb") as fh:
            fh.seek(pos)
            while True:
                header = fh.read(4)
                if len(header) < 4:
                    break
                (length,) = _LEN.unpack(header)
                if length < self.min_msg_size or length > self.max_msg_size or pos + 4 + length > size:
                    break
                fh.seek(length, os.SEEK_CUR)
                pos += 4 + length
                count += 1
        return pos, count

    # --- writing ------------------------------------------------------------------------------

    def put(self, data: bytes) -> None:
        """Append one record (go-diskqueue's writeOne); raises BackendError if it cannot be stored."""
        self.put_many((data,))

    def put_many(self, records: Sequence[bytes]) -> None:
        """Append records in order, one writev per run of records that goes to the same file.

        The same records, files and rolls as one put() each; only the system calls are fewer. Raises
        BackendError (with `.stored`, how many of the first records were stored) at the first record that
        cannot be stored: those before it stay, as a row of put() calls would have left them."""
        if self._closed:
            raise BackendError("exiting")
        if self._write_fd is not None:
            now = time.monotonic()
            if now - self._last_link_check >= LINK_CHECK_INTERVAL:
                self._check_write_file_linked(now)
        min_size, max_size, max_file = self.min_msg_size, self.max_msg_size, self.max_bytes_per_file
        pack = _LEN.pack
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
                pos += 4 + length
                end += 1
            if iov:
                self._write_run(iov, pos - self.write_pos, end - stored, stored)
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
        return self._depth

    def _has_unread(self) -> bool:
        return self.read_file_num < self.write_file_num or self.read_pos < self.write_pos

    def read_nowait(self) -> bytes:
        """Take the next record; raises trio.WouldBlock when there is none."""
        records = self.read_many(1)
        if not records:
            raise trio.WouldBlock
        return records[0]

    def read_many(self, limit: int) -> list[bytes]:
        """Take up to `limit` records (fewer when the queue runs out). Corruption is logged and skipped
        (the file becomes `.bad`), never raised."""
        out: list[bytes] = []
        if self._closed:
            return out
        while len(out) < limit and self._has_unread():  # each read error skips at least one whole file
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
            out.append(data)
        return out

    def _read_one(self) -> bytes | None:
        """The next record, or None if the read file is finished (Go would take its EOF for a read
        error and keep a finished file as `.bad`)."""
        fh = self._read_file
        if fh is None:
            path = self.file_name(self.read_file_num)
            fh = open(path, "rb", buffering=_READ_BUFFER)
            try:
                if self.read_pos > 0:
                    fh.seek(self.read_pos)
                # a finished file ends at its size; the write file at most at max_bytes_per_file
                self._max_bytes_per_file_read = self.max_bytes_per_file
                if self.read_file_num < self.write_file_num:
                    self._max_bytes_per_file_read = os.fstat(fh.fileno()).st_size
            except OSError:
                fh.close()
                raise
            self._read_file = fh
            log.info("DISKQUEUE(%s): readOne() opened %s", self.name, path)
        if self.read_file_num < self.write_file_num and self.read_pos >= self._max_bytes_per_file_read:
            if self.read_pos > self._max_bytes_per_file_read:
                log.warning("DISKQUEUE(%s) readPos %d is past the end (%d) of %s, nothing left in it",
                            self.name, self.read_pos, self._max_bytes_per_file_read, self.file_name(self.read_file_num))
            return None
        header = fh.read(4)
        if len(header) < 4:
            raise ValueError(f"unexpected EOF reading a record length ({len(header)} of 4 bytes)")
        (length,) = _LEN.unpack(header)
        if length < self.min_msg_size or length > self.max_msg_size:
            # corrupt: there is no telling where a next record would start
            raise ValueError(f"invalid message read size ({length})")
        data = fh.read(length)
        if len(data) < length:
            raise ValueError(f"unexpected EOF reading a record ({len(data)} of {length} bytes)")
        return data

    def _move_forward(self, total: int) -> None:
        self.read_pos += total
        self._depth -= 1
        self._counted()
        if self.read_file_num < self.write_file_num and self.read_pos >= self._max_bytes_per_file_read:
            self._finish_read_file()
        self._check_tail_corruption()

    def _finish_read_file(self) -> None:
        """The read file is read to its end: delete it and go on with the next."""
        self._close_read_file()
        old = self.file_name(self.read_file_num)
        self.read_file_num += 1
        self.read_pos = 0
        self._file_changed()
        try:
            os.remove(old)
        except OSError as exc:
            log.error("DISKQUEUE(%s) failed to Remove(%s) - %s", self.name, old, exc)

    def _close_read_file(self) -> None:
        if self._read_file is not None:
            self._read_file.close()
            self._read_file = None

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
        for num in range(self.read_file_num, self.write_file_num + 1):
            try:
                os.remove(self.file_name(num))
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.error("DISKQUEUE(%s) failed to remove data file - %s", self.name, exc)
        self.write_file_num += 1
        self.write_pos = 0
        self.read_file_num = self.write_file_num
        self.read_pos = 0
        self._depth = 0
        self._unsynced_from = None
        self._file_changed()

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
            await trio.to_thread.run_sync(self._fsync_and_persist, files, meta)
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
                if first is not None:
                    self._unsynced_again(first)
                self._count += count
                self._needs_sync = self._needs_sync or needs_sync
                # not due again at once: a failing disk is retried every sync_timeout, not in a loop
            else:
                self._synced_writes = max(self._synced_writes, current.writes)
                if self._failing:
                    self._health(None)
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

    def _fsync_and_persist(self, files: list[str], meta: bytes) -> None:
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
            self._skip_to_next_rw_file()
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
        self._wake.set()

    def _remove_files(self) -> None:
        mine = re.compile(re.escape(self.name) + r"\.diskqueue\.(\d{6,}\.dat|meta\.dat(\.\d+\.tmp)?)\Z")
        try:
            names = os.listdir(self.data_path)
        except OSError as exc:
            log.error("DISKQUEUE(%s) failed to list %s - %s", self.name, self.data_path, exc)
            return
        for entry in names:
            if mine.match(entry):
                try:
                    os.remove(os.path.join(self.data_path, entry))
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.error("DISKQUEUE(%s) failed to remove %s - %s", self.name, entry, exc)
