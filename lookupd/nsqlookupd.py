"""NSQLookupd: the directory (nsqlookupd/nsqlookupd.go). `run()` owns the root nursery: the TCP listener
(protocol V1, one task per peer) and the HTTP server (shared/http_server serving http_api's Site)."""

from __future__ import annotations

import functools
import logging

import attrs
import trio

from trio_nsq.lookupd.http_api import lookupd_site
from trio_nsq.lookupd.options import Options
from trio_nsq.lookupd.protocol_v1 import ClientV1, LookupProtocolV1
from trio_nsq.lookupd.registration_db import RegistrationDB
from trio_nsq.shared.http import join_host_port, serve_site, split_host_port
from trio_nsq.shared.lookup_protocol import MAGIC_V1, frame
from trio_nsq.shared.service import error_text
from trio_nsq.shared.tcp import serve_connection

log = logging.getLogger("nsqlookupd")


@attrs.define(eq=False)
class NSQLookupd:
    """`NSQLookupd(options)`; `await nursery.start(lookupd.run)` returns once both listeners are bound.

    `tcp_address` and `http_address` are then the bound (host, port) pairs (Go's RealTCPAddr and
    RealHTTPAddr), so port 0 works. Cancelling `run` closes both listeners and every peer connection;
    each peer's registrations go with its connection.
    """

    options: Options
    db: RegistrationDB = attrs.field(factory=RegistrationDB)
    tcp_address: tuple[str, int] | None = attrs.field(default=None, init=False)
    http_address: tuple[str, int] | None = attrs.field(default=None, init=False)
    protocol: LookupProtocolV1 = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.protocol = LookupProtocolV1(self)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            address = self.options.tcp_address
            try:
                host, port = split_host_port(address)
                listeners = await nursery.start(
                    functools.partial(trio.serve_tcp, self._handle_tcp, port, host=host or None))
                address = self.options.http_address
                self.http_address = await nursery.start(
                    functools.partial(serve_site, lookupd_site(self), address))
            except* (OSError, ValueError) as group:  # trio.serve_tcp raises inside a group
                raise RuntimeError(f"listen ({address}) failed - {error_text(group)}") from None
            sockname = listeners[0].socket.getsockname()
            self.tcp_address = (sockname[0], sockname[1])
            # in nsqlookupd's order
            log.info("HTTP: listening on %s", join_host_port(*self.http_address))
            log.info("TCP: listening on %s", join_host_port(*self.tcp_address))
            task_status.started()

    async def _handle_tcp(self, stream: trio.SocketStream) -> None:
        # Go waits for the magic without a deadline; we give a silent connection the producer timeout
        await serve_connection(
            stream, magic=MAGIC_V1, bad_magic_reply=frame(b"E_BAD_PROTOCOL"),
            magic_timeout=self.options.inactive_producer_timeout, log=log,
            handler=lambda s, remote: self.protocol.serve(s, ClientV1(remote)),
        )
