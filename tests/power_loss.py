"""A power loss, in process: what the disk holds after one, rebuilt in place from what was fsynced.

Crash tests that kill -9 a broker keep the page cache: everything written is still there after the
restart, fsynced or not. `PowerLoss` is the other half: over one data directory it follows every write,
truncate, rename, remove and fsync the process makes there, keeps what each fsync made durable, and
`crash()` rewrites the directory to what a power loss may leave, so a test then reopens the broker's
objects on it (tests/test_power_loss.py).

    with PowerLoss(data_dir) as disk:
        ...                         # open a Topic on data_dir, publish, sync, ...
        kill(topic)                 # drop the crashed objects (tests/topic_owner.py)
        disk.crash("strict")        # what the disk holds after a power loss
        ...                         # reopen on data_dir, check, work, crash again

What it intercepts. While active it replaces attributes of the `os` module: open, write, writev, pwrite,
fsync, fdatasync, rename, replace, remove, unlink, truncate, ftruncate, close; and `builtins.open` /
`io.open` (pathlib's opens go through io.open) for files opened to write. A caller's `os.fsync(fd)` looks
`fsync` up on the os module when it runs, and so does code mypyc compiled (a compiled module keeps the
os *module* in a C static, not its functions), so compiled broker modules go through the wrappers too
(tested in tests/test_power_loss.py); replacing a module's global (`segment_log.os`) would not be seen by
compiled code, so nothing here does that. Everything is restored on exit.

The model (POSIX, the worst case a journaling file system is allowed):
- A file's content (by inode) is what it was at its last successful fsync or fdatasync, through any
  descriptor or name; no fsync since the harness started: what it held then; created since and never
  fsynced: empty.
- A directory's entries (name -> inode) are what they were at its last successful fsync (a descriptor
  opened with O_DIRECTORY, as broker/storage/files.py's fsync_dir does); what was there when the harness
  started counts as durable. So a name created since is gone, a name removed or renamed away since comes
  back (with its inode's durable content), and a rename over an existing name is undone.
- Modes of `crash()`: "strict" leaves exactly the durable state. "prefix": a file whose changes since
  its last fsync were only appends (its content is still its durable bytes followed by new ones) keeps
  a random prefix of the new bytes (ext4 may have written some back before the power went); "zeros": such
  a file keeps the new length but the new bytes read as zeros (a torn tail delayed allocation can leave).
  A file written below its durable length or truncated below it, one written through a Python file
  object or made behind the wrappers' back (a `dir_fd=` open: offsets not seen), and one whose every
  name is gone fall back to strict. Randomness is seeded
  (`PowerLoss(seed=...)` or `crash(seed=...)`).
- `fail_fsync(predicate)`: fsync (and fdatasync) of a path the predicate selects raises OSError(EIO)
  and makes nothing durable, until `fail_fsync(None)`. The page cache is left as it is (Linux may drop
  the dirty pages of a failed write-back; the model only says they were never durable: a later
  successful fsync makes what the page cache holds then durable, as a kernel that kept the pages would).

After `crash()` the harness goes on recording (crash, reopen, work, crash again). Every descriptor open
at the crash on a file or directory of the data directory is dead: a write, writev, pwrite, ftruncate,
fsync or fdatasync through it raises OSError(EIO) (closing it works), so the crashed objects cannot
write into the new state through their descriptors. Calls by path (os.rename, os.remove, os.open) cannot
be told apart: a test drops the crashed objects (tests/topic_owner.py's kill) before it reopens.

Not modelled: the data directory's own entry in its parent (nor any directory outside it); directories
created after the start (left as they are at a crash, their files unmodelled) and directory entries
that are not regular files; hard links (os.link) and `dir_fd=` calls (passed through unrecorded);
removal by means other than os.remove/unlink/rename (shutil.rmtree of a tracked file is seen only at the
next directory fsync); mmap; reordering within the model's rules beyond the three modes (e.g. a later
write reaching the disk while an earlier one does not, or metadata such as size and mtime on their own);
a page-sized granularity (prefixes are cut at any byte); two durable names for one inode come back as
two files.
"""

from __future__ import annotations

import builtins
import errno
import fcntl
import io
import os
import random
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

MODES = ("strict", "prefix", "zeros")
# the os functions wrapped (those the storage calls: grep broker/ shared/), and the file openers
WRAPPED = ("open", "write", "writev", "pwrite", "fsync", "fdatasync", "rename", "replace", "remove",
           "unlink", "truncate", "ftruncate", "close")

_real_os = {name: getattr(os, name) for name in WRAPPED}
_real_open = io.open
_real_fstat = os.fstat
_real_lstat = os.lstat
_real_listdir = os.listdir
_real_readlink = os.readlink

Key = tuple[int, int]  # (st_dev, st_ino)


O_APPEND = os.O_WRONLY | os.O_CREAT | os.O_APPEND


def write(path: Any, data: bytes, flags: int = O_APPEND, *, fsync: bool = True) -> None:
    """One write of `data` to a file (appended by default), fsynced if asked: the tests' workload step."""
    fd = os.open(path, flags, 0o600)
    try:
        os.write(fd, data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


class Event(NamedTuple):
    """One recorded call: the wrapper's name, the path it concerned (a descriptor's current name, or
    `src -> dst`), and a size (bytes written, a truncate's length) where there is one."""

    op: str
    path: str
    size: int | None = None


class Node:
    """One inode of the data directory as the model sees it."""

    __slots__ = ("key", "durable", "appends_only", "opaque", "perm", "writes", "fsyncs")

    def __init__(self, key: Key, durable: bytes, perm: int = 0o600, *, opaque: bool = False) -> None:
        self.key = key
        self.durable = durable  # the content at its last fsync
        self.appends_only = True  # since then: only bytes past len(durable) written, no truncate below it
        self.opaque = opaque  # written where offsets are not seen (a file object): strict at a crash
        self.perm = perm
        self.writes = 0
        self.fsyncs = 0


def _eio(what: str) -> OSError:
    return OSError(errno.EIO, f"{os.strerror(errno.EIO)} ({what})")


def _path(p: Any) -> str:
    return os.path.abspath(os.fsdecode(os.fspath(p)))


class PowerLoss:
    """What a power loss leaves of one data directory (see the module's docstring). A context manager:
    the os module is patched inside `with`, restored after; one instance active at a time."""

    _active: PowerLoss | None = None

    def __init__(self, data_dir: str | os.PathLike[str], *, seed: int = 0) -> None:
        self.data_dir = os.path.realpath(os.fspath(data_dir))
        self.rng = random.Random(seed)
        self.events: list[Event] = []
        self.crashes = 0
        self.fsync_failures: list[str] = []  # paths whose fsync was made to fail, in order
        self._fail: Callable[[str], bool] | None = None
        self._lock = threading.RLock()
        self._dirs: dict[Key, str] = {}  # tracked directories, by inode
        self._durable_dirs: dict[str, dict[str, Node]] = {}  # directory -> its durable entries
        self._inodes: dict[Key, Node] = {}  # live inodes of tracked files
        self._dead: dict[int, Key] = {}  # descriptors open at a crash -> the inode they had
        self._saved: dict[str, Any] = {}

    # --- the context --------------------------------------------------------------------------

    def __enter__(self) -> PowerLoss:
        assert PowerLoss._active is None, "one PowerLoss at a time"
        self._scan_start()
        for name in WRAPPED:
            self._saved[name] = getattr(os, name)
            setattr(os, name, getattr(self, f"_{name}"))
        self._saved["builtins.open"] = builtins.open
        self._saved["io.open"] = io.open
        builtins.open = self._open_file  # type: ignore[assignment]
        io.open = self._open_file  # type: ignore[assignment]
        PowerLoss._active = self
        return self

    def __exit__(self, *exc: object) -> None:
        for name in WRAPPED:
            setattr(os, name, self._saved[name])
        builtins.open = self._saved["builtins.open"]
        io.open = self._saved["io.open"]
        PowerLoss._active = None

    def _scan_start(self) -> None:
        """Everything there at the start is durable: every directory under data_dir, every file's bytes."""
        for folder, subdirs, names in os.walk(self.data_dir):
            st = _real_lstat(folder)
            self._dirs[(st.st_dev, st.st_ino)] = folder
            entries: dict[str, Node] = {}
            for name in names:
                path = os.path.join(folder, name)
                st = _real_lstat(path)
                if not stat.S_ISREG(st.st_mode):
                    continue
                key = (st.st_dev, st.st_ino)
                node = self._inodes.get(key)
                if node is None:
                    node = self._inodes[key] = Node(key, self._read(path), stat.S_IMODE(st.st_mode))
                entries[name] = node
            self._durable_dirs[folder] = entries

    # --- what a test asks ---------------------------------------------------------------------

    def fail_fsync(self, predicate: Callable[[str], bool] | None) -> None:
        """From now on fsync/fdatasync of a path (a descriptor's current name; a directory's path) for
        which `predicate(path)` is true raises OSError(EIO) and makes nothing durable; None: no more."""
        with self._lock:
            self._fail = predicate

    def durable(self, path: str | os.PathLike[str]) -> bytes | None:
        """What a strict crash now leaves at `path` (None: no such name)."""
        path = _path(path)
        with self._lock:
            entries = self._durable_dirs.get(os.path.realpath(os.path.dirname(path)), {})
            node = entries.get(os.path.basename(path))
            return None if node is None else node.durable

    def durable_names(self, folder: str | os.PathLike[str] | None = None) -> list[str]:
        """The names a crash now leaves in `folder` (the data directory by default), sorted."""
        with self._lock:
            return sorted(self._durable_dirs[os.path.realpath(os.fspath(folder or self.data_dir))])

    def ops(self, op: str) -> list[Event]:
        return [e for e in self.events if e.op == op]

    def crash(self, mode: str = "strict", *, seed: int | None = None) -> None:
        """The power goes and comes back: every tracked directory is rewritten in place to what the
        model says survives (every entry removed, every durable name written back with its inode's
        surviving bytes), and every descriptor open on it until now is dead (module docstring)."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        rng = self.rng if seed is None else random.Random(seed)
        with self._lock:
            current = self._page_cache() if mode != "strict" else {}
            self._kill_descriptors()
            for folder in self._durable_dirs:
                os.makedirs(folder, exist_ok=True)  # removed since: its own entry is not modelled
                for name in _real_listdir(folder):
                    path = os.path.join(folder, name)
                    if not stat.S_ISDIR(_real_lstat(path).st_mode):
                        _real_os["remove"](path)
            self._inodes = {}
            for folder, entries in self._durable_dirs.items():
                survived: dict[str, Node] = {}
                for name in sorted(entries):
                    node = entries[name]
                    data = self._survivor(node, mode, current.get(node.key), rng)
                    survived[name] = self._write_back(os.path.join(folder, name), data, node.perm)
                self._durable_dirs[folder] = survived
            self.crashes += 1
            self.events.append(Event("crash", mode))

    def _page_cache(self) -> dict[Key, bytes]:
        """What the page cache holds of every durable inode that may keep unsynced appends."""
        wanted = {node.key for entries in self._durable_dirs.values() for node in entries.values()
                  if node.appends_only and not node.opaque}
        current: dict[Key, bytes] = {}
        for folder in self._durable_dirs:
            for name in (_real_listdir(folder) if os.path.isdir(folder) else ()):
                path = os.path.join(folder, name)
                st = _real_lstat(path)
                key = (st.st_dev, st.st_ino)
                if key in wanted and key not in current and stat.S_ISREG(st.st_mode):
                    current[key] = self._read(path)
        return current

    @staticmethod
    def _survivor(node: Node, mode: str, now: bytes | None, rng: random.Random) -> bytes:
        durable = node.durable
        if mode == "strict" or now is None or not node.appends_only or node.opaque:
            return durable
        if len(now) <= len(durable) or not now.startswith(durable):
            return durable
        new = len(now) - len(durable)
        if mode == "zeros":
            return durable + bytes(new)
        return now[:len(durable) + rng.randint(0, new)]

    def _write_back(self, path: str, data: bytes, perm: int) -> Node:
        fd = _real_os["open"](path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, perm)
        try:
            view = memoryview(data)
            while view:
                view = view[_real_os["write"](fd, view):]
            st = _real_fstat(fd)
        finally:
            _real_os["close"](fd)
        key = (st.st_dev, st.st_ino)
        node = self._inodes[key] = Node(key, data, perm)
        return node

    def _kill_descriptors(self) -> None:
        """Every descriptor of this process on a tracked file or directory: dead from now on."""
        for name in _real_listdir("/proc/self/fd"):
            fd = int(name)
            try:
                st = _real_fstat(fd)
            except OSError:
                continue  # the listing's own descriptor, closed by now
            key = (st.st_dev, st.st_ino)
            if key in self._inodes or key in self._dirs or self._names_durably(key):
                self._dead[fd] = key

    def _names_durably(self, key: Key) -> bool:
        return any(node.key == key for entries in self._durable_dirs.values() for node in entries.values())

    # --- bookkeeping ----------------------------------------------------------------------------

    @staticmethod
    def _read(path: str) -> bytes:
        fd = _real_os["open"](path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            _real_os["close"](fd)

    def _tracked_dir(self, path: str) -> str | None:
        """The tracked directory `path` is in (None: not one of ours)."""
        try:
            st = os.stat(os.path.dirname(path))
        except OSError:
            return None
        return self._dirs.get((st.st_dev, st.st_ino))

    @staticmethod
    def _fd_name(fd: int) -> str:
        name = _real_readlink(f"/proc/self/fd/{fd}")
        return name[:-len(" (deleted)")] if name.endswith(" (deleted)") else name

    def _check_dead(self, fd: int, st: os.stat_result, op: str) -> None:
        key = self._dead.get(fd)
        if key is None:
            return
        if key == (st.st_dev, st.st_ino):
            raise _eio(f"{op} on a descriptor opened before the power loss")
        del self._dead[fd]  # closed behind our back, the number reused since

    def _file_of(self, fd: int, op: str) -> Node | None:
        """The tracked inode `fd` is open on (None: not ours); raises EIO for a dead descriptor."""
        try:
            st = _real_fstat(fd)
        except (OSError, TypeError, ValueError):
            return None  # the real call reports it
        self._check_dead(fd, st, op)
        return self._node(fd, st)

    def _node(self, fd: int, st: os.stat_result) -> Node | None:
        """The Node of a regular file: known, or one made behind our back (not through a wrapper) whose
        name is in a tracked directory (nothing of it durable yet, its writes unseen: strict)."""
        if not stat.S_ISREG(st.st_mode):
            return None
        key = (st.st_dev, st.st_ino)
        node = self._inodes.get(key)
        if node is None and st.st_nlink > 0 and self._tracked_dir(self._fd_name(fd)) is not None:
            node = self._inodes[key] = Node(key, b"", stat.S_IMODE(st.st_mode), opaque=True)
        return node

    def _wrote(self, fd: int, op: str, size: int, offset: int | None) -> None:
        """Before a write of `size` bytes at `offset` (None: the descriptor's position, or the end)."""
        node = self._file_of(fd, op)
        if node is None:
            return
        if offset is None:
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND:
                offset = _real_fstat(fd).st_size
            else:
                offset = os.lseek(fd, 0, os.SEEK_CUR)
        if offset < len(node.durable):
            node.appends_only = False
        node.writes += 1
        self.events.append(Event(op, self._fd_name(fd), size))

    def _truncated(self, node: Node | None, length: int) -> None:
        if node is not None and length < len(node.durable):
            node.appends_only = False

    def _created(self, path: str, fd: int, *, opaque: bool = False) -> None:
        st = _real_fstat(fd)
        key = (st.st_dev, st.st_ino)
        self._inodes[key] = Node(key, b"", stat.S_IMODE(st.st_mode), opaque=opaque)
        self.events.append(Event("create", path))

    def _snapshot_dir(self, folder: str) -> None:
        """A directory fsync: its entries now are its durable entries."""
        entries: dict[str, Node] = {}
        for name in _real_listdir(folder):
            try:
                st = _real_lstat(os.path.join(folder, name))
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            key = (st.st_dev, st.st_ino)
            node = self._inodes.get(key)
            if node is None:  # made behind our back: never fsynced as far as we know
                node = self._inodes[key] = Node(key, b"", stat.S_IMODE(st.st_mode), opaque=True)
            entries[name] = node
        self._durable_dirs[folder] = entries

    def _forget_last_link(self, path: str) -> Key | None:
        """Before `path` loses its name: its inode, when that is its last link (the number may be reused
        by a new file afterwards, so the inode leaves the live map; the model keeps its Node)."""
        try:
            st = _real_lstat(path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino) if st.st_nlink <= 1 else None

    # --- the wrappers ---------------------------------------------------------------------------

    def _open(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        real = _real_os["open"]
        if dir_fd is not None:
            return real(path, flags, mode, dir_fd=dir_fd)
        with self._lock:
            name = _path(path)
            folder = self._tracked_dir(name)
            existed = folder is not None and os.path.lexists(name)
            fd = real(path, flags, mode)
            self._dead.pop(fd, None)  # the number is new again
            if folder is None:
                return fd
            try:
                if not existed and flags & os.O_CREAT:
                    self._created(name, fd)
                elif flags & os.O_TRUNC and flags & (os.O_WRONLY | os.O_RDWR):
                    node = self._file_of(fd, "open")
                    self._truncated(node, 0)
                    if node is not None:
                        self.events.append(Event("truncate", name, 0))
            except BaseException:
                _real_os["close"](fd)
                raise
            return fd

    def _open_file(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        """builtins.open / io.open: reads pass through; a file opened to write is noted (created,
        truncated; its writes are not seen, so it falls back to strict at a crash)."""
        if isinstance(file, int) or not any(c in mode for c in "wax+"):
            return _real_open(file, mode, *args, **kwargs)
        with self._lock:
            name = _path(file)
            folder = self._tracked_dir(name)
            existed = folder is not None and os.path.lexists(name)
            fh = _real_open(file, mode, *args, **kwargs)
            if folder is not None:
                fd = fh.fileno()
                self._dead.pop(fd, None)
                if not existed:
                    self._created(name, fd, opaque=True)
                else:
                    node = self._file_of(fd, "open")
                    if node is not None:
                        node.opaque = True
                        if "w" in mode:
                            self._truncated(node, 0)
            return fh

    def _write(self, fd: int, data: Any) -> int:
        with self._lock:
            self._wrote(fd, "write", len(memoryview(data)), None)
            return _real_os["write"](fd, data)

    def _writev(self, fd: int, buffers: Any) -> int:
        with self._lock:
            buffers = list(buffers)
            self._wrote(fd, "writev", sum(len(memoryview(b)) for b in buffers), None)
            return _real_os["writev"](fd, buffers)

    def _pwrite(self, fd: int, data: Any, offset: int) -> int:
        with self._lock:
            self._wrote(fd, "pwrite", len(memoryview(data)), offset)
            return _real_os["pwrite"](fd, data, offset)

    def _fsync(self, fd: Any) -> None:
        self._sync(fd, "fsync")

    def _fdatasync(self, fd: Any) -> None:
        self._sync(fd, "fdatasync")

    def _sync(self, fd: Any, op: str) -> None:
        real = _real_os[op]
        if not isinstance(fd, int):
            fd = fd.fileno()
        with self._lock:
            try:
                st = _real_fstat(fd)
            except OSError:
                real(fd)  # not a descriptor: the real call says so
                return
            self._check_dead(fd, st, op)
            key = (st.st_dev, st.st_ino)
            folder = self._dirs.get(key) if stat.S_ISDIR(st.st_mode) else None
            node = self._node(fd, st)
            if folder is None and node is None:
                real(fd)
                return
            path = folder if folder is not None else self._fd_name(fd)
            if self._fail is not None and self._fail(path):
                self.fsync_failures.append(path)
                self.events.append(Event(f"{op} failed", path))
                raise _eio(f"{op} of {path} made to fail by PowerLoss")
            real(fd)
            self.events.append(Event(op, path))
            if folder is not None:
                self._snapshot_dir(folder)
            elif node is not None:
                node.durable = self._read(f"/proc/self/fd/{fd}")
                node.appends_only = True
                node.fsyncs += 1

    def _rename(self, src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        self._move("rename", src, dst, src_dir_fd, dst_dir_fd)

    def _replace(self, src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        self._move("replace", src, dst, src_dir_fd, dst_dir_fd)

    def _move(self, op: str, src: Any, dst: Any, src_dir_fd: int | None, dst_dir_fd: int | None) -> None:
        real = _real_os[op]
        if src_dir_fd is not None or dst_dir_fd is not None:
            real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            return
        with self._lock:
            s, d = _path(src), _path(dst)
            ours = self._tracked_dir(s) is not None or self._tracked_dir(d) is not None
            if not ours:
                real(src, dst)
                return
            moved = _real_lstat(s) if os.path.lexists(s) else None
            gone = self._forget_last_link(d)
            real(src, dst)
            if gone is not None and (moved is None or gone != (moved.st_dev, moved.st_ino)):
                self._inodes.pop(gone, None)
            self.events.append(Event(op, f"{s} -> {d}"))

    def _remove(self, path: Any, *, dir_fd: int | None = None) -> None:
        self._unlink_as("remove", path, dir_fd)

    def _unlink(self, path: Any, *, dir_fd: int | None = None) -> None:
        self._unlink_as("unlink", path, dir_fd)

    def _unlink_as(self, op: str, path: Any, dir_fd: int | None) -> None:
        real = _real_os[op]
        if dir_fd is not None:
            real(path, dir_fd=dir_fd)
            return
        with self._lock:
            name = _path(path)
            if self._tracked_dir(name) is None:
                real(path)
                return
            gone = self._forget_last_link(name)
            real(path)
            if gone is not None:
                self._inodes.pop(gone, None)
            self.events.append(Event(op, name))

    def _truncate(self, path: Any, length: int) -> None:
        if isinstance(path, int):
            self._ftruncate(path, length)
            return
        with self._lock:
            name = _path(path)
            if self._tracked_dir(name) is not None:
                try:
                    st = os.stat(name)
                except OSError:
                    pass  # the real call reports it
                else:
                    self._truncated(self._inodes.get((st.st_dev, st.st_ino)), length)
                    self.events.append(Event("truncate", name, length))
            _real_os["truncate"](path, length)

    def _ftruncate(self, fd: int, length: int) -> None:
        with self._lock:
            node = self._file_of(fd, "ftruncate")
            if node is not None:
                self._truncated(node, length)
                self.events.append(Event("ftruncate", self._fd_name(fd), length))
            _real_os["ftruncate"](fd, length)

    def _close(self, fd: int) -> None:
        with self._lock:
            self._dead.pop(fd, None)
            _real_os["close"](fd)


@pytest.fixture
def power_loss(tmp_path: Path) -> Iterator[PowerLoss]:
    """A PowerLoss over a fresh `tmp_path / "data"` (seed 0), active for the test."""
    data = tmp_path / "data"
    data.mkdir()
    with PowerLoss(data) as disk:
        yield disk
