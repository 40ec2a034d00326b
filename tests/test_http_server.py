"""shared/http_server in-process, on a real loopback socket under trio's MockClock: the idle timeout, and a
handler's failure costing one answer."""

from __future__ import annotations

import functools
import logging

import trio

from trio_nsq.shared.http import serve_site
from trio_nsq.shared.http_api import Router, plain
from trio_nsq.shared.http_server import IDLE_TIMEOUT, Site

log = logging.getLogger("test")


async def _call(req, handler, params):
    if handler == "boom":
        raise RuntimeError("a bug of ours")
    return plain("OK")


SITE = Site(Router({"GET": {"/ping": "ping", "/boom": "boom"}}), _call, log)


async def _answer(stream: trio.abc.Stream, end: bytes) -> bytes:
    answer = b""
    while not answer.endswith(end):
        chunk = await stream.receive_some(65536)
        assert chunk, answer
        answer += chunk
    return answer


async def test_an_idle_keep_alive_connection_is_closed_after_the_timeout(autojump_clock):
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(functools.partial(serve_site, SITE, "127.0.0.1:0"))
        stream = await trio.open_tcp_stream(host, port)
        await stream.send_all(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _answer(stream, b"OK")).startswith(b"HTTP/1.1 200 ")
        idle_since = trio.current_time()
        assert await stream.receive_some(100) == b""
        assert IDLE_TIMEOUT <= trio.current_time() - idle_since <= IDLE_TIMEOUT + 1.5
        await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_a_handler_bug_is_a_500_and_the_connection_goes_on(autojump_clock, caplog):
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(functools.partial(serve_site, SITE, "127.0.0.1:0"))
        stream = await trio.open_tcp_stream(host, port)
        await stream.send_all(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\nGET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await _answer(stream, b"OK")
        assert answer.startswith(b"HTTP/1.1 500 ") and b'{"message":"INTERNAL_ERROR"}HTTP/1.1 200 ' in answer
        assert "panic in HTTP handler - RuntimeError('a bug of ours')" in caplog.text
        await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_a_client_that_never_reads_its_answers_is_dropped(autojump_clock):
    """Pipelined requests whose answers the client never reads: the server stops reading once the socket
    is full, and closes the connection after the idle timeout."""
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(functools.partial(serve_site, SITE, "127.0.0.1:0"))
        stream = await trio.open_tcp_stream(host, port)
        started = trio.current_time()
        burst = b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n" * 20_000
        try:
            while True:  # until the server, having stopped reading, cuts the connection
                await stream.send_all(burst)
        except trio.BrokenResourceError:
            pass
        assert trio.current_time() - started >= IDLE_TIMEOUT
        await stream.aclose()
        nursery.cancel_scope.cancel()
