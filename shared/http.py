"""HTTP glue shared by nsqd and nsqlookupd: hypercorn serving a quart-trio app inside the caller's nursery."""

from __future__ import annotations

import logging
import socket
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import wrap_app
from quart import Response

# the address helpers live in shared/addresses.py (the client needs them without this module's stack);
# imported here for the daemons that import them from this module
from trio_nsq.shared.addresses import address_text, is_unix_address, join_host_port, split_host_port  # noqa: F401
from trio_nsq.shared.http_api import Reply

log = logging.getLogger(__name__)


class _OneLine(logging.Filter):
    """Hypercorn logs an exception in the app or the protocol with its traceback; a client's bad input
    must cost one log line, so the exception goes on that line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            if isinstance(exc, BaseExceptionGroup):
                exc_text = _first_error(exc)
            else:
                exc_text = f"{type(exc).__name__}: {exc}"
            record.msg = f"HTTP: {record.getMessage()} - {exc_text}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


_HYPERCORN_ERRORS = logging.getLogger("hypercorn.error")
_HYPERCORN_ERRORS.addFilter(_OneLine())


async def open_unix_listener(path: str) -> trio.SocketListener:
    """A listening unix socket at `path` (which must not exist, as with Go's net.Listen)."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await sock.bind(path)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return trio.SocketListener(sock)


def hypercorn_config(address: str, *, max_body_size: int | None = None, **extra: Any) -> Config:
    config = Config()
    if is_unix_address(address):
        config.bind = [f"unix:{address}"]
    else:
        host, port = split_host_port(address)
        config.bind = [join_host_port(host, port)]
    config.accesslog = None
    config.errorlog = _HYPERCORN_ERRORS
    config.graceful_timeout = 1.0
    config.keep_alive_timeout = 75.0
    if max_body_size is not None:
        config.wsgi_max_body_size = max_body_size
    for key, value in extra.items():
        setattr(config, key, value)
    return config


async def serve_app(
    app: Any,
    address: str,
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    **config_extra: Any,
) -> None:
    """Serve `app` on `address` until cancelled; reports the bound (host, port) to task_status.

    Port 0 binds a free port, which is how tests run several servers side by side. Hypercorn's
    `serve()` runs every connection in one nursery, so one connection's exception (hypercorn and h11
    have raised several on malformed input) would end the server and the process with it. Here our own
    accept loop hands each connection to hypercorn's per-connection TCPServer inside a guard, as
    shared/tcp.py does for TCP: a failure costs that connection and one log line.
    """
    config = hypercorn_config(address, **config_extra)
    wrapped = wrap_app(_http_only(app), config.wsgi_max_body_size, None)
    context = WorkerContext(None)
    lifespan_state: dict[str, Any] = {}
    lifespan = Lifespan(wrapped, config, lifespan_state)
    sockets = config.create_sockets()
    listeners: list[trio.abc.Listener] = []
    if sockets.secure_sockets:
        ssl_context = config.create_ssl_context()
        if ssl_context is None:
            raise ValueError("a TLS address needs a certificate and key")
        for sock in sockets.secure_sockets:
            sock.listen(config.backlog)
            listeners.append(trio.SSLListener(trio.SocketListener(trio.socket.from_stdlib_socket(sock)),
                                              ssl_context, https_compatible=True))
    for sock in sockets.insecure_sockets:
        sock.listen(config.backlog)
        listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
    bound = (sockets.secure_sockets or sockets.insecure_sockets)[0].getsockname()
    if isinstance(bound, str):  # a unix socket
        bound = (bound, 0)

    async def serve_one(stream: trio.abc.Stream) -> None:
        try:
            # hypercorn annotates SSLStream, yet its own trio worker hands it plain SocketStreams too
            await TCPServer(wrapped, config, context, ConnectionState(lifespan_state.copy()), stream)  # type: ignore[arg-type]
        except* Exception as group:
            log.error("HTTP: connection failed - %s", _first_error(group))
        finally:
            await trio.aclose_forcefully(stream)

    async with trio.open_nursery() as nursery:
        await nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        await nursery.start(trio.serve_listeners, serve_one, listeners)
        task_status.started((bound[0], bound[1]))


def _http_only(app: Any) -> Any:
    """nsqd speaks plain HTTP: a WebSocket upgrade is refused (hypercorn answers 403) before the app
    sees a scope type it was not written for."""

    async def asgi(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1000})
            return
        await app(scope, receive, send)

    return asgi


def _first_error(group: BaseExceptionGroup) -> str:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


def to_response(reply: Reply) -> Response:
    """A Quart response carrying exactly the reply's headers (Quart adds none of its own)."""
    response = Response(reply.body, status=reply.status)
    response.headers.clear()
    for key, value in reply.header_list():
        response.headers[key] = value
    response.headers["Content-Length"] = str(len(reply.body))
    return response
