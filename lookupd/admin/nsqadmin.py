"""NSQAdmin: `run()` owns the nursery of the HTTP server (shared/http_server serving api.py's Site) and
of the notifications it sends; cancelling it closes both and the HTTP client."""

from __future__ import annotations

import functools
import logging
import ssl
from typing import Any

import trio

from trio_nsq.lookupd.admin.api import Admin, admin_site
from trio_nsq.lookupd.admin.cluster import Cluster
from trio_nsq.lookupd.admin.options import Options
from trio_nsq.shared.http import join_host_port, serve_site
from trio_nsq.shared.service import error_text

log = logging.getLogger("nsqadmin")


class NSQAdmin:
    def __init__(self, options: Options) -> None:
        if not options.nsqlookupd_http_addresses and not options.nsqd_http_addresses:
            raise RuntimeError("--nsqd-http-address or --lookupd-http-address required")
        if options.nsqlookupd_http_addresses and options.nsqd_http_addresses:
            raise RuntimeError("use --nsqd-http-address or --lookupd-http-address not both")
        self.options = options
        self.http_address: tuple[str, int] | None = None

    def _verify(self) -> Any:
        o = self.options
        if o.http_client_tls_insecure_skip_verify:
            return False
        if not (o.http_client_tls_root_ca_file or o.http_client_tls_cert):
            return True
        context = ssl.create_default_context(cafile=o.http_client_tls_root_ca_file or None)
        if o.http_client_tls_cert:
            context.load_cert_chain(o.http_client_tls_cert, o.http_client_tls_key or None)
        return context

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        o = self.options
        cluster = Cluster(o.nsqlookupd_http_addresses, o.nsqd_http_addresses,
                          connect_timeout=o.http_client_connect_timeout,
                          request_timeout=o.http_client_request_timeout, verify=self._verify(), max_nodes=o.max_nodes)
        try:
            async with trio.open_nursery() as nursery:
                site = admin_site(Admin(o, cluster), nursery)
                try:
                    self.http_address = await nursery.start(functools.partial(serve_site, site, o.http_address))
                except* (OSError, ValueError) as group:
                    raise RuntimeError(f"listen ({o.http_address}) failed - {error_text(group)}") from None
                assert self.http_address is not None
                log.info("HTTP: listening on %s", join_host_port(*self.http_address))
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                await cluster.aclose()
