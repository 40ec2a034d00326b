"""What Topic needs of NSQD, for in-process tests of a topic and its channels (tests/test_topic_log.py,
tests/test_delivery_machine.py), and kill -9 done to a topic in process."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio.testing

from trio_nsq.broker.channel import Channel
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
