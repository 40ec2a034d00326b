"""BackendQueue: what a Topic or Channel needs from the queue behind its memory queue.

nsqd's BackendQueue interface made Trio-friendly: put_many and read_many are synchronous so the hot path
never awaits per message (the pumps are woken by the topic or channel that queued something).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import trio


class BackendError(Exception):
    """A put failed (disk full, I/O error): the publisher gets E_PUB_FAILED, nothing is dropped silently.

    `stored` says how many records of a put_many() were stored before the failure."""

    def __init__(self, message: str, stored: int = 0) -> None:
        super().__init__(message)
        self.stored = stored


class BackendQueue(Protocol):
    # whether it keeps what the memory queue has no room for (a channel's room is unbounded then)
    stores: bool
    # whether a record read stays stored until finish() (a channel's queue: crash-safe delivery)
    cursor: bool
    # a channel's queue: the highest topic position it has taken, persisted with its own records, and
    # the ids of records found after a crash past what its metadata says (taken, but maybe not noted)
    upstream: int
    recovered_ids: set[bytes]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The io_loop (periodic fsync and the like); runs in the owner's nursery until cancelled."""

    def put(self, data: bytes) -> None:
        """Append one record; raises BackendError if it cannot be stored."""

    def put_many(self, records: Sequence[bytes], delay: float = 0.0, positions: list[int] | None = None) -> None:
        """Append records in order; raises BackendError (`.stored` of them kept) at the first that fails.
        `delay` > 0: they are deferred, and a restart keeps the deadline (delay_of). `positions` gets
        where each went."""

    def hold(self, data: bytes, delay: float = 0.0, old: int = -1) -> int:
        """Append a record its owner holds (in flight, or deferred `delay` seconds): not read again in this
        process, delivered after a restart; the record at `old` (if any) is finished with it, so a crash
        finds one of the two. Returns its position; raises BackendError."""

    def rewrite(self, data: bytes, old: int) -> int:
        """Append a record to be read again in place of the one at `old` (finished with it, so a crash
        finds one of the two). Returns its position; raises BackendError."""

    def finish(self, pos: int) -> None:
        """The record read or held at `pos` is done with (a no-op unless the queue keeps a cursor)."""

    def finish_many(self, positions: list[int]) -> None:
        """finish() of each position in turn (a run of FINs in one call)."""

    def has_deadlines(self) -> bool: ...

    def delay_of(self, pos: int) -> float:
        """Seconds left of the deadline kept for the record at `pos` (<= 0 when none or due)."""

    async def sync(self) -> None:
        """Return once every record put so far is durable (group commit: waiters share one fsync)."""

    def read_many(self, limit: int, positions: list[int] | None = None) -> list[bytes]:
        """Take up to `limit` records (`positions` gets theirs); an empty list when there is none."""

    def depth(self) -> int: ...

    async def empty(self) -> None:
        """Drop every record."""

    async def close(self) -> None:
        """Persist state (metadata, fsync) and release files; the queue can be reopened later."""

    def delete(self) -> None:
        """Remove every file of this queue before returning (closes it too)."""


class DummyBackendQueue:
    """For ephemeral topics/channels (never touch disk) and until a real backend is configured.

    It holds nothing: put() refuses, so a full memory queue pushes back instead of dropping.
    """

    stores = False
    cursor = False
    upstream = -1
    recovered_ids: set[bytes] = set()  # never filled

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()

    def put(self, data: bytes) -> None:
        raise BackendError("memory queue full and no backend queue")

    def put_many(self, records: Sequence[bytes], delay: float = 0.0, positions: list[int] | None = None) -> None:
        raise BackendError("memory queue full and no backend queue")

    def hold(self, data: bytes, delay: float = 0.0, old: int = -1) -> int:
        raise BackendError("no backend queue")

    def rewrite(self, data: bytes, old: int) -> int:
        raise BackendError("no backend queue")

    def finish(self, pos: int) -> None:
        return None

    def finish_many(self, positions: list[int]) -> None:
        return None

    def has_deadlines(self) -> bool:
        return False

    def delay_of(self, pos: int) -> float:
        return 0.0

    async def sync(self) -> None:
        return None

    def read_many(self, limit: int, positions: list[int] | None = None) -> list[bytes]:
        return []

    def depth(self) -> int:
        return 0

    async def empty(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def delete(self) -> None:
        return None
