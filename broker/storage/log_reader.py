"""LogReader: a channel's place in one log, and what persists it.

A durable channel reads its topic's log through one LogReader, and, when it has one, its own queue (the
go-diskqueue files `<topic>:<channel>.diskqueue.*`: what was in the channel's memory at a clean exit,
records moved out of the way of the topic's log, a queue Go nsqd wrote) through another. A LogReader
holds a SegmentReader (where reading is), a Cursor (what is finished or held) and the cursor's file
`<name>.cursor.dat`, which every sync round appends the cursor's changes to and now and then replaces
with a snapshot. An ephemeral channel's reader keeps its cursor in memory only.

It hands out records (bytes) with their positions, never messages: the channel decodes them
(`Batch`). A position it hands out carries its `tag` (the channel tells its two readers apart by it).

Who calls it: the Channel's storage (read, finish, hold, reset, depth); the topic's SyncGroup (prepare,
finished).
"""

from __future__ import annotations

import logging
import os
import random
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence

from trio_nsq.broker.storage.cursor import Cursor, CursorFileError
from trio_nsq.broker.storage.deadlines import PublishDeadlines
from trio_nsq.broker.storage.deferred_index import DeferredIndex
from trio_nsq.broker.storage.files import remove_quietly, write_synced
from trio_nsq.broker.storage.segment_log import Place, SegmentLog, list_dir, temp_files
from trio_nsq.broker.storage.sync_group import META_INTERVAL, RoundPlan, SyncGroup
from trio_nsq.shared.protocol import MESSAGE_HEADER

log = logging.getLogger("nsqd")

# deferred records one read() puts in its DeferredIndex at most: a run of a million is read in turns
# of the event loop (~20 ms each compiled; 65,536 took 76-96 ms), not in one
DEFERRED_PER_READ = 16384


class Batch:
    """Records a LogReader handed out, in log order, with their positions (tag included); `states` has,
    for a record that comes back with attempts of its own (held) or a delay still ahead (deferred, read
    without an index to put it in), its place in `records` -> (attempts or -1, seconds left or 0)."""

    __slots__ = ("records", "positions", "states")

    def __init__(self) -> None:
        self.records: list[bytes] = []
        self.positions: list[int] = []
        self.states: dict[int, tuple[int, float]] = {}

    def __len__(self) -> int:
        return len(self.records)


class LogReader:
    def __init__(
        self,
        segments: SegmentLog,
        name: str,
        group: SyncGroup | None,
        *,
        start: Place,
        tag: int = 0,
        publish_deadlines: PublishDeadlines | None = None,
        owns_log: bool = False,
        clock: Callable[[], float] = time.time,
        names: Sequence[str] | None = None,
    ) -> None:
        """`name`: the cursor file's stem (`topic:channel`), None-like when `group` is None (an ephemeral
        channel: nothing persisted). `start`: (position, index) where a reader with no cursor file starts.
        `tag` is or-ed into the positions of the messages it returns (a channel tells its two readers
        apart by it). `owns_log`: the segments are this reader's alone (a channel's own queue), so it also
        persists their metadata and drops what it has finished. `names`: the data directory's names for
        this topic, when the caller has them (temp files a crash left are looked for there; else the
        directory is listed)."""
        self.segments = segments
        self.name = name
        self.group = group
        self.tag = tag
        self.publish_deadlines = publish_deadlines
        self.owns_log = owns_log
        self.clock = clock
        self.deleted = False
        self.dropped = 0  # records an ephemeral reader skipped because it fell too far behind
        self.deferred_per_read = DEFERRED_PER_READ
        self.more = False  # the last read() stopped at deferred_per_read: there is more to read
        self._snapshot_due = True  # no file of ours yet (or one that is not ours): write it whole
        self._taken: list[str] = []  # segments a round fsyncs, again if it fails
        self._removing: list[tuple[str, bool, str]] = []
        self._meta_at = -META_INTERVAL  # an own log's metadata: when last written (a round's monotonic time)
        self._timestamp_of: tuple[int, int | None] = (-1, None)
        self._names = names
        self.cursor = self._load(start)
        # its cursor file is on disk: what the log holds past it is found again after a kill -9 (a
        # reader made since the last round would start at the log's end)
        self.on_disk = not self._snapshot_due
        self.segment_reader = segments.reader(self.cursor.read_pos, self.cursor.read_index)
        if group is not None:
            group.members.append(self)
            if owns_log and segments.recovered:
                group.request_round()  # records a kill -9 may have left in the page cache only

    def __repr__(self) -> str:
        return f"LogReader({self.name})"

    def cursor_file_name(self) -> str:
        return os.path.join(self.segments.data_path, f"{self.name}.cursor.dat")

    def _load(self, start: Place) -> Cursor:
        fresh = Cursor(start.position, start.index, self.segments.epoch)
        if self.group is None:
            return fresh
        path = self.cursor_file_name()
        self._remove_temp_files(path, self._names)
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return fresh
        except OSError as exc:
            log.error("CURSOR(%s) cannot read %s, starting at %d - %s", self.name, path, start.position, exc)
            return fresh
        try:
            cursor, sound = Cursor.load(data, self.segments.epoch)
        except CursorFileError as exc:
            # the log's files were rewritten by another program (Go nsqd ran on this directory): what it
            # delivered meanwhile is past `start`, what it did not is in the channel's own queue
            log.warning("CURSOR(%s) %s is not for these files (%s): starting at %d", self.name, path, exc,
                        start.position)
            return fresh
        if sound < len(data):
            log.warning("CURSOR(%s) cutting %d bytes of a torn block off the end of %s", self.name, len(data) - sound, path)
        else:
            self._snapshot_due = False
        segments = self.segments
        if cursor.read_pos < segments.start:
            log.warning("CURSOR(%s) its position %d is before the log's start %d: starting there",
                        self.name, cursor.read_pos, segments.start)
            cursor.reset(segments.start, segments.start_index())
            self._snapshot_due = True  # the file's ranges are of positions no longer there
        elif cursor.read_pos > segments.tail:
            # the log lost files under it (its directory damaged): what comes next must not be skipped
            log.error("CURSOR(%s) its position %d is past the log's end %d (files lost?): starting there",
                      self.name, cursor.read_pos, segments.tail)
            cursor.reset(segments.tail, segments.tail_index)
            self._snapshot_due = True  # else the file's old ranges would skip records written there later
        elif cursor.forget_from(segments.tail, self._count_records):
            log.error("CURSOR(%s) finished or held records past the log's end %d (files cut?): forgotten",
                      self.name, segments.tail)
            self._snapshot_due = True
        return cursor

    def _count_records(self, first: int, end: int) -> int:
        """Records at positions in [first, end) (`first` need not be where a record starts)."""
        segments = self.segments
        num = max(segments.file_of(first), segments.first_file)
        reader = segments.reader(segments.start_of(num), segments.index_of_file(num))
        count = 0
        try:
            while True:
                positions: list[int] = []
                if not reader.read(4096, end, positions):
                    break
                count += sum(1 for pos in positions if pos >= first)
        finally:
            reader.close()
        return count

    @staticmethod
    def _remove_temp_files(path: str, names: Sequence[str] | None) -> None:
        """A crash during a snapshot's write leaves `<file>.<random>.tmp`: never read, so removed."""
        folder, name = os.path.split(path)
        if names is None:
            names = list_dir(folder or ".")
        for entry in temp_files(names, name):
            remove_quietly(os.path.join(folder, entry))

    # --- reading ------------------------------------------------------------------------------

    def depth(self, end_index: int) -> int:
        """Records not read yet up to the record with index `end_index` (the end of what it may read)."""
        return max(0, end_index - self.cursor.read_index - self.cursor.hidden())

    def deferred_ahead(self, end: int) -> int:
        """Records not read yet before position `end` that are deferred publishes (counted deferred, not
        queued, as nsqd counts them once its topic handed them to the channel)."""
        if self.publish_deadlines is None or not len(self.publish_deadlines):
            return 0
        return self.publish_deadlines.count_between(self.cursor.read_pos, end)

    def read(self, limit: int, upto: int, later: DeferredIndex | None = None, batch: Batch | None = None) -> Batch:
        """Records before position `upto` into `batch` (a new one if None) until it holds `limit`: skips
        what was finished before a restart, gives a held record its attempts. A record with a deadline
        still ahead (a deferred publish, a held one) goes to `later` as its position and deadline (the
        channel reads it back when it is due); without `later` it comes with its seconds left. It stops
        once deferred_per_read records went to `later` (`more` says so: the caller reads on later)."""
        cursor = self.cursor
        reader = self.segment_reader
        if batch is None:
            batch = Batch()
        out = batch.records
        out_pos = batch.positions
        tag = self.tag
        ahead = 0  # after a batch that went to `later`: read this many at least, and give back the surplus
        budget = self.deferred_per_read
        self.more = False
        while len(out) < limit:
            if budget <= 0:
                self.more = True
                break
            want = limit - len(out)
            size = ahead if ahead > want else want
            start_index = reader.index
            positions: list[int] = []
            records = reader.read(size, upto, positions)
            if not records:
                break
            skipping = cursor.hidden() > 0
            held = cursor.held
            # the deferred publishes among these records: walked beside them (both in position order)
            deferred = self.publish_deadlines
            at = end = 0
            if deferred is not None and len(deferred):
                at = bisect_left(deferred.positions, positions[0])
                end = bisect_left(deferred.positions, positions[-1] + 1)
            if not held and at == end and size == want and not skipping:
                # nothing held, deferred or finished among them: the plain path
                cursor.handed(positions, start_index, reader.position, reader.index)
                out.extend(records)
                out_pos.extend([pos | tag for pos in positions] if tag else positions)
                continue
            deferring = self._read_slow(batch, limit, records, positions, start_index, skipping, at, end, later)
            # a run of deferred records is read in batches that double (up to 4,096), whatever `limit` is
            ahead = min(2 * size, 4096, budget) if deferring else 0
            budget -= deferring
        return batch

    def _read_slow(self, batch: Batch, limit: int, records: list[bytes], positions: list[int], start_index: int,
                   skipping: bool, at: int, end: int, later: DeferredIndex | None) -> int:
        """read()'s records where some were finished before a restart, are held, or are deferred
        publishes (deadlines[at:end] are among them); those read ahead and not needed are given back.
        How many went to `later`."""
        cursor = self.cursor
        held = cursor.held
        deferred = self.publish_deadlines
        tag = self.tag
        out = batch.records
        now = self.clock()
        shift = later.clock() - now if later is not None else 0.0  # to the index's clock
        used = len(records)
        deferring = 0
        skipped: list[int] = []
        for i in range(len(records)):
            if len(out) >= limit:
                used = i  # read ahead and not needed: given back below
                break
            pos = positions[i]
            if skipping and cursor.skip(pos):
                skipped.append(i)
                continue
            attempts = -1
            deadline = 0.0
            if held:
                state = held.get(pos)
                if state is not None:
                    attempts, deadline = state
            if at < end:
                assert deferred is not None
                while at < end and deferred.positions[at] < pos:
                    at += 1
                if at < end and deferred.positions[at] == pos and deferred.deadlines[at] > deadline:
                    deadline = deferred.deadlines[at]
            if deadline > now and later is not None:
                later.add(deadline + shift, pos | tag)
                deferring += 1
                continue
            if attempts >= 0 or deadline > now:
                batch.states[len(out)] = (attempts, deadline - now if deadline > now else 0.0)
            out.append(records[i])
            batch.positions.append(pos | tag)
        if used < len(records):
            # the reader goes back to the first not needed (indices run on within one read)
            self.segment_reader.rewind(positions[used], start_index + used)
            del positions[used:]
        cursor.handed(positions, start_index, self.segment_reader.position, self.segment_reader.index,
                      skipped or None)
        return deferring

    def read_back(self, positions: list[int], batch: Batch | None = None) -> Batch:
        """The records at `positions` (this reader's, tag included) read again, into `batch` (a new one if
        None): deferred records that are due (DeferredIndex). A held one gets its attempts; one that cannot
        be read is logged and finished."""
        if batch is None:
            batch = Batch()
        if not positions:
            return batch
        held = self.cursor.held
        tag = self.tag
        fetcher = self.segments.reader(positions[0] & ~tag, 0)
        bad: list[int] = []
        try:
            for pos in positions:
                at = pos & ~tag
                try:
                    data = fetcher.fetch(at)
                except (OSError, ValueError) as exc:
                    log.error("CURSOR(%s): failed to read deferred message at %d - %s", self.name, at, exc)
                    bad.append(pos)
                    continue
                if held:
                    state = held.get(at)
                    if state is not None:
                        batch.states[len(batch.records)] = (state[0], 0.0)
                batch.records.append(data)
                batch.positions.append(pos)
        finally:
            fetcher.close()
        if bad:
            self.finish_many(bad)
        return batch

    def peek(self, limit: int, upto: int) -> Batch:
        """Up to `limit` of the records not read yet before position `upto` that would be queued once read
        (not finished before a restart, no deadline ahead), with their attempts: a look that moves
        nothing (/channel/messages), through a SegmentReader of its own. At most 4 x limit + 64 records
        are read, so where more than that are skipped fewer are returned. (A bad record it meets cuts
        its file as the reader would on getting there: SegmentReader.read.)"""
        batch = Batch()
        if limit <= 0:
            return batch
        cursor = self.cursor
        held = cursor.held
        deferred = self.publish_deadlines if self.publish_deadlines is not None and len(self.publish_deadlines) else None
        now = self.clock()
        budget = 4 * limit + 64
        reader = self.segments.reader(self.segment_reader.position, self.segment_reader.index)
        try:
            while len(batch) < limit and budget > 0:
                positions: list[int] = []
                records = reader.read(min(budget, limit - len(batch)), upto, positions)
                if not records:
                    break
                budget -= len(records)
                for data, pos in zip(records, positions):
                    if cursor.finished_ahead(pos):
                        continue
                    state = held.get(pos) if held else None
                    if state is not None and state[1] > now:
                        continue  # deferred when read
                    if deferred is not None and deferred.deadline_at(pos) > now:
                        continue  # a deferred publish still ahead
                    if state is not None:
                        batch.states[len(batch.records)] = (state[0], 0.0)
                    batch.records.append(data)
                    batch.positions.append(pos | self.tag)
        finally:
            reader.close()
        return batch

    def skip_to_lag(self, end_index: int, upto: int, max_lag: int) -> None:
        """An ephemeral reader more than max_lag records behind drops the oldest, as nsqd's ephemeral
        channel drops what its memory queue has no room for (counted in `dropped`)."""
        while (over := self.depth(end_index) - max_lag) > 0:
            batch = self.read(min(over, 4096), upto)
            if not batch:
                break
            self.dropped += len(batch)
            self.finish_many(batch.positions)

    # --- what the channel did -----------------------------------------------------------------

    def finish_many(self, positions: list[int]) -> None:
        """Positions this reader gave (tag included) are done with."""
        if self.tag:
            positions = [pos & ~self.tag for pos in positions]
        self.cursor.finish_many(positions)
        if self.group is not None:
            self.group.changed(len(positions))

    def hold(self, pos: int, attempts: int, deadline: float) -> None:
        """The message at `pos` was requeued (deadline 0) or deferred until `deadline` (unix seconds)."""
        self.cursor.hold(pos & ~self.tag, attempts, deadline)
        if self.group is not None:
            self.group.changed()

    def reset(self, pos: int, index: int) -> None:
        """Nothing before `pos` is wanted (an empty: the end of the log; a seek: anywhere in it)."""
        self.cursor.reset(pos, index)
        self.segment_reader.seek(pos, index)
        self._snapshot_due = True
        if self.group is not None:
            self.group.changed()

    def mark_delete(self) -> int:
        return self.cursor.mark_delete()

    def truncated(self, end: Place) -> bool:
        """Its log was cut back to `end` (TopicLog.truncate_to): nothing at or past it was read. A reader
        past it goes back to its oldest unfinished record, or to `end` (what it finished before comes
        again: at least once, never lost); holds and finished ranges past it go; the block read ahead is
        dropped (new records will be written there). Whether the cursor changed (its file must be
        written again before the log grows past `end`: persist_now)."""
        cursor = self.cursor
        if cursor.read_pos > end.position:
            mark = cursor.mark_delete()
            if mark < end.position:
                self.reset(mark, cursor.mark_index())
            else:
                self.reset(end.position, end.index)
            return True
        reader = self.segment_reader
        reader.seek(reader.position, reader.index)
        if cursor.forget_from(end.position, self._count_records):
            self._snapshot_due = True
            return True
        return self._snapshot_due

    def persist_now(self) -> None:
        """The cursor's file replaced by its snapshot now (temp file fsynced, renamed; the caller fsyncs
        the directory): TopicLog.truncate_to and reset_to, which no sync round runs beside. Raises OSError."""
        if self.group is None or self.deleted:
            return
        path = self.cursor_file_name()
        tmp = f"{path}.{random.getrandbits(63)}.tmp"
        try:
            write_synced(tmp, self.cursor.snapshot())
            with self.group.files_lock:
                os.rename(tmp, path)
        except OSError:
            remove_quietly(tmp)
            self._snapshot_due = True
            raise
        self._snapshot_due = False
        self.on_disk = True

    @property
    def file_num(self) -> int:
        """The segment reading is in."""
        return self.segment_reader.file_num

    def drained(self) -> bool:
        """Everything of its log is read and finished, nothing held."""
        return self.cursor.mark_delete() >= self.segments.tail and not self.cursor.held

    def timestamp_at(self, pos: int) -> int | None:
        """The publish time (unix ns) of the record at `pos` (cached: /stats asks for the mark's)."""
        if self._timestamp_of[0] == pos:
            return self._timestamp_of[1]
        try:
            timestamp: int | None = int(MESSAGE_HEADER.unpack_from(self.segments.read_at(pos))[0])
        except (OSError, ValueError):
            timestamp = None
        self._timestamp_of = (pos, timestamp)
        return timestamp

    # --- own queue ----------------------------------------------------------------------------

    def append(self, records: list[bytes], positions: list[int]) -> None:
        """Write to the reader's own log (owns_log): read after what is there already. Raises BackendError."""
        self.segments.append(records, positions)

    # --- persistence (SyncGroup member) -------------------------------------------------------

    def prepare(self, plan: RoundPlan) -> None:
        if self.deleted:
            return
        cursor = self.cursor
        if self._snapshot_due or cursor.wants_snapshot():
            # a first cursor file is a new name: made durable before the topic's metadata is replaced
            (plan.replaces if self.on_disk else plan.creates).append((self, self.cursor_file_name(), cursor.snapshot()))
            self._snapshot_due = False
        else:
            delta = cursor.take_delta()
            if delta:
                plan.appends.append((self, self.cursor_file_name(), delta))
        if self.owns_log:
            segments = self.segments
            self._taken = segments.take_unsynced()
            plan.fsync.extend(self._taken)
            mark = cursor.mark_delete()
            self._removing.extend((path, bad, segments.name)
                                  for path, bad in segments.drop_before(segments.file_of(mark)))
            plan.removes.extend(self._removing)
            changed = segments.take_files_changed()
            plan.new_names = plan.new_names or changed
            if changed or plan.final or plan.now - self._meta_at >= META_INTERVAL:
                self._meta_at = plan.now
                plan.replaces.append((self, segments.meta_file_name(), segments.meta_bytes(mark, cursor.mark_index())))

    def finished(self, plan: RoundPlan, ok: bool) -> None:
        if ok:
            self.on_disk = not self._snapshot_due
            self._removing = []
            self._taken = []
            return
        self.cursor.untake_delta()
        self._snapshot_due = True
        if self.owns_log:
            self.segments.unsynced_again(self._taken)
            self._meta_at = -META_INTERVAL

    def close(self) -> None:
        self.segment_reader.close()
        if self.owns_log:
            self.segments.close()
        if self.group is not None and self in self.group.members:
            self.group.members.remove(self)

    def delete(self) -> None:
        """Remove the cursor file (and the own log's files), now: a channel of the same name created next
        starts afresh."""
        self.segment_reader.close()
        lock = self.group.files_lock if self.group is not None else None
        if lock is not None:
            with lock:
                self.deleted = True
                self._remove_files()
        else:
            self.deleted = True
            self._remove_files()
        self.close()

    def _remove_files(self) -> None:
        for path in (self.cursor_file_name(),):
            failed = remove_quietly(path)
            if failed is not None:
                log.error("CURSOR(%s) failed to remove %s - %s", self.name, path, failed)
        if self.owns_log:
            self.segments.remove_files()
