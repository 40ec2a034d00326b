"""Connection: one protocol V2 conversation with a broker, owned by a nursery.

Responses are matched to commands in order (nsqd answers in order), so any number of PUBs may be in
flight at once. Messages go to the owner's callback; heartbeats are answered with NOP.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from shared.http import split_host_port
from shared.protocol import (
    FRAME_TYPE_ERROR,
    FRAME_TYPE_MESSAGE,
    HEARTBEAT,
    MAGIC_V2,
    FrameParser,
    decode_message,
    encode_fin,
    encode_identify,
    encode_nop,
    encode_rdy,
    encode_req,
    encode_touch,
)
from shared.version import USER_AGENT

log = logging.getLogger("trio_nsq.client")

# errors nsqd sends for FIN/REQ/TOUCH, which have no response of their own to be matched with
_UNMATCHED_ERRORS = (b"E_FIN_FAILED", b"E_REQ_FAILED", b"E_TOUCH_FAILED")
MAX_FRAME = 16 * 1024 * 1024


class NSQError(Exception):
    """An error frame from the broker: `code` is nsqd's (E_BAD_TOPIC...), str() its whole text."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.code = text.split(" ", 1)[0]


class _Pending:
    __slots__ = ("event", "value", "error")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.value: bytes | None = None
        self.error: Exception | None = None


class Message:
    """A message from a consumer connection; finish/requeue/touch answer the broker for it."""

    def __init__(self, conn: Connection, msg_id: bytes, body: bytes, attempts: int, timestamp: int) -> None:
        self.conn = conn
        self.id = msg_id
        self.body = body
        self.attempts = attempts
        self.timestamp = timestamp
        self.responded = False

    async def finish(self) -> None:
        if not self.responded:
            self.responded = True
            await self.conn.send(encode_fin(self.id))
            self.conn.in_flight -= 1

    async def requeue(self, delay_ms: int = 0) -> None:
        if not self.responded:
            self.responded = True
            await self.conn.send(encode_req(self.id, delay_ms))
            self.conn.in_flight -= 1

    async def touch(self) -> None:
        if not self.responded:
            await self.conn.send(encode_touch(self.id))


class Connection:
    def __init__(
        self,
        address: str,
        *,
        identify: dict[str, Any] | None = None,
        on_message: Callable[[Message], None] | None = None,
        connect_timeout: float = 5.0,
    ) -> None:
        self.address = address
        self.identify_data = {"feature_negotiation": True, "user_agent": USER_AGENT, **(identify or {})}
        self.on_message = on_message
        self.connect_timeout = connect_timeout
        self.features: dict[str, Any] = {}
        self.rdy = 0
        self.rdy_history: deque[int] = deque(maxlen=64)  # the last RDY counts sent, for inspection
        self.in_flight = 0
        self.closed = trio.Event()
        self._stream: trio.abc.Stream | None = None
        self._pending: deque[_Pending] = deque()
        self._send_lock = trio.StrictFIFOLock()
        self._parser = FrameParser(MAX_FRAME)

    def __repr__(self) -> str:
        return f"Connection({self.address})"

    async def run(self, *, task_status: trio.TaskStatus[Connection] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect and IDENTIFY, report started, then read frames until the connection ends."""
        host, port = split_host_port(self.address, default_host="127.0.0.1")
        try:
            with trio.fail_after(self.connect_timeout):
                self._stream = await trio.open_tcp_stream(host, port)
                await self._stream.send_all(MAGIC_V2 + encode_identify(self.identify_data))
                kind, data = await self._next_frame()
            if kind == FRAME_TYPE_ERROR:
                raise NSQError(data.decode(errors="replace"))
            if data != b"OK":
                self.features = json.loads(data)
            task_status.started(self)
            while True:
                kind, data = await self._next_frame()
                if kind == FRAME_TYPE_MESSAGE:
                    msg = decode_message(data)
                    self.in_flight += 1
                    if self.on_message is not None:
                        self.on_message(Message(self, msg.id, msg.body, msg.attempts, msg.timestamp))
                elif kind == FRAME_TYPE_ERROR and data.startswith(_UNMATCHED_ERRORS):
                    log.warning("%s: %s", self, data.decode(errors="replace"))
                elif kind != FRAME_TYPE_ERROR and data == HEARTBEAT:
                    await self.send(encode_nop())
                else:
                    self._resolve(kind, data)
        finally:
            self._fail_pending(ConnectionError(f"connection to {self.address} closed"))
            self.closed.set()
            if self._stream is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    await self._stream.aclose()

    async def _next_frame(self) -> tuple[int, bytes]:
        while True:
            for frame in self._parser:
                return frame
            data = await self._stream.receive_some(65536)
            if not data:
                raise ConnectionError(f"{self.address} closed the connection")
            self._parser.feed(data)

    def _resolve(self, kind: int, data: bytes) -> None:
        if not self._pending:
            if kind == FRAME_TYPE_ERROR:
                log.error("%s: %s", self, data.decode(errors="replace"))
            return
        pending = self._pending.popleft()
        if kind == FRAME_TYPE_ERROR:
            pending.error = NSQError(data.decode(errors="replace"))
        else:
            pending.value = data
        pending.event.set()

    def _fail_pending(self, error: Exception) -> None:
        while self._pending:
            pending = self._pending.popleft()
            pending.error = error
            pending.event.set()

    async def send(self, data: bytes) -> None:
        """A command with no response (FIN, REQ, TOUCH, RDY, NOP)."""
        if self._stream is None or self.closed.is_set():
            raise ConnectionError(f"not connected to {self.address}")
        async with self._send_lock:
            await self._stream.send_all(data)

    async def command(self, data: bytes) -> bytes:
        """A command with a response (PUB, MPUB, DPUB, SUB, CLS); raises NSQError on an error frame."""
        if self._stream is None or self.closed.is_set():
            raise ConnectionError(f"not connected to {self.address}")
        pending = _Pending()
        async with self._send_lock:
            self._pending.append(pending)
            await self._stream.send_all(data)
        await pending.event.wait()
        if pending.error is not None:
            raise pending.error
        return pending.value

    async def set_rdy(self, count: int) -> None:
        self.rdy = count
        self.rdy_history.append(count)
        await self.send(encode_rdy(count))
