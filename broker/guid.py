"""GUID factory: nsqd's 64-bit ids (time | node id | sequence), written as 16 hex ASCII bytes."""

from __future__ import annotations

import time
from collections.abc import Callable

NODE_ID_BITS = 10
SEQUENCE_BITS = 12
NODE_ID_SHIFT = SEQUENCE_BITS
TIMESTAMP_SHIFT = SEQUENCE_BITS + NODE_ID_BITS
SEQUENCE_MASK = (1 << SEQUENCE_BITS) - 1
TWEPOCH = 1288834974288
# an id's last three hex digits are its sequence: new_ids() joins a prefix per tick and one of these
_SEQUENCE_HEX: tuple[bytes, ...] = tuple(b"%03x" % seq for seq in range(1 << SEQUENCE_BITS))


class GUIDFactory:
    """Unique, increasing ids for one node.

    Go's factory fails when its 12-bit sequence runs out within one ~1 ms tick and nsqd retries after
    a sleep; here the tick is borrowed from the future instead, which keeps ids unique and increasing
    without ever blocking the event loop. `clock` (nanoseconds since the epoch) is a test's seam: a
    compiled module does not see a monkeypatched `time`.
    """

    __slots__ = ("node_id", "_sequence", "_last_ts", "_node_bits", "_clock")

    def __init__(self, node_id: int, clock: Callable[[], int] = time.time_ns) -> None:
        if not 0 <= node_id < 1024:
            raise ValueError(f"node id {node_id} not in range [0,1024)")
        self.node_id = node_id
        self._node_bits = node_id << NODE_ID_SHIFT
        self._sequence = 0
        self._last_ts = 0
        self._clock = clock

    def new_guid(self) -> int:
        ts = self._clock() >> 20
        if ts <= self._last_ts:
            ts = self._last_ts
            self._sequence = (self._sequence + 1) & SEQUENCE_MASK
            if self._sequence == 0:
                ts += 1
        else:
            self._sequence = 0
        self._last_ts = ts
        return ((ts - TWEPOCH) << TIMESTAMP_SHIFT) | self._node_bits | self._sequence

    def new_id(self) -> bytes:
        return b"%016x" % self.new_guid()

    def new_ids(self, n: int) -> list[bytes]:
        """n ids at once (MPUB): one clock read, the same rules as new_guid for each."""
        ts = self._clock() >> 20
        seq = self._sequence
        last = self._last_ts
        node = self._node_bits
        out: list[bytes] = []
        append = out.append
        prefix_ts = -1
        prefix = b""
        for _ in range(n):
            if ts <= last:
                ts = last
                seq = (seq + 1) & SEQUENCE_MASK
                if seq == 0:
                    ts += 1
            else:
                seq = 0
            last = ts
            if ts != prefix_ts:
                # b"%016x" % id, its sequence digits split off: one format per tick, not per id
                prefix = b"%013x" % ((((ts - TWEPOCH) << TIMESTAMP_SHIFT) | node) >> SEQUENCE_BITS)
                prefix_ts = ts
            append(prefix + _SEQUENCE_HEX[seq])
        self._sequence = seq
        self._last_ts = last
        return out
