"""nsqd's HTTP API (nsqd/http.go) as a quart-trio app, served by hypercorn inside the broker's nursery.

Three layers, outermost first:

- ``Front``, the ASGI callable hypercorn is given: refuses plain HTTP with 403 TLS_REQUIRED when TLS is
  required (as nsqd's ServeHTTP), and serves the two hot routes, ``POST /pub`` and ``POST /mpub``, itself
  straight from ASGI events; everything else goes to the Quart app. A Quart request costs several times
  what the publish does (request/response objects, context variables, a nursery per request), so the
  routes whose rate matters skip it. The Quart app has the same two routes, so it is complete on its own.
- the ``QuartTrio`` app from ``create_app``: one route per nsqd endpoint, nsqd's JSON 404/405/500, and
  httprouter's trailing-slash and fixed-path redirects.
- ``Api``: one method per endpoint, free of any framework. It takes an ``ApiRequest`` (method, query
  string, Content-Length and a body reader that stops at a cap) and returns a ``Reply``. Parameters,
  checks, their order, status codes and messages are nsqd's, so nsqadmin, nsq_stat, nsq_to_http and every
  client library keep working.

Request bodies are never taken whole before their size is known to be allowed: a declared
Content-Length over the limit is refused before reading, and a body streamed without one is read only up
to the limit. The rest is read and dropped before the 413 goes out (within LINGER_SECONDS and
LINGER_BYTES; beyond them the answer goes out and the connection closes), because
hypercorn closes a connection whose request body is unfinished when the answer ends, and a client still
uploading would then see a reset instead of the answer; this way the connection even stays usable.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from broker.backend import BackendError
from broker.idempotency import valid_key
from broker.message import Message
from broker.stats import GC_PAUSES, get_stats, health, prometheus_text, stats_text
from broker.topic import Topic
from shared.http import join_host_port, serve_app, to_response
from shared.http_api import (
    EMPTY,
    JSON_TYPE,
    OK,
    TEXT_TYPE,
    HTTPError,
    Reply,
    Router,
    error_reply,
    go_json,
    log_request,
    ok_json,
    parse_go_int,
    parse_query,
    routed_reply,
)
from shared.logs import parse_level
from shared.names import is_valid_channel_name, is_valid_topic_name
from shared.version import VERSION

log = logging.getLogger("nsqd")

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# how long, and how much of, a refused upload is read and dropped so its client can read the answer
LINGER_SECONDS = 10.0
LINGER_BYTES = 64 * 1024 * 1024

# nsqd's boolParams: anything else is "not given" (stats) or "true" (mpub's binary)
BOOL_PARAMS = {"true": True, "1": True, "false": False, "0": False}

# nsqd's lg.LogLevel values, which GET /config/log_level reports
GO_LOG_LEVELS = {"debug": 1, "info": 2, "warn": 3, "error": 4, "fatal": 5}

# Options nsqd has without a flag tag, which /config/:opt therefore does not show
_UNFLAGGED_OPTIONS = frozenset(
    {"queue_scan_interval", "queue_scan_refresh_interval", "queue_scan_dirty_percent", "client_timeout"}
)

# set TRIO_NSQ_HTTP_FAST_PATH=0 to serve /pub and /mpub through Quart too (for measuring the difference)
FAST_PATH = os.environ.get("TRIO_NSQ_HTTP_FAST_PATH", "1") != "0"

_INT32 = struct.Struct(">i")


# --- requests -----------------------------------------------------------------------------------


class ClientGone(Exception):
    """The client disconnected before its request body was complete: nothing is published."""


@attrs.define
class ApiRequest:
    """What an endpoint needs from an HTTP request, whichever layer received it.

    ``read(cap)`` returns the body, or None as soon as more than ``cap`` bytes have arrived (the
    rest is left unread); it raises ClientGone if the client leaves first."""

    method: str
    path: str
    query: bytes
    content_length: int | None
    read: Callable[[int], Awaitable[bytes | None]]
    remote: str = ""
    server_port: int = 0
    idempotency_key: str | None = None  # the Idempotency-Key header, as sent (checked by /pub, /mpub)

    @property
    def uri(self) -> str:
        return self.path + ("?" + self.query.decode("latin-1") if self.query else "")


def parse_binary_mpub(body: bytes, max_msg_size: int, max_body_size: int) -> list[bytes]:
    """nsqd's readMPUB over an HTTP body: [count:int32][size:int32][bytes]...; bytes after the last
    message are ignored, as nsqd reads only what the count announces. Errors are 413 with nsqd's
    code minus its "E_" (BAD_BODY, BAD_MESSAGE)."""
    end = len(body)
    if end < 4:
        raise HTTPError(413, "BAD_BODY")
    (count,) = _INT32.unpack_from(body, 0)
    if count <= 0 or count > (max_body_size - 4) // 5:
        raise HTTPError(413, "BAD_BODY")
    view = memoryview(body)
    unpack = _INT32.unpack_from
    pos = 4
    out: list[bytes] = []
    for _ in range(count):
        if end - pos < 4:
            raise HTTPError(413, "BAD_MESSAGE")
        (size,) = unpack(body, pos)
        pos += 4
        if size <= 0 or size > max_msg_size or end - pos < size:
            raise HTTPError(413, "BAD_MESSAGE")
        out.append(bytes(view[pos : pos + size]))
        pos += size
    return out


# --- the endpoints ------------------------------------------------------------------------------


class Api:
    """nsqd's httpServer handlers, one method per endpoint, each returning a Reply."""

    def __init__(self, nsqd: Any) -> None:
        self.nsqd = nsqd
        self.options = nsqd.options
        self.https_address: tuple[str, int] | None = None

    async def call(self, name: str, req: ApiRequest, **kwargs: Any) -> Reply:
        """Run one endpoint, turning HTTPError into nsqd's error reply; every endpoint but /pub and
        /mpub is logged as nsqd's Log decorator does."""
        start = time.perf_counter_ns()
        try:
            reply = await getattr(self, name)(req, **kwargs)
        except HTTPError as exc:
            if name == "ping":  # nsqd's PlainText decorator: the text as it is
                reply = Reply(exc.status, exc.text.encode(), TEXT_TYPE, nsq_header=False)
            else:
                reply = error_reply(exc.status, exc.text)
        if name not in ("pub", "mpub"):
            self.log_request(req, reply.status, start)
        return reply

    @staticmethod
    def log_request(req: ApiRequest, status: int, start_ns: int) -> None:
        log_request(log, status, req.method, req.uri, req.remote, time.perf_counter_ns() - start_ns)

    # --- query helpers (nsqd's getTopicFromQuery and friends) ----------------------------

    def _params(self, req: ApiRequest) -> dict[str, list[str]]:
        try:
            return parse_query(req.query)
        except ValueError as exc:
            log.error("failed to parse request params - %s", exc)
            raise HTTPError(400, "INVALID_REQUEST") from None

    def _topic_from_query(self, req: ApiRequest) -> tuple[dict[str, list[str]], Topic]:
        """Creates the topic if needed, as nsqd's GetTopic."""
        params = self._params(req)
        names = params.get("topic")
        if names is None:
            raise HTTPError(400, "MISSING_ARG_TOPIC")
        if not is_valid_topic_name(names[0]):
            raise HTTPError(400, "INVALID_TOPIC")
        return params, self.nsqd.get_topic(names[0])

    def _topic_name(self, req: ApiRequest) -> str:
        names = self._params(req).get("topic")
        if names is None:
            raise HTTPError(400, "MISSING_ARG_TOPIC")
        return names[0]

    def _existing_topic(self, name: str) -> Topic:
        topic = self.nsqd.get_existing_topic(name)
        if topic is None:
            raise HTTPError(404, "TOPIC_NOT_FOUND")
        return topic

    def _existing_topic_and_channel_name(self, req: ApiRequest) -> tuple[Topic, str]:
        """nsqd's getExistingTopicFromQuery (the channel endpoints' argument checks)."""
        params = self._params(req)
        topic_names = params.get("topic")
        if topic_names is None:
            raise HTTPError(400, "MISSING_ARG_TOPIC")
        if not is_valid_topic_name(topic_names[0]):
            raise HTTPError(400, "INVALID_ARG_TOPIC")
        channel_names = params.get("channel")
        if channel_names is None:
            raise HTTPError(400, "MISSING_ARG_CHANNEL")
        if not is_valid_channel_name(channel_names[0]):
            raise HTTPError(400, "INVALID_ARG_CHANNEL")
        return self._existing_topic(topic_names[0]), channel_names[0]

    def _existing_channel(self, req: ApiRequest):
        topic, name = self._existing_topic_and_channel_name(req)
        channel = topic.get_existing_channel(name)
        if channel is None:
            raise HTTPError(404, "CHANNEL_NOT_FOUND")
        return channel

    # --- /ping /info ------------------------------------------------------------------------

    async def ping(self, req: ApiRequest) -> Reply:
        text = health(self.nsqd)
        if self.nsqd.health_error is not None:
            raise HTTPError(500, text)
        return Reply(200, text.encode(), TEXT_TYPE, nsq_header=False)

    async def info(self, req: ApiRequest) -> Reply:
        opts = self.options
        tcp = self.nsqd.tcp_address
        http = self.nsqd.http_address
        return ok_json({
            "version": VERSION,
            "broadcast_address": opts.broadcast_address,
            "hostname": socket.gethostname(),
            "http_port": http[1] if http else req.server_port,
            "tcp_port": tcp[1] if tcp else -1,
            "start_time": self.nsqd.start_time,
            "max_heartbeat_interval": _ns(opts.max_heartbeat_interval),
            "max_output_buffer_size": opts.max_output_buffer_size,
            "max_output_buffer_timeout": _ns(opts.max_output_buffer_timeout),
            "max_deflate_level": opts.max_deflate_level,
            "topology_zone": "",
            "topology_region": "",
            "idempotent_publish": True,  # /pub and /mpub honour Idempotency-Key (Go nsqd lacks the field)
        })

    # --- publishing -------------------------------------------------------------------------

    async def pub(self, req: ApiRequest) -> Reply:
        key = self._idempotency_key(req)
        max_msg_size = self.options.max_msg_size
        if req.content_length is not None and req.content_length > max_msg_size:
            raise HTTPError(413, "MSG_TOO_BIG")
        body = await req.read(max_msg_size)
        if body is None:
            raise HTTPError(413, "MSG_TOO_BIG")
        if not body:
            raise HTTPError(400, "MSG_EMPTY")
        params, topic = self._topic_from_query(req)
        deferred = 0.0
        defer = params.get("defer")
        if defer is not None:
            try:
                ms = parse_go_int(defer[0])
            except ValueError:
                raise HTTPError(400, "INVALID_DEFER") from None
            if ms < 0 or ms > self.options.max_req_timeout * 1000:
                raise HTTPError(400, "INVALID_DEFER")
            deferred = ms / 1000
        msg = topic.new_message(body)
        msg.deferred = deferred
        if key is not None:
            await topic.idempotency.publish_once(key, lambda: self._publish(topic, [msg], "pub"))
            return OK
        await self._publish(topic, [msg], "pub")
        return OK

    async def mpub(self, req: ApiRequest) -> Reply:
        key = self._idempotency_key(req)
        opts = self.options
        if req.content_length is not None and req.content_length > opts.max_body_size:
            raise HTTPError(413, "BODY_TOO_BIG")
        params, topic = self._topic_from_query(req)
        binary = False
        values = params.get("binary")
        if values is not None:
            binary = BOOL_PARAMS.get(values[0], True)
            if values[0] not in BOOL_PARAMS:
                log.warning("deprecated value '%s' used for /mpub binary param", values[0])
        body = await req.read(opts.max_body_size)
        if body is None:
            raise HTTPError(413, "BODY_TOO_BIG")
        if binary:
            bodies = parse_binary_mpub(body, opts.max_msg_size, opts.max_body_size)
        else:
            # newline-separated; empty lines are skipped, as nsqd has done since 0.2.22
            bodies = [line for line in body.split(b"\n") if line]
            max_msg_size = opts.max_msg_size
            if any(len(line) > max_msg_size for line in bodies):
                raise HTTPError(413, "MSG_TOO_BIG")
        new_id = topic.guid.new_id
        msgs = [Message(new_id(), b) for b in bodies]
        if key is not None:
            await topic.idempotency.publish_once(key, lambda: self._publish(topic, msgs, "mpub"))
            return OK
        await self._publish(topic, msgs, "mpub")
        return OK

    @staticmethod
    def _idempotency_key(req: ApiRequest) -> str | None:
        key = req.idempotency_key
        if key is not None and not valid_key(key):
            log.error("invalid Idempotency-Key header (%d bytes) on %s", len(key), req.path)
            raise HTTPError(400, "INVALID_IDEMPOTENCY_KEY")
        return key

    async def _publish(self, topic: Topic, msgs: list[Message], what: str) -> bool:
        """Queue the messages (and wait for their fsync with --sync-every=1); True if every one of
        them is on disk now, fsynced (so an Idempotency-Key covering them may be journalled)."""
        in_memory = len(topic.memory)
        try:
            to_backend = topic.put_messages(msgs)
        except BackendError as exc:
            log.error("TOPIC(%s): HTTP %s failed - %s", topic.name, what, exc)
            raise HTTPError(503, "EXITING") from None
        all_on_disk = to_backend and len(topic.memory) == in_memory
        if to_backend:
            await self._sync(topic)
        return all_on_disk and self.options.sync_every == 1

    async def _sync(self, topic: Topic) -> None:
        """With --sync-every=1 a publish is answered only once it is on disk, over HTTP as over TCP
        (concurrent requests share the fsync: the backend's sync is a group commit)."""
        if self.options.sync_every != 1:
            return
        try:
            await topic.backend.sync()
        except BackendError as exc:
            log.error("TOPIC(%s): failed to sync published messages - %s", topic.name, exc)
            raise HTTPError(500, "INTERNAL_ERROR") from None

    # --- /stats /metrics /openapi.json -----------------------------------------------------

    async def stats(self, req: ApiRequest) -> Reply:
        params = self._params(req)

        def first(key: str) -> str:
            return params.get(key, [""])[0]

        snapshot = get_stats(self.nsqd, first("topic"), first("channel"),
                             include_clients=BOOL_PARAMS.get(first("include_clients"), True),
                             include_mem=BOOL_PARAMS.get(first("include_mem"), True))
        if first("format") != "json":
            return Reply(200, stats_text(snapshot).encode(), TEXT_TYPE)
        return ok_json(snapshot.to_json())

    async def metrics(self, req: ApiRequest) -> Reply:
        return Reply(200, prometheus_text(self.nsqd).encode(), PROMETHEUS_TYPE, nsq_header=False)

    async def openapi(self, req: ApiRequest) -> Reply:
        return Reply(200, _openapi_bytes(), JSON_TYPE, nsq_header=False)

    # --- topics -----------------------------------------------------------------------------

    async def topic_create(self, req: ApiRequest) -> Reply:
        self._topic_from_query(req)
        return EMPTY

    async def topic_delete(self, req: ApiRequest) -> Reply:
        try:
            self.nsqd.delete_topic(self._topic_name(req))
        except KeyError:
            raise HTTPError(404, "TOPIC_NOT_FOUND") from None
        return EMPTY

    async def topic_empty(self, req: ApiRequest) -> Reply:
        name = self._topic_name(req)
        if not is_valid_topic_name(name):
            raise HTTPError(400, "INVALID_TOPIC")
        topic = self._existing_topic(name)
        try:
            await topic.empty()
        except (BackendError, OSError) as exc:
            log.error("TOPIC(%s): failed to empty - %s", name, exc)
            raise HTTPError(500, "INTERNAL_ERROR") from None
        return EMPTY

    async def topic_pause(self, req: ApiRequest, *, unpause: bool = False) -> Reply:
        topic = self._existing_topic(self._topic_name(req))
        if unpause:
            topic.unpause()
        else:
            topic.pause()
        # persisted at once so a crash cannot silently (un)pause it, as nsqd
        self.nsqd.persist_metadata()
        return EMPTY

    async def topic_unpause(self, req: ApiRequest) -> Reply:
        return await self.topic_pause(req, unpause=True)

    # --- channels ---------------------------------------------------------------------------

    async def channel_create(self, req: ApiRequest) -> Reply:
        topic, name = self._existing_topic_and_channel_name(req)
        topic.get_channel(name)
        return EMPTY

    async def channel_delete(self, req: ApiRequest) -> Reply:
        topic, name = self._existing_topic_and_channel_name(req)
        try:
            topic.delete_channel(name)
        except KeyError:
            raise HTTPError(404, "CHANNEL_NOT_FOUND") from None
        return EMPTY

    async def channel_empty(self, req: ApiRequest) -> Reply:
        channel = self._existing_channel(req)
        try:
            await channel.empty()
        except (BackendError, OSError) as exc:
            log.error("CHANNEL(%s): failed to empty - %s", channel.name, exc)
            raise HTTPError(500, "INTERNAL_ERROR") from None
        return EMPTY

    async def channel_pause(self, req: ApiRequest, *, unpause: bool = False) -> Reply:
        channel = self._existing_channel(req)
        if unpause:
            channel.unpause()
        else:
            channel.pause()
        self.nsqd.persist_metadata()
        return EMPTY

    async def channel_unpause(self, req: ApiRequest) -> Reply:
        return await self.channel_pause(req, unpause=True)

    # --- /config/:opt -----------------------------------------------------------------------

    async def config(self, req: ApiRequest, opt: str) -> Reply:
        """GET any option by its config-file name; PUT nsqlookupd_tcp_addresses (a JSON list) or
        log_level (debug, info, warn, error, fatal; bare or as a JSON string). Answers with the value."""
        if req.method == "PUT":
            body = await req.read(self.options.max_msg_size)
            if not body:  # None (too big) or empty
                raise HTTPError(413, "INVALID_VALUE")
            if opt == "nsqlookupd_tcp_addresses":
                try:
                    addresses = json.loads(body)
                except ValueError:
                    raise HTTPError(400, "INVALID_VALUE") from None
                if addresses is None:
                    addresses = []
                if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
                    raise HTTPError(400, "INVALID_VALUE")
                self.nsqd.set_lookupd_addresses(addresses)
            elif opt == "log_level":
                self._set_log_level(body)
            else:
                raise HTTPError(400, "INVALID_OPTION")
        try:
            return ok_json(option_value(self.options, opt))
        except KeyError:
            raise HTTPError(400, "INVALID_OPTION") from None

    def _set_log_level(self, body: bytes) -> None:
        text = body.decode("utf-8", "replace")
        if text.startswith('"'):
            try:
                text = json.loads(text)
            except ValueError:
                raise HTTPError(400, "INVALID_VALUE") from None
        level = str(text).lower()
        if level not in GO_LOG_LEVELS:
            raise HTTPError(400, "INVALID_VALUE")
        self.options.log_level = level
        root = logging.getLogger()
        root.setLevel(parse_level(level))
        logging.getLogger("hypercorn").setLevel(max(logging.WARNING, root.level))
        log.info("log level set to %s", level)


def option_value(options: Any, name: str) -> Any:
    """An option as nsqd's getOptByCfgName shows it in JSON: durations in nanoseconds, the log level
    as lg.LogLevel's number. Raises KeyError for an unknown name."""
    for field in attrs.fields(type(options)):
        if (field.metadata.get("cfg") or field.name) != name or field.name in _UNFLAGGED_OPTIONS:
            continue
        value = getattr(options, field.name)
        if field.name == "log_level":
            level = str(value).lower()
            return GO_LOG_LEVELS.get("warn" if level == "warning" else level, 0)
        if field.metadata.get("kind") == "duration":
            return _ns(value)
        return value
    raise KeyError(name)


def _ns(seconds: float) -> int:
    return int(round(seconds * 1_000_000_000))


# --- the Quart app ------------------------------------------------------------------------------

# method -> httprouter path -> Api method; /pub and /mpub are also served by Front when FAST_PATH is on
ROUTES: dict[str, dict[str, str]] = {
    "GET": {
        "/ping": "ping",
        "/info": "info",
        "/stats": "stats",
        "/config/:opt": "config",
        "/metrics": "metrics",
        "/openapi.json": "openapi",
    },
    "POST": {
        "/pub": "pub",
        "/mpub": "mpub",
        "/topic/create": "topic_create",
        "/topic/delete": "topic_delete",
        "/topic/empty": "topic_empty",
        "/topic/pause": "topic_pause",
        "/topic/unpause": "topic_unpause",
        "/channel/create": "channel_create",
        "/channel/delete": "channel_delete",
        "/channel/empty": "channel_empty",
        "/channel/pause": "channel_pause",
        "/channel/unpause": "channel_unpause",
    },
    "PUT": {"/config/:opt": "config"},
}
ROUTER = Router(ROUTES)


def _quart_request() -> ApiRequest:
    async def read(cap: int) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        try:
            async for data in request.body:
                size += len(data)
                if size > cap:
                    return None
                chunks.append(data)
        except RequestEntityTooLarge:
            return None
        return b"".join(chunks)

    client = request.scope.get("client") or ("", 0)
    server = request.scope.get("server") or ("", 0)
    return ApiRequest(
        method=request.method,
        path=request.path,
        query=request.query_string,
        content_length=request.content_length,
        read=read,
        remote=join_host_port(client[0], client[1]) if client[0] else "",
        server_port=server[1] or 0,
        idempotency_key=request.headers.get("Idempotency-Key"),
    )


def create_app(api: Api) -> QuartTrio:
    app = QuartTrio(__name__)
    opts = api.options
    # Quart's own body buffer stops here; each endpoint applies its smaller limit while reading
    app.config["MAX_CONTENT_LENGTH"] = max(opts.max_body_size, opts.max_msg_size)

    @app.before_request
    async def dispatch() -> Response:
        # every request is answered here (httprouter's dispatch), so werkzeug's routing never gets a say
        start = time.perf_counter_ns()
        # the ASGI path as received (percent-decoded), as Go's URL.Path: Quart's request.path is normalised
        path = request.scope.get("path") or request.path
        where = ROUTER.resolve(request.method, path)
        routed = routed_reply(request.method, request.query_string, where)
        if routed is not None:
            Api.log_request(_quart_request(), routed.status, start)
            return to_response(routed)
        assert where.handler is not None
        return to_response(await api.call(where.handler, _quart_request(), **where.params))

    @app.errorhandler(Exception)
    async def internal_error(exc: Exception) -> Response:
        if isinstance(exc, HTTPException):
            text = (exc.name or "ERROR").upper().replace(" ", "_")
            return to_response(error_reply(exc.code or 500, text))
        log.error("panic in HTTP handler - %r", exc, exc_info=exc)
        return to_response(error_reply(500, "INTERNAL_ERROR"))

    return app


# --- the ASGI front -----------------------------------------------------------------------------


class AsgiBody:
    """A request body read straight from ASGI receive() events, never more than asked for."""

    __slots__ = ("receive", "done", "received")

    def __init__(self, receive: Callable[[], Awaitable[dict]]) -> None:
        self.receive = receive
        self.done = False
        self.received = 0

    async def read(self, cap: int) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        receive = self.receive
        while not self.done:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            data = message.get("body", b"")
            if not message.get("more_body", False):
                self.done = True
            size += len(data)
            if size > cap:
                self.received += size
                return None
            chunks.append(data)
        self.received += size
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def drain(self, budget: int) -> None:
        """Read and drop what is left, up to `budget` bytes in all, so the answer reaches a client
        still uploading and the connection can carry on."""
        receive = self.receive
        while not self.done and self.received <= budget:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            self.received += len(message.get("body", b""))
            if not message.get("more_body", False):
                self.done = True

    async def linger(self, content_length: int | None) -> None:
        """drain() within LINGER_SECONDS and LINGER_BYTES; an upload declared bigger than that is
        answered at once (and the connection closed by hypercorn), as there is no point reading it."""
        if self.done or (content_length is not None and content_length > LINGER_BYTES):
            return
        with trio.move_on_after(LINGER_SECONDS):
            await self.drain(LINGER_BYTES)


# an ASGI 3 application; Front hands scopes and events through to it untouched
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


class Front:
    """The ASGI app hypercorn serves: TLS requirement, the hot routes, then the Quart app."""

    def __init__(self, app: ASGIApp, api: Api, *, tls: bool, fast_path: bool = FAST_PATH) -> None:
        self.app = app
        self.api = api
        self.tls = tls
        self.fast = {"/pub": "pub", "/mpub": "mpub"} if fast_path else {}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            if not self.tls and self.api.nsqd.tls_required_http:
                await self._tls_required(receive, send)
                return
            if scope["method"] == "POST":
                name = self.fast.get(scope["path"])
                if name is not None:
                    await self._serve(name, scope, receive, send)
                    return
            await self._delegate(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _delegate(self, scope: dict, receive: Callable, send: Callable) -> None:
        """Hand a request to Quart, holding back the end of its answer until the request body is in.

        Hypercorn closes a connection whose response ended before its request body did, so a client
        still uploading may see a reset instead of the answer; Quart keeps reading (and, past its
        MAX_CONTENT_LENGTH, dropping) the body meanwhile. Each send is shielded because quart-trio
        cancels its request nursery when a disconnect arrives, which can land inside hypercorn's own
        close bookkeeping and leave the connection open forever."""
        done = trio.Event()

        async def tracking_receive() -> dict:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                done.set()
            return message

        async def patient_send(message: dict) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not done.is_set():
                declared = _content_length(scope)
                if declared is None or declared <= LINGER_BYTES:
                    with trio.move_on_after(LINGER_SECONDS):
                        await done.wait()
            with trio.CancelScope(shield=True):
                await send(message)

        await self.app(scope, tracking_receive, patient_send)

    async def _serve(self, name: str, scope: dict, receive: Callable, send: Callable) -> None:
        body = AsgiBody(receive)
        content_length = _content_length(scope)
        client = scope.get("client") or ("", 0)
        req = ApiRequest("POST", scope["path"], scope["query_string"], content_length, body.read,
                         f"{client[0]}:{client[1]}", (scope.get("server") or ("", 0))[1] or 0,
                         _header(scope, b"idempotency-key"))
        try:
            reply = await self.api.call(name, req)
            # answered before the body was in (a limit): read and drop the rest first, since
            # hypercorn closes a connection whose request is unfinished when the answer ends
            await body.linger(content_length)
        except ClientGone:
            return
        await send_reply(send, reply)

    async def _tls_required(self, receive: Callable, send: Callable) -> None:
        https_port = self.api.https_address[1] if self.api.https_address else 0
        # nsqd writes this one by hand, spaces included
        payload = f'{{"message": "TLS_REQUIRED", "https_port": {https_port}}}'.encode()
        try:
            await AsgiBody(receive).linger(None)
        except ClientGone:
            return
        await send_reply(send, Reply(403, payload, JSON_TYPE))


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _content_length(scope: dict) -> int | None:
    for key, value in scope["headers"]:
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def send_reply(send: Callable, reply: Reply) -> None:
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in reply.header_list()]
    headers.append((b"content-length", str(len(reply.body)).encode()))
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})


# --- serving ------------------------------------------------------------------------------------

HYPERCORN_SETTINGS: dict[str, Any] = {
    # nsqd (Go's net/http) does not close a keep-alive connection after N requests
    "keep_alive_max_requests": 1 << 31,
}


async def serve_http(nsqd: Any, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the HTTP API on --http-address (and HTTPS on --https-address when TLS is configured)
    until cancelled; reports the bound HTTP (host, port)."""
    GC_PAUSES.install()
    opts = nsqd.options
    api = Api(nsqd)
    app = create_app(api)
    async with trio.open_nursery() as nursery:
        if opts.https_address and nsqd.tls_context is not None:
            api.https_address = await nursery.start(
                functools.partial(serve_app, Front(app, api, tls=True), opts.https_address,
                                  **HYPERCORN_SETTINGS, **_tls_settings(opts))
            )
            log.info("HTTPS: listening on %s", join_host_port(*api.https_address))
        bound = await nursery.start(
            functools.partial(serve_app, Front(app, api, tls=False), opts.http_address, **HYPERCORN_SETTINGS)
        )
        task_status.started(bound)


def _tls_settings(opts: Any) -> dict[str, Any]:
    import ssl

    settings: dict[str, Any] = {"certfile": opts.tls_cert, "keyfile": opts.tls_key, "alpn_protocols": ["http/1.1"]}
    if opts.tls_root_ca_file:
        settings["ca_certs"] = opts.tls_root_ca_file
    if opts.tls_client_auth_policy in ("require", "require-verify"):
        settings["verify_mode"] = ssl.CERT_REQUIRED
    return settings


# --- OpenAPI ------------------------------------------------------------------------------------


@functools.cache
def _openapi_bytes() -> bytes:
    return go_json(openapi_spec())


def _param(name: str, description: str, *, required: bool = False, schema: dict | None = None) -> dict:
    return {"name": name, "in": "query", "required": required, "description": description,
            "schema": schema or {"type": "string"}}


def _err(*messages: str) -> dict:
    return {
        "description": " | ".join(messages),
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"},
                                         "examples": {m: {"value": {"message": m}} for m in messages}}},
    }


_TEXT_OK = {"description": "OK", "content": {"text/plain": {"schema": {"type": "string", "example": "OK"}}}}
_EMPTY_OK = {"description": "Done (empty body)"}
_TOPIC = _param("topic", "topic name: [.a-zA-Z0-9_-]+(#ephemeral)?, 1-64 characters", required=True)
_CHANNEL = _param("channel", "channel name: [.a-zA-Z0-9_-]+(#ephemeral)?, 1-64 characters", required=True)
_INTEGER = {"type": "integer", "format": "int64"}
_BOOL = {"type": "boolean"}


def _schemas() -> dict:
    latency = {
        "type": "object",
        "properties": {
            "count": {"type": "integer"},
            "percentiles": {"type": "array", "nullable": True, "items": {
                "type": "object", "properties": {"quantile": {"type": "number"}, "value": {"type": "number",
                                                                                     "description": "nanoseconds"}}}},
        },
    }
    client = {"type": "object", "properties": {
        **{k: {"type": "string"} for k in ("client_id", "hostname", "version", "remote_address", "user_agent",
                                            "tls_cipher_suite", "tls_version", "tls_negotiated_protocol",
                                            "auth_identity", "auth_identity_url", "topology_zone", "topology_region")},
        **{k: _INTEGER for k in ("state", "ready_count", "in_flight_count", "message_count", "finish_count",
                                  "requeue_count", "connect_ts", "sample_rate", "output_buffer_size",
                                  "output_buffer_timeout")},
        **{k: _BOOL for k in ("deflate", "snappy", "tls", "authed", "tls_negotiated_protocol_is_mutual")},
        "pub_counts": {"type": "array", "items": {"type": "object", "properties": {
            "topic": {"type": "string"}, "count": _INTEGER}}},
    }}
    channel = {"type": "object", "properties": {
        "channel_name": {"type": "string"},
        **{k: _INTEGER for k in ("depth", "backend_depth", "in_flight_count", "deferred_count", "message_count",
                                  "requeue_count", "timeout_count", "client_count")},
        "clients": {"type": "array", "nullable": True, "items": {"$ref": "#/components/schemas/Client"}},
        "paused": _BOOL,
        "e2e_processing_latency": {"$ref": "#/components/schemas/Latency"},
    }}
    topic = {"type": "object", "properties": {
        "topic_name": {"type": "string"},
        "channels": {"type": "array", "items": {"$ref": "#/components/schemas/ChannelStats"}},
        **{k: _INTEGER for k in ("depth", "backend_depth", "message_count", "message_bytes")},
        "paused": _BOOL,
        "e2e_processing_latency": {"$ref": "#/components/schemas/Latency"},
        "idempotency_keys": {**_INTEGER, "description": "Idempotency-Keys the topic holds"},
    }}
    memory = {"type": "object", "properties": {k: _INTEGER for k in (
        "heap_objects", "heap_idle_bytes", "heap_in_use_bytes", "heap_released_bytes", "gc_pause_usec_100",
        "gc_pause_usec_99", "gc_pause_usec_95", "next_gc_bytes", "gc_total_runs")}}
    stats = {"type": "object", "required": ["version", "health", "start_time", "topics", "producers"], "properties": {
        "version": {"type": "string"}, "health": {"type": "string"}, "start_time": _INTEGER,
        "topics": {"type": "array", "nullable": True, "items": {"$ref": "#/components/schemas/TopicStats"}},
        "memory": {"$ref": "#/components/schemas/Memory"},
        "producers": {"type": "array", "nullable": True, "items": {"$ref": "#/components/schemas/Client"}},
    }}
    info = {"type": "object", "properties": {
        "version": {"type": "string"}, "broadcast_address": {"type": "string"}, "hostname": {"type": "string"},
        "http_port": {"type": "integer"}, "tcp_port": {"type": "integer"}, "start_time": _INTEGER,
        "max_heartbeat_interval": {**_INTEGER, "description": "nanoseconds"},
        "max_output_buffer_size": _INTEGER,
        "max_output_buffer_timeout": {**_INTEGER, "description": "nanoseconds"},
        "max_deflate_level": {"type": "integer"},
        "topology_zone": {"type": "string"}, "topology_region": {"type": "string"},
        "idempotent_publish": {"type": "boolean"},
    }}
    error = {"type": "object", "required": ["message"], "properties": {"message": {"type": "string"}}}
    return {"Error": error, "Info": info, "Stats": stats, "TopicStats": topic, "ChannelStats": channel,
            "Client": client, "Latency": latency, "Memory": memory}


def openapi_spec() -> dict:
    """An OpenAPI 3.0 description of every endpoint: parameters, bodies, statuses and error messages."""
    not_allowed = _err("METHOD_NOT_ALLOWED")
    bad_query = "INVALID_REQUEST"

    def op(summary: str, responses: dict, parameters: list | None = None, body: dict | None = None,
           description: str = "") -> dict:
        operation: dict[str, Any] = {"summary": summary, "responses": {**responses, "405": not_allowed}}
        if description:
            operation["description"] = description
        if parameters:
            operation["parameters"] = parameters
        if body:
            operation["requestBody"] = body
        return operation

    binary_body = {"required": True, "content": {"application/octet-stream": {"schema": {
        "type": "string", "format": "binary"}}}}
    paths: dict[str, Any] = {
        "/ping": {"get": op("Health check", {
            "200": _TEXT_OK,
            "500": {"description": "unhealthy", "content": {"text/plain": {"schema": {
                "type": "string", "example": "NOK - failed to write to disk"}}}}})},
        "/info": {"get": op("Version and listening ports", {
            "200": {"description": "broker information", "content": {"application/json": {"schema": {
                "$ref": "#/components/schemas/Info"}}}}})},
        "/pub": {"post": op(
            "Publish one message", {
                "200": _TEXT_OK,
                "400": _err("MSG_EMPTY", "MISSING_ARG_TOPIC", "INVALID_TOPIC", "INVALID_DEFER", "INVALID_IDEMPOTENCY_KEY", bad_query),
                "413": _err("MSG_TOO_BIG"),
                "500": _err("INTERNAL_ERROR"),
                "503": _err("EXITING")},
            [_TOPIC, _param("defer", "delay delivery by this many milliseconds (0 to --max-req-timeout)",
                            schema=_INTEGER)],
            binary_body, "The body is the message (1 byte to --max-msg-size)."),
        },
        "/mpub": {"post": op(
            "Publish several messages", {
                "200": _TEXT_OK,
                "400": _err("MISSING_ARG_TOPIC", "INVALID_TOPIC", "INVALID_IDEMPOTENCY_KEY", bad_query),
                "413": _err("BODY_TOO_BIG", "MSG_TOO_BIG", "BAD_BODY", "BAD_MESSAGE"),
                "500": _err("INTERNAL_ERROR"),
                "503": _err("EXITING")},
            [_TOPIC, _param("binary", "false (default): one message per line, empty lines skipped; true: "
                                      "[count:int32][size:int32][bytes]... big-endian", schema={"type": "string"})],
            binary_body, "At most --max-body-size bytes in all."),
        },
        "/stats": {"get": op(
            "Topics, channels, clients and memory", {
                "200": {"description": "JSON with format=json, nsqd's text report otherwise", "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/Stats"}},
                    "text/plain": {"schema": {"type": "string"}}}},
                "400": _err(bad_query)},
            [_param("format", "json, or text (the default)", schema={"type": "string", "enum": ["json", "text"]}),
             _param("topic", "only this topic"), _param("channel", "only this channel"),
             _param("include_clients", "true (default) or false", schema={"type": "string"}),
             _param("include_mem", "true (default) or false", schema={"type": "string"})]),
        },
        "/metrics": {"get": {"summary": "The /stats figures in Prometheus text format", "responses": {
            "200": {"description": "text exposition format 0.0.4", "content": {"text/plain": {"schema": {
                "type": "string"}}}}, "405": not_allowed}}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {
            "200": {"description": "OpenAPI 3 document", "content": {"application/json": {"schema": {
                "type": "object"}}}}, "405": not_allowed}}},
        "/config/{opt}": {
            "parameters": [{"name": "opt", "in": "path", "required": True, "description":
                            "an option's config-file name, e.g. nsqlookupd_tcp_addresses, log_level, mem_queue_size",
                            "schema": {"type": "string"}}],
            "get": op("Read an option (durations in nanoseconds)", {
                "200": {"description": "the value as JSON", "content": {"application/json": {"schema": {}}}},
                "400": _err("INVALID_OPTION")}),
            "put": op("Change nsqlookupd_tcp_addresses or log_level at run time", {
                "200": {"description": "the new value as JSON", "content": {"application/json": {"schema": {}}}},
                "400": _err("INVALID_OPTION", "INVALID_VALUE"),
                "413": _err("INVALID_VALUE")},
                body={"required": True, "content": {
                    "application/json": {"schema": {"type": "array", "items": {"type": "string"}},
                                         "example": ["127.0.0.1:4160"]},
                    "text/plain": {"schema": {"type": "string", "enum": list(GO_LOG_LEVELS)}}}}),
        },
    }
    topic_errors = {
        "create": ("Create a topic", {"400": _err("MISSING_ARG_TOPIC", "INVALID_TOPIC", bad_query)}),
        "delete": ("Delete a topic and its channels", {"400": _err("MISSING_ARG_TOPIC", bad_query),
                                                       "404": _err("TOPIC_NOT_FOUND")}),
        "empty": ("Drop every queued message of a topic", {"400": _err("MISSING_ARG_TOPIC", "INVALID_TOPIC", bad_query),
                                                           "404": _err("TOPIC_NOT_FOUND"),
                                                           "500": _err("INTERNAL_ERROR")}),
        "pause": ("Stop a topic's flow to its channels", {"400": _err("MISSING_ARG_TOPIC", bad_query),
                                                           "404": _err("TOPIC_NOT_FOUND")}),
        "unpause": ("Resume a paused topic", {"400": _err("MISSING_ARG_TOPIC", bad_query),
                                              "404": _err("TOPIC_NOT_FOUND")}),
    }
    for action, (summary, errors) in topic_errors.items():
        paths[f"/topic/{action}"] = {"post": op(summary, {"200": _EMPTY_OK, **errors}, [_TOPIC])}
    channel_args = _err("MISSING_ARG_TOPIC", "INVALID_ARG_TOPIC", "MISSING_ARG_CHANNEL", "INVALID_ARG_CHANNEL",
                        bad_query)
    channel_summaries = {
        "create": "Create a channel (the topic must exist)",
        "delete": "Delete a channel",
        "empty": "Drop every queued, in-flight and deferred message of a channel",
        "pause": "Stop delivering a channel's messages",
        "unpause": "Resume a paused channel",
    }
    for action, summary in channel_summaries.items():
        not_found = _err("TOPIC_NOT_FOUND") if action == "create" else _err("TOPIC_NOT_FOUND", "CHANNEL_NOT_FOUND")
        responses = {"200": _EMPTY_OK, "400": channel_args, "404": not_found}
        if action == "empty":
            responses["500"] = _err("INTERNAL_ERROR")
        paths[f"/channel/{action}"] = {"post": op(summary, responses, [_TOPIC, _CHANNEL])}
    return {
        "openapi": "3.0.3",
        "info": {"title": "trio-nsq nsqd HTTP API", "version": VERSION, "description":
                 "nsqd's HTTP API (same paths, parameters, statuses and messages), plus /metrics and this "
                 "document. Errors are JSON {\"message\": ...}; an unknown path is 404 NOT_FOUND and a wrong "
                 "method 405 METHOD_NOT_ALLOWED. With TLS required, plain HTTP answers 403 "
                 "{\"message\": \"TLS_REQUIRED\", \"https_port\": N}."},
        "paths": paths,
        "components": {"schemas": _schemas()},
    }
