"""NSQLookupd: the directory. Owns the root nursery: TCP (protocol V1) and HTTP (nsqlookupd/nsqlookupd.go)."""

from __future__ import annotations

import functools
import logging

import trio

from lookupd.http_api import create_app
from lookupd.options import Options
from lookupd.protocol_v1 import ClientV1, LookupProtocolV1, frame
from lookupd.registration_db import RegistrationDB
from shared.http import join_host_port, serve_app, split_host_port
from shared.tcp import serve_connection

log = logging.getLogger("nsqlookupd")

MAGIC_V1 = b"  V1"


class NSQLookupd:
    def __init__(self, options: Options) -> None:
        self.options = options
        self.db = RegistrationDB()
        self.protocol = LookupProtocolV1(self)
        self.tcp_address: tuple[str, int] | None = None
        self.http_address: tuple[str, int] | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self.http_address = await nursery.start(
                functools.partial(serve_app, create_app(self), self.options.http_address))
            log.info("HTTP: listening on %s", join_host_port(*self.http_address))
            host, port = split_host_port(self.options.tcp_address)
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, self._handle_tcp, port, host=host or None))
            sockname = listeners[0].socket.getsockname()
            self.tcp_address = (sockname[0], sockname[1])
            log.info("TCP: listening on %s", join_host_port(*self.tcp_address))
            task_status.started()

    async def _handle_tcp(self, stream: trio.SocketStream) -> None:
        await serve_connection(
            stream, magic=MAGIC_V1, bad_magic_reply=frame(b"E_BAD_PROTOCOL"),
            magic_timeout=self.options.inactive_producer_timeout, log=log,
            handler=lambda s, remote: self.protocol.serve(s, ClientV1(remote)),
        )
