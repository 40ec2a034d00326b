"""A follower's HTTP/1.1 connection to its leader's `GET /replica/fetch` (follower.py is its only user).

Not httpx: in pure Python an httpx request costs about a millisecond of CPU (URL and header objects, the
connection pool, h11's events), as much as the rest of a fetch together, and a follower fetches as often
as its leader appends, per topic. The other side is our own server (shared/http_server.py), which always
answers with a content-length: one request at a time on one keep-alive connection, the status and the
body read back, and any error (a timeout included) closes the connection; the next fetch opens another.
"""

from __future__ import annotations

import trio

# (the fetch answer's own limits are replica_api's: 16 MiB of records and their header)
MAX_HEAD = 64 * 1024
MAX_BODY = 96 * 1024 * 1024
_RECEIVE = 256 * 1024


class FetchError(Exception):
    """The fetch got no answer: connection refused or lost, a timeout, or not an HTTP answer."""


class FetchClient:
    """One connection to `address` (host:port), opened on first use. Who calls it: follower.py's loop,
    one request at a time."""

    def __init__(self, address: str, timeout: float) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"not host:port: {address!r}")
        self.host = host.strip("[]")
        self.port = int(port)
        self.timeout = timeout
        self._host_header = address.encode()
        self._stream: trio.SocketStream | None = None
        self._buffer = bytearray()

    async def aclose(self) -> None:
        stream, self._stream = self._stream, None
        self._buffer.clear()
        if stream is not None:
            await stream.aclose()

    async def get(self, target: str) -> tuple[int, bytes]:
        """`GET target` (path and query, already encoded): the status and the body. FetchError when
        there is no answer (the connection is closed then)."""
        try:
            with trio.fail_after(self.timeout):
                return await self._get(target)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, FetchError,
                ValueError) as exc:
            with trio.CancelScope(shield=True):
                await self.aclose()
            if isinstance(exc, trio.TooSlowError):
                raise FetchError(f"no answer in {self.timeout:g}s") from None
            raise FetchError(str(exc) or type(exc).__name__) from None

    async def _get(self, target: str) -> tuple[int, bytes]:
        if self._stream is None:
            self._stream = await trio.open_tcp_stream(self.host, self.port)
            self._buffer.clear()
        stream = self._stream
        await stream.send_all(b"GET %s HTTP/1.1\r\nhost: %s\r\n\r\n" % (target.encode(), self._host_header))
        buffer = self._buffer
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(buffer) > MAX_HEAD:
                raise FetchError("answer headers too long")
            await self._receive(stream)
        lines = bytes(buffer[:end]).split(b"\r\n")
        del buffer[:end + 4]
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise FetchError(f"not an HTTP answer: {lines[0][:80]!r}")
        status = int(parts[1])
        length = -1
        close = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value.strip())
            elif name == b"connection":
                close = value.strip().lower() == b"close"
            elif name == b"transfer-encoding":
                raise FetchError("a chunked answer")
        if length < 0 or length > MAX_BODY:
            raise FetchError(f"answer length {length}")
        while len(buffer) < length:
            await self._receive(stream)
        body = bytes(buffer[:length])
        del buffer[:length]
        if close:
            await self.aclose()
        return status, body

    async def _receive(self, stream: trio.SocketStream) -> None:
        data = await stream.receive_some(_RECEIVE)
        if not data:
            raise FetchError("connection closed by the leader")
        self._buffer += data
