"""DiskQueue: go-diskqueue's files and behaviour, as a Trio-friendly BackendQueue.

Files, in the data directory:
- data `<name>.diskqueue.%06d.dat`: records `[length int32 BE][bytes]`; a new file once the next record
  would take the current one past max_bytes_per_file;
- meta `<name>.diskqueue.meta.dat`: "depth\\nreadFileNum,readPos\\nwriteFileNum,writePos\\n", written to a
  temp file, fsynced and renamed.

Differences from go-diskqueue, on purpose:
- put() and read_nowait() are synchronous (plain writes and reads go to the OS in the event loop, which
  is cheap); only fsync goes to a worker thread, so the loop never blocks on the disk's flush.
- sync() is a group commit: every caller waiting at a moment shares one fsync.
- On open, records written after the last metadata sync (a kill -9) are recovered by scanning the write
  file past the recorded write position; go-diskqueue skips to a new file and leaves them unread.
"""

from __future__ import annotations

import logging
import os
import random
import struct
import time

import trio

from broker.backend import BackendError

log = logging.getLogger("nsqd")

_LEN = struct.Struct(">i")
# how often put() checks that its write file still exists
LINK_CHECK_INTERVAL = 0.1


class DiskQueue:
    durable = True

    def __init__(
        self,
        name: str,
        data_path: str,
        *,
        max_bytes_per_file: int = 100 * 1024 * 1024,
        min_msg_size: int = 0,
        max_msg_size: int = 1024 * 1024 + 26,
        sync_every: int = 2500,
        sync_timeout: float = 2.0,
    ) -> None:
        self.name = name
        self.data_path = data_path
        self.max_bytes_per_file = max_bytes_per_file
        self.min_msg_size = min_msg_size
        self.max_msg_size = max_msg_size
        self.sync_every = max(1, sync_every)
        self.sync_timeout = sync_timeout

        self._depth = 0
        self.read_file_num = 0
        self.read_pos = 0
        self.write_file_num = 0
        self.write_pos = 0
        # the size of the file being read, once it is no longer the write file
        self._max_bytes_per_file_read = 0

        self._read_file = None
        self._write_fd: int | None = None
        self._retired_fds: list[int] = []

        self.fsync_count = 0
        self._since_sync = 0
        self._needs_sync = False
        self._writes = 0  # records put so far (group commit compares against it)
        self._synced_writes = 0
        self._syncing = False
        self._sync_done = trio.Event()
        self._sync_wanted = trio.Event()
        self._readable = trio.Event()
        self._closed = False
        self._last_link_check = 0.0

        self._retrieve_metadata()
        if self._depth > 0:
            self._readable.set()

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

    def _persist_metadata(self, text: bytes) -> None:
        path = self.meta_file_name()
        tmp = f"{path}.{random.getrandbits(63)}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, text)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def _retrieve_metadata(self) -> None:
        try:
            with open(self.meta_file_name(), "rb") as fh:
                lines = fh.read().decode().split("\n")
            depth = int(lines[0])
            read_num, read_pos = (int(x) for x in lines[1].split(","))
            write_num, write_pos = (int(x) for x in lines[2].split(","))
        except FileNotFoundError:
            return
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            log.error("DISKQUEUE(%s): failed to retrieveMetaData - %s, starting empty", self.name, exc)
            return
        self._depth = depth
        self.read_file_num, self.read_pos = read_num, read_pos
        self.write_file_num, self.write_pos = write_num, write_pos
        self._recover_tail()

    def _recover_tail(self) -> None:
        """Records written after the last metadata sync are still in the write file: count them in."""
        path = self.file_name(self.write_file_num)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            return
        if size < self.write_pos:
            log.error("DISKQUEUE(%s): %s is shorter (%d) than its write position %d, moving to a new file",
                      self.name, path, size, self.write_pos)
            self.write_file_num += 1
            self.write_pos = 0
            return
        if size == self.write_pos:
            return
        recovered, pos = 0, self.write_pos
        with open(path, "rb") as fh:
            fh.seek(pos)
            while True:
                header = fh.read(4)
                if len(header) < 4:
                    break
                (length,) = _LEN.unpack(header)
                if length < self.min_msg_size or length > self.max_msg_size:
                    break
                if len(fh.read(length)) < length:
                    break
                pos += 4 + length
                recovered += 1
        if pos < size:
            log.warning("DISKQUEUE(%s): truncating %d bytes of partial record at the end of %s",
                        self.name, size - pos, path)
            os.truncate(path, pos)
        log.warning("DISKQUEUE(%s): recovered %d records written after the last metadata sync",
                    self.name, recovered)
        self.write_pos = pos
        self._depth += recovered

    # --- writing ------------------------------------------------------------------------------

    def put(self, data: bytes) -> None:
        if self._closed:
            raise BackendError("exiting")
        length = len(data)
        if length < self.min_msg_size or length > self.max_msg_size:
            raise BackendError(
                f"invalid message write size ({length}) minMsgSize={self.min_msg_size} maxMsgSize={self.max_msg_size}")
        total = 4 + length
        now = time.monotonic()
        if now - self._last_link_check > LINK_CHECK_INTERVAL:
            self._check_write_file_linked(now)
        try:
            if self.write_pos > 0 and self.write_pos + total > self.max_bytes_per_file:
                self._roll()
            if self._write_fd is None:
                self._write_fd = os.open(self.file_name(self.write_file_num), os.O_WRONLY | os.O_CREAT, 0o600)
                os.lseek(self._write_fd, self.write_pos, os.SEEK_SET)
            record = _LEN.pack(length) + data
            written = os.write(self._write_fd, record)
            if written != len(record):
                # a short write (disk full): cut it off so the file still ends on a record boundary
                os.ftruncate(self._write_fd, self.write_pos)
                raise OSError(28, f"short write ({written} of {len(record)} bytes)")
        except OSError as exc:
            self._drop_write_fd()
            log.error("DISKQUEUE(%s): failed to write - %s", self.name, exc)
            raise BackendError(f"failed to write to disk queue - {exc.strerror or exc}") from None
        self.write_pos += total
        self._depth += 1
        self._writes += 1
        self._mark_dirty()
        self._readable.set()

    def _check_write_file_linked(self, now: float) -> None:
        """A write file deleted under us (rm -rf of the data directory) would swallow writes into an
        unlinked inode: notice it, at most LINK_CHECK_INTERVAL late, and reopen (which then fails loudly)."""
        self._last_link_check = now
        if self._write_fd is not None and os.fstat(self._write_fd).st_nlink == 0:
            log.error("DISKQUEUE(%s): %s was removed from the disk", self.name, self.file_name(self.write_file_num))
            self._drop_write_fd()

    def _roll(self) -> None:
        """Next write file; go-diskqueue syncs at a roll, so the metadata never lags a whole file."""
        if self.read_file_num == self.write_file_num:
            self._max_bytes_per_file_read = self.write_pos
        if self._write_fd is not None:
            os.fsync(self._write_fd)
            self._retired_fds.append(self._write_fd)
            self._write_fd = None
        self.write_file_num += 1
        self.write_pos = 0
        self._persist_metadata(self._meta_text())
        self._close_retired()

    def _drop_write_fd(self) -> None:
        if self._write_fd is not None:
            if self._syncing:
                self._retired_fds.append(self._write_fd)
            else:
                os.close(self._write_fd)
            self._write_fd = None

    def _close_retired(self) -> None:
        if self._syncing:
            return  # a worker thread may be fsyncing one of them
        for fd in self._retired_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._retired_fds.clear()

    def _mark_dirty(self) -> None:
        self._needs_sync = True
        self._since_sync += 1
        if self._since_sync >= self.sync_every:
            self._sync_wanted.set()

    # --- reading ------------------------------------------------------------------------------

    def depth(self) -> int:
        return self._depth

    def _has_unread(self) -> bool:
        return self.read_file_num < self.write_file_num or self.read_pos < self.write_pos

    def read_nowait(self) -> bytes:
        # each read error skips a whole file, so this ends
        while self._has_unread():
            try:
                data = self._read_one()
            except (OSError, ValueError) as exc:
                log.error("DISKQUEUE(%s): reading at %s:%d failed - %s", self.name,
                          self.file_name(self.read_file_num), self.read_pos, exc)
                self._handle_read_error()
                continue
            self._move_forward(len(data))
            return data
        self._check_tail_corruption()
        self._readable = trio.Event()
        raise trio.WouldBlock

    def _read_one(self) -> bytes:
        if self._read_file is None:
            self._read_file = open(self.file_name(self.read_file_num), "rb")
            if self.read_pos:
                self._read_file.seek(self.read_pos)
            self._max_bytes_per_file_read = self.max_bytes_per_file
            if self.read_file_num < self.write_file_num:
                self._max_bytes_per_file_read = os.fstat(self._read_file.fileno()).st_size
        header = self._read_file.read(4)
        if len(header) < 4:
            raise ValueError("unexpected end of file reading a record length")
        (length,) = _LEN.unpack(header)
        if length < self.min_msg_size or length > self.max_msg_size:
            raise ValueError(f"invalid message read size ({length})")
        data = self._read_file.read(length)
        if len(data) < length:
            raise ValueError(f"unexpected end of file reading a record of {length} bytes")
        return data

    def _move_forward(self, length: int) -> None:
        self.read_pos += 4 + length
        self._depth -= 1
        if self.read_file_num < self.write_file_num and self.read_pos >= self._max_bytes_per_file_read:
            # this file is done: delete it and read the next
            self._close_read_file()
            old = self.file_name(self.read_file_num)
            self.read_file_num += 1
            self.read_pos = 0
            try:
                os.remove(old)
            except OSError as exc:
                log.error("DISKQUEUE(%s) failed to Remove(%s) - %s", self.name, old, exc)
        self._mark_dirty()
        self._check_tail_corruption()

    def _close_read_file(self) -> None:
        if self._read_file is not None:
            self._read_file.close()
            self._read_file = None

    def _handle_read_error(self) -> None:
        """As go-diskqueue: keep the bad file as `.bad`, jump to the next file, fix depth at the tail."""
        self._close_read_file()
        if self.read_file_num == self.write_file_num:
            self._drop_write_fd()
            self.write_file_num += 1
            self.write_pos = 0
        bad = self.file_name(self.read_file_num)
        log.warning("DISKQUEUE(%s) jump to next file and saving bad file as %s.bad", self.name, bad)
        try:
            os.rename(bad, bad + ".bad")
        except OSError as exc:
            log.error("DISKQUEUE(%s) failed to rename bad diskqueue file %s - %s", self.name, bad, exc)
        self.read_file_num += 1
        self.read_pos = 0
        self._needs_sync = True
        self._check_tail_corruption()

    def _check_tail_corruption(self) -> None:
        if self._has_unread():
            return
        if self._depth != 0:
            what = "negative depth at tail, metadata corruption" if self._depth < 0 else "positive depth at tail, data loss"
            log.error("DISKQUEUE(%s) %s (%d), resetting 0...", self.name, what, self._depth)
            self._depth = 0
            self._needs_sync = True
        if self.read_file_num != self.write_file_num or self.read_pos != self.write_pos:
            log.error("DISKQUEUE(%s) read position past write position, corruption, skipping to next file", self.name)
            self._skip_to_next_rw_file()

    def _skip_to_next_rw_file(self) -> None:
        self._close_read_file()
        self._drop_write_fd()
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
        self._needs_sync = True

    async def wait_readable(self) -> None:
        while not self._has_unread():
            if self._readable.is_set():
                self._readable = trio.Event()
            await self._readable.wait()

    # --- sync ---------------------------------------------------------------------------------

    async def sync(self) -> None:
        """Return once everything put before this call is on disk; concurrent callers share fsyncs."""
        target = self._writes
        while self._synced_writes < target:
            if self._syncing:
                await self._sync_done.wait()
            else:
                await self._sync_now()

    async def _sync_now(self) -> None:
        self._syncing = True
        done = self._sync_done
        writes = self._writes
        meta = self._meta_text()
        fds = [fd for fd in [self._write_fd, *self._retired_fds] if fd is not None]
        self._since_sync = 0
        self._needs_sync = False
        self._sync_wanted = trio.Event()
        try:
            await trio.to_thread.run_sync(self._fsync_and_persist, fds, meta)
        except OSError as exc:
            self._needs_sync = True
            log.error("DISKQUEUE(%s) failed to sync - %s", self.name, exc)
            raise BackendError(f"failed to sync disk queue - {exc}") from None
        finally:
            self._syncing = False
            self._sync_done = trio.Event()
            done.set()
            self._close_retired()
        self._synced_writes = max(self._synced_writes, writes)

    def _fsync_and_persist(self, fds: list[int], meta: bytes) -> None:
        for fd in fds:
            os.fsync(fd)
        self._persist_metadata(meta)
        self.fsync_count += 1

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The io_loop: fsync and metadata every sync_every reads/writes, or sync_timeout when dirty."""
        task_status.started()
        while True:
            with trio.move_on_after(self.sync_timeout):
                await self._sync_wanted.wait()
            if self._needs_sync and not self._syncing:
                try:
                    await self._sync_now()
                except BackendError:
                    pass  # logged; the next round tries again

    # --- admin --------------------------------------------------------------------------------

    async def empty(self) -> None:
        log.info("DISKQUEUE(%s): emptying", self.name)
        self._skip_to_next_rw_file()
        await self._sync_quietly()

    async def close(self) -> None:
        if self._closed:
            return
        await self._sync_quietly()
        self._closed = True
        self._close_read_file()
        self._drop_write_fd()
        self._close_retired()

    async def _sync_quietly(self) -> None:
        while self._syncing:
            await self._sync_done.wait()
        try:
            await self._sync_now()
        except BackendError:
            pass

    async def delete(self) -> None:
        self._closed = True
        while self._syncing:
            await self._sync_done.wait()
        self._close_read_file()
        self._drop_write_fd()
        self._close_retired()
        for num in range(self.read_file_num, self.write_file_num + 1):
            try:
                os.remove(self.file_name(num))
            except OSError:
                pass
        try:
            os.remove(self.meta_file_name())
        except OSError:
            pass
