"""Queue semantics where nsqd's behaviour is subtle: deletion, --mem-queue-size=0, ephemeral and
deferred messages, and channels learnt from lookupd. Real broker (and lookupd) processes."""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request

from nsq_raw import Message, RawNSQ, take
from processes import BrokerProcess, LookupdProcess
from test_durability import _connect, _read_frame

from trio_nsq.shared.protocol import FrameParser, encode_mpub


def http(broker: BrokerProcess, path: str, body: bytes | None = None) -> bytes:
    request = urllib.request.Request(f"http://{broker.http_address}{path}", data=body,
                                     method="POST" if body is not None else "GET")
    with urllib.request.urlopen(request, timeout=10) as resp:
        return resp.read()


def topic_stats(broker: BrokerProcess, topic: str) -> dict | None:
    doc = json.loads(http(broker, f"/stats?format=json&topic={urllib.parse.quote(topic)}"))
    return next((t for t in doc["topics"] if t["topic_name"] == topic), None)


def read_all(broker: BrokerProcess, topic: str, channel: str, quiet: float = 0.5) -> list[bytes]:
    """Every message the channel delivers until it is quiet for `quiet` seconds, FIN'd."""
    with RawNSQ(broker.tcp_address) as conn:
        conn.sub(topic, channel)
        conn.rdy(2500)
        bodies = []
        while True:
            msgs = [f for f in conn.frames_for(quiet) if isinstance(f, Message)]
            if not msgs:
                return bodies
            for msg in msgs:
                bodies.append(msg.body)
                conn.fin(msg.id)


def test_delete_then_publish_keeps_exactly_the_new_messages(broker_factory):
    """Each round: 2,000 messages go to disk (in 200 files), the topic (with a channel) is deleted, and new messages are
    published the moment the delete has answered. Old files must be gone by then: the new topic may not
    read the old metadata (old messages back) nor lose its files to the old deletion."""
    broker = broker_factory(mem_queue_size=10, max_bytes_per_file=400)
    topic = "deleted"
    with _connect(broker) as pub:
        parser = FrameParser()
        for round_no in range(15):
            old = [b"old-%d-%d" % (round_no, i) for i in range(2000)]
            pub.sendall(encode_mpub(topic, old))
            assert _read_frame(pub, parser) == (0, b"OK")
            http(broker, f"/channel/create?topic={topic}&channel=c", b"")
            http(broker, f"/topic/delete?topic={topic}", b"")
            new = [b"new-%d-%d" % (round_no, i) for i in range(30)]
            pub.sendall(encode_mpub(topic, new))
            assert _read_frame(pub, parser) == (0, b"OK")
            if round_no < 14:
                http(broker, f"/topic/delete?topic={topic}", b"")
    assert topic_stats(broker, topic)["depth"] == 30
    broker.stop()
    broker.start()
    assert topic_stats(broker, topic)["depth"] == 30
    assert sorted(read_all(broker, topic, "c")) == sorted(new)


def test_ephemeral_channel_with_mem_queue_size_0_gets_messages_handed_off(broker_factory):
    """nsq_tail's case: an #ephemeral channel on a durable broker run with --mem-queue-size=0. nsqd's
    memory queue is a Go channel of size 0, so a message reaches a consumer that waits for it."""
    broker = broker_factory(mem_queue_size=0)
    with RawNSQ(broker.tcp_address) as conn:
        conn.sub("tailed", "tail#ephemeral")
        conn.rdy(100)
        bodies = [b"tail-%d" % i for i in range(50)]
        for body in bodies:
            http(broker, "/pub?topic=tailed", body)
        got = []
        for _ in bodies:
            msg = conn.expect_message(timeout=5)
            got.append(msg.body)
            conn.fin(msg.id)
    assert sorted(got) == sorted(bodies)


def test_deferred_publish_with_mem_queue_size_0_keeps_its_delay(broker_factory):
    broker = broker_factory(mem_queue_size=0)
    http(broker, "/topic/create?topic=later", b"")
    with RawNSQ(broker.tcp_address) as conn:
        conn.sub("later", "c")
        conn.rdy(10)
        published = time.monotonic()
        http(broker, "/pub?topic=later&defer=1500", b"deferred")
        http(broker, "/pub?topic=later&defer=1500", b"again")  # the same query, kept checked: deferred too
        conn.dpub("later", 1500, b"dpub")
        conn.expect_no_frame(1.0)  # a record on disk would carry no delay: delivered at once
        got = {conn.expect_message(timeout=5).body for _ in range(3)}
        assert got == {b"deferred", b"again", b"dpub"}
        assert time.monotonic() - published >= 1.4


def test_mem_queue_size_0_gives_every_durable_channel_the_message_as_published(broker_factory):
    """With --mem-queue-size=0 the topic pump hands its disk records to the channels' disk queues as they
    are (no decode and encode on the way): each channel gets every message once, in order, with the id
    and timestamp it was published with; a channel without a disk queue (#ephemeral, subscribed) gets
    its copy as before."""
    broker = broker_factory(mem_queue_size=0)
    http(broker, "/topic/create?topic=fan", b"")
    for channel in ("a", "b"):
        http(broker, f"/channel/create?topic=fan&channel={channel}", b"")
    first = [b"first-%d" % i for i in range(300)]
    with RawNSQ(broker.tcp_address) as pub:
        pub.mpub("fan", first)
        got_a, got_b = take(broker.tcp_address, "fan", "a", 300), take(broker.tcp_address, "fan", "b", 300)
        assert [m.body for m in got_a] == first
        assert [(m.id, m.timestamp, m.body, m.attempts) for m in got_a] == \
               [(m.id, m.timestamp, m.body, m.attempts) for m in got_b]
        assert len({m.id for m in got_a}) == 300
        with RawNSQ(broker.tcp_address) as tail:  # a third channel, in memory only
            tail.sub("fan", "tail#ephemeral")
            tail.rdy(100)
            second = [b"second-%d" % i for i in range(50)]
            pub.mpub("fan", second)
            assert [m.body for m in tail.expect_messages(50, timeout=10)] == second
    for channel in ("a", "b"):
        assert [m.body for m in take(broker.tcp_address, "fan", channel, 50)] == second
    stats = topic_stats(broker, "fan")
    assert stats is not None and stats["message_count"] == 350
    counts = {c["channel_name"]: (c["message_count"], c["depth"]) for c in stats["channels"]}
    assert counts["a"] == counts["b"] == (350, 0), counts


def test_durable_channel_of_an_ephemeral_topic_overflows_to_its_own_disk_queue(broker_factory):
    """nsqd gives such a channel a disk queue named `t#ephemeral:c`: its overflow is kept, so the topic
    (which has no backend) never has to drop what the channel cannot hold in memory."""
    broker = broker_factory(mem_queue_size=10)
    topic = "fleeting#ephemeral"
    # the topic's pump runs before SUB: a topic created by SUB starts it a few scheduling rounds after the
    # answer, which a client reading the stats at once can overtake (then, as in nsqd, what the pump is not
    # there to receive is dropped)
    http(broker, f"/topic/create?topic={urllib.parse.quote(topic)}", b"")
    with RawNSQ(broker.tcp_address) as conn:
        conn.sub(topic, "kept")  # a durable channel: it stays after this consumer leaves
        conn.rdy(0)
        # As in nsqd, what gets past the topic's 10-message memory queue is what its pump is there to
        # receive: publish once the pump, woken by the new channel, waits again (a stats round trip).
        deadline = time.monotonic() + 5
        while not (topic_stats(broker, topic) or {}).get("channels") and time.monotonic() < deadline:
            time.sleep(0.02)
        bodies = [b"e-%d" % i for i in range(300)]
        conn.mpub(topic, bodies)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        stats = topic_stats(broker, topic)
        if stats and stats["channels"] and stats["channels"][0]["depth"] == 300:
            break
        time.sleep(0.05)
    assert stats["channels"][0]["depth"] == 300, stats
    assert (broker.data_path / f"{topic}:kept.diskqueue.000000.dat").exists()
    assert sorted(read_all(broker, topic, "kept")) == sorted(bodies)


def test_a_new_topic_gets_the_channels_lookupd_knows(broker_factory, tmp_path):
    """Consumers subscribed through lookupd on broker A; the topic's first message lands on broker B.
    As nsqd does, B asks its lookupds for the topic's channels when it creates the topic, so the
    message is kept for those consumers' channel."""

    lookupd = LookupdProcess(tmp_path, broadcast_address="127.0.0.1").start()
    try:
        flags = {"lookupd_tcp_address": f"127.0.0.1:{lookupd.tcp_port}", "broadcast_address": "127.0.0.1"}
        a = broker_factory(**flags)
        b = broker_factory(**flags)
        with RawNSQ(a.tcp_address) as conn:
            conn.sub("spread", "remote")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                channels = lookupd.http.get("/channels", params={"topic": "spread"}).json()["channels"]
                ports = {p["tcp_port"] for p in lookupd.http.get("/nodes").json()["producers"]}
                if channels == ["remote"] and b.tcp_port in ports:
                    break
                time.sleep(0.05)
            assert channels == ["remote"] and b.tcp_port in ports
            for i in range(5):
                http(b, "/pub?topic=spread", b"m%d" % i)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                stats = topic_stats(b, "spread")
                if stats["channels"] and stats["channels"][0]["depth"] == 5:
                    break
                time.sleep(0.05)
            assert [(c["channel_name"], c["depth"]) for c in stats["channels"]] == [("remote", 5)]
        # the lookupd query is nsqd's business, not a library's: no httpx "HTTP Request: ..." lines
        assert "HTTP Request:" not in b.log_text()
    finally:
        lookupd.stop()
