"""TopicLog: a topic's messages, stored once, read by every channel through a cursor of its own.

What it holds, in the data directory:
- the SegmentLog `<topic>.diskqueue.*`: go-diskqueue's files. Its metadata's read position is the oldest
  record a durable channel has not finished (or, with no channels, the first not handed to any), so Go
  nsqd started on this directory delivers every unfinished message of every channel (some twice);
- the deadlines of deferred publishes (DPUB, /pub?defer=), per segment:
  `<topic>.diskqueue.deadlines.%06d.dat`, entries (position, unix deadline, message id) appended after
  their records. A channel reading such a record defers it; a restart reads the deadline again. They go
  with their segment; in memory only those of records some channel has not read are kept (PublishDeadlines);
- after Go's three lines of the metadata, how far the topic has handed its log to its channels
  (`dispatched`, "all" when up to the end): a channel created later starts there, as nsqd's new channel
  gets only what its topic still holds. While the topic has channels and is not paused, everything
  appended is handed at once.

Segments go once every channel has finished them (a positional reader's cursor idle past
--cursor-idle-timeout does not count: `idle`) (and, with --retention-time or --retention-bytes, once
they are also older or beyond the limit: a segment is older than the time when the next one's first
message was published before it, by the records' own timestamps, not the files' times, which a restored
backup resets), after the metadata and cursors that no longer need them are persisted: it all happens in
the topic's sync rounds (`prepare`, a SyncGroup member).

Its *durable tail* is the position up to which a round has fsynced the log: after a power loss a new
record may be written at the position of one that was lost, so whatever hands positions to a client (a
positional reader, a follower) serves no further. A round that fails leaves it where it was for good
(Linux may drop the pages of a failed write-back and report the next fsync clean): until a restart reads
the files again, nothing past it is served.

A replica (issue 52) holds its leader's records at the leader's positions (`append_at`, from the leader's
`read_raw`), hands its channels no further than the high watermark (`dispatch(upto)`, `served_end`), and
is cut back (`truncate_to`, KIP-101) or started again as the leader's log (`reset_to`). A cut back is
committed by a metadata saying so (segment_log.CUT_KEY: an open finishes it), so a crash reopens the log
as it was or cut, never half way; it runs between sync rounds (`truncate()`, `reset()` await that).

Who calls it: Topic (append, dispatch, empty, delete), Channel (reader_for, seek_to), the HTTP API
(seek positions, /stats, /replica/fetch: read_raw), the replication (append_at, truncate, reset,
high_watermark).
"""

from __future__ import annotations

import bisect
import builtins
import logging
import os
import random
import struct
import time
from collections.abc import Callable, Sequence

from trio_nsq.broker.storage.backend import BackendError
from trio_nsq.broker.storage.deadlines import PublishDeadlines
from trio_nsq.broker.storage.files import close_quietly, fsync_dir, fsync_file, remove_quietly, write_synced
from trio_nsq.broker.storage.log_index import LogIndex, PositionError
from trio_nsq.broker.storage.log_reader import LogReader
from trio_nsq.broker.storage.records import looks_like_message
from trio_nsq.broker.storage.segment_log import CUT_KEY, Place, SegmentLog, list_dir, numbered_files
from trio_nsq.broker.storage.sync_group import META_INTERVAL, RoundPlan, SyncGroup
from trio_nsq.shared.protocol import MESSAGE_HEADER

log = logging.getLogger("nsqd")

_DEADLINE = struct.Struct(">qd16s")
# read_raw's ends remembered (a follower's next fetch starts at one): more followers than this is unusual
_RAW_ENDS = 16


class SeekError(ValueError):
    """A seek the log cannot do (a time before what it retains)."""


class TopicLog:
    def __init__(
        self,
        name: str,
        data_path: str,
        group: SyncGroup,
        *,
        max_bytes_per_file: int,
        min_msg_size: int,
        max_msg_size: int,
        retention_time: float = 0.0,
        retention_bytes: int = 0,
        clock: Callable[[], float] = time.time,
        names: Sequence[str] | None = None,
    ) -> None:
        """`names`: the data directory's names, when the caller listed it (else it is listed here)."""
        self.name = name
        self.data_path = data_path
        self.group = group
        self.clock = clock
        self.retention_time = retention_time
        self.retention_bytes = retention_bytes
        self.deleted = False
        if names is None:
            names = list_dir(data_path)
        self._names = names  # what the data directory held for this topic at start (its channels' too)
        self.segments = SegmentLog(name, data_path, max_bytes_per_file=max_bytes_per_file,
                                   min_msg_size=min_msg_size, max_msg_size=max_msg_size, on_write=group.wrote,
                                   valid_record=looks_like_message, names=names)
        segments = self.segments
        self.readers: list[LogReader] = []  # every channel's reader of this log (ephemeral ones too)
        self.durable: list[LogReader] = []  # those with a cursor file
        # positional readers' cursors not committed for --cursor-idle-timeout (Channel.set_pins): their
        # position keeps no segment, and Go's read position is not theirs (`pinning`)
        self.idle: set[LogReader] = set()
        # how far the log is handed to the channels
        self.dispatched = self._load_dispatched()
        self.publish_deadlines = PublishDeadlines()
        self._deadline_fds: dict[int, int] = {}
        self._deadline_unsynced: set[int] = set()
        self._removing: list[tuple[str, bool, str]] = []
        self._taken: list[str] = []
        self._deadline_created: set[int] = set()
        self._meta_at = -META_INTERVAL  # when the metadata was last written (a round's monotonic time)
        self._meta_dispatched = ""
        self._first_stamps: dict[int, int | None] = {}  # segment -> its first record's timestamp
        # what a round has fsynced (position, index): at open, what the metadata says was; records found
        # past it are fsynced at open and it moves over those of the metadata's write file
        # (_sync_recovered); the deadlines after them are fsynced by the first round
        self.durable_tail = segments.synced_at_open
        self._round_tail = self.durable_tail
        self._suspect = False  # a round failed: the durable tail stays until a restart
        # read by position (the HTTP log API): every message is written here, none kept in memory only
        self.positional = segments.extension.get("positional") == "1"
        # the log id (the epoch) is in a metadata file on disk: until it is, it is not given out (a crash
        # before would make another)
        self.epoch_on_disk = segments.epoch_loaded
        self.positional_on_disk = self.positional  # ... and so is "positional 1" (the log API awaits it)
        self._meta_in_round = False
        self._positional_in_round = False
        self._index: LogIndex | None = None
        # a replicated topic's high watermark (set by its replication): positional readers are served no
        # further than min(durable tail, it) (`served_end`)
        self.high_watermark: int | None = None
        self._in_round = False  # between this log's prepare and finished: a round's thread may be at work
        self._broken = ""  # a cut back (truncate_to, reset_to) failed half way: no append until a restart
        self._raw_ends: dict[int, int] = {}  # position -> index where recent read_raw calls ended
        deadline_files = numbered_files(names, f"{name}.diskqueue.deadlines")
        if segments.cut_at_open:
            # a cut back may have stopped before its deadlines were cut: entries past the end would defer
            # the records written at their positions later
            self._cut_deadlines(segments.write_file_num, segments.tail, deadline_files)
            deadline_files = [num for num in deadline_files if num <= segments.write_file_num]
        # the log does not end where the metadata said (records recovered, a torn tail cut, segments
        # given a start): a deadline entry may name a position its record no longer has
        changed = segments.tail != segments.synced_at_open.position
        self._load_deadlines(segments.start, deadline_files, check_ids=changed)
        if segments.recovered:
            self._deadline_unsynced.update(n for n in deadline_files if n >= segments.file_of(self.durable_tail.position))
            self._sync_recovered()
            group.request_round()
        elif segments.cut_at_open:
            group.request_round()  # a metadata without the cut line, soon: records written from now on are kept
        group.members.append(self)

    def __repr__(self) -> str:
        return f"TopicLog({self.name})"

    def _sync_recovered(self) -> None:
        """Records a kill -9 left past the metadata's write position (maybe in the page cache only) are
        fsynced now, with the names of their segments: the durable tail starts where the recovered
        records of the metadata's write file end, not back at its write position (a reader shown the old
        end before the kill would find its positions past the end until the first round). Not further:
        a segment the metadata does not name got its start at this open, from the files there now, and
        another open before the first round writes the metadata may give it another (a roll since)."""
        segments = self.segments
        named = segments.file_of(segments.synced_at_open.position)  # the metadata's write file
        if named == segments.write_file_num:
            end = Place(segments.tail, segments.tail_index)
        else:
            end = Place(segments.start_of(named) + segments.segment_size(named), segments.index_of_file(named + 1))
        paths = segments.take_unsynced()
        try:
            for path in paths:
                fsync_file(path)  # (a segment Go or an older trio-nsq wrote has no side file)
            fsync_dir(self.data_path)
        except OSError as exc:
            log.error("TOPIC(%s) failed to fsync the records recovered at open - %s", self.name, exc)
            segments.unsynced_again(paths)  # the first round does it
            return
        if end.position > self.durable_tail.position:
            self.durable_tail = self._round_tail = end

    def _load_dispatched(self) -> Place:
        segments = self.segments
        value = segments.extension.get("dispatched")
        if value == "all":
            return Place(segments.tail, segments.tail_index)
        if value is not None:
            try:
                pos, index = (int(x) for x in value.split(" "))
                return Place(pos, index)
            except ValueError:
                log.error("TOPIC(%s) ignoring an unreadable dispatched position %r", self.name, value)
        if segments.meta_found:
            return Place(segments.position(*segments.meta_read), segments.meta_read_index)
        return Place(segments.start, segments.start_index())

    # --- files --------------------------------------------------------------------------------

    def deadline_file_name(self, num: int) -> str:
        return os.path.join(self.data_path, f"{self.name}.diskqueue.deadlines.{num:06d}.dat")

    def _deadline_files(self) -> list[int]:
        return numbered_files(list_dir(self.data_path), f"{self.name}.diskqueue.deadlines")

    def _load_deadlines(self, start: int, files: list[int], check_ids: bool = False) -> None:
        """The deadlines still ahead of records from `start` on (a restart, or a seek back), from deadline
        files `files`. Entries past the log's end (their records lost with a power failure, or a torn
        write) are cut off their file: a record written there later is not deferred by them. With
        `check_ids` (at open, after a crash), those of the segments past what the metadata saw must also
        name the message id of the record at their position (or follow it: `_verified`)."""
        now = self.clock()
        segments = self.segments
        tail = segments.tail
        first = segments.file_of(start)
        # segments a crash may have changed since their deadlines were written: from the one the metadata
        # saw the end of (records past it recovered at open, segments past it given a start at open)
        recovered = segments.file_of(segments.synced_at_open.position) if check_ids else segments.write_file_num + 1
        found: list[tuple[int, float]] = []
        for num in files:
            path = self.deadline_file_name(num)
            if num < first:
                if num < self.segments.first_file:
                    remove_quietly(path)  # its segment went before it
                continue
            try:
                with open(path, "rb") as fh:
                    data = fh.read()
            except OSError as exc:
                log.error("TOPIC(%s) cannot read %s - %s", self.name, path, exc)
                continue
            usable = len(data) - len(data) % _DEADLINE.size  # a crash may cut the last entry
            if num >= recovered:
                for pos, deadline, _ in self._verified(num, path, data[:usable], len(data)):
                    if pos >= start and deadline > now:
                        found.append((pos, deadline))
                continue
            kept = 0
            for pos, deadline, _ in _DEADLINE.iter_unpack(data[:usable]):
                if pos >= tail:
                    break
                kept += _DEADLINE.size
                if pos >= start and deadline > now:
                    found.append((pos, deadline))
            if kept < len(data):
                log.warning("TOPIC(%s) cutting %d deadline entries past the end of the log off %s",
                            self.name, (len(data) - kept) // _DEADLINE.size, path)
                try:
                    os.truncate(path, kept)
                except OSError as exc:
                    log.error("TOPIC(%s) cannot cut %s - %s", self.name, path, exc)
        if found:
            self.publish_deadlines.load(found)

    def _verified(self, num: int, path: str, data: bytes, size: int) -> list[tuple[int, float, bytes]]:
        """The entries of segment num's deadline file whose record is there: the message id at the
        position is the entry's, or (the segment was given another start at open) the record with that id
        is found in the segment and the entry moves to its position. The others (their records lost) go,
        so a deadline never defers another record written at their position. The file is rewritten
        when anything changed (the next round fsyncs it)."""
        segments = self.segments
        entries = list(_DEADLINE.iter_unpack(data))
        first, end = segments.start_of(num), segments.start_of(num) + segments.segment_size(num)
        kept: list[tuple[int, float, bytes]] = []
        missing: dict[bytes, float] = {}
        reader = segments.reader(first, segments.index_of_file(num))
        try:
            for pos, deadline, msg_id in entries:
                try:
                    same = first <= pos < end and reader.fetch(pos)[10:26] == msg_id
                except (OSError, ValueError):
                    same = False
                if same:
                    kept.append((pos, deadline, msg_id))
                else:
                    missing[msg_id] = deadline
        finally:
            reader.close()
        moved = 0
        if missing:
            for pos, msg_id in self._positions_of(num, set(missing)):
                kept.append((pos, missing.pop(msg_id), msg_id))
                moved += 1
            kept.sort()
            if missing:
                log.warning("TOPIC(%s) dropping %d deadline entries of %s: their records are not in the log",
                            self.name, len(missing), path)
            if moved:
                log.info("TOPIC(%s) %d deadline entries of %s follow their records to the positions their "
                         "segment has since this start", self.name, moved, path)
        if missing or moved or size != len(data):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
                try:
                    os.write(fd, b"".join(_DEADLINE.pack(*entry) for entry in kept))
                finally:
                    close_quietly(fd)
                self._deadline_unsynced.add(num)
            except OSError as exc:
                log.error("TOPIC(%s) cannot rewrite %s - %s", self.name, path, exc)
        return kept

    def _positions_of(self, num: int, ids: set[bytes]) -> list[tuple[int, bytes]]:
        """(position, id) of the records of segment num whose message id is in `ids`."""
        segments = self.segments
        found: list[tuple[int, bytes]] = []
        reader = segments.reader(segments.start_of(num), segments.index_of_file(num))
        upto = segments.start_of(num + 1)
        try:
            while ids:
                positions: list[int] = []
                records = reader.read(4096, upto, positions)
                if not records:
                    break
                for pos, data in zip(positions, records):
                    msg_id = data[10:26]
                    if msg_id in ids:
                        ids.discard(msg_id)
                        found.append((pos, msg_id))
        finally:
            reader.close()
        return found

    # --- writing ------------------------------------------------------------------------------

    def append(self, records: Sequence[bytes], deadline: float = 0.0) -> None:
        """Append records (every one deferred until `deadline`, unix seconds, when > 0). Raises
        BackendError (`.stored` of them kept) at the first that cannot be stored."""
        if self._broken:
            raise BackendError(self._broken)
        index = self._index
        if not deadline and index is None:
            self.segments.append(records)
            return
        positions: list[int] = []
        first_index = self.segments.tail_index
        try:
            self.segments.append(records, positions)
        finally:
            # after their records: a kill -9 between the two writes costs these records their delay,
            # never the records (an entry whose record was lost is cut off at the next start)
            if positions and deadline:
                self._append_deadlines(records, positions, deadline)
            if positions and index is not None:
                # a log read by position marks what it writes: a split or a check of what was written
                # since the start walks nothing again
                index.appended(records, positions, first_index)

    def _append_deadlines(self, records: Sequence[bytes], positions: list[int], deadline: float) -> None:
        self.publish_deadlines.add_many(positions, deadline)
        by_file: dict[int, list[bytes]] = {}
        file_of = self.segments.file_of
        for data, pos in zip(records, positions):
            by_file.setdefault(file_of(pos), []).append(_DEADLINE.pack(pos, deadline, data[10:26]))
        for num, packed in by_file.items():
            try:
                fd = self._deadline_fds.get(num)
                if fd is None:
                    for old in [n for n in self._deadline_fds if n != num]:
                        close_quietly(self._deadline_fds.pop(old))
                    fd = os.open(self.deadline_file_name(num), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                    self._deadline_fds[num] = fd
                    self._deadline_created.add(num)
                os.write(fd, b"".join(packed))
                self._deadline_unsynced.add(num)
            except OSError as exc:
                # the records stay; a restart before they are read delivers them at once (early, not lost)
                log.error("TOPIC(%s) failed to write deadlines to %s - %s", self.name, self.deadline_file_name(num), exc)

    def append_at(self, records: Sequence[bytes], positions: Sequence[int],
                  deadlines: Sequence[tuple[int, float]] = ()) -> None:
        """A replica appends what its leader sent: each record (as stored: what read_raw gives) at exactly
        its position there. A position equal to the tail is a plain append (this log rolls by its own
        max_bytes_per_file: positions stay contiguous either way); one past the tail starts a new segment
        there (the leader rolled earlier, or a power loss left it a gap); one below the tail (or inside
        the record before it) is a ValueError, before anything is written (the caller truncates first).
        `deadlines`: (position, unix deadline) of the deferred records among them, kept as a deferred
        append keeps them. Raises BackendError as append does (sizes, disk). Durable once a sync round has
        run (`await self.group.sync()`; then `durable_tail` says how far)."""
        if len(records) != len(positions):
            raise ValueError(f"{len(records)} records with {len(positions)} positions")
        if not records:
            return
        if self._broken:
            raise BackendError(self._broken)
        segments = self.segments
        end = segments.tail
        for data, pos in zip(records, positions):
            if pos < end:
                raise ValueError(f"a record at {pos}, before {end} (the log's end or the previous record's)")
            end = pos + 4 + len(data)
        due = dict(deadlines)
        if due and not set(due) <= set(positions):
            raise ValueError("a deadline for a position that is not among the records")
        index = self.index  # a replica is read by position: its marks follow what is written
        n = len(records)
        at = 0
        while at < n:
            if positions[at] > segments.tail:
                segments.roll_at(positions[at])
            stop = at + 1
            while stop < n and positions[stop] == positions[stop - 1] + 4 + len(records[stop - 1]):
                stop += 1
            run = records[at:stop]
            written: list[int] = []
            first_index = segments.tail_index
            try:
                segments.append(run, written)
            finally:
                if written:
                    index.appended(run, written, first_index)
                    deferred = [(pos, due[pos], data) for pos, data in zip(written, run) if pos in due]
                    if deferred:
                        self._append_deadline_entries(deferred)
            if written != list(positions[at:stop]):
                raise BackendError(f"records of {self.name} written at {written[:1]}, not at {positions[at]}", at)
            at = stop

    def _append_deadline_entries(self, entries: list[tuple[int, float, bytes]]) -> None:
        """Deadlines of deferred records appended at various positions (append_at), in position order."""
        for pos, deadline, data in entries:
            self._append_deadlines([data], [pos], deadline)

    def dispatch(self, upto: int | None = None) -> None:
        """Everything appended so far is handed to the channels there are; with `upto` (a replicated
        topic's high watermark), only the records that end at or before it."""
        segments = self.segments
        if upto is None or upto >= segments.tail:
            self.dispatched = Place(segments.tail, segments.tail_index)
            return
        if upto <= self.dispatched.position:
            return
        try:
            place = self.place_at(upto)
        except (OSError, ValueError) as exc:
            log.error("TOPIC(%s): cannot find where the records before %d end - %s", self.name, upto, exc)
            return
        if place.position > self.dispatched.position:
            self.dispatched = place

    def dispatchable(self, upto: int) -> int:
        """Records not handed to any channel yet that dispatch(upto) would hand."""
        segments = self.segments
        if upto >= segments.tail:
            return segments.tail_index - self.dispatched.index
        if upto <= self.dispatched.position:
            return 0
        try:
            return max(0, self.place_at(upto).index - self.dispatched.index)
        except (OSError, ValueError):
            return 0

    def place_at(self, position: int) -> Place:
        """The last record boundary at or before `position` (clamped to the log), with its index. Raises
        PositionError or ValueError (a damaged file)."""
        segments = self.segments
        if position >= segments.tail:
            return Place(segments.tail, segments.tail_index)
        if position <= segments.start:
            return Place(segments.start, segments.start_index())
        hint = self.dispatched if self.dispatched.position <= position else None
        return self.index.boundary_before(position, hint)

    def undispatched(self) -> int:
        """Records not handed to any channel yet (a paused topic's, or one without channels)."""
        return self.segments.tail_index - self.dispatched.index

    def read_raw(self, position: int, max_bytes: int, upto: int) -> tuple[list[int], list[bytes]]:
        """The records (raw, as stored: what append_at takes) from `position` (a record boundary, or the
        start of a later segment) that end at or before `upto` (clamped to the tail), about `max_bytes` of
        them (one at least when there is one), with their positions. What a leader serves its followers
        (past its high watermark too). Raises ValueError (PositionError: before the log's start, past its
        end, not a record boundary; or a damaged file)."""
        segments = self.segments
        tail = Place(segments.tail, segments.tail_index)
        known = self._raw_ends.get(position)
        # where a fetch ended is where the next one starts: no walk to check it is a boundary
        start = Place(position, known) if known is not None and segments.start <= position <= tail.position \
            else self.index.locate(position, tail)
        limit = self.place_at(upto) if upto < tail.position else tail  # (a boundary, with its index)
        end = limit.position
        positions: list[int] = []
        records: list[bytes] = []
        total = 0
        place = start
        while place.position < end and total < max_bytes:
            try:
                block = self.index.read(place, limit, end, max(1, max_bytes - total))
            except PositionError as exc:
                num = segments.file_of(place.position)
                if exc.code != "POSITION_GONE" or num >= segments.write_file_num:
                    raise
                # a segment a power loss took the name of: its records are lost, a gap (as channels skip it)
                log.error("TOPIC(%s): %s is missing, reading on from the next segment", self.name,
                          segments.file_name(num))
                place = Place(segments.start_of(num + 1), segments.index_of_file(num + 1))
                continue
            starts = block.starts
            data = block.data
            for i in range(len(block)):
                positions.append(block.position + starts[i])
                records.append(bytes(data[starts[i] + 4:starts[i + 1]]))
            total += block.size
            if block.next <= place.position:
                break
            place = Place(block.next, block.next_index)
        if place.position > start.position:
            if len(self._raw_ends) >= _RAW_ENDS:
                self._raw_ends.clear()
            self._raw_ends[place.position] = place.index
        return positions, records

    def deadlines_for(self, first: int, end: int) -> list[tuple[int, float]]:
        """(position, unix deadline) of the deferred records in [first, end), across segments (what
        read_raw returned: the leader sends these with them)."""
        segments = self.segments
        out: list[tuple[int, float]] = []
        num = max(segments.file_of(first), segments.first_file)
        while num <= segments.write_file_num and segments.start_of(num) < end:
            lo = max(first, segments.start_of(num))
            hi = min(end, segments.start_of(num + 1)) if num < segments.write_file_num else end
            if lo < hi:
                out.extend(self.deadlines_between(lo, hi))
            num += 1
        return out

    def served_end(self) -> Place:
        """How far positional readers (/log/read) are served: the durable tail, or, for a replicated topic,
        no further than its high watermark."""
        end = self.durable_tail
        hwm = self.high_watermark
        if hwm is None or hwm >= end.position:
            return end
        try:
            return self.place_at(hwm)
        except (OSError, ValueError) as exc:
            log.error("TOPIC(%s): cannot find where the records before %d end - %s", self.name, hwm, exc)
            return Place(self.segments.start, self.segments.start_index())

    # --- cutting back (a replica following its leader) -----------------------------------------

    async def truncate(self, position: int) -> None:
        """truncate_to(position) once no sync round is at work (one is run first: its own cannot
        interleave). What a replica awaits."""
        await self._between_rounds()
        self.truncate_to(position)

    async def reset(self, start: int, log_id: str) -> None:
        """reset_to(start, log_id) once no sync round is at work (as truncate)."""
        await self._between_rounds()
        self.reset_to(start, log_id)

    async def _between_rounds(self) -> None:
        """Returns when no round is in flight: a round, awaited to its end; the caller goes on without a
        checkpoint, so none starts before it is done."""
        try:
            await self.group.sync_round()
        except BackendError:
            pass  # logged; the cut back fsyncs what it needs itself

    def _check_between_rounds(self) -> None:
        if self._in_round:
            raise RuntimeError(f"TOPIC({self.name}): a sync round is in flight (await truncate() or reset())")
        if self._broken:
            raise BackendError(self._broken)

    def truncate_to(self, position: int) -> None:
        """Every record at or past `position` (a record boundary between the log's start and its tail, or
        the end of a segment's records) goes, durably on return: a crash at any point reopens the log as
        it was (before the metadata saying so is renamed into place) or cut at `position` (after; an open
        finishes the cut), never with a record past it nor without a record before it that was fsynced.
        Everything before `position` is fsynced too, and is the durable tail (unless a round failed).
        Channels' readers past it go back to their oldest unfinished record (or to `position`), their
        cursors persisted; what they hold in memory past it is their channel's to drop (Channel.seek).
        The next record is appended at `position` (or where append_at says). Synchronous (fsyncs in the
        event loop: a replica cuts back once per change of leader); no round may be in flight (RuntimeError:
        the caller awaits truncate() instead). Raises ValueError for a position that is not a boundary,
        BackendError when the disk fails (the log then takes no append until a restart)."""
        self._check_between_rounds()
        segments = self.segments
        tail = Place(segments.tail, segments.tail_index)
        if position == tail.position:
            return
        if position > tail.position:
            raise ValueError(f"{position} is past the end of the log ({tail.position})")
        place = self.index.locate(position, tail)  # PositionError (a ValueError) if not a boundary
        num = segments.file_of(position)
        offset = position - segments.start_of(num)
        self._sync_now()
        segments.truncated_to(num, offset, place.index)
        if self.dispatched.position > position:
            self.dispatched = place
        self.publish_deadlines.drop_from(position)
        for old in [n for n in self._deadline_fds if n >= num]:
            close_quietly(self._deadline_fds.pop(old))
        for old in [n for n in self._first_stamps if n >= num]:
            del self._first_stamps[old]
        self.index.truncated(position)
        self._raw_ends.clear()
        changed = [reader for reader in self.readers if reader.truncated(place)]
        log.info("TOPIC(%s): log cut back to %d (it ended at %d)", self.name, position, tail.position)
        self._cut_back(place, num, [reader for reader in changed if reader in self.durable], "cut back")

    def reset_to(self, start: int, log_id: str) -> None:
        """The log becomes empty, its next record at position `start`, its id `log_id` (16 hex digits:
        its leader's), durably on return (a crash reopens it as it was or reset); every channel's reader
        starts at `start`, nothing finished (their cursors persisted). Synchronous, no round in flight
        (as truncate_to; the caller awaits reset()). Raises ValueError for a bad start or id, BackendError
        when the disk fails."""
        self._check_between_rounds()
        try:
            epoch = int(log_id, 16)
        except ValueError:
            raise ValueError(f"not a log id: {log_id!r}") from None
        if len(log_id) != 16:
            raise ValueError(f"not a log id: {log_id!r}")
        segments = self.segments
        old_first, old_write = segments.first_file, segments.write_file_num
        num = segments.reset_to(start, epoch)  # ValueError before anything changes
        place = Place(start, 0)
        self.dispatched = place
        self.publish_deadlines.drop_from(0)
        for fd in self._deadline_fds.values():
            close_quietly(fd)
        self._deadline_fds.clear()
        self._deadline_unsynced.clear()
        self._first_stamps.clear()
        self._index = None
        self._raw_ends.clear()
        for reader in self.readers:
            reader.cursor.epoch = epoch
            reader.reset(start, 0)
        log.info("TOPIC(%s): log reset to start at %d with log id %s (segments %d to %d dropped)", self.name,
                 start, log_id, old_first, old_write)
        self._cut_back(place, num, list(self.durable), "reset")

    def _sync_now(self) -> None:
        """What a round would fsync (segments, side files, deadlines) fsynced now, with the directory: a
        metadata saying the log ends at a position is written only once everything before it is durable."""
        segments = self.segments
        paths = segments.take_unsynced()
        deadlines = sorted(self._deadline_unsynced)
        try:
            for path in paths:
                fsync_file(path)
            for num in deadlines:
                fsync_file(self.deadline_file_name(num))
            fsync_dir(self.data_path)
        except OSError as exc:
            segments.unsynced_again(paths)
            self._suspect = True
            log.error("TOPIC(%s): failed to fsync before cutting its log back - %s", self.name, exc)
            self.group.wrote(0, f"failed to sync disk queue {self.name} - {exc}")
            raise BackendError(f"failed to sync disk queue {self.name} - {exc}") from None
        self._deadline_unsynced.clear()

    def _cut_back(self, place: Place, num: int, readers: list[LogReader], what: str) -> None:
        """The files follow the log cut back (or reset) in memory to `place` in segment num: a metadata
        saying so with CUT_KEY (the commit: an open from then on cuts the files itself), the files cut
        and removed, the deadlines cut, the readers' cursors written, then the metadata without the line."""
        try:
            self._write_meta(cut=True)
            self.segments.cut_files(num, place.position - self.segments.start_of(num))
            self._cut_deadlines(num, place.position, self._deadline_files())
            for reader in readers:
                reader.persist_now()
            fsync_dir(self.data_path)
            self._write_meta(cut=False)
        except OSError as exc:
            self._suspect = True
            self._broken = f"failed to {what} the log of {self.name} - {exc} (restart the broker)"
            log.error("TOPIC(%s): %s", self.name, self._broken)
            self.group.wrote(0, self._broken)
            raise BackendError(self._broken) from None
        if self._suspect:
            if self.durable_tail.position > place.position:
                self.durable_tail = self._round_tail = place
        else:
            self.durable_tail = self._round_tail = place

    def _cut_deadlines(self, num: int, position: int, files: list[int]) -> None:
        """Deadline files past segment num (and before the first segment kept: a reset) removed, segment
        num's cut before `position`, durably (an entry left would defer the record written at its position
        later). Raises OSError."""
        changed = False
        first = self.segments.first_file
        for n in files:
            if n > num or n < first:
                fd = self._deadline_fds.pop(n, None)
                close_quietly(fd)
                failed = remove_quietly(self.deadline_file_name(n))
                if failed is not None:
                    raise failed
                changed = True
        if num in files:
            path = self.deadline_file_name(num)
            try:
                with open(path, "rb") as fh:
                    data = fh.read()
            except FileNotFoundError:
                data = b""
            kept = 0
            usable = len(data) - len(data) % _DEADLINE.size
            for pos, _, _ in _DEADLINE.iter_unpack(data[:usable]):
                if pos >= position:
                    break
                kept += _DEADLINE.size
            if kept < len(data):
                os.truncate(path, kept)
                fsync_file(path)
        if changed:
            fsync_dir(self.data_path)

    def _write_meta(self, *, cut: bool) -> None:
        """The metadata replaced now (temp file fsynced, renamed, the directory fsynced). Raises OSError."""
        data, dispatched = self._meta_content([f"{CUT_KEY} 1"] if cut else [])
        path = self.segments.meta_file_name()
        tmp = f"{path}.{random.getrandbits(63)}.tmp"
        try:
            write_synced(tmp, data)
            with self.group.files_lock:
                os.rename(tmp, path)
        except OSError:
            remove_quietly(tmp)
            raise
        fsync_dir(self.data_path)
        self.segments.take_files_changed()
        self.epoch_on_disk = True
        self.positional_on_disk = self.positional_on_disk or self.positional
        self._meta_at = self.group.clock()
        self._meta_dispatched = dispatched

    def empty(self) -> None:
        """Drop what is not handed to a channel yet (nsqd's topic empty); a replicated topic's only up to its
        high watermark (what is past it may still be cut by a new leader: no channel may have it)."""
        self.dispatch(self.high_watermark)
        self.group.changed()

    # --- readers ------------------------------------------------------------------------------

    def reader_for(self, name: str, *, durable: bool, names: list[str] | None = None) -> LogReader:
        """A channel's reader of this log: a durable channel's cursor persists in `<name>.cursor.dat` (a
        new channel starts at what is not handed yet); an ephemeral one's starts there, in memory.
        `names`: the start-up listing's names of the channel's files (default: the topic's)."""
        reader = LogReader(self.segments, name, self.group if durable else None, start=self.dispatched,
                           publish_deadlines=self.publish_deadlines, clock=self.clock,
                           names=self._names if names is None else names)
        self.readers.append(reader)
        if durable:
            self.durable.append(reader)
        return reader

    def forget(self, reader: LogReader) -> None:
        """A channel's reader is gone (the channel deleted): it no longer holds segments."""
        if reader in self.readers:
            self.readers.remove(reader)
        if reader in self.durable:
            self.durable.remove(reader)
        self.idle.discard(reader)
        self.group.changed()

    def seek_position(self, to: str | int) -> Place:
        """Where a seek goes: "earliest" (the first record kept), "latest" (past the last handed to the
        channels), or a time (unix nanoseconds): the first record published at or after it. Raises
        SeekError for a time before the first record kept (what was there is gone)."""
        segments = self.segments
        if to == "earliest":
            return Place(segments.start, segments.start_index())
        if to == "latest":
            return self.dispatched
        assert isinstance(to, int)
        first = self._first_record(segments.first_file)
        if first is not None and to < first[2] and segments.first_file > 0:
            raise SeekError("time is before the first message retained")
        # the last segment whose first record is at or before `to`, then record by record
        firsts = [(num, first[2]) for num in segments.segments() if (first := self._first_record(num)) is not None]
        at = max(0, bisect.bisect_right([stamp for _, stamp in firsts], to) - 1)
        for num, _ in firsts[at:]:
            found = self._scan_for_time(num, to)
            if found is not None:
                return found
        return self.dispatched

    def _first_record(self, num: int) -> tuple[int, int, int] | None:
        """(position, index, timestamp) of segment num's first record, if it has one."""
        segments = self.segments
        if num == segments.write_file_num and segments.write_pos == 0:
            return None
        pos = segments.start_of(num)
        try:
            data = segments.read_at(pos)
        except (OSError, ValueError):
            return None
        return pos, segments.index_of_file(num), MESSAGE_HEADER.unpack_from(data)[0]

    def _first_timestamp(self, num: int) -> int | None:
        """The publish time (unix ns) of segment num's first record (cached: records never change)."""
        if num in self._first_stamps:
            return self._first_stamps[num]
        first = self._first_record(num)
        stamp = None if first is None else int(first[2])
        if first is not None or num != self.segments.write_file_num:
            self._first_stamps[num] = stamp
        return stamp

    def _scan_for_time(self, num: int, to: int) -> Place | None:
        segments = self.segments
        reader = segments.reader(segments.start_of(num), segments.index_of_file(num))
        end = min(self.dispatched.position, segments.start_of(num + 1))
        try:
            while True:
                positions: list[int] = []
                index = reader.index
                records = reader.read(4096, end, positions)
                if not records:
                    return None
                for i, data in enumerate(records):
                    if MESSAGE_HEADER.unpack_from(data)[0] >= to:
                        return Place(positions[i], index + i)
        finally:
            reader.close()

    def reload_deadlines(self, start: int) -> None:
        """A reader went back to `start` (a seek): deadlines still ahead there count again."""
        self._load_deadlines(start, self._deadline_files())

    # --- positional readers (the HTTP log API) ------------------------------------------------

    @property
    def log_id(self) -> str:
        """The log's identity: its epoch, made when the log was created (a topic created again, or a
        data directory replaced, has another)."""
        return f"{self.segments.epoch:016x}"

    @property
    def index(self) -> LogIndex:
        if self._index is None:
            self._index = LogIndex(self.segments)
        return self._index

    def mark_positional(self) -> None:
        """A positional reader came: the metadata says so from the next round on (the topic writes every
        message here from now)."""
        if not self.positional:
            self.positional = True
            self._meta_at = -META_INTERVAL
            self.group.request_round()

    def request_meta(self) -> None:
        """The metadata is written by the next round (the log id goes to disk)."""
        self._meta_at = -META_INTERVAL
        self.group.request_round()

    def first_stamp(self, num: int) -> int | None:
        return self._first_timestamp(num)

    def deadlines_between(self, first: int, end: int) -> list[tuple[int, float]]:
        """(position, unix deadline) of the deferred records in [first, end) of one segment, from its
        deadline file (entries in position order: found by bisection, a few preads)."""
        num = self.segments.file_of(first)
        try:
            fd = os.open(self.deadline_file_name(num), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return []
        size = _DEADLINE.size
        try:
            count = os.fstat(fd).st_size // size

            def position(i: int) -> int:
                return int(_DEADLINE.unpack(os.pread(fd, size, i * size))[0])

            lo, hi = 0, count
            while lo < hi:  # the first entry at or past `first`
                mid = (lo + hi) // 2
                if position(mid) < first:
                    lo = mid + 1
                else:
                    hi = mid
            out: list[tuple[int, float]] = []
            at = lo
            while at < count:
                data = os.pread(fd, size * min(4096, count - at), at * size)
                for pos, deadline, _ in _DEADLINE.iter_unpack(data[:len(data) - len(data) % size]):
                    if pos >= end:
                        return out
                    out.append((pos, deadline))
                at += 4096
            return out
        finally:
            close_quietly(fd)

    # --- what /stats says ---------------------------------------------------------------------

    def first_position(self) -> int:
        return self.segments.start

    def end_position(self) -> int:
        return self.segments.tail

    def bytes(self) -> int:
        return self.segments.segment_bytes()

    def oldest_timestamp(self, pos: int) -> int | None:
        """The publish time (unix ns) of the record at `pos`, if it can be read."""
        if pos >= self.segments.tail:
            return None
        try:
            return int(MESSAGE_HEADER.unpack_from(self.segments.read_at(pos))[0])
        except (OSError, ValueError):
            return None

    # --- persistence (SyncGroup member) -------------------------------------------------------

    def pinning(self, readers: list[LogReader]) -> list[LogReader]:
        """`readers` less the idle cursors: those whose position keeps the log."""
        return [reader for reader in readers if reader not in self.idle] if self.idle else readers

    def needed(self) -> int:
        """The oldest position any channel, or a channel created now, may still read."""
        pos = self.dispatched.position
        for reader in self.pinning(self.readers):
            mark = reader.mark_delete()
            if mark < pos:
                pos = mark
        return pos

    def prepare(self, plan: RoundPlan) -> None:
        if self.deleted:
            return
        self._in_round = True
        segments = self.segments
        self._taken = segments.take_unsynced()
        self._round_tail = Place(segments.tail, segments.tail_index)
        plan.fsync.extend(self._taken)
        for num in sorted(self._deadline_unsynced):
            plan.fsync.append(self.deadline_file_name(num))
        self._deadline_unsynced.clear()
        needed = self.needed()
        keep = self._retained(segments.file_of(needed))
        if keep > segments.first_file:
            for num in range(segments.first_file, keep):
                fd = self._deadline_fds.pop(num, None)
                close_quietly(fd)
                self._first_stamps.pop(num, None)
                self._removing.append((self.deadline_file_name(num), False, self.name))
            self._removing.extend((path, bad, self.name) for path, bad in segments.drop_before(keep))
        plan.removes.extend(self._removing)
        if len(self.publish_deadlines):
            # entries every reader has read (a restart reads them from the files again)
            oldest = min((reader.cursor.read_pos for reader in self.pinning(self.readers)),
                         default=self.dispatched.position)
            self.publish_deadlines.prune_before(min(oldest, self.dispatched.position))
        files_changed = segments.take_files_changed()
        plan.new_names = plan.new_names or files_changed or bool(self._deadline_created)
        self._deadline_created.clear()
        dispatched = self._dispatched_line()
        if not (files_changed or plan.final or dispatched != self._meta_dispatched
                or plan.now - self._meta_at >= META_INTERVAL):
            return
        self._meta_at = plan.now
        self._meta_dispatched = dispatched
        self._meta_in_round = True
        self._positional_in_round = self.positional
        plan.replaces.append((self, segments.meta_file_name(), self._meta_content()[0]))

    def _dispatched_line(self) -> str:
        """How far the log is handed, as the metadata says it ("all": to the end; a replicated topic's
        always by position: records recovered past it at open wait for the high watermark)."""
        at = self.dispatched
        if at.position == self.segments.tail and self.high_watermark is None:
            return "all"
        return f"{at.position} {at.index}"

    def _meta_content(self, extra: Sequence[str] = ()) -> tuple[builtins.bytes, str]:
        """The metadata file's bytes (and its dispatched line)."""
        segments = self.segments
        dispatched = self._dispatched_line()
        # Go's read position: the oldest record a durable channel has not finished
        go_pos, go_index = self.dispatched.position, self.dispatched.index
        for reader in self.pinning(self.durable):
            mark = reader.mark_delete()
            if mark < go_pos:
                go_pos, go_index = mark, reader.cursor.mark_index()
        lines = [f"dispatched {dispatched}"]
        if self.positional:
            lines.append("positional 1")
        lines.extend(extra)
        return segments.meta_bytes(go_pos, go_index, lines), dispatched

    def _retained(self, needed_file: int) -> int:
        """The first segment to keep: every one before `needed_file` may go, unless retention keeps it."""
        segments = self.segments
        keep = min(needed_file, segments.write_file_num)
        if not (self.retention_time or self.retention_bytes):
            return max(keep, segments.first_file)
        cutoff = int((self.clock() - self.retention_time) * 1e9)
        total = segments.segment_bytes()
        first = segments.first_file
        while first < keep:
            size = segments.segment_size(first)
            # every record of a segment was published before the next one's first record
            newer = self._first_timestamp(first + 1) if self.retention_time > 0 else None
            old = newer is not None and newer < cutoff
            big = self.retention_bytes > 0 and total - size >= self.retention_bytes
            if not (old or big):
                break
            total -= size
            first += 1
        return first

    def finished(self, plan: RoundPlan, ok: bool) -> None:
        self._in_round = False
        if ok:
            self._removing = []
            if self._meta_in_round:
                self.epoch_on_disk = True
                self.positional_on_disk = self.positional_on_disk or self._positional_in_round
            if not self._suspect:
                self.durable_tail = self._round_tail
        else:
            if not self._suspect:
                log.error("TOPIC(%s): a sync round failed: positions past %d are not served until a restart",
                          self.name, self.durable_tail.position)
            self._suspect = True
            self.segments.unsynced_again(self._taken)
            self._meta_at = -META_INTERVAL  # written again next round
            self._meta_dispatched = ""
            self.segments.files_changed_again()
        self._taken = []
        self._meta_in_round = False

    # --- end ----------------------------------------------------------------------------------

    def close(self) -> None:
        for fd in self._deadline_fds.values():
            close_quietly(fd)
        self._deadline_fds.clear()
        for reader in list(self.readers):
            reader.close()
        self.segments.close()
        if self in self.group.members:
            self.group.members.remove(self)

    def delete(self) -> None:
        """Every file of the topic's log, now (nsqd removes them before it answers)."""
        with self.group.files_lock:
            self.deleted = True
            self.close()
            self.segments.remove_files()
            for num in self._deadline_files():
                remove_quietly(self.deadline_file_name(num))


__all__ = ["BackendError", "SeekError", "TopicLog"]
