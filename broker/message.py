"""Message: one NSQ message as the broker holds it, plus its in-flight/deferred bookkeeping."""

from __future__ import annotations

import struct
import time

from trio_nsq.shared.protocol import MESSAGE_HEADER, MIN_VALID_MSG_LENGTH

_unpack_header = MESSAGE_HEADER.unpack_from
# the header and the 16-byte id in one pack: encode() runs once per message written to a disk queue
_pack_head = struct.Struct(">qH16s").pack


class Message:
    """A message in a topic or channel.

    A plain slotted class, not attrs: millions are made per minute on the hot path. The same object
    moves between a channel's memory queue, its in-flight table and its deferred queue; `generation`
    changes on every move so stale heap entries can be told apart cheaply (see pqueue).
    """

    __slots__ = ("id", "body", "timestamp", "attempts", "deferred", "client_id", "delivery_ts", "pri", "lane", "generation", "pos")

    def __init__(self, msg_id: bytes, body: bytes, timestamp: int | None = None, attempts: int = 0) -> None:
        self.id = msg_id
        self.body = body
        self.timestamp = time.time_ns() if timestamp is None else timestamp
        self.attempts = attempts
        self.deferred = 0.0  # seconds; set by DPUB
        self.client_id = 0
        self.delivery_ts = 0.0
        self.pri = 0.0
        self.lane: float | None = None  # the in-flight/deferred lane holding its deadline (pqueue)
        self.generation = 0
        # where its record is in the log its channel read it from (-1: none, it lives in memory only; a
        # channel's own queue's positions carry channel.OWN): FIN finishes it there, REQ holds it there
        self.pos = -1

    def copy(self) -> Message:
        """A channel's own copy (nsqd copies per channel after the first)."""
        msg = Message(self.id, self.body, self.timestamp, self.attempts)
        msg.deferred = self.deferred
        msg.pos = self.pos
        return msg

    def encode(self) -> bytes:
        """The wire format, which is also the disk queue's record format."""
        return encode_record(self.timestamp, self.attempts, self.id, self.body)

    @classmethod
    def decode(cls, data: bytes) -> Message:
        """A record read back from a disk queue (decode_message's checks, without its value object:
        this runs once per message read from disk)."""
        if len(data) < MIN_VALID_MSG_LENGTH:
            raise ValueError(f"invalid message buffer size ({len(data)})")
        timestamp, attempts = _unpack_header(data)
        return cls(data[10:26], data[26:], timestamp, attempts)

    def __repr__(self) -> str:
        return f"Message(id={self.id!r}, attempts={self.attempts}, size={len(self.body)})"


def encode_record(timestamp: int, attempts: int, msg_id: bytes, body: bytes) -> bytes:
    """A message's wire format and disk record (Message.encode; Topic publishes straight to disk with it)."""
    return _pack_head(timestamp, attempts, msg_id) + body
