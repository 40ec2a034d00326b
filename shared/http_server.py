"""The HTTP/1.1 server of the three daemons (nsqd, nsqlookupd, trio-nsqadmin): one loop per connection
on a trio stream, requests parsed by httptools (llhttp, in C), routed by shared/http_api.Router and
answered with bytes written here, one write per batch of pipelined answers. No task per request, no
ASGI events, no framework on the way.

Who calls what: a daemon builds a `Site` (its Router of `Route`s, its log) and hands it to
shared/http.serve_site, whose accept loop runs `Connection(...).serve()` for each connection inside a
guard. `Site.__call__` is the one dispatch of the three daemons: the router's own answers (redirects,
405 with Allow, OPTIONS, 404), the route's Reply, and the request log line. Every route of every daemon
has one contract, `Route`: an async handler of (request, path parameters), and, where the route may be
answered in place by the ConnectionPoller, the same answer without awaiting.

Answers are byte for byte what the daemons gave when hypercorn (h11) served them: lowercase header
names, the reply's headers then content-length, date and server; an empty reason phrase; `Connection:
close` when the client asked for it or spoke HTTP/1.0; `100 Continue` first for `Expect: 100-continue`;
a protocol error is `400` (`431` for a head over 16 KiB) with `connection: close`.

What this loop does not serve it hands, with the bytes it has read replayed in front of the stream, to
hypercorn's per-connection server (shared/http.py), which keeps doing what it did: an Upgrade (h2c,
WebSocket: refused), HTTP/2 with prior knowledge, and a request head llhttp refuses but h11 takes
(a lowercase method, `HTTP/9.9`, ...) or answers in its own way. Over TLS there is no hand-off: such a
request is answered 400 and the connection closed.

Limits: a request head (request line and headers) of at most MAX_HEAD bytes; a body is kept up to the
site's max_body (the endpoints apply their own smaller limits while reading); a refused body is read
and dropped within LINGER_SECONDS and LINGER_BYTES so its client sees the answer (past them the
connection closes); a connection idle or stalled for IDLE_TIMEOUT seconds is closed; requests per
connection are not counted (as Go's net/http).
"""

from __future__ import annotations

import logging
import os
import select
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import unquote
from wsgiref.handlers import format_date_time

import httptools
import trio

from trio_nsq.shared.addresses import join_host_port
from trio_nsq.shared.http_api import HTTPError, Reply, Resolved, Router, error_reply, log_request, routed_reply

LINGER_SECONDS = 10.0
LINGER_BYTES = 64 * 1024 * 1024
MAX_HEAD = 16 * 1024  # h11's max_incomplete_event_size, which decided 431 before
IDLE_TIMEOUT = 75.0  # hypercorn's keep_alive_timeout as the daemons configured it
READ_SIZE = 65536
QUICK_READS = 16  # reads in a row without yielding to the scheduler
PARK_BODY = 1024 * 1024  # a body up to this size is awaited in the poller, a larger one in a task
LARGE_REPLY = 256 * 1024  # an answer at least this large is written in pieces, its body never copied
PARK, TASK, CLOSE = 0, 1, 2  # what Connection.step asks of the poller
MAX_EVENTS = 256  # connections served per wake-up of the poller

Handler = Callable[["Request", Mapping[str, str]], Awaitable[Reply]]
NowHandler = Callable[["Request", Mapping[str, str]], "Reply | None"]


class Route:
    """One route of a daemon's table. `handler(request, params)` answers it (params: the path's `:name`
    segments); an HTTPError it raises is answered as {"message": text} with its status. `now`, where
    given, answers a request that came whole without awaiting (ConnectionPoller's fast path), or returns
    None having done nothing, and the handler runs in a task. `logged`: nsqd logs no /pub or /mpub."""

    __slots__ = ("handler", "now", "logged")

    def __init__(self, handler: Handler, now: NowHandler | None = None, *, logged: bool = True) -> None:
        self.handler = handler
        self.now = now
        self.logged = logged


class ClientGone(Exception):
    """The client disconnected before its request body was complete: nothing is done with it."""


class HandOff(Exception):
    """This connection goes to hypercorn from here, with `data` replayed first."""

    def __init__(self, data: bytes) -> None:
        super().__init__("hand-off")
        self.data = data


class BadRequest(Exception):
    """A protocol error we answer ourselves: status, then the connection closes."""

    def __init__(self, status: int = 400) -> None:
        super().__init__(status)
        self.status = status


class Request:
    """One HTTP request as the endpoints see it, whichever server received it (this loop, or the QuartTrio
    app behind hypercorn). ``read(cap)`` returns the body, or None as soon as more than ``cap``
    bytes have arrived; it raises ClientGone if the client leaves first. A request answered without
    awaiting (Site.now) came whole: ``body_now(cap)`` gives its body the same way."""

    __slots__ = ("method", "raw_path", "query", "version", "headers", "content_length", "_peer",
                 "server_port", "expect_continue", "close", "_reader", "_path", "_body")

    def __init__(self, method: str, raw_path: str, query: bytes, headers: dict[str, str], *,
                 reader: Callable[[int], Awaitable[bytes | None]], remote: str | tuple = "", server_port: int = 0,
                 version: str = "1.1", body: bytes | None = None) -> None:
        self.method = method
        self.raw_path = raw_path
        self.query = query
        self.version = version
        self.headers = headers  # lowercased names; a repeated header keeps its first value
        length = headers.get("content-length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        self._peer = remote  # host:port, or the address tuple accept() gave, formatted when asked
        self.server_port = server_port
        self._reader = reader
        self._body = body  # the whole body when it came with the head (None: not kept, past max_body)
        self._path: str | None = None
        connection = headers.get("connection", "").lower()
        self.close = version != "1.1" or "close" in connection
        self.expect_continue = version == "1.1" and "100-continue" in headers.get("expect", "").lower()

    @property
    def path(self) -> str:
        """The path percent-decoded, as Go's URL.Path (and ASGI's "path")."""
        if self._path is None:
            self._path = unquote(self.raw_path) if "%" in self.raw_path else self.raw_path
        return self._path

    @property
    def remote(self) -> str:
        """The client's address as the request log shows it: host:port ("" on a unix socket)."""
        peer = self._peer
        if isinstance(peer, tuple):
            self._peer = peer = join_host_port(peer[0], peer[1])
        return peer

    @property
    def uri(self) -> str:
        """The request URI as logged: the path as received, then the query."""
        return self.path + ("?" + self.query.decode("latin-1") if self.query else "")

    @property
    def idempotency_key(self) -> str | None:
        return self.headers.get("idempotency-key")

    def read(self, cap: int) -> Awaitable[bytes | None]:
        return self._reader(cap)

    def body_now(self, cap: int) -> bytes | None:
        """The body of a request that came whole (what ``read(cap)`` would return)."""
        body = self._body
        return None if body is None or len(body) > cap else body


# --- the one dispatch of the three daemons ----------------------------------------------------------


class Site:
    """A daemon's HTTP API as the server calls it: httprouter's dispatch over `router` (method -> path ->
    Route), each route's handler, and nsqd's request log line. `base_path` is stripped first
    (nsqadmin's --base-path). Handed to serve_site; the QuartTrio app behind hypercorn
    (shared/http_quart.py) calls the same. ConnectionPoller calls `now` for a request that came whole."""

    def __init__(self, router: Router[Route], log: logging.Logger, *, base_path: str = "",
                 max_body: int = 16 * 1024 * 1024) -> None:
        self.router = router
        self.log = log
        self.base = base_path.rstrip("/")
        self.max_body = max_body

    def refusing(self, reply: Reply) -> Site:
        """The same site answering every request with `reply`, unlogged (nsqd's TLS_REQUIRED)."""
        return _Refusing(self, reply)

    async def __call__(self, req: Request) -> Reply:
        start = time.perf_counter_ns()
        path, where, reply = self._route(req)
        if reply is None:
            route = where.handler
            assert route is not None
            try:
                reply = await route.handler(req, where.params)
            except HTTPError as err:
                reply = error_reply(err.status, err.text)
            except (ClientGone, BadRequest):  # the connection's end, not the handler's
                raise
            except Exception as exc:
                reply = self._panic(exc)
            if not route.logged:
                return reply
        self._log(req, path, reply, start)
        return reply

    def now(self, req: Request) -> Reply | None:
        """The answer when it can be given without awaiting (ConnectionPoller's fast path: a request that
        came whole, a route whose `now` answers it), else None, having done nothing."""
        start = time.perf_counter_ns()
        path, where, reply = self._route(req)
        if reply is None:
            route = where.handler
            assert route is not None
            if route.now is None:
                return None
            try:
                reply = route.now(req, where.params)
            except HTTPError as err:
                reply = error_reply(err.status, err.text)
            except Exception as exc:
                reply = self._panic(exc)
            if reply is None or not route.logged:
                return reply
        self._log(req, path, reply, start)
        return reply

    def _route(self, req: Request) -> tuple[str, Resolved[Route], Reply | None]:
        """The path routed (after base_path), where it goes, and the router's own answer if it has one."""
        method, path = req.method, req.path
        base = self.base
        if base and (path == base or path.startswith(base + "/")):
            path = path[len(base):] or "/"
        where = self.router.resolve(method, path)
        return path, where, routed_reply(method, req.query, where)

    def _panic(self, exc: Exception) -> Reply:
        # our bug, not the client's input: worth its traceback
        self.log.error("panic in HTTP handler - %r", exc, exc_info=exc)
        return error_reply(500, "INTERNAL_ERROR")

    def _log(self, req: Request, path: str, reply: Reply, start: int) -> None:
        if not self.log.isEnabledFor(logging.INFO):
            return
        uri = path + ("?" + req.query.decode("latin-1") if req.query else "")
        log_request(self.log, reply.status, req.method, uri, req.remote, time.perf_counter_ns() - start)


class _Refusing(Site):
    """Site.refusing's site: its own class, so that a site serving its routes checks nothing per request."""

    def __init__(self, site: Site, reply: Reply) -> None:
        super().__init__(site.router, site.log, base_path=site.base, max_body=site.max_body)
        self.reply = reply

    async def __call__(self, req: Request) -> Reply:
        return self.reply

    def now(self, req: Request) -> Reply | None:
        return self.reply


# --- answers ----------------------------------------------------------------------------------------

_SERVER = b"server: hypercorn-h11\r\n"  # what every answer said before; kept byte for byte


class _Date:
    """The date header's line, formatted once a second (an instance: compiled, a class cannot keep state)."""

    def __init__(self) -> None:
        self.second = -1
        self.line = b""

    def now(self) -> bytes:
        second = int(time.time())
        if second != self.second:
            self.second = second
            self.line = b"date: " + format_date_time(second).encode() + b"\r\n" + _SERVER
        return self.line


_date = _Date()


_heads: dict[tuple, bytes] = {}


def _head(reply: Reply) -> bytes:
    """Status line and the reply's own headers (memoised: replies are few and mostly constants)."""
    key = (reply.status, reply.content_type, reply.nsq_header, reply.headers)
    head = _heads.get(key)
    if head is None:
        lines = [b"HTTP/1.1 %d \r\n" % reply.status]
        lines += [b"%s: %s\r\n" % (k.lower().encode("latin-1"), v.encode("latin-1"))
                  for k, v in reply.header_list()]
        head = b"".join(lines)
        if len(_heads) < 1024:  # redirects carry their Location: keep the table bounded
            _heads[key] = head
    return head


def reply_bytes(reply: Reply, close: bool, head: bool = False) -> bytes:
    """The whole answer as h11 wrote it for hypercorn (to HEAD without the body)."""
    body = reply.body
    more = reply.more
    return b"".join((_head(reply), b"content-length: %d\r\n" % (len(body) + len(more)), _date.now(),
                     b"Connection: close\r\n\r\n" if close else b"\r\n", b"" if head else body,
                     b"" if head else more))


def reply_pieces(reply: Reply, close: bool) -> list[bytes | memoryview]:
    """reply_bytes's bytes, for a large answer, as pieces written as they are (no copy of the body)."""
    body = reply.body
    more = reply.more
    return [b"".join((_head(reply), b"content-length: %d\r\n" % (len(body) + len(more)), _date.now(),
                      b"Connection: close\r\n\r\n" if close else b"\r\n")), body, more]


def error_bytes(status: int) -> bytes:
    """A protocol error's answer (hypercorn's _send_error_response)."""
    return b"HTTP/1.1 %d \r\ncontent-length: 0\r\nconnection: close\r\n%s\r\n" % (status, _date.now())


def continue_bytes() -> bytes:
    return b"HTTP/1.1 100 \r\n" + _date.now() + b"\r\n"


# --- the connection loop --------------------------------------------------------------------------


class _Message:
    """A request as the parser delivers it: head, then body pieces, then complete."""

    __slots__ = ("method", "url", "headers", "version", "body", "size", "complete", "head_size", "keep")

    def __init__(self) -> None:
        self.url = b""
        self.headers: dict[str, str] = {}
        self.method = ""
        self.version = "1.1"
        self.body: list[bytes] = []
        self.size = 0
        self.complete = False
        self.head_size = 0
        self.keep = True  # body pieces are kept (False once past max_body or when draining)


class IdleTimeouts:
    """The read timeouts of a server's connections: one task (run) ends every wait past its due time by
    trio.lowlevel.notify_closing (the wait raises ClosedResourceError and the connection closes), and
    the poller's connections idle for IDLE_TIMEOUT, checked every second. A cancel scope per connection
    or per read cost more than a short request's parsing."""

    def __init__(self) -> None:
        self.waiting: dict[int, float] = {}  # descriptor -> when its wait ends
        self.poller: ConnectionPoller | None = None

    async def run(self) -> None:
        waiting = self.waiting
        while True:
            await trio.sleep(1.0)
            now = trio.current_time()
            for fd in [fd for fd, due in waiting.items() if due <= now]:
                del waiting[fd]
                trio.lowlevel.notify_closing(fd)
            if self.poller is not None:
                self.poller.expire(now - IDLE_TIMEOUT)


class ConnectionPoller:
    """The plain connections between requests, watched by one task (run) through an epoll of its own:
    a connection becomes readable, and `Connection.step` reads, parses and answers right there what
    Site.now answers (nsqd's /pub, /mpub and /ping; nsqlookupd's routes), for every readable
    connection of one wake-up, so one trip through the scheduler serves many requests (a task per
    connection cost a wake-up, a failed read and an epoll_ctl per request: more than the request).
    Anything else (a body still coming in, a route that awaits, TLS, a hand-off, an answer the socket
    does not take at once) goes to a task of its own, `serve_task`, in the server's nursery; that task
    hands the connection back once it is idle between requests.

    Owned by shared/http.serve_site, which adds every accepted plain connection. Linux only (epoll;
    elsewhere every connection has its task). Cancelling run closes the connections it holds."""

    def __init__(self, nursery: trio.Nursery, serve_task: Callable[[Connection], Awaitable[None]],
                 log: logging.Logger) -> None:
        self.nursery = nursery
        self.serve_task = serve_task
        self.log = log
        self.epoll = select.epoll()
        self.connections: dict[int, Connection] = {}

    def add(self, conn: Connection) -> None:
        if self.epoll.closed:  # the server is shutting down
            conn.sock.close()
            return
        conn.parkable = True
        conn.last_active = trio.current_time()
        self.connections[conn.fd] = conn
        self.epoll.register(conn.fd, select.EPOLLIN)

    def _remove(self, conn: Connection) -> None:
        del self.connections[conn.fd]
        self.epoll.unregister(conn.fd)

    async def run(self) -> None:
        connections = self.connections
        try:
            while True:
                await trio.lowlevel.wait_readable(self.epoll.fileno())
                now = trio.current_time()
                for fd, _ in self.epoll.poll(0, MAX_EVENTS):
                    conn = connections.get(fd)
                    if conn is None:
                        continue
                    try:
                        outcome = conn.step()
                    except trio.BrokenResourceError:
                        outcome = CLOSE
                    except Exception as exc:  # our bug: it costs this connection
                        self.log.error("HTTP: connection failed - %s: %s", type(exc).__name__, exc)
                        outcome = CLOSE
                    if outcome == PARK:
                        conn.last_active = now
                        continue
                    self._remove(conn)
                    if outcome == CLOSE:
                        conn.sock.close()
                    else:
                        self.nursery.start_soon(self.serve_task, conn)
        finally:
            for conn in connections.values():
                conn.sock.close()
            connections.clear()
            self.epoll.close()

    def expire(self, before: float) -> None:
        """Close the connections idle since before `before` (IdleTimeouts calls it every second)."""
        for conn in [conn for conn in self.connections.values() if conn.last_active < before]:
            self._remove(conn)
            conn.sock.close()


class Connection:
    """One HTTP/1.1 connection: read, parse, answer in order, until the client or a limit ends it.
    Run by shared/http.serve_site's accept loop, inside its guard."""

    def __init__(self, site: Site, idle: IdleTimeouts, *, sock: Any = None, stream: trio.abc.Stream | None = None,
                 remote: str | tuple = "", server_port: int, can_hand_off: bool) -> None:
        self.stream = stream  # TLS: a trio stream; plain: None, and `sock`, a non-blocking stdlib socket
        self.sock = sock
        self.idle = idle
        self.site = site
        self.remote = remote
        self.server_port = server_port
        self.can_hand_off = can_hand_off
        self.parser = httptools.HttpRequestParser(self)
        self.ready: deque[_Message] = deque()  # parsed heads, in order; the first is being answered
        self.current: _Message | None = None  # the message the parser is filling
        self.out: list[bytes] = []
        self.eof = False
        # a plain socket's descriptor, read and written without a trip through the scheduler (-1: TLS)
        self.fd = sock.fileno() if sock is not None else -1
        self.quick_reads = 0
        self.broken = 0  # a status to answer once the requests before the error are answered
        self.heads = 0  # request heads parsed so far
        self.partial_head = 0  # bytes fed since the unfinished head began (at most)
        # what was fed since the last message boundary, while a head is incomplete: replayed to
        # hypercorn if llhttp refuses the head
        self.replay: bytearray | None = bytearray()
        self.parkable = False  # set by ConnectionPoller: idle between requests, the task hands it back
        self.closing = False  # the last answer is given (or being written): no more requests are read
        self.handoff: HandOff | None = None  # met by step(): the task hands the connection to hypercorn
        self.last_active = 0.0  # trio.current_time() of its last read in the poller

    # parser callbacks (httptools calls these from feed_data)

    def on_message_begin(self) -> None:
        self.current = _Message()

    def on_url(self, url: bytes) -> None:
        m = self.current
        assert m is not None
        m.url += url
        m.head_size += len(url)
        if m.head_size > MAX_HEAD:
            raise BadRequest(431)

    def on_header(self, name: bytes, value: bytes) -> None:
        m = self.current
        assert m is not None
        m.head_size += len(name) + len(value) + 4
        if m.head_size > MAX_HEAD:
            raise BadRequest(431)
        key = name.decode("latin-1").lower()
        if key not in m.headers:
            m.headers[key] = value.decode("latin-1").strip()

    def on_headers_complete(self) -> None:
        m = self.current
        assert m is not None
        m.version = self.parser.get_http_version()
        if m.version not in ("1.1", "1.0"):
            raise BadRequest(400)  # to hypercorn, if it can be handed off: h11 decides, as before
        m.method = self.parser.get_method().decode("latin-1")
        self.heads += 1
        self.ready.append(m)

    def on_body(self, body: bytes) -> None:
        m = self.current
        assert m is not None
        m.size += len(body)
        if m.keep:
            if m.size > self.site.max_body:
                m.keep = False
                m.body.clear()
            else:
                m.body.append(body)

    def on_message_complete(self) -> None:
        m = self.current
        assert m is not None
        m.complete = True
        self.current = None

    # the loop

    async def serve(self) -> bool:
        """Serve requests until the connection ends (False) or, when parkable, until it is idle between
        requests with every answer written (True: the poller takes it back)."""
        if self.handoff is not None:
            raise self.handoff
        try:
            if not self.closing and await self._serve():
                return True
        except HandOff:
            raise
        except BadRequest as exc:
            self.out.append(error_bytes(exc.status))
        except (ClientGone, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        if self.out:
            try:
                rest = self._write_now()
                if rest is not None:  # a scope only for an answer the socket did not take at once
                    with trio.move_on_after(LINGER_SECONDS):
                        await self._send_slowly(rest)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return False
        return False

    async def _serve(self) -> bool:
        site = self.site
        while True:
            while not self.ready:
                if self.out:
                    await self._flush()
                if self.parkable and not self.broken and not self.eof:
                    return True
                if not await self._feed(IDLE_TIMEOUT):
                    return False
            m = self.ready[0]
            if m.version == "1.1" and "host" not in m.headers:
                raise BadRequest(400)  # h11's rule
            req = self._request(m, whole=False)
            if req.expect_continue:
                self.out.append(continue_bytes())
                await self._flush()
            reply = await site(req)
            close = req.close
            if not m.complete:
                # answered before the body was in (a limit): read and drop the rest first, so that a
                # client still uploading gets the answer and the connection can carry on
                close = not await self._linger(m, req.content_length) or close
            self.ready.popleft()
            if len(reply.body) + len(reply.more) >= LARGE_REPLY and m.method != "HEAD":
                await self._flush()  # the answers before it first
                await self._send_pieces(reply_pieces(reply, close))
            else:
                self.out.append(reply_bytes(reply, close, m.method == "HEAD"))
            if close:
                return False

    def _request(self, m: _Message, whole: bool) -> Request:
        """`m` as the endpoints see it; `whole` (the poller's, for a message complete): its body at hand
        for Request.body_now (a task's request reads it through Request.read instead)."""
        path, _, query = m.url.partition(b"?")
        body: bytes | None = None
        if whole and m.keep:
            body = m.body[0] if len(m.body) == 1 else b"".join(m.body)
        return Request(m.method, path.decode("latin-1"), query, m.headers, reader=self._read_body,
                       remote=self.remote, server_port=self.server_port, version=m.version, body=body)

    async def _read_body(self, cap: int) -> bytes | None:
        """Request.read of the request being answered (the first of `ready`)."""
        return await self._reader(self.ready[0])(cap)

    # the poller's side: everything here runs without awaiting

    def step(self) -> int:
        """The socket is readable: read once, parse, answer what Site.now answers. PARK: back to waiting
        in the poller; TASK: a task goes on with serve(); CLOSE: the connection is done."""
        try:
            data = os.read(self.fd, READ_SIZE)
        except BlockingIOError:
            return PARK
        except OSError:
            return CLOSE
        if not data:
            self.eof = True
            return TASK if self.ready else CLOSE
        try:
            self._parse(data)
        except HandOff as exc:
            self.handoff = exc
            return TASK
        return self._answer_now()

    def _answer_now(self) -> int:
        site = self.site
        while self.ready and not self.broken:
            m = self.ready[0]
            if not m.complete:
                declared = m.headers.get("content-length", "")
                if not declared.isdigit() or int(declared) > PARK_BODY:
                    return TASK  # a large or chunked body: the task reads it (and may answer early)
                break
            if m.version == "1.1" and "host" not in m.headers:
                return TASK
            req = self._request(m, whole=True)
            if req.expect_continue:
                return TASK
            reply = site.now(req)
            if reply is None:
                return TASK
            self.ready.popleft()
            self.out.append(reply_bytes(reply, req.close, m.method == "HEAD"))
            if req.close:
                self.closing = True
                break
        if self.out:
            rest = self._write_now()
            if rest is not None:
                self.out.append(bytes(rest))
                return TASK
        if self.closing:
            return CLOSE
        return TASK if self.broken else PARK

    def _reader(self, m: _Message) -> Callable[[int], Awaitable[bytes | None]]:
        declared = m.headers.get("content-length", "")

        async def read(cap: int) -> bytes | None:
            if declared.isdigit() and int(declared) > cap:
                return None  # refused before it is sent
            while not m.complete and m.size <= cap:
                if not await self._feed(IDLE_TIMEOUT):
                    raise ClientGone()
            if m.size > cap or not m.keep:
                return None
            body = m.body
            return body[0] if len(body) == 1 else b"".join(body)

        return read

    async def _linger(self, m: _Message, declared: int | None) -> bool:
        """Read and drop the rest of `m`'s body within LINGER_SECONDS and LINGER_BYTES: True if it all
        came, False if the connection is to close after the answer."""
        if declared is not None and declared > LINGER_BYTES:
            return False
        m.keep = False
        m.body.clear()
        with trio.move_on_after(LINGER_SECONDS):
            while not m.complete and m.size <= LINGER_BYTES:
                if not await self._feed(LINGER_SECONDS + 1):  # this scope ends it first
                    raise ClientGone()
        return m.complete

    async def _feed(self, timeout: float) -> bool:
        """Read once and parse what came; False when the client has gone (or stayed silent)."""
        if self.broken:
            raise BadRequest(self.broken)
        if self.eof:
            return False
        data = await self._receive(timeout)
        if not data:
            self.eof = True
            return False
        self._parse(data)
        return True

    def _parse(self, data: bytes | bytearray) -> None:
        heads = self.heads
        replay = self.replay
        if replay is not None:
            replay += data
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.ready.pop()  # the upgrade's head, the last one parsed
            self._give_up(replay if self.heads - heads == 1 else None, 400)
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            self._give_up(replay if self.heads == heads else None,
                          cause.status if isinstance(cause, BadRequest) else 400)
        else:
            current = self.current
            if current is None:  # the feed ended on a message boundary
                self.replay = bytearray()
                self.partial_head = 0
            elif current.method:  # a head came whole: nothing before it is to be replayed
                self.replay = None
                self.partial_head = 0
            elif self.heads != heads:  # an unfinished head began in this read, where is not known
                self.replay = None
                self.partial_head = 0
            else:
                # llhttp keeps an unfinished header's bytes itself: bound them here (the count may
                # miss the part of the head that came with the read where it began: < READ_SIZE)
                self.partial_head += len(data)
                if self.partial_head > MAX_HEAD:
                    self._give_up(self.replay, 431)

    def _give_up(self, replay: bytearray | None, status: int) -> None:
        """llhttp refused what came after the answered requests: hypercorn takes the connection over
        if everything since the last message boundary is at hand; else the requests parsed before it
        are answered, then `status` and the connection closes."""
        if self.can_hand_off and replay is not None and not self.ready:
            raise HandOff(bytes(replay))
        self.broken = status

    async def _receive(self, timeout: float) -> bytes | bytearray:
        """What the client sent next (b"" at its end, or after `timeout` seconds of silence). On a plain
        socket the read is tried first and awaited only when nothing is there (a trio stream yields to
        the scheduler on every call, which cost as much as the rest of a request); every QUICK_READS
        reads it yields anyway, so a client that never pauses cannot starve the others."""
        fd = self.fd
        if fd < 0:
            assert self.stream is not None
            with trio.move_on_after(timeout):
                return await self.stream.receive_some(READ_SIZE)
            return b""
        if self.quick_reads < QUICK_READS:
            self.quick_reads += 1
            try:
                return os.read(fd, READ_SIZE)
            except BlockingIOError:
                pass
            except OSError:
                return b""
        self.quick_reads = 0
        waiting = self.idle.waiting
        waiting[fd] = trio.current_time() + timeout
        try:
            while True:
                await trio.lowlevel.wait_readable(fd)
                try:
                    return os.read(fd, READ_SIZE)
                except BlockingIOError:
                    continue
                except OSError:
                    return b""
        finally:
            waiting.pop(fd, None)

    async def _flush(self) -> None:
        """Write the answers gathered so far: at once when the socket takes them all (the usual case),
        else through the stream."""
        rest = self._write_now()
        if rest is not None:
            await self._send_slowly(rest)

    def _write_now(self) -> bytes | memoryview | None:
        """Write what the socket takes now, without awaiting; what is left (None: nothing). Over TLS
        everything is left for the stream."""
        out = self.out
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        if self.fd < 0:
            return data
        try:
            sent = os.write(self.fd, data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise trio.BrokenResourceError(exc) from exc
        return None if sent == len(data) else memoryview(data)[sent:]

    async def _send_slowly(self, data: bytes | memoryview) -> None:
        """A client that reads nothing for IDLE_TIMEOUT seconds while answers wait is gone (no request
        is read meanwhile, so what it holds is bounded by one read's worth of answers)."""
        with trio.move_on_after(IDLE_TIMEOUT):
            if self.stream is not None:
                await self.stream.send_all(data)
                return
            view = memoryview(data)
            while view:
                await trio.lowlevel.wait_writable(self.fd)
                view = self._write_some(view)
            return
        raise trio.BrokenResourceError("the client read nothing for the idle timeout")

    async def _send_pieces(self, pieces: list[bytes | memoryview]) -> None:
        """A large answer: one writev for what the socket takes now, the rest as the socket drains."""
        pieces = [piece for piece in pieces if piece]
        if self.fd >= 0:
            try:
                sent = os.writev(self.fd, pieces)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                raise trio.BrokenResourceError(exc) from exc
            while pieces and sent >= len(pieces[0]):
                sent -= len(pieces[0])
                pieces.pop(0)
            if pieces and sent:
                await self._send_slowly(memoryview(pieces.pop(0))[sent:])
        for piece in pieces:
            await self._send_slowly(piece)

    def _write_some(self, view: memoryview) -> memoryview:
        """What is left of `view` after one write. The count is taken first and the slice after: compiled,
        `view[os.write(fd, view):]` wrote the same bytes more than once (a 16 MB answer went out as 50 to
        90 MB, until the linger timeout closed the connection)."""
        try:
            sent = os.write(self.fd, view)
        except BlockingIOError:
            return view
        except OSError as exc:
            raise trio.BrokenResourceError(exc) from exc
        return view[sent:]
