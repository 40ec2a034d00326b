"""The ASGI callable hypercorn is given: refuses plain HTTP with 403 TLS_REQUIRED when TLS is required
(as nsqd's ServeHTTP), and serves the two hot routes, POST /pub and POST /mpub, itself straight from ASGI
events; everything else goes to the Quart app. A Quart request costs several times what the publish
does (request/response objects, context variables, a nursery per request), so the routes whose rate
matters skip it."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from trio_nsq.broker.http.endpoints import Api
from trio_nsq.broker.http.request import ApiRequest, ClientGone
from trio_nsq.shared.http_api import JSON_TYPE, Reply

# how long, and how much of, a refused upload is read and dropped so its client can read the answer
LINGER_SECONDS = 10.0
LINGER_BYTES = 64 * 1024 * 1024

# set TRIO_NSQ_HTTP_FAST_PATH=0 to serve /pub and /mpub through Quart too (for measuring the difference)
FAST_PATH = os.environ.get("TRIO_NSQ_HTTP_FAST_PATH", "1") != "0"


class AsgiBody:
    """A request body read straight from ASGI receive() events, never more than asked for."""

    __slots__ = ("receive", "done", "received")

    def __init__(self, receive: Callable[[], Awaitable[dict]]) -> None:
        self.receive = receive
        self.done = False
        self.received = 0

    async def read(self, cap: int) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        receive = self.receive
        while not self.done:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            data = message.get("body", b"")
            if not message.get("more_body", False):
                self.done = True
            size += len(data)
            if size > cap:
                self.received += size
                return None
            chunks.append(data)
        self.received += size
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def drain(self, budget: int) -> None:
        """Read and drop what is left, up to `budget` bytes in all, so the answer reaches a client
        still uploading and the connection can carry on."""
        receive = self.receive
        while not self.done and self.received <= budget:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            self.received += len(message.get("body", b""))
            if not message.get("more_body", False):
                self.done = True

    async def linger(self, content_length: int | None) -> None:
        """drain() within LINGER_SECONDS and LINGER_BYTES; an upload declared bigger than that is
        answered at once (and the connection closed by hypercorn), as there is no point reading it."""
        if self.done or (content_length is not None and content_length > LINGER_BYTES):
            return
        with trio.move_on_after(LINGER_SECONDS):
            await self.drain(LINGER_BYTES)


# an ASGI 3 application; Front hands scopes and events through to it untouched
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


class Front:
    """The ASGI app hypercorn serves: TLS requirement, the hot routes, then the Quart app."""

    def __init__(self, app: ASGIApp, api: Api, *, tls: bool, fast_path: bool = FAST_PATH) -> None:
        self.app = app
        self.api = api
        self.tls = tls
        self.fast = {"/pub": "pub", "/mpub": "mpub"} if fast_path else {}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            if not self.tls and self.api.nsqd.tls_required_http:
                await self._tls_required(receive, send)
                return
            if scope["method"] == "POST":
                name = self.fast.get(scope["path"])
                if name is not None:
                    await self._serve(name, scope, receive, send)
                    return
            await self._delegate(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _delegate(self, scope: dict, receive: Callable, send: Callable) -> None:
        """Hand a request to Quart, holding back the end of its answer until the request body is in.

        Hypercorn closes a connection whose response ended before its request body did, so a client
        still uploading may see a reset instead of the answer; Quart keeps reading (and, past its
        MAX_CONTENT_LENGTH, dropping) the body meanwhile. Each send is shielded because quart-trio
        cancels its request nursery when a disconnect arrives, which can land inside hypercorn's own
        close bookkeeping and leave the connection open forever."""
        done = trio.Event()

        async def tracking_receive() -> dict:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                done.set()
            return message

        async def patient_send(message: dict) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not done.is_set():
                declared = _content_length(scope)
                if declared is None or declared <= LINGER_BYTES:
                    with trio.move_on_after(LINGER_SECONDS):
                        await done.wait()
            with trio.CancelScope(shield=True):
                await send(message)

        await self.app(scope, tracking_receive, patient_send)

    async def _serve(self, name: str, scope: dict, receive: Callable, send: Callable) -> None:
        body = AsgiBody(receive)
        content_length = _content_length(scope)
        client = scope.get("client") or ("", 0)
        req = ApiRequest("POST", scope["path"], scope["query_string"], content_length, body.read,
                         f"{client[0]}:{client[1]}", (scope.get("server") or ("", 0))[1] or 0,
                         _header(scope, b"idempotency-key"))
        try:
            reply = await self.api.call(name, req)
            # answered before the body was in (a limit): read and drop the rest first, since
            # hypercorn closes a connection whose request is unfinished when the answer ends
            await body.linger(content_length)
        except ClientGone:
            return
        await send_reply(send, reply)

    async def _tls_required(self, receive: Callable, send: Callable) -> None:
        https_port = self.api.https_address[1] if self.api.https_address else 0
        # nsqd writes this one by hand, spaces included
        payload = f'{{"message": "TLS_REQUIRED", "https_port": {https_port}}}'.encode()
        try:
            await AsgiBody(receive).linger(None)
        except ClientGone:
            return
        await send_reply(send, Reply(403, payload, JSON_TYPE))


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _content_length(scope: dict) -> int | None:
    for key, value in scope["headers"]:
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def send_reply(send: Callable, reply: Reply) -> None:
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in reply.header_list()]
    headers.append((b"content-length", str(len(reply.body)).encode()))
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})
