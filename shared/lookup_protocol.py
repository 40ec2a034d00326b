"""nsqlookupd's TCP protocol V1, sans-IO: the magic, the commands an nsqd sends, the responses nsqlookupd
writes, and the parsers for both directions.

Like shared/protocol.py for V2, nothing here touches a socket. Two callers:

- the broker's lookup peer (broker/lookup.py) sends `MAGIC_V1`, then IDENTIFY, REGISTER, UNREGISTER and
  PING as built by `identify_cmd`, `register_cmd`, `unregister_cmd` and `PING_CMD` (go-nsq's
  command.go: Identify, Register, UnRegister, Ping), and reads nsqlookupd's answers with a
  `ResponseParser`;
- nsqlookupd (lookupd/protocol_v1.py) reads commands with a `V1Parser` and writes each answer with
  `frame`, an error's data being `error_data`; what a command does to the RegistrationDB stays there.

Every response, errors included, is `[size int32 BE][data]` (Go's protocol.SendResponse); an error's data
is "E_CODE description" (Go's FatalClientErr.Error()).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import attrs

from trio_nsq.shared.protocol import Command, FatalClientError

MAGIC_V1 = b"  V1"

# The one 4-byte big-endian size of V1: IDENTIFY's body size and every response's.
SIZE = struct.Struct(">i")

# A V1 line is at most "UNREGISTER <64> <64>"; nsqd never sends more than ~150 bytes.
MAX_LINE_LENGTH = 4096
# nsqd's IDENTIFY body is a few hundred bytes. Go reads whatever size it is told; we refuse big ones.
MAX_IDENTIFY_BODY = 1024 * 1024

# What Go's unicode.IsSpace accepts, hence what strings.TrimSpace removes (Python's str.strip() would
# also remove \x1c-\x1f, which Go keeps).
GO_SPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" \
           "\u2028\u2029\u202f\u205f\u3000"


# --- nsqd -> nsqlookupd: commands ------------------------------------------------------------------


def identify_cmd(info: dict[str, Any]) -> bytes:
    """IDENTIFY: the line, then the JSON body's size and the body (nsqd's connectCallback)."""
    body = json.dumps(info).encode()
    return b"IDENTIFY\n" + SIZE.pack(len(body)) + body


def register_cmd(topic: str, channel: str = "") -> bytes:
    """REGISTER topic [channel]: the channel only when there is one, as go-nsq's Register."""
    return f"REGISTER {topic} {channel}\n".encode() if channel else f"REGISTER {topic}\n".encode()


def unregister_cmd(topic: str, channel: str = "") -> bytes:
    """UNREGISTER topic [channel], as go-nsq's UnRegister."""
    return f"UNREGISTER {topic} {channel}\n".encode() if channel else f"UNREGISTER {topic}\n".encode()


PING_CMD = b"PING\n"


# --- nsqlookupd -> nsqd: responses -----------------------------------------------------------------


def frame(data: bytes) -> bytes:
    """Go's protocol.SendResponse: `[len(data) int32 BE][data]`."""
    return SIZE.pack(len(data)) + data


def error_data(err: FatalClientError) -> bytes:
    """The bytes Go sends for an error: "E_CODE description", with a peer's raw bytes echoed as they were."""
    return f"{err.code} {err.description}".encode("utf-8", "surrogateescape")


def is_error(data: bytes) -> bool:
    """Whether a response's data is an error ("E_CODE description") rather than OK or IDENTIFY's JSON."""
    return data.startswith(b"E_")


class _Parser:
    """What both directions' parsers do with the bytes read: keep them until they make a whole response
    or command."""

    __slots__ = ()  # the subclasses keep _buf: V1Parser as an attrs field
    _buf: bytearray

    def feed(self, data: bytes | bytearray) -> None:
        self._buf += data

    def buffered(self) -> int:
        return len(self._buf)


class ResponseParser(_Parser):
    """nsqlookupd's responses, however the bytes arrive (sans-IO): feed what is read, take each response's
    data. An impossible size is a ValueError with nsqd's text (readResponseBounded); a negative one too,
    where Go would panic."""

    def __init__(self, max_size: int) -> None:
        self._buf = bytearray()
        self._max = max_size

    def next_response(self) -> bytes | None:
        """The next complete response's data, or None until more is fed."""
        buf = self._buf
        if len(buf) < 4:
            return None
        (size,) = SIZE.unpack_from(buf)
        # checked as soon as the size is read, as Go does, so a bad one is never waited for
        if size < 0 or size > self._max:
            raise ValueError(f"response body size ({size}) is greater than limit")
        if len(buf) < 4 + size:
            return None
        data = bytes(buf[4 : 4 + size])
        del buf[: 4 + size]
        return data


# --- nsqlookupd's side: reading commands -----------------------------------------------------------


def decode_param(raw: bytes) -> str:
    """A command's name or param as text: surrogateescape keeps invalid UTF-8 byte for byte, as Go's
    strings do (an error echoes it back unchanged)."""
    return raw.decode("utf-8", "surrogateescape")


def split_line(line: bytes) -> Command:
    """One V1 line (without its newline) as Go's IOLoop sees it: TrimSpace, then split on single spaces."""
    parts = decode_param(line).strip(GO_SPACE).split(" ")
    encoded = [p.encode("utf-8", "surrogateescape") for p in parts]
    return Command(encoded[0], tuple(encoded[1:]))


# Called when an IDENTIFY line has been read, before its size is: Go refuses a second IDENTIFY there.
IdentifyCheck = Callable[[], None]


def _accept_identify() -> None:
    return None


@attrs.define
class V1Parser(_Parser):
    """Bytes from a lookupd peer -> Commands (sans-IO). Raises FatalClientError with Go's errors.

    It reads a line the way Go's IOLoop does (`strings.TrimSpace`, then `strings.Split(line, " ")`), and
    for IDENTIFY the 4-byte big-endian size and the body. Unlike Go's unbounded `bufio.Reader`, a line
    and a body have limits, so a peer cannot make us buffer without end.
    """

    on_identify: IdentifyCheck = _accept_identify
    max_line_length: int = MAX_LINE_LENGTH
    max_body_size: int = MAX_IDENTIFY_BODY
    _buf: bytearray = attrs.field(factory=bytearray, init=False)
    # IDENTIFY whose line is read: (command, body size or None while the size is not read yet)
    _pending: tuple[Command, int | None] | None = attrs.field(default=None, init=False)

    def next_command(self) -> Command | None:
        """The next complete command, or None until more bytes are fed."""
        buf = self._buf
        if self._pending is None:
            end = buf.find(b"\n", 0, self.max_line_length + 1)
            if end < 0:
                if len(buf) > self.max_line_length:
                    raise FatalClientError("E_INVALID", "failed to read command - line too long")
                return None
            cmd = split_line(bytes(buf[:end]))
            del buf[: end + 1]
            if cmd.name != b"IDENTIFY":
                return cmd
            self.on_identify()
            self._pending = (cmd, None)
        cmd, size = self._pending
        if size is None:
            if len(buf) < 4:
                return None
            (size,) = SIZE.unpack_from(buf)
            del buf[:4]
            if size < 0 or size > self.max_body_size:
                # Go would panic on a negative size and try to allocate a huge one
                raise FatalClientError("E_BAD_BODY", f"IDENTIFY invalid body size {size}")
            self._pending = (cmd, size)
        if len(buf) < size:
            return None
        body = bytes(buf[:size])
        del buf[:size]
        self._pending = None
        return Command(cmd.name, cmd.params, body)

    def eof_error(self) -> FatalClientError | None:
        """What Go answers when the peer closes in the middle of an IDENTIFY (a partial line it drops)."""
        if self._pending is None:
            return None
        if self._pending[1] is None:
            return FatalClientError("E_BAD_BODY", "IDENTIFY failed to read body size")
        return FatalClientError("E_BAD_BODY", "IDENTIFY failed to read body")
