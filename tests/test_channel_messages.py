"""GET /channel/messages in process (broker/channel_messages.py): a channel's in-flight, deferred and
queued messages under MockClock, read from memory, from the topic's log without moving the channel's
place in it (across a kill -9: what was finished, requeued or deferred before it), the walk of the
in-flight and deferred queues in deadline order with its bound, body previews, and the endpoint's
answers and errors through nsqd's routes on a loopback socket."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from trio_nsq.broker.channel import Channel
from trio_nsq.broker.channel_messages import (
    DEFAULT_LIMIT, MAX_LIMIT, ListingError, list_messages, listing_args, preview,
)
from trio_nsq.broker.http.endpoints import Api
from trio_nsq.broker.http.serve import nsqd_site
from trio_nsq.broker.message import Message
from trio_nsq.broker.pqueue import MessagePQueue
from trio_nsq.broker.topic import Topic
from trio_nsq.shared.http import serve_site
from tests.topic_owner import Owner, kill

CLIENT = 7


class Consumer:
    """What the listing reads of a consumer (as /stats shows it); what the channel calls of one."""

    id = CLIENT
    client_id = "worker-1"
    remote_address = "127.0.0.1:50123"

    def wake(self) -> None:
        return None

    def ready_room(self) -> int:
        return 0

    def timed_out_message(self) -> None:
        return None

    def empty(self) -> None:
        return None

    async def close(self) -> None:
        return None


def open_topic(d: Path, clock: trio.testing.MockClock, **options: Any) -> Topic:
    return Topic(Owner(d, clock, mem_queue_size=0, **options), "t")  # type: ignore[arg-type]


def deliver(channel: Channel, n: int, timeout: float = 60.0) -> list[Message]:
    msgs = channel.take(n)
    for msg in msgs:
        msg.attempts += 1
    channel.start_in_flight_many(msgs, CLIENT, trio.current_time(), timeout)
    return msgs


def bodies(answer: dict[str, Any]) -> list[str]:
    return [row["body_preview"] for row in answer["messages"]]


# --- arguments and previews -------------------------------------------------------------------------


@pytest.mark.parametrize("state, limit, error", [
    (None, None, "MISSING_ARG_STATE"), ("", "5", "MISSING_ARG_STATE"), ("inflight", None, "INVALID_ARG_STATE"),
    ("queued", "1001", "INVALID_ARG_LIMIT"), ("queued", "-1", "INVALID_ARG_LIMIT"), ("queued", "x", "INVALID_ARG_LIMIT"),
    ("queued", "²", "INVALID_ARG_LIMIT"), ("queued", "9" * 40, "INVALID_ARG_LIMIT"), ("queued", "1e3", "INVALID_ARG_LIMIT"),
])
def test_bad_arguments_are_named(state, limit, error):
    with pytest.raises(ListingError, match=f"^{error}$"):
        listing_args(state, limit)


def test_limit_defaults_and_bounds():
    assert listing_args("deferred", None) == ("deferred", DEFAULT_LIMIT)
    assert listing_args("in_flight", "") == ("in_flight", DEFAULT_LIMIT)
    assert listing_args("queued", "0") == ("queued", 0)
    assert listing_args("queued", str(MAX_LIMIT)) == ("queued", MAX_LIMIT)


def test_preview_is_text_whatever_the_bytes():
    assert preview(b'{"order": 1}') == '{"order": 1}'
    assert preview("né à 東京".encode()) == "né à 東京"
    assert preview(b"\xff\x00ok\xc3") == "\\xff\x00ok\\xc3"  # not UTF-8: \xNN; the end of the body is the end
    # the cut at 64 bytes splits a 3-byte character: it is left out, not shown as bytes
    assert preview(b"a" * 63 + "東".encode() + b"zzz") == "a" * 63
    assert preview(b"b" * 100) == "b" * 64


# --- the in-flight and deferred queues, walked in deadline order -----------------------------------


def test_earliest_merges_lanes_and_heap_in_deadline_order():
    queue = MessagePQueue()
    msgs = [Message(b"%016d" % i, b"x") for i in range(300)]
    for i, msg in enumerate(msgs[:100]):  # a lane: 60 s timeout
        queue.push(msg, 1000.0 + i * 3, lane=60.0)
    for i, msg in enumerate(msgs[100:200]):  # another lane: 10 s timeout
        queue.push(msg, 1001.0 + i * 3, lane=10.0)
    for i, msg in enumerate(msgs[200:]):  # the heap (TOUCH's deadlines), pushed out of order
        queue.push(msg, 1002.0 + ((i * 37) % 100) * 3)
    by_deadline = sorted(msgs, key=lambda m: m.pri)
    assert queue.earliest(250) == by_deadline[:250]
    assert queue.earliest(1) == [msgs[0]] and queue.earliest(0) == []
    # a finished one goes; the rest stay where they were
    queue.pop(msgs[0].id)
    queue.pop(msgs[200].id)
    assert queue.earliest(5) == [m for m in by_deadline if m not in (msgs[0], msgs[200])][:5]
    assert len(queue) == 298


def test_earliest_looks_at_a_bounded_number_of_entries():
    """Finished out of order and not compacted yet, stale entries may stand before the live ones: the
    walk gives up after 4 x limit + 64 entries rather than go through the queue."""
    queue = MessagePQueue()
    early = [Message(b"e%015d" % i, b"x") for i in range(2000)]
    late = [Message(b"l%015d" % i, b"x") for i in range(10_000)]
    for i, msg in enumerate(early):
        queue.push(msg, float(i))
    for i, msg in enumerate(late):
        queue.push(msg, 5000.0 + i)
    for msg in early:
        queue.pop(msg.id)
    assert queue.entry_count == 12_000  # not compacted: 2,000 stale entries first
    assert queue.earliest(1) == []  # 68 entries looked at, all stale
    assert queue.earliest(500) == late[:64]  # 2,064 looked at: 64 past the stale ones
    assert queue.earliest(1000) == late[:1000]


# --- a channel's messages ----------------------------------------------------------------------------


async def test_in_flight_deferred_and_queued(tmp_path, mock_clock):
    topic = open_topic(tmp_path, mock_clock)
    channel = topic.get_channel("c")
    channel.add_client(Consumer(), 0)  # type: ignore[arg-type]
    topic.publish([b"m%d" % i for i in range(10)])
    first = deliver(channel, 2, timeout=60.0)
    mock_clock.jump(5)
    second = deliver(channel, 2, timeout=30.0)  # due before the first two
    channel.requeue_message(CLIENT, second[1].id, 30.0)  # m3: deferred 30 s
    channel.requeue_message(CLIENT, first[1].id, 0.0)  # m1: queued again, in memory
    started = topic.now_ns()  # the clock of publish timestamps: the MockClock here

    in_flight = list_messages(channel, "in_flight", 10)
    assert (in_flight["topic"], in_flight["channel"], in_flight["state"], in_flight["count"]) == ("t", "c", "in_flight", 2)
    assert bodies(in_flight) == ["m2", "m0"]  # nearest deadline first
    m2, m0 = in_flight["messages"]
    assert m0["id"] == first[0].id.decode() and len(m0["id"]) == 16
    assert (m0["attempts"], m0["body_size"], m0["timestamp"]) == (1, 2, first[0].timestamp)
    assert (m0["client_id"], m0["client_address"]) == ("worker-1", "127.0.0.1:50123")
    assert m0["deadline"] - m0["delivered_at"] == pytest.approx(60e9, abs=1e3)
    assert m2["deadline"] - m2["delivered_at"] == pytest.approx(30e9, abs=1e3)
    assert m2["delivered_at"] - m0["delivered_at"] == pytest.approx(5e9, abs=1e3)
    assert started - 1e9 < m2["delivered_at"] <= topic.now_ns()  # unix ns, as a timestamp

    deferred = list_messages(channel, "deferred", 10)
    assert deferred["count"] == 1 and bodies(deferred) == ["m3"]
    assert deferred["messages"][0]["attempts"] == 1
    assert deferred["messages"][0]["deadline"] == pytest.approx(started + 30e9, abs=0.5e9)
    assert "client_id" not in deferred["messages"][0]

    queued = list_messages(channel, "queued", 100)
    assert queued["count"] == channel.depth() == 7
    assert bodies(queued) == ["m1", "m4", "m5", "m6", "m7", "m8", "m9"]  # memory, then the log
    assert [row["attempts"] for row in queued["messages"]] == [1] + [0] * 6
    assert all(0 <= row["age_ms"] < 60_000 for row in queued["messages"])
    assert bodies(list_messages(channel, "queued", 3)) == ["m1", "m4", "m5"]
    assert list_messages(channel, "queued", 0)["messages"] == []

    # looking moved nothing: the channel delivers what it would have
    # (take() reads half of what it may from the log first, then memory, then the log again)
    assert [m.body for m in deliver(channel, 10)] == [b"m4", b"m5", b"m6", b"m7", b"m8", b"m1", b"m9"]
    assert list_messages(channel, "queued", 10) == {"topic": "t", "channel": "c", "state": "queued", "count": 0,
                                                     "messages": []}
    kill(topic)


async def test_queued_in_the_log_after_a_kill_skips_what_was_finished_or_deferred(tmp_path, mock_clock):
    """After a restart the channel reads the log again from its oldest unfinished message: the listing
    leaves out what was finished after it and what was deferred (its deadline still ahead), and gives a
    requeued message its attempts."""
    topic = open_topic(tmp_path, mock_clock)
    channel = topic.get_channel("c")
    topic.publish([b"m%d" % i for i in range(8)])
    msgs = deliver(channel, 8)
    channel.finish_messages(CLIENT, [m.id for m in msgs[1:4]])  # m1-m3: finished after m0
    channel.requeue_message(CLIENT, msgs[4].id, 600.0)  # m4: deferred ten minutes
    channel.requeue_message(CLIENT, msgs[5].id, 0.0)  # m5: requeued
    topic.publish([b"later"], 3600.0)
    topic.publish([b"m9"])
    await topic.group.sync_round()
    kill(topic)

    topic = open_topic(tmp_path, mock_clock)
    channel = topic.get_channel("c")
    queued = list_messages(channel, "queued", 100)
    assert bodies(queued) == ["m0", "m5", "m6", "m7", "m9"]
    # what was in flight at the kill comes as its record has it; the requeued one with its attempts
    assert [row["attempts"] for row in queued["messages"]] == [0, 1, 0, 0, 0]
    # counted as /stats counts them: m4 among the queued until read again (then deferred), the deferred
    # publish among the deferred, though not listed (not read yet)
    assert queued["count"] == channel.depth() == 6
    deferred = list_messages(channel, "deferred", 100)
    assert deferred["count"] == channel.deferred_count() == 1 and deferred["messages"] == []
    assert [m.body for m in deliver(channel, 100)] == [b"m0", b"m5", b"m6", b"m7", b"m9"]
    assert bodies(list_messages(channel, "deferred", 100)) == ["m4", "later"]
    kill(topic)


async def test_a_channel_of_an_ephemeral_topic_lists_its_memory(tmp_path, mock_clock):
    topic = Topic(Owner(tmp_path, mock_clock), "e#ephemeral")  # type: ignore[arg-type]
    channel = topic.get_channel("c")
    channel.put_messages([Message(b"%016d" % i, b"\xffm%d" % i) for i in range(3)])
    queued = list_messages(channel, "queued", 2)
    assert queued["count"] == 3 and bodies(queued) == ["\\xffm0", "\\xffm1"]
    assert queued["messages"][0]["id"] == "0000000000000000"
    kill(topic)


# --- the endpoint, through nsqd's routes -------------------------------------------------------------


class Broker:
    """What the HTTP API asks of NSQD for /channel/messages."""

    def __init__(self, topic: Topic, owner: Owner) -> None:
        self.options = owner.options
        self.topics = {topic.name: topic}

    def get_existing_topic(self, name: str) -> Topic | None:
        return self.topics.get(name)


async def get(port: int, target: str) -> tuple[int, Any]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    answer = b""
    while chunk := await stream.receive_some(65536):
        answer += chunk
    await stream.aclose()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


async def test_the_endpoint_answers_and_refuses_as_nsqd(tmp_path, autojump_clock, caplog):
    owner = Owner(tmp_path, autojump_clock, mem_queue_size=0)
    topic = Topic(owner, "t")  # type: ignore[arg-type]
    channel = topic.get_channel("c")
    topic.publish([b"one", b"two"])
    deliver(channel, 1)
    caplog.set_level(logging.INFO, "nsqd")
    site = nsqd_site(Api(Broker(topic, owner)))
    async with trio.open_nursery() as nursery:
        _, port = await nursery.start(functools.partial(serve_site, site, "127.0.0.1:0"))
        status, answer = await get(port, "/channel/messages?topic=t&channel=c&state=in_flight")
        assert status == 200 and answer["count"] == 1 and bodies(answer) == ["one"]
        status, answer = await get(port, "/channel/messages?topic=t&channel=c&state=queued&limit=1")
        assert status == 200 and bodies(answer) == ["two"]
        for target, want in [
            ("/channel/messages?channel=c&state=queued", (400, "MISSING_ARG_TOPIC")),
            ("/channel/messages?topic=bad!&channel=c&state=queued", (400, "INVALID_ARG_TOPIC")),
            ("/channel/messages?topic=t&state=queued", (400, "MISSING_ARG_CHANNEL")),
            ("/channel/messages?topic=nope&channel=c&state=queued", (404, "TOPIC_NOT_FOUND")),
            ("/channel/messages?topic=t&channel=nope&state=queued", (404, "CHANNEL_NOT_FOUND")),
            ("/channel/messages?topic=t&channel=c", (400, "MISSING_ARG_STATE")),
            ("/channel/messages?topic=t&channel=c&state=all", (400, "INVALID_ARG_STATE")),
            ("/channel/messages?topic=t&channel=c&state=queued&limit=1001", (400, "INVALID_ARG_LIMIT")),
            ("/channel/messages?topic=t&channel=c&state=queued&limit=%ZZ", (400, "INVALID_REQUEST")),
        ]:
            status, answer = await get(port, target)
            assert (status, answer) == (want[0], {"message": want[1]}), target
        nursery.cancel_scope.cancel()
    assert "Traceback" not in caplog.text
    # a refused request is one line, nsqd's request line
    lines = [r.getMessage() for r in caplog.records if "state=all" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("400 GET /channel/messages?topic=t&channel=c&state=all ("), lines
    kill(topic)
