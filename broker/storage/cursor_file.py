"""A cursor's file, `<topic>:<channel>.cursor.dat`: what a channel has finished and holds, for a restart.

The file is a header line, then blocks `[length u32][crc32 u32][entries]`; a block cut short by a crash
(or one whose checksum does not match) ends the file there. Entries:
- `M` mark-delete position, its index, the log's epoch: every record before the position is finished;
- `R` count, then (first, last, count): every record at a position in [first, last] is finished, `count`
  of them (a FIN is (pos, pos, 1); a snapshot writes each run of finished records between two unfinished
  ones as one range, however many records it holds);
- `H` count, then (position, attempts, deadline): a requeued or deferred record, with the attempts and
  the deadline (unix seconds, 0: none) a restart gives it.
A round appends a block of what changed (a delta); now and then a snapshot (the header and blocks of the
whole state) replaces the file. Reading applies the blocks in order and drops what is before the last mark
once, at the end: linear in the file's size. Every number is written in its field's width: counts and
lengths that would pass 32 bits are split over more entries and blocks.
"""

from __future__ import annotations

import struct
import zlib
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

HEADER = b"trio-nsq-cursor 3\n"
_BLOCK = struct.Struct(">II")
_MARK = struct.Struct(">cqqQ")  # b"M", mark-delete position, its index, the log's epoch
_COUNT = struct.Struct(">cI")  # b"R" / b"H", how many follow
_RANGE = struct.Struct(">qqI")  # first, last (inclusive), how many records
_HELD = struct.Struct(">qHd")  # position, attempts, deadline (0: none)
# entries a block holds at most (a block's length is 32 bits; a count is too)
BLOCK_ENTRIES = 1 << 20
U32 = (1 << 32) - 1
ATTEMPTS_MAX = (1 << 16) - 1  # an attempts field is 16 bits, as on the wire

Range = tuple[int, int, int]
Held = tuple[int, float]


class CursorFileError(ValueError):
    """A cursor file that is not ours (no header) or belongs to another log (its epoch)."""


def range_size() -> int:
    return _RANGE.size


def held_size() -> int:
    return _HELD.size


def _block(body: bytes) -> bytes:
    return _BLOCK.pack(len(body), zlib.crc32(body)) + body


def _ranges_fitting(ranges: Sequence[Range]) -> list[Range]:
    """A range whose count passes 32 bits is written as several over the same positions, the count split
    among them (their firsts one apart, as a range is known by its first): a reader skips by the bounds
    and counts down the front one, so the skipping is exact and only the depth it reports meanwhile is
    off by the parts not at the front (Cursor.skip)."""
    out: list[Range] = []
    for first, last, count in ranges:
        while count > U32:
            out.append((first, last, U32))
            first += 1
            count -= U32
        out.append((first, last, count))
    return out


def encode(mark: int, index: int, epoch: int, ranges: Sequence[Range], held: Sequence[tuple[int, Held]]) -> bytes:
    """Blocks holding the mark, these ranges and these holds (a delta, or a snapshot's body): at most
    BLOCK_ENTRIES entries a block, so a block's length and a count fit their 32 bits."""
    entries: list[bytes] = [_RANGE.pack(first, last, count) for first, last, count in _ranges_fitting(ranges)]
    n_ranges = len(entries)
    entries.extend(_HELD.pack(pos, min(attempts, ATTEMPTS_MAX), deadline) for pos, (attempts, deadline) in held)
    blocks: list[bytes] = []
    at = 0
    while True:
        parts = [_MARK.pack(b"M", mark, index, epoch)] if at == 0 else []
        stop = min(len(entries), at + BLOCK_ENTRIES)
        if at < min(stop, n_ranges):
            end = min(stop, n_ranges)
            parts.append(_COUNT.pack(b"R", end - at))
            parts.extend(entries[at:end])
        if stop > max(at, n_ranges):
            begin = max(at, n_ranges)
            parts.append(_COUNT.pack(b"H", stop - begin))
            parts.extend(entries[begin:stop])
        blocks.append(_block(b"".join(parts)))
        at = stop
        if at >= len(entries):
            return b"".join(blocks)


def load(data: bytes, epoch: int) -> tuple[int, int, array[int], array[int], array[int], dict[int, Held], int]:
    """(mark, its index, the finished ranges past it in position order as three arrays: firsts, lasts,
    counts; the held records past it; how many bytes of the file are sound). Raises CursorFileError for
    a file that is not a cursor of the log with this epoch."""
    if not data.startswith(HEADER):
        raise CursorFileError("not a cursor file")
    ranges = _Ranges()
    held: dict[int, Held] = {}
    mark = index = 0
    seen_mark = False
    at = len(HEADER)
    while at + _BLOCK.size <= len(data):
        length, crc = _BLOCK.unpack_from(data, at)
        body = data[at + _BLOCK.size:at + _BLOCK.size + length]
        if len(body) < length or zlib.crc32(body) != crc:
            break
        try:
            mark, index, seen = _apply_block(body, mark, index, ranges, held, epoch)
        except (struct.error, ValueError) as exc:
            if isinstance(exc, CursorFileError):
                raise
            ranges.undo_block()
            break
        ranges.block_done()
        seen_mark = seen_mark or seen
        at += _BLOCK.size + length
    if not seen_mark:
        raise CursorFileError("no state in the cursor file")
    firsts, lasts, counts = ranges.kept(mark)
    return mark, index, firsts, lasts, counts, {pos: st for pos, st in held.items() if pos >= mark}, at


class _Ranges:
    """The R entries read so far, in three arrays, in the order read (a later range with the same first
    replaces an earlier one: kept() sorts and keeps the last of each)."""

    __slots__ = ("firsts", "lasts", "counts", "_block_start")

    def __init__(self) -> None:
        self.firsts: array[int] = array("q")
        self.lasts: array[int] = array("q")
        self.counts: array[int] = array("q")
        self._block_start = 0

    def add(self, first: int, last: int, count: int) -> None:
        self.firsts.append(first)
        self.lasts.append(last)
        self.counts.append(count)

    def block_done(self) -> None:
        self._block_start = len(self.firsts)

    def undo_block(self) -> None:
        """The block being read is not sound: what it added goes."""
        cut = self._block_start
        del self.firsts[cut:], self.lasts[cut:], self.counts[cut:]

    def kept(self, mark: int) -> tuple[array[int], array[int], array[int]]:
        """Those whose last is at or past `mark`, in position order, one per first (the last read)."""
        firsts, lasts, counts = self.firsts, self.lasts, self.counts
        order: Sequence[int] = range(len(firsts))
        if any(firsts[i] >= firsts[i + 1] for i in range(len(firsts) - 1)):
            order = sorted(order, key=firsts.__getitem__)  # stable: the last read of a first comes last
        out_f: array[int] = array("q")
        out_l: array[int] = array("q")
        out_c: array[int] = array("q")
        for i in order:
            if lasts[i] < mark:
                continue
            if out_f and out_f[-1] == firsts[i]:
                out_l[-1], out_c[-1] = lasts[i], counts[i]
                continue
            out_f.append(firsts[i])
            out_l.append(lasts[i])
            out_c.append(counts[i])
        return out_f, out_l, out_c


def _counted(body: bytes, at: int, record: struct.Struct) -> tuple[Iterator[tuple[Any, ...]], int]:
    """The `record`s of the counted entry at `at` (its kind, how many, then them), and where the next
    entry starts."""
    _, n = _COUNT.unpack_from(body, at)
    start = at + _COUNT.size
    end = start + n * record.size
    if end > len(body):
        raise ValueError("a counted entry past its block")
    return record.iter_unpack(body[start:end]), end


def _apply_block(body: bytes, mark: int, index: int, ranges: _Ranges,
                 held: dict[int, Held], epoch: int) -> tuple[int, int, bool]:
    """One block's entries on top of the state so far, in place. What a later mark leaves behind is
    dropped once, by load(), not here: marks only move forward within a file (a cursor that goes back
    writes a snapshot), so the last one decides."""
    at = 0
    seen = False
    while at < len(body):
        kind = body[at:at + 1]
        if kind == b"M":
            _, mark, index, file_epoch = _MARK.unpack_from(body, at)
            if file_epoch != epoch:
                raise CursorFileError(f"cursor of another log (epoch {file_epoch:x}, the log's {epoch:x})")
            at += _MARK.size
            seen = True
        elif kind == b"R":
            entries, at = _counted(body, at, _RANGE)
            for first, last, count in entries:
                if last >= mark:
                    ranges.add(first, last, count)
                    if held:
                        held.pop(first, None)
        elif kind == b"H":
            entries, at = _counted(body, at, _HELD)
            for pos, attempts, deadline in entries:
                if pos >= mark:
                    held[pos] = (attempts, deadline)
        else:
            raise ValueError(f"unknown cursor entry {kind!r}")
    return mark, index, seen


def snapshot_file(mark: int, index: int, epoch: int, ranges: Sequence[Range], held: Sequence[tuple[int, Held]]) -> bytes:
    """The whole file of a snapshot."""
    return HEADER + encode(mark, index, epoch, ranges, held)
