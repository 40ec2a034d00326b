"""DeferredIndex: the deferred records a channel has read from its logs, as (deadline, position) only.

A channel that reads a record whose deadline is still ahead (a deferred publish, a record a REQ with a
delay held before a restart, one reclaim moved to the channel's own queue) does not make a Message of it:
the record stays in its log, and its position and deadline go here, 32 bytes an entry in arrays (16 in
deadline order, 16 in position order; nothing for the garbage collector to walk). When it is due the
position moves to the `ready` queue (8 bytes), and the channel reads the record back from its log when a
consumer takes it. So a million messages deferred for a day cost ~32 MB here (and their place in the
cursor), not a million bodies and Message objects.
Pulsar's delayed-delivery tracker does the same over its ledger: (ledger, entry, deliver-at), entries
read again when due.

Deadlines are in the index's clock (the channel's: trio's, which its queue scan and deferred queue run on),
converted from the logs' unix seconds when a record is read, as a message's deadline in the deferred
queue is. Positions are unsigned 64-bit (0 <= pos < 2**64: a channel tags its own queue's with bit 63).

How it keeps them in deadline order without a heap of tuples: in *runs*, each two arrays (array("d") of
deadlines, array("Q") of positions) sorted by deadline, consumed from a `head`. Every run is sorted at
every moment; nothing else is assumed of them, so `due` and `earliest` read any set of runs the same way.

- Open runs (at most `max_open`, 16) take entries appended in order: a new entry goes to the open run
  whose last deadline is the latest at or before it (their last deadlines are kept sorted, so that is one
  bisect, and the run the last entry went to is tried first in O(1)). One delay used by every publisher
  gives deadlines in read order: one open run, appended to, 16 bytes an entry, no other work; a few
  delays, a few open runs. No open run takes an entry before them all: it waits in a small unsorted
  buffer, sorted (a C sort) into a run of its own every `pending_max` (4,096) entries.
- Those runs, and an open run that stops taking entries while the buffer fills (it is sealed, freeing its
  place), are *tiered*: a run has a level (a buffer's run 0; a sealed open run the level of its size,
  level c holding fewer than pending_max * fanout**(c+1) entries), and as soon as `fanout` (32) runs
  rest at one level they are merged into one run a level up (at least the next level, and at least its
  size's). So an entry is merged at most once a level, and there are O(log n) levels: O(n log n) in all.
- A merge is incremental, a few thousand entries a step, so no call waits for a big one. A step takes
  from the front of each input run the entries up to a cut value t, at most `per` of each: t is the
  least of the inputs' deadlines `per` past their fronts (or +inf where an input has fewer left). What
  it takes is at most t, and what is left of each input is at least t (an input is cut either after
  its last entry <= t or at the entry `per` past its front, which is >= t), so the entries taken sort
  (a C sort of the concatenated pieces, which timsort merges as the sorted runs they are) onto the end of
  the output after everything already there. Output and inputs therefore stay sorted runs at every step,
  with every output entry <= every input entry; `due` consuming from the front of either, and `remove`
  dropping entries from any, keep both true. Each step moves at least `per` entries (the input that set
  t gives `per`) and at most `step` (4,096) in all, per = step / inputs: bounded work, and progress (when
  one input alone gives some, or is left, up to `slice_max` of it are copied, not sorted).
- How much merging is done when: every entry that enters the tiers (a buffer sorted, an open run sealed)
  owes every merge in progress 2 entries of work, paid lowest level first when a full buffer is sorted
  (and when due() sorts a partial one): at most `work` (16,384 entries, ~4 ms in pure Python) a call, or
  what a full buffer owes if that is more (2 x 4,096 x the merges in progress, with over 2 of them: so
  merging keeps up at any size), the rest at the next call. While entries only come in, a run of level c
  holds pending_max * fanout**c entries (a sealed open run between that and fanout times it), so a merge at
  level c moves pending_max * fanout**(c+1) and is done once half as many have entered the tiers, while
  level c gathers `fanout` runs again only once that many have: one merge a level at a time, fewer than
  `fanout` runs resting at each level (the tests check both). Entries coming due only take work away.
  So there are at most max_open + 2 * fanout * levels runs, levels <= 1 + log_fanout(n / pending_max):
  at 4M random deadlines 3 levels and, measured, 109 runs at most. A larger fanout merges an entry
  fewer times (log_fanout) for more runs to look at: 32 rather than 16 took 10-15% less time at 4M, for
  109 runs at most rather than 67.
- `due(now)` moves what is due, earliest first: everything due if that is at most `due_max` (16,384,
  sorted when several runs give some; each marked due by position, below); else what is at most a
  deadline t found by halving the span between the earliest front and the latest due entry (a bisect a
  run each time, 40 times at most) until between due_max / 2 and due_max are at most t (or the same cut
  as a merge's, per = due_max / runs, when more than due_max share the earliest deadline): what it
  moves is due and at most anything left. The rest moves at the next call (a
  channel's queue scan counts a due() that moved some as work, and samples again at once while enough of
  its channels have some).

- By position: reclaim asks for the oldest few thousand positions a channel read (to move their records
  out of the topic log's way) among all the entries, then removes those it moved; the runs cannot say
  where a position is (a merge scatters them). So every entry is also kept by position: in *chunks* of
  `chunk` (4,096) positions in the order added, with each one's state (its deadline while deferred,
  -inf once due), the chunks in position order (a log read forward adds increasing positions: appended
  to the last chunk in O(1); one inside a chunk's span, out of order, is kept aside in a dict). A lookup
  is two bisects. due() marks what it moves due, take_ready() forgets what it takes, and a chunk goes
  once nothing in it is left. `remove` forgets an entry by position at once and counts it gone; its copy
  in a run, the buffer or the ready queue stays until it is met there (due() drops it, take_ready() skips
  it): so a remove is O(k log n), and what removed entries keep (16 bytes each in a run) is bounded by
  the entries added and goes when they come due, or when nothing deferred is left.

What bounds a call, then: add is O(1) (a bisect when the last open run or chunk does not take the entry),
and a full buffer adds its sort (4,096 entries) and at most `work` + `step` entries of merging (more only
with over 2 merges in progress: past 128M entries); due, a look at each run's front, 41 bisects a run at
most and at most `due_max` entries sorted and looked up by position (removed ones among them); earliest,
n, the runs and the removed entries met; take_ready, n lookups (and the removed ones met). Cutting
consumed entries off a run's front copies at most half of it. entries_in and remove, k lookups by
position: O(k log n), nothing copied.

Who calls it: the Channel (add through LogReader.read, due from the queue scan, take_ready from take,
clear on empty and seek, entries_in and remove from reclaim, earliest from GET /channel/messages); /stats
counts it.
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from typing import Final

# open runs that take entries in order before the buffer does
MAX_OPEN: Final = 16
# unsorted entries buffered before they are sorted into a run
PENDING_MAX: Final = 4096
# runs resting at one level that are merged into one
FANOUT: Final = 32
# entries one merge step moves at most (sorted)
STEP: Final = 4096
# merge work (entries sorted) one call does at most (unless the entries it sorted owe more), and what
# one due() sorts at most
WORK: Final = 16384
DUE_MAX: Final = 16384
# entries moved from a single run (a memory copy, not a sort) in one merge step at most
SLICE_MAX: Final = 1 << 20
# consumed entries at a run's (or the ready queue's) front are cut off once more than this many
_TRIM: Final = 4096

_INF: Final = float("inf")
# an entry's state where its position is kept (_Chunk): its deadline while deferred, these once due or gone
_READY: Final = float("-inf")
_GONE: Final = float("nan")
# entries a _Chunk holds at most (positions in the order added, increasing)
CHUNK: Final = 4096
# one past the largest position
_END: Final = 1 << 64

# what a run is
_OPEN: Final = 0  # takes entries appended in order
_RESTING: Final = 1  # sealed, at its level, waiting for a merge
_INPUT: Final = 2  # sealed, in a merge (consumed from its front)
_OUTPUT: Final = 3  # a merge's output (appended to by the merge alone)


class _Run:
    """Entries sorted by deadline; those before `head` are gone (due, or merged into another run)."""

    __slots__ = ("deadlines", "positions", "head", "kind", "level", "mark")

    def __init__(self, deadlines: array[float], positions: array[int], kind: int, level: int) -> None:
        self.deadlines = deadlines
        self.positions = positions
        self.head = 0
        self.kind = kind
        self.level = level
        self.mark = len(deadlines)  # an open run's length at the last full buffer (how much it takes)

    def size(self) -> int:
        return len(self.deadlines) - self.head

    def trim(self, share: int = 2) -> None:
        """Consumed entries are cut off once more than 1/share of the arrays (a merge's inputs: 1/4, as
        they are all consumed at once; copying the rest costs less than merging the entries cut)."""
        head = self.head
        if head > _TRIM and head * share > len(self.deadlines):
            del self.deadlines[:head]
            del self.positions[:head]
            self.mark -= head
            self.head = 0


class _Chunk:
    """Entries by position: positions increasing, in the order added, and each one's state (its deadline
    while deferred, _READY once due, _GONE once taken or removed); `live` of them not gone."""

    __slots__ = ("positions", "states", "live")

    def __init__(self, pos: int, state: float) -> None:
        self.positions: array[int] = array("Q", [pos])
        self.states: array[float] = array("d", [state])
        self.live = 1


class _Hint:
    """Where the last lookup by position of one caller found its entry: the next one is usually just after
    it (entries come due, and are taken, in the order they were read when their deadlines are)."""

    __slots__ = ("chunk", "at")

    def __init__(self) -> None:
        self.chunk: _Chunk | None = None
        self.at = 0


class _Merge:
    """`fanout` runs of one level being merged into `output` a step at a time."""

    __slots__ = ("inputs", "output", "level", "debt")

    def __init__(self, inputs: list[_Run], output: _Run, level: int) -> None:
        self.inputs = inputs
        self.output = output
        self.level = level
        self.debt = 0  # entries of work owed to it (entries that entered the tiers since it started, x2)


class DeferredIndex:
    __slots__ = ("clock", "_runs", "_open", "_lasts", "_last", "_last_i", "_last_limit", "_pending_deadlines",
                 "_pending_positions", "_pending_min", "_merges", "_inflow", "_count", "_ready", "_ready_head",
                 "_dead", "_ready_dead", "_chunks", "_firsts", "_tail", "_tail_limit", "_strays", "_chunk",
                 "_due_hint", "_take_hint", "_hint",
                 "_max_open", "_pending_max", "_fanout", "_step", "_work", "_due_max", "_slice_max")

    def __init__(self, clock: Callable[[], float], *, max_open: int = MAX_OPEN, pending_max: int = PENDING_MAX,
                 fanout: int = FANOUT, step: int = STEP, work: int = WORK, due_max: int = DUE_MAX,
                 slice_max: int = SLICE_MAX, chunk: int = CHUNK) -> None:
        """The keyword arguments are the bounds above (tests make them small to reach every path)."""
        self.clock = clock  # what the deadlines here are in (`due` is given a time of it)
        self._max_open = max(1, max_open)
        self._pending_max = max(1, pending_max)
        self._fanout = max(2, fanout)
        self._step = max(2, step)
        self._work = max(1, work)
        self._due_max = max(1, due_max)
        self._slice_max = max(1, slice_max)
        self._chunk = max(1, chunk)
        self._runs: list[_Run] = []  # every run (open, resting, in a merge)
        self._open: list[_Run] = []  # the open runs, by their last deadline
        self._lasts: array[float] = array("d")  # their last deadlines (the one of `_last` may be behind)
        self._last: _Run | None = None  # the open run the last entry went to (the next usually goes there too)
        self._last_i = 0  # its place in _open
        self._last_limit = _INF  # the next open run's last deadline: what `_last` may take is below it
        self._pending_deadlines: array[float] = array("d")
        self._pending_positions: array[int] = array("Q")
        self._pending_min = 0.0
        self._merges: list[_Merge] = []  # in progress, lowest level first
        self._inflow = 0  # entries that entered the tiers and have not given their merge work yet
        self._count = 0  # entries not due yet
        self._ready: array[int] = array("Q")  # positions due, in the order they became due
        self._ready_head = 0
        # removed entries still in the runs or the buffer (dropped when they come due), and in `_ready`
        self._dead = 0
        self._ready_dead = 0
        # every entry by position: chunks in position order (their first positions in `_firsts`), the one
        # the last entry went to (`_tail`, taking positions below `_tail_limit`), and positions added
        # inside a chunk's span (out of order: none from a log read forward) aside
        self._chunks: list[_Chunk] = []
        self._firsts: array[int] = array("Q")
        self._tail: _Chunk | None = None
        self._tail_limit = 0
        self._strays: dict[int, float] = {}
        self._due_hint = _Hint()
        self._take_hint = _Hint()
        self._hint = _Hint()

    def __len__(self) -> int:
        """Entries not due yet (deferred)."""
        return self._count

    def ready_count(self) -> int:
        """Entries due and not taken yet (queued)."""
        return len(self._ready) - self._ready_head - self._ready_dead

    def nbytes(self) -> int:
        """The bytes the entries take (the arrays' contents)."""
        total = 8 * (len(self._pending_deadlines) + len(self._pending_positions) + len(self._ready))
        for run in self._runs:
            total += 8 * (len(run.deadlines) + len(run.positions))
        for chunk in self._chunks:
            total += 16 * len(chunk.positions)
        return total

    # --- entries by position ----------------------------------------------------------------------

    def _place(self, pos: int, deadline: float) -> None:
        """A new entry's position and state: appended to the chunk the last one went to when it is
        after that one's last and before the next chunk (a log read forward: always)."""
        chunk = self._tail
        if chunk is not None and chunk.positions[-1] < pos < self._tail_limit and len(chunk.positions) < self._chunk:
            chunk.positions.append(pos)
            chunk.states.append(deadline)
            chunk.live += 1
            return
        firsts = self._firsts
        chunks = self._chunks
        i = bisect_right(firsts, pos) - 1
        if i >= 0:
            chunk = chunks[i]
            if pos <= chunk.positions[-1]:
                self._strays[pos] = deadline
                return
            if len(chunk.positions) < self._chunk:
                chunk.positions.append(pos)
                chunk.states.append(deadline)
                chunk.live += 1
                self._tail = chunk
                self._tail_limit = firsts[i + 1] if i + 1 < len(firsts) else _END
                return
        chunk = _Chunk(pos, deadline)
        chunks.insert(i + 1, chunk)
        firsts.insert(i + 1, pos)
        self._tail = chunk
        self._tail_limit = firsts[i + 2] if i + 2 < len(firsts) else _END

    def _state(self, pos: int) -> float:
        """The entry's deadline while deferred, _READY when due, _GONE when not here."""
        if self._strays:
            state = self._strays.get(pos)
            if state is not None:
                return state
        i = bisect_right(self._firsts, pos) - 1
        if i >= 0:
            chunk = self._chunks[i]
            j = bisect_left(chunk.positions, pos)
            if j < len(chunk.positions) and chunk.positions[j] == pos:
                return chunk.states[j]
        return _GONE

    def _swap(self, pos: int, state: float, hint: _Hint) -> float:
        """The entry's state becomes `state` (_READY, or _GONE: it is forgotten); what it was (_GONE:
        not here, and left so). Looked for just after where `hint` found the last one first (O(1) for
        positions in order), else by two bisects. A chunk left with nothing goes."""
        strays = self._strays
        if strays:
            old = strays.get(pos)
            if old is not None:
                if state == _READY:
                    strays[pos] = state
                else:
                    del strays[pos]
                return old
        chunk = hint.chunk
        j = hint.at
        if chunk is None or j >= len(chunk.positions) or chunk.positions[j] != pos:
            i = bisect_right(self._firsts, pos) - 1
            if i < 0:
                return _GONE
            chunk = self._chunks[i]
            j = bisect_left(chunk.positions, pos)
            if j == len(chunk.positions) or chunk.positions[j] != pos:
                return _GONE
        hint.chunk = chunk
        hint.at = j + 1
        old = chunk.states[j]
        if old != old:  # gone already
            return old
        chunk.states[j] = state
        if state != state:
            chunk.live -= 1
            if not chunk.live:
                self._drop_chunk(chunk)
        return old

    def _drop_chunk(self, chunk: _Chunk) -> None:
        i = bisect_right(self._firsts, chunk.positions[0]) - 1
        del self._chunks[i]
        del self._firsts[i]
        self._tail = None
        for hint in (self._due_hint, self._take_hint, self._hint):
            if hint.chunk is chunk:
                hint.chunk = None

    # --- adding -------------------------------------------------------------------------------

    def add_many(self, deadlines: list[float], positions: list[int]) -> None:
        """Records just read, deferred until their deadlines."""
        for deadline, pos in zip(deadlines, positions):
            self.add(deadline, pos)

    def add(self, deadline: float, pos: int) -> None:
        """An entry at a position not in the index (deferred or due)."""
        self._count += 1
        self._place(pos, deadline)
        run = self._last
        if run is not None and run.deadlines[-1] <= deadline < self._last_limit:
            run.deadlines.append(deadline)
            run.positions.append(pos)
            return
        self._add_elsewhere(deadline, pos)

    def _add_elsewhere(self, deadline: float, pos: int) -> None:
        lasts = self._lasts
        last = self._last
        if last is not None:
            lasts[self._last_i] = last.deadlines[-1]
        opened = self._open
        i = bisect_right(lasts, deadline) - 1
        if i >= 0:
            run = opened[i]
            run.deadlines.append(deadline)
            run.positions.append(pos)
            lasts[i] = deadline
        elif len(opened) < self._max_open:
            i = 0
            run = _Run(array("d", [deadline]), array("Q", [pos]), _OPEN, 0)
            opened.insert(0, run)
            lasts.insert(0, deadline)
            self._runs.append(run)
        else:
            if not self._pending_deadlines or deadline < self._pending_min:
                self._pending_min = deadline
            self._pending_deadlines.append(deadline)
            self._pending_positions.append(pos)
            if len(self._pending_deadlines) >= self._pending_max:
                self._flush_pending()
                self._seal_idle()
                self._schedule()
                self._do_work(self._work)
            return
        self._last = run
        self._last_i = i
        self._last_limit = lasts[i + 1] if i + 1 < len(lasts) else _INF

    def _flush_pending(self) -> None:
        """The buffered entries become a run of their own (level 0)."""
        keys = self._pending_deadlines.tolist()
        order = sorted(range(len(keys)), key=keys.__getitem__)
        values = self._pending_positions.tolist()
        run = _Run(array("d", map(keys.__getitem__, order)), array("Q", map(values.__getitem__, order)), _RESTING, 0)
        self._runs.append(run)
        self._inflow += len(keys)
        self._pending_deadlines = array("d")
        self._pending_positions = array("Q")

    def _seal_idle(self) -> None:
        """With every open place taken, the open run that took least while the buffer filled (less than
        its share) is sealed: its place goes to the next entry no open run takes."""
        opened = self._open
        if len(opened) < self._max_open:
            return
        if self._last is not None:
            self._lasts[self._last_i] = self._last.deadlines[-1]
        idle = -1
        least = self._pending_max // self._max_open
        for i, run in enumerate(opened):
            grew = len(run.deadlines) - run.mark
            run.mark = len(run.deadlines)
            if grew < least:
                idle, least = i, grew
        if idle < 0:
            return
        run = opened.pop(idle)
        del self._lasts[idle]
        self._last = None
        run.kind = _RESTING
        run.level = self._level_of(run.size())
        self._inflow += run.size()

    def _level_of(self, size: int) -> int:
        level = 0
        bound = self._pending_max * self._fanout
        while size >= bound:
            level += 1
            bound *= self._fanout
        return level

    # --- merging ------------------------------------------------------------------------------

    def _schedule(self) -> None:
        """Every `fanout` runs resting at one level start a merge."""
        fanout = self._fanout
        levels: dict[int, list[_Run]] = {}
        for run in self._runs:
            if run.kind == _RESTING:
                levels.setdefault(run.level, []).append(run)
        for level, runs in levels.items():
            while len(runs) >= fanout:
                inputs = runs[:fanout]
                del runs[:fanout]
                size = 0
                top = level
                for run in inputs:
                    run.kind = _INPUT
                    size += run.size()
                    top = max(top, run.level)
                output = _Run(array("d"), array("Q"), _OUTPUT, max(top + 1, self._level_of(size)))
                self._runs.append(output)
                merge = _Merge(inputs, output, level)
                at = 0
                while at < len(self._merges) and self._merges[at].level <= level:
                    at += 1
                self._merges.insert(at, merge)

    def _do_work(self, budget: int) -> None:
        """The merge work the entries that entered the tiers owe: 2 entries each to every merge in
        progress, lowest level first; in this call at most `budget`, or what a full buffer owes when that
        is more (so merging keeps up however many levels there are), and what is left at the next."""
        inflow = self._inflow
        self._inflow = 0
        for merge in self._merges:
            merge.debt += 2 * inflow
        budget = max(budget, 2 * self._pending_max * len(self._merges))
        for merge in list(self._merges):
            while merge.debt > 0 and budget > 0 and merge.inputs:
                moved, cost = self._merge_step(merge)
                merge.debt -= moved
                budget -= cost
            if not merge.inputs:
                self._finish(merge)
            if budget <= 0:
                break

    def _merge_step(self, merge: _Merge) -> tuple[int, int]:
        """One bounded step of a merge: (entries moved, their cost in entries sorted)."""
        inputs = [run for run in merge.inputs if run.head < len(run.deadlines)]
        out = merge.output
        if len(inputs) < 2:
            moved = 0
            if inputs:
                run = inputs[0]
                end = min(run.head + self._slice_max, len(run.deadlines))
                out.deadlines.extend(run.deadlines[run.head:end])
                out.positions.extend(run.positions[run.head:end])
                moved = end - run.head
                run.head = end
            cost = moved // 32 + 1
        else:
            cuts = _cut(inputs, max(1, self._step // len(inputs)), _INF)
            moved, sorted_ = _merge_into(inputs, cuts, out.deadlines, out.positions)
            cost = moved if sorted_ else moved // 32 + 1
            for run, cut in zip(inputs, cuts):
                run.head = cut
        for run in inputs:
            run.trim(4)
        if any(run.head == len(run.deadlines) for run in inputs):
            gone = [run for run in inputs if run.head == len(run.deadlines)]
            inputs = [run for run in inputs if run.head < len(run.deadlines)]
            self._runs = [run for run in self._runs if run not in gone]
        merge.inputs = inputs
        return moved, cost

    def _finish(self, merge: _Merge) -> None:
        """Its inputs are all merged (or due): the output rests at its level, and may start a merge there."""
        self._merges.remove(merge)
        out = merge.output
        gone = [run for run in merge.inputs if run.kind == _INPUT]
        out.kind = _RESTING
        if not out.size():
            gone.append(out)
        if gone:
            self._runs = [run for run in self._runs if run not in gone]
        self._schedule()

    # --- due ----------------------------------------------------------------------------------

    def due(self, now: float) -> int:
        """The entries whose deadline is at or before `now` move to the ready queue, earliest first (those
        removed are dropped instead); how many it took, both kinds: at most `due_max` a call, the
        earliest of them, so call again while it takes some."""
        if self._pending_deadlines and self._pending_min <= now:
            self._flush_pending()
            self._schedule()
            self._do_work(self._work // 2)  # half a full buffer's: this call sorts what is due too
        runs = [run for run in self._runs if run.head < len(run.deadlines) and run.deadlines[run.head] <= now]
        if not runs:
            return 0
        got: array[int] = array("Q")
        if len(runs) == 1:
            run = runs[0]
            cut = bisect_right(run.deadlines, now, run.head, min(run.head + self._due_max, len(run.deadlines)))
            got = run.positions[run.head:cut]
            run.head = cut
        else:
            cuts = _due_cuts(runs, now, self._due_max)
            _due_into(runs, cuts, got)
            for run, cut in zip(runs, cuts):
                run.head = cut
        emptied = False
        for run in runs:
            if run.head == len(run.deadlines):
                emptied = True
            else:
                run.trim()
        ready = self._ready
        moved = 0
        for pos in got:
            old = self._swap(pos, _READY, self._due_hint)
            if old != old:  # removed: it goes here
                self._dead -= 1
            else:
                ready.append(pos)
                moved += 1
        self._count -= moved
        if emptied:
            self._drop_empty()
        return len(got)

    def _drop_empty(self) -> None:
        """Runs left empty go (a merge's output stays, emptied, until the merge is done; with nothing left
        deferred the merges go too); the open runs follow."""
        if not self._count:
            self._clear_runs()
            return
        for run in self._runs:
            if run.kind == _OUTPUT and run.head and run.head == len(run.deadlines):
                run.deadlines = array("d")
                run.positions = array("Q")
                run.head = 0
        self._runs = [run for run in self._runs if run.head < len(run.deadlines) or run.kind == _OUTPUT]
        if any(run.head == len(run.deadlines) for run in self._open):
            self._reopen([run for run in self._open if run.head < len(run.deadlines)])

    def _reopen(self, opened: list[_Run]) -> None:
        opened.sort(key=_last_deadline)
        self._open = opened
        self._lasts = array("d", [run.deadlines[-1] for run in opened])
        self._last = None

    def take_ready(self, n: int) -> list[int]:
        """Up to n positions of due entries, in the order they became due; taken out."""
        ready = self._ready
        head = self._ready_head
        end = len(ready)
        out: list[int] = []
        while head < end and len(out) < n:
            pos = ready[head]
            head += 1
            if self._swap(pos, _GONE, self._take_hint) == _READY:
                out.append(pos)
            else:  # removed while due
                self._ready_dead -= 1
        end = head
        if end == len(ready):
            self._ready = array("Q")
            self._ready_head = 0
        elif end > _TRIM and end * 2 > len(ready):
            del ready[:end]
            self._ready_head = 0
        else:
            self._ready_head = end
        return out

    # --- what the channel drops or moves --------------------------------------------------------

    def clear(self) -> None:
        """Every entry goes (the channel emptied or sought)."""
        self._clear_runs()
        self._ready = array("Q")
        self._ready_head = 0
        self._ready_dead = 0
        self._chunks = []
        self._firsts = array("Q")
        self._tail = None
        self._strays = {}
        self._due_hint = _Hint()
        self._take_hint = _Hint()
        self._hint = _Hint()

    def _clear_runs(self) -> None:
        """No entry is deferred (the runs hold removed ones at most): the runs, the buffer and the merges
        go; the due entries stay."""
        self._runs = []
        self._open = []
        self._lasts = array("d")
        self._last = None
        self._pending_deadlines = array("d")
        self._pending_positions = array("Q")
        self._merges = []
        self._inflow = 0
        self._count = 0
        self._dead = 0

    def earliest(self, n: int) -> list[tuple[float, int]]:
        """The n entries due first, (deadline, position), nearest first; none taken out (a look inside:
        GET /channel/messages). What it costs is bounded by n, the runs and the removed entries it meets,
        not by the entries."""
        runs = self._runs
        heads: list[tuple[float, int, int, int]] = []  # (deadline, position, run, index)
        for r, run in enumerate(runs):
            if run.head < len(run.deadlines):
                heads.append((run.deadlines[run.head], run.positions[run.head], r, run.head))
        pending = list(zip(self._pending_deadlines, self._pending_positions))
        if self._dead:
            pending = [(deadline, pos) for deadline, pos in pending if self._state(pos) == deadline]
        out: list[tuple[float, int]] = heapq.nsmallest(n, pending)
        heapq.heapify(heads)
        taken = 0
        while heads and taken < n:
            deadline, pos, r, i = heapq.heappop(heads)
            if not self._dead or self._state(pos) == deadline:
                out.append((deadline, pos))
                taken += 1
            run = runs[r]
            if i + 1 < len(run.deadlines):
                heapq.heappush(heads, (run.deadlines[i + 1], run.positions[i + 1], r, i + 1))
        return sorted(out)[:n]

    def entries(self) -> list[tuple[int, float]]:
        """(position, deadline) of every entry not due yet (a look inside, for tests)."""
        out: list[tuple[int, float]] = []
        for run in self._runs:
            out.extend(zip(run.positions[run.head:], run.deadlines[run.head:]))
        out.extend(zip(self._pending_positions, self._pending_deadlines))
        if self._dead:
            out = [(pos, deadline) for pos, deadline in out if self._state(pos) == deadline]
        return out

    def entries_in(self, wanted: set[int]) -> list[tuple[int, float]]:
        """(position, deadline) of the entries at these positions: deferred ones with their deadline,
        due ones with 0. A lookup by position each (two bisects): O(k log n)."""
        out: list[tuple[int, float]] = []
        for pos in wanted:
            state = self._state(pos)
            if state == _READY:
                out.append((pos, 0.0))
            elif state == state:
                out.append((pos, state))
        return out

    def remove(self, gone: set[int]) -> None:
        """The entries at these positions go (reclaim moved their records elsewhere): forgotten by
        position at once, O(k log n); where they are in the runs, the buffer or the ready queue they are
        dropped when met there (they come due, or are taken)."""
        for pos in gone:
            state = self._swap(pos, _GONE, self._hint)
            if state == _READY:
                self._ready_dead += 1
            elif state == state:
                self._count -= 1
                self._dead += 1
        if not self._count and self._dead:
            self._clear_runs()
        if self._ready_dead and self._ready_dead == len(self._ready) - self._ready_head:
            self._ready = array("Q")
            self._ready_head = 0
            self._ready_dead = 0


def _last_deadline(run: _Run) -> float:
    return run.deadlines[-1]


def _cut(runs: list[_Run], per: int, upto: float) -> list[int]:
    """Where to cut each run's front so that what is taken (at most `per` of each, every deadline at most
    `upto`) is at most anything left in any of them: t is `upto` or the least deadline `per` past a front;
    a run is cut after its last entry <= t, or at the entry `per` past its front (which is >= t)."""
    t = upto
    for run in runs:
        end = run.head + per
        if end < len(run.deadlines):
            deadline = run.deadlines[end]
            if deadline < t:
                t = deadline
    return [bisect_right(run.deadlines, t, run.head, min(run.head + per, len(run.deadlines))) for run in runs]


def _due_cuts(runs: list[_Run], now: float, limit: int) -> list[int]:
    """Where to cut the runs' fronts so that what is taken is due, at most `limit`, and at most anything
    left: everything due if it is no more than `limit`; else everything at most a deadline t, halving
    between the earliest front and the latest due entry until limit / 2 to limit are taken."""
    heads = 0
    for run in runs:
        heads += run.head
    cuts = [bisect_right(run.deadlines, now, run.head) for run in runs]
    if sum(cuts) - heads <= limit:
        return cuts
    low = min([run.deadlines[run.head] for run in runs])
    high = max([run.deadlines[cut - 1] for run, cut in zip(runs, cuts) if cut > run.head])
    best = [bisect_right(run.deadlines, low, run.head) for run in runs]
    if sum(best) - heads > limit:  # more than `limit` share the earliest deadline
        return _cut(runs, max(1, limit // len(runs)), now)
    for _ in range(40):
        mid = low + (high - low) / 2
        if not low < mid < high:
            break
        cuts = [bisect_right(run.deadlines, mid, run.head) for run in runs]
        taken = sum(cuts) - heads
        if taken > limit:
            high = mid
        else:
            low, best = mid, cuts
            if taken * 2 >= limit:
                break
    return best


def _pieces(runs: list[_Run], cuts: list[int]) -> tuple[array[float], array[int], int]:
    """The runs' fronts up to their cuts, concatenated; and how many runs gave some."""
    deadlines: array[float] = array("d")
    positions: array[int] = array("Q")
    given = 0
    for run, cut in zip(runs, cuts):
        if cut > run.head:
            deadlines.extend(run.deadlines[run.head:cut])
            positions.extend(run.positions[run.head:cut])
            given += 1
    return deadlines, positions, given


def _merge_into(runs: list[_Run], cuts: list[int], deadlines: array[float], positions: array[int]) -> tuple[int, bool]:
    """The runs' fronts up to their cuts, in deadline order, onto the end of (deadlines, positions): how
    many, and whether that took a sort (more than one run gave some)."""
    got_d, got_p, given = _pieces(runs, cuts)
    if given <= 1:
        deadlines.extend(got_d)
        positions.extend(got_p)
        return len(got_d), False
    keys = got_d.tolist()
    values = got_p.tolist()
    order = sorted(range(len(keys)), key=keys.__getitem__)  # timsort: a merge of the sorted pieces
    deadlines.extend(map(keys.__getitem__, order))
    positions.extend(map(values.__getitem__, order))
    return len(keys), True


def _due_into(runs: list[_Run], cuts: list[int], ready: array[int]) -> int:
    """The positions of the runs' fronts up to their cuts, in deadline order, onto the ready queue."""
    got_d, got_p, given = _pieces(runs, cuts)
    if given <= 1:
        ready.extend(got_p)
    else:
        keys = got_d.tolist()
        values = got_p.tolist()
        ready.extend(map(values.__getitem__, sorted(range(len(keys)), key=keys.__getitem__)))
    return len(got_d)
