"""MessageQueue: the queue behind a Topic and behind a Channel, nsqd's memoryMsgChan then backend.

Messages go to a memory deque while it has room, the rest to the backend (go-diskqueue files) in one
write; an ephemeral queue has no backend, so its overflow is dropped (as nsqd's dummy backend discards
it). Topic and Channel own one each and decide what this does not: how much memory room there is now
(nsqd's hand-off rules differ between them) and what a backend error means (a publisher's error for a
topic, a retry for a channel). Synchronous throughout: the pumps move batches without awaiting.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence

from trio_nsq.broker.backend import BackendQueue
from trio_nsq.broker.message import Message
from trio_nsq.shared.protocol import MIN_VALID_MSG_LENGTH

log = logging.getLogger("nsqd")


class MessageQueue:
    __slots__ = ("owner", "memory", "backend", "ephemeral")

    def __init__(self, owner: str, backend: BackendQueue, ephemeral: bool) -> None:
        self.owner = owner  # "TOPIC(name)" or "CHANNEL(name)", for log lines
        self.memory: deque[Message] = deque()
        self.backend = backend
        self.ephemeral = ephemeral

    def depth(self) -> int:
        return len(self.memory) + self.backend.depth()

    def put(self, msgs: Sequence[Message], room: int) -> int:
        """The first `room` (≥ 0) messages into memory, the rest to the backend in one write. Returns
        how many went past memory (written, or dropped when ephemeral). A BackendError propagates with
        `.stored` saying how many of the rest the backend did write."""
        if room >= len(msgs):
            self.memory.extend(msgs)
            return 0
        self.memory.extend(msgs[:room])
        rest = msgs[room:]
        if not self.ephemeral:
            # a deferred publish (all of its messages share the delay) keeps its deadline on disk
            self.backend.put_many([msg.encode() for msg in rest], rest[0].deferred)
        return len(rest)

    def take_memory(self, out: list[Message], limit: int) -> None:
        """Append memory messages to `out` until it holds `limit`."""
        memory = self.memory
        while memory and len(out) < limit:
            out.append(memory.popleft())

    def take_backend(self, out: list[Message], limit: int) -> None:
        """Append backend messages to `out` until it holds `limit`; an undecodable record is logged and
        skipped (nsqd does the same)."""
        backend = self.backend
        if len(out) >= limit or not backend.depth():
            return
        decode = Message.decode
        positions: list[int] = []
        records = backend.read_many(limit - len(out), positions)
        deadlines = backend.has_deadlines()
        for data, pos in zip(records, positions):
            try:
                msg = decode(data)
            except ValueError as exc:
                log.error("%s: failed to decode message - %s", self.owner, exc)
                backend.finish(pos)
                continue
            msg.pos = pos
            if deadlines:
                msg.deferred = max(0.0, backend.delay_of(pos))
            out.append(msg)

    def take_records(self, limit: int, positions: list[int]) -> list[bytes]:
        """Up to `limit` backend records as stored, not decoded (`positions` gets theirs), for a pump that
        passes them on as they are; an undecodable record is logged and skipped, as by take_backend."""
        backend = self.backend
        records = backend.read_many(limit, positions)
        if records and min(map(len, records)) < MIN_VALID_MSG_LENGTH:
            kept: list[bytes] = []
            kept_positions: list[int] = []
            for data, pos in zip(records, positions):
                if len(data) < MIN_VALID_MSG_LENGTH:
                    log.error("%s: failed to decode message - invalid message buffer size (%d)", self.owner, len(data))
                    backend.finish(pos)
                else:
                    kept.append(data)
                    kept_positions.append(pos)
            records = kept
            positions[:] = kept_positions
        return records

    def drain_memory(self) -> list[Message]:
        out = list(self.memory)
        self.memory.clear()
        return out

    async def empty(self) -> None:
        self.memory.clear()
        await self.backend.empty()
