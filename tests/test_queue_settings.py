"""Settings per topic and channel (broker/queue_settings.py), in process under MockClock: how they are
parsed and resolved, max attempts and the dead-letter topic (with kill -9 during the move), re-drive,
message TTL, and the maximum depth with either policy."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from trio_nsq.broker.channel import Channel
from trio_nsq.broker.options import Options
from trio_nsq.broker.queue_settings import QueueSettings, SettingsError, default_dead_letter_topic, parse_updates, resolve
from trio_nsq.broker.topic import DEAD_LETTERS_CHANNEL, Topic, TopicFull
from tests.topic_owner import CLIENT, Owner, deliver, drain, kill



def owner(d: Path, clock: trio.testing.MockClock | None = None, **options: Any) -> Owner:
    """A TopicOwner whose wall clock is now plus the MockClock's time: publish timestamps and TTLs too."""
    own = Owner(d, clock, **options)
    if clock is not None:
        start = time.time()
        own.clock = lambda: start + clock.current_time()
    return own


def configure(topic: Topic, channel: Channel | None = None, **values: str) -> None:
    """What POST /topic/config or /channel/config does with a query."""
    changes = parse_updates({k: [v] for k, v in values.items()}, topic=topic.name,
                            channel=channel.name if channel else "")
    (channel.settings if channel else topic.settings).update(changes)
    topic.apply_settings()


async def dead_letters_on_disk(own: Owner) -> None:
    """The round that puts the dead-letter topics' channels on disk (POST /channel/config awaits it)."""
    for topic in own.topics.values():
        await topic.group.sync_round()


async def limited(d: Path, clock: trio.testing.MockClock, max_attempts: int) -> tuple[Owner, Topic, Channel]:
    """Topic t (no memory queue) and its channel c with max_attempts, its dead-letter topic on disk."""
    own = owner(d, clock, mem_queue_size=0)
    topic = Topic(own, "t")  # type: ignore[arg-type]
    channel = topic.get_channel("c")
    configure(topic, channel, max_attempts=str(max_attempts))
    await dead_letters_on_disk(own)
    return own, topic, channel


async def restart(own: Owner, topic: Topic, synced: bool = True) -> Topic:
    """kill -9 of topic t and of the dead-letter topics (after a sync round of each, if `synced`), and
    t opened again; the dead-letter topics open again through own.get_topic."""
    # a message moved from one topic to another is finished where it was once the other topic's round has
    # made the copy durable, and that finish is persisted by a round of its own topic: two rounds of each
    # (as their io loops would run them) cover moves both ways (dead letters, and a re-drive)
    for _ in range(2 if synced else 0):
        for each in (*own.topics.values(), topic):
            await each.group.sync_round()
    for each in (*own.topics.values(), topic):
        kill(each)
    own.topics.clear()
    return Topic(own, "t")  # type: ignore[arg-type]


# --- parsing and resolving --------------------------------------------------------------------------


def test_values_are_checked_and_an_empty_one_unsets():
    assert parse_updates({"topic": ["t"], "max_depth": ["10"], "depth_policy": ["drop-oldest"],
                          "message_ttl": ["1h30m"], "max_attempts": ["5"], "dead_letter_topic": [""]},
                         topic="t", channel="c") == {
        "max_depth": 10, "depth_policy": "drop-oldest", "message_ttl": 5400.0, "max_attempts": 5,
        "dead_letter_topic": None}
    for key, value in [("max_depth", "-1"), ("max_depth", "ten"), ("depth_policy", "block"),
                       ("message_ttl", "soon"), ("message_ttl", "-1s"), ("max_attempts", "65536"),
                       ("dead_letter_topic", "bad name"), ("dead_letter_topic", "x#ephemeral"),
                       ("expired_to_dead_letter", "maybe")]:
        with pytest.raises(SettingsError, match=f"INVALID_ARG_{key.upper()}"):
            parse_updates({key: [value]}, topic="t", channel="c")
    with pytest.raises(SettingsError, match="INVALID_ARG_COLOUR"):
        parse_updates({"colour": ["red"]}, topic="t")
    with pytest.raises(SettingsError, match="INVALID_ARG_DEAD_LETTER_TOPIC"):
        parse_updates({"dead_letter_topic": ["t"]}, topic="t", channel="c")  # into what it reads


def test_a_channel_setting_wins_over_its_topics_which_wins_over_the_flag():
    opts = Options()
    opts.max_depth = 100
    topic, channel = QueueSettings(max_depth=50, max_attempts=3), QueueSettings(max_depth=10)
    resolved = resolve(opts, channel, topic, topic="orders", channel="billing")
    assert (resolved.max_depth, resolved.max_attempts, resolved.mem_queue_size) == (10, 3, opts.mem_queue_size)
    assert resolved.dead_letter_topic == "orders-billing-dlq"
    assert resolve(opts, QueueSettings(), topic="orders").max_depth == 100
    assert default_dead_letter_topic("t#ephemeral", "c#ephemeral") == "t-c-dlq"
    assert default_dead_letter_topic("t" * 40, "c" * 30) == ""  # past 64 characters: one must be given
    saved = QueueSettings(message_ttl=90.0, depth_policy="drop-oldest", expired_to_dead_letter=True)
    assert saved.to_json() == {"depth_policy": "drop-oldest", "message_ttl": "1m30s", "expired_to_dead_letter": True}
    assert QueueSettings.from_json(saved.to_json()) == saved
    assert QueueSettings.from_json({"max_depth": "lots", "max_attempts": 4}) == QueueSettings(max_attempts=4)


# --- max attempts and the dead-letter topic -----------------------------------------------------------


async def test_a_poison_message_reaches_the_dead_letter_topic_after_its_attempts_and_nowhere_else(tmp_path, mock_clock):
    own, topic, channel = await limited(tmp_path, mock_clock, 3)
    topic.publish([b"poison", b"good"])
    for attempt in (1, 2, 3):
        msgs = deliver(channel)
        assert [(m.body, m.attempts) for m in msgs] == ([(b"poison", attempt), (b"good", 1)] if attempt == 1
                                                        else [(b"poison", attempt)])
        for msg in msgs:
            if msg.body == b"poison":
                channel.requeue_message(CLIENT, msg.id, 0.0)
            else:
                channel.finish_message(CLIENT, msg.id)
    assert channel.dead_lettered_count == 1 and channel.depth() == 0 and not channel.in_flight
    dead_topic = own.topics["t-c-dlq"]
    dead = dead_topic.channels[DEAD_LETTERS_CHANNEL]
    assert [(m.body, m.attempts) for m in dead.take(10)] == [(b"poison", 0)]
    # a timeout at the maximum dead-letters too
    topic.publish([b"slow"])
    for attempt in (1, 2, 3):
        assert [m.body for m in deliver(channel, now=trio.current_time(), timeout=10.0)] == [b"slow"]
        mock_clock.jump(11)
        assert channel.process_in_flight_queue(trio.current_time())
    assert channel.dead_lettered_count == 2 and channel.timeout_count == 3 and channel.depth() == 0
    topic = await restart(own, topic)
    assert drain(topic.get_channel("c")) == []  # nowhere else after a restart
    dead = own.get_topic("t-c-dlq").get_channel(DEAD_LETTERS_CHANNEL)
    assert sorted(drain(dead)) == [b"poison", b"slow"]


async def test_a_kill_9_during_the_move_leaves_the_message_in_one_of_the_two_at_least(tmp_path, mock_clock):
    """The dead-letter topic's log is written before the channel finishes the message: a kill -9 right
    after the move (nothing synced) finds it in the dead-letter topic, and perhaps again in its channel."""
    own, topic, channel = await limited(tmp_path, mock_clock, 1)
    topic.publish([b"poison-%d" % i for i in range(50)])
    await topic.group.sync_round()
    for msg in deliver(channel):
        channel.requeue_message(CLIENT, msg.id, 0.0)  # each one past its single attempt: moved
    assert channel.dead_lettered_count == 50
    topic = await restart(own, topic, synced=False)
    again = drain(topic.get_channel("c"))
    dead = drain(own.get_topic("t-c-dlq").get_channel(DEAD_LETTERS_CHANNEL))
    assert sorted(dead) == sorted(b"poison-%d" % i for i in range(50))  # none lost
    assert set(again) <= set(dead)


async def test_nothing_is_moved_before_the_dead_letter_topic_is_on_disk(tmp_path, mock_clock):
    """A kill -9 before the dead-letter channel's first round would restart it at its log's end, past
    what was moved: the message waits (deferred a second) until that round has been."""
    own = owner(tmp_path, mock_clock, mem_queue_size=0)
    topic = Topic(own, "t")  # type: ignore[arg-type]
    channel = topic.get_channel("c")
    configure(topic, channel, max_attempts="1")
    topic.publish([b"poison"])
    [msg] = deliver(channel)
    channel.requeue_message(CLIENT, msg.id, 0.0)
    assert channel.dead_lettered_count == 0 and len(channel.deferred) == 1
    await dead_letters_on_disk(own)
    mock_clock.jump(1.5)
    assert channel.process_deferred_queue(trio.current_time())  # moved then, not delivered again
    assert channel.dead_lettered_count == 1 and channel.depth() == 0 and not channel.deferred
    kill(topic)


async def test_redrive_moves_the_dead_letters_back_with_their_attempts_reset(tmp_path, mock_clock):
    own, topic, channel = await limited(tmp_path, mock_clock, 1)
    topic.publish([b"a", b"b", b"c"])
    for msg in deliver(channel):
        channel.requeue_message(CLIENT, msg.id, 0.0)
    dead_topic = own.topics["t-c-dlq"]
    dead = dead_topic.channels[DEAD_LETTERS_CHANNEL]
    assert dead.depth() == 3
    assert channel.redrive_from(dead, 2) == 2 and channel.redrive_from(dead, 2) == 1
    assert channel.redrive_from(dead, 2) == 0 and dead.depth() == 0
    topic = await restart(own, topic)
    channel = topic.get_channel("c")
    msgs = deliver(channel)
    assert sorted((m.body, m.attempts) for m in msgs) == [(b"a", 1), (b"b", 1), (b"c", 1)]  # a fresh start
    assert drain(own.get_topic("t-c-dlq").get_channel(DEAD_LETTERS_CHANNEL)) == []


# --- message TTL ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("memory", [False, True])
async def test_an_expired_message_is_not_delivered_and_is_counted(tmp_path, mock_clock, memory):
    own = owner(tmp_path, mock_clock, mem_queue_size=100 if memory else 0)
    topic = Topic(own, "t")  # type: ignore[arg-type]
    channel = topic.get_channel("c")
    configure(topic, message_ttl="60s")  # the topic's, so the channel's too
    topic.publish([b"old-%d" % i for i in range(5)])
    mock_clock.jump(61)
    topic.publish([b"new"])
    if memory:
        topic._hand(100)
    assert drain(channel) == [b"new"]
    assert channel.expired_count == 5 and channel.depth() == 0
    configure(topic, channel, expired_to_dead_letter="true")
    await dead_letters_on_disk(own)
    topic.publish([b"late"])
    if memory:
        topic._hand(100)
    mock_clock.jump(61)
    assert drain(channel) == []
    assert channel.expired_count == 6 and channel.dead_lettered_count == 1
    assert drain(own.topics["t-c-dlq"].channels[DEAD_LETTERS_CHANNEL]) == [b"late"]
    kill(topic)


async def test_a_backlog_of_expired_messages_is_gone_through_a_turn_at_a_time(tmp_path, mock_clock):
    """70,000 expired messages and one fresh one: a take finds at most EXPIRED_PER_TURN expired before it
    returns (nothing, the pump woken for the next turn); the next finds the rest and the fresh one."""
    topic = Topic(owner(tmp_path, mock_clock, mem_queue_size=0), "t")  # type: ignore[arg-type]
    channel = topic.get_channel("c")
    configure(topic, channel, message_ttl="1m")
    for at in range(0, 70_000, 5_000):
        topic.publish([b"old"] * 5_000)
    mock_clock.jump(61)
    topic.publish([b"new"])
    takes = []
    while not (msgs := channel.take(100)) or msgs[0].body != b"new":
        takes.append(len(msgs))
        assert len(takes) < 5
    assert takes == [0] and channel.expired_count == 70_000 and channel.depth() == 0
    kill(topic)


# --- maximum depth --------------------------------------------------------------------------------------


async def test_a_publish_past_the_maximum_depth_is_refused_whole(tmp_path, mock_clock):
    topic = Topic(owner(tmp_path, mock_clock, mem_queue_size=0), "t")  # type: ignore[arg-type]
    a, b = topic.get_channel("a"), topic.get_channel("b")
    configure(topic, b, max_depth="5")
    topic.publish([b"%d" % i for i in range(4)])
    with pytest.raises(TopicFull, match="channel b is at its maximum depth 5"):
        topic.publish([b"x", b"y"])  # an MPUB is all or nothing
    topic.publish([b"4"])
    assert (a.depth(), b.depth(), b.refused_count, a.refused_count) == (5, 5, 1, 0)
    deliver(b, 2)  # in flight does not count in the depth
    topic.publish([b"5", b"6"])
    assert drain(a) == [b"%d" % i for i in range(7)]
    configure(topic, b, max_depth="")  # unset: no limit
    assert not topic.limited
    topic.publish([b"z"] * 10)
    kill(topic)


async def test_a_topic_without_channels_refuses_past_its_own_maximum(tmp_path, mock_clock):
    topic = Topic(owner(tmp_path, mock_clock), "t")  # type: ignore[arg-type]
    configure(topic, max_depth="3")
    topic.publish([b"1", b"2", b"3"])
    with pytest.raises(TopicFull):
        topic.publish([b"4"])
    assert topic.depth() == 3 and topic.refused_count == 1
    kill(topic)


@pytest.mark.parametrize("memory", [False, True])
async def test_drop_oldest_keeps_the_newest_and_counts_the_rest(tmp_path, mock_clock, memory):
    topic = Topic(owner(tmp_path, mock_clock, mem_queue_size=4 if memory else 0), "t")  # type: ignore[arg-type]
    channel = topic.get_channel("c")
    configure(topic, channel, max_depth="5", depth_policy="drop-oldest")
    for i in range(8):
        topic.publish([b"%d" % i])
        if memory:
            topic._hand(100)
    assert channel.depth() == 5 and channel.dropped_count == 3
    assert sorted(drain(channel)) == [b"%d" % i for i in range(3, 8)]  # the log's and memory's, interleaved
    await topic.group.sync_round()
    kill(topic)
    topic = Topic(owner(tmp_path, mock_clock, mem_queue_size=0), "t")  # type: ignore[arg-type]
    assert drain(topic.get_channel("c")) == []  # what was dropped is finished, not back after a restart
