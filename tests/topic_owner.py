"""What Topic needs of NSQD, for in-process tests of a topic and its channels (tests/test_topic_log.py,
tests/test_delivery_machine.py), kill -9 done to a topic in process, and a consumer's delivery (deliver, drain)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio.testing

from trio_nsq.broker.channel import Channel
from trio_nsq.broker.message import Message
from trio_nsq.broker.options import Options
from trio_nsq.broker.topic import Topic


class Owner:
    """The TopicOwner protocol: options (node id 1, then `options`), the data path, the clock deadlines
    are kept in (the MockClock's, else the wall clock), and the health reports, kept in `health`
    (`strict`: a report of an error fails the test at once)."""

    def __init__(self, data_path: Path | str, clock: trio.testing.MockClock | None = None, *, strict: bool = False,
                 **options: Any) -> None:
        self.data_path = str(data_path)
        self.clock = clock.current_time if clock is not None else time.time
        self.options = Options()
        self.options.node_id = 1
        for key, value in options.items():
            setattr(self.options, key, value)
        self.strict = strict
        self.health: list[str | None] = []
        self.topics: dict[str, Topic] = {}  # those made through get_topic (dead-letter topics)

    def set_health(self, error: str | None) -> None:
        assert not (self.strict and error is not None), error
        self.health.append(error)

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        raise AssertionError("no clients here")

    def notify_channel(self, channel: Channel, created: bool) -> None:
        return None

    def delete_topic(self, name: str) -> None:
        return None

    def get_topic(self, name: str) -> Topic:
        topic = self.topics.get(name)
        if topic is None:
            topic = self.topics[name] = Topic(self, name)
        return topic


def kill(topic: Topic) -> None:
    """kill -9: every descriptor closed, nothing more written (no sync round, no flush)."""
    topic.group.closed = True
    for channel in topic.channels.values():
        channel.close()
    if topic.log is not None:
        topic.log.close()


CLIENT = 1  # the consumer deliver() puts messages in flight for


def deliver(channel: Channel, n: int = 1000, now: float = 0.0, timeout: float = 60.0) -> list[Message]:
    """What a consumer's message pump does: take, count the attempt, put in flight."""
    msgs = channel.take(n)
    for msg in msgs:
        msg.attempts += 1
    channel.start_in_flight_many(msgs, CLIENT, now, timeout)
    return msgs


def drain(channel: Channel) -> list[bytes]:
    """Deliver and FIN until the channel has nothing left; the bodies in delivery order."""
    out: list[bytes] = []
    while msgs := deliver(channel):
        channel.finish_messages(CLIENT, [m.id for m in msgs])
        out.extend(m.body for m in msgs)
    return out
