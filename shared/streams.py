"""Stream wrappers for NSQ's IDENTIFY upgrades: snappy (framing format), deflate (raw), and a prefix
stream that hands back bytes read before an upgrade (TLS or compression) to the upgraded layer.

Each wraps a trio.abc.Stream and is a stream itself, so the connection code is the same with or
without them. Either side of a connection uses them (the broker and our client).

Snappy uses the framing format (stream identifier, then chunks of [type][3-byte length][masked CRC-32C]
[data]) that go-nsq and pynsq speak; the chunk codec and CRC come from cramjam. Deflate is raw deflate
(no zlib header) with a sync flush per write, as nsqd's flate writer does.
"""

from __future__ import annotations

import zlib

import cramjam
import trio

SNAPPY_STREAM_IDENTIFIER = b"\xff\x06\x00\x00sNaPpY"
# The framing format caps one chunk's uncompressed data at 64 KiB.
SNAPPY_MAX_CHUNK = 65536
_SNAPPY_MAX_FRAME = 4 + 4 + 65536 + 65536 // 6 + 32


class CompressionError(Exception):
    """The peer sent data that does not decode: the connection must end."""


class _WrappedStream(trio.abc.Stream):
    """A stream that transforms bytes on the way in and out of `inner`.

    `prefix` holds raw bytes already read from `inner` before the upgrade (they belong to the new
    encoding).
    """

    def __init__(self, inner: trio.abc.Stream, prefix: bytes = b"") -> None:
        self.inner = inner
        self._pending = prefix

    async def send_eof(self) -> None:  # pragma: no cover - not used by NSQ
        raise NotImplementedError

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def _raw(self, max_bytes: int) -> bytes:
        if self._pending:
            data, self._pending = self._pending, b""
            return data
        return bytes(await self.inner.receive_some(max_bytes))


class PrefixedStream(_WrappedStream):
    """`inner`, with `prefix` returned first: what a reader buffered before handing the stream on."""

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self._raw(max_bytes or 65536)


class SnappyStream(_WrappedStream):
    def __init__(self, inner: trio.abc.Stream, prefix: bytes = b"") -> None:
        super().__init__(inner, prefix)
        self._inbuf = bytearray()
        self._saw_identifier = False
        self._sent_identifier = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        out = bytearray()
        if not self._sent_identifier:
            out += SNAPPY_STREAM_IDENTIFIER
            self._sent_identifier = True
        view = memoryview(data)
        for start in range(0, len(view), SNAPPY_MAX_CHUNK):
            out += _snappy_chunk(bytes(view[start : start + SNAPPY_MAX_CHUNK]))
        await self.inner.send_all(out)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        while True:
            decoded = self._decode_available()
            if decoded:
                return decoded
            data = await self._raw(65536)
            if not data:
                if self._inbuf:
                    raise CompressionError("snappy stream ended inside a chunk")
                return b""
            self._inbuf += data

    def _decode_available(self) -> bytes:
        """Decode every complete chunk in the buffer; CRCs are checked by cramjam."""
        buf = self._inbuf
        pos = 0
        frames = bytearray()
        while len(buf) - pos >= 4:
            chunk_type = buf[pos]
            length = int.from_bytes(buf[pos + 1 : pos + 4], "little")
            if length > _SNAPPY_MAX_FRAME:
                raise CompressionError(f"snappy chunk too large ({length})")
            if len(buf) - pos < 4 + length:
                break
            chunk = bytes(buf[pos : pos + 4 + length])
            pos += 4 + length
            if chunk_type == 0xFF:
                if chunk != SNAPPY_STREAM_IDENTIFIER:
                    raise CompressionError("bad snappy stream identifier")
                self._saw_identifier = True
            elif chunk_type in (0x00, 0x01):
                if not self._saw_identifier:
                    raise CompressionError("snappy data before stream identifier")
                frames += chunk
            elif chunk_type <= 0x7F:
                raise CompressionError(f"unsupported snappy chunk type {chunk_type:#x}")
            # 0x80-0xfe: skippable chunks (padding and the like)
        del buf[:pos]
        if not frames:
            return b""
        try:
            return bytes(cramjam.snappy.decompress(SNAPPY_STREAM_IDENTIFIER + bytes(frames)))
        except Exception as exc:  # cramjam raises its own DecompressionError
            raise CompressionError(f"snappy decode failed - {exc}") from None


def _snappy_chunk(data: bytes) -> bytes:
    """One framed chunk (without identifier): cramjam frames it, we strip the identifier it adds."""
    framed = bytes(cramjam.snappy.compress(data))
    if framed.startswith(SNAPPY_STREAM_IDENTIFIER):
        framed = framed[len(SNAPPY_STREAM_IDENTIFIER) :]
    return framed


class DeflateStream(_WrappedStream):
    def __init__(self, inner: trio.abc.Stream, level: int = 6, prefix: bytes = b"", max_chunk: int = 1 << 20) -> None:
        super().__init__(inner, prefix)
        self._compress = zlib.compressobj(level, zlib.DEFLATED, -15)
        self._decompress = zlib.decompressobj(-15)
        # decompressed output per receive is capped, so a small bomb cannot balloon memory
        self._max_chunk = max_chunk

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        out = self._compress.compress(data) + self._compress.flush(zlib.Z_SYNC_FLUSH)
        await self.inner.send_all(out)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        limit = min(max_bytes or self._max_chunk, self._max_chunk)
        while True:
            tail = self._decompress.unconsumed_tail
            if tail:
                data = self._inflate(tail, limit)
                if data:
                    return data
            raw = await self._raw(65536)
            if not raw:
                return b""
            data = self._inflate(raw, limit)
            if data:
                return data

    def _inflate(self, raw: bytes, limit: int) -> bytes:
        try:
            return self._decompress.decompress(raw, limit)
        except zlib.error as exc:
            raise CompressionError(f"deflate decode failed - {exc}") from None
