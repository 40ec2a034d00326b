"""Connection: one protocol V2 conversation with nsqd, owning its reader and writer tasks.

    async with Connection("127.0.0.1:4150") as conn:
        await conn.command(encode_pub("topic", b"body"))

nsqd answers the commands that have an answer (IDENTIFY, SUB, PUB, MPUB, DPUB, CLS, AUTH) in the order
it reads them, so any number of them may be in flight: each waits on a slot in a FIFO and the reader
hands every response or error frame to the oldest slot. FIN, REQ, TOUCH, RDY and NOP have no answer;
their only possible errors (E_FIN_FAILED, E_REQ_FAILED, E_TOUCH_FAILED) are logged, never matched.

Writes are appended to one output buffer and a writer task sends whatever has accumulated in one
`send_all`, so a burst of pipelined PUBs (or FINs) leaves as one segment. The buffer is bounded:
`command()` waits for room past `max_pending` unanswered commands or `write_buffer_size` bytes.

The end of the connection is a state, not an exception: the reader records why it ended, sets
`closed`, and fails every waiting command. The tasks never raise into the owner's nursery.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs
import trio

from trio_nsq.shared.addresses import split_host_port
from trio_nsq.shared.protocol import (
    CLOSE_WAIT,
    FRAME_TYPE_ERROR,
    FRAME_TYPE_MESSAGE,
    FRAME_TYPE_RESPONSE,
    HEARTBEAT,
    MAGIC_V2,
    MIN_VALID_MSG_LENGTH,
    DecodedMessage,
    FrameParser,
    decode_message,
    encode_auth,
    encode_cls,
    encode_fin,
    encode_identify,
    encode_nop,
    encode_rdy,
    encode_req,
    encode_touch,
)
from trio_nsq.shared.streams import DeflateStream, SnappyStream
from trio_nsq.shared.version import USER_AGENT

log = logging.getLogger("trio_nsq.client")

# Errors nsqd sends for commands without a response; nsqd keeps the connection after them.
NON_FATAL_ERRORS = frozenset({"E_FIN_FAILED", "E_REQ_FAILED", "E_TOUCH_FAILED"})
MAX_FRAME_SIZE = 64 * 1024 * 1024
RECV_SIZE = 65536


class NSQError(Exception):
    """An error nsqd answered: `code` is nsqd's (E_BAD_TOPIC, ...), `description` the rest of its text; or
    the client's refusal of nsqd's answer (E_TLS_NOT_OFFERED: TLS asked for, nsqd has none).

    Every error nsqd sends except E_FIN_FAILED / E_REQ_FAILED / E_TOUCH_FAILED is fatal: nsqd closes the
    connection right after it (`fatal` says so). HTTP errors carry nsqd's JSON message as the code
    (MSG_TOO_BIG, TOPIC_NOT_FOUND...) and `status` the HTTP status.
    """

    def __init__(self, code: str, description: str = "", *, status: int | None = None) -> None:
        super().__init__(f"{code} {description}".strip())
        self.code = code
        self.description = description
        self.status = status

    @property
    def fatal(self) -> bool:
        return self.code not in NON_FATAL_ERRORS

    @classmethod
    def from_frame(cls, data: bytes) -> NSQError:
        code, _, description = data.decode(errors="replace").partition(" ")
        return cls(code, description)


class NSQConnectionError(ConnectionError):
    """The connection ended before the command's answer arrived.

    `maybe_processed` is False when nsqd certainly never executed the command (it was never written,
    or it came after a command nsqd refused with a fatal error: nsqd stops reading there), so sending
    it again cannot duplicate anything. When True, the command may or may not have been executed.
    """

    def __init__(self, message: str, *, maybe_processed: bool = True) -> None:
        super().__init__(message)
        self.maybe_processed = maybe_processed


def fresh_error(error: Exception) -> Exception:
    """A copy of an NSQError or NSQConnectionError, for one caller of several to raise (one exception
    object raised in several tasks would collect all their tracebacks)."""
    if isinstance(error, NSQError):
        return NSQError(error.code, error.description, status=error.status)
    if isinstance(error, NSQConnectionError):
        return NSQConnectionError(str(error), maybe_processed=error.maybe_processed)
    return error


def connect_refusal(address: str, error: BaseException) -> Exception | None:
    """The error of a failed connection attempt that trying again will not fix, for the Producer's
    publishes and the Consumer's wait_connected to raise at once: nsqd's refusal (IDENTIFY, AUTH) or ours
    (E_TLS_NOT_OFFERED), or a failed TLS handshake (a certificate refused by either side, which trio
    wraps in BrokenResourceError). None otherwise."""
    if isinstance(error, NSQError):
        return error if error.fatal else None
    if isinstance(error, trio.BrokenResourceError) and isinstance(error.__cause__, ssl.SSLError):
        return NSQConnectionError(f"{address}: TLS handshake failed - {error.__cause__}", maybe_processed=False)
    return None


class OwnedNursery:
    """The nursery of an object used as an async context manager: opened in __aenter__, cancelled and
    left in __aexit__. Our tasks never raise, so when the nursery wraps the body's exception in an
    ExceptionGroup (strict exception groups), the body's exception is let through unwrapped.
    """

    def __init__(self) -> None:
        self._cm: Any = None
        self.nursery: trio.Nursery | None = None

    async def open(self) -> trio.Nursery:
        self._cm = trio.open_nursery()
        self.nursery = await self._cm.__aenter__()
        return self.nursery

    async def close(self, exc_info: tuple[Any, Any, Any]) -> bool:
        if self.nursery is None:
            return False  # never opened
        self.nursery.cancel_scope.cancel()
        try:
            return bool(await self._cm.__aexit__(*exc_info))
        except BaseExceptionGroup as group:
            if exc_info[1] is not None and all(e is exc_info[1] for e in group.exceptions):
                return False  # the body's exception propagates as it was raised
            raise


class _Pending:
    __slots__ = ("event", "value", "error")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.value = b""
        self.error: BaseException | None = None


# on_message(connection, message): called by the reader task, so it must not block.
MessageCallback = Callable[["Connection", DecodedMessage], None]
# on_messages(connection, frames): the message frames of one read, undecoded (the wire format: timestamp,
# attempts, id, body), for a caller that decodes them in bulk; called by the reader task, must not block.
MessagesCallback = Callable[["Connection", list[bytes]], None]


def tls_context(ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None,
                verify: bool = True) -> ssl.SSLContext:
    """An SSLContext for ``Connection(tls=...)`` (and Producer/Consumer's ``tls=``).

    ``ca_file`` verifies nsqd's certificate (default: the system's CAs); ``cert_file``/``key_file``
    present a client certificate (nsqd's --tls-client-auth-policy); ``verify=False`` accepts any
    certificate and host name (nsqd's tls_insecure_skip_verify in go-nsq). Raises ``OSError`` or
    ``ssl.SSLError`` when a file cannot be read."""
    context = ssl.create_default_context(cafile=ca_file)
    if cert_file:
        context.load_cert_chain(cert_file, key_file)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def _identify_fields(fields: dict[str, Any] | None) -> dict[str, Any]:
    return dict(fields or {})


def _check_compression(snappy: bool, deflate: bool) -> None:
    if snappy and deflate:
        raise ValueError("snappy and deflate cannot both be on: a connection is compressed one way or the other")


def _at_least(minimum: float, *, off: float | None = None, optional: bool = False) -> Any:
    """An attrs validator: the value is `minimum` or more (nsqd's lower bound), or `off`, or None."""
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if (value is None and optional) or (off is not None and value == off):
            return
        if value is None or value < minimum:
            allowed = f"{off:g} (off) or " if off is not None else ""
            raise ValueError(f"{attribute.name} must be {allowed}at least {minimum:g} (nsqd refuses less), not {value!r}")
    return check


def _ms(seconds: float) -> int:
    """A duration of ours (seconds) in IDENTIFY's unit (ms); -1, nsqd's "off", stays -1."""
    return -1 if seconds == -1 else round(seconds * 1000)


@attrs.define(kw_only=True, eq=False)
class ConnectOptions:
    """How a Producer or a Consumer opens each of its connections: IDENTIFY fields, AUTH secret, TLS,
    compression, connect timeout. Both classes extend it, so these keywords are declared once;
    `connect(address)` makes a Connection with them.

    IDENTIFY's settings, as go-nsq's Config and pynsq's Conn name them (durations in seconds here; nsqd
    gets ms): `heartbeat_interval` (30 s as both; -1 turns heartbeats off; the client drops a connection
    silent for twice that), `output_buffer_size` (bytes nsqd buffers before writing to this client, -1:
    none) and `output_buffer_timeout` (how long at most, -1: no timeout), `sample_rate` (the percentage of
    a channel's messages this consumer gets, 0: all) and `msg_timeout` (nsqd's --msg-timeout for this
    client's messages). None leaves nsqd's own default. `identify={...}` sends any field as given, over
    these. A value nsqd would refuse raises ValueError here, as go-nsq's config validation does."""

    identify: dict[str, Any] = attrs.field(factory=dict, converter=_identify_fields)
    auth_secret: bytes | str | None = attrs.field(default=None, repr=False)
    tls: ssl.SSLContext | None = None
    snappy: bool = False
    deflate: bool = attrs.field(default=False)
    connect_timeout: float = 5.0
    heartbeat_interval: float = attrs.field(default=30.0, validator=_at_least(1.0, off=-1))
    output_buffer_size: int | None = attrs.field(default=None, validator=_at_least(64, off=-1, optional=True))
    output_buffer_timeout: float | None = attrs.field(default=None, validator=_at_least(0.0, off=-1, optional=True))
    sample_rate: int = attrs.field(default=0, validator=[attrs.validators.ge(0), attrs.validators.le(99)])
    msg_timeout: float | None = attrs.field(default=None, validator=_at_least(1.0, optional=True))

    @deflate.validator
    def _one_compression(self, attribute: Any, value: bool) -> None:
        _check_compression(self.snappy, value)

    def identify_fields(self) -> dict[str, Any]:
        """The IDENTIFY fields these options send (before `identify`'s, which win)."""
        fields: dict[str, Any] = {"heartbeat_interval": _ms(self.heartbeat_interval), "sample_rate": self.sample_rate}
        if self.output_buffer_size is not None:
            fields["output_buffer_size"] = self.output_buffer_size
        if self.output_buffer_timeout is not None:
            fields["output_buffer_timeout"] = _ms(self.output_buffer_timeout)
        if self.msg_timeout is not None:
            fields["msg_timeout"] = _ms(self.msg_timeout)
        return {**fields, **self.identify}

    def connect(self, address: str, **extra: Any) -> Connection:
        return Connection(address, identify=self.identify_fields(), auth_secret=self.auth_secret, tls=self.tls,
                          snappy=self.snappy, deflate=self.deflate, connect_timeout=self.connect_timeout, **extra)


class Connection:
    """One V2 connection. Use as `async with Connection(address, ...) as conn:`.

    Entering connects, sends the magic and IDENTIFY (with feature_negotiation; the broker's JSON answer
    is kept in `features` and its main values as attributes), and AUTH when the broker requires it.
    Message frames go to `on_message`, or, without one, into `messages` (a memory channel of
    `message_buffer` entries; the reader waits when it is full); with `on_messages`, the frames of each
    read go to it in one list, undecoded (no per-message object or call). Leaving closes the socket.
    """

    def __init__(
        self,
        address: str,
        *,
        identify: dict[str, Any] | None = None,
        auth_secret: bytes | str | None = None,
        on_message: MessageCallback | None = None,
        on_messages: MessagesCallback | None = None,
        message_buffer: int = 100,
        connect_timeout: float = 5.0,
        max_pending: int = 10_000,
        write_buffer_size: int = 4 * 1024 * 1024,
        tls: ssl.SSLContext | None = None,
        snappy: bool = False,
        deflate: bool = False,
        deflate_level: int = 6,
    ) -> None:
        _check_compression(snappy, deflate)
        self.address = address
        self.tls_context = tls
        self.identify_data: dict[str, Any] = {
            "client_id": socket.gethostname().split(".")[0],
            "hostname": socket.gethostname(),
            "feature_negotiation": True,
            "user_agent": USER_AGENT,
            # sent, as go-nsq and pynsq do: nsqd's own default is --client-timeout/2, which this client
            # cannot know, and it reads with a timeout of twice the interval
            "heartbeat_interval": 30_000,
            "tls_v1": tls is not None,
            "snappy": snappy,
            "deflate": deflate,
            "deflate_level": deflate_level,
            **(identify or {}),
        }
        self.auth_secret = auth_secret.encode() if isinstance(auth_secret, str) else auth_secret
        self.on_message = on_message
        self.on_messages = on_messages
        self.connect_timeout = connect_timeout
        self.write_buffer_size = write_buffer_size

        # what the broker answered to IDENTIFY
        self.features: dict[str, Any] = {}
        self.max_rdy_count = 2500
        self.msg_timeout = 60_000  # ms
        self.max_msg_timeout = 15 * 60_000
        # nsqd does not answer with the interval: it is the one asked for (ms; -1: none)
        self.heartbeat_interval = int(self.identify_data["heartbeat_interval"])
        self.auth: dict[str, Any] | None = None

        # consumer bookkeeping (used by Consumer; harmless for producers)
        self.rdy = 0  # the last RDY sent
        self.rdy_remaining = 0  # last RDY minus the messages received since
        self.rdy_history: deque[int] = deque(maxlen=256)
        self.in_flight = 0  # messages received and not yet FIN'd or REQ'd
        self.last_message_at = 0.0
        self.messages_received = 0

        self.closed = trio.Event()
        self.close_reason: BaseException | None = None
        self._stream: trio.abc.Stream | None = None
        self._parser = FrameParser(MAX_FRAME_SIZE)
        self._pending: deque[_Pending] = deque()
        self._pending_slots = trio.Semaphore(max_pending)
        self._unwritten = 0  # how many of the newest _pending entries are still in _outbuf
        self._fatal_seen = False
        self._outbuf = bytearray()
        self._write_wanted = trio.Event()
        self._write_lot = trio.lowlevel.ParkingLot()  # woken when the buffer was written
        self._idle_lot = trio.lowlevel.ParkingLot()  # woken when in_flight drops to 0
        self._messages_send, self.messages = trio.open_memory_channel[DecodedMessage](message_buffer)
        self._tasks = OwnedNursery()

    def __repr__(self) -> str:
        return f"Connection({self.address})"

    @property
    def is_closed(self) -> bool:
        return self.closed.is_set()

    @property
    def read_timeout(self) -> float | None:
        """Seconds of silence after which the connection is dropped: two heartbeat intervals (nsqd's own
        read timeout for a client); None when heartbeats are off."""
        return 2 * self.heartbeat_interval / 1000 if self.heartbeat_interval > 0 else None

    @property
    def stream(self) -> trio.abc.Stream:
        """The connected stream (TLS and compression layers included); set by __aenter__."""
        if self._stream is None:
            raise NSQConnectionError(f"not connected to {self.address}", maybe_processed=False)
        return self._stream

    # --- life ---------------------------------------------------------------------------------

    async def __aenter__(self) -> Connection:
        host, port = split_host_port(self.address, default_host="127.0.0.1")
        with trio.fail_after(self.connect_timeout):
            self._stream = await trio.open_tcp_stream(host, port)
            try:
                await self._handshake()
            except BaseException:
                self._set_closed(None)
                with trio.CancelScope(shield=True):
                    await self.stream.aclose()
                raise
        nursery = await self._tasks.open()
        nursery.start_soon(self._reader)
        nursery.start_soon(self._writer)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool:
        try:
            return await self._tasks.close(exc_info)
        finally:
            self._set_closed(None)
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    async def _handshake(self) -> None:
        await self.stream.send_all(MAGIC_V2 + encode_identify(self.identify_data))
        kind, data = await self._read_frame()
        if kind == FRAME_TYPE_ERROR:
            raise NSQError.from_frame(data)
        if data != b"OK":
            self._apply_features(json.loads(data))
        if self.tls_context is not None and not self.features.get("tls_v1"):
            raise NSQError("E_TLS_NOT_OFFERED", f"{self.address} does not offer TLS (nsqd without --tls-cert): "
                                                "not going on in plaintext")
        # as nsqd does it: TLS on the same stream, then compression on top; each answers OK
        if self.features.get("tls_v1"):
            host = split_host_port(self.address, default_host="127.0.0.1")[0]
            if self.tls_context is None:
                raise NSQError("E_INVALID", f"{self.address} negotiated TLS without a TLS context")
            stream = trio.SSLStream(self.stream, self.tls_context, server_hostname=host)
            await stream.do_handshake()
            self._stream = stream
            await self._expect_ok()
        # what was read past the IDENTIFY answer is already compressed: the new layer reads it first
        if self.features.get("snappy"):
            self._stream = SnappyStream(self.stream, prefix=self._parser.take_buffered())
            await self._expect_ok()
        elif self.features.get("deflate"):
            level = int(self.features.get("deflate_level") or 6)
            self._stream = DeflateStream(self.stream, level, prefix=self._parser.take_buffered())
            await self._expect_ok()
        if self.features.get("auth_required"):
            if self.auth_secret is None:
                raise NSQError("E_AUTH_REQUIRED", f"{self.address} requires AUTH and no secret was given")
            await self.stream.send_all(encode_auth(self.auth_secret))
            kind, data = await self._read_frame()
            if kind == FRAME_TYPE_ERROR:
                raise NSQError.from_frame(data)
            self.auth = json.loads(data)

    def _apply_features(self, features: dict[str, Any]) -> None:
        self.features = features
        self.max_rdy_count = int(features.get("max_rdy_count", self.max_rdy_count))
        self.msg_timeout = int(features.get("msg_timeout", self.msg_timeout))
        self.max_msg_timeout = int(features.get("max_msg_timeout", self.max_msg_timeout))
        for wanted in ("tls_v1", "snappy", "deflate"):
            if features.get(wanted) and not self.identify_data.get(wanted):
                raise NSQError("E_INVALID", f"{self.address} negotiated {wanted}, which was not asked for")

    async def _expect_ok(self) -> None:
        kind, data = await self._read_frame()
        if kind == FRAME_TYPE_ERROR:
            raise NSQError.from_frame(data)
        if data != b"OK":
            raise NSQError("E_INVALID", f"{self.address} answered {data[:100]!r} to an upgrade")

    async def _read_frame(self) -> tuple[int, bytes]:
        while True:
            for frame in self._parser:
                return frame
            data = await self.stream.receive_some(RECV_SIZE)
            if not data:
                raise NSQConnectionError(f"{self.address} closed the connection")
            self._parser.feed(data)

    async def _reader(self) -> None:
        """Read frames until the connection ends; a silence of two heartbeat intervals ends it too."""
        timeout = self.read_timeout or float("inf")
        reason: BaseException | None = None
        try:
            while True:
                # every frame already received, then one timed read: a deadline per read, not per frame
                while True:
                    if self.on_messages is not None:
                        # a run of message frames, split in one call (compiled), handed over in order
                        frames = self._parser.message_run()
                        if frames:
                            self._got_messages(frames)
                    frame = self._parser.next_frame()
                    if frame is None:
                        break
                    kind, data = frame
                    if kind == FRAME_TYPE_MESSAGE:
                        await self._got_message(decode_message(data))
                    elif kind == FRAME_TYPE_RESPONSE and data == HEARTBEAT:
                        self.write(encode_nop())
                    elif kind == FRAME_TYPE_ERROR:
                        self._got_error(NSQError.from_frame(data))
                    else:
                        self._got_response(data)
                with trio.fail_after(timeout):
                    received = await self.stream.receive_some(RECV_SIZE)
                if not received:
                    raise NSQConnectionError(f"{self.address} closed the connection")
                self._parser.feed(received)
        except trio.TooSlowError:
            reason = NSQConnectionError(f"{self.address}: no data for {timeout:g}s (heartbeats missed)")
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, ValueError) as exc:
            reason = exc
        except NSQConnectionError as exc:
            reason = exc
        finally:
            self._set_closed(reason)
            if self._stream is not None:
                with trio.CancelScope(shield=True):
                    await self._stream.aclose()
        if reason is not None and not isinstance(reason, NSQConnectionError):
            log.info("%s: connection ended - %r", self, reason)

    async def _got_message(self, msg: DecodedMessage) -> None:
        self.in_flight += 1
        self.rdy_remaining -= 1
        self.messages_received += 1
        self.last_message_at = trio.current_time()
        if self.on_message is not None:
            self.on_message(self, msg)
        else:
            await self._messages_send.send(msg)

    def _got_messages(self, frames: list[bytes]) -> None:
        assert self.on_messages is not None
        if min(map(len, frames)) < MIN_VALID_MSG_LENGTH:
            raise ValueError(f"invalid message buffer size ({min(map(len, frames))})")
        self.in_flight += len(frames)
        self.rdy_remaining -= len(frames)
        self.messages_received += len(frames)
        self.last_message_at = trio.current_time()
        self.on_messages(self, frames)

    def _got_error(self, error: NSQError) -> None:
        if not error.fatal:
            log.warning("%s: %s", self, error)
            return
        self._fatal_seen = True
        if self._pending:
            self._resolve(b"", error)
        else:
            log.error("%s: %s", self, error)

    def _got_response(self, data: bytes) -> None:
        if not self._pending:
            log.warning("%s: unexpected response %r", self, data[:100])
            return
        self._resolve(data, None)

    def _resolve(self, value: bytes, error: BaseException | None) -> None:
        pending = self._pending.popleft()
        pending.value, pending.error = value, error
        pending.event.set()

    def _set_closed(self, reason: BaseException | None) -> None:
        if self.closed.is_set():
            return
        self.close_reason = reason
        self.closed.set()
        written = len(self._pending) - self._unwritten
        for i, pending in enumerate(self._pending):
            # after a fatal error nsqd stops reading: nothing later was executed; nor was the unwritten
            maybe = i < written and not self._fatal_seen
            pending.error = NSQConnectionError(f"connection to {self.address} closed"
                                               + (f" ({reason})" if reason else ""), maybe_processed=maybe)
            pending.event.set()
        self._pending.clear()
        self._outbuf.clear()
        self._unwritten = 0
        self._messages_send.close()
        self._write_lot.unpark_all()
        self._idle_lot.unpark_all()

    # --- writing ------------------------------------------------------------------------------

    async def _writer(self) -> None:
        try:
            while True:
                await self._write_wanted.wait()
                self._write_wanted = trio.Event()
                while self._outbuf:
                    data = bytes(self._outbuf)
                    self._outbuf.clear()
                    self._unwritten = 0
                    await self.stream.send_all(data)
                self._write_lot.unpark_all()
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._set_closed(exc)
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    def write(self, data: bytes) -> None:
        """Queue a command that has no response (FIN, REQ, TOUCH, RDY, NOP); the writer sends it."""
        if self.closed.is_set():
            raise NSQConnectionError(f"not connected to {self.address}", maybe_processed=False)
        self._outbuf += data
        self._write_wanted.set()

    async def drain(self) -> None:
        """Wait while the output buffer is over `write_buffer_size` (backpressure for writers)."""
        while len(self._outbuf) > self.write_buffer_size and not self.closed.is_set():
            await self._write_lot.park()
        await trio.lowlevel.checkpoint()

    async def flush(self) -> None:
        """Wait until everything queued so far has been handed to the socket."""
        while self._outbuf and not self.closed.is_set():
            await self._write_lot.park()
        await trio.lowlevel.checkpoint()

    async def command(self, data: bytes) -> bytes:
        """Send a command that has a response; return the response, raise NSQError for an error frame.

        Raises NSQConnectionError when the connection ends before the answer (see `maybe_processed`).
        """
        async with self._pending_slots:
            await self.drain()
            self.write(data)
            pending = _Pending()
            self._pending.append(pending)
            self._unwritten += 1
            await pending.event.wait()
        if pending.error is not None:
            raise pending.error
        return pending.value

    # --- consumer commands --------------------------------------------------------------------

    def send_rdy(self, count: int) -> None:
        count = max(0, min(count, self.max_rdy_count))
        self.rdy = self.rdy_remaining = count
        self.rdy_history.append(count)
        self.write(encode_rdy(count))

    def responded(self, count: int = 1) -> None:
        """`count` messages of this connection no longer in flight on our side: answered (FIN, REQ), or
        dropped by the Consumer unanswered once nsqd had requeued them (msg_timeout passed)."""
        self.in_flight -= count
        if self.in_flight <= 0:
            self.in_flight = 0
            self._idle_lot.unpark_all()

    def fin(self, msg_id: bytes) -> None:
        self.write(encode_fin(msg_id))
        self.responded()

    def req(self, msg_id: bytes, delay_ms: int = 0) -> None:
        self.write(encode_req(msg_id, max(0, int(delay_ms))))
        self.responded()

    def touch(self, msg_id: bytes) -> None:
        self.write(encode_touch(msg_id))

    def fin_many(self, msg_ids: list[bytes]) -> None:
        """FIN each of `msg_ids`: the bytes of one FIN per message, built and queued in one go."""
        self._write_many(encode_fin(b"\0").split(b"\0"), msg_ids)
        self.responded(len(msg_ids))

    def req_many(self, msg_ids: list[bytes], delay_ms: int = 0) -> None:
        self._write_many(encode_req(b"\0", max(0, int(delay_ms))).split(b"\0"), msg_ids)
        self.responded(len(msg_ids))

    def touch_many(self, msg_ids: list[bytes]) -> None:
        self._write_many(encode_touch(b"\0").split(b"\0"), msg_ids)

    def _write_many(self, around: list[bytes], msg_ids: list[bytes]) -> None:
        """One command per id, the id between `around`'s two parts (b"FIN ", b"\\n"), joined in C."""
        if msg_ids:
            before, after = around
            self.write(before + (after + before).join(msg_ids) + after)

    async def wait_idle(self) -> None:
        """Wait until no message received on this connection is waiting for FIN or REQ."""
        while self.in_flight > 0 and not self.closed.is_set():
            await self._idle_lot.park()
        await trio.lowlevel.checkpoint()

    async def wait_closed(self) -> None:
        await self.closed.wait()

    async def close_gracefully(self, timeout: float = 5.0) -> None:
        """NSQ's clean close: CLS, wait for CLOSE_WAIT (after it nsqd sends no more messages), wait until
        every message received is FIN'd or REQ'd, then half-close so nsqd reads all of it and closes.
        """
        with trio.move_on_after(timeout):
            if not self.closed.is_set():
                try:
                    answer = await self.command(encode_cls())
                except (NSQError, NSQConnectionError) as exc:
                    log.info("%s: CLS - %s", self, exc)
                    return
                if answer != CLOSE_WAIT:
                    log.warning("%s: CLS answered %r", self, answer)
            await self.wait_idle()
            await self.flush()
            # half-close only on a plain socket: TLS and the compressed streams cannot (nsqd then
            # ends the connection itself once CLS has drained, or the socket close ends it)
            if not self.closed.is_set() and isinstance(self._stream, trio.SocketStream):
                try:
                    await self._stream.send_eof()
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                await self.closed.wait()
