"""Every crash state of a recorded workload, checked (issue 48: enumerate, do not sample).

tests/power_loss.py's PowerLoss rewrites a data directory to ONE state a power loss may leave, where a test
calls `crash()`. This module does what the ALICE study and CrashMonkey do instead:

1. `Recorder` (a PowerLoss) records a workload once: every file-system call the process makes in the data
   directory, with what replaying it needs (a write's offset and bytes, a truncate's length, a rename's
   names, an unlink, an fsync of a file with the content it made durable, of a directory, a failed fsync),
   and the marks the workload puts in the stream when the broker *answered* something (`disk.mark(...)`).
   It intercepts the os module as PowerLoss does (attributes of `os`, so code mypyc compiled goes through
   it too).
2. `crash_states` replays the calls in a model of the disk and, at every call boundary, yields every state
   a power loss may leave there (within the bounds below), deduplicated: the same directory content
   reached at many boundaries is opened once and judged against each boundary's expectations.
3. `check_workload` writes each distinct state into a fresh directory, opens the broker's objects on it in
   process as a restart does (NSQD: nsqd.dat, its journal, each topic with its log, cursors and keys; the
   durable tail noted before the first round, then one round, whose fsyncs are skipped: a scratch copy),
   and checks what the README promises against what was answered before the boundary (`Expected`, built
   from the marks): every topic, channel, pause, message, Idempotency-Key and log id answered is there;
   nothing deleted (topic, channel, its messages, keys, log id) comes back; a position served holds the
   record it held; the durable tail shown does not go back; the positional flag given out stays; a kept
   key has its messages; a dead letter is in its channel or the dead-letter topic. A request asked and
   not answered (creating, pausing, deleting, a seek) may have happened or not. One line per workload:
   distinct states checked, states enumerated, call boundaries, violations.

The model of one boundary (POSIX, the worst a journaling file system is allowed, as PowerLoss):
- Directory entries: what the directory held at its last successful fsync, plus any subset of the
  operations since (create, unlink, rename) that respects their order on each name (a rename of `a` to
  `b` is durable only if `a`'s creation is; a later operation on a name only if the earlier ones on it
  are). Bound: with at most `ALL_SUBSETS_UP_TO` (8) pending operations every such subset (<= 256); with
  more: none, all, each prefix in call order, each single operation with what it depends on, and
  `SAMPLED_SUBSETS` (16) random ones (seeded) closed the same way.
- File content (by inode), one mode for all files of a state: "strict" (content at the last fsync),
  and for a file only appended to since: "kept" (the whole page cache), "first" (the first unsynced
  write: a record or batch boundary), "last" (all but the last unsynced write), "torn" (half of the
  first unsynced write), "zeros" (the new length, read as zeros); and for each file with an unsynced
  tail, one state where only its tail is kept (the others strict) and one where only it is strict (the
  others kept). A file written in place, truncated below its durable length or written through a file
  object is strict in every mode.
- A failed fsync (Linux): the dirty pages may have been dropped and the NEXT fsync reports success
  without writing them. When the workload has one, each state also comes in a "dropped" variant where
  the bytes written before the failed fsync read as they did at the last good fsync (zeros past its
  length), whatever later fsyncs say. (A failed directory fsync: not modelled beyond "not durable": its
  operations stay pending until a later successful one.)
Not modelled (as PowerLoss): directories made after the start, hard links, dir_fd= calls, mmap.
"""

from __future__ import annotations

import copy
import errno
import fcntl
import functools
import logging
import os
import random
import shutil
import stat
import struct
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import httpx
import trio

from trio_nsq.broker.nsqd import NSQD
from trio_nsq.broker.options import Options
from trio_nsq.broker.storage.log_index import PositionError
from trio_nsq.testing.embed import run_nsqd
from tests.power_loss import PowerLoss, _path, _real_fstat, _real_lstat
from tests.topic_owner import kill

ALL_SUBSETS_UP_TO = 8
SAMPLED_SUBSETS = 16
TAIL_MODES = ("strict", "kept", "first", "last", "torn", "zeros")


# --- the recorded calls -------------------------------------------------------------------------------


class Create(NamedTuple):
    dir: str
    name: str
    ino: int


class Write(NamedTuple):
    ino: int
    offset: int
    data: bytes


class Trunc(NamedTuple):
    ino: int
    length: int


class Rename(NamedTuple):
    src_dir: str
    src: str
    dst_dir: str
    dst: str
    ino: int


class Unlink(NamedTuple):
    dir: str
    name: str


class Fsync(NamedTuple):
    ino: int
    content: bytes  # what the fsync made durable (read back: right for writes not seen too)


class DirSync(NamedTuple):
    dir: str


class FsyncFailed(NamedTuple):
    ino: int | None  # None: a directory's
    dir: str | None


class Opaque(NamedTuple):
    """A file opened through a file object to write: its writes are not seen until its next fsync."""

    ino: int


class Mark(NamedTuple):
    kind: str
    what: dict[str, Any]


Call = Create | Write | Trunc | Rename | Unlink | Fsync | DirSync | FsyncFailed | Opaque | Mark


class Recorder(PowerLoss):
    """A PowerLoss that also keeps `calls`: each call on the data directory with what replaying it needs,
    and the workload's marks. Inodes are numbered by the recorder (a number the kernel reuses for a new
    file is a new inode here). `initial`: the files there at the start, durable."""

    def __init__(self, data_dir: str | os.PathLike[str], *, seed: int = 0) -> None:
        super().__init__(data_dir, seed=seed)
        self.calls: list[Call] = []
        self.initial: dict[tuple[str, str], tuple[int, bytes]] = {}
        self._ids: dict[tuple[int, int], int] = {}
        self._count = 0
        self._fail_writes: Callable[[str], bool] | None = None

    def fail_writes(self, predicate: Callable[[str], bool] | None) -> None:
        """From now on a write to a file whose path the predicate selects raises OSError(ENOSPC) and
        writes nothing (a full disk), until `fail_writes(None)`."""
        with self._lock:
            self._fail_writes = predicate

    def _check_write(self, fd: int) -> None:
        if self._fail_writes is not None and self._target(fd) is not None:
            path = self._fd_name(fd)
            if self._fail_writes(path):
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (write to {path} made to fail)")

    def __enter__(self) -> Recorder:
        super().__enter__()
        return self

    def mark(self, kind: str, **what: Any) -> None:
        """The workload was answered (or is about to ask: "attempt"): the expectations change here."""
        with self._lock:
            self.calls.append(Mark(kind, what))

    @property
    def failed_fsyncs(self) -> int:
        return sum(isinstance(c, FsyncFailed) for c in self.calls)

    # --- numbering ------------------------------------------------------------------------------

    def _rel(self, folder: str) -> str:
        return os.path.relpath(folder, self.data_dir)

    def _new_id(self, key: tuple[int, int]) -> int:
        self._count += 1
        self._ids[key] = self._count
        return self._count

    def _id_of(self, key: tuple[int, int]) -> int:
        found = self._ids.get(key)
        return found if found is not None else self._new_id(key)

    def _scan_start(self) -> None:
        super()._scan_start()
        for folder, entries in self._durable_dirs.items():
            for name, node in entries.items():
                self.initial[(self._rel(folder), name)] = (self._id_of(node.key), node.durable)

    def _target(self, fd: int) -> int | None:
        """The recorder's number for the tracked regular file `fd` is open on (None: not ours, or dead)."""
        try:
            st = _real_fstat(fd)
        except (OSError, TypeError, ValueError):
            return None
        key = (st.st_dev, st.st_ino)
        if self._dead.get(fd) == key or not stat.S_ISREG(st.st_mode):
            return None
        if self._node(fd, st) is None:
            return None
        return self._id_of(key)

    def _offset(self, fd: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND:
            return _real_fstat(fd).st_size
        return os.lseek(fd, 0, os.SEEK_CUR)

    # --- the wrappers, recording ------------------------------------------------------------------

    def _created(self, path: str, fd: int, *, opaque: bool = False) -> None:
        super()._created(path, fd, opaque=opaque)
        st = _real_fstat(fd)
        ino = self._new_id((st.st_dev, st.st_ino))
        folder = self._tracked_dir(path)
        assert folder is not None
        self.calls.append(Create(self._rel(folder), os.path.basename(path), ino))
        if opaque:
            self.calls.append(Opaque(ino))

    def _open(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        with self._lock:
            seen = len(self.events)
            fd = super()._open(path, flags, mode, dir_fd=dir_fd)
            if any(e.op == "truncate" for e in self.events[seen:]):
                ino = self._target(fd)
                if ino is not None:
                    self.calls.append(Trunc(ino, 0))
            return fd

    def _open_file(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            calls = len(self.calls)
            fh = super()._open_file(file, mode, *args, **kwargs)
            if isinstance(file, int) or not any(c in mode for c in "wax+") or len(self.calls) > calls:
                return fh  # not written, or created (Create and Opaque recorded)
            ino = self._target(fh.fileno())
            if ino is not None:
                self.calls.append(Opaque(ino))
                if "w" in mode:
                    self.calls.append(Trunc(ino, 0))
            return fh

    def _write(self, fd: int, data: Any) -> int:
        with self._lock:
            self._check_write(fd)
            ino = self._target(fd)
            offset = self._offset(fd) if ino is not None else 0
            n = super()._write(fd, data)
            if ino is not None:
                self.calls.append(Write(ino, offset, bytes(memoryview(data).cast("B")[:n])))
            return n

    def _writev(self, fd: int, buffers: Any) -> int:
        with self._lock:
            buffers = list(buffers)
            self._check_write(fd)
            ino = self._target(fd)
            offset = self._offset(fd) if ino is not None else 0
            n = super()._writev(fd, buffers)
            if ino is not None:
                data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
                self.calls.append(Write(ino, offset, data[:n]))
            return n

    def _pwrite(self, fd: int, data: Any, offset: int) -> int:
        with self._lock:
            self._check_write(fd)
            ino = self._target(fd)
            n = super()._pwrite(fd, data, offset)
            if ino is not None:
                self.calls.append(Write(ino, offset, bytes(memoryview(data).cast("B")[:n])))
            return n

    def _sync(self, fd: Any, op: str) -> None:
        if not isinstance(fd, int):
            fd = fd.fileno()
        with self._lock:
            seen = len(self.events)
            try:
                super()._sync(fd, op)
            except OSError:
                if len(self.events) > seen and self.events[-1].op.endswith(" failed"):
                    path = self.events[-1].path
                    if path in self._durable_dirs:
                        self.calls.append(FsyncFailed(None, self._rel(path)))
                    else:
                        self.calls.append(FsyncFailed(self._target(fd), None))
                raise
            if len(self.events) == seen:
                return  # not ours
            path = self.events[-1].path
            if path in self._durable_dirs:
                self.calls.append(DirSync(self._rel(path)))
                return
            st = _real_fstat(fd)
            node = self._inodes.get((st.st_dev, st.st_ino))
            if node is not None:
                self.calls.append(Fsync(self._id_of(node.key), node.durable))

    def _move(self, op: str, src: Any, dst: Any, src_dir_fd: int | None, dst_dir_fd: int | None) -> None:
        with self._lock:
            seen = len(self.events)
            s, d = _path(src), _path(dst)
            moved = _real_lstat(s) if os.path.lexists(s) else None
            sdir, ddir = self._tracked_dir(s), self._tracked_dir(d)
            super()._move(op, src, dst, src_dir_fd, dst_dir_fd)
            if len(self.events) == seen or moved is None:
                return
            ino = self._id_of((moved.st_dev, moved.st_ino))
            if sdir is not None and ddir is not None:
                self.calls.append(Rename(self._rel(sdir), os.path.basename(s), self._rel(ddir), os.path.basename(d), ino))
            elif sdir is not None:
                self.calls.append(Unlink(self._rel(sdir), os.path.basename(s)))
            elif ddir is not None:  # came from outside: a new name for an inode never seen written
                self.calls.append(Create(self._rel(ddir), os.path.basename(d), ino))
                self.calls.append(Opaque(ino))

    def _unlink_as(self, op: str, path: Any, dir_fd: int | None) -> None:
        with self._lock:
            seen = len(self.events)
            name = _path(path)
            folder = self._tracked_dir(name) if dir_fd is None else None
            super()._unlink_as(op, path, dir_fd)
            if len(self.events) > seen and folder is not None:
                self.calls.append(Unlink(self._rel(folder), os.path.basename(name)))

    def _truncate(self, path: Any, length: int) -> None:
        if isinstance(path, int):
            self._ftruncate(path, length)
            return
        with self._lock:
            seen = len(self.events)
            name = _path(path)
            ino = None
            if self._tracked_dir(name) is not None:
                try:
                    st = os.stat(name)
                    ino = self._id_of((st.st_dev, st.st_ino))
                except OSError:
                    pass
            super()._truncate(path, length)
            if ino is not None and len(self.events) > seen:
                self.calls.append(Trunc(ino, length))

    def _ftruncate(self, fd: int, length: int) -> None:
        with self._lock:
            ino = self._target(fd)
            super()._ftruncate(fd, length)
            if ino is not None:
                self.calls.append(Trunc(ino, length))


# --- the model of the disk, replayed ------------------------------------------------------------------


class INode:
    __slots__ = ("data", "durable", "dropped", "writes", "appends_only", "opaque", "lost")

    def __init__(self, durable: bytes = b"") -> None:
        self.data = bytearray(durable)  # the page cache
        self.durable = durable  # at the last successful fsync
        self.dropped = durable  # the same, had a failed fsync's pages been dropped
        self.writes: list[tuple[int, int]] = []  # (offset, length) since the last successful fsync
        self.appends_only = True
        self.opaque = False
        self.lost: list[tuple[int, int]] = []  # written before a failed fsync, not since made durable

    def tail(self, mode: str) -> bytes:
        """The content a power loss leaves in `mode` (the module's docstring)."""
        durable = self.durable
        if mode == "strict" or not self.appends_only or self.opaque or len(self.data) <= len(durable):
            return durable
        if mode == "kept":
            return bytes(self.data)
        if mode == "zeros":
            return durable + bytes(len(self.data) - len(durable))
        appended = [w for w in self.writes if w[0] >= len(durable)]
        if not appended:
            return durable
        if mode == "first":
            offset, length = appended[0]
            return bytes(self.data[:offset + length]) if offset == len(durable) else durable
        if mode == "torn":
            offset, length = appended[0]
            return bytes(self.data[:offset + max(1, length // 2)]) if offset == len(durable) else durable
        if mode == "last":
            offset, _ = appended[-1]
            return bytes(self.data[:offset])
        raise ValueError(mode)


class DirOp(NamedTuple):
    kind: str  # create, unlink, rename
    dir: str
    names: tuple[str, ...]
    ino: int | None


@dataclass
class Disk:
    """The replayed disk: inodes by the recorder's numbers, directories live and durable, the directory
    operations not yet durable."""

    inodes: dict[int, INode] = field(default_factory=dict)
    live: dict[str, dict[str, int]] = field(default_factory=dict)
    durable: dict[str, dict[str, int]] = field(default_factory=dict)
    pending: list[DirOp] = field(default_factory=list)

    def apply(self, call: Call) -> None:
        if isinstance(call, Create):
            self.inodes[call.ino] = INode()
            self.live.setdefault(call.dir, {})[call.name] = call.ino
            self.pending.append(DirOp("create", call.dir, (call.name,), call.ino))
        elif isinstance(call, Write):
            node = self.inodes.setdefault(call.ino, INode())
            end = call.offset + len(call.data)
            if call.offset < len(node.durable):
                node.appends_only = False
            if len(node.data) < call.offset:
                node.data.extend(bytes(call.offset - len(node.data)))
            node.data[call.offset:end] = call.data
            node.writes.append((call.offset, len(call.data)))
            if node.lost:  # written again after the failed fsync: those pages are dirty again
                node.lost = _minus(node.lost, call.offset, end)
        elif isinstance(call, Trunc):
            node = self.inodes.setdefault(call.ino, INode())
            if call.length < len(node.durable):
                node.appends_only = False
            del node.data[call.length:]
            if len(node.data) < call.length:
                node.data.extend(bytes(call.length - len(node.data)))
        elif isinstance(call, Fsync):
            node = self.inodes.setdefault(call.ino, INode())
            dropped = bytearray(call.content)
            for offset, length in node.lost:  # the pages the failed fsync dropped: as the last good fsync had them
                end = min(offset + length, len(dropped))
                if offset < end:
                    old = node.dropped[offset:end]
                    dropped[offset:end] = old + bytes(end - offset - len(old))
            node.durable, node.dropped = call.content, bytes(dropped)
            node.data = bytearray(call.content)
            node.writes, node.lost = [], []
            node.appends_only, node.opaque = True, False
        elif isinstance(call, FsyncFailed):
            if call.ino is not None and call.ino in self.inodes:
                node = self.inodes[call.ino]
                node.lost.extend(node.writes)
        elif isinstance(call, Opaque):
            self.inodes.setdefault(call.ino, INode()).opaque = True
        elif isinstance(call, Rename):
            entries = self.live.setdefault(call.src_dir, {})
            ino = entries.pop(call.src, call.ino)
            self.live.setdefault(call.dst_dir, {})[call.dst] = ino
            if call.src_dir == call.dst_dir:
                self.pending.append(DirOp("rename", call.src_dir, (call.src, call.dst), ino))
            else:
                self.pending.append(DirOp("unlink", call.src_dir, (call.src,), None))
                self.pending.append(DirOp("create", call.dst_dir, (call.dst,), ino))
        elif isinstance(call, Unlink):
            self.live.setdefault(call.dir, {}).pop(call.name, None)
            self.pending.append(DirOp("unlink", call.dir, (call.name,), None))
        elif isinstance(call, DirSync):
            self.durable[call.dir] = dict(self.live.get(call.dir, {}))
            self.pending = [op for op in self.pending if op.dir != call.dir]

    def entries(self, chosen: list[DirOp]) -> dict[str, dict[str, int]]:
        """Each directory's entries with the operations `chosen` (in call order) made durable."""
        out = {d: dict(e) for d, e in self.durable.items()}
        for op in chosen:
            entries = out.setdefault(op.dir, {})
            if op.kind == "create":
                assert op.ino is not None
                entries[op.names[0]] = op.ino
            elif op.kind == "unlink":
                entries.pop(op.names[0], None)
            else:
                src, dst = op.names
                if src in entries:
                    entries[dst] = entries.pop(src)
        return out


def _minus(regions: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """(offset, length) regions without [start, end)."""
    out = []
    for offset, length in regions:
        stop = offset + length
        if offset < start:
            out.append((offset, min(stop, start) - offset))
        if stop > end:
            out.append((max(offset, end), stop - max(offset, end)))
    return [r for r in out if r[1] > 0]


def _closed_subsets(ops: list[DirOp], rng: random.Random) -> Iterator[tuple[int, ...]]:
    """Subsets of the pending directory operations (indexes) that respect each name's order."""
    n = len(ops)
    deps: list[int] = []  # bitmask of the earlier operations on a name op j touches
    for j, op in enumerate(ops):
        mask = 0
        for i in range(j):
            if ops[i].dir == op.dir and set(ops[i].names) & set(op.names):
                mask |= 1 << i | deps[i]
        deps.append(mask)

    def closed(mask: int) -> bool:
        return all(not (mask >> j & 1) or deps[j] & mask == deps[j] for j in range(n))

    def closure(mask: int) -> int:
        for j in range(n):
            if mask >> j & 1:
                mask |= deps[j]
        return mask

    if n <= ALL_SUBSETS_UP_TO:
        masks: set[int] = {m for m in range(1 << n) if closed(m)}
    else:
        masks = {0, (1 << n) - 1}
        masks.update((1 << k) - 1 for k in range(1, n))  # each prefix (closed: deps point backwards)
        masks.update(closure(1 << j) for j in range(n))
        masks.update(closure(rng.getrandbits(n)) for _ in range(SAMPLED_SUBSETS))
    for mask in sorted(masks):
        yield tuple(j for j in range(n) if mask >> j & 1)


State = frozenset[tuple[str, bytes]]  # (relative path, content)


@dataclass
class Enumeration:
    """The distinct states of a recorded workload and, for each, the boundaries (counts of marks
    before the crash) it was reached at, with a description of one way it is reached."""

    states: dict[State, dict[int, str]] = field(default_factory=dict)
    enumerated: int = 0  # states generated before deduplication
    sampled: int = 0  # boundaries with more pending directory operations than ALL_SUBSETS_UP_TO (sampled)
    boundaries: int = 0


def crash_states(recorder: Recorder, *, seed: int = 0) -> Enumeration:
    """Every state a power loss may leave at each call boundary of the recorded workload (module docstring)."""
    rng = random.Random(seed)
    disk = Disk()
    for (folder, name), (ino, data) in recorder.initial.items():
        disk.inodes[ino] = INode(data)
        disk.live.setdefault(folder, {})[name] = ino
        disk.durable.setdefault(folder, {})[name] = ino
    disk.live.setdefault(".", {})
    disk.durable.setdefault(".", {})
    out = Enumeration()
    modes = TAIL_MODES + (("dropped",) if recorder.failed_fsyncs else ())
    marks = 0
    calls = recorder.calls
    last: list[tuple[State, str]] = []
    for at in range(len(calls) + 1):
        out.boundaries += 1
        if at and isinstance(calls[at - 1], Mark):
            marks += 1  # the disk is as it was: the same states, judged with one more answer
            for state, how in last:
                out.states.setdefault(state, {}).setdefault(marks, how + " (after an answer)")
            continue
        if at:
            disk.apply(calls[at - 1])
        last = []
        pending = disk.pending
        if len(pending) > ALL_SUBSETS_UP_TO:
            out.sampled += 1
        contents: dict[tuple[str, int], bytes] = {}

        def content(mode: str, ino: int) -> bytes:
            found = contents.get((mode, ino))
            if found is None:
                node = disk.inodes.get(ino) or INode()
                found = contents[(mode, ino)] = node.dropped if mode == "dropped" else node.tail(mode)
            return found
        for subset in _closed_subsets(pending, rng):
            entries = disk.entries([pending[j] for j in subset])
            named = [(name if folder == "." else os.path.join(folder, name), ino)
                     for folder, names in entries.items() for name, ino in names.items()]
            # one mode for every file, then each file with an unsynced tail on its own: only its tail
            # kept (the others strict), and only it strict (the others kept)
            mixes: list[tuple[str, dict[int, str], str]] = [(mode, {}, mode) for mode in modes]
            for path, ino in named:
                if content("kept", ino) is not content("strict", ino):
                    mixes.append(("strict", {ino: "kept"}, f"only {path} kept"))
                    mixes.append(("kept", {ino: "strict"}, f"all kept but {path}"))
            for mode, files, what in mixes:
                state = frozenset((path, content(files.get(ino, mode), ino)) for path, ino in named)
                out.enumerated += 1
                how = f"call {at}/{len(calls)}, {what}, {len(subset)}/{len(pending)} directory ops durable"
                last.append((state, how))
                out.states.setdefault(state, {}).setdefault(marks, how)
    return out


def materialize(state: State, folder: str) -> None:
    """The state written into `folder` (emptied first)."""
    if os.path.exists(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    for rel, content in state:
        path = os.path.join(folder, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(content)
        os.chmod(path, 0o600)


def expected_marks(recorder: Recorder) -> list[Mark]:
    return [c for c in recorder.calls if isinstance(c, Mark)]


# --- what was answered: the expectations at each boundary --------------------------------------------


@dataclass
class ExChannel:
    paused: bool | None = None
    must: dict[bytes, None] = field(default_factory=dict)  # answered, not consumed: deliverable
    never: set[bytes] = field(default_factory=set)  # consumed (FIN persisted, a seek or commit past it)


@dataclass
class ExTopic:
    log_id: str | None = None  # given out to a client
    positional: bool = False  # read by position (the log API answered): every message goes to its log
    paused: bool | None = None
    channels: dict[str, ExChannel] = field(default_factory=dict)
    gone_channels: set[str] = field(default_factory=set)
    keys: set[str] = field(default_factory=set)  # Idempotency-Keys answered
    attempts: dict[str, list[bytes]] = field(default_factory=dict)  # every key asked for, with its bodies
    end: int = 0  # the durable tail shown (/log/positions, /log/read)
    served: dict[int, bytes] = field(default_factory=dict)  # position -> body served by /log/read
    deleting: bool = False  # a delete asked, not answered: there, gone or half gone
    deleting_channels: set[str] = field(default_factory=set)


@dataclass
class Expected:
    """What the marks up to a boundary promise (the README's durability promises)."""

    topics: dict[str, ExTopic] = field(default_factory=dict)
    gone: set[str] = field(default_factory=set)  # deleted, not made again
    old_ids: dict[str, set[str]] = field(default_factory=dict)  # log ids of deleted incarnations
    old_keys: dict[str, set[str]] = field(default_factory=dict)  # keys of deleted incarnations
    old_channels: dict[str, set[str]] = field(default_factory=dict)  # channels of deleted incarnations
    old_bodies: dict[str, set[bytes]] = field(default_factory=dict)  # messages of deleted incarnations
    moved: list[tuple[bytes, str, str, str]] = field(default_factory=list)  # body, topic, channel, dead-letter topic

    def topic(self, name: str) -> ExTopic:
        self.gone.discard(name)
        ex = self.topics.get(name)
        if ex is None:  # made (again): what a deleted incarnation had must not be found in it
            ex = self.topics[name] = ExTopic(gone_channels=set(self.old_channels.get(name, ())))
        return ex

    def apply(self, mark: Mark) -> None:
        w = mark.what
        kind = mark.kind
        if kind == "topic":
            self.topic(w["topic"])
        elif kind == "channel":
            ex = self.topic(w["topic"])
            ex.gone_channels.discard(w["channel"])
            ex.channels.setdefault(w["channel"], ExChannel())
        elif kind == "creating":  # asked, not answered: there or not (what it had before must not be)
            if w.get("channel") is None:
                self.gone.discard(w["topic"])
            elif w["topic"] in self.topics:
                self.topics[w["topic"]].gone_channels.discard(w["channel"])
        elif kind == "pausing":  # asked, not answered: paused or not
            ex = self.topics[w["topic"]]
            if w.get("channel") is None:
                ex.paused = None
            else:
                ex.channels[w["channel"]].paused = None
        elif kind == "deleting":
            if w.get("channel") is None:
                self.topics[w["topic"]].deleting = True
            else:
                self.topics[w["topic"]].deleting_channels.add(w["channel"])
        elif kind == "delete_topic":
            ex = self.topics.pop(w["topic"], ExTopic())
            for log_id in (ex.log_id, w.get("log_id")):
                if log_id is not None:
                    self.old_ids.setdefault(w["topic"], set()).add(log_id)
            self.old_channels.setdefault(w["topic"], set()).update(ex.channels)
            bodies = self.old_bodies.setdefault(w["topic"], set())
            for channel in ex.channels.values():
                bodies.update(channel.must)
                bodies.update(channel.never)
            self.old_keys.setdefault(w["topic"], set()).update(ex.attempts)
            self.gone.add(w["topic"])
            self.moved = [m for m in self.moved if w["topic"] not in (m[1], m[3])]
        elif kind == "delete_channel":
            ex = self.topics[w["topic"]]
            ex.channels.pop(w["channel"], None)
            ex.deleting_channels.discard(w["channel"])
            ex.gone_channels.add(w["channel"])
        elif kind == "pause":
            ex = self.topics[w["topic"]]
            if w.get("channel") is None:
                ex.paused = w["paused"]
            else:
                ex.channels[w["channel"]].paused = w["paused"]
        elif kind == "attempt":
            self.topic(w["topic"]).attempts[w["key"]] = list(w["bodies"])
        elif kind == "pub":
            ex = self.topic(w["topic"])
            if not w.get("durable", True):
                return  # answered before its fsync (--sync-every > 1): promised nothing across a power loss
            for channel in ex.channels.values():
                channel.must.update(dict.fromkeys(w["bodies"]))
            if w.get("key") is not None:
                ex.keys.add(w["key"])
        elif kind == "log_id":
            self.topics[w["topic"]].log_id = w["log_id"]
            self.topics[w["topic"]].positional = True
        elif kind == "end":
            ex = self.topics[w["topic"]]
            ex.end = max(ex.end, w["end"])
        elif kind == "served":
            self.topics[w["topic"]].served.update(w["records"])
        elif kind == "consuming":  # a seek or commit asked, not answered: its messages there or not
            self.topics[w["topic"]].channels[w["channel"]].must.clear()
        elif kind == "consumed":  # everything published to the channel before now is consumed
            ex = self.topics[w["topic"]]
            channel = ex.channels.setdefault(w["channel"], ExChannel())
            channel.never.update(channel.must)
            channel.never.update(w.get("bodies", ()))
            channel.must.clear()
        elif kind == "moved":  # a dead-letter move answered (its FIN persisted)
            self.topics[w["topic"]].channels[w["channel"]].must.pop(w["body"], None)
            self.moved.append((w["body"], w["topic"], w["channel"], w["dead"]))
        else:
            raise ValueError(f"unknown mark {kind!r}")


# --- what a state holds, opened in process ---------------------------------------------------------------


@dataclass
class SeenChannel:
    paused: bool
    messages: list[tuple[int, bytes]]  # (position, body) deliverable, in order


@dataclass
class SeenTopic:
    paused: bool
    log_id: str | None  # None: no id on disk yet (a new one would be made)
    positional: bool
    end: int | None
    keys: set[str]
    channels: dict[str, SeenChannel]
    records: dict[int, bytes] = field(default_factory=dict)  # the log read by position: position -> body
    log_error: tuple[int, str, bool] | None = None  # a read by position that failed: where, why, an error the
    # log API answers 500 for (not a PositionError)


@dataclass
class Seen:
    topics: dict[str, SeenTopic] = field(default_factory=dict)
    error: str | None = None


def observe(folder: str, options: dict[str, Any]) -> Seen:
    """Open the broker's objects on `folder` as a restart does (nsqd.dat and its journal, every topic it
    names with its log, channels, cursors and keys), note what they hold, and drop them (no round, no
    clean exit: nothing of the check is written back)."""
    seen = Seen()
    real = os.fsync, os.fdatasync

    def skipped(fd: Any) -> None:
        return None

    async def main() -> None:
        nsqd = NSQD(Options(data_path=folder, **options))
        try:
            nsqd.load_metadata()
            for name in list(nsqd._pending):
                if name in nsqd._pending:
                    nsqd.get_topic(name)
            ends = {name: topic.log.durable_tail.position if topic.log is not None else None
                    for name, topic in nsqd.topics.items()}  # what /log/positions says before any round
            for topic in list(nsqd.topics.values()):
                await topic.group.sync_round()  # the first round after a start: recovered records made durable
                topic.dispatch()  # as its message pump does (paused or not: what it holds is looked at)
            for name, topic in nsqd.topics.items():
                log_ = topic.log
                channels = {}
                for cname, channel in list(topic.channels.items()):
                    messages: list[tuple[int, bytes]] = []
                    while batch := channel.take(1000):
                        messages.extend((m.pos, bytes(m.body)) for m in batch)
                    channels[cname] = SeenChannel(channel.paused, messages)
                records, log_error = _read_log(log_) if log_ is not None else ({}, None)
                seen.topics[name] = SeenTopic(
                    topic.paused, log_.log_id if log_ is not None and log_.epoch_on_disk else None,
                    log_ is not None and log_.positional,
                    ends.get(name), set(topic.idempotency.keys), channels, records, log_error)
        except Exception as exc:  # a state the broker cannot start on is a violation
            seen.error = f"{type(exc).__name__}: {exc}"
        finally:
            for topic in list(nsqd.topics.values()):
                try:
                    kill(topic)
                    topic.idempotency._close_fd()
                except Exception:
                    pass
    # the state is a scratch copy: its first round's fsyncs are skipped (they only cost time)
    os.fsync, os.fdatasync = skipped, skipped
    try:
        trio.run(main)
    finally:
        os.fsync, os.fdatasync = real
    return seen


def _read_log(log_: Any) -> tuple[dict[int, bytes], tuple[int, str, bool] | None]:
    """Every record of a topic's log up to its durable tail, as /log/read serves them: position -> body."""
    records: dict[int, bytes] = {}
    end = log_.durable_tail
    pos = log_.segments.start
    try:
        while pos < end.position:
            block = log_.index.read(log_.index.locate(pos, end), end, end.position, 1 << 20)
            if not len(block):
                break
            starts = block.starts
            for i in range(len(block)):
                record = block.data[starts[i]:starts[i + 1]]
                records[block.position + starts[i]] = bytes(record[4 + 26:])  # size, id, timestamp, attempts
            pos = block.next
    except PositionError as exc:
        return records, (pos, f"{exc.code} at {pos}: {exc}", False)
    except (OSError, ValueError) as exc:
        return records, (pos, f"{type(exc).__name__} at {pos}: {exc}", True)
    return records, None


def judge(seen: Seen, ex: Expected) -> list[str]:
    """The promises `ex` holds that `seen` breaks, one line each."""
    if seen.error is not None:
        return [f"the broker does not start: {seen.error}"]
    out = []
    for name, et in ex.topics.items():
        st = seen.topics.get(name)
        if et.deleting:  # there or not, with or without its data; its id and old keys are still checked
            continue
        if st is None:
            out.append(f"topic {name} was answered and is missing")
            continue
        if et.paused is not None and st.paused != et.paused:
            out.append(f"topic {name}: paused={et.paused} was answered, {st.paused} after")
        if et.log_id is not None and st.log_id != et.log_id:
            out.append(f"topic {name}: log id {et.log_id} given out, {st.log_id} after")
        if et.positional and not st.positional:
            out.append(f"topic {name}: read by position (answered), not after")
        if st.end is not None and st.end < et.end:
            out.append(f"topic {name}: durable tail {et.end} shown, {st.end} after")
        if st.log_error is not None:
            at, why, internal = st.log_error
            # a position served that cannot be read back; an error the log API answers 500 for anywhere
            # (one that says the position is gone is the log's first position after a crash of records
            # never answered, unless a record there was served)
            if internal or any(pos >= at for pos in et.served):
                out.append(f"topic {name}: its log cannot be read by position: {why}")
        positions: dict[int, bytes] = dict(st.records)
        for sc in st.channels.values():
            positions.update(sc.messages)
        for pos, body in et.served.items():
            if pos in positions and positions[pos] != body:
                out.append(f"topic {name}: position {pos} served {body!r}, holds {positions[pos]!r} after")
        for cname, ec in et.channels.items():
            found = st.channels.get(cname)
            if cname in et.deleting_channels:
                continue
            if found is None:
                out.append(f"channel {name}:{cname} was answered and is missing")
                continue
            sc = found
            if ec.paused is not None and sc.paused != ec.paused:
                out.append(f"channel {name}:{cname}: paused={ec.paused} was answered, {sc.paused} after")
            bodies = {b for _, b in sc.messages}
            missing = [b for b in ec.must if b not in bodies]
            if missing:
                out.append(f"channel {name}:{cname}: {len(missing)} answered messages missing ({missing[0]!r}...)")
            back = sorted(ec.never & bodies)
            if back:
                out.append(f"channel {name}:{cname}: {len(back)} consumed messages back ({back[0]!r}...)")
        for cname in et.gone_channels:
            if cname in st.channels:
                out.append(f"channel {name}:{cname} was deleted and came back")
        lost = sorted(et.keys - st.keys)
        if lost:
            out.append(f"topic {name}: Idempotency-Key {lost[0]} answered, lost (a retry duplicates)")
        all_bodies = {b for sc in st.channels.values() for _, b in sc.messages}
        consumed = {b for ec in et.channels.values() for b in ec.never}
        for key in sorted(st.keys):
            asked = et.attempts.get(key)
            if asked is None:
                if key in ex.old_keys.get(name, ()):
                    out.append(f"topic {name}: Idempotency-Key {key} of the deleted topic came back")
                continue
            absent = [b for b in asked if b not in all_bodies and b not in consumed]
            if absent and st.channels:
                out.append(f"topic {name}: Idempotency-Key {key} kept, {len(absent)} of its messages gone")
    for name in sorted(ex.gone):
        st = seen.topics.get(name)
        if st is not None:
            out.append(f"topic {name} was deleted and came back (log id {st.log_id}, channels {sorted(st.channels)})")
    for name, st in seen.topics.items():
        if st.log_id is not None and st.log_id in ex.old_ids.get(name, ()):
            out.append(f"topic {name}: has the log id {st.log_id} of a deleted topic")
        old = sorted({b for sc in st.channels.values() for _, b in sc.messages} & ex.old_bodies.get(name, set()))
        if old and name not in ex.gone:
            out.append(f"topic {name}: {len(old)} messages of the deleted topic came back ({old[0]!r}...)")
    for body, topic, channel, dead in ex.moved:
        places = [seen.topics[t].channels[c] for t, c in ((topic, channel),) if t in seen.topics
                  and c in seen.topics[t].channels]
        if dead in seen.topics:
            places.extend(seen.topics[dead].channels.values())
        if not any(body in {b for _, b in sc.messages} for sc in places):
            out.append(f"dead letter {body!r} of {topic}:{channel} in neither the channel nor {dead}")
    return out


# --- a scenario: recorded once, every state checked ------------------------------------------------------


@dataclass
class Report:
    name: str
    states: int
    enumerated: int
    boundaries: int
    sampled: int
    calls: int
    violations: list[str]

    def summary(self) -> str:
        """The report's line and the first violations of each kind (an assertion's message)."""
        return "\n".join([self.line(), *_summary(self.violations)])

    def line(self) -> str:
        return (f"crash states {self.name}: {self.states} distinct states checked ({self.enumerated} enumerated at "
                f"{self.boundaries} call boundaries of {self.calls} calls, directory operations sampled at "
                f"{self.sampled}), {len(self.violations)} violations")


class Workload:
    """What a scenario drives: the broker over HTTP (answers marked in the recorded stream) and in process."""

    def __init__(self, client: httpx.AsyncClient, nsqd: NSQD, disk: Recorder) -> None:
        self.client = client
        self.nsqd = nsqd
        self.disk = disk

    async def post(self, path: str, content: bytes = b"", headers: dict[str, str] | None = None) -> Any:
        answer = await self.client.post(path, content=content, headers=headers or {})
        assert answer.status_code == 200, (path, answer.status_code, answer.text)
        return answer

    async def create_topic(self, topic: str) -> None:
        self.disk.mark("creating", topic=topic)
        await self.post(f"/topic/create?topic={topic}")
        self.disk.mark("topic", topic=topic)

    async def create_channel(self, topic: str, channel: str) -> None:
        self.disk.mark("creating", topic=topic, channel=channel)
        await self.post(f"/channel/create?topic={topic}&channel={channel}")
        self.disk.mark("channel", topic=topic, channel=channel)

    async def delete_topic(self, topic: str) -> None:
        log_ = self.nsqd.topics[topic].log  # its id, given out or not: a topic made again must not have it
        log_id = log_.log_id if log_ is not None and log_.epoch_on_disk else None
        self.disk.mark("deleting", topic=topic)
        await self.post(f"/topic/delete?topic={topic}")
        self.disk.mark("delete_topic", topic=topic, log_id=log_id)

    async def delete_channel(self, topic: str, channel: str) -> None:
        self.disk.mark("deleting", topic=topic, channel=channel)
        await self.post(f"/channel/delete?topic={topic}&channel={channel}")
        self.disk.mark("delete_channel", topic=topic, channel=channel)

    async def pause(self, topic: str, channel: str | None = None, paused: bool = True) -> None:
        what = "pause" if paused else "unpause"
        self.disk.mark("pausing", topic=topic, channel=channel)
        if channel is None:
            await self.post(f"/topic/{what}?topic={topic}")
        else:
            await self.post(f"/channel/{what}?topic={topic}&channel={channel}")
        self.disk.mark("pause", topic=topic, channel=channel, paused=paused)

    async def publish(self, topic: str, bodies: list[bytes], key: str | None = None) -> None:
        headers = {}
        if key is not None:
            headers["Idempotency-Key"] = key
            self.disk.mark("attempt", topic=topic, key=key, bodies=bodies)
        await self.post(f"/mpub?topic={topic}", b"\n".join(bodies), headers)
        self.disk.mark("pub", topic=topic, bodies=bodies, key=key, durable=self.nsqd.options.sync_every == 1)

    async def positions(self, topic: str) -> dict[str, Any]:
        answer = (await self.client.get(f"/log/positions?topic={topic}")).json()
        self.disk.mark("log_id", topic=topic, log_id=answer["log_id"])
        self.disk.mark("end", topic=topic, end=answer["end"])
        return dict(answer)


Scenario = Callable[[Workload], Awaitable[None]]


def record(folder: str, scenario: Scenario, options: dict[str, Any], *, clean_exit: bool = False) -> Recorder:
    """Run `scenario` on a broker in process over `folder`, every file-system call recorded; then the
    broker's clean exit, recorded too when `clean_exit` (else the recording ends as a power loss would)."""
    os.makedirs(folder)
    disk = Recorder(folder)

    async def run(nursery: trio.Nursery) -> None:
        running = await nursery.start(functools.partial(run_nsqd, data_path=folder, **options))
        async with httpx.AsyncClient(base_url=f"http://{running.http_address}") as client:
            await scenario(Workload(client, running.server, disk))
        nursery.cancel_scope.cancel()

    async def main() -> None:
        if clean_exit:
            with disk:
                async with trio.open_nursery() as nursery:
                    await run(nursery)
            return
        async with trio.open_nursery() as nursery:
            with disk:
                await run(nursery)  # (the clean exit runs once the nursery's body is done: not recorded)
    trio.run(main)
    return disk


def check_workload(folder: str, name: str, scenario: Scenario, options: dict[str, Any], *, seed: int = 0,
                   clean_exit: bool = False) -> Report:
    """Record `scenario` under `folder`/record, enumerate its crash states, check each in `folder`/state."""
    disk = record(os.path.join(folder, "record"), scenario, options, clean_exit=clean_exit)
    enumeration = crash_states(disk, seed=seed)
    marks = [c for c in disk.calls if isinstance(c, Mark)]
    expectations = [Expected()]
    for mark in marks:
        ex = copy.deepcopy(expectations[-1])
        ex.apply(mark)
        expectations.append(ex)
    violations: list[str] = []
    where = os.path.join(folder, "state")
    quiet = logging.getLogger("nsqd")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # the checks open thousands of torn states: their warnings are expected
    try:
        for state, by_marks in enumeration.states.items():
            materialize(state, where)
            seen = observe(where, options)
            for count, how in sorted(by_marks.items()):
                last = marks[count - 1] if count else None
                after = f"after {last.kind} {last.what}" if last is not None else "before any answer"
                violations.extend(f"{v} [{how}; {after}]" for v in judge(seen, expectations[count]))
    finally:
        quiet.setLevel(level)
        shutil.rmtree(where, ignore_errors=True)
    report = Report(name, len(enumeration.states), enumeration.enumerated, enumeration.boundaries,
                    enumeration.sampled, len(disk.calls), violations)
    print(report.line())
    for line in _summary(violations):
        print("   ", line)
    return report


def _summary(violations: list[str], per_kind: int = 2) -> list[str]:
    """The first lines of each kind of violation (the text before its first number or name)."""
    kinds: dict[str, list[str]] = {}
    for v in violations:
        kinds.setdefault(v.split("[")[0].split(":")[-1][:40], []).append(v)
    out = []
    for lines in kinds.values():
        out.extend(lines[:per_kind])
        if len(lines) > per_kind:
            out.append(f"... and {len(lines) - per_kind} more like it")
    return out


async def read_log(w: Workload, topic: str, position: int) -> list[tuple[int, bytes]]:
    """/log/read from `position`: the (position, body) of each record served, marked as served."""
    answer = await w.client.get(f"/log/read?topic={topic}&position={position}")
    assert answer.status_code == 200, answer.text
    first = int(answer.headers["X-NSQ-Position"])
    n = int(answer.headers["X-NSQ-Records"])
    size = int(answer.headers["X-NSQ-Records-Bytes"])
    data = answer.content
    starts = struct.unpack(f"<{n + 1}i", data[size:size + 4 * (n + 1)])
    records = []
    for i in range(n):
        record = data[starts[i]:starts[i + 1]]
        records.append((first + starts[i], bytes(record[4 + 26:])))  # size, then id, timestamp, attempts
    w.disk.mark("served", topic=topic, records=records)
    w.disk.mark("end", topic=topic, end=int(answer.headers["X-NSQ-End"]))
    return records
