"""Priority queues for in-flight and deferred messages: a dict by id, and deadlines in lanes and a heap.

Go's indexed heap removes an entry in O(log n) on FIN; in Python that bookkeeping costs more than it
saves. Here FIN only drops the dict entry and the deadline entry goes stale (lazy deletion): an entry is
live while its message is still in the dict with the same generation. Stale entries are skipped when
popped, and everything is rebuilt from the dict whenever stale entries outnumber the live ones, so
memory stays within twice the number of messages held.

Lanes make the common case O(1): messages put in flight with the same timeout (every consumer with the
default msg_timeout) get deadlines `now + timeout` in the order they are pushed, so a FIFO per timeout
value is already sorted, and consumers FIN roughly in delivery order, so a FIN usually finds its entry
at the front of its lane and drops it there. A push that would break a lane's order (TOUCH's capped
deadline, a clock that did not move) and pushes without a lane go to the heap.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from trio_nsq.broker.message import Message

_COMPACT_MIN = 1024
# pop_owned: why a run stopped
OWNED = 0
MISSING = 1
NOT_OWNED = 2
# distinct lane keys kept (one per msg_timeout in use); pushes for further keys use the heap
MAX_LANES = 16


class MessagePQueue:
    __slots__ = ("_items", "_heap", "_lanes", "_entries", "_seq")

    def __init__(self) -> None:
        self._items: dict[bytes, Message] = {}
        self._heap: list[tuple[float, int, int, Message]] = []
        self._lanes: dict[float, deque[tuple[float, int, Message]]] = {}
        self._entries = 0  # heap and lane entries, live or stale
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, msg_id: bytes) -> bool:
        return msg_id in self._items

    def get(self, msg_id: bytes) -> Message | None:
        return self._items.get(msg_id)

    def messages(self) -> list[Message]:
        """Every message held (a look inside: /stats, reclaim)."""
        return list(self._items.values())

    @property
    def entry_count(self) -> int:
        """Deadline entries held, live or stale (bounded by 2 x len() + _COMPACT_MIN)."""
        return self._entries

    def push(self, msg: Message, pri: float, lane: float | None = None) -> None:
        """Add (or re-prioritise) msg with deadline `pri` (trio clock seconds). `lane`: the timeout that
        made the deadline (pri = now + lane), for the in-order FIFO of that timeout."""
        msg.generation += 1
        msg.pri = pri
        msg.lane = None
        self._items[msg.id] = msg
        self._entries += 1
        if lane is not None:
            fifo = self._lanes.get(lane)
            if fifo is None and len(self._lanes) < MAX_LANES:
                fifo = self._lanes[lane] = deque()
            if fifo is not None and (not fifo or fifo[-1][0] <= pri):
                fifo.append((pri, msg.generation, msg))
                msg.lane = lane
                self._maybe_compact()
                return
        heapq.heappush(self._heap, (pri, next(self._seq), msg.generation, msg))
        self._maybe_compact()

    def push_many(self, msgs: list[Message], pri: float, lane: float) -> None:
        """push() of each message with one deadline and lane (a message pump's batch put in flight)."""
        fifo = self._lanes.get(lane)
        if fifo is None and len(self._lanes) < MAX_LANES:
            fifo = self._lanes[lane] = deque()
        if fifo is None or (fifo and fifo[-1][0] > pri):
            for msg in msgs:
                self.push(msg, pri, lane)
            return
        items = self._items
        append = fifo.append
        for msg in msgs:
            generation = msg.generation + 1
            msg.generation = generation
            msg.pri = pri
            msg.lane = lane
            items[msg.id] = msg
            append((pri, generation, msg))
        self._entries += len(msgs)
        self._maybe_compact()

    def pop_owned(self, msg_ids: list[bytes], owner: int) -> tuple[list[Message], int]:
        """pop() of each id in turn while its message is here and its client_id is `owner` (a consumer's
        run of FINs): the messages, and why it stopped (OWNED: it did not; MISSING: an id not here;
        NOT_OWNED: a message of another client, left here). The lanes' fronts are cleared once."""
        items = self._items
        out: list[Message] = []
        stopped = OWNED
        for msg_id in msg_ids:
            msg = items.get(msg_id)
            if msg is None:
                stopped = MISSING
                break
            if msg.client_id != owner:
                stopped = NOT_OWNED
                break
            del items[msg_id]
            msg.generation += 1
            out.append(msg)
        if out:
            for fifo in self._lanes.values():
                self._drop_stale_front(fifo)
            self._maybe_compact()
        return out, stopped

    def pop(self, msg_id: bytes) -> Message | None:
        """Remove by id (FIN, REQ, TOUCH's first half); its deadline entry goes stale."""
        msg = self._items.pop(msg_id, None)
        if msg is not None:
            msg.generation += 1
            fifo = self._lanes.get(msg.lane) if msg.lane is not None else None
            if fifo:
                self._drop_stale_front(fifo)
            self._maybe_compact()
        return msg

    def _drop_stale_front(self, fifo: deque[tuple[float, int, Message]]) -> None:
        """FINs come in delivery order: the entries they left stale at a lane's front go at once."""
        while fifo and not self._live(fifo[0][1], fifo[0][2]):
            fifo.popleft()
            self._entries -= 1

    def pop_expired(self, now: float) -> list[Message]:
        """Every message whose deadline is <= now, removed, earliest first."""
        out: list[Message] = []
        sources = 0
        heap = self._heap
        if heap and heap[0][0] <= now:
            sources += 1
            while heap and heap[0][0] <= now:
                _, _, generation, msg = heapq.heappop(heap)
                self._entries -= 1
                if self._live(generation, msg):
                    self._take(msg, out)
        for fifo in self._lanes.values():
            if fifo and fifo[0][0] <= now:
                sources += 1
                while fifo and fifo[0][0] <= now:
                    _, generation, msg = fifo.popleft()
                    self._entries -= 1
                    if self._live(generation, msg):
                        self._take(msg, out)
        if sources > 1:
            out.sort(key=_deadline)
        if out:
            # the live ones it took may leave stale entries (a message pushed again, elsewhere) outnumbering them
            self._maybe_compact()
        return out

    def next_deadline(self) -> float | None:
        best = None
        heap = self._heap
        while heap:
            _, _, generation, msg = heap[0]
            if self._live(generation, msg):
                best = heap[0][0]
                break
            heapq.heappop(heap)
            self._entries -= 1
        for fifo in self._lanes.values():
            while fifo:
                pri, generation, msg = fifo[0]
                if self._live(generation, msg):
                    if best is None or pri < best:
                        best = pri
                    break
                fifo.popleft()
                self._entries -= 1
        return best

    def fronts(self) -> list[Message]:
        """The message with the nearest deadline of each lane and of the heap (those delivered or
        deferred first): a cheap look at the oldest held, for /stats."""
        out: list[Message] = []
        heap = self._heap
        if heap and self._live(heap[0][2], heap[0][3]):
            out.append(heap[0][3])
        for fifo in self._lanes.values():
            for pri, generation, msg in fifo:
                if self._live(generation, msg):
                    out.append(msg)
                    break
        return out

    def earliest(self, limit: int) -> list[Message]:
        """Up to `limit` messages held, nearest deadline first, left where they are (a look inside:
        /channel/messages). The lanes are in deadline order already and the heap's tree is walked from
        its root, so the cost is bounded by `limit`, not by how many are held: at most 4 x limit + 64
        entries are looked at (where more of them than that are stale, finished out of order and not
        compacted yet, fewer are returned)."""
        out: list[Message] = []
        if limit <= 0:
            return out
        budget = 4 * limit + 64
        heap = self._heap
        fifos = list(self._lanes.values())
        # the next entry of each source, by (deadline, tie, source, index): source -1 is the heap (index:
        # the entry's place in its tree, whose children are 2i+1 and 2i+2), n >= 0 the n-th lane
        frontier: list[tuple[float, int, int, int]] = []
        if heap:
            frontier.append((heap[0][0], heap[0][1], -1, 0))
        for n, fifo in enumerate(fifos):
            if fifo:
                frontier.append((fifo[0][0], -1, n, 0))
        heapq.heapify(frontier)
        while frontier and len(out) < limit and budget > 0:
            _, _, source, at = heapq.heappop(frontier)
            budget -= 1
            if source < 0:
                _, _, generation, msg = heap[at]
                for child in (2 * at + 1, 2 * at + 2):
                    if child < len(heap):
                        heapq.heappush(frontier, (heap[child][0], heap[child][1], -1, child))
            else:
                fifo = fifos[source]
                _, generation, msg = fifo[at]  # near the deque's front: a few blocks' walk at most
                if at + 1 < len(fifo):
                    heapq.heappush(frontier, (fifo[at + 1][0], -1, source, at + 1))
            if self._live(generation, msg):
                out.append(msg)
        return out

    def drain(self) -> list[Message]:
        """Remove and return everything (shutdown, empty)."""
        out = list(self._items.values())
        for msg in out:
            msg.generation += 1
        self._items.clear()
        self._heap.clear()
        self._lanes.clear()
        self._entries = 0
        return out

    def _live(self, generation: int, msg: Message) -> bool:
        return msg.generation == generation and self._items.get(msg.id) is msg

    def _take(self, msg: Message, out: list[Message]) -> None:
        del self._items[msg.id]
        msg.generation += 1
        out.append(msg)

    def _maybe_compact(self) -> None:
        # FINs out of order and TOUCHes leave stale entries (holding bodies): keep them bounded
        if self._entries > _COMPACT_MIN and self._entries > 2 * len(self._items):
            self._compact()

    def _compact(self) -> None:
        live = self._live
        for lane, fifo in list(self._lanes.items()):
            kept = deque(entry for entry in fifo if live(entry[1], entry[2]))
            if kept:
                self._lanes[lane] = kept
            else:
                del self._lanes[lane]  # a timeout no longer in use frees its lane
        self._heap = [entry for entry in self._heap if live(entry[2], entry[3])]
        heapq.heapify(self._heap)
        self._entries = len(self._heap) + sum(len(fifo) for fifo in self._lanes.values())


def _deadline(msg: Message) -> float:
    return msg.pri
