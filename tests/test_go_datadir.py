"""A data directory written by Go nsqd 1.3.0 loads here, and ours is what Go nsqd reads.

The Go side's bytes are built here from the formats (checked once by hand against a directory the real
nsqd 1.3.0 wrote with the same steps: `"topics":null` before any topic, `"channels":null` for a topic
without channels, compact JSON in the key order name, paused, channels; go-diskqueue files and meta).
The same steps against trio-nsqd must leave the same nsqd.dat, byte for byte, and files Go reads.
"""

from __future__ import annotations

import json
import struct
import time
import urllib.request
from pathlib import Path

import pytest

from processes import BrokerProcess
from nsq_raw import RawNSQ, take

GO_EMPTY_NSQD_DAT = b'{"topics":null,"version":"1.3.0"}'
# what nsqd 1.3.0 wrote after: create topic "empty"; topic "withch" with channels c1 and c2, c2 paused;
# topic "paused", paused; three messages published to each topic, --mem-queue-size=0
GO_NSQD_DAT = (
    b'{"topics":[{"name":"empty","paused":false,"channels":null},'
    b'{"name":"withch","paused":false,"channels":[{"name":"c1","paused":false},{"name":"c2","paused":true}]},'
    b'{"name":"paused","paused":true,"channels":null}],"version":"1.3.0"}'
)


def go_record(msg_id: bytes, body: bytes, timestamp: int = 1_700_000_000_000_000_000, attempts: int = 0) -> bytes:
    """One go-diskqueue record holding one message: [len][timestamp][attempts][16-byte id][body]."""
    message = struct.pack(">qH", timestamp, attempts) + msg_id + body
    return struct.pack(">i", len(message)) + message


def write_queue(data: Path, name: str, bodies: list[bytes], read: int = 0) -> None:
    """A go-diskqueue (data file 0 and meta) holding `bodies`, the first `read` of them already read."""
    records = [go_record(b"%016x" % (0x18a685037a269000 + i), body) for i, body in enumerate(bodies)]
    blob = b"".join(records)
    (data / f"{name}.diskqueue.000000.dat").write_bytes(blob)
    read_pos = sum(len(r) for r in records[:read])
    (data / f"{name}.diskqueue.meta.dat").write_text(f"{len(bodies) - read}\n0,{read_pos}\n0,{len(blob)}\n")


def go_data_dir(data: Path) -> dict[tuple[str, str], list[bytes]]:
    """The directory Go nsqd leaves; returns what each (topic, channel) must deliver."""
    (data / "nsqd.dat").write_bytes(GO_NSQD_DAT)
    write_queue(data, "empty", [b"n1", b"n2", b"n3"])
    write_queue(data, "paused", [b"p1", b"p2", b"p3"])
    write_queue(data, "withch", [b"w1", b"w2", b"w3"], read=3)  # the pump moved them to the channels
    write_queue(data, "withch:c1", [b"w1", b"w2", b"w3"])
    write_queue(data, "withch:c2", [b"w1", b"w2", b"w3"])
    return {("empty", "new"): [b"n1", b"n2", b"n3"], ("paused", "new"): [b"p1", b"p2", b"p3"],
            ("withch", "c1"): [b"w1", b"w2", b"w3"], ("withch", "c2"): [b"w1", b"w2", b"w3"]}


def http(broker: BrokerProcess, path: str, body: bytes | None = None) -> bytes:
    request = urllib.request.Request(f"http://{broker.http_address}{path}", data=body,
                                     method="POST" if body is not None else "GET")
    with urllib.request.urlopen(request, timeout=10) as resp:
        return resp.read()


def stats(broker: BrokerProcess) -> dict[str, dict]:
    doc = json.loads(http(broker, "/stats?format=json"))
    return {t["topic_name"]: t for t in doc["topics"]}


def drain(broker: BrokerProcess, topic: str, channel: str, count: int) -> list[bytes]:
    return [m.body for m in take(broker.tcp_address, topic, channel, count)]  # nothing more than on disk


def test_a_go_data_dir_with_nulls_loads_and_drains(tmp_path):
    broker = BrokerProcess(tmp_path)
    want = go_data_dir(broker.data_path)
    broker.start()
    try:
        topics = stats(broker)
        assert set(topics) == {"empty", "withch", "paused"}
        assert topics["paused"]["paused"] and not topics["withch"]["paused"]
        channels = {c["channel_name"]: c for c in topics["withch"]["channels"]}
        assert set(channels) == {"c1", "c2"} and channels["c2"]["paused"] and not channels["c1"]["paused"]
        assert topics["empty"]["depth"] == 3 and topics["empty"]["channels"] == []
        http(broker, "/topic/unpause?topic=paused", b"")
        http(broker, "/channel/unpause?topic=withch&channel=c2", b"")
        for (topic, channel), bodies in want.items():
            assert sorted(drain(broker, topic, channel, len(bodies))) == bodies, (topic, channel)
    finally:
        broker.stop()


def test_a_go_data_dir_with_a_thousand_topics_loads(tmp_path):
    """Go nsqd's directory of 1,000 topics with two channels each (its channel queues holding what its
    topic queues handed over): every topic and channel opens, each with its message, and a journal-less
    nsqd.dat written at the clean exit names them all, as Go's did."""
    broker = BrokerProcess(tmp_path)
    data = broker.data_path
    entries = []
    for i in range(1000):
        topic = f"many{i:04d}"
        write_queue(data, topic, [b"m"], read=1)
        for channel in ("a", "b"):
            write_queue(data, f"{topic}:{channel}", [b"m%d" % i])
        entries.append({"name": topic, "paused": False,
                        "channels": [{"name": "a", "paused": False}, {"name": "b", "paused": False}]})
    (data / "nsqd.dat").write_bytes(json.dumps({"topics": entries, "version": "1.3.0"}, separators=(",", ":")).encode())
    broker.start()
    try:
        topics = stats(broker)
        assert len(topics) == 1000
        assert all([c["depth"] for c in t["channels"]] == [1, 1] for t in topics.values())
        assert drain(broker, "many0999", "b", 1) == [b"m999"]
    finally:
        assert broker.stop() == 0
    assert not (data / "nsqd.dat.journal").exists()
    written = json.loads((data / "nsqd.dat").read_bytes())
    assert [t["name"] for t in written["topics"]] == [e["name"] for e in entries]


def test_an_empty_go_data_dir_loads(tmp_path):
    broker = BrokerProcess(tmp_path)
    (broker.data_path / "nsqd.dat").write_bytes(GO_EMPTY_NSQD_DAT)
    broker.start()
    try:
        assert stats(broker) == {}
        assert broker.stop() == 0
        assert (broker.data_path / "nsqd.dat").read_bytes() == GO_EMPTY_NSQD_DAT
    finally:
        broker.stop()


def test_our_data_dir_is_what_go_nsqd_writes(tmp_path):
    """The same steps Go nsqd was given; nsqd.dat byte for byte, and the queues in go-diskqueue's format.
    A topic's messages are stored once, in the topic's queue, whose read position is the oldest message
    a channel has not finished: Go nsqd reads it from there and copies it to every channel (its channels'
    own queues are empty), so it delivers what Go's own directory would. (Go nsqd 1.3.0 loaded such a
    directory and delivered every message: `make bench` runs it, tests/bench/go_interop.py.)"""
    broker = BrokerProcess(tmp_path, mem_queue_size=0)
    broker.start()
    try:
        http(broker, "/topic/create?topic=empty", b"")
        http(broker, "/topic/create?topic=withch", b"")
        http(broker, "/channel/create?topic=withch&channel=c1", b"")
        http(broker, "/channel/create?topic=withch&channel=c2", b"")
        http(broker, "/channel/pause?topic=withch&channel=c2", b"")
        http(broker, "/topic/create?topic=paused", b"")
        http(broker, "/topic/pause?topic=paused", b"")
        for i in (1, 2, 3):
            for topic, prefix in (("withch", b"w"), ("empty", b"n"), ("paused", b"p")):
                http(broker, f"/pub?topic={topic}", prefix + b"%d" % i)
        deadline = time.monotonic() + 5
        while stats(broker)["withch"]["depth"] and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        assert broker.stop() == 0
    data = broker.data_path
    assert (data / "nsqd.dat").read_bytes() == GO_NSQD_DAT
    expected_meta = {"empty": "3\n0,0\n0,96\n", "paused": "3\n0,0\n0,96\n", "withch": "3\n0,0\n0,96\n"}
    for name, meta in expected_meta.items():
        # our lines follow Go's three (Go's Fscanf reads those and stops)
        text = (data / f"{name}.diskqueue.meta.dat").read_text()
        assert text.split("trio-nsq-log 2\n")[0] == meta, name
    assert not list(data.glob("withch:*.diskqueue.*"))  # no copy per channel
    blob = (data / "withch.diskqueue.000000.dat").read_bytes()
    bodies, pos = [], 0
    while pos < len(blob):
        (length,) = struct.unpack_from(">i", blob, pos)
        timestamp, attempts = struct.unpack_from(">qH", blob, pos + 4)
        msg_id = blob[pos + 14 : pos + 30]
        assert attempts == 0 and abs(timestamp / 1e9 - time.time()) < 60 and len(msg_id) == 16
        int(msg_id, 16)  # Go reads the id as 16 hex characters
        bodies.append(blob[pos + 30 : pos + 4 + length])
        pos += 4 + length
    assert bodies == [b"w1", b"w2", b"w3"]


@pytest.mark.parametrize("first", [(1 << 22) - 2, (1 << 23) - 2])
def test_a_go_queue_at_large_segment_numbers_survives_kill_9(tmp_path, first):
    """Issue 41's recipe, through a process: go-diskqueue's file numbers only grow, and a long-lived Go
    nsqd leaves a topic queue at segment 2**22 - 2 or 2**23 - 2 (where positions `file << 40 | offset`
    met the own queue's tag, then overflowed: the broker died at restart with `struct.error`). With
    --max-bytes-per-file=4096 and --mem-queue-size=0, 20,000 messages are published and consumed with
    some REQs, a kill -9 half way: every message comes, the files roll past both numbers."""
    broker = BrokerProcess(tmp_path, mem_queue_size=0, max_bytes_per_file=4096)
    data = broker.data_path
    (data / "nsqd.dat").write_bytes(b'{"topics":[{"name":"big","paused":false,"channels":[{"name":"c",'
                                    b'"paused":false}]}],"version":"1.3.0"}')
    old = [b"go-%d" % i for i in range(3)]
    blob = b"".join(go_record(b"%016x" % (0x18a685037a269000 + i), body) for i, body in enumerate(old))
    (data / f"big.diskqueue.{first:06d}.dat").write_bytes(blob)
    (data / "big.diskqueue.meta.dat").write_text(f"3\n{first},0\n{first},{len(blob)}\n")
    new = [b"new-%05d" % i for i in range(20_000)]
    broker.start()
    got: set[bytes] = set()
    requeued: set[bytes] = set()

    def consume(until: int) -> None:
        with RawNSQ(broker.tcp_address, timeout=10) as conn:
            conn.sub("big", "c")
            conn.rdy(200)
            while len(got) < until:
                msg = conn.expect_message(timeout=20)
                if len(got) % 50 == 7 and msg.body not in requeued:
                    conn.req(msg.id, 0)
                    requeued.add(msg.body)
                else:
                    conn.fin(msg.id)
                    got.add(msg.body)
        # closed with messages in flight: the broker requeues them

    try:
        with RawNSQ(broker.tcp_address, timeout=10) as pub:
            for at in range(0, len(new), 500):
                pub.mpub("big", new[at:at + 500])
        consume(10_000)
        broker.kill()
        broker.start()  # it died here at restart
        consume(len(old) + len(new))
        assert got == set(old) | set(new) and len(requeued) > 150
        assert broker.stop() == 0
        write_file = int((data / "big.diskqueue.meta.dat").read_text().split("\n")[2].split(",")[0])
        assert write_file > first + 100  # rolled past 2**22 (2**23); the segments read went
    finally:
        broker.stop()


def test_a_queue_go_nsqd_wrote_is_read_by_position_and_keeps_its_log_id_across_kill_9(tmp_path):
    """A log opened from Go's files has no log id on disk (Go's metadata has three lines): the first
    /log request writes it before answering, so a kill -9 right after cannot make another one, and the
    positions Go's records got are the same after the restart."""
    broker = BrokerProcess(tmp_path)
    (broker.data_path / "nsqd.dat").write_bytes(b'{"topics":[{"name":"gone","paused":false,"channels":[]}],'
                                                 b'"version":"1.3.0"}')
    bodies = [b"go-%03d" % i for i in range(50)]
    write_queue(broker.data_path, "gone", bodies)
    broker.start()
    try:
        info = json.loads(http(broker, "/log/positions?topic=gone"))
        assert (info["first"], info["end_index"] - info["first_index"]) == (0, 50)
        assert "epoch" in (broker.data_path / "gone.diskqueue.meta.dat").read_text()  # on disk before the answer
        data = http(broker, f"/log/read?topic=gone&position=0&end={info['end']}")
        records = []
        at = 0
        while at < info["end"]:
            (size,) = struct.unpack_from(">i", data, at)
            records.append(data[at + 30:at + 4 + size])
            at += 4 + size
        assert records == bodies
        broker.kill()
        broker.start()
        again = json.loads(http(broker, "/log/positions?topic=gone"))
        assert (again["log_id"], again["first"], again["end"]) == (info["log_id"], 0, info["end"])
    finally:
        broker.stop()
