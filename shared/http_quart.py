"""The framework side of the HTTP API: a QuartTrio app over a daemon's Site, which hypercorn serves for
the connections shared/http_server's loop hands off (HTTP/2 with prior knowledge, an h2c upgrade, a
request head llhttp refuses). One before_request calls the Site's dispatch, so there is no second route
table: the answer is the one our own loop gives over HTTP/1.1.

Who calls it: shared/http.serve_site, on a server's first hand-off (Quart takes about a second to
import on a loaded machine, more than a daemon takes to start, and most servers never hand off)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from trio_nsq.shared.http_api import Reply, error_reply
from trio_nsq.shared.http_server import LINGER_SECONDS, Request, Site


def to_response(reply: Reply) -> Response:
    """A Quart response carrying exactly the reply's headers (Quart adds none of its own)."""
    body = b"".join((reply.body, reply.more))
    response = Response(body, status=reply.status)
    response.headers.clear()
    for key, value in reply.header_list():
        response.headers[key] = value
    response.headers["Content-Length"] = str(len(body))
    return response


async def _read(cap: int) -> bytes | None:
    """The body, or None once more than `cap` bytes came (or more than Quart's MAX_CONTENT_LENGTH)."""
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
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def asgi_app(site: Site) -> Callable[[dict, Any, Any], Awaitable[None]]:
    """What hypercorn serves: quart_app(site), and a WebSocket upgrade refused before the app sees a scope
    type it was not written for (hypercorn answers 403, as before)."""
    app = quart_app(site)

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1000})
            return
        await app(scope, receive, send)

    return asgi


async def _linger() -> None:
    """Read and drop what is left of a refused body (within LINGER_SECONDS, and Quart's
    MAX_CONTENT_LENGTH), as our loop does: an HTTP/2 client still sending gets the answer, not a reset."""
    with trio.move_on_after(LINGER_SECONDS):
        try:
            async for _ in request.body:
                pass
        except RequestEntityTooLarge:
            pass


def quart_app(site: Site) -> QuartTrio:
    """The app: every request is answered by before_request through `site`, so werkzeug's routing never
    gets a say."""
    app = QuartTrio(__name__)
    # Quart's own body buffer stops here; each endpoint applies its smaller limit while reading
    app.config["MAX_CONTENT_LENGTH"] = site.max_body

    @app.before_request
    async def dispatch() -> Response:
        scope = request.scope
        headers: dict[str, str] = {}
        for key, value in scope["headers"]:
            headers.setdefault(key.decode("latin-1").lower(), value.decode("latin-1"))
        client = scope.get("client") or ("", 0)
        req = Request(request.method, scope["raw_path"].decode("latin-1"), scope["query_string"], headers,
                      reader=_read, remote=(client[0], client[1]) if client[0] else "",
                      server_port=(scope.get("server") or ("", 0))[1] or 0, version=scope["http_version"])
        reply = await site(req)
        await _linger()
        return to_response(reply)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        return to_response(error_reply(exc.code or 500, (exc.name or "ERROR").upper().replace(" ", "_")))

    return app
