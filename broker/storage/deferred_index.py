"""DeferredIndex: the deferred records a channel has read from its logs, as (deadline, position) only.

A channel that reads a record whose deadline is still ahead (a deferred publish, a record a REQ with a
delay held before a restart, one reclaim moved to the channel's own queue) does not make a Message of it:
the record stays in its log, and its position and deadline go here, 16 bytes an entry in arrays (nothing
for the garbage collector to walk). When it is due the position moves to the `ready` queue (8 bytes), and
the channel reads the record back from its log when a consumer takes it. So a million messages deferred
for a day cost ~16 MB here (and their place in the cursor), not a million bodies and Message objects.
Pulsar's delayed-delivery tracker does the same over its ledger: (ledger, entry, deliver-at), entries
read again when due.

Deadlines are in the index's clock (the channel's: trio's, which its queue scan and deferred queue run on),
converted from the logs' unix seconds when a record is read, as a message's deadline in the deferred
queue is.

How it keeps them in deadline order without a heap of tuples: in *runs*, each two arrays sorted by
deadline. A new entry is appended to the run whose last deadline is the latest at or before it (one
delay used by every publisher gives deadlines in read order, so one run; a few delays, a few runs);
when MAX_RUNS runs exist and none takes it, it waits in a small unsorted buffer, which is sorted into a
run of its own at PENDING_MAX entries, and the two shortest runs are then merged (a C sort), so
scattered deadlines cost O(n log n) in all and there are never more than MAX_RUNS + 1 runs to look at.

Who calls it: the Channel (add_many through LogReader.read, due from the queue scan, take_ready from
take, clear on empty and seek, entries_in and remove from reclaim); /stats counts it.
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_right
from collections.abc import Callable

# runs kept before scattered deadlines are buffered and merged
MAX_RUNS = 16
# unsorted entries buffered before they are sorted into a run
PENDING_MAX = 4096
# consumed entries at a run's (or the ready queue's) front are cut off once more than this many
_TRIM = 4096


class _Run:
    """Entries sorted by deadline; those before `head` are gone (due)."""

    __slots__ = ("deadlines", "positions", "head")

    def __init__(self, deadlines: array[float], positions: array[int]) -> None:
        self.deadlines = deadlines
        self.positions = positions
        self.head = 0

    def size(self) -> int:
        return len(self.deadlines) - self.head

    def trim(self) -> None:
        head = self.head
        if head > _TRIM and head * 2 > len(self.deadlines):
            del self.deadlines[:head]
            del self.positions[:head]
            self.head = 0


class DeferredIndex:
    __slots__ = ("clock", "_runs", "_last", "_pending_deadlines", "_pending_positions", "_pending_min",
                 "_count", "_ready", "_ready_head")

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock  # what the deadlines here are in (`due` is given a time of it)
        self._runs: list[_Run] = []
        self._last: _Run | None = None  # the run the last entry went to (the next usually goes there too)
        self._pending_deadlines: array[float] = array("d")
        self._pending_positions: array[int] = array("Q")
        self._pending_min = 0.0
        self._count = 0  # entries not due yet
        self._ready: array[int] = array("Q")  # positions due, in the order they became due
        self._ready_head = 0

    def __len__(self) -> int:
        """Entries not due yet (deferred)."""
        return self._count

    def ready_count(self) -> int:
        """Entries due and not taken yet (queued)."""
        return len(self._ready) - self._ready_head

    def nbytes(self) -> int:
        """The bytes the entries take (the arrays' contents)."""
        total = 8 * (len(self._pending_deadlines) + len(self._pending_positions) + len(self._ready))
        for run in self._runs:
            total += 8 * (len(run.deadlines) + len(run.positions))
        return total

    # --- adding -------------------------------------------------------------------------------

    def add_many(self, deadlines: list[float], positions: list[int]) -> None:
        """Records just read, deferred until their deadlines."""
        for deadline, pos in zip(deadlines, positions):
            self.add(deadline, pos)

    def add(self, deadline: float, pos: int) -> None:
        self._count += 1
        run = self._last
        if run is not None and run.deadlines[-1] <= deadline:
            run.deadlines.append(deadline)
            run.positions.append(pos)
            return
        best: _Run | None = None
        best_last = 0.0
        for run in self._runs:
            last = run.deadlines[-1]
            if last <= deadline and (best is None or last > best_last):
                best, best_last = run, last
        if best is None:
            if len(self._runs) < MAX_RUNS:
                best = _Run(array("d"), array("Q"))
                self._runs.append(best)
            else:
                if not self._pending_deadlines or deadline < self._pending_min:
                    self._pending_min = deadline
                self._pending_deadlines.append(deadline)
                self._pending_positions.append(pos)
                if len(self._pending_deadlines) >= PENDING_MAX:
                    self._flush_pending()
                return
        best.deadlines.append(deadline)
        best.positions.append(pos)
        self._last = best

    def _flush_pending(self) -> None:
        """The buffered entries become a run of their own; the two shortest runs merge."""
        run = _sorted_run(self._pending_deadlines, self._pending_positions)
        self._pending_deadlines = array("d")
        self._pending_positions = array("Q")
        runs = self._runs
        runs.append(run)
        if len(runs) > MAX_RUNS:
            runs.sort(key=_Run.size)
            a, b = runs[0], runs[1]
            merged = _sorted_run(a.deadlines[a.head:] + b.deadlines[b.head:], a.positions[a.head:] + b.positions[b.head:])
            runs[:2] = [merged]
        self._last = None

    # --- due ----------------------------------------------------------------------------------

    def due(self, now: float) -> int:
        """Every entry whose deadline is at or before `now` moves to the ready queue, earliest first;
        how many did."""
        deadlines: list[array[float]] = []
        positions: list[array[int]] = []
        emptied = False
        for run in self._runs:
            head = run.head
            if run.deadlines[head] > now:
                continue
            cut = bisect_right(run.deadlines, now, head)
            deadlines.append(run.deadlines[head:cut])
            positions.append(run.positions[head:cut])
            run.head = cut
            if cut == len(run.deadlines):
                emptied = True
            else:
                run.trim()
        if self._pending_deadlines and self._pending_min <= now:
            self._due_pending(now, deadlines, positions)
        if emptied:
            self._runs = [run for run in self._runs if run.size()]
            if self._last is not None and not self._last.size():
                self._last = None
        if not positions:
            return 0
        if len(positions) == 1:
            moved = positions[0]
        else:
            merged = _sorted_run(_concat_d(deadlines), _concat_q(positions))
            moved = merged.positions
        self._ready.extend(moved)
        self._count -= len(moved)
        return len(moved)

    def _due_pending(self, now: float, deadlines: list[array[float]], positions: list[array[int]]) -> None:
        keep_d: array[float] = array("d")
        keep_p: array[int] = array("Q")
        due_d: array[float] = array("d")
        due_p: array[int] = array("Q")
        for deadline, pos in zip(self._pending_deadlines, self._pending_positions):
            if deadline <= now:
                due_d.append(deadline)
                due_p.append(pos)
            else:
                keep_d.append(deadline)
                keep_p.append(pos)
        self._pending_deadlines, self._pending_positions = keep_d, keep_p
        self._pending_min = min(keep_d) if keep_d else 0.0
        deadlines.append(due_d)
        positions.append(due_p)

    def take_ready(self, n: int) -> list[int]:
        """Up to n positions of due entries, in the order they became due; taken out."""
        ready = self._ready
        head = self._ready_head
        end = min(head + n, len(ready))
        out = ready[head:end].tolist()
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
        self._runs = []
        self._last = None
        self._pending_deadlines = array("d")
        self._pending_positions = array("Q")
        self._count = 0
        self._ready = array("Q")
        self._ready_head = 0

    def earliest(self, n: int) -> list[tuple[float, int]]:
        """The n entries due first, (deadline, position), nearest first; none taken out (a look inside:
        GET /channel/messages). What it costs is bounded by n and the few runs, not by the entries."""
        heads: list[tuple[float, int, int, int]] = []  # (deadline, position, run, index)
        for r, run in enumerate(self._runs):
            if run.head < len(run.deadlines):
                heads.append((run.deadlines[run.head], run.positions[run.head], r, run.head))
        pending = sorted(zip(self._pending_deadlines, self._pending_positions))[:n]
        out: list[tuple[float, int]] = []
        heapq.heapify(heads)
        while heads and len(out) < n:
            deadline, pos, r, i = heapq.heappop(heads)
            out.append((deadline, pos))
            run = self._runs[r]
            if i + 1 < len(run.deadlines):
                heapq.heappush(heads, (run.deadlines[i + 1], run.positions[i + 1], r, i + 1))
        return sorted(out + pending)[:n]

    def entries(self) -> list[tuple[int, float]]:
        """(position, deadline) of every entry not due yet (a look inside, for tests)."""
        out: list[tuple[int, float]] = []
        for run in self._runs:
            out.extend(zip(run.positions[run.head:], run.deadlines[run.head:]))
        out.extend(zip(self._pending_positions, self._pending_deadlines))
        return out

    def entries_in(self, wanted: set[int]) -> list[tuple[int, float]]:
        """(position, deadline) of the entries at these positions: deferred ones with their deadline,
        ready ones with 0."""
        out: list[tuple[int, float]] = []
        for run in self._runs:
            out.extend((p, d) for d, p in zip(run.deadlines[run.head:], run.positions[run.head:]) if p in wanted)
        out.extend((p, d) for d, p in zip(self._pending_deadlines, self._pending_positions) if p in wanted)
        out.extend((p, 0.0) for p in self._ready[self._ready_head:] if p in wanted)
        return out

    def remove(self, gone: set[int]) -> None:
        """The entries at these positions go (reclaim moved their records elsewhere)."""
        runs: list[_Run] = []
        for run in self._runs:
            kept = [(d, p) for d, p in zip(run.deadlines[run.head:], run.positions[run.head:]) if p not in gone]
            if kept:
                runs.append(_Run(array("d", [d for d, _ in kept]), array("Q", [p for _, p in kept])))
        pending = [(d, p) for d, p in zip(self._pending_deadlines, self._pending_positions) if p not in gone]
        ready = array("Q", [p for p in self._ready[self._ready_head:] if p not in gone])
        self._runs = runs
        self._last = None
        self._pending_deadlines = array("d", [d for d, _ in pending])
        self._pending_positions = array("Q", [p for _, p in pending])
        self._pending_min = min(self._pending_deadlines) if pending else 0.0
        self._count = sum(run.size() for run in runs) + len(pending)
        self._ready = ready
        self._ready_head = 0


def _sorted_run(deadlines: array[float], positions: array[int]) -> _Run:
    order = sorted(range(len(deadlines)), key=deadlines.__getitem__)
    return _Run(array("d", [deadlines[i] for i in order]), array("Q", [positions[i] for i in order]))


def _concat_d(parts: list[array[float]]) -> array[float]:
    out: array[float] = array("d")
    for part in parts:
        out.extend(part)
    return out


def _concat_q(parts: list[array[int]]) -> array[int]:
    out: array[int] = array("Q")
    for part in parts:
        out.extend(part)
    return out
