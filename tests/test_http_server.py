"""shared/http_server in-process, on a real loopback socket under trio's MockClock: the idle timeout, a
handler's failure costing one answer, and ConnectionPoller's fast path (a Route's `now`) beside the task
that serves what it cannot answer without awaiting."""

from __future__ import annotations

import functools
import logging

import trio

from trio_nsq.shared.http import serve_site
from trio_nsq.shared.http_api import Reply, Router, plain
from trio_nsq.shared.http_server import IDLE_TIMEOUT, Route, Site

log = logging.getLogger("test")


async def _ping(req, params):
    return plain("OK")


async def _boom(req, params):
    raise RuntimeError("a bug of ours")


SITE = Site(Router({"GET": {"/ping": Route(_ping), "/boom": Route(_boom)}}), log)


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


class _Counted:
    """A site whose /ping is answered without awaiting (its Route's `now`) and whose /slow awaits (its handler): counts
    which path answered what."""

    def __init__(self) -> None:
        self.now: list[str] = []
        self.awaited: list[str] = []
        routes = {"GET": {path: Route(self._awaited(path[1:]), self._now(path[1:]))
                          for path in ("/ping", "/slow", "/boom", "/garbage")}}
        self.site = Site(Router(routes), log)

    def _now(self, name):
        def now(req, params):
            if name == "boom":
                raise RuntimeError("a bug of ours")
            if name == "garbage":
                return "not a Reply"  # a bug that breaks the answer itself, not the handler
            if name == "slow":
                return None
            self.now.append(name)
            return plain(name)
        return now

    def _awaited(self, name):
        async def handler(req, params):
            await trio.sleep(1)
            self.awaited.append(name)
            return plain(name)
        return handler


async def test_the_poller_answers_what_it_can_and_a_task_the_rest_in_order(autojump_clock):
    """Pipelined /ping, /slow, /ping: the first /ping answered in place, /slow by a task after its
    await (and the /ping behind it by that task), the answers in order; the task hands the connection
    back, and later requests go through the fast path again."""
    counted = _Counted()
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(functools.partial(serve_site, counted.site, "127.0.0.1:0"))
        stream = await trio.open_tcp_stream(host, port)
        ping, slow = b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
        await stream.send_all(ping + slow + ping)
        answer = b""
        while answer.count(b"HTTP/1.1 200 ") < 3 or not answer.endswith(b"\r\n\r\nping"):
            answer += await stream.receive_some(65536)
        bodies = [part.rpartition(b"\r\n\r\n")[2] for part in answer.split(b"HTTP/1.1 200 ")[1:]]
        assert bodies == [b"ping", b"slow", b"ping"]
        assert counted.now == ["ping"] and counted.awaited == ["slow", "ping"]
        for _ in range(3):
            await stream.send_all(ping)
            assert (await _answer(stream, b"\r\n\r\nping")).startswith(b"HTTP/1.1 200 ")
        assert counted.now == ["ping"] * 4 and counted.awaited == ["slow", "ping"]
        await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_a_bug_in_the_fast_path_costs_one_answer_or_one_connection(autojump_clock, caplog):
    """A `now` raising is a 500 and the connection goes on; an answer that cannot even be written (a
    handler returning garbage) costs that connection and one log line, and the server keeps serving."""
    counted = _Counted()
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(functools.partial(serve_site, counted.site, "127.0.0.1:0"))
        stream = await trio.open_tcp_stream(host, port)
        await stream.send_all(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\nGET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await _answer(stream, b"ping")
        assert answer.startswith(b"HTTP/1.1 500 ") and b'{"message":"INTERNAL_ERROR"}HTTP/1.1 200 ' in answer
        assert "panic in HTTP handler - RuntimeError('a bug of ours')" in caplog.text

        broken = await trio.open_tcp_stream(host, port)
        await broken.send_all(b"GET /garbage HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await broken.receive_some(100) == b""
        failed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("HTTP: connection failed")]
        assert len(failed) == 1 and "AttributeError" in failed[0], failed

        await stream.send_all(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _answer(stream, b"ping")).startswith(b"HTTP/1.1 200 ")
        await stream.aclose()
        await broken.aclose()
        nursery.cancel_scope.cancel()


async def test_the_poller_closes_a_silent_connection_and_its_connections_at_shutdown(autojump_clock):
    """A connection that never sends a byte is closed after the idle timeout; cancelling the server
    closes the idle connections the poller holds."""
    counted = _Counted()
    async with trio.open_nursery() as outer:
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(functools.partial(serve_site, counted.site, "127.0.0.1:0"))
            silent = await trio.open_tcp_stream(host, port)
            since = trio.current_time()
            assert await silent.receive_some(100) == b""
            assert IDLE_TIMEOUT <= trio.current_time() - since <= IDLE_TIMEOUT + 1.5
            await silent.aclose()

            kept = await trio.open_tcp_stream(host, port)
            await kept.send_all(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await _answer(kept, b"ping")).startswith(b"HTTP/1.1 200 ")
            nursery.cancel_scope.cancel()
        with trio.fail_after(1):
            assert await kept.receive_some(100) == b""
        await kept.aclose()
        outer.cancel_scope.cancel()


_BIG = b"".join(b"%08d\n" % i for i in range(2_000_000))  # 18 MB of numbered lines: a resent stretch shows


async def _big(req, params):
    return Reply(200, _BIG, nsq_header=False)


async def test_an_answer_the_socket_takes_in_many_writes_comes_whole(autojump_clock):
    """An answer far larger than the socket's buffer (/stats with thousands of topics) is written in many
    writes, each from where the last one ended. The compiled build wrote each one from where the first
    partial write had ended (the memoryview it advanced was not kept across the await), so the client got
    a stretch twice and lost the end (issue 43's bench: /stats with 10,000 topics did not parse)."""
    site = Site(Router({"GET": {"/big": Route(_big)}}), log)
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(functools.partial(serve_site, site, "127.0.0.1:0"))
        stream = await trio.open_tcp_stream(host, port)
        await stream.send_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while not answer.endswith(b"%08d\n" % 1_999_999) and len(answer) < len(_BIG) + 1000:
            chunk = await stream.receive_some(1 << 16)
            assert chunk, len(answer)
            answer += chunk
            await trio.sleep(0.001)  # a reader slower than the writer: the socket fills
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b"content-length: %d" % len(_BIG) in head.lower()
        assert body == _BIG
        await stream.aclose()
        nursery.cancel_scope.cancel()
