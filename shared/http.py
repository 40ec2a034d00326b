"""HTTP serving shared by nsqd, nsqlookupd and trio-nsqadmin: the listeners and accept loop inside the
caller's nursery, each connection served by shared/http_server.Connection and, for what it hands off,
by hypercorn serving a QuartTrio app over the same Site (shared/http_quart.py).

Hypercorn is imported only where it is used: at start for a TLS address (its config makes the SSL
context), else at the first hand-off, in a thread. Importing it cost a fifth of a daemon's start-up,
and most daemons never hand a connection off."""

from __future__ import annotations

import errno
import importlib
import logging
import select
import socket
from collections.abc import Awaitable, Callable
import os
import stat
from typing import TYPE_CHECKING, Any

import trio

# the address helpers live in shared/addresses.py (the client needs them without this module's stack);
# imported here for the daemons that import them from this module
from trio_nsq.shared.addresses import address_text, is_unix_address, join_host_port, split_host_port  # noqa: F401
from trio_nsq.shared.http_server import Connection, ConnectionPoller, HandOff, IdleTimeouts, Site

if TYPE_CHECKING:
    from hypercorn.config import Config

log = logging.getLogger(__name__)

BACKLOG = 100  # hypercorn's default listen backlog, which every daemon had before


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


async def httpx_module() -> Any:
    """httpx, for a daemon's few outgoing requests (an auth server, lookupd's channels of a new topic):
    imported on first use, in a thread, instead of at start-up, where it was a tenth of trio-nsqd's."""
    return await trio.to_thread.run_sync(importlib.import_module, "httpx")


def hypercorn_config(address: str, *, max_body_size: int | None = None, **extra: Any) -> Config:
    from hypercorn.config import Config

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


async def serve_site(
    site: Site,
    address: str,
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    **config_extra: Any,
) -> None:
    """Serve `site` on `address` until cancelled; reports the bound (host, port) to task_status.

    Port 0 binds a free port, which is how tests run several servers side by side. Our own accept
    loop runs each connection in shared/http_server.Connection inside a guard, as shared/tcp.py does
    for TCP: a failure costs that connection and one log line. What that loop hands off (an Upgrade,
    HTTP/2, a head llhttp refuses) goes to hypercorn's per-connection TCPServer, with the bytes already
    read replayed first, serving a QuartTrio app over the same site. TLS settings (certfile, keyfile,
    ca_certs, verify_mode, alpn_protocols) are hypercorn's config keys, as before.
    """
    tls = "certfile" in config_extra or "keyfile" in config_extra
    hypercorn: list[Any] = []  # (config, context, the QuartTrio app wrapped), once a connection is handed off
    tls_listeners: list[trio.SSLListener] = []
    plain: list[socket.socket] = []
    if tls:
        config = hypercorn_config(address, **config_extra)
        sockets = config.create_sockets()
        ssl_context = config.create_ssl_context()
        if ssl_context is None:
            raise ValueError("a TLS address needs a certificate and key")
        for sock in sockets.secure_sockets:
            sock.listen(config.backlog)
            tls_listeners.append(trio.SSLListener(trio.SocketListener(trio.socket.from_stdlib_socket(sock)),
                                                  ssl_context, https_compatible=True))
        plain = sockets.insecure_sockets
        bound = (sockets.secure_sockets or plain)[0].getsockname()
    else:
        plain = [_bind(address)]
        bound = plain[0].getsockname()
    for sock in plain:
        sock.listen(BACKLOG)
        sock.setblocking(False)
        if sock.family != socket.AF_UNIX:  # accepted connections inherit it (Linux, BSD, macOS)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if isinstance(bound, str):  # a unix socket
        bound = (bound, 0)
    port = bound[1]

    def load_hypercorn() -> tuple[Any, Any, Any]:
        """Hypercorn and Quart, for the first hand-off (Quart's import takes about a second on a loaded
        machine: in a thread, once, not at start-up)."""
        from hypercorn.trio.worker_context import WorkerContext
        from hypercorn.utils import wrap_app

        module = importlib.import_module("trio_nsq.shared.http_quart")
        config = hypercorn_config(address, **config_extra)
        return config, WorkerContext(None), wrap_app(module.asgi_app(site), config.wsgi_max_body_size, None)

    async def hand_off(stream: trio.abc.Stream, data: bytes) -> None:
        if not hypercorn:
            loaded = await trio.to_thread.run_sync(load_hypercorn)
            if not hypercorn:
                hypercorn.append(loaded)
        config, context, app = hypercorn[0]
        from hypercorn.trio.tcp_server import TCPServer
        from hypercorn.typing import ConnectionState

        # hypercorn annotates SSLStream, yet its own trio worker hands it plain streams too
        await TCPServer(app, config, context, ConnectionState({}), _Replayed(stream, data))  # type: ignore[arg-type]

    def accepted(sock: socket.socket, peer: Any) -> None:
        conn = Connection(site, idle, sock=sock, remote=peer if isinstance(peer, tuple) else "",
                          server_port=port, can_hand_off=True)
        if poller is not None:
            poller.add(conn)
        else:
            nursery.start_soon(serve_plain, conn)

    async def serve_plain(conn: Connection) -> None:
        parked = False
        try:
            try:
                parked = await conn.serve()
            except HandOff as exc:
                stream = trio.SocketStream(trio.socket.from_stdlib_socket(conn.sock))
                await hand_off(stream, exc.data)
        except* Exception as group:
            log.error("HTTP: connection failed - %s", _first_error(group))
        finally:
            if parked and poller is not None:
                poller.add(conn)
            else:
                # at once, and without notify_closing: no task waits on it now (the answer is written;
                # close sends it on, then FIN, as Go's net/http closes after the last write)
                conn.sock.close()

    async def serve_tls(stream: trio.SSLStream) -> None:
        try:
            await Connection(site, idle, stream=stream, remote=_remote(stream.transport_stream.socket),
                             server_port=port, can_hand_off=False).serve()
        except* Exception as group:
            log.error("HTTP: connection failed - %s", _first_error(group))
        finally:
            await trio.aclose_forcefully(stream)

    idle = IdleTimeouts()
    poller: ConnectionPoller | None = None
    async with trio.open_nursery() as nursery:
        if hasattr(select, "epoll"):
            idle.poller = poller = ConnectionPoller(nursery, serve_plain, log)
            nursery.start_soon(poller.run)
        nursery.start_soon(idle.run)
        for listener in tls_listeners:
            nursery.start_soon(_accept_loop, listener, serve_tls, nursery)
        for sock in plain:
            nursery.start_soon(_accept_plain, sock, accepted)
        task_status.started((bound[0], port))


def _bind(address: str) -> socket.socket:
    """A plain listening socket bound as hypercorn binds one (the daemons used its config for this):
    a unix path replacing a stale socket there, else host:port with SO_REUSEADDR."""
    if is_unix_address(address):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if stat.S_ISSOCK(os.stat(address).st_mode):
                os.remove(address)
        except FileNotFoundError:
            pass
        binding: Any = address
    else:
        host, port = split_host_port(address)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        binding = (host, port)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(binding)
    except OSError:
        sock.close()
        raise
    return sock


# accept() errors that mean "out of a resource for now": wait and accept again (as trio.serve_listeners)
_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
QUICK_ACCEPTS = 16  # connections accepted in a row before yielding to the scheduler


async def _accept_plain(listener: socket.socket, accepted: Callable[[socket.socket, Any], None]) -> None:
    """Accept from a non-blocking listening socket straight away, awaiting only when none is waiting:
    trio.SocketListener's accept, from_stdlib_socket, SocketStream's setsockopts and a getpeername
    per connection were most of a `Connection: close` request's CPU. The peer address comes with
    accept(); TCP_NODELAY with the listener."""
    fd = listener.fileno()
    try:
        while True:
            for _ in range(QUICK_ACCEPTS):
                try:
                    sock, peer = listener.accept()
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(fd)
                    continue
                except OSError as exc:
                    await _accept_failed(exc)
                    continue
                sock.setblocking(False)
                accepted(sock, peer)
            await trio.lowlevel.checkpoint()  # a flood of connections cannot starve the rest
    finally:
        trio.lowlevel.notify_closing(listener)
        listener.close()


async def _accept_loop(listener: trio.abc.Listener[Any], serve_one: Callable[[Any], Awaitable[None]],
                       nursery: trio.Nursery) -> None:
    """trio.serve_listeners' loop without its aclose_forcefully per connection (a cancelled scope and a
    caught Cancelled: a fifth of a short request); serve_one closes its stream itself."""
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:
            await _accept_failed(exc)
            continue
        nursery.start_soon(serve_one, stream)


async def _accept_failed(exc: OSError) -> None:
    """Out of a resource for now (descriptors, memory): wait and accept again; else the error stands."""
    if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
        raise exc
    log.error("HTTP: accept failed (%s); retrying in 100 ms", exc)
    await trio.sleep(0.1)


def _remote(sock: Any) -> str:
    """The client's address as the request log shows it: host:port ("" on a unix socket)."""
    try:
        peer = sock.getpeername()
    except OSError:  # already gone
        return ""
    return join_host_port(peer[0], peer[1]) if isinstance(peer, tuple) else ""


class _Replayed(trio.abc.Stream):
    """A connection handed to hypercorn: the bytes our loop read first, then the stream."""

    def __init__(self, stream: trio.abc.Stream, data: bytes) -> None:
        self.stream = stream
        self.data = data
        self.socket = getattr(stream, "socket", None)

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self.data:
            data, self.data = self.data, b""
            return data
        return await self.stream.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        # shielded: hypercorn closes from inside the app's last send, and quart-trio cancels that task
        # once the disconnect reaches it; cancelled at send_eof's checkpoint, the close never came
        if isinstance(self.stream, trio.abc.HalfCloseableStream):
            with trio.CancelScope(shield=True):
                await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()


def _first_error(group: BaseExceptionGroup) -> str:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"
