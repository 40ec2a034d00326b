"""The broker's HTTP API, process level: the real ``python -m trio_nsq.broker`` on free loopback ports, spoken to
with httpx and raw sockets, its messages consumed over TCP by third-party clients (gnsq, pynsq) and by a
raw V2 client. Statuses, bodies and error messages are nsqd's (nsqd/http.go, internal/http_api)."""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import socket
import struct
import subprocess
import time

import httpx
import pytest
import trio

from http_helpers import consume
from processes import BrokerProcess, free_port, wait_for
from nsq_raw import RawNSQ, publish, subscribe
from trio_nsq.client import Consumer

NSQ_HEADER = "nsq; version=1.0"
_names = itertools.count(1)


def unique(prefix: str = "t") -> str:
    return f"{prefix}-{os.getpid()}-{next(_names)}"


def mpub_binary(bodies: list[bytes]) -> bytes:
    return struct.pack(">i", len(bodies)) + b"".join(struct.pack(">i", len(b)) + b for b in bodies)


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = BrokerProcess(tmp_path_factory.mktemp("http-broker"), "--max-msg-size=65536", "--max-body-size=262144",
                      "--max-req-timeout=10s").start()
    yield b
    b.stop()


@pytest.fixture
def http(broker):
    with httpx.Client(base_url=broker.http_url, timeout=10.0) as client:
        yield client


def assert_error(resp: httpx.Response, status: int, message: str) -> None:
    assert (resp.status_code, resp.text) == (status, json.dumps({"message": message}, separators=(",", ":")))
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.headers["x-nsq-content-type"] == NSQ_HEADER


def stats(http: httpx.Client, **params: str) -> dict:
    resp = http.get("/stats", params={"format": "json", **params})
    assert resp.status_code == 200, resp.text
    return resp.json()


def topic_stats(http: httpx.Client, topic: str) -> dict | None:
    topics = stats(http, topic=topic)["topics"]
    return topics[0] if topics else None


# --- /ping /info --------------------------------------------------------------------------------


def test_ping_is_plain_ok(http):
    resp = http.get("/ping")
    assert (resp.status_code, resp.text) == (200, "OK")
    assert "x-nsq-content-type" not in resp.headers  # PlainText, not V1


def test_info(http, broker):
    resp = http.get("/info")
    assert resp.status_code == 200
    assert resp.headers["x-nsq-content-type"] == NSQ_HEADER
    info = resp.json()
    assert info["version"] == "1.3.0"
    assert info["http_port"] == broker.http_port
    assert info["tcp_port"] == broker.tcp_port
    assert abs(info["start_time"] - time.time()) < 600
    assert info["max_heartbeat_interval"] == 60 * 10**9  # durations in ns, as Go marshals them
    # nsqd 1.3.0's fields in its order, then ours; no topology fields without --topology-zone/-region
    assert list(info) == ["version", "broadcast_address", "hostname", "http_port", "tcp_port", "start_time",
                          "max_heartbeat_interval", "max_output_buffer_size", "max_output_buffer_timeout",
                          "max_deflate_level", "idempotent_publish"]


def test_topology_flags_add_their_fields_to_info_and_identify(tmp_path):
    broker = BrokerProcess(tmp_path, "--topology-zone=eu-1a", "--topology-region=eu").start()
    try:
        info = httpx.get(f"{broker.http_url}/info", timeout=5).json()
        assert (info["topology_zone"], info["topology_region"]) == ("eu-1a", "eu")
        with RawNSQ(broker.tcp_address) as conn:
            answer = conn.identify(feature_negotiation=True)
        assert (answer["topology_zone"], answer["topology_region"]) == ("eu-1a", "eu")
    finally:
        broker.stop()


def test_accept_header_does_not_change_the_answer(http):
    plain = http.get("/info").json()
    versioned = http.get("/info", headers={"Accept": "application/vnd.nsq; version=1.0"})
    assert versioned.status_code == 200 and versioned.json().keys() == plain.keys()
    resp = http.get("/stats", params={"topic": "nope"}, headers={"Accept": "application/vnd.nsq; version=1.0"})
    assert resp.status_code == 200


# --- /pub ---------------------------------------------------------------------------------------


def test_pub_then_consumed_by_gnsq(http, broker):
    topic = unique()
    bodies = [f"http message {i} \x00\xff".encode("latin-1") for i in range(5)]
    for body in bodies:
        resp = http.post("/pub", params={"topic": topic}, content=body)
        assert (resp.status_code, resp.text) == (200, "OK")
        assert resp.headers["x-nsq-content-type"] == NSQ_HEADER
    t = topic_stats(http, topic)
    assert (t["depth"], t["message_count"], t["message_bytes"]) == (5, 5, sum(map(len, bodies)))
    got = consume("gnsq", broker.tcp_address, topic, "ch", expect=5)
    assert [base64.b64decode(m["body"]) for m in got] == bodies
    assert all(m["attempts"] == 1 for m in got)


@pytest.mark.parametrize(
    "params, body, status, message",
    [
        ({}, b"x", 400, "MISSING_ARG_TOPIC"),
        ({"topic": "bad/name"}, b"x", 400, "INVALID_TOPIC"),
        ({"topic": ""}, b"x", 400, "INVALID_TOPIC"),
        ({"topic": "a" * 65}, b"x", 400, "INVALID_TOPIC"),
        ({"topic": "ok"}, b"", 400, "MSG_EMPTY"),
        ({}, b"", 400, "MSG_EMPTY"),  # nsqd reads the body before the query
        ({"topic": "ok", "defer": "-1"}, b"x", 400, "INVALID_DEFER"),
        ({"topic": "ok", "defer": "soon"}, b"x", 400, "INVALID_DEFER"),
        ({"topic": "ok", "defer": "10001"}, b"x", 400, "INVALID_DEFER"),  # > --max-req-timeout=10s
        ({"topic": "ok"}, b"x" * 65537, 413, "MSG_TOO_BIG"),
    ],
)
def test_pub_errors(http, params, body, status, message):
    assert_error(http.post("/pub", params=params, content=body), status, message)


def test_pub_bad_query_string(http):
    assert_error(http.post("/pub?topic=a%zz", content=b"x"), 400, "INVALID_REQUEST")
    assert_error(http.post("/pub?topic=a;b", content=b"x"), 400, "INVALID_REQUEST")


def test_pub_at_the_size_limit_and_streamed_over_it(http):
    topic = unique()
    assert http.post("/pub", params={"topic": topic}, content=b"y" * 65536).status_code == 200

    def chunks():  # no Content-Length: the limit must hold while reading
        for _ in range(5):
            yield b"z" * 20000

    assert_error(http.post("/pub", params={"topic": topic}, content=chunks()), 413, "MSG_TOO_BIG")
    assert topic_stats(http, topic)["message_count"] == 1


def test_pub_with_defer_is_not_delivered_before_the_delay(http, broker):
    topic = unique()
    with subscribe(broker.tcp_address, topic, "ch", rdy=1) as consumer:
        wait_for(lambda: topic_stats(http, topic) and topic_stats(http, topic)["channels"], message="channel")
        sent = time.monotonic()
        resp = http.post("/pub", params={"topic": topic, "defer": "1500"}, content=b"later")
        assert (resp.status_code, resp.text) == (200, "OK")
        channel = topic_stats(http, topic)["channels"][0]
        assert (channel["deferred_count"], channel["depth"]) == (1, 0)
        consumer.expect_no_frame(1.0)
        msg = consumer.expect_message(timeout=5)
        assert msg.body == b"later"
        assert time.monotonic() - sent >= 1.4
        consumer.fin(msg.id)


def test_pub_interrupted_mid_body_publishes_nothing(http, broker):
    topic = unique()
    with socket.create_connection(("127.0.0.1", broker.http_port)) as sock:
        sock.sendall(f"POST /pub?topic={topic} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n".encode()
                     + b"only ten b")
        time.sleep(0.2)
    time.sleep(0.2)
    assert topic_stats(http, topic) is None  # /pub reads the body before it creates the topic
    assert http.get("/ping").text == "OK"


# --- /mpub --------------------------------------------------------------------------------------


def test_mpub_text_skips_empty_lines_and_is_consumed_by_pynsq(http, broker):
    topic = unique()
    resp = http.post("/mpub", params={"topic": topic}, content=b"one\ntwo\n\nthree\r\n\n")
    assert (resp.status_code, resp.text) == (200, "OK")
    got = consume("pynsq", broker.tcp_address, topic, "ch", expect=3)
    assert [base64.b64decode(m["body"]) for m in got] == [b"one", b"two", b"three\r"]


@pytest.mark.parametrize("binary", ["true", "1", "yes-deprecated-but-true"])
def test_mpub_binary_consumed_over_raw_tcp(http, broker, binary):
    topic = unique()
    bodies = [os.urandom(100) + b"\n\x00" for _ in range(20)]
    resp = http.post("/mpub", params={"topic": topic, "binary": binary}, content=mpub_binary(bodies) + b"trailing")
    assert (resp.status_code, resp.text) == (200, "OK")
    with subscribe(broker.tcp_address, topic, "ch", rdy=100) as consumer:
        msgs = consumer.expect_messages(20)
        assert [m.body for m in msgs] == bodies
        for m in msgs:
            consumer.fin(m.id)
        consumer.nop()


def test_mpub_binary_false_means_text(http):
    topic = unique()
    assert http.post("/mpub", params={"topic": topic, "binary": "false"}, content=b"a\nb").status_code == 200
    assert topic_stats(http, topic)["depth"] == 2


def test_mpub_empty_body_is_ok_and_publishes_nothing(http):
    topic = unique()
    resp = http.post("/mpub", params={"topic": topic}, content=b"\n\n")
    assert (resp.status_code, resp.text) == (200, "OK")
    assert topic_stats(http, topic)["depth"] == 0


@pytest.mark.parametrize(
    "params, body, status, message",
    [
        ({}, b"a", 400, "MISSING_ARG_TOPIC"),
        ({"topic": "bad name"}, b"a", 400, "INVALID_TOPIC"),
        ({"topic": "T"}, b"a\n" + b"x" * 65537, 413, "MSG_TOO_BIG"),
        ({"topic": "T"}, b"x\n" * 131073, 413, "BODY_TOO_BIG"),
        ({"topic": "T", "binary": "true"}, b"\x00\x00", 413, "BAD_BODY"),
        ({"topic": "T", "binary": "true"}, struct.pack(">i", 0), 413, "BAD_BODY"),
        ({"topic": "T", "binary": "true"}, struct.pack(">i", 10**6), 413, "BAD_BODY"),
        ({"topic": "T", "binary": "true"}, struct.pack(">ii", 2, 1) + b"a", 413, "BAD_MESSAGE"),
        ({"topic": "T", "binary": "true"}, struct.pack(">ii", 1, 0), 413, "BAD_MESSAGE"),
        ({"topic": "T", "binary": "true"}, struct.pack(">ii", 1, 5) + b"abc", 413, "BAD_MESSAGE"),
        ({"topic": "T", "binary": "true"}, struct.pack(">ii", 1, 65537) + b"x" * 65537, 413, "BAD_MESSAGE"),
    ],
)
def test_mpub_errors(http, params, body, status, message):
    assert_error(http.post("/mpub", params=params, content=body), status, message)


def test_mpub_over_the_limit_publishes_nothing(http):
    topic = unique()
    # a declared Content-Length over the limit is refused before anything else, as nsqd
    assert_error(http.post("/mpub", params={"topic": topic}, content=b"m\n" * 200000), 413, "BODY_TOO_BIG")
    assert topic_stats(http, topic) is None

    def chunks():
        for _ in range(20):
            yield b"m\n" * 10000

    # streamed: nsqd creates the topic before reading the body; none of it is published
    assert_error(http.post("/mpub", params={"topic": topic}, content=chunks()), 413, "BODY_TOO_BIG")
    assert topic_stats(http, topic)["message_count"] == 0


# --- body limits: streamed, not buffered ----------------------------------------------------------


@pytest.fixture
def small_limits_broker(tmp_path):
    b = BrokerProcess(tmp_path, "--max-body-size=1048576", "--max-msg-size=1048576").start()
    yield b
    b.stop()


@pytest.mark.parametrize("path", ["/mpub", "/pub"])
def test_oversized_streamed_body_is_refused_without_buffering(small_limits_broker, path):
    """A 48 MiB chunked upload to a broker whose limit is 1 MiB: 413 once the limit is passed, the
    process's peak RSS does not grow by anything like the body, and the broker keeps serving (the same
    connection included: the rest of the body is read and dropped, not left to reset the client)."""
    b = small_limits_broker
    topic = unique()
    chunk = (b"m" * 1023 + b"\n") * 64  # 64 KiB, 64 messages
    total = 48 * 1024 * 1024
    with httpx.Client(base_url=b.http_url, timeout=30.0) as client:
        for _ in range(3):  # warm up: topic, code paths, allocator
            assert client.post("/mpub", params={"topic": topic}, content=chunk).status_code == 200
            client.get("/stats", params={"format": "json"})
        before = b.memory()

        def body():
            for _ in range(total // len(chunk)):
                yield chunk

        resp = client.post(path, params={"topic": topic}, content=body())
        assert resp.status_code == 413
        assert resp.json()["message"] == ("BODY_TOO_BIG" if path == "/mpub" else "MSG_TOO_BIG")
        after = b.memory()
        growth = after["VmHWM"] - before["VmHWM"]
        assert growth < 8 * 1024 * 1024, (before, after)
        # same client (keep-alive), then a fresh one
        assert client.get("/ping").text == "OK"
        assert client.post("/pub", params={"topic": topic}, content=b"after").status_code == 200
    assert httpx.get(f"{b.http_url}/ping").text == "OK"
    assert b.is_alive()


@pytest.mark.parametrize("request_line, message", [
    (b"POST /mpub?topic=x", b'{"message":"BODY_TOO_BIG"}'),
    (b"POST /pub?topic=x", b'{"message":"MSG_TOO_BIG"}'),
    (b"PUT /config/log_level", b'{"message":"INVALID_VALUE"}'),
])
def test_declared_oversized_body_is_refused_at_once(small_limits_broker, request_line, message):
    """A Content-Length of 1 GiB is answered before any of the body is sent."""
    b = small_limits_broker
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", b.http_port), timeout=5) as sock:
        sock.sendall(request_line + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 1073741824\r\n\r\n")
        answer = b""
        while not answer.endswith(message):
            data = sock.recv(4096)
            assert data, answer
            answer += data
    assert answer.startswith(b"HTTP/1.1 413")
    assert time.monotonic() - started < 3


# --- /stats -------------------------------------------------------------------------------------


def test_stats_json_shape_with_tcp_producer_and_consumer(http, broker):
    topic = unique()
    publish(broker.tcp_address, topic, b"a", b"b")  # a TCP producer: only those appear in producers
    with subscribe(broker.tcp_address, topic, "ch", rdy=1) as consumer:
        msg = consumer.expect_message()
        doc = stats(http)
        assert set(doc) == {"version", "health", "start_time", "topics", "memory", "producers"}
        assert (doc["version"], doc["health"]) == ("1.3.0", "OK")
        assert set(doc["memory"]) == {"heap_objects", "heap_idle_bytes", "heap_in_use_bytes", "heap_released_bytes",
                                      "gc_pause_usec_100", "gc_pause_usec_99", "gc_pause_usec_95", "next_gc_bytes",
                                      "gc_total_runs"}
        names = [t["topic_name"] for t in doc["topics"]]
        assert names == sorted(names)
        t = next(t for t in doc["topics"] if t["topic_name"] == topic)
        assert t["e2e_processing_latency"] == {"count": 0, "percentiles": None}
        assert (t["message_count"], t["message_bytes"], t["paused"]) == (2, 2, False)
        (c,) = t["channels"]
        assert c["channel_name"] == "ch"
        assert (c["in_flight_count"], c["depth"], c["message_count"], c["client_count"]) == (1, 1, 2, 1)
        for key in ("backend_depth", "deferred_count", "requeue_count", "timeout_count", "paused",
                    "e2e_processing_latency"):
            assert key in c
        (client,) = c["clients"]
        assert client["version"] == "V2"
        assert (client["ready_count"], client["in_flight_count"], client["message_count"], client["state"]) == (1, 1, 1, 3)
        for key in ("client_id", "hostname", "remote_address", "finish_count", "requeue_count", "connect_ts",
                    "sample_rate", "deflate", "snappy", "user_agent", "tls", "output_buffer_size",
                    "output_buffer_timeout"):
            assert key in client
        consumer.fin(msg.id)
        consumer.nop()

        text = http.get("/stats").text  # text is the default format
        assert text.startswith("nsqd v1.3.0")
        assert "\nHealth: OK\n" in text and "\nMemory:\n" in text
        assert re.search(r"\n   " + re.escape(f"[{topic:<15}]") + r" depth: 0 +be-depth: 0 +msgs: 2 +e2e%: \n", text)
        assert re.search(r"\n      \[ch {23}\] depth: [01] +be-depth: 0 +inflt: [01] +def: 0 +re-q: 0 +timeout: 0 +msgs: 2", text)
        assert "        [V2 " in text and " state: 3 " in text


def test_stats_producers_and_filters(http, broker):
    topic, other = unique(), unique()
    with RawNSQ(broker.tcp_address) as producer:
        producer.identify(user_agent="http-test/1.0")
        producer.pub(topic, b"p")
        doc = stats(http, topic=topic)
        (p,) = [p for p in doc["producers"] if p.get("user_agent") == "http-test/1.0"]
        assert p["pub_counts"] == [{"topic": topic, "count": 1}]
        assert "Producers:\n   [V2 " in http.get("/stats", params={"topic": topic}).text
    http.post("/topic/create", params={"topic": other})
    assert [t["topic_name"] for t in stats(http, topic=topic)["topics"]] == [topic]
    assert stats(http, topic="no-such-topic")["topics"] is None
    http.post("/channel/create", params={"topic": other, "channel": "only"})
    filtered = stats(http, channel="only")["topics"]
    assert [t["topic_name"] for t in filtered] == [other]
    lean = stats(http, topic=other, include_clients="false", include_mem="0")
    assert "memory" not in lean and lean["producers"] is None
    assert lean["topics"][0]["channels"][0]["clients"] is None


def test_e2e_percentiles_are_numbers_as_go_writes_them(tmp_path):
    """With --e2e-processing-latency-percentile, /stats carries each quantile and its latency as Go's
    json.Marshal writes a float64: a whole number without ".0" ("quantile":1, "value":59815304 from Go
    nsqd 1.3.0); /config shows the list the same way."""
    broker = BrokerProcess(tmp_path, "--e2e-processing-latency-percentile=1.0",
                           "--e2e-processing-latency-percentile=0.5").start()
    try:
        topic = unique("e2e")
        publish(broker.tcp_address, topic, b"a", b"b", b"c")
        with subscribe(broker.tcp_address, topic, "ch", rdy=3) as consumer:
            for msg in consumer.expect_messages(3):
                consumer.fin(msg.id)
            consumer.nop()
            raw = httpx.get(f"{broker.http_url}/stats?format=json&topic={topic}", timeout=5).content
        found = re.findall(rb'"e2e_processing_latency":\{"count":3,"percentiles":\[\{"quantile":1,"value":(\d+)\},'
                           rb'\{"quantile":0\.5,"value":(\d+)\}\]\}', raw)
        assert len(found) == 2, raw  # the topic's (aggregated) and its channel's
        assert all(int(v) > 0 for pair in found for v in pair)
        assert httpx.get(f"{broker.http_url}/config/e2e_processing_latency_percentiles", timeout=5).content == b"[1,0.5]"
    finally:
        broker.stop()


def test_stats_bad_query(http):
    assert_error(http.get("/stats?format=json&topic=%"), 400, "INVALID_REQUEST")


# --- topics and channels --------------------------------------------------------------------------


def test_topic_create_shows_in_stats_and_nsqd_dat(http, broker):
    topic = unique()
    resp = http.post("/topic/create", params={"topic": topic})
    assert (resp.status_code, resp.text) == (200, "")
    assert resp.headers["x-nsq-content-type"] == NSQ_HEADER
    assert topic_stats(http, topic)["channels"] == []

    def on_disk():
        meta = broker.metadata()
        return meta and next((t for t in meta["topics"] or [] if t["name"] == topic), None)

    # as Go nsqd writes it: a topic without channels has "channels":null
    assert wait_for(on_disk, message="topic in nsqd.dat") == {"name": topic, "paused": False, "channels": None}
    assert http.post("/channel/create", params={"topic": topic, "channel": "c1"}).status_code == 200
    assert wait_for(lambda: (on_disk() or {}).get("channels"), message="channel in nsqd.dat") == [
        {"name": "c1", "paused": False}]

    assert http.post("/topic/pause", params={"topic": topic}).status_code == 200
    assert topic_stats(http, topic)["paused"] is True
    wait_for(lambda: (on_disk() or {}).get("paused") is True, message="paused in nsqd.dat")
    assert http.post("/channel/pause", params={"topic": topic, "channel": "c1"}).status_code == 200
    assert topic_stats(http, topic)["channels"][0]["paused"] is True
    wait_for(lambda: (on_disk() or {}).get("channels") == [{"name": "c1", "paused": True}], message="channel paused")
    assert "*P [" in http.get("/stats").text

    assert http.post("/channel/unpause", params={"topic": topic, "channel": "c1"}).status_code == 200
    assert http.post("/topic/unpause", params={"topic": topic}).status_code == 200
    t = topic_stats(http, topic)
    assert (t["paused"], t["channels"][0]["paused"]) == (False, False)

    assert http.post("/channel/delete", params={"topic": topic, "channel": "c1"}).status_code == 200
    assert topic_stats(http, topic)["channels"] == []
    assert http.post("/topic/delete", params={"topic": topic}).status_code == 200
    assert topic_stats(http, topic) is None
    wait_for(lambda: broker.metadata() and on_disk() is None, message="topic gone from nsqd.dat")


def test_topic_and_channel_empty(http, broker):
    topic = unique()
    http.post("/channel/create", params={"topic": topic, "channel": "c"})  # topic missing yet
    http.post("/topic/create", params={"topic": topic})
    http.post("/channel/create", params={"topic": topic, "channel": "c"})
    http.post("/mpub", params={"topic": topic}, content=b"1\n2\n3")
    wait_for(lambda: topic_stats(http, topic)["channels"][0]["depth"] == 3, message="messages in channel")
    assert http.post("/channel/empty", params={"topic": topic, "channel": "c"}).status_code == 200
    assert topic_stats(http, topic)["channels"][0]["depth"] == 0
    http.post("/topic/pause", params={"topic": topic})
    http.post("/pub", params={"topic": topic}, content=b"held")
    assert topic_stats(http, topic)["depth"] == 1
    assert http.post("/topic/empty", params={"topic": topic}).status_code == 200
    assert topic_stats(http, topic)["depth"] == 0


@pytest.mark.parametrize(
    "path, params, status, message",
    [
        ("/topic/create", {}, 400, "MISSING_ARG_TOPIC"),
        ("/topic/create", {"topic": "no good"}, 400, "INVALID_TOPIC"),
        ("/topic/delete", {}, 400, "MISSING_ARG_TOPIC"),
        ("/topic/delete", {"topic": "missing-topic"}, 404, "TOPIC_NOT_FOUND"),
        ("/topic/empty", {}, 400, "MISSING_ARG_TOPIC"),
        ("/topic/empty", {"topic": "no good"}, 400, "INVALID_TOPIC"),
        ("/topic/empty", {"topic": "missing-topic"}, 404, "TOPIC_NOT_FOUND"),
        ("/topic/pause", {}, 400, "MISSING_ARG_TOPIC"),
        ("/topic/pause", {"topic": "missing-topic"}, 404, "TOPIC_NOT_FOUND"),
        ("/topic/unpause", {"topic": "missing-topic"}, 404, "TOPIC_NOT_FOUND"),
        ("/channel/create", {}, 400, "MISSING_ARG_TOPIC"),
        ("/channel/create", {"topic": "no good", "channel": "c"}, 400, "INVALID_ARG_TOPIC"),
        ("/channel/create", {"topic": "missing-topic"}, 400, "MISSING_ARG_CHANNEL"),
        ("/channel/create", {"topic": "missing-topic", "channel": "no good"}, 400, "INVALID_ARG_CHANNEL"),
        ("/channel/create", {"topic": "missing-topic", "channel": "c"}, 404, "TOPIC_NOT_FOUND"),
        ("/channel/delete", {"topic": "missing-topic", "channel": "c"}, 404, "TOPIC_NOT_FOUND"),
        ("/channel/delete", {"topic": "existing", "channel": "missing"}, 404, "CHANNEL_NOT_FOUND"),
        ("/channel/empty", {"topic": "existing", "channel": "missing"}, 404, "CHANNEL_NOT_FOUND"),
        ("/channel/pause", {"topic": "existing", "channel": "missing"}, 404, "CHANNEL_NOT_FOUND"),
        ("/channel/unpause", {"topic": "existing", "channel": "missing"}, 404, "CHANNEL_NOT_FOUND"),
        ("/channel/pause", {"topic": "existing"}, 400, "MISSING_ARG_CHANNEL"),
        ("/topic/create", {"topic": "%zz"}, 400, "INVALID_REQUEST"),
    ],
)
def test_topic_and_channel_errors(http, path, params, status, message):
    http.post("/topic/create", params={"topic": "existing"})
    query = "topic=%zz" if params == {"topic": "%zz"} else None
    resp = http.post(f"{path}?{query}") if query else http.post(path, params=params)
    assert_error(resp, status, message)


# --- /channel/messages and the delivery-to-FIN latency -----------------------------------------


def test_channel_messages_shows_what_a_consumer_holds_and_its_fin_latency(http, broker):
    """Our Trio client holds two messages (its handler waits) and requeues one for 10 s: the broker
    lists them in flight (with the consumer) and deferred, the rest queued; once the handlers return
    (FIN), /stats, its text and /metrics have the channel's delivery-to-FIN percentiles."""
    topic = unique()
    http.post("/topic/create", params={"topic": topic})
    http.post("/channel/create", params={"topic": topic, "channel": "c"})
    assert http.post("/mpub", params={"topic": topic}, content=b"m0\nm1\nm2\nm3\nm4").text == "OK"

    def listing(state: str, **params: str) -> dict:
        resp = http.get("/channel/messages", params={"topic": topic, "channel": "c", "state": state, **params})
        assert resp.status_code == 200, resp.text
        return resp.json()

    def held() -> bool:
        return listing("in_flight")["count"] == 2 and listing("deferred")["count"] == 1

    looked: dict[str, dict] = {}

    async def scenario() -> None:
        release = trio.Event()

        async def handler(message) -> None:
            if message.body == b"m0":
                await message.requeue(delay_ms=10_000, backoff=False)  # --max-req-timeout
                return
            await release.wait()  # held: in flight until it returns (FIN)

        async with Consumer(topic, "c", handler, nsqd_tcp_addresses=[broker.tcp_address], max_in_flight=2):
            await trio.to_thread.run_sync(lambda: wait_for(held, timeout=10, message="two in flight, one deferred"))
            for state in ("in_flight", "deferred", "queued"):
                looked[state] = await trio.to_thread.run_sync(listing, state)
            looked["one queued"] = await trio.to_thread.run_sync(lambda: listing("queued", limit="1"))
            looked["stats"] = await trio.to_thread.run_sync(lambda: topic_stats(http, topic))
            release.set()
            await trio.to_thread.run_sync(lambda: wait_for(
                lambda: listing("in_flight")["count"] == 0 and listing("queued")["count"] == 0, timeout=10,
                message="m1-m4 finished"))

    started = time.time_ns()
    trio.run(scenario)
    in_flight, deferred, queued = looked["in_flight"], looked["deferred"], looked["queued"]
    assert sorted(m["body_preview"] for m in in_flight["messages"]) == ["m1", "m2"]
    [client] = looked["stats"]["channels"][0]["clients"]
    for m in in_flight["messages"]:
        assert (m["attempts"], m["body_size"], len(m["id"])) == (1, 2, 16)
        assert (m["client_id"], m["client_address"]) == (client["client_id"], client["remote_address"])
        assert m["deadline"] - m["delivered_at"] == pytest.approx(60e9, abs=1e6)  # --msg-timeout: 60 s
        assert m["timestamp"] <= m["delivered_at"] <= time.time_ns()
    assert [(m["body_preview"], m["attempts"]) for m in deferred["messages"]] == [("m0", 1)]
    # due 10 s after the REQ, which came between the start and now
    assert started + 10e9 <= deferred["messages"][0]["deadline"] <= time.time_ns() + 10e9
    assert (queued["count"], [m["body_preview"] for m in queued["messages"]]) == (2, ["m3", "m4"])
    assert all(m["age_ms"] >= 0 and m["attempts"] == 0 for m in queued["messages"])
    assert [m["body_preview"] for m in looked["one queued"]["messages"]] == ["m3"]

    # the two held ones were FIN'd when released, m3 and m4 delivered and FIN'd after them
    channel = topic_stats(http, topic)["channels"][0]
    assert channel["delivery_to_fin_latency"]["count"] == 4
    fin = channel["delivery_to_fin_latency"]
    assert [p["quantile"] for p in fin["percentiles"]] == [0.5, 0.9, 0.99, 0.999]
    assert all(p["value"] > 0 for p in fin["percentiles"])
    assert list(channel)[-7:] == ["lag_messages", "oldest_unfinished_age_ms", "delivery_to_fin_latency",
                                  "dead_lettered_count", "expired_count", "refused_count", "dropped_count"]
    assert channel["oldest_unfinished_age_ms"] > 0  # m0, deferred
    text = http.get("/stats", params={"topic": topic}).text
    assert re.search(r"\[c +\] depth: 0 .* fin%: [0-9.]+[mun]?s, [0-9.]+[mun]?s, [0-9.]+[mun]?s, [0-9.]+[mun]?s "
                     r"oldest: [0-9.]+[mun]?s\n", text), text
    types, samples = parse_prometheus(http.get("/metrics").text)
    assert types["nsq_channel_delivery_to_fin_latency_seconds"] == "summary"
    labels = f'topic="{topic}",channel="c"'
    assert samples[f"nsq_channel_delivery_to_fin_latency_seconds_count{{{labels}}}"] == 4
    assert samples[f'nsq_channel_delivery_to_fin_latency_seconds{{{labels},quantile="0.5"}}'] > 0
    assert samples[f"nsq_channel_oldest_unfinished_age_seconds{{{labels}}}"] > 0


@pytest.mark.parametrize("params, status, message", [
    ({"channel": "c", "state": "queued"}, 400, "MISSING_ARG_TOPIC"),
    ({"topic": "bad!", "channel": "c", "state": "queued"}, 400, "INVALID_ARG_TOPIC"),
    ({"topic": "missing-topic", "channel": "c", "state": "queued"}, 404, "TOPIC_NOT_FOUND"),
    ({"topic": "existing", "channel": "missing", "state": "queued"}, 404, "CHANNEL_NOT_FOUND"),
    ({"topic": "existing", "channel": "c"}, 400, "MISSING_ARG_STATE"),
    ({"topic": "existing", "channel": "c", "state": "stuck"}, 400, "INVALID_ARG_STATE"),
    ({"topic": "existing", "channel": "c", "state": "queued", "limit": "100000"}, 400, "INVALID_ARG_LIMIT"),
])
def test_channel_messages_errors(http, params, status, message):
    http.post("/topic/create", params={"topic": "existing"})
    http.post("/channel/create", params={"topic": "existing", "channel": "c"})
    assert_error(http.get("/channel/messages", params=params), status, message)
    assert http.post("/channel/messages", params=params).status_code == 405


# --- /config ------------------------------------------------------------------------------------


def test_config_get_and_put(http):
    resp = http.get("/config/nsqlookupd_tcp_addresses")
    assert (resp.status_code, resp.text) == (200, "[]")
    addrs = '["127.0.0.1:1","127.0.0.1:2"]'
    resp = http.put("/config/nsqlookupd_tcp_addresses", content=addrs)
    assert (resp.status_code, resp.text) == (200, addrs)
    assert http.get("/config/nsqlookupd_tcp_addresses").text == addrs
    assert http.put("/config/nsqlookupd_tcp_addresses", content="[]").text == "[]"
    assert_error(http.put("/config/nsqlookupd_tcp_addresses", content="not json"), 400, "INVALID_VALUE")
    assert_error(http.put("/config/nsqlookupd_tcp_addresses", content='{"a": 1}'), 400, "INVALID_VALUE")

    assert http.get("/config/log_level").text == "2"  # lg.LogLevel INFO, as nsqd marshals it
    assert http.put("/config/log_level", content="debug").text == "1"
    assert http.put("/config/log_level", content='"warn"').text == "3"
    assert_error(http.put("/config/log_level", content="bad"), 400, "INVALID_VALUE")
    assert http.put("/config/log_level", content="info").status_code == 200

    assert_error(http.put("/config/log_level", content=b""), 413, "INVALID_VALUE")
    assert_error(http.put("/config/log_level", content=b"x" * 65537), 413, "INVALID_VALUE")
    assert_error(http.put("/config/mem_queue_size", content="5"), 400, "INVALID_OPTION")
    assert_error(http.get("/config/nonsense"), 400, "INVALID_OPTION")
    assert http.get("/config/max_msg_size").json() == 65536
    assert http.get("/config/msg_timeout").json() == 60 * 10**9
    assert_error(http.post("/config/log_level", content="x"), 405, "METHOD_NOT_ALLOWED")


# --- routing ------------------------------------------------------------------------------------


def test_not_found_and_method_not_allowed(http):
    assert_error(http.get("/not_found"), 404, "NOT_FOUND")
    assert_error(http.get("/config/"), 404, "NOT_FOUND")
    resp = http.post("/stats")
    assert_error(resp, 405, "METHOD_NOT_ALLOWED")
    assert "GET" in resp.headers["allow"]
    assert_error(http.get("/pub"), 405, "METHOD_NOT_ALLOWED")
    assert_error(http.get("/mpub"), 405, "METHOD_NOT_ALLOWED")
    assert_error(http.put("/topic/create"), 405, "METHOD_NOT_ALLOWED")


def test_trailing_slash_and_case_redirect_as_httprouter(http):
    resp = http.get("/ping/")
    assert (resp.status_code, resp.headers["location"]) == (301, "/ping")
    resp = http.get("/STATS?format=json")
    assert (resp.status_code, resp.headers["location"]) == (301, "/stats?format=json")
    # httprouter v1.3.0 (Go nsqd 1.3.0 answers the same): 307 for a method other than GET
    resp = http.post("/topic/create/?topic=x")
    assert (resp.status_code, resp.headers["location"]) == (307, "/topic/create?topic=x")
    resp = http.post("/PUB?topic=x", content=b"m")
    assert (resp.status_code, resp.headers["location"]) == (307, "/pub?topic=x")
    # a redirect only looks in the request method's routes: GET has no /pub, so /pub/ is not found
    assert_error(http.get("/pub/"), 404, "NOT_FOUND")
    resp = http.options("/pub")
    assert (resp.status_code, resp.headers["allow"], resp.content) == (200, "OPTIONS, POST", b"")
    assert http.get("/pub").headers["allow"] == "OPTIONS, POST"
    resp = http.get("/config/NSQLOOKUPD_TCP_ADDRESSES/")  # a parameter keeps its spelling
    assert (resp.status_code, resp.headers["location"]) == (301, "/config/NSQLOOKUPD_TCP_ADDRESSES")


def test_unclean_paths_are_redirected_not_served(broker):
    """`//pub` is redirected to `/pub` (httprouter's CleanPath), as Go nsqd does, never published."""
    with socket.create_connection(("127.0.0.1", broker.http_port), timeout=5) as sock:
        sock.sendall(b"POST //pub?topic=unclean HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nConnection: close\r\n\r\nm")
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    head = answer.split(b"\r\n\r\n", 1)[0].decode().lower()
    assert head.startswith("http/1.1 307") and "\r\nlocation: /pub?topic=unclean" in head, head


def test_many_requests_on_one_keep_alive_connection(broker):
    topic = unique()
    request = f"POST /pub?topic={topic} HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx".encode()
    n = 1200  # past hypercorn's default of 1000 requests per connection
    with socket.create_connection(("127.0.0.1", broker.http_port), timeout=5) as sock:
        buf = b""
        for _ in range(n):
            sock.sendall(request)
            while b"\r\n\r\nOK" not in buf:
                data = sock.recv(65536)
                assert data, "connection closed"
                buf += data
            assert b"connection: close" not in buf.lower()
            buf = buf[buf.index(b"\r\n\r\nOK") + 6:]
    with httpx.Client(base_url=broker.http_url) as http:
        assert topic_stats(http, topic)["message_count"] == n


# --- /metrics and /openapi.json -----------------------------------------------------------------

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*",?)*\})? (\S+)$')


def parse_prometheus(text: str) -> tuple[dict[str, str], dict[str, float]]:
    """A strict reading of the text exposition format: every line a HELP, a TYPE or a sample;
    returns the families' types and the samples by their full line key."""
    types: dict[str, str] = {}
    samples: dict[str, float] = {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            assert len(line.split(" ", 3)) == 4
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "summary", "histogram", "untyped")
            assert name not in types, f"TYPE twice for {name}"
            types[name] = kind
        else:
            m = _SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            family = m.group(1)
            if family not in types:
                family = re.sub(r"_(count|sum)$", "", family)
            assert family in types, f"sample before its TYPE: {line!r}"
            samples[line.rsplit(" ", 1)[0]] = float(m.group(4))
    return types, samples


def test_metrics_prometheus_text(http, broker):
    topic = unique()
    http.post("/topic/create", params={"topic": topic})
    http.post("/channel/create", params={"topic": topic, "channel": "c"})
    http.post("/mpub", params={"topic": topic}, content=b"a\nbb\nccc")
    wait_for(lambda: topic_stats(http, topic)["channels"][0]["depth"] == 3, message="messages in channel")
    with subscribe(broker.tcp_address, topic, "c", rdy=1) as consumer:
        consumer.expect_message()
        resp = http.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    types, samples = parse_prometheus(resp.text)
    assert types["nsq_topic_depth"] == "gauge"
    assert types["nsq_topic_messages_total"] == "counter"
    assert types["nsq_channel_in_flight_count"] == "gauge"
    assert types["nsq_channel_requeued_total"] == "counter"
    assert samples[f'nsq_topic_messages_total{{topic="{topic}"}}'] == 3
    assert samples[f'nsq_topic_message_bytes_total{{topic="{topic}"}}'] == 6
    assert samples[f'nsq_channel_in_flight_count{{topic="{topic}",channel="c"}}'] == 1
    assert samples[f'nsq_channel_depth{{topic="{topic}",channel="c"}}'] == 2
    assert samples[f'nsq_channel_client_count{{topic="{topic}",channel="c"}}'] == 1
    assert samples["nsq_up"] == 1
    assert any(k.startswith("nsq_client_ready_count{") and f'topic="{topic}"' in k for k in samples)


def test_openapi_document_covers_every_endpoint(http):
    resp = http.get("/openapi.json")
    assert resp.status_code == 200
    doc = resp.json()
    assert doc["openapi"].startswith("3.")
    expected = {"/ping": "get", "/info": "get", "/pub": "post", "/mpub": "post", "/stats": "get",
                "/metrics": "get", "/openapi.json": "get", "/config/{opt}": "put"}
    expected.update({f"/topic/{a}": "post" for a in ("create", "delete", "empty", "pause", "unpause")})
    expected.update({f"/channel/{a}": "post" for a in ("create", "delete", "empty", "pause", "unpause", "seek", "redrive")})
    expected.update({"/topic/config": "post", "/channel/config": "post"})
    expected["/channel/messages"] = "get"
    expected["/replica/fetch"] = "get"  # (cluster mode's; a broker without etcd answers 400 NOT_IN_CLUSTER_MODE)
    for path, method in expected.items():
        assert method in doc["paths"][path], path
        responses = doc["paths"][path][method]["responses"]
        assert "200" in responses
    assert "get" in doc["paths"]["/config/{opt}"]
    pub = doc["paths"]["/pub"]["post"]
    assert {p["name"] for p in pub["parameters"]} == {"topic", "defer"}
    assert "MSG_TOO_BIG" in json.dumps(pub["responses"]["413"])
    # every $ref resolves
    for ref in re.findall(r'"\$ref": "#/components/schemas/(\w+)"', json.dumps(doc)):
        assert ref in doc["components"]["schemas"]


# --- failures to store, TLS -------------------------------------------------------------------


def test_pub_that_cannot_be_stored_is_refused(tmp_path):
    """With room for one message in memory, the next publish goes to the topic's backend; if that
    cannot take it, nsqd answers 503 EXITING and counts nothing. (With a disk queue it is stored.)"""
    b = BrokerProcess(tmp_path, "--mem-queue-size=1").start()
    try:
        with httpx.Client(base_url=b.http_url) as http:
            topic = unique()
            assert http.post("/pub", params={"topic": topic}, content=b"1").status_code == 200
            resp = http.post("/pub", params={"topic": topic}, content=b"2")
            resp_m = http.post("/mpub", params={"topic": topic}, content=b"3\n4")
            t = topic_stats(http, topic)
            if resp.status_code == 503:
                assert_error(resp, 503, "EXITING")
                assert_error(resp_m, 503, "EXITING")
                assert (t["depth"], t["message_count"]) == (1, 1)
            else:  # a backend queue took them
                assert (resp.status_code, resp_m.status_code) == (200, 200)
                assert (t["depth"], t["backend_depth"], t["message_count"]) == (4, 3, 4)
    finally:
        b.stop()


def _self_signed(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    try:
        import trustme
    except ImportError:
        trustme = None
    if trustme is not None:
        server = trustme.CA().issue_cert("127.0.0.1")
        server.cert_chain_pems[0].write_to_path(str(cert))
        server.private_key_pem.write_to_path(str(key))
        return cert, key
    try:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"no trustme and no openssl to make a certificate: {exc}")
    return cert, key


def test_tls_required_refuses_plain_http_and_serves_https(tmp_path):
    cert, key = _self_signed(tmp_path)
    https_port = free_port()
    b = BrokerProcess(tmp_path, f"--tls-cert={cert}", f"--tls-key={key}", "--tls-required",
                      f"--https-address=127.0.0.1:{https_port}")
    b.start(ready_url=f"https://127.0.0.1:{https_port}/ping")
    try:
        resp = httpx.post(f"{b.http_url}/pub?topic=t", content=b"x")
        assert resp.status_code == 403
        assert resp.text == f'{{"message": "TLS_REQUIRED", "https_port": {https_port}}}'
        with httpx.Client(base_url=f"https://127.0.0.1:{https_port}", verify=False) as https:
            assert https.post("/pub", params={"topic": "t"}, content=b"x").text == "OK"
            assert topic_stats(https, "t")["depth"] == 1
    finally:
        b.stop()


def _raw_exchange(port: int, data: bytes) -> bytes:
    """One request on its own connection, `Connection: close`: the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_http2_refused_upload_gets_its_answer(broker):
    """Over HTTP/2 (hypercorn + the QuartTrio app) a body over --max-msg-size and past the first flow
    control window (64 KiB) is read and dropped, so the client gets 413, not a reset; then the connection serves on."""
    topic = unique()
    with httpx.Client(http1=False, http2=True, base_url=broker.http_url) as h2:
        big = h2.post(f"/pub?topic={topic}", content=b"x" * 200_000)  # > 65536, < --max-body-size
        assert (big.http_version, big.status_code, big.json()) == ("HTTP/2", 413, {"message": "MSG_TOO_BIG"})
        assert h2.post(f"/pub?topic={topic}", content=b"after").text == "OK"


def test_requests_handed_to_hypercorn_are_served_by_the_same_routes(broker):
    """A head llhttp refuses but h11 takes (here an obs-folded header) goes to hypercorn with the bytes
    already read; hypercorn serves it through the same Site: /pub and /mpub publish, limits hold."""
    topic = unique()

    def post(path: str, body: bytes, *headers: str) -> bytes:
        head = "".join(h + "\r\n" for h in headers)
        return _raw_exchange(broker.http_port, f"POST {path} HTTP/1.1\r\nHost: x\r\nX-Fold: a\r\n b\r\n{head}"
                             f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)

    assert post(f"/pub?topic={topic}", b"one").endswith(b"\r\n\r\nOK")
    assert post(f"/mpub?topic={topic}&binary=true", mpub_binary([b"two", b"three"])).endswith(b"\r\n\r\nOK")
    assert post(f"/pub?topic={topic}", b"").endswith(b'{"message":"MSG_EMPTY"}')
    assert post(f"/pub?topic={topic}", b"x" * (1024 * 1024 + 1)).endswith(b'{"message":"MSG_TOO_BIG"}')
    with httpx.Client(base_url=broker.http_url) as http:
        assert topic_stats(http, topic)["message_count"] == 3
    with subscribe(broker.tcp_address, topic, "ch", rdy=3) as consumer:
        assert [m.body for m in consumer.expect_messages(3)] == [b"one", b"two", b"three"]
