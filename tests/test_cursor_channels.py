"""A cursor is not a consumer's channel (issue 49 items 5 and 6, the broker's side).

A channel made by POST /log/commit is a cursor: the flag is in nsqd.dat (`"cursor":true`, a key Go nsqd's
decoder ignores) and survives kill -9 and a clean restart. A commit to a channel with consumers, or to one
not made as a cursor, is refused (409 CHANNEL_HAS_CONSUMERS / CHANNEL_NOT_A_CURSOR) and the channel's
messages, in memory, in flight and deferred, are all still delivered; `adopt=true` makes a channel without
consumers a cursor (a cursor an older trio-nsq made has no flag). A SUB to a cursor is refused with
E_SUB_FAILED and the connection closed, as nsqd does when a channel will not take a client. A cursor not
committed for --cursor-idle-timeout stops pinning the topic's log (one WARNING, shown in /stats) until its
next commit: under trio's MockClock in process, and with a short flag on a broker process."""

from __future__ import annotations

import json
import logging
from typing import Any

import trio
import trio.testing
from nsq_raw import RawNSQ
from processes import BrokerProcess, wait_for
from test_log_api import call, get_json, publish, read_range, synced_end

from tests.topic_owner import Owner
from trio_nsq.broker.stats import ChannelStats, E2eLatency, NsqdStats, TopicStats
from trio_nsq.broker.stats_json import stats_json
from trio_nsq.broker.stats_text import stats_text
from trio_nsq.broker.topic import Topic


def refused(broker: BrokerProcess, path: str) -> tuple[int, str | None]:
    """(status, NSQ's message) of a POST; the message is None for an answer without one (a 200)."""
    status, _, body = call(broker, path, "POST")
    return status, json.loads(body).get("message")


def channel_stats(broker: BrokerProcess, topic: str, channel: str) -> dict[str, Any]:
    for t in get_json(broker, f"/stats?format=json&topic={topic}")["topics"]:
        for c in t["channels"]:
            if c["channel_name"] == channel:
                return c
    raise AssertionError(f"no channel {topic}:{channel} in /stats")


def log_lines(broker: BrokerProcess, text: str) -> list[str]:
    return [line for line in broker.log_text().splitlines() if text in line]


def test_a_commit_to_a_consumers_channel_is_refused_and_every_message_is_still_delivered(broker_factory):
    broker = broker_factory(sync_timeout="50ms")
    bodies = {b"m-%02d" % i for i in range(10)}
    with RawNSQ(broker.tcp_address) as consumer:
        consumer.sub("t", "workers")
        publish(broker, "t", sorted(bodies))
        consumer.rdy(3)
        first = consumer.expect_messages(3)
        consumer.req(first[0].id, 1500)  # deferred; its RDY room brings a fourth in flight
        in_flight = first[1:] + consumer.expect_messages(1)
        # a typo, or the group's own name, in a positional reader's commit: refused, nothing dropped
        assert refused(broker, "/log/commit?topic=t&channel=workers&position=0") == (409, "CHANNEL_HAS_CONSUMERS")
        assert len(log_lines(broker, "CHANNEL_HAS_CONSUMERS")) == 1
        assert refused(broker, "/log/commit?topic=t&channel=workers&position=0&adopt=true") == (
            409, "CHANNEL_HAS_CONSUMERS")
        got = {m.body for m in first[1:]} | {m.body for m in in_flight}
        for msg in in_flight:
            consumer.fin(msg.id)
        consumer.rdy(10)
        while got != bodies:
            msg = consumer.expect_message(timeout=10)
            assert msg.body not in got or msg.body == first[0].body, msg
            got.add(msg.body)
            consumer.fin(msg.id)
    # no consumer now, but it was not made as a cursor: refused too, and its next messages still come
    wait_for(lambda: channel_stats(broker, "t", "workers")["client_count"] == 0)
    assert refused(broker, "/log/commit?topic=t&channel=workers&position=0") == (409, "CHANNEL_NOT_A_CURSOR")
    publish(broker, "t", [b"after"])
    with RawNSQ(broker.tcp_address) as consumer:
        consumer.sub("t", "workers")
        consumer.rdy(5)
        assert consumer.expect_message(timeout=10).body == b"after"
        consumer.expect_no_frame(0.3)


def test_a_sub_to_a_cursor_is_refused_with_E_SUB_FAILED_and_the_flag_survives_restarts(broker_factory):
    broker = broker_factory(sync_timeout="50ms")
    assert get_json(broker, "/log/commit?topic=p&channel=query&position=0", "POST")["position"] == 0

    def sub_refused() -> None:
        with RawNSQ(broker.tcp_address) as client:
            client.command("SUB", "p", "query")
            error = client.expect_error()
            assert error.code == "E_SUB_FAILED", error
            assert client.is_closed_by_peer(5.0)  # a fatal error, as nsqd's SUB failures

    sub_refused()
    stats = channel_stats(broker, "p", "query")
    assert stats["client_count"] == 0 and stats["cursor"]["pins_retention"] is True
    assert stats["cursor"]["last_commit"] > 0
    broker.kill()  # the flag is in the metadata journal
    broker.restart()
    sub_refused()
    assert get_json(broker, "/log/commit?topic=p&channel=query&position=0", "POST")["position"] == 0
    broker.stop()  # a clean exit writes nsqd.dat as Go's, with the flag Go ignores
    meta = broker.metadata()
    assert meta is not None
    assert meta["topics"][0]["channels"] == [{"name": "query", "paused": False, "cursor": True}]
    broker.start()
    sub_refused()
    # /stats after a restart: a cursor not committed since the start has no last commit time
    assert channel_stats(broker, "p", "query")["cursor"] == {"last_commit": None, "pins_retention": True}
    # a consumer channel beside it: no cursor key set
    publish(broker, "p", [b"x"])
    with RawNSQ(broker.tcp_address) as consumer:
        consumer.sub("p", "workers")
    assert "cursor" not in channel_stats(broker, "p", "workers")


def test_a_cursor_an_older_version_made_is_adopted_only_when_asked(broker_factory):
    """An older trio-nsq wrote no flag: its cursor is a channel like any other in nsqd.dat (as one made by
    /channel/create is). A commit is refused until one names `adopt=true`; from then on it is a cursor."""
    broker = broker_factory(sync_timeout="50ms")
    assert call(broker, "/topic/create?topic=p", "POST")[0] == 200
    assert call(broker, "/channel/create?topic=p&channel=old", "POST")[0] == 200
    assert refused(broker, "/log/commit?topic=p&channel=old&position=0") == (409, "CHANNEL_NOT_A_CURSOR")
    assert refused(broker, "/log/commit?topic=p&channel=old&position=0&adopt=nope") == (400, "INVALID_ARG_ADOPT")
    assert refused(broker, "/log/commit?topic=p&channel=old&position=0&adopt=true") == (200, None)
    assert len(log_lines(broker, "adopted as a cursor")) == 1
    assert refused(broker, "/log/commit?topic=p&channel=old&position=0") == (200, None)
    broker.kill()
    broker.restart()
    with RawNSQ(broker.tcp_address) as client:
        client.command("SUB", "p", "old")
        assert client.expect_error().code == "E_SUB_FAILED"


def test_an_idle_cursor_stops_pinning_the_log_and_a_commit_pins_it_again(broker_factory):
    broker = broker_factory(max_bytes_per_file=4096, sync_timeout="50ms", cursor_idle_timeout="1s")
    assert get_json(broker, "/log/commit?topic=p&channel=query&position=0", "POST")["position"] == 0
    publish(broker, "p", [b"r-%03d" % i + b"y" * 200 for i in range(200)])
    info = synced_end(broker, "p", 200)
    records = read_range(broker, "p", 0, info["end"])
    # idle past the timeout: it says so once, /stats shows it, and the segments it kept go
    wait_for(lambda: not channel_stats(broker, "p", "query")["cursor"]["pins_retention"], timeout=20)
    wait_for(lambda: get_json(broker, "/log/positions?topic=p")["first"] > 0, timeout=20)
    assert len(log_lines(broker, "no longer keeps")) == 1
    assert channel_stats(broker, "p", "query")["depth"] >= 0  # its position is gone: /stats still answers
    # a commit to a position gone answers as ever, and the cursor stays idle
    assert refused(broker, "/log/commit?topic=p&channel=query&position=0") == (404, "POSITION_GONE")
    assert channel_stats(broker, "p", "query")["cursor"]["pins_retention"] is False
    # a commit to a position kept: it pins again from there
    last = records[-1][0]
    assert get_json(broker, f"/log/commit?topic=p&channel=query&position={last}", "POST")["depth"] == 1
    assert channel_stats(broker, "p", "query")["cursor"]["pins_retention"] is True


def test_stats_json_writes_the_cursor_key_on_cursors_only():
    from trio_nsq.broker.stats import CursorStats  # (not on main: imported here, the other tests run there)

    def channel(name: str, cursor: CursorStats | None) -> ChannelStats:
        return ChannelStats(name, 1, 2, 3, 4, 5, 6, 7, 0, None, False, E2eLatency(), cursor=cursor)

    chans = (channel("c", None), channel("q", CursorStats(1700000000123, False)), channel("r", CursorStats(None, True)))
    topic = TopicStats("t", chans, 0, 0, 0, 0, False, E2eLatency(), 0, 0, 0, 0, 0, 0)
    doc = json.loads(stats_json(NsqdStats("OK", 1, (topic,), None, None)))
    assert [c.get("cursor", "absent") for c in doc["topics"][0]["channels"]] == [
        "absent", {"last_commit": 1700000000123, "pins_retention": False}, {"last_commit": None, "pins_retention": True}]
    text = stats_text(NsqdStats("OK", 1, (topic,), None, None))
    assert text.count("cursor: idle") == 1 and text.count("cursor: keeps the log") == 1


class Owner49(Owner):
    """Owner and the metadata writes a cursor's idle change asks for (counted)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.persisted: list[tuple[str, str]] = []

    def persist_metadata(self, topic: str, channel: str = "") -> None:
        self.persisted.append((topic, channel))


async def test_idle_cursor_under_mock_clock(tmp_path, mock_clock, caplog):
    """Exactly at --cursor-idle-timeout after its last commit, not before, the cursor stops keeping the
    log (one WARNING, the metadata told); segments go at the next round; a commit keeps them again."""
    owner = Owner49(tmp_path, mock_clock, max_bytes_per_file=4096, cursor_idle_timeout=3600.0)
    topic = Topic(owner, "t")  # type: ignore[arg-type]
    log_ = topic.log
    assert log_ is not None
    topic.keep_whole_log()
    channel = topic.get_channel("query")
    channel.make_cursor()
    channel.commit(0, 0)
    for i in range(100):
        topic.publish([b"r-%03d" % i + b"y" * 200])
    await topic.group.sync_round()
    assert log_.first_position() == 0 and log_.segments.first_file < log_.segments.write_file_num
    mock_clock.jump(3599)
    channel.process_in_flight_queue(trio.current_time())
    await topic.group.sync_round()
    assert channel.pins and log_.first_position() == 0
    caplog.set_level(logging.WARNING, "nsqd")
    mock_clock.jump(1)
    channel.process_in_flight_queue(trio.current_time())
    channel.process_in_flight_queue(trio.current_time())
    assert not channel.pins
    assert [r.levelname for r in caplog.records if "no longer keeps" in r.getMessage()] == ["WARNING"]
    assert owner.persisted == [("t", "query")]
    await topic.group.sync_round()
    assert log_.segments.first_file == log_.segments.write_file_num  # only what the topic writes to
    # a commit at a position still kept: it pins again, and what is after it stays
    kept = log_.first_position()
    channel.commit(kept, log_.index.locate(kept, log_.durable_tail).index)
    assert channel.pins and owner.persisted == [("t", "query")] * 2
    for i in range(100):
        topic.publish([b"s-%03d" % i + b"y" * 200])
    await topic.group.sync_round()
    assert log_.first_position() == kept and log_.segments.first_file < log_.segments.write_file_num
    topic.group.closed = True
    channel.close()
    log_.close()
