"""A tiny synchronous NSQ TCP protocol V2 client on a plain socket, for exact protocol assertions.

Third-party clients hide the wire: they retry, answer heartbeats, swallow error frames and
reconnect. The process-level tests use this client where they need to see exactly which frame
the broker sent, when, and whether it closed the connection afterwards.

Wire format (NSQ "TCP Protocol Spec"):
  client → broker   magic b"  V2", then commands ``NAME[ PARAM...]\\n`` optionally followed by
                    ``[size:int32 BE][body]``
  broker → client   frames ``[size:int32 BE][frame type:int32 BE][data]`` where size counts the
                    frame type and the data; type 0 response, 1 error, 2 message
  message data      ``[timestamp ns:int64 BE][attempts:uint16 BE][id:16 bytes][body]``

Every read has a timeout, so a broker that goes silent fails a test instead of hanging it.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from dataclasses import dataclass

# the protocol's constants are the codec's; the framing below is this client's own, kept independent
from trio_nsq.shared.protocol import (  # noqa: F401  (re-exported for the tests)
    CLOSE_WAIT, FRAME_TYPE_ERROR, FRAME_TYPE_MESSAGE, FRAME_TYPE_RESPONSE, HEARTBEAT, MAGIC_V2, OK,
)

_SIZE = struct.Struct(">i")
_FRAME_HEADER = struct.Struct(">ii")
_MESSAGE_HEADER = struct.Struct(">qH16s")


class ConnectionClosed(Exception):
    """The broker closed the connection (EOF or reset) while we were reading."""


class FrameTimeout(AssertionError):
    """No complete frame arrived within the timeout."""


@dataclass(frozen=True)
class Response:
    data: bytes

    @property
    def is_heartbeat(self) -> bool:
        return self.data == HEARTBEAT


@dataclass(frozen=True)
class Error:
    data: bytes

    @property
    def code(self) -> str:
        return self.data.split(b" ", 1)[0].decode("ascii", "replace")

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


@dataclass(frozen=True)
class Message:
    timestamp: int
    attempts: int
    id: bytes
    body: bytes


Frame = Response | Error | Message


def decode_frame(frame_type: int, data: bytes) -> Frame:
    if frame_type == FRAME_TYPE_RESPONSE:
        return Response(data)
    if frame_type == FRAME_TYPE_ERROR:
        return Error(data)
    if frame_type == FRAME_TYPE_MESSAGE:
        if len(data) < _MESSAGE_HEADER.size:
            raise AssertionError(f"message frame too short ({len(data)} bytes): {data!r}")
        timestamp, attempts, msg_id = _MESSAGE_HEADER.unpack_from(data)
        return Message(timestamp, attempts, msg_id, data[_MESSAGE_HEADER.size :])
    raise AssertionError(f"unknown frame type {frame_type} with data {data[:100]!r}")


def encode_command(name: str | bytes, *params: object, body: bytes | None = None) -> bytes:
    parts = [name.encode() if isinstance(name, str) else name]
    for p in params:
        parts.append(p if isinstance(p, bytes) else str(p).encode())
    line = b" ".join(parts) + b"\n"
    if body is None:
        return line
    return line + _SIZE.pack(len(body)) + body


def encode_mpub_body(bodies: list[bytes]) -> bytes:
    return _SIZE.pack(len(bodies)) + b"".join(_SIZE.pack(len(b)) + b for b in bodies)


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


class RawNSQ:
    """One V2 connection. Use as a context manager or call close()."""

    def __init__(self, address: str, *, timeout: float = 5.0, send_magic: bool = True):
        self.address = address
        self.timeout = timeout
        self.sock = socket.create_connection(parse_address(address), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray()
        self.heartbeats_seen = 0
        if send_magic:
            self.send(MAGIC_V2)

    # -- plumbing -------------------------------------------------------------------------

    def __enter__(self) -> RawNSQ:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def command(self, name: str | bytes, *params: object, body: bytes | None = None) -> None:
        self.send(encode_command(name, *params, body=body))

    def _fill(self, n: int, deadline: float) -> None:
        while len(self._buf) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FrameTimeout(f"timed out waiting for data from {self.address}")
            self.sock.settimeout(remaining)
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                raise FrameTimeout(f"timed out waiting for data from {self.address}") from None
            except (ConnectionResetError, BrokenPipeError) as exc:
                raise ConnectionClosed(f"connection reset: {exc}") from None
            if not chunk:
                raise ConnectionClosed(
                    f"broker closed the connection ({len(self._buf)} unread bytes buffered)"
                )
            self._buf += chunk

    def read_frame(self, timeout: float | None = None) -> Frame:
        """Read the next frame, whatever it is (heartbeats included)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self._fill(4, deadline)
        (size,) = _SIZE.unpack_from(self._buf)
        if size < 4:
            raise AssertionError(f"invalid frame size {size}; buffered: {bytes(self._buf[:64])!r}")
        self._fill(4 + size, deadline)
        (_, frame_type) = _FRAME_HEADER.unpack_from(self._buf)
        data = bytes(self._buf[8 : 4 + size])
        del self._buf[: 4 + size]
        return decode_frame(frame_type, data)

    def next_frame(self, timeout: float | None = None, *, answer_heartbeats: bool = True) -> Frame:
        """Read the next frame that is not a heartbeat; heartbeats are answered with NOP."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            frame = self.read_frame(max(0.0, deadline - time.monotonic()))
            if isinstance(frame, Response) and frame.is_heartbeat:
                self.heartbeats_seen += 1
                if answer_heartbeats:
                    self.nop()
                continue
            return frame

    def frames_for(self, seconds: float, *, answer_heartbeats: bool = True) -> list[Frame]:
        """Collect every non-heartbeat frame arriving within ``seconds`` (expects no EOF)."""
        deadline = time.monotonic() + seconds
        frames: list[Frame] = []
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return frames
            try:
                frames.append(self.next_frame(remaining, answer_heartbeats=answer_heartbeats))
            except FrameTimeout:
                return frames

    def expect_response(self, expected: bytes | None = None, timeout: float | None = None) -> bytes:
        frame = self.next_frame(timeout)
        if not isinstance(frame, Response):
            raise AssertionError(f"expected a response frame, got {frame!r}")
        if expected is not None and frame.data != expected:
            raise AssertionError(f"expected response {expected!r}, got {frame.data!r}")
        return frame.data

    def expect_error(self, timeout: float | None = None) -> Error:
        frame = self.next_frame(timeout)
        if not isinstance(frame, Error):
            raise AssertionError(f"expected an error frame, got {frame!r}")
        return frame

    def expect_message(self, timeout: float | None = None) -> Message:
        frame = self.next_frame(timeout)
        if not isinstance(frame, Message):
            raise AssertionError(f"expected a message frame, got {frame!r}")
        return frame

    def expect_messages(self, n: int, timeout: float | None = None) -> list[Message]:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        return [self.expect_message(max(0.0, deadline - time.monotonic())) for _ in range(n)]

    def expect_no_frame(self, seconds: float) -> None:
        """Assert that nothing but heartbeats arrives for ``seconds``."""
        frames = self.frames_for(seconds)
        if frames:
            raise AssertionError(f"expected no frames for {seconds}s, got {frames!r}")

    def expect_closed(self, timeout: float | None = None) -> list[Frame]:
        """Read until the broker closes the connection; return the frames read before EOF.

        Raises FrameTimeout if the connection is still open after ``timeout``.
        """
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        frames: list[Frame] = []
        while True:
            try:
                frames.append(self.read_frame(max(0.0, deadline - time.monotonic())))
            except ConnectionClosed:
                return frames

    def is_closed_by_peer(self, timeout: float = 0.5) -> bool:
        try:
            self.expect_closed(timeout)
        except FrameTimeout:
            return False
        return True

    # -- commands -------------------------------------------------------------------------

    def identify(self, **fields: object) -> bytes | dict:
        """IDENTIFY; returns the parsed JSON if feature_negotiation was answered, else the raw data."""
        self.command("IDENTIFY", body=json.dumps(fields).encode())
        data = self.expect_response()
        if data == OK:
            return data
        return json.loads(data)

    def sub(self, topic: str, channel: str) -> None:
        self.command("SUB", topic, channel)
        self.expect_response(OK)

    def rdy(self, count: int | str) -> None:
        self.command("RDY", count)

    def fin(self, msg_id: bytes) -> None:
        self.command("FIN", msg_id)

    def req(self, msg_id: bytes, delay_ms: int) -> None:
        self.command("REQ", msg_id, delay_ms)

    def touch(self, msg_id: bytes) -> None:
        self.command("TOUCH", msg_id)

    def nop(self) -> None:
        self.command("NOP")

    def cls(self) -> None:
        self.command("CLS")

    def pub(self, topic: str, body: bytes) -> None:
        self.command("PUB", topic, body=body)
        self.expect_response(OK)

    def mpub(self, topic: str, bodies: list[bytes]) -> None:
        self.command("MPUB", topic, body=encode_mpub_body(bodies))
        self.expect_response(OK)

    def dpub(self, topic: str, delay_ms: int, body: bytes) -> None:
        self.command("DPUB", topic, delay_ms, body=body)
        self.expect_response(OK)


def subscribe(address: str, topic: str, channel: str, *, rdy: int = 0, timeout: float = 5.0,
              **identify: object) -> RawNSQ:
    """Connect, optionally IDENTIFY, SUB and set RDY; returns the open connection."""
    conn = RawNSQ(address, timeout=timeout)
    try:
        if identify:
            conn.identify(**identify)
        conn.sub(topic, channel)
        if rdy:
            conn.rdy(rdy)
    except BaseException:
        conn.close()
        raise
    return conn


def take(address: str, topic: str, channel: str, count: int, *, quiet: float = 0.3) -> list[Message]:
    """SUB, take `count` messages and FIN each; then nothing more may come for `quiet` seconds (an error
    answering a FIN, or a message beyond `count`, would show there)."""
    with RawNSQ(address) as conn:
        conn.sub(topic, channel)
        conn.rdy(count)
        msgs = conn.expect_messages(count, timeout=10)
        for msg in msgs:
            conn.fin(msg.id)
        conn.expect_no_frame(quiet)
    return msgs


def publish(address: str, topic: str, *bodies: bytes, timeout: float = 5.0) -> None:
    """PUB each body on a fresh connection (each answered OK)."""
    with RawNSQ(address, timeout=timeout) as conn:
        for body in bodies:
            conn.pub(topic, body)
