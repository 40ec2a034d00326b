"""ChannelBackend: what a channel keeps on disk (nsqd's channel backend, its disk queue), as records.

A channel reads its topic's log through a LogReader (none for an ephemeral topic), and keeps a queue of its
own, `<topic>:<channel>.diskqueue.*` (another LogReader, over a SegmentLog it alone appends to), only for
what is in no log: what was in its memory at a clean exit, the overflow of a channel of an ephemeral
topic, a queue Go nsqd wrote, records moved out of the topic log's way (reclaim), re-driven dead letters.
The own queue is opened when its files are there or when something must go in, and goes, files and all,
once it holds nothing more. Positions in it carry OWN (bit 63, past every log position), so one position
says which log a record is in.

A record read with a deadline still ahead (a deferred publish, a record held with a delay before a
restart) is not handed out: its position goes to the DeferredIndex, and it is read back when due.

It knows records, positions, attempts and deadlines; the Channel above makes messages of them.

Who calls it: the Channel (read, finish, hold, store, empty, seek, flush, reclaim, depths); its Topic
makes it (the reader of the topic's log, and how to open the own queue).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from trio_nsq.broker.storage.backend import BackendError
from trio_nsq.broker.storage.deferred_index import DeferredIndex
from trio_nsq.broker.storage.log_reader import Batch, LogReader

log = logging.getLogger("nsqd")

# the tag of positions in a channel's own queue (every log position is below it)
OWN = 1 << 63
# reclaim copies records that pin the topic's log only when that frees this many times what it writes
RECLAIM_RATIO = 4
# pinning records reclaim looks at, reads and moves in one call (the rest in later calls): 1,024 read
# back, written and held take ~10 ms compiled (4,096, twice in one take, made event-loop steps of 100 ms+)
RECLAIM_CHUNK = 1024


class ChannelBackend:
    """Made by the Topic for each channel: `reader` (its place in the topic's log, or None) and
    `open_own(create)` (the channel's own queue when its files are there, or made when `create`; None for
    an ephemeral channel). `now` is the clock of the DeferredIndex's deadlines (trio's, as the channel's
    queues); `wall` the unix clock of the deadlines kept across a restart."""

    def __init__(self, name: str, reader: LogReader | None, open_own: Callable[[bool], LogReader | None],
                 *, ephemeral: bool, now: Callable[[], float], wall: Callable[[], float]) -> None:
        self.name = name
        self.reader = reader
        self._open_own = open_own
        self.ephemeral = ephemeral
        self.own: LogReader | None = open_own(False) if not ephemeral else None
        # deferred records read from the logs, by deadline: read back when due
        self.deferred_records = DeferredIndex(now)
        self.now = now
        self.wall = wall
        self.exiting = False
        self._read_file = -1  # the segment the topic's reader was in when reclaim last looked
        self.reclaim_wanted = False  # the channel calls reclaim() when it can say what it holds in memory

    def __repr__(self) -> str:
        return f"ChannelBackend({self.name})"

    # --- depths -------------------------------------------------------------------------------

    def depth(self, end_index: int, end: int) -> int:
        """Records waiting in the logs (the topic's up to index `end_index`, position `end`, and the own
        queue's), not read yet: deferred publishes among them are counted deferred (deferred_count), as
        nsqd counts them once handed to the channel."""
        depth = 0
        if self.reader is not None:
            depth += self.reader.depth(end_index) - self.reader.deferred_ahead(end)
        if self.own is not None:
            depth += self.own.depth(self.own.segments.tail_index)
        return depth

    def deferred_count(self, end: int) -> int:
        """Deferred records read (not due yet) and deferred publishes in the topic's log not read yet."""
        ahead = self.reader.deferred_ahead(end) if self.reader is not None else 0
        return len(self.deferred_records) + ahead

    def oldest_timestamps(self, end: int) -> list[int]:
        """The publish times (unix ns) of the records at the logs' mark-delete positions (the oldest not
        finished of each), where there are any."""
        found: list[int] = []
        for reader, upto in ((self.reader, end), (self.own, -1)):
            if reader is not None:
                mark = reader.mark_delete()
                if mark < (reader.segments.tail if upto < 0 else upto):
                    timestamp = reader.timestamp_at(mark)
                    if timestamp is not None:
                        found.append(timestamp)
        return found

    # --- reading ------------------------------------------------------------------------------

    def read(self, batch: Batch, limit: int, upto: int) -> bool:
        """Up to `limit` records into `batch`: deferred records now due (read back), the own queue's,
        then the topic log's up to position `upto`. True when a long run of deferred records stopped it
        (the rest is read in the event loop's next turn)."""
        index = self.deferred_records
        if index.ready_count() and len(batch) < limit:
            self._read_due(batch, index.take_ready(limit - len(batch)))
        reader = self.reader
        if reader is not None and not self.ephemeral:
            file_num = reader.file_num
            if file_num != self._read_file:
                # the reader moved to another segment: is an old record keeping two or more behind it?
                self._read_file = file_num
                if reader.segments.file_of(reader.mark_delete()) < file_num - 1:
                    self.reclaim_wanted = True
        for log_reader, end in ((self.own, -1), (reader, upto)):
            while log_reader is not None and len(batch) < limit:
                before = len(batch)
                log_reader.read(limit, log_reader.segments.tail if end < 0 else end, index, batch)
                if log_reader.more:
                    return True
                if len(batch) == before:
                    break
        return False

    def _read_due(self, batch: Batch, positions: list[int]) -> None:
        """Deferred records that are due, read back from their logs (own queue positions carry OWN)."""
        own = [pos for pos in positions if pos & OWN]
        if own:
            positions = [pos for pos in positions if not pos & OWN]
            self._reader_of(OWN).read_back(own, batch)
        if positions:
            self._reader_of(0).read_back(positions, batch)

    def _reader_of(self, pos: int) -> LogReader:
        reader = self.own if pos & OWN else self.reader
        assert reader is not None, pos
        return reader

    def keep_up(self, end_index: int, upto: int, max_lag: int) -> int:
        """An ephemeral channel's reader more than max_lag records behind drops the oldest (as nsqd's
        ephemeral channel drops what its memory queue has no room for); how many it dropped."""
        reader = self.reader
        if reader is None:
            return 0
        before = reader.dropped
        reader.skip_to_lag(end_index, upto, max_lag)
        return reader.dropped - before

    # --- what the channel did -----------------------------------------------------------------

    def finish(self, positions: list[int]) -> None:
        """Records handed out (positions from read/read_back) are done with."""
        own = self.own
        if own is not None and any(pos & OWN for pos in positions):
            own.finish_many([pos for pos in positions if pos & OWN])
            positions = [pos for pos in positions if not pos & OWN]
            self._drop_own_if_drained()
        if positions and self.reader is not None:
            self.reader.finish_many(positions)

    def hold(self, pos: int, attempts: int, deadline: float) -> None:
        """The record at `pos` was requeued (deadline 0) or deferred until `deadline` (unix seconds): a
        restart gives it back so."""
        self._reader_of(pos).hold(pos, attempts, deadline)

    def due(self, now: float) -> int:
        """Deferred records whose deadline passed are ready to be read back; how many the index took
        (made ready, or dropped as moved by reclaim): work done, call again while there is some."""
        return self.deferred_records.due(now) if len(self.deferred_records) else 0

    def store(self, records: list[bytes], holds: list[tuple[int, float]] | None = None) -> int:
        """Into the own queue (what no log holds: memory overflow, a flush at exit, re-driven dead letters),
        each with (attempts, deadline) from `holds` where given; how many of the first were stored (a
        failure is logged)."""
        own = self._own()
        if own is None:
            return 0
        positions: list[int] = []
        try:
            own.append(records, positions)
        except BackendError as exc:
            log.error("CHANNEL(%s): failed to store %d messages - %s", self.name, len(records) - exc.stored, exc)
        if holds is not None:
            for pos, (attempts, deadline) in zip(positions, holds):
                own.hold(pos | OWN, attempts, deadline)
        return len(positions)

    def _own(self) -> LogReader | None:
        if self.own is None and not self.ephemeral:
            self.own = self._open_own(True)
        return self.own

    def _drop_own_if_drained(self) -> None:
        """An own queue that holds nothing more goes, files and all (it is made again when needed): a
        channel does not keep a queue of its own for what was in its memory at one restart."""
        own = self.own
        if own is not None and own.drained():
            own.delete()
            self.own = None

    # --- reclaim ------------------------------------------------------------------------------

    def pinning(self) -> list[int]:
        """The oldest records of the topic's log read and not finished (up to RECLAIM_CHUNK) that keep two
        or more segments behind the reader: what reclaim would move; and one more, if there is one, which
        says how far moving them would free the log."""
        self.reclaim_wanted = False
        reader = self.reader
        if reader is None or self.ephemeral or self.exiting:
            return []
        segments = reader.segments
        cutoff = segments.start_of(reader.file_num)
        return reader.cursor.unfinished_before(cutoff, RECLAIM_CHUNK + 1)

    def reclaim(self, pinning: list[int], in_memory: dict[int, tuple[bytes, int, float]]) -> set[int]:
        """A few records deferred or requeued long ago keep the topic's log from being dropped behind them
        (a message deferred for an hour, a poison message requeued again and again): move the oldest of
        them (`pinning`, oldest first) to the own queue, held there with their attempts and deadline and
        read back from there, so the topic's log is free. The channel gives those it holds in memory
        (position -> record, attempts, deadline in unix seconds; 0: none); the others must be in the
        deferred index (due or not). Only the ones before the first that is neither (in flight: its
        timeout ends the wait) move, and only when that frees RECLAIM_RATIO times what it writes (judged
        first by the log's mean record size, before reading anything, then by the records read: each is
        read once). Returns the positions moved (the channel drops its copies)."""
        reader = self.reader
        if reader is None or not pinning:
            return set()
        more = len(pinning) > RECLAIM_CHUNK  # pinning()'s extra record: more pin the log past these
        pinning = pinning[:RECLAIM_CHUNK]
        index = self.deferred_records
        indexed = dict(index.entries_in(set(pinning))) if len(index) or index.ready_count() else {}
        movable: list[int] = []
        for pos in pinning:
            if pos not in in_memory and pos not in indexed:
                break
            movable.append(pos)
        if not movable:
            return set()
        segments = reader.segments
        stop = pinning[len(movable)] if len(movable) < len(pinning) else segments.start_of(reader.file_num)
        freed = segments.distance(movable[0], stop)
        if self._size_guess(movable, in_memory) * RECLAIM_RATIO > freed:
            return set()  # it would not pay
        if more and len(movable) == len(pinning):
            # the log is freed up to `stop` only once every record pinning it before there has moved: that
            # must pay too (records deferred all along the log would be copied, a chunk a call, for nothing)
            pins = reader.cursor.unfinished_count_before(stop)
            if pins * self._mean_size() * RECLAIM_RATIO > freed:
                return set()
        records, holds, moved = self._copies(reader, movable, in_memory, indexed)
        if not moved or sum(34 + len(record) for record in records) * RECLAIM_RATIO > freed:
            return set()
        stored = self.store(records, holds)
        done = set(moved[:stored])
        if done:
            index.remove(done)
            log.info("CHANNEL(%s): moved %d deferred or requeued messages to its own queue to free the topic's log",
                     self.name, len(done))
            reader.finish_many(sorted(done))
        if more and stored == len(moved):
            self._read_file = -1  # more may pin: look again at the next read
        return done

    def _size_guess(self, movable: list[int], in_memory: dict[int, tuple[bytes, int, float]]) -> int:
        """What moving these would write: the memory's records as they are, the others at the topic
        log's mean record size."""
        mean = self._mean_size()
        return sum(34 + len(in_memory[pos][0]) if pos in in_memory else mean for pos in movable)

    def _mean_size(self) -> int:
        """The topic log's mean record size."""
        assert self.reader is not None
        segments = self.reader.segments
        records = max(1, segments.tail_index - segments.start_index())
        return segments.segment_bytes() // records

    def _copies(self, reader: LogReader, movable: list[int], in_memory: dict[int, tuple[bytes, int, float]],
                indexed: dict[int, float]) -> tuple[list[bytes], list[tuple[int, float]], list[int]]:
        """The records to write to the own queue, their (attempts, deadline in unix seconds), and their
        positions in the topic's log: those the channel holds as they are, the indexed ones read back
        (once), up to the first that cannot be read."""
        from_index = [pos for pos in movable if pos not in in_memory]
        read = reader.read_back(from_index) if from_index else Batch()
        found = dict(zip(read.positions, read.records))
        now, wall = self.now(), self.wall()
        records: list[bytes] = []
        holds: list[tuple[int, float]] = []
        moved: list[int] = []
        for pos in movable:
            memory = in_memory.get(pos)
            if memory is not None:
                record, attempts, deadline = memory
            else:
                data = found.get(pos)
                if data is None:
                    break  # could not be read (read_back finished it): stop here
                record = data
                held = reader.cursor.held.get(pos)
                attempts = held[0] if held is not None else 0
                due = indexed[pos]
                deadline = wall + max(0.001, due - now) if due else 0.0
            records.append(record)
            holds.append((attempts, deadline))
            moved.append(pos)
        return records, holds, moved

    # --- admin --------------------------------------------------------------------------------

    def clear_deferred(self) -> None:
        self.deferred_records.clear()

    def empty(self, end: int, end_index: int) -> None:
        """Everything goes: the topic log's reader moves to `end`, the own queue is emptied (and goes)."""
        self.deferred_records.clear()
        if self.reader is not None:
            self.reader.reset(end, end_index)
        self._empty_own()

    def seek(self, pos: int, index: int) -> None:
        """Deliver the topic's log again from `pos`, nothing after it finished; the own queue emptied."""
        assert self.reader is not None
        self.deferred_records.clear()
        self.reader.reset(pos, index)
        self._empty_own()

    def _empty_own(self) -> None:
        if self.own is not None:
            self.own.reset(self.own.segments.tail, self.own.segments.tail_index)
            self._drop_own_if_drained()

    def on_disk(self) -> bool:
        """The cursor of the topic's log is on disk (a kill -9 would not restart it at the log's end)."""
        return self.reader is not None and self.reader.on_disk

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        if self.own is not None:
            self.own.close()

    def delete_files(self) -> None:
        """The channel's cursor file and own queue go now (nsqd removes them before it answers)."""
        if self.reader is not None:
            self.reader.delete()
        if self.own is not None:
            self.own.delete()

