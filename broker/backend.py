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

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The io_loop (periodic fsync and the like); runs in the owner's nursery until cancelled."""

    def put(self, data: bytes) -> None:
        """Append one record; raises BackendError if it cannot be stored."""

    def put_many(self, records: Sequence[bytes]) -> None:
        """Append records in order; raises BackendError (`.stored` of them kept) at the first that fails."""

    async def sync(self) -> None:
        """Return once every record put so far is durable (group commit: waiters share one fsync)."""

    def read_many(self, limit: int) -> list[bytes]:
        """Take up to `limit` records; an empty list when there is none."""

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

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()

    def put(self, data: bytes) -> None:
        raise BackendError("memory queue full and no backend queue")

    def put_many(self, records: Sequence[bytes]) -> None:
        raise BackendError("memory queue full and no backend queue")

    async def sync(self) -> None:
        return None

    def read_many(self, limit: int) -> list[bytes]:
        return []

    def depth(self) -> int:
        return 0

    async def empty(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def delete(self) -> None:
        return None
