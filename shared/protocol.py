"""NSQ TCP protocol V2, sans-IO: frames, commands, messages and IDENTIFY data.

Like h11, nothing here touches a socket. The broker feeds received bytes to a CommandParser and gets
Command events back; clients use the encode_* helpers and a FrameParser. Errors that nsqd reports to a
client are raised as ClientError / FatalClientError carrying nsqd's code and text, so the connection
handler only decides how to send them.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import attrs

MAGIC_V2 = b"  V2"

FRAME_TYPE_RESPONSE = 0
FRAME_TYPE_ERROR = 1
FRAME_TYPE_MESSAGE = 2

MSG_ID_LENGTH = 16
# timestamp (8) + attempts (2) + id (16): the smallest valid encoded message.
MIN_VALID_MSG_LENGTH = 8 + 2 + MSG_ID_LENGTH

HEARTBEAT = b"_heartbeat_"
OK = b"OK"
CLOSE_WAIT = b"CLOSE_WAIT"

INT32 = struct.Struct(">i")
UINT32 = struct.Struct(">I")
FRAME_HEADER = struct.Struct(">ii")
MESSAGE_HEADER = struct.Struct(">qH")
# frame header + message header in one pack: [size][type=2][timestamp][attempts]
MESSAGE_FRAME_HEADER = struct.Struct(">iiqH")


def int32_at(data: bytes, pos: int) -> int:
    """INT32 at `pos` of `data`, from its bytes: compiled, this allocates nothing (unpack_from makes a
    tuple each), for the loops that read one per record (MPUB's sizes, the disk queue's lengths)."""
    value = (data[pos] << 24) | (data[pos + 1] << 16) | (data[pos + 2] << 8) | data[pos + 3]
    return value - 0x100000000 if value >= 0x80000000 else value

# Commands whose line is followed by a 4-byte size and a body.
BODY_COMMANDS = frozenset({b"IDENTIFY", b"AUTH", b"PUB", b"MPUB", b"DPUB"})


class ClientError(Exception):
    """An error nsqd reports to the client and then keeps the connection (e.g. E_FIN_FAILED)."""

    fatal: ClassVar[bool] = False  # ClassVar: compiled by mypyc, a plain attribute is per instance

    def __init__(self, code: str, description: str) -> None:
        super().__init__(f"{code} {description}")
        self.code = code
        self.description = description

    def frame_data(self) -> bytes:
        return f"{self.code} {self.description}".encode()


class FatalClientError(ClientError):
    """An error after which nsqd closes the connection."""

    fatal: ClassVar[bool] = True


# --- frames -----------------------------------------------------------------------------------------


def encode_frame(frame_type: int, data: bytes) -> bytes:
    return FRAME_HEADER.pack(len(data) + 4, frame_type) + data


def encode_message_frame(msg_id: bytes, timestamp: int, attempts: int, body: bytes) -> bytes:
    """A whole message frame: [size][2][timestamp][attempts][id][body]."""
    return MESSAGE_FRAME_HEADER.pack(30 + len(body), FRAME_TYPE_MESSAGE, timestamp, attempts) + msg_id + body


class FrameParser:
    """Splits a byte stream from nsqd into (frame_type, data) pairs."""

    def __init__(self, max_frame_size: int = 64 * 1024 * 1024) -> None:
        self._buf = bytearray()
        self._max = max_frame_size

    def feed(self, data: bytes | bytearray) -> None:
        self._buf += data

    def take_buffered(self) -> bytes:
        """The bytes fed and not yet framed, taken out: after a stream upgrade they belong to the new
        layer (nsqd sends its compressed OK right behind the IDENTIFY answer, often in one segment)."""
        data = bytes(self._buf)
        self._buf.clear()
        return data

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        """The complete frames fed so far (`for frame_type, data in parser`). A generator rather than
        `__next__`: mypyc cannot compile a `__next__` that returns a tuple."""
        while (frame := self.next_frame()) is not None:
            yield frame

    def next_frame(self) -> tuple[int, bytes] | None:
        """The next complete frame, or None until more is fed; ValueError on an impossible size."""
        buf = self._buf
        if len(buf) < 8:
            return None
        size, frame_type = FRAME_HEADER.unpack_from(buf)
        if size < 4 or size > self._max:
            raise ValueError(f"invalid frame size {size}")
        if len(buf) < 4 + size:
            return None
        data = bytes(buf[8 : 4 + size])
        del buf[: 4 + size]
        return frame_type, data

    def message_run(self) -> list[bytes]:
        """The message frames at the front of what was fed (each frame's data, as next_frame gives it),
        up to the first frame of another type, the first incomplete one or a bad size: a consumer that takes what a
        read brought as one list (the Spark source's connections) splits it in one call, with one slice
        per frame (next_frame makes two) and the buffer cut once."""
        buf = self._buf
        if len(buf) < 8:
            return []
        size, frame_type = FRAME_HEADER.unpack_from(buf)
        if frame_type != FRAME_TYPE_MESSAGE or len(buf) < 4 + size:
            return []  # (so a large frame still arriving is copied below once at most, not per read)
        data = bytes(buf)
        end = len(data)
        pos = 0
        run: list[bytes] = []
        while end - pos >= 8:
            size = int32_at(data, pos)
            if size < 4 or size > self._max or int32_at(data, pos + 4) != FRAME_TYPE_MESSAGE or end - pos < 4 + size:
                break  # (a bad size is next_frame's to refuse, after the messages before it)
            run.append(data[pos + 8 : pos + 4 + size])
            pos += 4 + size
        del buf[:pos]
        return run


# --- messages ---------------------------------------------------------------------------------------


@attrs.frozen
class DecodedMessage:
    id: bytes
    timestamp: int
    attempts: int
    body: bytes


def encode_message(msg_id: bytes, timestamp: int, attempts: int, body: bytes) -> bytes:
    """The message wire format, also the record format of the disk queue."""
    return MESSAGE_HEADER.pack(timestamp, attempts) + msg_id + body


def decode_message(data: bytes | memoryview) -> DecodedMessage:
    if len(data) < MIN_VALID_MSG_LENGTH:
        raise ValueError(f"invalid message buffer size ({len(data)})")
    timestamp, attempts = MESSAGE_HEADER.unpack_from(data)
    return DecodedMessage(bytes(data[10:26]), timestamp, attempts, bytes(data[26:]))


# --- client-side command encoding ------------------------------------------------------------------


def _with_body(line: bytes, body: bytes) -> bytes:
    return line + UINT32.pack(len(body)) + body


def encode_identify(data: dict[str, Any]) -> bytes:
    return _with_body(b"IDENTIFY\n", json.dumps(data).encode())


def encode_auth(secret: bytes) -> bytes:
    return _with_body(b"AUTH\n", secret)


def encode_sub(topic: str, channel: str) -> bytes:
    return f"SUB {topic} {channel}\n".encode()


def encode_pub(topic: str, body: bytes) -> bytes:
    return _with_body(f"PUB {topic}\n".encode(), body)


def encode_mpub_body(bodies: Iterable[bytes]) -> bytes:
    bodies = list(bodies)
    parts = [UINT32.pack(len(bodies))]
    for body in bodies:
        parts.append(UINT32.pack(len(body)))
        parts.append(body)
    return b"".join(parts)


def encode_mpub(topic: str, bodies: Iterable[bytes]) -> bytes:
    return _with_body(f"MPUB {topic}\n".encode(), encode_mpub_body(bodies))


def encode_dpub(topic: str, delay_ms: int, body: bytes) -> bytes:
    return _with_body(f"DPUB {topic} {delay_ms}\n".encode(), body)


def encode_rdy(count: int) -> bytes:
    return b"RDY %d\n" % count


def encode_fin(msg_id: bytes) -> bytes:
    return b"FIN " + msg_id + b"\n"


def encode_req(msg_id: bytes, delay_ms: int) -> bytes:
    return b"REQ " + msg_id + b" %d\n" % delay_ms


def encode_touch(msg_id: bytes) -> bytes:
    return b"TOUCH " + msg_id + b"\n"


def encode_cls() -> bytes:
    return b"CLS\n"


def encode_nop() -> bytes:
    return b"NOP\n"


# --- server-side command parsing -------------------------------------------------------------------


@attrs.frozen
class Command:
    """One command as read off the wire: its name, space-separated params, and body if it has one."""

    name: bytes
    params: tuple[bytes, ...]
    body: bytes | None = None


# Called for a command that carries a body: once with size None as soon as its line is read (nsqd
# checks the params before reading the size), then with the declared size before the body is read.
# It raises the nsqd error for what the broker refuses, so an oversize body is never buffered.
BodySizeCheck = Callable[[bytes, tuple[bytes, ...], "int | None"], None]


class CommandParser:
    """Turns the bytes a client sends into Commands.

    A line longer than max_line_length is an error (nsqd's bufio reader would fail the same way);
    a body size is validated by check_body_size before the body is read.
    """

    def __init__(self, check_body_size: BodySizeCheck, max_line_length: int = 16 * 1024) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._check = check_body_size
        self._max_line = max_line_length
        # a command whose line is parsed and whose body is awaited: (name, params, size)
        self._pending: tuple[bytes, tuple[bytes, ...], int | None] | None = None

    def feed(self, data: bytes | bytearray) -> None:
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def take_buffered(self) -> bytes:
        """Remove and return the bytes not yet parsed (they belong to a stream upgrade: TLS, snappy)."""
        data = bytes(self._buf[self._pos :])
        self._buf.clear()
        self._pos = 0
        return data

    def next_command(self) -> Command | None:
        """The next complete command, or None until more bytes are fed."""
        buf = self._buf
        if self._pending is None:
            end = buf.find(b"\n", self._pos)
            if end < 0:
                if len(buf) - self._pos >= self._max_line:
                    raise FatalClientError("E_INVALID", "failed to read command - line too long")
                return None
            if end - self._pos >= self._max_line:  # the line and its '\n' must fit, as in nsqd's bufio buffer
                raise FatalClientError("E_INVALID", "failed to read command - line too long")
            line = bytes(buf[self._pos : end])
            self._pos = end + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            parts = line.split(b" ")
            name, params = parts[0], tuple(parts[1:])
            if name not in BODY_COMMANDS:
                return Command(name, params)
            self._check(name, params, None)
            self._pending = (name, params, None)
        name, params, size = self._pending
        if size is None:
            if len(buf) - self._pos < 4:
                return None
            (size,) = INT32.unpack_from(buf, self._pos)
            self._pos += 4
            # validated before buffering: raises the nsqd error for a refused size
            self._check(name, params, size)
            self._pending = (name, params, size)
        if len(buf) - self._pos < size:
            return None
        body = bytes(buf[self._pos : self._pos + size])
        self._pos += size
        self._pending = None
        return Command(name, params, body)

    def peek_fins(self) -> list[bytes]:
        """The message ids of the complete `FIN <id>` lines at the front of the buffer, not consumed
        (skip_fins() does that). A consumer sends FINs in runs: one call per read instead of one
        next_command() each. Stops at anything else, which next_command() then parses as usual."""
        if self._pending is not None:
            return []
        buf, pos = self._buf, self._pos
        lines = (len(buf) - pos) // _FIN_LINE
        if not lines or buf[pos] != 70:  # b"F"
            return []
        # checked column by column (every line's byte k in one strided slice, in C) rather than by a
        # regular expression per line: how many lines from the front have "FIN " and "\n" in place
        chunk = bytes(buf[pos : pos + lines * _FIN_LINE])
        n = lines
        for col, want in _FIN_COLUMNS:
            column = chunk[col::_FIN_LINE]
            n = min(n, len(column) - len(column.lstrip(want)))
            if not n:
                return []
        # no space or newline inside those ids, none ending in "\r": else the exact rule, line by line
        end = n * _FIN_LINE
        if chunk.count(b" ", 0, end) != n or chunk.count(b"\n", 0, end) != n or b"\r" in chunk[19:end:_FIN_LINE]:
            run = _FIN_RUN.match(chunk)
            if run is None:
                return []
            end = run.end()
        return [chunk[p + 4 : p + _FIN_LINE - 1] for p in range(0, end, _FIN_LINE)]

    def skip_fins(self, n: int) -> None:
        """Consume the first n FIN lines that peek_fins() returned."""
        self._pos += n * _FIN_LINE

    def wanted(self) -> int:
        """How many more bytes the pending command needs (0 when unknown): lets a reader size its receive."""
        if self._pending is None or self._pending[2] is None:
            return 0
        return max(0, self._pending[2] - (len(self._buf) - self._pos))


# b"FIN " + a 16-byte message id + b"\n"; a line that next_command() would read otherwise (a space
# splitting the id, a "\r" it would strip) is not part of a run
_FIN_LINE = 4 + 16 + 1
_FIN_RUN = re.compile(rb"(?:FIN [^\n ]{15}[^\n\r ]\n)+")
_FIN_COLUMNS = ((0, b"F"), (1, b"I"), (2, b"N"), (3, b" "), (_FIN_LINE - 1, b"\n"))


def parse_mpub_body(body: bytes, max_msg_size: int, max_body_size: int, *, surplus_ok: bool = False) -> list[bytes]:
    """The message bodies of an MPUB body ([count][size][bytes]...), with nsqd's errors. TCP's MPUB and
    HTTP's `/mpub?binary=true` both read it here; HTTP ignores bytes after the last message, as nsqd
    reads only what the count announces there (surplus_ok)."""
    if len(body) < 4:
        raise FatalClientError("E_BAD_BODY", "MPUB failed to read message count")
    (count,) = INT32.unpack_from(body, 0)
    max_messages = (max_body_size - 4) // 5
    if count <= 0 or count > max_messages:
        raise FatalClientError("E_BAD_BODY", f"MPUB invalid message count {count}")
    if type(body) is not bytes:
        body = bytes(body)  # a bytearray's slices would be bytearrays
    pos = 4
    end = len(body)
    out: list[bytes] = []
    for i in range(count):
        if end - pos < 4:
            raise FatalClientError("E_BAD_MESSAGE", f"MPUB failed to read message({i}) body size")
        size = int32_at(body, pos)
        pos += 4
        if size <= 0:
            raise FatalClientError("E_BAD_MESSAGE", f"MPUB invalid message({i}) body size {size}")
        if size > max_msg_size:
            raise FatalClientError("E_BAD_MESSAGE", f"MPUB message too big {size} > {max_msg_size}")
        if end - pos < size:
            raise FatalClientError("E_BAD_MESSAGE", "MPUB failed to read message body")
        out.append(body[pos : pos + size])  # one copy (a memoryview's slice, then bytes(), made two objects)
        pos += size
    if pos != end and not surplus_ok:
        # nsqd would read the surplus as the next command; we refuse the MPUB outright instead
        raise FatalClientError("E_BAD_BODY", f"MPUB invalid message count {count} for body size {end}")
    return out


def parse_int(value: bytes | str) -> int:
    """nsqd's ByteToBase10: ASCII decimal digits only (no sign, no spaces)."""
    if not value or not value.isdigit() or not value.isascii():
        raise ValueError(f"invalid integer {value!r}")
    return int(value)


# --- IDENTIFY ---------------------------------------------------------------------------------------


def topology_fields(zone: str, region: str) -> dict[str, str]:
    """A node's topology as nsqd after 1.3.0 reports it (IDENTIFY's answer, /info, nsqlookupd's
    producers): only when --topology-zone/--topology-region are set, so that a node without them answers
    byte for byte as nsqd 1.3.0, which has no such fields."""
    fields = {}
    if zone:
        fields["topology_zone"] = zone
    if region:
        fields["topology_region"] = region
    return fields


@attrs.define
class IdentifyData:
    """The JSON a client sends in IDENTIFY (unknown keys ignored, as Go's json.Unmarshal does)."""

    client_id: str = ""
    hostname: str = ""
    user_agent: str = ""
    feature_negotiation: bool = False
    heartbeat_interval: int = 0
    output_buffer_size: int = 0
    output_buffer_timeout: int = 0
    tls_v1: bool = False
    snappy: bool = False
    deflate: bool = False
    deflate_level: int = 0
    sample_rate: int = 0
    msg_timeout: int = 0
    topology_zone: str = ""
    topology_region: str = ""

    @classmethod
    def from_json(cls, body: bytes) -> IdentifyData:
        try:
            raw = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise FatalClientError("E_BAD_BODY", "IDENTIFY failed to decode JSON body") from exc
        if not isinstance(raw, dict):
            raise FatalClientError("E_BAD_BODY", "IDENTIFY failed to decode JSON body")
        # long_id/short_id are the deprecated names of hostname/client_id that old clients still send
        if "short_id" in raw and "client_id" not in raw:
            raw["client_id"] = raw["short_id"]
        if "long_id" in raw and "hostname" not in raw:
            raw["hostname"] = raw["long_id"]
        kwargs: dict[str, Any] = {}
        for field in attrs.fields(cls):
            if field.name not in raw or raw[field.name] is None:
                continue
            value = raw[field.name]
            expected = field.type if isinstance(field.type, type) else {"str": str, "bool": bool, "int": int}[field.type]
            if expected is int and isinstance(value, float) and value.is_integer():
                value = int(value)
            if expected is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise FatalClientError("E_BAD_BODY", "IDENTIFY failed to decode JSON body")
            if expected is not int and not isinstance(value, expected):
                raise FatalClientError("E_BAD_BODY", "IDENTIFY failed to decode JSON body")
            kwargs[field.name] = value
        return cls(**kwargs)
