"""What the storage knows of a record's bytes: an NSQ message as go-diskqueue stores it,
`[timestamp ns int64][attempts uint16][id: 16 hex digits][body]` (shared/protocol.py)."""

from __future__ import annotations

from trio_nsq.shared.protocol import MIN_VALID_MSG_LENGTH

_HEX = frozenset(b"0123456789abcdefABCDEF")


def looks_like_message(record: bytes) -> bool:
    """Whether a record found past the persisted write position at open is a message and not what a power
    loss left (zeros where its bytes were never written back): a message's id is 16 hex digits (Go nsqd's
    and ours). A record whose first bytes were written back and the rest not
    cannot be told from one whose body ends in zeros: go-diskqueue's format has no checksum (the side
    files of checksums.py add one, checked before this)."""
    if len(record) < MIN_VALID_MSG_LENGTH:
        return False
    for byte in record[10:26]:
        if byte not in _HEX:
            return False
    return True
