"""Cursor: one channel's acknowledgement state over one log (Pulsar's ManagedCursor).

A log (broker/storage/segment_log.py) only appends; what a channel has done with its records lives here:
- the *read position*: the next record the channel has not read yet (and that record's index, so a depth
  is a subtraction);
- the *mark-delete position*: every record before it is finished. It is the oldest record read and not
  finished (in flight, deferred, requeued), or the read position when there is none;
- the records finished after it, out of order (a set while they are being read, ranges once persisted);
- *held* records: those requeued or deferred by the channel, with the attempts and deadline a restart
  must give them back.

Pure: no files and no clock. The channel's LogReader tells it what was read and finished; the sync round
asks it for the bytes to append to its file (`take_delta`: only what changed since the last round, never
the whole held set) or, now and then, for a snapshot to replace the file with (`snapshot`); `load` reads
such a file back. What a restart finds: the mark-delete position, the finished records after it (skipped
when read again) and the held ones (read again with their attempts and deadline). Everything read and not
finished since the last round comes again: in flight at the crash, it is delivered again.

Records are read in log order, so a run of records read one after another and all finished is a range of
the log: the snapshot writes such runs as (first, last, count).
"""

from __future__ import annotations

import struct
import zlib
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from itertools import islice, takewhile
from typing import Any

# the file: a header line, then blocks [length u32][crc32 u32][entries]; a block cut short by a crash
# (or one whose checksum does not match) ends the file there
HEADER = b"trio-nsq-cursor 3\n"
_BLOCK = struct.Struct(">II")
_MARK = struct.Struct(">cqqQ")  # b"M", mark-delete position, its index, the log's epoch
_COUNT = struct.Struct(">cI")  # b"F" / b"R" / b"H", how many follow
_RANGE = struct.Struct(">qqI")  # first, last (both finished, inclusive), how many records
_HELD = struct.Struct(">qHd")  # position, attempts, deadline (0: none)
# when this many positions wait (finished out of order, or noted FINs), they are applied / reclaim looks
FINISHED_LIMIT = 4096
# retired handed positions are dropped from the front of the list once more than this many (and most of
# the list) are retired
_HANDED_TRIM = 4096


class CursorFileError(ValueError):
    """A cursor file that is not ours (no header) or belongs to another log (its epoch)."""


class Cursor:
    """Created by a LogReader (broker/storage/log_reader.py), which is the only caller: it reports reads
    (`handed`, `skip`), FINs (`finish_many`), requeues (`hold`), and asks for the bytes a sync round
    persists. `epoch` ties the state to one log: a file of another log (one Go nsqd rewrote) is refused."""

    __slots__ = ("read_pos", "read_index", "epoch", "_handed", "_head", "_finished", "_fins", "_ahead",
                 "_ahead_count", "held", "_new_fins", "_new_holds", "_persisted_mark", "_delta_bytes")

    def __init__(self, pos: int = 0, index: int = 0, epoch: int = 0) -> None:
        self.read_pos = pos
        self.read_index = index
        self.epoch = epoch
        # positions read since the mark-delete position, in log order (every record read, finished or
        # not): those from _head on are not retired yet. A list and an index rather than a deque: a run of
        # FINs that continues the front is found and retired by comparing slices (in C)
        self._handed: list[int] = []
        self._head = 0
        self._finished: set[int] = set()  # finished positions in _handed[_head:]
        self._fins: list[int] = []  # FINs noted by finish_many, not applied yet
        # finished ranges past the read position (loaded after a restart), each [first, last, records not
        # read yet]: skipped when read
        self._ahead: list[list[int]] = []
        self._ahead_count = 0  # records in them not read yet
        # requeued or deferred records: position -> (attempts, deadline); a deadline is unix seconds
        self.held: dict[int, tuple[int, float]] = {}
        # what changed since the last take_delta()
        self._new_fins: list[int] = []
        self._new_holds: dict[int, tuple[int, float]] = {}
        self._persisted_mark = (-1, -1)
        self._delta_bytes = 0  # appended since the last snapshot

    # --- reading --------------------------------------------------------------------------------

    def skip(self, pos: int) -> bool:
        """Whether the record at `pos` (being read) was finished before a restart (only asked while
        hidden() > 0); the reader still reports it read (`handed`)."""
        ahead = self._ahead
        while ahead and ahead[0][1] < pos:
            self._ahead_count -= ahead.pop(0)[2]  # passed without reading all of it (a bad file skipped)
        if not ahead or pos < ahead[0][0]:
            return False
        ahead[0][2] -= 1
        self._ahead_count -= 1
        if ahead[0][2] <= 0 or ahead[0][1] == pos:
            self._ahead_count -= ahead.pop(0)[2]
        self._finished.add(pos)
        return True

    def finished_ahead(self, pos: int) -> bool:
        """Whether the record at `pos`, past the read position, was finished before a restart: skip()
        without its bookkeeping, a look that changes nothing (/channel/messages)."""
        ahead = self._ahead
        if not ahead:
            return False
        at = bisect_right(ahead, pos, key=_first) - 1
        return at >= 0 and pos <= ahead[at][1]

    def handed(self, positions: list[int], next_pos: int, next_index: int) -> None:
        """The reader read the records at `positions` (in order, skipped ones included) and is now at
        `next_pos`, the record with index `next_index`."""
        self._handed.extend(positions)
        self.read_pos = next_pos
        self.read_index = next_index

    def hidden(self) -> int:
        """Records past the read position that will be skipped (finished before a restart)."""
        return self._ahead_count

    def moved_to(self, pos: int, index: int) -> None:
        """The reader jumped (a bad file skipped, or a seek): reading goes on from there."""
        self.read_pos = pos
        self.read_index = index

    # --- finishing ------------------------------------------------------------------------------

    def finish_many(self, positions: list[int]) -> None:
        """Each position is finished (FIN, or done with otherwise). The hot path of a channel read from
        the log, so they are only noted: applied in bulk (_apply_fins) before anything reads the state,
        or once FINISHED_LIMIT wait."""
        fins = self._fins
        fins.extend(positions)
        if len(fins) > FINISHED_LIMIT:
            self._apply_fins()

    def hold(self, pos: int, attempts: int, deadline: float) -> None:
        """The record at `pos` (read, not finished) was requeued or deferred: after a restart it comes with
        these attempts, and not before `deadline` (unix seconds; 0: none)."""
        self.held[pos] = self._new_holds[pos] = (attempts, deadline)

    def mark_delete(self) -> int:
        """The oldest position that may hold an unfinished record."""
        self._apply_fins()
        if self._head < len(self._handed):
            return self._handed[self._head]
        return self.read_pos

    def mark_index(self) -> int:
        self._apply_fins()
        return self.read_index - (len(self._handed) - self._head)

    def unfinished(self) -> int:
        """Records read and not finished (in flight, deferred or requeued)."""
        self._apply_fins()
        return len(self._handed) - self._head - len(self._finished)

    def finished_waiting(self) -> int:
        """Finished positions kept because an older record is not finished."""
        self._apply_fins()
        return len(self._finished)

    def waiting_at_most(self) -> int:
        """finished_waiting() or more, without applying the noted FINs (cheap: reclaim asks per FIN run)."""
        return len(self._fins) + len(self._finished)

    def unfinished_before(self, cutoff: int) -> list[int]:
        """Positions read, not finished, before `cutoff` (the records that pin what is before it)."""
        self._apply_fins()
        finished = self._finished
        out = []
        for pos in islice(self._handed, self._head, None):
            if pos >= cutoff:
                break
            if pos not in finished:
                out.append(pos)
        return out

    def middle(self) -> int:
        """A position halfway through what was read since the mark-delete position."""
        self._apply_fins()
        return self._handed[(self._head + len(self._handed)) // 2] if self._head < len(self._handed) else self.read_pos

    def reset(self, pos: int, index: int) -> None:
        """Nothing before `pos` is wanted any more, nothing after it is finished (an empty, or a seek)."""
        self.read_pos, self.read_index = pos, index
        self._handed = []
        self._head = 0
        self._finished.clear()
        self._fins.clear()
        self._ahead = []
        self._ahead_count = 0
        self.held.clear()
        self._new_fins.clear()
        self._new_holds.clear()

    def _apply_fins(self) -> None:
        """Apply the FINs finish_many noted, in order."""
        positions = self._fins
        if not positions:
            if self._finished:
                self._set_head(self._retire_finished(self._head))
            return
        self._fins = []
        handed = self._handed
        head = self._head
        end = len(handed)
        held = self.held
        if held:
            for pos in positions:
                held.pop(pos, None)
        if head == end:
            return  # every one finished already, or reset since
        finished = self._finished
        if finished:
            head = self._retire_finished(head)
        positions.sort()
        # consumers FIN mostly in the order they were sent, so most of the sorted run continues the
        # front: it is retired by moving the index, without the set
        first = 0
        if head == end:
            first = len(positions)  # all of them before the front (finished before, or reset since)
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
            rest = positions[first + n:]
            if head < end:
                front = handed[head]
                rest = [pos for pos in rest if pos >= front and pos not in finished]
            else:
                rest = []
            finished.update(rest)
            self._new_fins.extend(rest)
        if finished:
            head = self._retire_finished(head)
        self._set_head(head)

    def _set_head(self, head: int) -> None:
        """The handed positions before `head` are retired: they go in bulk once they are most of the list."""
        if head > _HANDED_TRIM and head * 2 > len(self._handed):
            del self._handed[:head]
            head = 0
        self._head = head

    def _retire_finished(self, head: int) -> int:
        """Move `head` past the finished positions at the front, dropping them from the finished set."""
        front = list(takewhile(self._finished.__contains__, islice(self._handed, head, None)))
        if front:
            self._finished.difference_update(front)
        return head + len(front)

    # --- persistence ----------------------------------------------------------------------------

    def take_delta(self) -> bytes:
        """The block to append for what changed since the last call (b"" when nothing did): the mark-delete
        position, FINs past it, holds past it."""
        mark = self.mark_delete()
        index = self.mark_index()
        fins = [pos for pos in self._new_fins if pos >= mark and pos in self._finished]
        holds = [(pos, st) for pos, st in self._new_holds.items() if pos >= mark and pos in self.held]
        self._new_fins = []
        self._new_holds = {}
        if (mark, index) == self._persisted_mark and not fins and not holds:
            return b""
        self._persisted_mark = (mark, index)
        parts = [_MARK.pack(b"M", mark, index, self.epoch)]
        if fins:
            parts.append(_COUNT.pack(b"R", len(fins)))
            parts.extend(_RANGE.pack(pos, pos, 1) for pos in fins)
        if holds:
            parts.append(_COUNT.pack(b"H", len(holds)))
            parts.extend(_HELD.pack(pos, attempts, deadline) for pos, (attempts, deadline) in holds)
        block = _block(b"".join(parts))
        self._delta_bytes += len(block)
        return block

    def untake_delta(self) -> None:
        """The last delta was not persisted (its round failed): the next one must say it all again."""
        self._persisted_mark = (-1, -1)
        self._new_fins = list(self._finished)
        self._new_holds = dict(self.held)

    def wants_snapshot(self) -> bool:
        """Deltas have grown past what a snapshot of the state would take (compaction)."""
        return self._delta_bytes > 64 * 1024 and self._delta_bytes > 4 * self._state_size()

    def _state_size(self) -> int:
        return 64 + _RANGE.size * (len(self._finished) + len(self._ahead)) + _HELD.size * len(self.held)

    def snapshot(self) -> bytes:
        """The whole file: the header and one block holding the state (the file replaced by it)."""
        mark = self.mark_delete()
        index = self.mark_index()
        ranges = self._finished_ranges()
        ranges.extend((first, last, count) for first, last, count in self._ahead)
        held = sorted((pos, st) for pos, st in self.held.items() if pos >= mark)
        parts = [_MARK.pack(b"M", mark, index, self.epoch)]
        if ranges:
            parts.append(_COUNT.pack(b"R", len(ranges)))
            parts.extend(_RANGE.pack(first, last, count) for first, last, count in ranges)
        if held:
            parts.append(_COUNT.pack(b"H", len(held)))
            parts.extend(_HELD.pack(pos, attempts, deadline) for pos, (attempts, deadline) in held)
        self._persisted_mark = (mark, index)
        self._new_fins = []
        self._new_holds = {}
        self._delta_bytes = 0
        return HEADER + _block(b"".join(parts))

    def _finished_ranges(self) -> list[tuple[int, int, int]]:
        """Runs of finished records among those read since the mark-delete position: (first, last, count)."""
        self._apply_fins()
        finished = self._finished
        out: list[tuple[int, int, int]] = []
        if not finished:
            return out
        first = last = -1
        count = 0
        for pos in islice(self._handed, self._head, None):
            if pos in finished:
                if count == 0:
                    first = pos
                last = pos
                count += 1
            elif count:
                out.append((first, last, count))
                count = 0
        if count:
            out.append((first, last, count))
        return out

    @classmethod
    def load(cls, data: bytes, epoch: int) -> tuple[Cursor, int]:
        """A cursor from its file; also how many bytes of it are sound (a crash may cut the last block).
        Raises CursorFileError for a file that is not a cursor of the log with this epoch."""
        if not data.startswith(HEADER):
            raise CursorFileError("not a cursor file")
        cursor = cls(epoch=epoch)
        ranges: dict[int, tuple[int, int]] = {}
        held: dict[int, tuple[int, float]] = {}
        mark = index = 0
        seen_mark = False
        at = len(HEADER)
        while at + _BLOCK.size <= len(data):
            length, crc = _BLOCK.unpack_from(data, at)
            body = data[at + _BLOCK.size:at + _BLOCK.size + length]
            if len(body) < length or zlib.crc32(body) != crc:
                break
            try:
                mark, index, ranges, held = _apply_block(body, mark, index, ranges, held, epoch)
            except (struct.error, ValueError) as exc:
                if isinstance(exc, CursorFileError):
                    raise
                break
            seen_mark = True
            at += _BLOCK.size + length
        if not seen_mark:
            raise CursorFileError("no state in the cursor file")
        cursor.read_pos, cursor.read_index = mark, index
        cursor._persisted_mark = (mark, index)
        cursor._ahead = sorted([first, last, count] for first, (last, count) in ranges.items() if last >= mark)
        cursor._ahead_count = sum(count for _, _, count in cursor._ahead)
        cursor.held = {pos: st for pos, st in held.items() if pos >= mark}
        cursor._delta_bytes = at
        return cursor, at


def _first(entry: list[int]) -> int:
    return entry[0]


def _block(body: bytes) -> bytes:
    return _BLOCK.pack(len(body), zlib.crc32(body)) + body


def _counted(body: bytes, at: int, record: struct.Struct) -> tuple[Iterator[tuple[Any, ...]], int]:
    """The `record`s of the counted entry at `at` (its kind, how many, then them), and where the next
    entry starts."""
    _, n = _COUNT.unpack_from(body, at)
    start = at + _COUNT.size
    end = start + n * record.size
    return record.iter_unpack(body[start:end]), end


def _apply_block(body: bytes, mark: int, index: int, ranges: dict[int, tuple[int, int]],
                 held: dict[int, tuple[int, float]], epoch: int) -> tuple[int, int, dict[int, tuple[int, int]], dict[int, tuple[int, float]]]:
    """One block's entries on top of the state so far (a later mark drops what is before it)."""
    at = 0
    while at < len(body):
        kind = body[at:at + 1]
        if kind == b"M":
            _, mark, index, file_epoch = _MARK.unpack_from(body, at)
            if file_epoch != epoch:
                raise CursorFileError(f"cursor of another log (epoch {file_epoch:x}, the log's {epoch:x})")
            at += _MARK.size
            if ranges:
                ranges = {first: st for first, st in ranges.items() if st[0] >= mark}
            if held:
                held = {pos: st for pos, st in held.items() if pos >= mark}
        elif kind == b"R":
            entries, at = _counted(body, at, _RANGE)
            for first, last, count in entries:
                if last >= mark:
                    ranges[first] = (last, count)
                    held.pop(first, None)
        elif kind == b"H":
            entries, at = _counted(body, at, _HELD)
            for pos, attempts, deadline in entries:
                if pos >= mark:
                    held[pos] = (attempts, deadline)
        else:
            raise ValueError(f"unknown cursor entry {kind!r}")
    return mark, index, ranges, held
