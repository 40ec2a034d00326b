"""nsqlookupd's TCP protocol V1 (nsqlookupd/lookup_protocol_v1.go): IDENTIFY, REGISTER, UNREGISTER, PING.

Two halves, as h11 splits a protocol from its I/O:

- `V1Parser` is pure: bytes in, `Command`s out. It reads a line the way Go's IOLoop does
  (`strings.TrimSpace`, then `strings.Split(line, " ")`), and for IDENTIFY the 4-byte big-endian size and
  the body. Unlike Go's unbounded `bufio.Reader`, a line and a body have limits, so a peer cannot make
  us buffer without end.
- `LookupProtocolV1.exec` applies one command to the RegistrationDB and returns the response bytes;
  `serve` is the only part that touches a socket.

Every response, errors included, is `[size int32 BE][data]` (Go's protocol.SendResponse), an error's data
being "E_CODE description". Every V1 error is a FatalClientErr in Go: it is sent, then the connection
closes, and (as on any exit of Go's IOLoop) the peer's registrations go with it.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import trio

from trio_nsq.lookupd.registration_db import PeerInfo, Producer, Registration
from trio_nsq.shared.names import is_valid_channel_name, is_valid_topic_name
from trio_nsq.shared.protocol import Command, FatalClientError
from trio_nsq.shared.version import VERSION

if TYPE_CHECKING:
    from trio_nsq.lookupd.nsqlookupd import NSQLookupd

log = logging.getLogger("nsqlookupd")

_SIZE = struct.Struct(">i")

# A V1 line is at most "UNREGISTER <64> <64>"; nsqd never sends more than ~150 bytes.
MAX_LINE_LENGTH = 4096
# nsqd's IDENTIFY body is a few hundred bytes. Go reads whatever size it is told; we refuse big ones.
MAX_IDENTIFY_BODY = 1024 * 1024

# What Go's unicode.IsSpace accepts, hence what strings.TrimSpace removes (Python's str.strip() would
# also remove \x1c-\x1f, which Go keeps).
GO_SPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" \
           "\u2028\u2029\u202f\u205f\u3000"

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def frame(data: bytes) -> bytes:
    """Go's protocol.SendResponse: `[len(data) int32 BE][data]`."""
    return _SIZE.pack(len(data)) + data


def error_data(err: FatalClientError) -> bytes:
    """The bytes Go sends for an error: "E_CODE description", with a peer's raw bytes echoed as they were."""
    return f"{err.code} {err.description}".encode("utf-8", "surrogateescape")


def _text(raw: bytes) -> str:
    # surrogateescape keeps invalid UTF-8 byte-for-byte, as Go's strings do
    return raw.decode("utf-8", "surrogateescape")


def split_line(line: bytes) -> Command:
    """One V1 line (without its newline) as Go's IOLoop sees it: TrimSpace, then split on single spaces."""
    parts = _text(line).strip(GO_SPACE).split(" ")
    encoded = [p.encode("utf-8", "surrogateescape") for p in parts]
    return Command(encoded[0], tuple(encoded[1:]))


# Called when an IDENTIFY line has been read, before its size is: Go refuses a second IDENTIFY there.
IdentifyCheck = Callable[[], None]


def _accept_identify() -> None:
    return None


@attrs.define
class V1Parser:
    """Bytes from a lookupd peer -> Commands (sans-IO). Raises FatalClientError with Go's errors."""

    on_identify: IdentifyCheck = _accept_identify
    max_line_length: int = MAX_LINE_LENGTH
    max_body_size: int = MAX_IDENTIFY_BODY
    _buf: bytearray = attrs.field(factory=bytearray, init=False)
    # IDENTIFY whose line is read: (command, body size or None while the size is not read yet)
    _pending: tuple[Command, int | None] | None = attrs.field(default=None, init=False)

    def feed(self, data: bytes | bytearray) -> None:
        self._buf += data

    def buffered(self) -> int:
        return len(self._buf)

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
            (size,) = _SIZE.unpack_from(buf)
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


# --- IDENTIFY's JSON, decoded as Go's json.Unmarshal into PeerInfo would -----------------------------

_PEER_FIELDS: dict[str, type] = {
    "remote_address": str, "hostname": str, "broadcast_address": str, "tcp_port": int, "http_port": int,
    "version": str, "topology_zone": str, "topology_region": str,
}
_FOLDED = {name.casefold(): name for name in _PEER_FIELDS}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def decode_identify(body: bytes, remote_address: str) -> PeerInfo:
    """IDENTIFY's body -> PeerInfo, with Go's E_BAD_BODY errors.

    As encoding/json: keys match field names case-insensitively, unknown keys and nulls are ignored,
    a wrong type (a string port, a float, a bool) is an error, invalid UTF-8 becomes U+FFFD. The
    remote_address a peer claims is replaced by the real one; all of broadcast_address, tcp_port,
    http_port and version are required.
    """
    try:
        raw = json.loads(body.decode("utf-8", "replace"), parse_constant=_reject_constant)
        values = _peer_values(raw)
    except (ValueError, TypeError):
        raise FatalClientError("E_BAD_BODY", "IDENTIFY failed to decode JSON body") from None
    values["remote_address"] = remote_address
    peer = PeerInfo(id=remote_address, **values)
    if not peer.broadcast_address or not peer.tcp_port or not peer.http_port or not peer.version:
        raise FatalClientError("E_BAD_BODY", "IDENTIFY missing fields")
    return peer


def _peer_values(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise TypeError("IDENTIFY body is not an object")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = key if key in _PEER_FIELDS else _FOLDED.get(key.casefold())
        if name is None or value is None:
            continue
        kind = _PEER_FIELDS[name]
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, int) or not _INT64_MIN <= value <= _INT64_MAX:
                raise TypeError(f"{name} is not an integer")
        elif not isinstance(value, str):
            raise TypeError(f"{name} is not a string")
        values[name] = value
    return values


# --- the protocol --------------------------------------------------------------------------------


@attrs.define(eq=False)
class ClientV1:
    """One peer (an nsqd) connected over V1; `peer` is set by its IDENTIFY."""

    remote_address: str
    peer: PeerInfo | None = None

    def __str__(self) -> str:
        return self.remote_address


@attrs.define(eq=False)
class LookupProtocolV1:
    lookupd: NSQLookupd

    @property
    def db(self):
        return self.lookupd.db

    async def serve(self, stream: trio.abc.Stream, client: ClientV1, initial: bytes = b"") -> None:
        """Go's IOLoop: read commands, answer each; on an error answer it and close. However it ends,
        the peer's registrations are removed."""
        parser = V1Parser(on_identify=lambda: self.check_identify(client))
        parser.feed(initial)
        try:
            while True:
                out = bytearray()
                try:
                    while (cmd := parser.next_command()) is not None:
                        out += frame(self.exec(client, cmd))
                except FatalClientError as err:
                    await self._fail(stream, client, out, err)
                    return
                if out:
                    await stream.send_all(bytes(out))
                data = await stream.receive_some(65536)
                if not data:
                    if (eof_err := parser.eof_error()) is not None:
                        await self._fail(stream, client, bytearray(), eof_err)
                    return
                parser.feed(data)
        finally:
            log.info("PROTOCOL(V1): [%s] exiting ioloop", client)
            self.remove_peer(client)

    async def _fail(self, stream: trio.abc.Stream, client: ClientV1, out: bytearray, err: FatalClientError) -> None:
        log.error("[%s] - %s", client, error_data(err).decode("utf-8", "replace"))
        await stream.send_all(bytes(out) + frame(error_data(err)))

    def remove_peer(self, client: ClientV1) -> None:
        if client.peer is None:
            return
        for key in self.db.lookup_registrations(client.peer.id):
            removed, _ = self.db.remove_producer(key, client.peer.id)
            if removed:
                log.info("DB: client(%s) UNREGISTER category:%s key:%s subkey:%s",
                         client, key.category, key.key, key.subkey)

    def check_identify(self, client: ClientV1) -> None:
        if client.peer is not None:
            raise FatalClientError("E_INVALID", "cannot IDENTIFY again")

    def exec(self, client: ClientV1, cmd: Command) -> bytes:
        """One command -> its response data; raises FatalClientError with Go's code and text."""
        name = cmd.name
        params = [_text(p) for p in cmd.params]
        if name == b"PING":
            return self.ping(client)
        if name == b"IDENTIFY":
            return self.identify(client, cmd.body or b"")
        if name == b"REGISTER":
            return self.register(client, params)
        if name == b"UNREGISTER":
            return self.unregister(client, params)
        raise FatalClientError("E_INVALID", f"invalid command {_text(name)}")

    def ping(self, client: ClientV1) -> bytes:
        if client.peer is not None:
            # a PING may come before IDENTIFY; then there is nothing to refresh
            now = time.monotonic()
            log.info("CLIENT(%s): pinged (last ping %.3fs)", client.peer.id, now - client.peer.last_update)
            client.peer.last_update = now
        return b"OK"

    def identify(self, client: ClientV1, body: bytes) -> bytes:
        self.check_identify(client)
        peer = decode_identify(body, client.remote_address)
        log.info("CLIENT(%s): IDENTIFY Address:%s TCP:%d HTTP:%d Version:%s",
                 client, peer.broadcast_address, peer.tcp_port, peer.http_port, peer.version)
        client.peer = peer
        if self.db.add_producer(Registration("client", "", ""), Producer(peer)):
            log.info("DB: client(%s) REGISTER category:client key: subkey:", client)
        return json.dumps(self.identify_response(), separators=(",", ":")).encode()

    def identify_response(self) -> dict[str, Any]:
        # Go marshals a map: keys sorted
        lookupd = self.lookupd
        return {
            "broadcast_address": lookupd.options.broadcast_address,
            "hostname": socket.gethostname(),
            "http_port": lookupd.http_address[1] if lookupd.http_address else 0,
            "tcp_port": lookupd.tcp_address[1] if lookupd.tcp_address else 0,
            "version": VERSION,
        }

    def register(self, client: ClientV1, params: list[str]) -> bytes:
        if client.peer is None:
            raise FatalClientError("E_INVALID", "client must IDENTIFY")
        topic, channel = topic_channel("REGISTER", params)
        keys = [Registration("channel", topic, channel)] if channel else []
        keys.append(Registration("topic", topic, ""))
        for key in keys:
            if self.db.add_producer(key, Producer(client.peer)):
                log.info("DB: client(%s) REGISTER category:%s key:%s subkey:%s",
                         client, key.category, key.key, key.subkey)
        return b"OK"

    def unregister(self, client: ClientV1, params: list[str]) -> bytes:
        if client.peer is None:
            raise FatalClientError("E_INVALID", "client must IDENTIFY")
        topic, channel = topic_channel("UNREGISTER", params)
        peer_id = client.peer.id
        if channel:
            key = Registration("channel", topic, channel)
            removed, left = self.db.remove_producer(key, peer_id)
            if removed:
                log.info("DB: client(%s) UNREGISTER category:channel key:%s subkey:%s", client, topic, channel)
            # an ephemeral channel goes away with its last producer
            if left == 0 and channel.endswith("#ephemeral"):
                self.db.remove_registration(key)
            return b"OK"
        # a topic unregistration takes the peer's channels of it too (nsqd unregisters those first,
        # hence Go's warning when there were any)
        for key in self.db.find_registrations("channel", topic, "*"):
            removed, _ = self.db.remove_producer(key, peer_id)
            if removed:
                log.warning("client(%s) unexpected UNREGISTER category:channel key:%s subkey:%s",
                            client, topic, key.subkey)
        key = Registration("topic", topic, "")
        removed, left = self.db.remove_producer(key, peer_id)
        if removed:
            log.info("DB: client(%s) UNREGISTER category:topic key:%s subkey:", client, topic)
        if left == 0 and topic.endswith("#ephemeral"):
            self.db.remove_registration(key)
        return b"OK"


def topic_channel(command: str, params: list[str]) -> tuple[str, str]:
    """Go's getTopicChan: the topic and the optional channel of REGISTER/UNREGISTER, validated."""
    if not params:
        raise FatalClientError("E_INVALID", f"{command} insufficient number of params")
    topic = params[0]
    channel = params[1] if len(params) >= 2 else ""
    if not is_valid_topic_name(topic):
        raise FatalClientError("E_BAD_TOPIC", f"{command} topic name '{topic}' is not valid")
    if channel and not is_valid_channel_name(channel):
        raise FatalClientError("E_BAD_CHANNEL", f"{command} channel name '{channel}' is not valid")
    return topic, channel
