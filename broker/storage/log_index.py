"""LogIndex: where records start in a topic's log, for readers that come by position (the HTTP log API:
a Spark task, a planner, a follower), not through a channel.

go-diskqueue's files have no index: a record is found by walking the size prefixes from the start of its
file. So the index is sparse and built as it is needed: per segment, every INTERVAL bytes, the position,
index (record number) and timestamp of the first record at or past that mark, up to where the segment has
been walked (`scanned`). A position is then checked to be a record boundary by walking at most INTERVAL
bytes from the mark before it, a time or a record count is found by bisecting the marks, and a range is
cut into parts of similar size at marks. Reads walk the records they return anyway (to cut at a whole
record and to give the client each record's start), and extend the index as they go, so a reader reading
a log from end to end walks each record once.

Nothing is served at or past the log's durable tail (TopicLog.durable_tail), and records never change once
written (a power loss may cut what was past the durable tail: never what is indexed here, which is before
it). A segment removed takes its marks with it. Kept in memory only: a restart walks again, on demand.

Who calls it: TopicLog (its `index`), for the HTTP log API (broker/http/log_api.py), a replica's reads
(TopicLog.read_raw) and the high watermark's place (TopicLog.place_at).
"""

from __future__ import annotations

import os
from array import array
from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Final

from trio_nsq.broker.storage.files import close_quietly
from trio_nsq.broker.storage.segment_log import Place, SegmentLog
from trio_nsq.shared.protocol import int32_at

# (Final: compiled, a constant; a plain module name is a dict lookup at every use, in walk's loop too)
# bytes of log between two marks: checking a position walks at most this much (and one record)
INTERVAL: Final = 64 * 1024
# the block a scan reads
_BLOCK: Final = 1024 * 1024
# a record: [size int32][timestamp int64][attempts uint16][id 16][body]
_TS_AT: Final = 4
# walk's max_records when any number will do: compiled, an int above this is boxed and every compare
# with it in walk's loop takes the slow path (1 << 62 did)
ALL_RECORDS: Final = (1 << 62) - 1


class PositionError(ValueError):
    """A position the log cannot serve: `code` is the API's message (POSITION_GONE, POSITION_PAST_END,
    POSITION_NOT_A_RECORD)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code


class Walk:
    """What walking a block found: where the whole records stop (`stop`, an offset in the block), how
    many there are, the last one's offset (`last`), and each one's offset (`starts`, when asked for) and
    the marks passed."""

    __slots__ = ("stop", "count", "last", "starts", "marks")

    def __init__(self) -> None:
        self.stop = 0
        self.count = 0
        self.last = -1
        self.starts: list[int] | None = None
        self.marks: list[tuple[int, int, int]] = []  # (offset in the block, records before it, timestamp)


NO_MARKS: Final = -2  # walk's `prev` when no marks are wanted


def walk(buf: bytes, at: int, limit: int, max_records: int, min_size: int, max_size: int, result: Walk,
         base: int = 0, prev: int = NO_MARKS) -> Walk:
    """Walk the records of `buf` from offset `at` while a whole record lies before offset `limit` and fewer
    than `max_records` are walked. Raises ValueError at a size outside [min_size, max_size] (a damaged
    file: the channel readers cut it there, this reader refuses to go past it).

    Marks (unless `prev` is NO_MARKS): `buf` starts at offset `base` of its segment, and `prev` is the
    segment offset of the record before `at` (-1: `at` is the segment's first record). A record is a
    mark when it is the first at or past a multiple of INTERVAL: what is marked depends on the records
    only, never on where a walk began, so the same range is cut at the same places after a restart."""
    starts = result.starts
    marks = result.marks
    count = 0
    pos = at
    end = min(limit, len(buf))
    last = -1
    while count < max_records and pos + 4 <= end:
        # read here, not by int32_at (a call per record), and unsigned: a negative size is above max_size too
        size = (buf[pos] << 24) | (buf[pos + 1] << 16) | (buf[pos + 2] << 8) | buf[pos + 3]
        if size < min_size or size > max_size:
            raise ValueError(f"invalid message read size ({int32_at(buf, pos)})")
        if pos + 4 + size > end:
            break
        if prev != NO_MARKS:
            offset = base + pos
            if prev < 0 or offset // INTERVAL > prev // INTERVAL:
                marks.append((pos, count, int.from_bytes(buf[pos + _TS_AT:pos + _TS_AT + 8], "big", signed=True)))
            prev = offset
        if starts is not None:
            starts.append(pos)
        last = pos
        pos += 4 + size
        count += 1
    result.stop = pos
    result.count = count
    result.last = last
    return result


class Marks:
    """One segment's marks, and how far it has been walked from its start."""

    __slots__ = ("base", "positions", "indices", "stamps", "scanned", "scanned_index", "last")

    def __init__(self, start: int, index: int) -> None:
        self.base = start  # the segment's start position
        self.positions: array[int] = array("q")
        self.indices: array[int] = array("q")
        self.stamps: array[int] = array("q")
        self.scanned = start  # a record boundary: everything before it is walked
        self.scanned_index = index
        self.last = -1  # the segment offset of the last record walked (-1: none yet)

    def walked(self, at: int, result: Walk) -> None:
        """A walk of the records from `at` (== scanned) found `result`: its marks are kept."""
        for offset, before, stamp in result.marks:
            self.add(at + offset, self.scanned_index + before, stamp)
        if result.count:
            self.last = at + result.last - self.base
        self.scanned = at + result.stop
        self.scanned_index += result.count

    def add(self, position: int, index: int, stamp: int) -> None:
        if not self.positions or position > self.positions[-1]:
            self.positions.append(position)
            self.indices.append(index)
            self.stamps.append(stamp)

    def before(self, pos: int) -> int:
        """The index in the arrays of the last mark at or before `pos` (-1: none)."""
        return bisect_right(self.positions, pos) - 1


class Block:
    """Records read from one segment: the first `size` bytes of `data` (as in the file: the block read,
    of which the last bytes may be part of a record not returned), `starts` (each record's offset in it),
    their first position and index, and where the next read starts."""

    __slots__ = ("data", "size", "starts", "position", "index", "next", "next_index")

    def __init__(self, data: bytes, size: int, starts: list[int], position: int, index: int, next_: Place) -> None:
        self.data = data
        self.size = size
        self.starts = starts
        self.position = position
        self.index = index
        self.next = next_.position
        self.next_index = next_.index

    def __len__(self) -> int:
        return len(self.starts) - 1


class LogIndex:
    def __init__(self, segments: SegmentLog) -> None:
        self.segments = segments
        self._marks: dict[int, Marks] = {}

    # --- the segments -------------------------------------------------------------------------

    def _of(self, num: int) -> Marks:
        marks = self._marks.get(num)
        if marks is None:
            segments = self.segments
            for old in [n for n in self._marks if n < segments.first_file]:
                del self._marks[old]  # segments removed since
            marks = Marks(segments.start_of(num), segments.index_of_file(num))
            self._marks[num] = marks
        return marks

    def truncated(self, position: int) -> None:
        """The log was cut back to `position` (TopicLog.truncate_to): the marks of the segment holding it
        and of every later one go (walked again on demand: records will be written there again)."""
        num = self.segments.file_of(position)
        for old in [n for n in self._marks if n >= num]:
            del self._marks[old]

    def appended(self, records: Sequence[bytes], positions: list[int], first_index: int) -> None:
        """Records were appended at `positions` (the first with index `first_index`): where a segment's
        marks reach them (walked up to where they start), they are marked as a walk would mark them."""
        segments = self.segments
        i = 0
        n = len(positions)
        while i < n:
            num = segments.file_of(positions[i])
            marks = self._of(num)
            following = segments.start_of(num + 1) if num < segments.write_file_num else 1 << 62
            base = marks.base
            while i < n and positions[i] < following:
                pos = positions[i]
                if marks.scanned == pos:
                    offset = pos - base
                    last = marks.last
                    if last < 0 or offset // INTERVAL > last // INTERVAL:
                        record = records[i]
                        marks.add(pos, first_index + i, int.from_bytes(record[:8], "big", signed=True))
                    marks.last = offset
                    marks.scanned = pos + 4 + len(records[i])
                    marks.scanned_index = first_index + i + 1
                i += 1

    def _segment_end(self, num: int, fd: int) -> int:
        """The position where segment num's records end (its size, a cut, the write position)."""
        segments = self.segments
        end = segments.end_of(num)
        if end < 0:
            end = os.fstat(fd).st_size
        return segments.start_of(num) + end

    def _open(self, num: int) -> int:
        try:
            return os.open(self.segments.file_name(num), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise PositionError("POSITION_GONE", f"segment {num} is removed") from None

    def _scan(self, num: int, upto: int, end: int) -> Marks:
        """Walk segment num from where it was walked to at least `upto` (or its end, or `end`)."""
        marks = self._of(num)
        if marks.scanned >= upto:
            return marks
        segments = self.segments
        fd = self._open(num)
        try:
            base = segments.start_of(num)
            stop = min(end, self._segment_end(num, fd))
            result = Walk()
            while marks.scanned < upto and marks.scanned < stop:
                at = marks.scanned
                buf = os.pread(fd, min(stop - at, max(_BLOCK, segments.max_msg_size + 4)), at - base)
                result.marks = []
                walk(buf, 0, stop - at, ALL_RECORDS, segments.min_msg_size, segments.max_msg_size, result,
                     at - base, marks.last)
                if result.count == 0:
                    raise ValueError(f"a record past the end of segment {num} at {at - base}")
                marks.walked(at, result)
        finally:
            close_quietly(fd)
        return marks

    # --- finding places -----------------------------------------------------------------------

    def locate(self, pos: int, end: Place) -> Place:
        """`pos` checked to be where a record starts (or `end`), with its index. Raises PositionError."""
        segments = self.segments
        if pos == end.position:
            return end
        if pos < segments.start:
            raise PositionError("POSITION_GONE", f"{pos} is before the first record kept ({segments.start})")
        if pos > end.position:
            raise PositionError("POSITION_PAST_END", f"{pos} is past the end of the log ({end.position})")
        num = segments.file_of(pos)
        if pos == segments.start_of(num):
            return Place(pos, segments.index_of_file(num))
        marks = self._scan(num, pos, end.position)
        if marks.scanned == pos:
            return Place(pos, marks.scanned_index)
        at = marks.before(pos)
        if at >= 0 and marks.positions[at] == pos:
            return Place(pos, marks.indices[at])
        start = Place(marks.positions[at], marks.indices[at]) if at >= 0 else \
            Place(segments.start_of(num), segments.index_of_file(num))
        found = self._walk_from(num, start, pos - start.position, ALL_RECORDS, pos)
        if found.position != pos:
            raise PositionError("POSITION_NOT_A_RECORD", f"no record starts at {pos}")
        return found

    def boundary_before(self, pos: int, hint: Place | None = None) -> Place:
        """The last record boundary at or before `pos` (between the log's start and its tail), with its
        index: from the nearest known place before it in its segment (its start, a mark, where the
        segment was walked to, or `hint`, a boundary the caller knows), walking the rest. For a limit that
        need not be a boundary (a high watermark). Raises PositionError or ValueError (a damaged file)."""
        segments = self.segments
        num = segments.file_of(pos)
        best = Place(segments.start_of(num), segments.index_of_file(num))
        marks = self._marks.get(num)
        if marks is not None:
            if best.position < marks.scanned <= pos:
                best = Place(marks.scanned, marks.scanned_index)
            at = marks.before(pos)
            if at >= 0 and marks.positions[at] > best.position:
                best = Place(marks.positions[at], marks.indices[at])
        if hint is not None and best.position < hint.position <= pos:
            best = hint
        stop = min(pos, self._records_end(num))
        if best.position >= stop:
            return best
        return self._walk_from(num, best, stop - best.position, ALL_RECORDS, stop)

    def _walk_from(self, num: int, start: Place, max_bytes: int, max_records: int, end: int) -> Place:
        """The place after walking from `start` (a boundary of segment num) at most `max_bytes` bytes and
        `max_records` records, without passing `end` or the segment's end."""
        segments = self.segments
        fd = self._open(num)
        try:
            base = segments.start_of(num)
            stop = min(end, self._segment_end(num, fd), start.position + max_bytes)
            pos, index = start.position, start.index
            result = Walk()
            while pos < stop and max_records > 0:
                buf = os.pread(fd, max(_BLOCK, segments.max_msg_size + 4), pos - base)
                walk(buf, 0, stop - pos, max_records, segments.min_msg_size, segments.max_msg_size, result)
                if result.count == 0:
                    break
                pos += result.stop
                index += result.count
                max_records -= result.count
            return Place(pos, index)
        finally:
            close_quietly(fd)

    def _next_segment(self, num: int, end: Place) -> Place:
        """Where segment num+1 starts, or `end` past the durable tail."""
        segments = self.segments
        nxt = segments.start_of(num + 1)
        if num + 1 > segments.write_file_num or nxt >= end.position:
            return end
        return Place(nxt, segments.index_of_file(num + 1))

    def after(self, start: Place, end: Place, max_records: int, max_bytes: int) -> Place:
        """The boundary after at most `max_records` records and `max_bytes` bytes from `start` (at least
        one record when there is one), at most `end`."""
        segments = self.segments
        place = start
        records = 0
        used = 0
        while place.position < end.position and records < max_records and used < max_bytes:
            num = segments.file_of(place.position)
            seg_end = min(end.position, self._records_end(num))
            # jump to the last mark within both limits, then walk the rest
            target = min(seg_end, place.position + max_bytes - used)
            marks = self._scan(num, target, end.position)
            at = marks.before(target)
            while at >= 0 and marks.indices[at] - place.index > max_records - records:
                at -= 1
            if at >= 0 and marks.positions[at] > place.position:
                used += marks.positions[at] - place.position
                records += marks.indices[at] - place.index
                place = Place(marks.positions[at], marks.indices[at])
            walked = self._walk_from(num, place, max_bytes - used, max_records - records, seg_end)
            if walked.position == place.position and records == 0:
                walked = self._walk_from(num, place, 1 << 62, 1, seg_end)  # one record over the byte limit
            used += walked.position - place.position
            records += walked.index - place.index
            place = walked
            if place.position < seg_end:
                break  # a limit stopped the walk
            if seg_end < end.position:
                place = self._next_segment(num, end)
        return place

    def _records_end(self, num: int) -> int:
        """The position where segment num's records end."""
        segments = self.segments
        end = segments.end_of(num)
        if end < 0:
            end = segments.segment_size(num)
        return segments.start_of(num) + end

    def at_time(self, ns: int, end: Place, first_stamp: Callable[[int], int | None]) -> Place:
        """The first record published at or after `ns` (unix ns), by the records' timestamps (in publish
        order); `end` when none is. `first_stamp(num)`: segment num's first record's timestamp (every
        record of a segment was published before the next segment's first)."""
        segments = self.segments
        for num in segments.segments():
            if segments.start_of(num) >= end.position:
                break
            later = first_stamp(num + 1) if num < segments.write_file_num else None
            if later is not None and later < ns and segments.start_of(num + 1) < end.position:
                continue  # every record of segment num is older
            seg_end = min(end.position, self._records_end(num))
            marks = self._scan(num, seg_end, end.position)
            # the last mark before `ns`, then record by record
            at = bisect_right(marks.stamps, ns - 1) - 1
            place = Place(marks.positions[at], marks.indices[at]) if at >= 0 else \
                Place(segments.start_of(num), segments.index_of_file(num))
            found = self._find_time(num, place, ns, seg_end)
            if found is not None:
                return found
        return end

    def _find_time(self, num: int, start: Place, ns: int, end: int) -> Place | None:
        segments = self.segments
        fd = self._open(num)
        try:
            base = segments.start_of(num)
            pos, index = start.position, start.index
            result = Walk()
            while pos < end:
                buf = os.pread(fd, max(_BLOCK, segments.max_msg_size + 4), pos - base)
                result.starts = []
                walk(buf, 0, end - pos, ALL_RECORDS, segments.min_msg_size, segments.max_msg_size, result)
                if result.count == 0:
                    return None
                for i, offset in enumerate(result.starts):
                    if int.from_bytes(buf[offset + _TS_AT:offset + _TS_AT + 8], "big", signed=True) >= ns:
                        return Place(pos + offset, index + i)
                pos += result.stop
                index += result.count
            return None
        finally:
            close_quietly(fd)

    def splits(self, start: Place, end: Place, stop: int, parts: int) -> list[int]:
        """Up to parts-1 record boundaries strictly inside (start, stop), cutting it into parts of similar
        size, at marks and segment starts (so within INTERVAL of the ideal cut)."""
        segments = self.segments
        if parts <= 1 or stop <= start.position:
            return []
        candidates: list[int] = []
        num = segments.file_of(start.position)
        while num <= segments.write_file_num and segments.start_of(num) < stop:
            first = segments.start_of(num)
            if start.position < first:
                candidates.append(first)
            marks = self._scan(num, min(stop, self._records_end(num)), end.position)
            candidates.extend(p for p in marks.positions if start.position < p < stop)
            num += 1
        candidates = sorted(set(candidates))
        total = self._bytes_between(start.position, stop)
        cuts: list[int] = []
        for k in range(1, parts):
            target = start.position + total * k // parts
            at = bisect_right(candidates, target)
            best = -1
            for c in candidates[max(0, at - 1):at + 1]:
                if best < 0 or abs(c - target) < abs(best - target):
                    best = c
            if best >= 0 and (not cuts or best > cuts[-1]):
                cuts.append(best)
        return cuts

    def _bytes_between(self, a: int, b: int) -> int:
        return self.segments.distance(a, b) if a < b else 0

    # --- reading ------------------------------------------------------------------------------

    def read(self, start: Place, end: Place, stop: int, max_bytes: int) -> Block:
        """Records from `start` (a boundary) that end at or before `stop` and `end`, at most `max_bytes`
        of them (one record at least), from one segment: one pread of the block, walked once (which
        extends the marks when the block starts where the segment was walked to)."""
        segments = self.segments
        stop = min(stop, end.position)
        if start.position >= stop:
            return Block(b"", 0, [0], start.position, start.index, start)
        num = segments.file_of(start.position)
        fd = self._open(num)
        try:
            base = segments.start_of(num)
            seg_end = min(stop, self._segment_end(num, fd))
            if start.position >= seg_end:
                nxt = self._next_segment(num, end)
                return Block(b"", 0, [0], start.position, start.index, nxt if nxt.position <= stop else start)
            size = min(seg_end - start.position, max(max_bytes, 4))  # (a size prefix at least)
            buf = os.pread(fd, size, start.position - base)
            if len(buf) >= 4:
                first = 4 + int32_at(buf, 0)
                if first > len(buf) and first <= seg_end - start.position:
                    buf = os.pread(fd, first, start.position - base)  # one record larger than max_bytes
        finally:
            close_quietly(fd)
        marks = self._of(num)
        extend = marks.scanned == start.position
        starts: list[int] = []
        result = Walk()
        result.starts = starts
        walk(buf, 0, len(buf), ALL_RECORDS, segments.min_msg_size, segments.max_msg_size, result,
             start.position - base, marks.last if extend else NO_MARKS)
        if result.count == 0:
            raise ValueError(f"a record past the end of segment {num} at {start.position - base}")
        if extend:
            marks.walked(start.position, result)
        starts.append(result.stop)
        after = Place(start.position + result.stop, start.index + result.count)
        if after.position >= seg_end and seg_end < stop:
            after = self._next_segment(num, end)  # the segment is read to its end
        return Block(buf, result.stop, starts, start.position, start.index, after)
