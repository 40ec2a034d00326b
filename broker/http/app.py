"""The Quart app: httprouter's dispatch (shared/http_api.Router) over nsqd's routes, each calling Api.
Complete on its own; the ASGI front sends it everything but the hot routes."""

from __future__ import annotations

import logging
import time

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from trio_nsq.broker.http.endpoints import Api
from trio_nsq.broker.http.request import ApiRequest
from trio_nsq.shared.http import join_host_port, to_response
from trio_nsq.shared.http_api import Router, error_reply, routed_reply

log = logging.getLogger("nsqd")


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
