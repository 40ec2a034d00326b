"""What an endpoint needs from an HTTP request, whichever layer (Quart or the ASGI front) received it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import attrs


class ClientGone(Exception):
    """The client disconnected before its request body was complete: nothing is published."""


@attrs.define
class ApiRequest:
    """What an endpoint needs from an HTTP request, whichever layer received it.

    ``read(cap)`` returns the body, or None as soon as more than ``cap`` bytes have arrived (the
    rest is left unread); it raises ClientGone if the client leaves first."""

    method: str
    path: str
    query: bytes
    content_length: int | None
    read: Callable[[int], Awaitable[bytes | None]]
    remote: str = ""
    server_port: int = 0
    idempotency_key: str | None = None  # the Idempotency-Key header, as sent (checked by /pub, /mpub)

    @property
    def uri(self) -> str:
        return self.path + ("?" + self.query.decode("latin-1") if self.query else "")
