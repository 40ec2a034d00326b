"""Serving nsqd's HTTP API: its routes (httprouter's, as nsqd/http.go registers them) as a Site on
--http-address (and --https-address), inside the broker's nursery."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import trio

from trio_nsq.broker.http.endpoints import Api
from trio_nsq.broker.stats import GC_PAUSES
from trio_nsq.shared.http import join_host_port, serve_site
from trio_nsq.shared.http_api import JSON_TYPE, Reply, Router
from trio_nsq.shared.http_server import Request, Site

log = logging.getLogger("nsqd")


# method -> httprouter path -> Api method
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
        "/channel/seek": "channel_seek",
        "/channel/pause": "channel_pause",
        "/channel/unpause": "channel_unpause",
    },
    "PUT": {"/config/:opt": "config"},
}
ROUTER = Router(ROUTES)


def nsqd_site(api: Api) -> Site[str]:
    """nsqd's routes calling Api (its `_now` methods where a request can be answered without awaiting);
    /pub and /mpub are not logged, as nsqd's are not."""
    opts = api.options

    def call(req: Request, name: str, params: Mapping[str, str]) -> Any:
        return api.call(name, req, **params)

    def call_now(req: Request, name: str, params: Mapping[str, str]) -> Reply | None:
        return api.call_now(name, req)  # none of them has a path parameter

    return Site(ROUTER, call, log, unlogged=("pub", "mpub"), max_body=max(opts.max_body_size, opts.max_msg_size),
                call_now=call_now)


def tls_required_reply(api: Api) -> Reply:
    """nsqd's ServeHTTP answer on plain HTTP when --tls-required: written by hand, spaces included."""
    https_port = api.https_address[1] if api.https_address else 0
    return Reply(403, f'{{"message": "TLS_REQUIRED", "https_port": {https_port}}}'.encode(), JSON_TYPE)


async def serve_http(nsqd: Any, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the HTTP API on --http-address (and HTTPS on --https-address when TLS is configured)
    until cancelled; reports the bound HTTP (host, port)."""
    GC_PAUSES.install()
    opts = nsqd.options
    api = Api(nsqd)
    site = nsqd_site(api)
    async with trio.open_nursery() as nursery:
        if opts.https_address and nsqd.tls_context is not None:
            api.https_address = await nursery.start(
                functools.partial(serve_site, site, opts.https_address, **_tls_settings(opts))
            )
            log.info("HTTPS: listening on %s", join_host_port(*api.https_address))
        plain_site = site.refusing(tls_required_reply(api)) if nsqd.tls_required_http else site
        bound = await nursery.start(functools.partial(serve_site, plain_site, opts.http_address))
        task_status.started(bound)


def _tls_settings(opts: Any) -> dict[str, Any]:
    import ssl

    settings: dict[str, Any] = {"certfile": opts.tls_cert, "keyfile": opts.tls_key, "alpn_protocols": ["http/1.1"]}
    if opts.tls_root_ca_file:
        settings["ca_certs"] = opts.tls_root_ca_file
    if opts.tls_client_auth_policy in ("require", "require-verify"):
        settings["verify_mode"] = ssl.CERT_REQUIRED
    return settings
