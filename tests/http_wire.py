"""Raw HTTP exchanges with the three daemons, recorded byte for byte (tests/http_wire.json).

Each case is one connection: the request bytes are sent whole (pipelined requests included), the
answer read until it is as long as the recorded one (or the server closes), and whether the server
then closed the connection is part of the record. `Date` values are the only thing normalised.

    python tests/http_wire.py record      # re-record against the daemons in this checkout

The record was first taken from the hypercorn-served daemons before our own HTTP/1.1 layer replaced
them in front, so test_http_wire.py holds the new layer to every answer the old one gave.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RECORD = Path(__file__).with_name("http_wire.json")
# the broker's limits in these exchanges: small, so that 413s are cheap to provoke with whole bodies
BROKER_FLAGS = {"max_msg_size": 100, "max_body_size": 1000}
SETUP = ["POST /topic/create?topic=wire", "POST /channel/create?topic=wire&channel=c"]


def req(method: str, target: str, headers: list[str] = (), body: bytes = b"", version: str = "1.1",
        host: bool = True, length: bool = True) -> bytes:
    lines = [f"{method} {target} HTTP/{version}"]
    if host:
        lines.append("Host: wire")
    lines += headers
    if body and length and not any(h.lower().startswith(("content-length", "transfer-encoding")) for h in headers):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


CHUNKED = ["Transfer-Encoding: chunked"]


def mpub_binary(bodies: list[bytes]) -> bytes:
    return struct.pack(">i", len(bodies)) + b"".join(struct.pack(">i", len(b)) + b for b in bodies)


def common_cases() -> list[tuple[str, bytes]]:
    """What every daemon's router answers alike: dispatch, redirects, protocol rules."""
    return [
        ("ping", req("GET", "/ping")),
        ("ping head", req("HEAD", "/ping")),
        ("ping http/1.0", req("GET", "/ping", version="1.0", host=False)),
        ("ping http/1.0 keep-alive", req("GET", "/ping", ["Connection: keep-alive"], version="1.0")),
        ("ping close", req("GET", "/ping", ["Connection: close"])),
        ("ping no host", req("GET", "/ping", host=False)),
        ("ping pipelined x3", req("GET", "/ping") * 3),
        ("ping pipelined then close", req("GET", "/ping") + req("GET", "/ping", ["Connection: close"])
         + req("GET", "/ping")),
        ("ping percent path", req("GET", "/p%69ng")),
        ("ping query", req("GET", "/ping?a=1&b")),
        ("ping trailing slash", req("GET", "/ping/")),
        ("ping case", req("GET", "/PING")),
        ("ping double slash", req("GET", "//ping")),
        ("ping dot segment", req("GET", "/x/../ping")),
        ("ping absolute form", req("GET", "http://other/ping")),
        ("ping with body", req("GET", "/ping", body=b"abc")),
        ("ping chunked body", req("GET", "/ping", CHUNKED, chunked(b"abc"))),
        ("ping expect", req("GET", "/ping", ["Expect: 100-continue", "Content-Length: 3"], b"abc")),
        ("not found", req("GET", "/nope")),
        ("not found post", req("POST", "/nope", body=b"x")),
        ("ping post 405", req("POST", "/ping", body=b"x")),
        ("ping delete 405", req("DELETE", "/ping")),
        ("ping options", req("OPTIONS", "/ping")),
        ("options star", req("OPTIONS", "*")),
        ("unknown method", req("FOO", "/ping")),
        ("lowercase method", req("get", "/ping")),
        ("garbage request line", b"GARBAGE\r\n\r\n"),
        ("bad version", b"GET /ping HTTP/9.9\r\nHost: x\r\n\r\n"),
        ("http/0.9", b"GET /ping\r\n\r\n"),
        ("header without colon", req("GET", "/ping", ["nocolon"])),
        ("header space before colon", req("GET", "/ping", ["X-A : b"])),
        ("obs-fold header", req("GET", "/ping", ["X-A: a", " b"])),
        ("huge header", req("GET", "/ping", ["X-Big: " + "b" * 70_000])),
        ("two content lengths", req("POST", "/ping", ["Content-Length: 1", "Content-Length: 2"], b"ab")),
        ("negative content length", req("POST", "/ping", ["Content-Length: -1"], b"a")),
        ("content length and chunked", req("POST", "/ping", ["Content-Length: 3"] + CHUNKED, chunked(b"abc"))),
        ("bad chunk size", req("POST", "/ping", CHUNKED, b"zz\r\nabc\r\n0\r\n\r\n")),
        ("websocket upgrade", req("GET", "/ping", ["Connection: Upgrade", "Upgrade: websocket",
                                                 "Sec-WebSocket-Version: 13",
                                                 "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="])),
        ("bad percent in query", req("GET", "/ping?a=%ZZ")),
    ]


def nsqd_cases() -> list[tuple[str, bytes]]:
    mpub = mpub_binary([b"one", b"two"])
    return common_cases() + [
        ("root", req("GET", "/")),
        ("pub", req("POST", "/pub?topic=wire", body=b"hello")),
        ("pub close", req("POST", "/pub?topic=wire", ["Connection: close"], b"hello")),
        ("pub http/1.0", req("POST", "/pub?topic=wire", body=b"hello", version="1.0")),
        ("pub chunked", req("POST", "/pub?topic=wire", CHUNKED, chunked(b"hel", b"lo"))),
        ("pub expect", req("POST", "/pub?topic=wire", ["Expect: 100-continue"], b"hello")),
        ("pub pipelined x5", req("POST", "/pub?topic=wire", body=b"hello") * 5),
        ("pub pipelined mixed", req("POST", "/pub?topic=wire", body=b"a") + req("GET", "/nope")
         + req("POST", "/pub?topic=wire", CHUNKED, chunked(b"b")) + req("GET", "/ping")),
        ("pub defer", req("POST", "/pub?topic=wire&defer=1000", body=b"later")),
        ("pub bad defer", req("POST", "/pub?topic=wire&defer=x", body=b"later")),
        ("pub empty", req("POST", "/pub?topic=wire", ["Content-Length: 0"])),
        ("pub no topic", req("POST", "/pub", body=b"x")),
        ("pub bad topic", req("POST", "/pub?topic=bad!", body=b"x")),
        ("pub bad query", req("POST", "/pub?topic=%ZZ", body=b"x")),
        ("pub too big declared", req("POST", "/pub?topic=wire", body=b"x" * 101)),
        ("pub too big chunked", req("POST", "/pub?topic=wire", CHUNKED, chunked(b"x" * 60, b"y" * 60))),
        ("pub too big then ping", req("POST", "/pub?topic=wire", body=b"x" * 500) + req("GET", "/ping")),
        ("pub idempotency key", req("POST", "/pub?topic=wire", ["Idempotency-Key: wire-1"], b"x")),
        ("pub bad idempotency key", req("POST", "/pub?topic=wire", ["Idempotency-Key: " + "k" * 300], b"x")),
        ("pub get 405", req("GET", "/pub?topic=wire")),
        ("pub options", req("OPTIONS", "/pub")),
        ("pub trailing slash 307", req("POST", "/pub/?topic=wire", body=b"x")),
        ("pub case 307", req("POST", "/PUB?topic=wire", body=b"x")),
        ("mpub text", req("POST", "/mpub?topic=wire", body=b"a\n\nb\nc\n")),
        ("mpub binary", req("POST", "/mpub?topic=wire&binary=true", body=mpub)),
        ("mpub binary bad", req("POST", "/mpub?topic=wire&binary=true", body=struct.pack(">ii", 5, -1))),
        ("mpub too big", req("POST", "/mpub?topic=wire", body=b"a\n" * 600)),
        ("mpub line too big", req("POST", "/mpub?topic=wire", body=b"a" * 200)),
        ("mpub empty", req("POST", "/mpub?topic=wire", ["Content-Length: 0"])),
        ("mpub idempotency key", req("POST", "/mpub?topic=wire", ["Idempotency-Key: wire-2"], b"a\nb")
         * 2),
        ("topic create", req("POST", "/topic/create?topic=wire2")),
        ("topic create bad", req("POST", "/topic/create?topic=bad!")),
        ("topic delete missing", req("POST", "/topic/delete?topic=nosuch")),
        ("topic pause unpause", req("POST", "/topic/pause?topic=wire") + req("POST", "/topic/unpause?topic=wire")),
        ("channel create missing topic", req("POST", "/channel/create?topic=nosuch&channel=c")),
        ("channel create no channel", req("POST", "/channel/create?topic=wire")),
        ("channel pause unpause", req("POST", "/channel/pause?topic=wire&channel=c")
         + req("POST", "/channel/unpause?topic=wire&channel=c")),
        ("channel empty", req("POST", "/channel/empty?topic=wire&channel=c")),
        ("config get", req("GET", "/config/max_msg_size")),
        ("config get unknown", req("GET", "/config/nope")),
        ("config put log level", req("PUT", "/config/log_level", body=b"info")),
        ("config put empty", req("PUT", "/config/log_level", ["Content-Length: 0"])),
        ("config post 405", req("POST", "/config/log_level", body=b"x")),
        ("openapi", req("GET", "/openapi.json")),
        ("stats bad query", req("GET", "/stats?topic=%ZZ")),
    ]


def lookupd_cases() -> list[tuple[str, bytes]]:
    return common_cases() + [
        ("root", req("GET", "/")),
        ("info", req("GET", "/info")),
        ("topics", req("GET", "/topics")),
        ("nodes", req("GET", "/nodes")),
        ("debug", req("GET", "/debug")),
        ("lookup missing", req("GET", "/lookup?topic=nosuch")),
        ("lookup no topic", req("GET", "/lookup")),
        ("lookup bad query", req("GET", "/lookup?topic=%ZZ")),
        ("channels", req("GET", "/channels?topic=nosuch")),
        ("topic create", req("POST", "/topic/create?topic=wire")),
        ("topic create bad", req("POST", "/topic/create?topic=bad!")),
        ("channel create", req("POST", "/channel/create?topic=wire&channel=c")),
        ("channel delete missing", req("POST", "/channel/delete?topic=wire&channel=nosuch")),
        ("topic tombstone", req("POST", "/topic/tombstone?topic=wire&node=x:1")),
        ("topics post 405", req("POST", "/topics", body=b"x")),
    ]


def admin_cases() -> list[tuple[str, bytes]]:
    return common_cases() + [
        ("config get", req("GET", "/config/log_level")),
        ("config get unknown", req("GET", "/config/nope")),
        ("static missing", req("GET", "/static/nope.js")),
        ("api topics", req("GET", "/api/topics")),
        ("api nodes", req("GET", "/api/nodes")),
        ("api topics post bad body", req("POST", "/api/topics", body=b"{nope")),
        ("api topics post missing", req("POST", "/api/topics", body=b"{}")),
        ("api delete node 405", req("PUT", "/api/nodes/x")),
        ("api topic trailing slash", req("GET", "/api/topics/")),
    ]


CASES = {"nsqd": nsqd_cases, "nsqlookupd": lookupd_cases, "nsqadmin": admin_cases}

_DATE = re.compile(rb"(?im)^(date: )[^\r\n]*")


def normalise(data: bytes) -> bytes:
    return _DATE.sub(rb"\1<date>", data)


def exchange(port: int, data: bytes, want: int | None = None, idle: float = 1.0,
             timeout: float = 10.0) -> tuple[bytes, bool]:
    """Send `data` on a new connection; read until `want` bytes (or, without it, until `idle` seconds
    pass without any), then whether the server closed: (answer, closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
        except OSError:
            pass  # the server may answer and close before it has read everything
        answer = b""
        closed = False
        deadline = time.monotonic() + timeout
        while want is None or len(normalise(answer)) < want:
            sock.settimeout(idle if want is None else max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                closed = True
                break
            answer += chunk
        if not closed:
            # closed is recorded only when the server closes promptly
            sock.settimeout(idle)
            try:
                closed = sock.recv(1) == b""
            except TimeoutError:
                closed = False
            except OSError:
                closed = True
    return normalise(answer), closed


def record_daemon(port: int, cases: list[tuple[str, bytes]]) -> dict[str, dict]:
    for line in SETUP:
        method, target = line.split(" ")
        exchange(port, req(method, target), idle=0.3)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda case: exchange(port, case[1]), cases))
    return {name: {"answer": answer.decode("latin-1"), "closed": closed}
            for (name, _), (answer, closed) in zip(cases, results)}


def main() -> None:
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent))
    from processes import AdminProcess, BrokerProcess, LookupdProcess

    assert sys.argv[1:] == ["record"], __doc__
    with tempfile.TemporaryDirectory() as tmp:
        broker = BrokerProcess(Path(tmp), **BROKER_FLAGS).start()
        lookupd = LookupdProcess(Path(tmp)).start()
        admin = AdminProcess(Path(tmp), lookupd_http_address=lookupd.http_address).start()
        try:
            out = {"nsqd": record_daemon(broker.http_port, nsqd_cases()),
                   "nsqlookupd": record_daemon(lookupd.http_port, lookupd_cases()),
                   "nsqadmin": record_daemon(admin.http_port, admin_cases())}
        finally:
            for daemon in (admin, lookupd, broker):
                daemon.stop()
    RECORD.write_text(json.dumps(out, indent=1, ensure_ascii=True) + "\n")
    print(f"recorded {sum(map(len, out.values()))} exchanges in {RECORD}")


if __name__ == "__main__":
    main()
