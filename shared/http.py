"""HTTP glue shared by nsqd and nsqlookupd: hypercorn serving a quart-trio app inside the caller's nursery."""

from __future__ import annotations

import logging
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

log = logging.getLogger(__name__)


def split_host_port(address: str, default_host: str = "0.0.0.0") -> tuple[str, int]:
    """'127.0.0.1:4151', ':4151', '[::1]:4151' -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep:
        raise ValueError(f"address {address!r} has no port")
    host = host.strip("[]") or default_host
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def hypercorn_config(address: str, *, max_body_size: int | None = None, **extra: Any) -> Config:
    config = Config()
    host, port = split_host_port(address)
    config.bind = [join_host_port(host, port)]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
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

    Port 0 binds a free port, which is how tests run several servers side by side.
    """
    config = hypercorn_config(address, **config_extra)

    async def started_binds(*, task_status=trio.TASK_STATUS_IGNORED):
        await serve(app, config, task_status=task_status)

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(started_binds)
        bound = binds[0].split("://", 1)[1]
        host, port = split_host_port(bound)
        task_status.started((host, port))
