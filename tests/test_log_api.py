"""The HTTP log API (broker/http/log_api.py) through a broker process: positions, reads of raw records
with their offsets and deadlines, limits, splits, the durable cursor (pins retention, shows as a channel
with its lag, survives kill -9), bad arguments answered in NSQ's shape, and the log id across a topic
made again and a kill -9."""

from __future__ import annotations

import json
import struct
import urllib.error
import urllib.request

import pytest
from processes import BrokerProcess


def call(broker: BrokerProcess, path: str, method: str = "GET", data: bytes | None = None):
    """(status, headers, body) of one request."""
    req = urllib.request.Request(f"http://{broker.http_address}{path}", data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def get_json(broker: BrokerProcess, path: str, method: str = "GET") -> dict:
    status, _, body = call(broker, path, method)
    assert status == 200, (path, status, body)
    return json.loads(body)


def error(broker: BrokerProcess, path: str, method: str = "GET") -> tuple[int, str]:
    status, _, body = call(broker, path, method)
    return status, json.loads(body)["message"]


def read_range(broker: BrokerProcess, topic: str, start: int, end: int, max_bytes: int = 4096):
    """[(position, timestamp ns, id, body, deadline ms or None)] from start to end, read as a client does."""
    out = []
    pos = start
    while pos < end:
        status, headers, body = call(broker, f"/log/read?topic={topic}&position={pos}&end={end}&max_bytes={max_bytes}")
        assert status == 200, body
        n, size, k = (int(headers[h]) for h in ("X-NSQ-Records", "X-NSQ-Records-Bytes", "X-NSQ-Deadlines"))
        assert int(headers["X-NSQ-Position"]) == pos and len(body) == size + 4 * (n + 1) + 16 * k
        starts = struct.unpack_from(f"<{n + 1}i", body, size)
        deadlines = dict(struct.unpack_from("<2q", body, size + 4 * (n + 1) + 16 * i) for i in range(k))
        for a, b in zip(starts, starts[1:]):
            length, ts, _attempts = struct.unpack_from(">iqH", body, a)
            assert a + 4 + length == b
            out.append((pos + a, ts, body[a + 14:a + 30].decode(), body[a + 30:b], deadlines.get(pos + a)))
        nxt = int(headers["X-NSQ-Next-Position"])
        assert nxt > pos
        pos = nxt
    return out


def publish(broker: BrokerProcess, topic: str, bodies: list[bytes], defer_ms: int = 0) -> None:
    if defer_ms:
        for body in bodies:
            assert call(broker, f"/pub?topic={topic}&defer={defer_ms}", "POST", body)[0] == 200
        return
    data = b"".join(struct.pack(">i", len(b)) + b for b in bodies)
    data = struct.pack(">i", len(bodies)) + data
    assert call(broker, f"/mpub?topic={topic}&binary=true", "POST", data)[0] == 200


def synced_end(broker: BrokerProcess, topic: str, records: int) -> dict:
    """/log/positions once the durable tail holds `records` records (a sync round within --sync-timeout)."""
    import time

    deadline = time.monotonic() + 20
    while True:
        info = get_json(broker, f"/log/positions?topic={topic}")
        if info["end_index"] - info["first_index"] >= records or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


def channel_depth(broker: BrokerProcess, topic: str, channel: str) -> int | None:
    stats = get_json(broker, f"/stats?format=json&topic={topic}")
    for t in stats["topics"]:
        for c in t["channels"]:
            if c["channel_name"] == channel:
                return c["depth"]
    return None


def test_records_are_read_by_position_with_offsets_and_deadlines_and_errors_are_nsq_shaped(broker_factory):
    broker = broker_factory(max_bytes_per_file=8192, sync_timeout="50ms")
    assert error(broker, "/log/positions?topic=t") == (404, "TOPIC_NOT_FOUND")
    assert call(broker, "/topic/create?topic=t", "POST")[0] == 200
    info = get_json(broker, "/log/positions?topic=t")  # marks it as read by position
    assert info["first"] == info["end"] == 0 and len(info["log_id"]) == 16
    bodies = [b"m-%04d\n\x00\xff" % i + b"x" * (i % 300) for i in range(400)]
    publish(broker, "t", bodies)  # default --mem-queue-size: still every message goes to the log
    publish(broker, "t", [b"later"], defer_ms=3_600_000)
    info = synced_end(broker, "t", 401)
    records = read_range(broker, "t", info["first"], info["end"], max_bytes=5000)
    assert [r[3] for r in records] == bodies + [b"later"]
    assert all(r[4] is None for r in records[:-1]) and records[-1][4] > info["first_timestamp"] // 1_000_000
    assert len({r[2] for r in records}) == 401  # message ids
    # the same range again: the same records; a split cuts at record starts
    assert read_range(broker, "t", info["first"], info["end"], max_bytes=100_000) == records
    positions = {r[0] for r in records}
    cuts = get_json(broker, f"/log/splits?topic=t&start={info['first']}&end={info['end']}&parts=4")["positions"]
    assert cuts and set(cuts) <= positions
    at = get_json(broker, f"/log/position?topic=t&from={records[10][0]}&records=25")
    assert at["position"] == records[35][0] and at["index"] == 35
    at = get_json(broker, f"/log/position?topic=t&timestamp={records[200][1] // 1_000_000 + 1}")
    assert at["position"] in positions and at["index"] > 0
    # bad arguments
    first = records[1][0]
    assert error(broker, f"/log/read?topic=t&position={first + 1}") == (400, "POSITION_NOT_A_RECORD")
    assert error(broker, f"/log/read?topic=t&position={info['end'] + 5}") == (400, "POSITION_PAST_END")
    assert error(broker, "/log/read?topic=t&position=-1") == (400, "INVALID_ARG_POSITION")
    assert error(broker, "/log/read?topic=t") == (400, "MISSING_ARG_POSITION")
    assert error(broker, "/log/read?topic=t&position=0&log_id=0000000000000001") == (409, "LOG_ID_MISMATCH")
    assert error(broker, "/log/read?topic=bad!name&position=0") == (400, "INVALID_ARG_TOPIC")
    assert error(broker, "/log/positions?topic=e%23ephemeral".replace("%23", "%23")) in (
        (404, "TOPIC_NOT_FOUND"), (400, "TOPIC_HAS_NO_LOG"))
    assert error(broker, "/log/splits?topic=t&start=0&end=0&parts=0") == (400, "INVALID_ARG_PARTS")
    assert broker.proc is not None and broker.proc.poll() is None  # still serving


def test_the_durable_cursor_pins_retention_shows_its_lag_and_survives_kill_9(broker_factory):
    broker = broker_factory(max_bytes_per_file=4096, sync_timeout="50ms")
    # the commit makes the topic and the channel; a consumer channel finishes everything at once
    assert get_json(broker, "/log/commit?topic=p&channel=query&position=0", "POST")["position"] == 0
    publish(broker, "p", [b"r-%03d" % i + b"y" * 200 for i in range(200)])
    info = synced_end(broker, "p", 200)
    records = read_range(broker, "p", 0, info["end"])
    assert channel_depth(broker, "p", "query") == 200  # the reader's lag
    # everything before record 120 finished: on disk before the answer
    answer = get_json(broker, f"/log/commit?topic=p&channel=query&position={records[120][0]}", "POST")
    assert answer["depth"] == 80 and answer["log_id"] == info["log_id"]
    broker.kill()
    broker.restart()
    assert channel_depth(broker, "p", "query") == 80
    info2 = get_json(broker, "/log/positions?topic=p")
    assert info2["log_id"] == info["log_id"] and info2["end"] == info["end"]
    # segments before the cursor may go; those after it stay (the cursor pins them)
    assert info2["first"] <= records[120][0]
    assert read_range(broker, "p", records[120][0], info["end"]) == records[120:]
    # a commit back to a position still kept is allowed (a restart from an older checkpoint)
    assert get_json(broker, f"/log/commit?topic=p&channel=query&position={records[120][0]}", "POST")["depth"] == 80
    assert error(broker, f"/log/commit?topic=p&channel=query&position={records[120][0] + 3}", "POST") == (
        400, "POSITION_NOT_A_RECORD")
    assert error(broker, "/log/commit?topic=p&channel=bad!&position=0", "POST") == (400, "INVALID_ARG_CHANNEL")
    # an ephemeral channel or topic is refused before anything is made
    assert error(broker, "/log/commit?topic=p&channel=c%23ephemeral&position=0", "POST") == (400, "INVALID_ARG_CHANNEL")
    assert error(broker, "/log/commit?topic=e%23ephemeral&channel=c&position=0", "POST") == (400, "TOPIC_HAS_NO_LOG")
    stats = get_json(broker, "/stats?format=json")
    assert "e#ephemeral" not in {t["topic_name"] for t in stats["topics"]}
    assert channel_depth(broker, "p", "c#ephemeral") is None
    # a commit naming a log of a topic that is gone does not make the topic again
    assert error(broker, "/log/commit?topic=gone&channel=q&position=0&log_id=0123456789abcdef", "POST") == (
        409, "LOG_ID_MISMATCH")
    assert error(broker, "/log/positions?topic=gone") == (404, "TOPIC_NOT_FOUND")
    # the topic deleted and made again: another log id, old positions are no longer read as the same
    assert call(broker, "/topic/delete?topic=p", "POST")[0] == 200
    publish(broker, "p", [b"new"])
    info3 = synced_end(broker, "p", 1)
    assert info3["log_id"] != info["log_id"]
    assert error(broker, f"/log/read?topic=p&position=0&log_id={info['log_id']}") == (409, "LOG_ID_MISMATCH")


@pytest.mark.parametrize("kill_at", [0])
def test_positions_are_the_same_after_kill_9(broker_factory, kill_at):
    broker = broker_factory(sync_timeout="50ms")
    get_json(broker, "/log/commit?topic=k&channel=q&position=0", "POST")
    bodies = [b"%05d" % i + b"a" * 300 for i in range(3000)]  # ~1 MB: answers of 300 kB go out in pieces
    publish(broker, "k", bodies)
    info = synced_end(broker, "k", 3000)
    before = read_range(broker, "k", 0, info["end"], max_bytes=300_001)
    assert [r[3] for r in before] == bodies
    broker.kill()
    broker.restart()
    publish(broker, "k", [b"b" * 50] * 10)
    after_info = synced_end(broker, "k", 3010)
    after = read_range(broker, "k", 0, after_info["end"], max_bytes=1 << 20)
    assert after[:3000] == before and [r[3] for r in after[3000:]] == [b"b" * 50] * 10
    assert after_info["log_id"] == info["log_id"]
