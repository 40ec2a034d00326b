"""Priority queues for in-flight and deferred messages: a dict by id plus a heap by deadline.

Go's indexed heap removes an entry in O(log n) on FIN; in Python that bookkeeping costs more than it
saves. Here FIN only drops the dict entry and the heap entry goes stale (lazy deletion): an entry is
live while its message is still in the dict with the same generation. Stale entries are skipped when
popped, and the heap is rebuilt from the dict whenever they outnumber the live ones, so memory stays
within twice the number of messages held.
"""

from __future__ import annotations

import heapq
import itertools

from broker.message import Message

_COMPACT_MIN = 1024


class MessagePQueue:
    __slots__ = ("items", "_heap", "_seq")

    def __init__(self) -> None:
        self.items: dict[bytes, Message] = {}
        self._heap: list[tuple[float, int, int, Message]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, msg_id: bytes) -> bool:
        return msg_id in self.items

    def push(self, msg: Message, pri: float) -> None:
        """Add (or re-prioritise) msg with deadline `pri` (trio clock seconds)."""
        msg.generation += 1
        msg.pri = pri
        self.items[msg.id] = msg
        heap = self._heap
        heapq.heappush(heap, (pri, next(self._seq), msg.generation, msg))
        if len(heap) > _COMPACT_MIN and len(heap) > 2 * len(self.items):
            self._compact()

    def pop(self, msg_id: bytes) -> Message | None:
        """Remove by id (FIN, REQ, TOUCH's first half); its heap entry goes stale."""
        msg = self.items.pop(msg_id, None)
        if msg is not None:
            msg.generation += 1
            if len(self._heap) > _COMPACT_MIN and len(self._heap) > 2 * len(self.items):
                self._compact()  # FINs leave stale entries (holding bodies): keep them bounded
        return msg

    def pop_expired(self, now: float) -> list[Message]:
        """Every message whose deadline is <= now, removed, earliest first."""
        heap, items, out = self._heap, self.items, []
        while heap and heap[0][0] <= now:
            _, _, generation, msg = heapq.heappop(heap)
            if msg.generation == generation and items.get(msg.id) is msg:
                del items[msg.id]
                msg.generation += 1
                out.append(msg)
        return out

    def next_deadline(self) -> float | None:
        heap, items = self._heap, self.items
        while heap:
            _, _, generation, msg = heap[0]
            if msg.generation == generation and items.get(msg.id) is msg:
                return heap[0][0]
            heapq.heappop(heap)
        return None

    def drain(self) -> list[Message]:
        """Remove and return everything (shutdown, empty)."""
        out = list(self.items.values())
        for msg in out:
            msg.generation += 1
        self.items.clear()
        self._heap.clear()
        return out

    def _compact(self) -> None:
        self._heap = [(m.pri, next(self._seq), m.generation, m) for m in self.items.values()]
        heapq.heapify(self._heap)
