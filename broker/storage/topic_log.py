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

Who calls it: Topic (append, dispatch, empty, delete), Channel (reader_for, seek_to), the HTTP API
(seek positions, /stats).
"""

from __future__ import annotations

import bisect
import logging
import os
import struct
import time
from collections.abc import Callable, Sequence

from trio_nsq.broker.storage.backend import BackendError
from trio_nsq.broker.storage.deadlines import PublishDeadlines
from trio_nsq.broker.storage.files import close_quietly, fsync_dir, fsync_file, remove_quietly
from trio_nsq.broker.storage.log_index import LogIndex
from trio_nsq.broker.storage.log_reader import LogReader
from trio_nsq.broker.storage.records import looks_like_message
from trio_nsq.broker.storage.segment_log import Place, SegmentLog, list_dir, numbered_files
from trio_nsq.broker.storage.sync_group import META_INTERVAL, RoundPlan, SyncGroup
from trio_nsq.shared.protocol import MESSAGE_HEADER

log = logging.getLogger("nsqd")

_DEADLINE = struct.Struct(">qd16s")


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
        deadline_files = numbered_files(names, f"{name}.diskqueue.deadlines")
        # the log does not end where the metadata said (records recovered, a torn tail cut, segments
        # given a start): a deadline entry may name a position its record no longer has
        changed = segments.tail != segments.synced_at_open.position
        self._load_deadlines(segments.start, deadline_files, check_ids=changed)
        if segments.recovered:
            self._deadline_unsynced.update(n for n in deadline_files if n >= segments.file_of(self.durable_tail.position))
            self._sync_recovered()
            group.request_round()
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

    def dispatch(self) -> None:
        """Everything appended so far is handed to the channels there are."""
        self.dispatched = Place(self.segments.tail, self.segments.tail_index)

    def undispatched(self) -> int:
        """Records not handed to any channel yet (a paused topic's, or one without channels)."""
        return self.segments.tail_index - self.dispatched.index

    def empty(self) -> None:
        """Drop what is not handed to a channel yet (nsqd's topic empty)."""
        self.dispatch()
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
        at = self.dispatched
        dispatched = "all" if at.position == segments.tail else f"{at.position} {at.index}"
        if not (files_changed or plan.final or dispatched != self._meta_dispatched
                or plan.now - self._meta_at >= META_INTERVAL):
            return
        self._meta_at = plan.now
        self._meta_dispatched = dispatched
        # Go's read position: the oldest record a durable channel has not finished
        go_pos, go_index = self.dispatched.position, self.dispatched.index
        for reader in self.pinning(self.durable):
            mark = reader.mark_delete()
            if mark < go_pos:
                go_pos, go_index = mark, reader.cursor.mark_index()
        extra = [f"dispatched {dispatched}"]
        if self.positional:
            extra.append("positional 1")
        self._meta_in_round = True
        self._positional_in_round = self.positional
        plan.replaces.append((self, segments.meta_file_name(), segments.meta_bytes(go_pos, go_index, extra)))

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
