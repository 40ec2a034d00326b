"""SegmentLog: go-diskqueue's files as an append-only log that any number of readers read by position.

Files, in the data directory (byte for byte those of github.com/nsqio/go-diskqueue, so Go nsqd reads them):
- segments `<name>.diskqueue.%06d.dat`: records `[length int32 BE][bytes]`; a record goes to a new file
  when the current one is not empty and the record would take it past max_bytes_per_file (a file ends at
  most max_bytes_per_file long, or holds a single longer record);
- meta `<name>.diskqueue.meta.dat`: "depth\\nreadFileNum,readPos\\nwriteFileNum,writePos\\n", written to a
  temp file, fsynced and renamed. Its owner says what the read position is (the oldest record a reader
  still needs: what Go nsqd would deliver from) and may add lines after Go's three (`trio-nsq-log 2`:
  the log's epoch, each segment's first record index and start position, the index at the write
  position, and the owner's own lines); Go's Fscanf reads the three and stops.
Beside each segment, not Go's: `<name>.diskqueue.%06d.crc`, a CRC32 of every append batch (checksums.py):
records past the metadata's write position are checked against it at open (Go nsqd never opens it).

A record's *position* is where it is in the log's life: its segment's start position plus its offset
in the file. A new segment starts where the last one ended, so positions are byte offsets that never
run out (2**63 bytes) whatever the segment numbers are: go-diskqueue's file numbers only ever grow, and
a long-lived Go nsqd's directory carries numbers past 2**23 that `file << 40 | offset` (what positions
were before) could not hold in 63 bits. Segments of a log written by trio-nsq-log 1 keep their start
`file << 40`, so the positions its cursor files hold stay true; a queue Go wrote starts at 0. Positions
are stable, ordered as the log, and the same on every copy of the files (the starts are in the meta, and
each segment's own start in the header of its CRC side file, written before its first record: a segment
found past the meta at open starts there, or, without a whole header, past every position the files from
the meta's write file on may have held, since a power loss may have cut the file before it: what a torn
tail loses is a gap of positions, never a shift of the next segment's; a segment missing below one that
is there is a gap readers skip). Each record also has an index (its number in the log),
so the records between two positions are counted by a subtraction.

What go-diskqueue did that stays: the put size check, when a file rolls, a record length outside [min,
max] or a short read cutting the file there (Go renames it `.bad` and skips to the next; the write file
rolls when it is the one cut), a torn record at the end cut off.

What is not go-diskqueue's: reading does not consume (readers are SegmentReaders with a position of their
own); files go only when the owner says so (drop_before), after the metadata that no longer needs them is
persisted, and a segment a crash left below the first one kept is removed at open; a kill -9 loses nothing
written (records past the persisted write position are recovered at open, in order, with their indices),
and where a power loss left the unsynced end of a file as zeros (or another torn record) the recovery cuts
it there (the owner says what a record looks like: an NSQ message's id is 16 hex digits); fsync is not
done here but by the owner's sync round (SyncGroup), which asks `take_unsynced()`. Temp files a crash
left behind are removed at open.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import time
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence

import attrs

from trio_nsq.broker.storage.backend import BackendError
from trio_nsq.broker.storage.checksums import META_KEY, META_VALUE, Checksums, side_numbers
from trio_nsq.broker.storage.files import close_quietly, fsync_dir, fsync_file, remove_quietly
from trio_nsq.shared.protocol import INT32, int32_at

log = logging.getLogger("nsqd")

# positions are written as signed 64-bit numbers (cursor files, deadline files): none reaches this
POS_LIMIT = 1 << 63
# trio-nsq-log 1's positions: segment n started at n << LEGACY_SHIFT
LEGACY_SHIFT = 40
# how often append() checks that its write file still has a name on disk
LINK_CHECK_INTERVAL = 0.1
# records per write (a batch, one CRC entry: checksums.py); once a writev of two buffers each, within
# Linux's IOV_MAX of 1024
_IOV_RECORDS = 512
# a reader's block: it drains records in batches, so fewer, larger reads
_READ_BUFFER = 256 * 1024
# the block a scan at open reads the files in
_SCAN_BUFFER = 1024 * 1024
EXT_HEADER = "trio-nsq-log 2"
# a metadata line written while the log is cut back (TopicLog.truncate_to, reset_to): nothing past its write
# position is the log's, whatever the files hold there (an open cuts it off before recovering anything)
CUT_KEY = "cut-tail"
_EXT_HEADER_V1 = "trio-nsq-log 1"


@attrs.frozen
class Place:
    """A place in a log: a record's position and its index (the record there, or the one to come)."""

    position: int
    index: int


def numbered_files(names: Iterable[str], stem: str) -> list[int]:
    """The numbers N of the files `<stem>.N.dat` among `names` (N written with six digits or more), in
    order. A log's segments, and a topic log's deadline files. (String tests, no regular expression:
    it runs for every log a broker opens.)"""
    prefix = stem + "."
    found = []
    for entry in names:
        if entry.startswith(prefix) and entry.endswith(".dat"):
            number = entry[len(prefix):-4]
            if len(number) >= 6 and number.isdigit() and number.isascii():
                found.append(int(number))
    return sorted(found)


def temp_files(names: Iterable[str], path_name: str) -> list[str]:
    """The names `<path_name>.<digits>.tmp` among `names`: what a crash during a replace left."""
    prefix = path_name + "."
    return [entry for entry in names if entry.startswith(prefix) and entry.endswith(".tmp")
            and entry[len(prefix):-4].isdigit() and entry[len(prefix):-4].isascii()]


def list_dir(path: str) -> list[str]:
    """The names in a data directory; none when it cannot be read."""
    try:
        return os.listdir(path)
    except OSError:
        return []


class SegmentLog:
    """Owned by a TopicLog (a topic's messages) or a LogReader (a channel's own queue); they append, read
    through SegmentReaders, and tell it which files may go. Synchronous: writes go straight to the OS from
    the event loop (microseconds); fsync is the sync round's, in a thread.

    `valid_record(record)` says whether the bytes of a record found past the persisted write position at
    open look like one of the owner's records (a power loss can leave zeros where a record's bytes were
    not written back): the first that does not ends the log there. `names`: the data directory's names,
    when the caller listed it already (else it is listed once here)."""

    def __init__(
        self,
        name: str,
        data_path: str,
        *,
        max_bytes_per_file: int = 100 * 1024 * 1024,
        min_msg_size: int = 26,
        max_msg_size: int = 1024 * 1024 + 26,
        on_write: Callable[[int, str | None], None] | None = None,
        valid_record: Callable[[bytes], bool] | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        self.name = name
        self.data_path = data_path
        self.max_bytes_per_file = max_bytes_per_file
        self.min_msg_size = min_msg_size
        self.max_msg_size = max_msg_size
        # told of every append (records stored, or the error that stopped it) and of a roll (0, None)
        self._on_write = on_write
        self._valid_record = valid_record

        self.write_file_num = 0
        self.write_pos = 0
        self.tail_index = 0  # the index the next record gets
        self.first_file = 0  # the oldest segment kept
        self._first_index: dict[int, int] = {0: 0}  # segment -> index of its first record
        # the start position of every segment kept, first_file to write_file_num
        self._starts: list[int] = [0]
        self._cut: dict[int, int] = {}  # segment -> where a bad record cut it
        self._write_fd: int | None = None
        self._last_link_check = 0.0
        self._unsynced_from: int | None = None  # the first segment written since the last round
        self._files_changed = False  # a segment was created, dropped or cut since the last round
        self.closed = False
        self.appended = 0  # records appended by this process
        self.recovered = 0  # records found at open past the persisted write position
        # what the files held at open that a round had fsynced (a metadata write follows a round's
        # fsync): records found past it were written after, and may be in the page cache only
        self.synced_at_open = Place(0, 0)
        # where the first stretch of positions lost at open ends (records lost before a segment's start,
        # or a segment missing): records ending past it may have begun in the lost stretch
        self._lost_before = POS_LIMIT

        # what the metadata said: Go's read position and depth, and our lines after them
        self.meta_read = (0, 0)
        self.meta_read_index = 0
        self.meta_depth = 0
        self.meta_found = False  # a metadata file was there
        self.epoch = 0  # ties cursor files to these files: 0 until an extension is found or made
        self.extension: dict[str, str] = {}  # our owner's lines (`key value`)
        self.epoch_loaded = False  # the epoch was read from the metadata (else made here, not on disk yet)
        self._legacy = False  # the metadata is trio-nsq-log 1's: files found past it start at n << 40
        # the CRC side files (checksums.py); records past the metadata's write position are checked against
        # them at open only when that metadata says every append since has an entry
        self._checksums = Checksums(name, data_path)
        self._crc_check = False

        mine = self._my_files(list_dir(data_path) if names is None else names)
        self._remove_temp_files(mine)
        self._retrieve_metadata()
        # the metadata was written by a cut back (truncate_to, reset_to) that may not have finished: what
        # the files hold past its write position was cut off, and is, again, before anything is recovered
        self.cut_at_open = self.extension.pop(CUT_KEY, None) is not None
        if self.cut_at_open:
            gone = set(self.cut_files(self.write_file_num, self.write_pos, mine))
            mine = [entry for entry in mine if entry not in gone]
        existing = numbered_files(mine, f"{name}.diskqueue")
        named = self.write_file_num  # the metadata's write file: recovery looks at it and past it
        self._recover_tail(existing)
        self._note_missing(existing, named)
        self._remove_stale_segments(existing)
        self._checksums.remove_below(self.first_file, mine)

    def __repr__(self) -> str:
        return f"SegmentLog({self.name})"

    # --- files --------------------------------------------------------------------------------

    def file_name(self, num: int) -> str:
        return os.path.join(self.data_path, f"{self.name}.diskqueue.{num:06d}.dat")

    def meta_file_name(self) -> str:
        return os.path.join(self.data_path, f"{self.name}.diskqueue.meta.dat")

    def _my_files(self, names: Iterable[str]) -> list[str]:
        prefix = f"{self.name}.diskqueue."
        return [entry for entry in names if entry.startswith(prefix)]

    def _remove_temp_files(self, mine: list[str]) -> None:
        """A crash during a metadata write leaves `<meta>.<random>.tmp`: never read, so removed."""
        for entry in temp_files(mine, f"{self.name}.diskqueue.meta.dat"):
            remove_quietly(os.path.join(self.data_path, entry))

    def _remove_stale_segments(self, existing: list[int]) -> None:
        """Segments below the first one kept: a crash after the metadata stopped naming them and before
        their removal (or their removal's directory fsync) left them. Nothing reads them; Go nsqd neither."""
        for num in existing:
            if num >= self.first_file:
                break
            failed = remove_quietly(self.file_name(num))
            if failed is None:
                log.info("DISKQUEUE(%s) removed %s, left below the first segment %d by a crash",
                         self.name, self.file_name(num), self.first_file)

    def _retrieve_metadata(self) -> None:
        path = self.meta_file_name()
        try:
            with open(path, "rb") as fh:
                lines = fh.read().decode("ascii").split("\n")
            depth = int(lines[0])
            read_num, read_pos = (int(x) for x in lines[1].split(","))
            write_num, write_pos = (int(x) for x in lines[2].split(","))
            if min(depth, read_num, read_pos, write_num, write_pos) < 0:
                raise ValueError("a negative number")
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
        if not lines or lines[0] not in (EXT_HEADER, _EXT_HEADER_V1):
            return False
        legacy = lines[0] == _EXT_HEADER_V1
        ext: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                key, _, value = line.partition(" ")
                ext[key] = value
        try:
            epoch = int(ext.pop("epoch"), 16)
            segments: dict[int, tuple[int, int]] = {}
            for entry in ext.pop("segments").split(" "):
                if entry:
                    fields = [int(x) for x in entry.split(":")]
                    num, index = fields[0], fields[1]
                    start = num << LEGACY_SHIFT if legacy else fields[2]
                    segments[num] = (index, start)
            tail = int(ext.pop("tail"))
        except (KeyError, ValueError, IndexError) as exc:
            log.error("DISKQUEUE(%s) ignoring unreadable log state in %s - %s", self.name, self.meta_file_name(), exc)
            return False
        first = min(segments, default=self.write_file_num)
        if legacy and (max(self.write_file_num, *segments) + 2) << LEGACY_SHIFT >= POS_LIMIT:
            # trio-nsq-log 1 could not give these files positions: start again as from a queue Go wrote
            # (cursor files of the old epoch are refused: their channels start at the read position)
            log.warning("DISKQUEUE(%s) segment numbers past what trio-nsq-log 1 positions hold: "
                        "positions start again at the read position", self.name)
            return False
        self.epoch = epoch
        self._legacy = legacy
        self.first_file = min(first, self.write_file_num)
        self._first_index = {num: index for num, (index, _) in segments.items()}
        self._first_index.setdefault(self.write_file_num, tail)
        starts = {num: start for num, (_, start) in segments.items()}
        self._starts = []
        for num in range(self.first_file, self.write_file_num + 1):
            known = starts.get(num)
            self._starts.append(known if known is not None else
                                num << LEGACY_SHIFT if legacy else self._after_gap(1))
        self.tail_index = tail
        self._crc_check = ext.pop(META_KEY, None) == META_VALUE
        self.extension = ext
        self.epoch_loaded = True
        return True

    def _span(self) -> int:
        """More than any segment holds: a file's limit plus one record longer than it."""
        return self.max_bytes_per_file + 4 + self.max_msg_size

    def _after_gap(self, missing: int) -> int:
        """The start of a segment `missing` numbers after the last one known, whose sizes are not known
        (files lost): far enough that no position of theirs is given again."""
        last = self._starts[-1] if self._starts else 0
        return last + missing * self._span()

    def _count_go_queue(self, read_num: int, read_pos: int) -> None:
        """Indices and starts for a queue Go wrote: go-diskqueue deletes a file once read, so the read file
        still holds its records from offset 0; count them to the persisted write position. Positions
        start at 0 at the read file's start."""
        self.first_file = read_num
        index = 0
        start = 0
        self._first_index = {}
        self._starts = []
        for num in range(read_num, self.write_file_num + 1):
            self._first_index[num] = index
            self._starts.append(start)
            end = self.write_pos if num == self.write_file_num else None
            try:
                size = os.path.getsize(self.file_name(num))
            except OSError:
                start += self._span()
                continue
            scanned, count = self._scan(num, 0, size if end is None else min(end, size))
            index += count
            start += size
            if num == read_num:
                self.meta_read_index = self._count_before(num, read_pos)
        self.tail_index = index

    def _count_before(self, num: int, offset: int) -> int:
        try:
            size = os.path.getsize(self.file_name(num))
        except OSError:
            return 0
        return self._scan(num, 0, min(offset, size))[1]

    def _recover_tail(self, existing: list[int]) -> None:
        """Count in the records written after the metadata was last persisted: past the write position in
        the write file, then in the files a roll had started since.

        A segment the metadata does not name (a roll since its last write) takes the start its side file's
        header recorded when it was begun (checksums.py), if whole and of this log's epoch: a kill -9
        keeps every position, and a power loss that cut the file before it leaves a gap up to it, never a
        shift. Without one (torn, or its name not durable, or a log Go or an older trio-nsq wrote) it
        starts past every position the files from the metadata's write file on may have held (`floor`):
        a power loss may have cut the file before it (torn inside, or at a record boundary: nothing
        tells), and a position given then (a key's, a deadline's) must land in the gap, never on another
        record. A segment missing below one that is there (its name not durable: POSIX orders no two
        names without a directory fsync) stays in the log as a gap its readers skip."""
        if not self.meta_found:
            # no metadata (a crash before the first round): the log began at segment 0, position 0, with
            # the epoch its side files were written with
            for found in existing:
                header = self._checksums.header(found)
                if header is not None:
                    self.epoch = header[0]
                    break
        num, pos = self.write_file_num, self.write_pos
        self.synced_at_open = (Place(self.tail, self.tail_index) if self.meta_found
                               else Place(self.start, self.start_index()))
        floor = self._starts[-1] + (max([num, *existing]) - num + 1) * self._span()
        while True:
            path = self.file_name(num)
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                later = [n for n in existing if n > num]
                if later:
                    log.warning("DISKQUEUE(%s) %s is missing (metadata writePos %d), recovering from %s",
                                self.name, path, pos, self.file_name(later[0]))
                    recorded = self._recorded_start(later[0], self._starts[-1] + pos)
                    if recorded is None:
                        self._starts.extend(max(floor, self._after_gap(i)) for i in range(1, later[0] - num + 1))
                        num, pos = self._write_file_is(later[0])
                    else:
                        # the missing ones are a gap up to where the one found recorded its start
                        self._starts.extend([self._starts[-1]] * (later[0] - num - 1))
                        num, pos = self._starts_at(later[0], recorded)
                    self._lost_before = min(self._lost_before, self._starts[-1])
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
                # positions up to the metadata's write position were given, and maybe more past it
                recorded = self._recorded_start(num + 1, self._starts[-1] + pos)
                if recorded is None:
                    self._starts.append(max(floor, self._starts[-1] + pos))
                    num, pos = self._write_file_is(num + 1)
                else:
                    num, pos = self._starts_at(num + 1, recorded)
                self._lost_before = min(self._lost_before, self._starts[-1])
                continue
            end = self._recover_file(num, pos, size)
            num, pos = num + 1, 0
            if not os.path.exists(self.file_name(num)):
                break
            if self._legacy:
                self._first_index[num] = self.tail_index
                self._starts.append(num << LEGACY_SHIFT)
                continue
            recorded = self._recorded_start(num, self._starts[-1] + end)
            if recorded is None:
                self._first_index[num] = self.tail_index
                self._starts.append(max(floor, self._starts[-1] + end))
            else:
                self._starts_at(num, recorded)
            if self._starts[-1] > self._starts[-2] + end:
                self._lost_before = min(self._lost_before, self._starts[-1])
        if self.write_file_num not in self._first_index:
            self._first_index[self.write_file_num] = self.tail_index - self._count_before(self.write_file_num, self.write_pos)
        if self.first_file > self.write_file_num:
            self.first_file = self.write_file_num
            self._starts = self._starts[-1:]
        del self._starts[self.write_file_num - self.first_file + 1:]

    def _note_missing(self, existing: list[int], named: int) -> None:
        """Segments the metadata names before its write file that are not there (a power loss kept a
        later name and not theirs): their positions are a gap that readers skip (go-diskqueue reads on
        from the next file, as SegmentReader does), and records ending past it may have begun in it."""
        there = set(existing)
        for num in range(self.first_file, min(named, self.write_file_num)):
            if num not in there:
                log.warning("DISKQUEUE(%s) %s is missing: its positions are lost", self.name, self.file_name(num))
                self._lost_before = min(self._lost_before, self.start_of(num + 1))
                break

    def _recorded_start(self, num: int, at_least: int) -> tuple[int, int] | None:
        """(start, first index) segment num's side file recorded when it was begun, if its header is whole,
        of this log's epoch, and not before what the log before it holds (position `at_least`, the index
        tail_index): else None (the caller starts it past a gap)."""
        header = self._checksums.header(num)
        if header is None:
            return None
        epoch, start, index = header
        if epoch != self.epoch or start < at_least or index < self.tail_index or start >= POS_LIMIT:
            log.warning("DISKQUEUE(%s) ignoring the start recorded for %s (epoch %x, start %d, index %d)",
                        self.name, self.file_name(num), epoch, start, index)
            return None
        return start, index

    def _starts_at(self, num: int, recorded: tuple[int, int]) -> tuple[int, int]:
        """Segment num starts where its side file says: recovery goes on there (records lost between are
        a gap of positions and indices)."""
        start, index = recorded
        self._starts.append(start)
        self.tail_index = index
        return self._write_file_is(num)

    def _write_file_is(self, num: int) -> tuple[int, int]:
        """Recovery goes on in segment num, from its start: it is the write file until one after it is."""
        self.write_file_num, self.write_pos = num, 0
        self._first_index[num] = self.tail_index
        return num, 0

    def _recover_file(self, num: int, pos: int, size: int) -> int:
        """The records of segment num from `pos` on are counted in (a torn one at the end cut off); it is
        the write file up to where they end, which is returned."""
        path = self.file_name(num)
        if self._crc_check or not self.meta_found:
            limit, why = self._checksums.verified_end(path, num, pos, size, required=self._crc_check)
        else:
            limit, why = size, ""
        end, count = self._scan(num, pos, limit, check=self._valid_record)
        if end < size:
            log.warning("DISKQUEUE(%s) cutting %d bytes of a torn record%s off the end of %s", self.name,
                        size - end, f" ({why})" if end == limit and why else "", path)
            os.truncate(path, end)
            if not count:
                # no record recovered here, so no round fsyncs this file: a second power loss would bring
                # the torn bytes back (past a sealed segment's end, where a read then fails)
                self._sync_cut(path)
        if count:
            log.info("DISKQUEUE(%s) recovered %d records past writePos %d in %s (written after the "
                     "last metadata sync)", self.name, count, pos, path)
            # a kill -9 leaves them in the page cache: the first round fsyncs them
            if self._unsynced_from is None:
                self._unsynced_from = num
        self.recovered += count
        self.tail_index += count
        self.write_file_num, self.write_pos = num, end
        return end

    def _sync_cut(self, path: str) -> None:
        try:
            fsync_file(path)
        except OSError as exc:
            log.error("DISKQUEUE(%s) failed to fsync the cut of %s - %s", self.name, path, exc)

    def _scan(self, num: int, pos: int, size: int, check: Callable[[bytes], bool] | None = None) -> tuple[int, int]:
        """(end of the last whole, valid record from pos, how many records) in segment num up to size,
        read in blocks; `check` (when given) must accept each record's bytes."""
        count = 0
        if size <= pos:
            return pos, 0
        min_size, max_size = self.min_msg_size, self.max_msg_size
        with open(self.file_name(num), "rb", buffering=0) as fh:
            buf = b""
            at = 0  # buf[0] is at file offset `at`
            while pos + 4 <= size:
                rel = pos - at
                if rel + 4 > len(buf):
                    fh.seek(pos)
                    buf, at, rel = fh.read(min(_SCAN_BUFFER, size - pos)), pos, 0
                    if len(buf) < 4:
                        break
                length = int32_at(buf, rel)
                if length < min_size or length > max_size or pos + 4 + length > size:
                    break
                if check is not None:
                    if rel + 4 + length > len(buf):
                        fh.seek(pos)
                        buf, at, rel = fh.read(min(max(_SCAN_BUFFER, 4 + length), size - pos)), pos, 0
                        if len(buf) < 4 + length:
                            break
                    if not check(buf[rel + 4:rel + 4 + length]):
                        break
                pos += 4 + length
                count += 1
        return pos, count

    # --- metadata -----------------------------------------------------------------------------

    def meta_bytes(self, read_pos: int, read_index: int, extra: Sequence[str] = ()) -> bytes:
        """The metadata file: Go's three lines with this read position (and the depth from it to the
        tail), then ours."""
        num, offset = self.split(max(read_pos, self.start))
        segments = " ".join(f"{n}:{self.index_of_file(n)}:{self.start_of(n)}"
                            for n in range(self.first_file, self.write_file_num + 1))
        lines = [f"{self.tail_index - read_index}", f"{num},{offset}",
                 f"{self.write_file_num},{self.write_pos}", EXT_HEADER, f"epoch {self.epoch:x}",
                 f"segments {segments}", f"tail {self.tail_index}", f"{META_KEY} {META_VALUE}", *extra, ""]
        return "\n".join(lines).encode()

    def take_unsynced(self) -> list[str]:
        """The segments written since the last call, then their side files (a sync round fsyncs them)."""
        first = self._unsynced_from
        self._unsynced_from = None
        if first is None:
            return []
        nums = range(first, self.write_file_num + 1)
        return [self.file_name(n) for n in nums] + [self._checksums.file_name(n) for n in nums]

    def take_files_changed(self) -> bool:
        """Whether a segment was created, dropped or cut since the last call (the metadata must say so,
        and the directory be fsynced)."""
        changed, self._files_changed = self._files_changed, False
        return changed

    def files_changed_again(self) -> None:
        """A round that was to persist a change of files failed: the next one does it again."""
        self._files_changed = True

    def unsynced_again(self, paths: list[str]) -> None:
        """A round that was to fsync these failed: the next one does them again."""
        if paths:
            first = int(paths[0].rsplit(".", 2)[-2])
            self._unsynced_from = first if self._unsynced_from is None else min(first, self._unsynced_from)

    # --- positions ----------------------------------------------------------------------------

    @property
    def tail(self) -> int:
        """The position the next record gets."""
        return self._starts[-1] + self.write_pos

    @property
    def start(self) -> int:
        """The position of the first record kept."""
        return self._starts[0]

    def start_index(self) -> int:
        return self._first_index.get(self.first_file, self.tail_index)

    def start_of(self, num: int) -> int:
        """The position of segment num's offset 0 (past the write file: the tail, where the next starts;
        before the first kept: the first kept's)."""
        at = num - self.first_file
        if at < 0:
            return self._starts[0]
        if at >= len(self._starts):
            return self.tail
        return self._starts[at]

    def file_of(self, pos: int) -> int:
        """The segment holding position `pos` (first_file - 1 for a position before the log)."""
        return self.first_file + bisect_right(self._starts, pos) - 1

    def holds_end(self, pos: int) -> bool:
        """Whether the records that end at position `pos` are all in the log (or were dropped, every
        reader past them): not past the tail, nor in a gap that lost records left (a segment cut short
        before the next one's start), nor past a gap found at open (they may have begun in it)."""
        if pos <= self.start:
            return True
        if pos > self.tail or pos > self._lost_before:
            return False
        num = self.file_of(pos - 1)
        return pos - self.start_of(num) <= self._size(num)

    def split(self, pos: int) -> tuple[int, int]:
        """(segment, offset in it) of position `pos`."""
        num = self.file_of(pos)
        return num, pos - self.start_of(num)

    def position(self, num: int, offset: int) -> int:
        return self.start_of(num) + offset

    def index_of_file(self, num: int) -> int:
        """The index of segment num's first record (the tail's index past the last segment)."""
        while num <= self.write_file_num:
            index = self._first_index.get(num)
            if index is not None:
                return index
            num += 1
        return self.tail_index

    def distance(self, a: int, b: int) -> int:
        """Bytes of the log from position a to position b (a <= b): what keeping a costs past b."""
        num_a, off_a = self.split(a)
        num_b, off_b = self.split(b)
        if num_a == num_b:
            return off_b - off_a
        return sum(self._size(n) for n in range(num_a, num_b)) - off_a + off_b

    def segment_bytes(self) -> int:
        """The bytes of every segment kept."""
        total = 0
        for num in range(self.first_file, self.write_file_num):
            total += self._size(num)
        return total + self.write_pos

    def segment_size(self, num: int) -> int:
        """The bytes of segment num that readers read."""
        return self._size(num)

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

    def segments(self) -> range:
        return range(self.first_file, self.write_file_num + 1)

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
            base = self._starts[-1]
            while end < n and len(iov) < _IOV_RECORDS * 2:
                data = records[end]
                length = len(data)
                if length < min_size or length > max_size:
                    bad = (f"invalid message write size ({length}) "
                           f"minMsgSize={min_size} maxMsgSize={max_size}")
                    break
                if (pos > self.write_pos or end > stored) and pos + 4 + length > max_file:
                    break
                if base + pos + 4 + length >= POS_LIMIT:
                    bad = f"the log's positions are used up ({base + pos} of {POS_LIMIT})"
                    break
                iov.append(pack(length))
                iov.append(data)
                if positions is not None:
                    positions.append(base + pos)
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
        """One write of `count` records (their CRC entry first) to the write file; on failure none of them
        counts."""
        try:
            fd = self._write_fd
            if fd is None:
                fd = self._open_write_file()
            # one buffer: its CRC, and a write that costs less than the writev of its pieces (measured)
            data = b"".join(iov)
            if self._checksums.append(self.write_file_num, self.write_pos, data):
                self._files_changed = True  # the side file's name: the round fsyncs the directory
            written = os.write(fd, data)
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
            try:
                # where the segment starts, before its first record: an open before the metadata names it
                # reads it there (a kill -9 then keeps every position)
                self._checksums.begin(self.write_file_num, self.epoch, self._starts[-1], self.tail_index)
            except OSError:
                os.close(fd)
                raise
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

    def _next_write_file(self, start: int | None = None) -> None:
        """Roll: later records go to the next file, which starts where this one ends (or at `start`, past
        it: roll_at) (the owner's round fsyncs both)."""
        if self.write_pos > 0 and self._unsynced_from is None:
            self._unsynced_from = self.write_file_num
        self._close_write_fd()
        self._starts.append(self.tail if start is None else start)
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
        self._checksums.close()

    def roll_at(self, start: int) -> None:
        """The next record starts a new segment at position `start`, past the tail (a replica follows its
        leader's positions: the leader rolled before this log would, or a power loss left it a gap).
        An empty write file is made on disk first, with its side file's header: a segment missing below
        one that is there would be a gap of lost records to readers and to the next open."""
        if start <= self.tail or start >= POS_LIMIT:
            raise ValueError(f"a segment cannot start at {start} (the log ends at {self.tail})")
        if self.closed:
            raise BackendError("exiting")
        if self.write_pos == 0 and self._write_fd is None and not os.path.exists(self.file_name(self.write_file_num)):
            try:
                self._open_write_file()
            except OSError as exc:
                self._close_write_fd()
                error = f"failed to write to disk queue {self.name} - {exc}"
                log.error("DISKQUEUE(%s): failed to write - %s", self.name, exc)
                if self._on_write is not None:
                    self._on_write(0, error)
                raise BackendError(error, 0) from None
            if self._unsynced_from is None or self._unsynced_from > self.write_file_num:
                self._unsynced_from = self.write_file_num
        self._next_write_file(start)

    def truncated_to(self, num: int, offset: int, index: int) -> None:
        """The log ends at `offset` of segment num now (a record boundary, or its end), the next record's
        index `index`: the segments after it are forgotten (in memory: the owner has made the cut durable
        with cut_files, after a metadata saying CUT_KEY). Readers are the owner's to move."""
        self._close_write_fd()
        self._first_index[num] = self.index_of_file(num)
        for later in range(num + 1, self.write_file_num + 1):
            self._first_index.pop(later, None)
            self._cut.pop(later, None)
        self._cut.pop(num, None)
        del self._starts[num - self.first_file + 1:]
        self.write_file_num = num
        self.write_pos = offset
        self.tail_index = index
        # positions from here on are given again: a record ending past here is not one kept before
        self._lost_before = min(self._lost_before, self.tail)
        if self._unsynced_from is not None and self._unsynced_from > num:
            self._unsynced_from = num
        self._files_changed = True

    def reset_to(self, start: int, epoch: int) -> int:
        """The log is empty, its next record at `start` in a new segment (numbered after every one there
        is), and its epoch `epoch` (another log's: a replica takes its leader's). The old segments are
        forgotten (in memory: the owner removes them, after a metadata naming only the new one).
        Returns the new segment's number."""
        if not 0 <= start < POS_LIMIT or not 0 < epoch < POS_LIMIT:
            raise ValueError(f"cannot reset the log to {start} with epoch {epoch:x}")
        self._close_write_fd()
        num = self.write_file_num + 1
        self.first_file = self.write_file_num = num
        self.write_pos = 0
        self._starts = [start]
        self._first_index = {num: 0}
        self.tail_index = 0
        self._cut = {}
        self._lost_before = POS_LIMIT
        self._unsynced_from = None
        self._files_changed = True
        self.epoch = epoch
        self.epoch_loaded = True
        return num

    def cut_files(self, num: int, offset: int, names: Iterable[str] | None = None) -> list[str]:
        """The files cut to what the metadata says (CUT_KEY): segment num cut at `offset` and fsynced, every
        segment and side file after it (and before the first kept: a reset) removed, the directory
        fsynced. Its side file keeps its entries past `offset`: an open checks from the metadata's write
        position on, where none of them starts before a new batch's entry written after it (the last
        written for an offset wins). The names removed (of `names`, the directory's listing when None).
        Raises OSError."""
        self._close_write_fd()
        listing = list_dir(self.data_path) if names is None else list(names)
        path = self.file_name(num)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            size = -1
        if size > offset:
            os.truncate(path, offset)
            fsync_file(path)
        stem = f"{self.name}.diskqueue"
        first = self.first_file
        gone = [f"{stem}.{n:06d}.dat" for n in numbered_files(listing, stem) if n > num or n < first]
        gone.extend(f"{stem}.{n:06d}.crc" for n in side_numbers(listing, stem) if n > num or n < first)
        for entry in gone:
            failed = remove_quietly(os.path.join(self.data_path, entry))
            if failed is not None:
                raise failed
        if size > offset or gone:
            log.info("DISKQUEUE(%s) cut back to %d of %s (%d files after it removed)", self.name, offset,
                     self.file_name(num), len(gone))
        fsync_dir(self.data_path)
        return gone

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
        """The record at `pos` (seek, an age in /stats); raises OSError or ValueError."""
        num, offset = self.split(pos)
        with open(self.file_name(num), "rb") as fh:
            fh.seek(offset)
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

    def drop_before(self, before: int) -> list[tuple[str, bool]]:
        """Forget the segments before segment `before` (never the write file) and return their files, for
        the owner to remove once the metadata no longer naming them is persisted. Each with whether it is
        to be kept as `.bad` instead (a bad record cut it: go-diskqueue keeps such files)."""
        before = min(before, self.write_file_num)
        dropped: list[tuple[str, bool]] = []
        if before <= self.first_file:
            return dropped
        self._files_changed = True
        for num in range(self.first_file, before):
            dropped.append((self.file_name(num), num in self._cut))
            dropped.append((self._checksums.file_name(num), False))
            self._first_index.pop(num, None)
            self._cut.pop(num, None)
        del self._starts[:before - self.first_file]
        self.first_file = before
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
        mine = re.compile(re.escape(self.name) + r"\.diskqueue\.(\d{6,}\.(dat(\.bad)?|crc)|meta\.dat(\.\d+\.tmp)?)\Z")
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
    """One reader's place in a SegmentLog: the segment, its start position and the offset in it of the
    next record, that record's index, the open segment and a block read from it (records are cut from
    256 KiB preads). Owned by a LogReader (and a TopicLog's scans)."""

    __slots__ = ("log", "file_num", "base", "pos", "index", "_fd", "_buf", "_buf_at", "_file_end")

    def __init__(self, segments: SegmentLog, pos: int, index: int) -> None:
        self.log = segments
        self.file_num = 0
        self.base = 0  # the position of the segment's offset 0
        self.pos = 0  # the offset in the segment
        self.index = index
        self._fd: int | None = None
        self._buf = b""
        self._buf_at = 0
        self._file_end = -1
        self._place(pos)

    @property
    def position(self) -> int:
        return self.base + self.pos

    def _place(self, pos: int) -> None:
        num = self.log.file_of(pos)
        self.file_num = num
        self.base = self.log.start_of(num)
        self.pos = max(0, pos - self.base)

    def seek(self, pos: int, index: int) -> None:
        self.close()
        self._place(pos)
        self.index = index

    def close(self) -> None:
        self._buf = b""
        if self._fd is not None:
            close_quietly(self._fd)
            self._fd = None

    def read(self, limit: int, upto: int, positions: list[int]) -> list[bytes]:
        """Up to `limit` records before position `upto`; `positions` gets theirs. The records of one call
        have consecutive indices (a call stops where reading jumps over lost records). A bad record cuts
        its file (SegmentLog.cut) and reading goes on in the next one: logged, never raised."""
        out: list[bytes] = []
        segments = self.log
        if segments.closed:
            return out
        while len(out) < limit:
            num = self.file_num
            if num < segments.first_file:
                if not self._next_file(segments.first_file) and out:
                    break
                continue
            if self.base + self.pos >= upto:
                break
            try:
                data = self._read_one(num)
            except (OSError, ValueError) as exc:
                if isinstance(exc, FileNotFoundError) and num < segments.write_file_num:
                    log.error("DISKQUEUE(%s) %s is missing, reading on from the next file",
                              segments.name, segments.file_name(num))
                else:
                    segments.cut(num, self.pos, str(exc))
                if not self._next_file(num + 1) and out:
                    break
                continue
            if data is None:
                if num >= segments.write_file_num:
                    break  # at the tail
                if not self._next_file(num + 1) and out:
                    break
                continue
            positions.append(self.base + self.pos)
            out.append(data)
            self.pos += 4 + len(data)
            self.index += 1
        return out

    def rewind(self, pos: int, index: int) -> None:
        """Back to `pos` (read before, not used after all), the record with index `index`: in the same
        segment the open file and its block are kept."""
        if not self.base <= pos < self.log.start_of(self.file_num + 1) or self.file_num < self.log.first_file:
            self.seek(pos, index)
            return
        self.pos = pos - self.base
        self.index = index

    def fetch(self, pos: int) -> bytes:
        """The record at `pos`, out of order (a deferred record read back when it is due), through this
        reader's block, so records near each other cost one pread. For a reader that reads nothing else
        (its index is not kept). Raises OSError or ValueError."""
        num = self.log.file_of(pos)
        if num != self.file_num:
            self.close()
            self.file_num = num
            self.base = self.log.start_of(num)
        self.pos = pos - self.base
        data = self._read_one(num)
        if data is None:
            raise ValueError(f"no record at {num}:{self.pos}")
        return data

    def _next_file(self, num: int) -> bool:
        """On to segment num's start; whether the index runs on from here (no records lost between)."""
        self.close()
        index = self.log.index_of_file(num)
        same = index == self.index
        self.file_num = num
        self.base = self.log.start_of(num)
        self.pos = 0
        self.index = index
        return same

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
