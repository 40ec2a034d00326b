"""PublishDeadlines: the deadlines of a log's deferred publishes, for the records some reader has not read yet.

A TopicLog keeps one, from its deadline files (`<topic>.diskqueue.deadlines.%06d.dat`): a reader defers a
record it finds here; /stats counts the records ahead of a reader that are deferred. Two arrays in
position order (16 bytes an entry, nothing for the garbage collector to walk): a reader walks them beside
the records it reads, and what every reader has read is cut off the front.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left


class PublishDeadlines:
    """Who calls it: TopicLog (add_many after an append, load at open and after a seek back,
    prune_before in its rounds, drop_from when the log is cut back); each LogReader of the topic's log
    (reading, counting)."""

    __slots__ = ("positions", "deadlines")

    def __init__(self) -> None:
        self.positions: array[int] = array("q")
        self.deadlines: array[float] = array("d")

    def __len__(self) -> int:
        return len(self.positions)

    def add_many(self, positions: list[int], deadline: float) -> None:
        """Deferred publishes just appended (their positions follow every one here)."""
        self.positions.extend(positions)
        self.deadlines.extend([deadline] * len(positions))

    def load(self, entries: list[tuple[int, float]]) -> None:
        """Entries read from the files (a restart or a seek back), in position order, merged with those
        here (an entry read again replaces the one here). Linear: both are in position order."""
        if not len(self.positions):
            self.positions = array("q", [pos for pos, _ in entries])
            self.deadlines = array("d", [deadline for _, deadline in entries])
            return
        old_p, old_d = self.positions, self.deadlines
        new_p: array[int] = array("q")
        new_d: array[float] = array("d")
        i = 0
        n = len(old_p)
        for pos, deadline in entries:
            while i < n and old_p[i] < pos:
                new_p.append(old_p[i])
                new_d.append(old_d[i])
                i += 1
            if i < n and old_p[i] == pos:
                i += 1
            new_p.append(pos)
            new_d.append(deadline)
        new_p.extend(old_p[i:])
        new_d.extend(old_d[i:])
        self.positions, self.deadlines = new_p, new_d

    def count_between(self, lo: int, hi: int) -> int:
        """Deferred records at positions in [lo, hi)."""
        return bisect_left(self.positions, hi) - bisect_left(self.positions, lo)

    def deadline_at(self, pos: int) -> float:
        """The deadline of the deferred publish at `pos` (0: it is none)."""
        at = bisect_left(self.positions, pos)
        if at < len(self.positions) and self.positions[at] == pos:
            return self.deadlines[at]
        return 0.0

    def drop_from(self, pos: int) -> None:
        """The log was cut back to `pos` (TopicLog.truncate_to): the entries at or past it go."""
        cut = bisect_left(self.positions, pos)
        del self.positions[cut:]
        del self.deadlines[cut:]

    def prune_before(self, pos: int) -> None:
        """Every reader has read what is before `pos` (a restart reads the files again)."""
        cut = bisect_left(self.positions, pos)
        if cut:
            del self.positions[:cut]
            del self.deadlines[:cut]
