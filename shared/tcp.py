"""The front of a TCP connection, shared by nsqd and nsqlookupd: protocol magic, and one connection's
failure staying that connection's (its errors are logged; a bug never reaches the server's nursery)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from trio_nsq.shared.addresses import join_host_port


async def serve_connection(
    stream: trio.SocketStream,
    *,
    magic: bytes,
    bad_magic_reply: bytes,
    magic_timeout: float,
    handler: Callable[[trio.SocketStream, str], Awaitable[None]],
    log: logging.Logger,
) -> None:
    """Read the 4-byte magic; hand a good one's connection to `handler(stream, remote)`."""
    try:
        peer = stream.socket.getpeername()
    except OSError:
        return
    # a unix socket's peer has no address (Go logs its empty name as "@")
    remote = join_host_port(peer[0], peer[1]) if isinstance(peer, tuple) else (peer or "@")
    log.info("TCP: new client(%s)", remote)
    try:
        received = b""
        with trio.move_on_after(magic_timeout):
            while len(received) < 4:
                data = await stream.receive_some(4 - len(received))
                if not data:
                    return
                received += data
        if len(received) < 4:
            return
        if received != magic:
            log.error("client(%s) bad protocol magic '%s'", remote, received.decode(errors="replace"))
            with trio.move_on_after(1):
                await stream.send_all(bad_magic_reply)
            return
        log.info("CLIENT(%s): desired protocol magic '%s'", remote, received.decode())
        await handler(stream, remote)
    except* (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, OSError) as group:
        log.info("client(%s) connection ended - %s", remote, group.exceptions[0])
    except* Exception:
        # a bug must cost one connection, never the server
        log.exception("client(%s) internal error, closing connection", remote)
    finally:
        with trio.move_on_after(1) as scope:
            scope.shield = True
            await stream.aclose()
