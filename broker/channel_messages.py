"""GET /channel/messages: a look at a channel's messages (not in nsqd; nsqio/nsq #848, #347): which are in
flight and since when, which are deferred and until when, which are queued and how old, with their
attempts and the start of their bodies.

What it costs is bounded by `limit`, never by the channel's size: the in-flight and deferred queues are
walked from their nearest deadline (MessagePQueue.earliest), queued messages are read from the memory
queue's front and, past it, from the logs where the channel's readers are (LogReader.peek, with a
reader of its own: the channel's place does not move). Deferred publishes the channel has not read from
the topic's log yet are not listed (finding the earliest of them would mean reading them all), but
`count` includes them, as /stats' deferred_count does.

Called by broker/http/endpoints.py (Api.channel_messages); nothing here awaits, so the listing is one
consistent look.
"""

from __future__ import annotations

import codecs
from itertools import islice
from typing import TYPE_CHECKING, Any

import trio

from trio_nsq.broker.channel import OWN
from trio_nsq.broker.storage.log_reader import Batch
from trio_nsq.broker.message import Message

if TYPE_CHECKING:
    from trio_nsq.broker.channel import Channel

STATES = ("in_flight", "deferred", "queued")
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
PREVIEW_BYTES = 64


class ListingError(ValueError):
    """A bad `state` or `limit`: its text is the HTTP API's 400 message."""


def listing_args(state: str | None, limit: str | None) -> tuple[str, int]:
    """The state and limit asked for: MISSING_ARG_STATE, INVALID_ARG_STATE (not one of STATES),
    INVALID_ARG_LIMIT (not an integer from 0 to MAX_LIMIT)."""
    if state is None or not state:
        raise ListingError("MISSING_ARG_STATE")
    if state not in STATES:
        raise ListingError("INVALID_ARG_STATE")
    if limit is None or limit == "":
        return state, DEFAULT_LIMIT
    if not (limit.isascii() and limit.isdigit()) or len(limit) > 7 or int(limit) > MAX_LIMIT:
        raise ListingError("INVALID_ARG_LIMIT")
    return state, int(limit)


def list_messages(channel: Channel, state: str, limit: int) -> dict[str, Any]:
    """The answer: the channel, the state, `count` (how many the channel has in that state, as /stats
    counts them) and up to `limit` messages. Times are unix nanoseconds, as a message's timestamp."""
    now = trio.current_time()
    wall_ns = channel.topic.now_ns()  # the clock publish timestamps come from (a test's MockClock)

    def wall(deadline: float) -> int:
        """A trio clock time as unix nanoseconds."""
        return wall_ns + int((deadline - now) * 1e9)

    rows: list[dict[str, Any]] = []
    if state == "in_flight":
        count = len(channel.in_flight)
        for msg in channel.in_flight.earliest(limit):
            row = _row(msg)
            client = channel.clients.get(msg.client_id)
            row["delivered_at"] = wall(msg.delivery_ts)
            row["deadline"] = wall(msg.pri)
            # as /stats shows the client: its IDENTIFY client_id and its address ("": gone since)
            row["client_id"] = str(getattr(client, "client_id", "")) if client is not None else ""
            row["client_address"] = str(getattr(client, "remote_address", "")) if client is not None else ""
            rows.append(row)
    elif state == "deferred":
        count = channel.deferred_count()
        for deadline, msg in deferred(channel, limit):
            row = _row(msg)
            row["deadline"] = wall(deadline)
            rows.append(row)
    else:
        count = channel.depth()
        for msg in queued(channel, limit):
            row = _row(msg)
            row["age_ms"] = max(0, (wall_ns - msg.timestamp) // 1_000_000)
            rows.append(row)
    return {"topic": channel.topic_name, "channel": channel.name, "state": state, "count": count,
            "messages": rows}


def deferred(channel: Channel, limit: int) -> list[tuple[float, Message]]:
    """Up to `limit` deferred messages, nearest deadline first (a trio clock time): the deferred queue's
    (REQ with a delay) and the records read from the logs with a deadline ahead, read back for a look."""
    out = [(msg.pri, msg) for msg in channel.deferred.earliest(limit)]
    backend = channel.backend
    entries = backend.deferred_records.earliest(limit)
    deadline_of = {pos: deadline for deadline, pos in entries}
    for tag, reader in ((OWN, backend.own), (0, backend.reader)):
        positions = [pos for _, pos in entries if (pos & OWN) == tag]
        if reader is not None and positions:
            out.extend((deadline_of[msg.pos], msg) for msg in _messages(reader.read_back(positions)))
    out.sort(key=lambda pair: pair[0])
    return out[:limit]


def queued(channel: Channel, limit: int) -> list[Message]:
    """Up to `limit` queued messages: the memory queue's, then the channel's own queue's, then the topic
    log's the channel has not read yet (each in its order)."""
    out = list(islice(channel.memory, limit))
    backend = channel.backend
    readers = ((backend.own, -1), (backend.reader, channel.topic.dispatched_position()))
    for reader, upto in readers:
        if reader is not None and len(out) < limit:
            out.extend(_messages(reader.peek(limit - len(out), reader.segments.tail if upto < 0 else upto)))
    return out


def _messages(batch: Batch) -> list[Message]:
    """A look's records as messages (with their attempts); one that is not a message is left out (the
    channel finishes it when it reads it)."""
    out: list[Message] = []
    for i, (data, pos) in enumerate(zip(batch.records, batch.positions)):
        try:
            msg = Message.decode(data)
        except ValueError:
            continue
        msg.pos = pos
        state = batch.states.get(i)
        if state is not None and state[0] >= 0:
            msg.attempts = state[0]
        out.append(msg)
    return out


def _row(msg: Message) -> dict[str, Any]:
    body = msg.body
    return {"id": msg.id.decode("ascii", "backslashreplace"), "timestamp": msg.timestamp, "attempts": msg.attempts,
            "body_size": len(body), "body_preview": preview(body)}


def preview(body: bytes, size: int = PREVIEW_BYTES) -> str:
    """The first `size` bytes as text: UTF-8, a byte that is not written as \\xNN, and a character the
    cut splits left out."""
    decoder = codecs.getincrementaldecoder("utf-8")("backslashreplace")
    return decoder.decode(body[:size], final=len(body) <= size)
