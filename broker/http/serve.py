"""Serving the HTTP API: hypercorn on --http-address (and --https-address), inside the broker's nursery."""

from __future__ import annotations

import functools
import logging
from typing import Any

import trio

from trio_nsq.broker.http.app import create_app
from trio_nsq.broker.http.endpoints import Api
from trio_nsq.broker.http.front import Front
from trio_nsq.broker.stats import GC_PAUSES
from trio_nsq.shared.http import join_host_port, serve_app

log = logging.getLogger("nsqd")


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
