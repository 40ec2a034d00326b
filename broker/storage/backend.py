"""BackendError: the disk refused a write or an fsync (nsqd's backend errors).

Publishers get E_PUB_FAILED (HTTP 503 ...) for it; nothing is dropped silently."""

from __future__ import annotations


class BackendError(Exception):
    """A write failed (disk full, I/O error) or a round's fsync did. `stored` says how many records of
    an append were stored before the failure."""

    def __init__(self, message: str, stored: int = 0) -> None:
        super().__init__(message)
        self.stored = stored
