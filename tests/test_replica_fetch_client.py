"""The follower's HTTP client for /replica/fetch (broker/replication/fetch_client.py): keep-alive reuse,
the answers it refuses, and that every failure is a FetchError with the connection dropped. Against a
scripted loopback server (what a leader that misbehaves would send); the real exchange with the real
server is exercised by tests/test_replication_broker.py."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import trio

from trio_nsq.broker.replication.fetch_client import FetchClient, FetchError


async def _serve(nursery: trio.Nursery, answer: Callable[[int, bytes], bytes | None]) -> tuple[int, list[int]]:
    """A loopback server: for each request (the connection's number, the request head) it sends
    answer(...) (None: it closes the connection). Returns its port and the connections it accepted."""
    accepted: list[int] = []

    async def handle(stream: trio.SocketStream) -> None:
        number = len(accepted)
        accepted.append(number)
        buffer = b""
        async with stream:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                reply = answer(number, head)
                if reply is None:
                    return
                await stream.send_all(reply)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
    return listeners[0].socket.getsockname()[1], accepted


def _ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 \r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def test_answers_on_one_connection_and_after_a_close() -> None:
    targets: list[bytes] = []

    def answer(number: int, head: bytes) -> bytes:
        targets.append(head.split(b"\r\n")[0])
        if len(targets) == 2:
            return _ok(b"closing", b"Connection: close\r\n")
        return _ok(b"body %d" % len(targets))

    async with trio.open_nursery() as nursery:
        port, accepted = await _serve(nursery, answer)
        client = FetchClient(f"127.0.0.1:{port}", 5.0)
        try:
            assert await client.get("/replica/fetch?topic=t&position=0") == (200, b"body 1")
            assert await client.get("/replica/fetch?topic=t&position=7") == (200, b"closing")
            assert await client.get("/x") == (200, b"body 3")
        finally:
            await client.aclose()
        nursery.cancel_scope.cancel()
    assert targets == [b"GET /replica/fetch?topic=t&position=0 HTTP/1.1",
                       b"GET /replica/fetch?topic=t&position=7 HTTP/1.1", b"GET /x HTTP/1.1"]
    # kept alive for the first two, a new one after the server said close
    assert accepted == [0, 1]


async def test_a_large_body_in_pieces_and_an_error_status() -> None:
    big = bytes(range(256)) * 4096  # 1 MiB: many receives

    def answer(number: int, head: bytes) -> bytes:
        if b"/err" in head:
            return b'HTTP/1.1 409 \r\ncontent-length: 24\r\n\r\n{"message":"NOT_LEADER"}'
        return _ok(big)

    async with trio.open_nursery() as nursery:
        port, accepted = await _serve(nursery, answer)
        client = FetchClient(f"127.0.0.1:{port}", 5.0)
        try:
            assert await client.get("/big") == (200, big)
            assert await client.get("/err") == (409, b'{"message":"NOT_LEADER"}')
            assert await client.get("/big") == (200, big)
        finally:
            await client.aclose()
        nursery.cancel_scope.cancel()
    assert accepted == [0]


@pytest.mark.parametrize("reply, error", [
    (b"HTTP/1.1 200 \r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", "a chunked answer"),
    (b"HTTP/1.1 200 \r\n\r\nno length", "answer length -1"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP answer"),
    (b"HTTP/1.1 200 \r\ncontent-length: 100\r\n\r\ncut short", "connection closed by the leader"),
    (None, "connection closed by the leader"),
])
async def test_what_is_not_an_answer_is_a_fetch_error(reply: bytes | None, error: str) -> None:
    def answer(number: int, head: bytes) -> bytes | None:
        if number > 0:
            return _ok(b"fine")
        return reply

    async with trio.open_nursery() as nursery:
        port, accepted = await _serve(nursery, answer)
        client = FetchClient(f"127.0.0.1:{port}", 5.0)
        try:
            if reply is not None and b"cut short" in reply:
                # (the server keeps the connection open after a short body: the client's timeout ends it)
                client.timeout = 0.5
                error = "no answer in 0.5s"
            with pytest.raises(FetchError, match=error):
                await client.get("/replica/fetch")
            client.timeout = 5.0
            # the broken connection was dropped: the next fetch opens another
            assert await client.get("/replica/fetch") == (200, b"fine")
        finally:
            await client.aclose()
        nursery.cancel_scope.cancel()
    assert accepted == [0, 1]


async def test_connection_refused_is_a_fetch_error() -> None:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # (nothing listens there now)
    client = FetchClient(f"127.0.0.1:{port}", 5.0)
    with pytest.raises(FetchError):
        await client.get("/replica/fetch")


def test_address_must_be_host_and_port() -> None:
    with pytest.raises(ValueError):
        FetchClient("no-port", 1.0)
