"""Hostile input on the TCP ports (issue 8, "Must show" 2): fuzzed byte streams on the broker's TCP port and
lookupd's V1 port. (HTTP has its own place: test_http_fuzz.py.)

Cases come from hypothesis (tests/wire_fuzz.py): valid command sequences, built from their parts with the
sizes right, then mutated; upgraded streams (snappy, deflate, TLS) whose encoded part is mutated; random
bytes. Each example is a batch of cases played at once, each on its own connection, so that a CI-sized
run covers more than 10,000 cases in well under a minute.

For every case: the connection ends within a timeout (answered and closed — nothing hangs); on plain V2
connections every frame the broker sent is well-formed, every error code is nsqd's and a fatal error is
the last frame. While the fuzzing runs a canary producer/consumer pair keeps publishing and consuming
through the same broker and must be served throughout. Afterwards the process is alive, logged no
internal error, holds no client of the fuzzing any more, and a fresh client publishes and consumes.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
import trustme
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nsq_raw import RawNSQ
from processes import LookupdProcess
from wire_fuzz import (
    MAGIC_V2,
    MUTATIONS,
    V2_CASES,
    V2_COMMANDS,
    Canary,
    assert_canary,
    check_v2_answer,
    excerpt,
    line,
    mutate,
    play_sync,
    with_body,
)

FUZZ_SETTINGS = dict(deadline=None, database=None, derandomize=False,
                     suppress_health_check=list(HealthCheck))

V2_BATCH, V2_EXAMPLES = 25, 420  # 10,500 cases on the broker's TCP port
OPEN_BATCH, OPEN_EXAMPLES = 100, 5  # 500 left open, closed by the broker's read timeout
V1_BATCH, V1_EXAMPLES = 40, 100  # 4,000 on lookupd's V1 port

FIGURES: dict[str, int] = {}


def report(name: str, value: int) -> None:
    FIGURES[name] = value
    print(f"\n[fuzz] {name}: {value}")


@pytest.fixture
def fuzz_broker(broker_factory, tmp_path):
    """TLS is offered (not required), so IDENTIFY tls_v1 leads into a handshake with fuzzed bytes."""
    ca = trustme.CA()
    cert = tmp_path / "server.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(cert)
    return broker_factory(tls_cert=cert, tls_key=cert, msg_timeout="5s")


def assert_still_serving(broker) -> None:
    assert broker.is_alive(), broker.log_text()[-3000:]
    log = broker.log_text()
    assert "internal error" not in log and "Traceback" not in log, excerpt(log, ("internal error", "Traceback"))
    # every fuzzing connection is gone from the broker's books
    deadline = time.monotonic() + 10
    while True:
        data = httpx.get(f"http://{broker.http_address}/stats?format=json", timeout=10).json()
        leftover = [(t["topic_name"], c["channel_name"], len(c["clients"]))
                    for t in data["topics"] for c in t["channels"] if c["clients"]]
        if not leftover or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not leftover, leftover
    # and a fresh client publishes and consumes as usual
    with RawNSQ(broker.tcp_address) as consumer, RawNSQ(broker.tcp_address) as producer:
        consumer.identify(heartbeat_interval=5000, feature_negotiation=True)
        consumer.sub("after-fuzz", "ch")
        consumer.rdy(10)
        producer.pub("after-fuzz", b"one")
        producer.mpub("after-fuzz", [b"two", b"three"])
        producer.dpub("after-fuzz", 50, b"four")
        msgs = consumer.expect_messages(4)
        for m in msgs:
            consumer.fin(m.id)
        assert sorted(m.body for m in msgs) == [b"four", b"one", b"three", b"two"]
    assert httpx.get(f"http://{broker.http_address}/ping", timeout=5).text == "OK"


# ---------------------------------------------------------------------------------------------
# TCP protocol V2
# ---------------------------------------------------------------------------------------------


def test_fuzzed_v2_streams(fuzz_broker):
    broker = fuzz_broker
    address = ("127.0.0.1", broker.tcp_port)
    played = {"cases": 0, "plain": 0, "bytes": 0}

    @settings(max_examples=V2_EXAMPLES, **FUZZ_SETTINGS)
    @given(st.lists(V2_CASES, min_size=V2_BATCH, max_size=V2_BATCH))
    def batch(cases):
        outcomes = play_sync(address, [(c.data, c.half_close) for c in cases], timeout=10)
        played["cases"] += len(cases)
        for case, outcome in zip(cases, outcomes):
            played["bytes"] += len(case.data)
            assert outcome.closed, f"no answer and no close within 10 s for {case}"
            if case.kind == "plain" and case.data.startswith(MAGIC_V2):
                played["plain"] += 1
                problem = check_v2_answer(outcome.received)
                assert problem is None, f"{problem}\n  sent {case.data[:300]!r}\n  got {outcome.received[:300]!r}"

    with Canary(broker.tcp_address) as canary:
        batch()
    report("V2 cases (half-closed)", played["cases"])
    print(f"[fuzz] {played['plain']} plain V2 answers checked, {played['bytes']} bytes sent; canary: {canary.summary()}")
    assert played["cases"] >= 10_000
    assert_canary(canary)
    assert_still_serving(broker)


# A stream that stops in the middle of a command and is never closed: nsqd's read deadline (twice the
# heartbeat interval; 1 s asked for here) must end it.
OPEN_CASES = st.builds(
    lambda cmds, muts: MAGIC_V2 + with_body(b"IDENTIFY\n", b'{"heartbeat_interval": 1000}') + mutate(b"".join(cmds), muts),
    st.lists(V2_COMMANDS, min_size=1, max_size=5), MUTATIONS,
)


def test_streams_left_open_are_closed_by_the_read_timeout(fuzz_broker):
    broker = fuzz_broker
    address = ("127.0.0.1", broker.tcp_port)
    played = {"cases": 0, "slowest": 0.0}

    @settings(max_examples=OPEN_EXAMPLES, **FUZZ_SETTINGS)
    @given(st.lists(OPEN_CASES, min_size=OPEN_BATCH, max_size=OPEN_BATCH))
    def batch(streams):
        outcomes = play_sync(address, [(s, False) for s in streams], timeout=8, limit=OPEN_BATCH)
        played["cases"] += len(streams)
        for stream, outcome in zip(streams, outcomes):
            assert outcome.closed, f"the broker kept a silent connection open for 8 s: {stream[:200]!r}"
            played["slowest"] = max(played["slowest"], outcome.seconds)

    with Canary(broker.tcp_address) as canary:
        batch()
    report("V2 cases left open", played["cases"])
    print(f"[fuzz] slowest close {played['slowest']:.2f} s; canary: {canary.summary()}")
    assert played["slowest"] < 4.0  # 2 x 1 s heartbeat interval, plus scheduling
    assert_canary(canary)
    assert_still_serving(broker)


def test_long_lines_and_huge_sizes_are_refused_without_buffering(fuzz_broker):
    """A line without end, or a body size near 2 GiB, must not make the broker buffer it: nsqd's bufio
    line limit and its size checks end the connection first."""
    broker = fuzz_broker
    address = ("127.0.0.1", broker.tcp_port)
    # the size alone is refused with nsqd's error frame, then the connection is closed
    sizes = {
        b"PUB fuzz\n\x7f\xff\xff\xff": b"E_BAD_MESSAGE PUB message too big 2147483647 > 1048576",
        b"DPUB fuzz 10\n\x00\x20\x00\x00": b"E_BAD_MESSAGE DPUB message too big 2097152 > 1048576",
        b"MPUB fuzz\n\x7f\xff\xff\xff": b"E_BAD_BODY MPUB body too big 2147483647 > 5242880",
        b"IDENTIFY\n\x7f\xff\xff\xff": b"E_BAD_BODY IDENTIFY body too big 2147483647 > 5242880",
        b"AUTH\n\x00\x60\x00\x00": b"E_BAD_BODY AUTH body too big 6291456 > 5242880",
        b"PUB fuzz\n\xff\xff\xff\xff": b"E_BAD_MESSAGE PUB invalid message body size -1",
    }
    outcomes = play_sync(address, [(MAGIC_V2 + head, False) for head in sizes], timeout=5)
    for (head, error), outcome in zip(sizes.items(), outcomes):
        assert outcome.closed, head
        assert outcome.received == len(error + b"1234").to_bytes(4, "big") + b"\x00\x00\x00\x01" + error, outcome.received
    # streamed in bulk, they are cut off early (the error frame may be lost to the reset, as with nsqd)
    bulk = [
        MAGIC_V2 + b"PUB " + b"a" * (10 * 1024 * 1024),  # 10 MB and no newline
        MAGIC_V2 + b"PUB fuzz\n\x7f\xff\xff\xff" + b"x" * (10 * 1024 * 1024),
        MAGIC_V2 + b"MPUB fuzz\n\x7f\xff\xff\xff" + b"x" * (10 * 1024 * 1024),
        MAGIC_V2 + b"IDENTIFY\n\x7f\xff\xff\xff" + b"x" * (10 * 1024 * 1024),
    ]
    rss_before = broker.memory()["VmRSS"] / 2**20
    outcomes = play_sync(address, [(c, False) for c in bulk], timeout=10, chunk=65536)
    assert all(o.closed and o.seconds < 5 for o in outcomes), outcomes
    growth = broker.memory()["VmRSS"] / 2**20 - rss_before
    assert growth < 30, f"broker RSS grew {growth:.0f} MB"
    assert "line too long" in broker.log_text()
    assert_still_serving(broker)


# ---------------------------------------------------------------------------------------------
# lookupd: protocol V1
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def lookupd(tmp_path):
    process = LookupdProcess(tmp_path, broadcast_address="127.0.0.1").start()
    yield process
    process.stop()


def _identify_v1(body: bytes, size: int | None = None) -> bytes:
    return with_body(b"IDENTIFY\n", body, size)


V1_NAMES = st.sampled_from([b"t", b"topic", b"c", b"t#ephemeral", b"x" * 64, b"x" * 65, b"", b"bad/", b"\xff"])
V1_IDENTIFY = st.one_of(
    st.fixed_dictionaries({}, optional={
        "broadcast_address": st.one_of(st.text(max_size=10), st.integers()),
        "tcp_port": st.one_of(st.integers(-5, 70000), st.text(max_size=3), st.booleans()),
        "http_port": st.one_of(st.integers(-5, 70000), st.none()),
        "version": st.text(max_size=6), "hostname": st.text(max_size=6),
        "TCP_PORT": st.integers(0, 10),
    }).map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=40),
)
V1_COMMANDS = st.one_of(
    st.builds(_identify_v1, V1_IDENTIFY, st.one_of(st.none(), st.none(), st.sampled_from([-1, 0, 2**31 - 1, 5]))),
    st.builds(lambda t: line(b"REGISTER", t), V1_NAMES),
    st.builds(lambda t, c: line(b"REGISTER", t, c), V1_NAMES, V1_NAMES),
    st.builds(lambda t: line(b"UNREGISTER", t), V1_NAMES),
    st.builds(lambda t, c: line(b"UNREGISTER", t, c), V1_NAMES, V1_NAMES),
    st.sampled_from([b"PING\n", b"PING \n", b" PING\t\n", b"IDENTIFY\n", b"REGISTER\n", b"\n"]),
    st.binary(max_size=30),
)
V1_VALID_IDENTIFY = _identify_v1(b'{"broadcast_address":"fuzz","tcp_port":1,"http_port":2,"version":"1.0"}')
V1_CASES = st.builds(
    lambda magic, ident, cmds, muts: mutate(magic + (V1_VALID_IDENTIFY if ident else b"") + b"".join(cmds), muts),
    st.sampled_from([b"  V1", b"  V1", b"  V1", b"  V2", b""]), st.booleans(),
    st.lists(V1_COMMANDS, min_size=1, max_size=6), MUTATIONS,
)


def check_v1_answer(data: bytes) -> str | None:
    """lookupd's answers are [size][data]: OK, JSON for IDENTIFY, or E_ errors (the last thing sent)."""
    pos = 0
    while len(data) - pos >= 4:
        size = int.from_bytes(data[pos : pos + 4], "big", signed=True)
        if size < 0:
            return f"negative size {size}"
        if len(data) - pos - 4 < size:
            return None
        body = data[pos + 4 : pos + 4 + size]
        pos += 4 + size
        if body.startswith(b"E_"):
            if not re.match(rb"^E_[A-Z_]+( |$)", body):
                return f"odd error {body[:60]!r}"
            if pos != len(data):
                return f"data after error {body[:60]!r}: {data[pos:pos + 60]!r}"
        elif body != b"OK" and not body.startswith(b"{"):
            return f"unexpected answer {body[:60]!r}"
    return None


def test_fuzzed_lookupd_v1_streams(lookupd, broker_factory):
    address = ("127.0.0.1", lookupd.tcp_port)
    played = {"cases": 0}

    @settings(max_examples=V1_EXAMPLES, **FUZZ_SETTINGS)
    @given(st.lists(V1_CASES, min_size=V1_BATCH, max_size=V1_BATCH))
    def batch(streams):
        outcomes = play_sync(address, [(s, True) for s in streams], timeout=10)
        played["cases"] += len(streams)
        for stream, outcome in zip(streams, outcomes):
            assert outcome.closed, f"lookupd neither answered nor closed within 10 s: {stream[:200]!r}"
            if stream.startswith(b"  V1"):
                problem = check_v1_answer(outcome.received)
                assert problem is None, f"{problem}\n  sent {stream[:200]!r}\n  got {outcome.received[:200]!r}"

    batch()
    report("lookupd V1 cases", played["cases"])
    assert lookupd.proc.poll() is None
    log = lookupd.log_text()
    assert "internal error" not in log and "Traceback" not in log, excerpt(log, ("internal error", "Traceback"))
    assert lookupd.http.get("/ping").text == "OK"
    # every fuzzing peer closed, so none is left registered
    deadline = time.monotonic() + 5
    while lookupd.http.get("/nodes").json()["producers"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert lookupd.http.get("/nodes").json() == {"producers": []}
    # and a real broker still registers and is found
    broker = broker_factory(lookupd_tcp_address=f"127.0.0.1:{lookupd.tcp_port}", broadcast_address="127.0.0.1")
    with RawNSQ(broker.tcp_address) as conn:
        conn.pub("after-v1-fuzz", b"x")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        response = lookupd.http.get("/lookup?topic=after-v1-fuzz")
        if response.status_code == 200 and response.json()["producers"]:
            break
        time.sleep(0.1)
    [producer] = response.json()["producers"]
    assert producer["tcp_port"] == broker.tcp_port
