"""Malformed and hostile HTTP against both daemons' HTTP ports: no input ends a process.

Raw sockets send what no client library would: broken chunked bodies (a `-1` size, garbage and huge
sizes, missing CRLFs), pipelined requests with a bad one among them, Content-Length and
Transfer-Encoding in conflict, bad request lines, huge headers, HTTP/2 prior-knowledge prefaces and
h2c upgrades followed by garbage, connections reset in the middle of a body, and seeded random
mutations of valid requests. Many connections run at once. Afterwards each process is alive, answers
/ping, the broker still publishes and delivers, and neither log holds a traceback.
"""

from __future__ import annotations

import random
import re
import socket
import struct
import urllib.request

import pytest
import trio
from nsq_raw import RawNSQ
from processes import LookupdProcess
from wire_fuzz import mutate, random_mutations

SEED = 20261124
RANDOM_CASES = 1500  # per daemon, on top of the hand-written ones
CONCURRENCY = 40
READ_FOR = 0.3  # seconds each case waits for the server's answer before it closes


def _request(method: str, path: str, headers: list[str], body: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: fuzz\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n"
    return head.encode() + body


def hand_written(pub_path: str) -> list[tuple[str, bytes]]:
    chunked = ["Transfer-Encoding: chunked"]
    cases = [
        ("chunk size -1", _request("POST", pub_path, chunked, b"-1\r\nabc\r\n0\r\n\r\n")),
        ("chunk size garbage", _request("POST", pub_path, chunked, b"zz\r\nabc\r\n0\r\n\r\n")),
        ("chunk size huge", _request("POST", pub_path, chunked, b"ffffffffffffffffffff\r\nabc\r\n")),
        ("chunk without CRLF", _request("POST", pub_path, chunked, b"3\r\nabcdef0\r\n\r\n")),
        ("chunk extension junk", _request("POST", pub_path, chunked, b"3;\x00\x01=\"\r\nabc\r\n0\r\n\r\n")),
        ("chunked then pipelined", _request("POST", pub_path, chunked, b"3\r\nabc\r\n0\r\n\r\n")
         + _request("GET", "/ping", []) + b"-1\r\n\r\n"),
        ("pipelined with a bad one", _request("GET", "/ping", []) * 20 + b"GET /\x00 HTTP/1.1\r\n\r\n"
         + _request("GET", "/ping", []) * 5),
        ("pipelined bodies", (_request("POST", pub_path, ["Content-Length: 3"], b"abc")
                              + _request("POST", pub_path, chunked, b"-1\r\n")) * 10),
        ("length and chunked", _request("POST", pub_path, ["Content-Length: 5"] + chunked, b"3\r\nabc\r\n0\r\n\r\n")),
        ("two lengths", _request("POST", pub_path, ["Content-Length: 5", "Content-Length: 6"], b"abcdef")),
        ("negative length", _request("POST", pub_path, ["Content-Length: -5"], b"abc")),
        ("length not a number", _request("POST", pub_path, ["Content-Length: 1e3"], b"abc")),
        ("length too short", _request("POST", pub_path, ["Content-Length: 1"], b"abcdef") + b"\r\n\r\n"),
        ("bare request line", b"GET\r\n\r\n"),
        ("bad version", b"GET /ping HTTP/9.9\r\n\r\n"),
        ("http/0.9", b"GET /ping\r\n"),
        ("binary request line", bytes(range(256)) + b"\r\n\r\n"),
        ("long target", b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"),
        ("huge header", _request("GET", "/ping", ["X-Big: " + "b" * 200_000])),
        ("many headers", _request("GET", "/ping", [f"X-H{i}: v" for i in range(5000)])),
        ("header without colon", _request("GET", "/ping", ["nocolon"])),
        ("obs-fold header", b"GET /ping HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n"),
        ("http2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x12\x04\x00\x00\x00\x00\x00" + b"\xff" * 40),
        ("http2 preface only", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
        ("h2c upgrade then garbage", _request("GET", "/ping", [
            "Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA"])
         + b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x01\x02" * 100),
        ("h2c upgrade with body", _request("POST", pub_path, [
            "Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: !!!", "Content-Length: 3"], b"abc")),
        ("websocket upgrade", _request("GET", "/ping", [
            "Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Version: 13", "Sec-WebSocket-Key: x"])
         + b"\x81\xff" + b"\x00" * 20),
        ("expect 100 then nothing", _request("POST", pub_path, ["Expect: 100-continue", "Content-Length: 100"])),
        ("absolute form", b"GET http://other/ping HTTP/1.1\r\nHost: x\r\n\r\n"),
        ("connect method", b"CONNECT 127.0.0.1:1 HTTP/1.1\r\nHost: x\r\n\r\n"),
        ("percent garbage", _request("GET", "/pub?topic=%ZZ%%&defer=%00", [])),
        ("utf8 garbage target", "GET /топик?topic=\u0000 HTTP/1.1\r\nHost: x\r\n\r\n".encode("utf-8", "surrogateescape")),
        ("mpub binary lies", _request("POST", pub_path.replace("/pub", "/mpub") + "&binary=true",
                                      ["Content-Length: 12"], struct.pack(">ii", 1000, -1) + b"abcd")),
    ]
    return cases


def mutations(pub_path: str, rng: random.Random, count: int) -> list[tuple[str, bytes]]:
    seeds = [
        _request("POST", pub_path, ["Content-Length: 11"], b"hello world"),
        _request("POST", pub_path, ["Transfer-Encoding: chunked"], b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"),
        _request("GET", "/stats?format=json", []),
        _request("POST", pub_path.replace("/pub", "/mpub"), ["Content-Length: 7"], b"a\nb\nccc"),
        _request("GET", "/ping", ["Connection: keep-alive"]) * 3,
    ]
    pieces = [b"\r\n", b"\r\n\r\n", b"-1", b"\x00", b"chunked", b"Content-Length: ", b"HTTP/1.1", b" ",
              b"ffffffff", b"\xff\xfe", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b":", b"0\r\n\r\n"]
    return [(f"mutation {i}", mutate(rng.choice(seeds), random_mutations(rng, pieces))) for i in range(count)]


SERVER_ERRORS: list[tuple[str, bytes, bytes]] = []


async def play(port: int, name: str, data: bytes, reset: bool, split: int) -> None:
    """Send one case on its own connection; read briefly; close (with RST when `reset`). A 500 answer
    (an unhandled error of ours, not the client's fault) is recorded."""
    answer = b""
    sock = trio.socket.socket()
    try:
        await sock.connect(("127.0.0.1", port))
        with trio.move_on_after(READ_FOR * 3):
            if split and len(data) > split:
                await sock.send(data[:split])
                await trio.sleep(0.01)
                data = data[split:]
            view = memoryview(data)
            while view:
                sent = await sock.send(view)
                view = view[sent:]
        with trio.move_on_after(READ_FOR):
            answer = b""
            while chunk := await sock.recv(65536):
                answer += chunk
                if len(answer) > 65536:
                    break
        for status in re.findall(rb"HTTP/1\.[01] (\d{3})", answer[:65536]):
            if status == b"500":  # 501/505 are protocol answers (Go's net/http gives them too)
                SERVER_ERRORS.append((name, data[:200], answer[:300]))
    except OSError:
        pass  # the server closing first (or resetting) is an answer too
    finally:
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


async def fuzz(port: int, cases: list[tuple[str, bytes]], rng: random.Random) -> None:
    limiter = trio.CapacityLimiter(CONCURRENCY)

    async def one(name: str, data: bytes, reset: bool, split: int) -> None:
        async with limiter:
            await play(port, name, data, reset, split)

    async with trio.open_nursery() as nursery:
        for name, data in cases:
            nursery.start_soon(one, name, data, rng.random() < 0.3, rng.choice([0, 0, 1, 7, 30, 100]))


def http_get(port: int, path: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        return resp.status, resp.read()


@pytest.fixture
def lookupd_process(tmp_path):
    lk = LookupdProcess(tmp_path).start()
    yield lk
    lk.stop()


async def test_no_malformed_http_ends_either_daemon(broker_factory, lookupd_process):
    broker = broker_factory()
    rng = random.Random(SEED)
    pub_path = "/pub?topic=fuzz"
    cases = hand_written(pub_path) * 3 + mutations(pub_path, rng, RANDOM_CASES)
    for port in (broker.http_port, lookupd_process.http_port):
        await fuzz(port, cases, rng)

    assert broker.is_alive(), broker.log_text()[-3000:]
    assert lookupd_process.proc.poll() is None, lookupd_process.log_text()[-3000:]
    assert http_get(broker.http_port, "/ping") == (200, b"OK")
    assert http_get(lookupd_process.http_port, "/ping") == (200, b"OK")
    # the broker still publishes and delivers
    urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{broker.http_port}/pub?topic=after-fuzz", data=b"still here"), timeout=10).read()
    with RawNSQ(broker.tcp_address) as conn:
        conn.sub("after-fuzz", "c")
        conn.rdy(1)
        assert conn.expect_message(timeout=10).body == b"still here"
    # bad input is the client's error: never a 500 from an unhandled error of ours
    assert not SERVER_ERRORS, SERVER_ERRORS[:5]
    for log in (broker.log_text(), lookupd_process.log_text()):
        assert "Traceback" not in log, log[log.index("Traceback") - 500 : log.index("Traceback") + 3000]


async def _trickle(port: int, data: bytes, piece: int, pause: float) -> bytes | None:
    """Send `data` `piece` bytes at a time, `pause` seconds apart; then what the server answers (None
    if the server cut the connection before it had all of `data`)."""
    sock = trio.socket.socket()
    answer: bytes | None = b""
    try:
        await sock.connect(("127.0.0.1", port))
        for i in range(0, len(data), piece):
            view = memoryview(data)[i:i + piece]
            while view:
                view = view[await sock.send(view):]
            await trio.sleep(pause)
        with trio.move_on_after(5):
            while chunk := await sock.recv(65536):
                answer += chunk
    except OSError:
        answer = None  # cut by the server mid-way (its answer, if any, lost to the reset)
    finally:
        sock.close()
    return answer


async def test_slow_clients_and_endless_heads_cost_one_connection_each(broker_factory):
    """Clients that trickle a request a few bytes at a time are served; a head that never ends is cut
    at 16 KiB (431) however slowly it comes; meanwhile everyone else is answered at once; and a burst of
    pipelined requests in one write is answered in order."""
    broker = broker_factory()
    port = broker.http_port
    slow = b"POST /pub?topic=slow HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello"
    endless = b"GET /ping HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"p" * 40_000 + b"\r\n\r\n"
    answers: dict[str, bytes | None] = {}

    async def run(name: str, data: bytes, piece: int, pause: float) -> None:
        answers[name] = await _trickle(port, data, piece, pause)

    async with trio.open_nursery() as nursery:
        for i in range(10):
            nursery.start_soon(run, f"slow{i}", slow, 3, 0.01)
        for i in range(5):
            nursery.start_soon(run, f"endless{i}", endless, 1000, 0.005)
        await trio.sleep(0.2)
        for _ in range(5):  # others are served while those crawl
            assert (await trio.to_thread.run_sync(http_get, port, "/ping")) == (200, b"OK")
    for i in range(10):
        answer = answers[f"slow{i}"]
        assert answer is not None and answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"\r\n\r\nOK")
    for i in range(5):  # cut, its 431 (if it got through before the reset) the only answer
        answer = answers[f"endless{i}"]
        assert answer is None or answer.startswith(b"HTTP/1.1 431 "), answer[:100]

    n = 1000
    burst = b"".join(_request("POST", f"/pub?topic=burst&n={i}", [f"Content-Length: {len(str(i))}"], str(i).encode())
                     for i in range(n)) + _request("GET", "/nope", ["Connection: close"])
    answer = await _trickle(port, burst, len(burst), 0)
    assert answer is not None and answer.count(b"HTTP/1.1 200 ") == n and answer.endswith(b'{"message":"NOT_FOUND"}')
    with RawNSQ(broker.tcp_address) as conn:
        conn.sub("burst", "c")
        conn.rdy(n)
        assert [conn.expect_message(timeout=10).body for _ in range(n)] == [str(i).encode() for i in range(n)]
    assert broker.is_alive() and "Traceback" not in broker.log_text()
