"""Serving nsqd's HTTP API: its routes (httprouter's, as nsqd/http.go registers them) as a Site on
--http-address (and --https-address), inside the broker's nursery."""

from __future__ import annotations

import functools
import logging
from typing import Any

import trio

from trio_nsq.broker.http.endpoints import Api
from trio_nsq.broker.http.log_api import LogApi
from trio_nsq.broker.http.replica_api import ReplicaApi
from trio_nsq.broker.stats import GC_PAUSES
from trio_nsq.shared.http import join_host_port, serve_site
from trio_nsq.shared.http_api import JSON_TYPE, Reply, Router
from trio_nsq.shared.http_server import Route, Site

log = logging.getLogger("nsqd")


def routes(api: Api) -> dict[str, dict[str, Route]]:
    """nsqd's routes (method -> httprouter path -> Route), as nsqd/http.go registers them: /ping, /pub
    and /mpub are answered in place when the request came whole; /pub and /mpub are not logged, as
    nsqd's are not. /log/* are not nsqd's: a topic's log read by position (log_api.py)."""
    logs = LogApi(api)
    replica = ReplicaApi(api)
    return {
        "GET": {
            "/ping": Route(api.ping, api.ping_now),
            "/info": Route(api.info),
            "/stats": Route(api.stats),
            "/config/:opt": Route(api.config),
            "/metrics": Route(api.metrics),
            "/openapi.json": Route(api.openapi),
            "/topic/config": Route(api.topic_config),
            "/channel/config": Route(api.channel_config),
            "/channel/messages": Route(api.channel_messages),
            "/log/positions": Route(logs.positions),
            "/log/position": Route(logs.position),
            "/log/splits": Route(logs.splits),
            "/log/read": Route(logs.read, logged=False),
            "/replica/fetch": Route(replica.fetch, logged=False),  # cluster mode: a follower's fetch
        },
        "POST": {
            "/pub": Route(api.pub, api.pub_now, logged=False),
            "/mpub": Route(api.mpub, api.mpub_now, logged=False),
            "/topic/create": Route(api.topic_create),
            "/topic/delete": Route(api.topic_delete),
            "/topic/empty": Route(api.topic_empty),
            "/topic/pause": Route(api.topic_pause),
            "/topic/unpause": Route(api.topic_unpause),
            "/channel/create": Route(api.channel_create),
            "/channel/delete": Route(api.channel_delete),
            "/channel/empty": Route(api.channel_empty),
            "/channel/seek": Route(api.channel_seek),
            "/channel/pause": Route(api.channel_pause),
            "/channel/unpause": Route(api.channel_unpause),
            "/topic/config": Route(api.topic_config),
            "/channel/config": Route(api.channel_config),
            "/channel/redrive": Route(api.channel_redrive),
            "/log/commit": Route(logs.commit),
        },
        "PUT": {"/config/:opt": Route(api.config)},
    }


def nsqd_site(api: Api) -> Site:
    """nsqd's routes as the shared HTTP server's Site."""
    opts = api.options
    return Site(Router(routes(api)), log, max_body=max(opts.max_body_size, opts.max_msg_size))


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
