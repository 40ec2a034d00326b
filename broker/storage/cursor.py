"""Cursor: one channel's acknowledgement state over one log (Pulsar's ManagedCursor).

A log (broker/storage/segment_log.py) only appends; what a channel has done with its records lives here:
- the *read position*: the next record the channel has not read yet (and that record's index, so a depth
  is a subtraction);
- the *mark-delete position*: every record before it is finished. It is the oldest record read and not
  finished (in flight, deferred, requeued), or the read position when there is none;
- the records read and not finished after it, each with its index: every other record read is finished.
  So what is finished costs nothing however many records it is: one message stuck in flight while a
  million behind it are finished in order keeps one entry (and the consumers' window), not a million;
- *held* records: those requeued or deferred by the channel, with the attempts and deadline a restart
  must give them back.

Pure: no files and no clock. The channel's LogReader tells it what was read and finished; the sync round
asks it for the bytes to append to its file (`take_delta`: only what changed since the last round, never
the whole held set) or, now and then, for a snapshot to replace the file with (`snapshot`: each run of
finished records between two unfinished ones is one range, counted by the indices); `load` reads such a
file back (broker/storage/cursor_file.py). What a restart finds: the mark-delete position, the finished
records after it (skipped when read again) and the held ones (read again with their attempts and
deadline). Everything read and not finished since the last round comes again: in flight at the crash,
it is delivered again.

Memory: 16 bytes an unfinished record (two arrays), plus, for records finished out of order, a set entry
until half of the entries are finished, when the arrays are rebuilt without them: what a window of
out-of-order FINs costs is bounded by the window.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable

from trio_nsq.broker.storage.cursor_file import (
    HEADER,
    CursorFileError,
    Held,
    Range,
    encode,
    held_size,
    load,
    range_size,
    snapshot_file,
)

# FINs noted before they are applied (finish_many applies them in bulk)
FINISHED_LIMIT = 4096
# the unfinished arrays are rebuilt without finished entries once more than this many (and half) are
_COMPACT_MIN = 4096
# retired entries are cut off the arrays' front once more than this many (and most of them)
_HANDED_TRIM = 4096

__all__ = ["FINISHED_LIMIT", "HEADER", "Cursor", "CursorFileError"]


class FinishedAhead:
    """The finished ranges past a cursor's read position that a restart loaded: [first, last] and how many
    records in it are still to come, in position order, in three arrays (no object per range: a file
    of a million gaps is a million ranges). Reading skips a record inside one and counts it down; a
    range goes once reading passes its last position (its count only says how many are still to come,
    for the depth)."""

    __slots__ = ("firsts", "lasts", "counts", "at", "remaining")

    def __init__(self, firsts: array[int], lasts: array[int], counts: array[int]) -> None:
        self.firsts = firsts
        self.lasts = lasts
        self.counts = counts
        self.at = 0  # the ranges before it are passed
        self.remaining = sum(counts)  # records in them not read yet

    def __len__(self) -> int:
        return len(self.firsts) - self.at

    def skip(self, pos: int) -> bool:
        """Whether the record at `pos` (being read) was finished before the restart."""
        firsts, lasts, counts = self.firsts, self.lasts, self.counts
        at = self.at
        end = len(firsts)
        while at < end and lasts[at] < pos:
            self.remaining -= counts[at]  # passed without reading all of it (a bad file skipped)
            at += 1
        if at == end or pos < firsts[at]:
            self.at = at
            return False
        if counts[at] > 0:
            counts[at] -= 1
            self.remaining -= 1
        if lasts[at] == pos:
            self.remaining -= counts[at]
            at += 1
        self.at = at
        return True

    def finished(self, pos: int) -> bool:
        """Whether `pos`, not read yet, is in a range: skip() without its bookkeeping (a look)."""
        at = bisect_right(self.firsts, pos, self.at) - 1
        return at >= self.at and pos <= self.lasts[at]

    def ranges(self, read_pos: int) -> list[Range]:
        """The ranges still ahead, the front one from `read_pos` (it may be part read)."""
        return [(max(self.firsts[i], read_pos) if i == self.at else self.firsts[i], self.lasts[i], self.counts[i])
                for i in range(self.at, len(self.firsts))]

    def cut_from(self, end: int, count: Callable[[int, int], int]) -> int:
        """Nothing at or past `end` is in the log: ranges there go, one that `end` cuts ends before it and
        is counted again (`count(first, end)`). How many ranges went or were cut."""
        changed = 0
        firsts: array[int] = array("q")
        lasts: array[int] = array("q")
        counts: array[int] = array("q")
        for i in range(self.at, len(self.firsts)):
            first, last, n = self.firsts[i], self.lasts[i], self.counts[i]
            if first >= end:
                changed += 1
                continue
            if last >= end:
                last, n = end - 1, count(first, end)
                changed += 1
            firsts.append(first)
            lasts.append(last)
            counts.append(n)
        self.firsts, self.lasts, self.counts, self.at = firsts, lasts, counts, 0
        self.remaining = sum(counts)
        return changed


_NONE_AHEAD = FinishedAhead(array("q"), array("q"), array("q"))


class Cursor:
    """Created by a LogReader (broker/storage/log_reader.py), which is the only caller: it reports reads
    (`handed`, `skip`), FINs (`finish_many`), requeues (`hold`), and asks for the bytes a sync round
    persists. `epoch` ties the state to one log: a file of another log (one Go nsqd rewrote) is refused."""

    __slots__ = ("read_pos", "read_index", "epoch", "_pos", "_idx", "_head", "_done", "_fins", "_ahead",
                 "held", "_new_fins", "_new_holds", "_persisted_mark", "_delta_bytes")

    def __init__(self, pos: int = 0, index: int = 0, epoch: int = 0) -> None:
        self.read_pos = pos
        self.read_index = index
        self.epoch = epoch
        # the records read and not finished, in log order, and their indices: those from _head on; an
        # entry also in _done was finished out of order (dropped when it reaches the front, or when the
        # arrays are rebuilt). Arrays and an index rather than a deque: a run of FINs that continues the
        # front is found and retired by comparing slices (in C)
        self._pos: array[int] = array("q")
        self._idx: array[int] = array("q")
        self._head = 0
        self._done: set[int] = set()
        self._fins: list[int] = []  # FINs noted by finish_many, not applied yet
        # finished ranges past the read position (loaded after a restart): skipped when read
        self._ahead = _NONE_AHEAD
        # requeued or deferred records: position -> (attempts, deadline); a deadline is unix seconds
        self.held: dict[int, Held] = {}
        # what changed since the last take_delta()
        self._new_fins: list[int] = []
        self._new_holds: dict[int, Held] = {}
        self._persisted_mark = (-1, -1)
        self._delta_bytes = 0  # appended since the last snapshot

    # --- reading --------------------------------------------------------------------------------

    def skip(self, pos: int) -> bool:
        """Whether the record at `pos` (being read) was finished before a restart (only asked while
        hidden() > 0); the reader does not report it read (`handed`'s `skipped`)."""
        ahead = self._ahead
        skipped = ahead.skip(pos)
        if not len(ahead):
            self._ahead = _NONE_AHEAD
        return skipped

    def finished_ahead(self, pos: int) -> bool:
        """Whether the record at `pos`, past the read position, was finished before a restart: skip()
        without its bookkeeping, a look that changes nothing (/channel/messages)."""
        return len(self._ahead) > 0 and self._ahead.finished(pos)

    def handed(self, positions: list[int], first_index: int, next_pos: int, next_index: int,
               skipped: list[int] | None = None) -> None:
        """The reader read the records at `positions` (in order, indices first_index, first_index + 1, ...)
        and is now at `next_pos`, the record with index `next_index`. `skipped`: which of them (their
        places in `positions`) were finished before a restart (skip())."""
        if skipped is None:
            self._pos.extend(positions)
            self._idx.extend(range(first_index, first_index + len(positions)))
        elif len(skipped) < len(positions):
            gone = set(skipped)
            for i, pos in enumerate(positions):
                if i not in gone:
                    self._pos.append(pos)
                    self._idx.append(first_index + i)
        self.read_pos = next_pos
        self.read_index = next_index

    def hidden(self) -> int:
        """Records past the read position that will be skipped (finished before a restart)."""
        return max(0, self._ahead.remaining)

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
        if self._head < len(self._pos):
            return self._pos[self._head]
        return self.read_pos

    def mark_index(self) -> int:
        self._apply_fins()
        if self._head < len(self._idx):
            return self._idx[self._head]
        return self.read_index

    def unfinished(self) -> int:
        """Records read and not finished (in flight, deferred or requeued)."""
        self._apply_fins()
        return len(self._pos) - self._head - len(self._done)

    def unfinished_before(self, cutoff: int, limit: int) -> list[int]:
        """Up to `limit` positions read, not finished, before `cutoff` (the records that pin what is
        before it), oldest first."""
        self._apply_fins()
        done = self._done
        out: list[int] = []
        pos_ = self._pos
        for k in range(self._head, len(pos_)):
            pos = pos_[k]
            if pos >= cutoff or len(out) >= limit:
                break
            if pos not in done:
                out.append(pos)
        return out

    def unfinished_count_before(self, cutoff: int) -> int:
        """How many records read before `cutoff` are not finished: a bisect, less the FINs out of order
        among them (bounded by the window of out-of-order FINs)."""
        self._apply_fins()
        end = bisect_left(self._pos, cutoff, self._head)
        return end - self._head - sum(1 for pos in self._done if pos < cutoff)

    def reset(self, pos: int, index: int) -> None:
        """Nothing before `pos` is wanted any more, nothing after it is finished (an empty, or a seek)."""
        self.read_pos, self.read_index = pos, index
        self._pos = array("q")
        self._idx = array("q")
        self._head = 0
        self._done = set()
        self._fins = []
        self._ahead = _NONE_AHEAD
        self.held = {}
        self._new_fins = []
        self._new_holds = {}

    def forget_from(self, end: int, count: Callable[[int, int], int]) -> int:
        """Nothing at or past position `end` was read (the log was found shorter than this cursor's file
        says: a record written there later is a new one): the finished ranges and holds there go, and a
        range `end` cuts is counted again (`count(first, end)`: the records in [first, end)). How many
        entries went or were cut."""
        changed = self._ahead.cut_from(end, count) if len(self._ahead) else 0
        for pos in [pos for pos in self.held if pos >= end]:
            del self.held[pos]
            changed += 1
        return changed

    def _apply_fins(self) -> None:
        """Apply the FINs finish_many noted, in order."""
        positions = self._fins
        if not positions:
            if self._done:
                self._set_head(self._retire_finished(self._head))
            return
        self._fins = []
        held = self.held
        if held:
            for pos in positions:
                held.pop(pos, None)
        handed = self._pos
        head = self._head
        end = len(handed)
        if head == end:
            return  # every one finished already, or reset since
        done = self._done
        if done:
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
        if n > 0 and array("q", positions[first:first + n]) != handed[head:head + n]:
            # the longest run that matches (positions are unique and a subset of the unfinished ones, so
            # once one differs all later ones do): binary search, each probe one comparison
            lo, hi = 0, n - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if positions[first + mid] == handed[head + mid]:
                    lo = mid
                else:
                    hi = mid - 1
            n = lo + 1 if positions[first] == handed[head] else 0
            if n and array("q", positions[first:first + n]) != handed[head:head + n]:
                n = 0  # not in order after all: the set below handles every case
        head += n
        if first + n < len(positions) and head < end:
            front = handed[head]
            rest = [pos for pos in positions[first + n:] if pos >= front and pos not in done]
            done.update(rest)
            self._new_fins.extend(rest)
        if done:
            head = self._retire_finished(head)
        self._set_head(head)
        if len(done) > _COMPACT_MIN and 2 * len(done) > len(handed) - self._head:
            self._compact()

    def _set_head(self, head: int) -> None:
        """The entries before `head` are retired: they go in bulk once they are most of the arrays."""
        if head > _HANDED_TRIM and head * 2 > len(self._pos):
            del self._pos[:head]
            del self._idx[:head]
            head = 0
        self._head = head

    def _retire_finished(self, head: int) -> int:
        """Move `head` past the finished entries at the front, dropping them from the finished set."""
        handed = self._pos
        done = self._done
        end = len(handed)
        while head < end:
            pos = handed[head]
            if pos not in done:
                break
            done.discard(pos)
            head += 1
        return head

    def _compact(self) -> None:
        """Rebuild the arrays without the entries finished out of order (half of them at least)."""
        done = self._done
        handed, indices = self._pos, self._idx
        keep_pos: array[int] = array("q")
        keep_idx: array[int] = array("q")
        for k in range(self._head, len(handed)):
            pos = handed[k]
            if pos not in done:
                keep_pos.append(pos)
                keep_idx.append(indices[k])
        self._pos, self._idx = keep_pos, keep_idx
        self._head = 0
        self._done = set()

    # --- persistence ----------------------------------------------------------------------------

    def take_delta(self) -> bytes:
        """The block to append for what changed since the last call (b"" when nothing did): the mark-delete
        position, FINs past it, holds past it."""
        mark = self.mark_delete()
        index = self.mark_index()
        fins = [(pos, pos, 1) for pos in self._new_fins if pos >= mark]
        holds = [(pos, st) for pos, st in self._new_holds.items() if pos >= mark and pos in self.held]
        self._new_fins = []
        self._new_holds = {}
        if (mark, index) == self._persisted_mark and not fins and not holds:
            return b""
        self._persisted_mark = (mark, index)
        block = encode(mark, index, self.epoch, fins, holds)
        self._delta_bytes += len(block)
        return block

    def untake_delta(self) -> None:
        """The last delta was not persisted (its round failed): the caller writes a snapshot next."""
        self._persisted_mark = (-1, -1)

    def wants_snapshot(self) -> bool:
        """Deltas have grown past what a snapshot of the state would take (compaction)."""
        return self._delta_bytes > 64 * 1024 and self._delta_bytes > 4 * self._state_size()

    def _state_size(self) -> int:
        live = len(self._pos) - self._head - len(self._done)
        return (64 + range_size() * (live + 1 + len(self._ahead))
                + held_size() * len(self.held))

    def snapshot(self) -> bytes:
        """The whole file: the header and the blocks holding the state (the file replaced by it)."""
        mark = self.mark_delete()
        index = self.mark_index()
        ranges = self._finished_ranges()
        ranges.extend(self._ahead.ranges(self.read_pos))
        held = sorted((pos, st) for pos, st in self.held.items() if pos >= mark)
        self._persisted_mark = (mark, index)
        self._new_fins = []
        self._new_holds = {}
        self._delta_bytes = 0
        return snapshot_file(mark, index, self.epoch, ranges, held)

    def _finished_ranges(self) -> list[Range]:
        """The finished records between the mark-delete position and the read position, as ranges: each
        run between two unfinished records (counted by their indices), and the run after the last one."""
        self._apply_fins()
        done = self._done
        handed, indices = self._pos, self._idx
        out: list[Range] = []
        prev_pos = prev_index = -1
        for k in range(self._head, len(handed)):
            pos = handed[k]
            if pos in done:
                continue
            index = indices[k]
            if prev_index >= 0 and index - prev_index > 1:
                out.append((prev_pos + 1, pos - 1, index - prev_index - 1))
            prev_pos, prev_index = pos, index
        if prev_index >= 0 and self.read_index - prev_index > 1:
            out.append((prev_pos + 1, self.read_pos - 1, self.read_index - prev_index - 1))
        return out

    @classmethod
    def load(cls, data: bytes, epoch: int) -> tuple[Cursor, int]:
        """A cursor from its file; also how many bytes of it are sound (a crash may cut the last block).
        Raises CursorFileError for a file that is not a cursor of the log with this epoch."""
        mark, index, firsts, lasts, counts, held, sound = load(data, epoch)
        cursor = cls(mark, index, epoch)
        cursor._persisted_mark = (mark, index)
        if len(firsts):
            cursor._ahead = FinishedAhead(firsts, lasts, counts)
        cursor.held = held
        cursor._delta_bytes = sound
        return cursor, sound

