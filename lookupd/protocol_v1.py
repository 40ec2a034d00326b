"""nsqlookupd's TCP protocol V1 (nsqlookupd/lookup_protocol_v1.go): IDENTIFY, REGISTER, UNREGISTER, PING.

The wire is shared/lookup_protocol.py's (sans-IO: `V1Parser` turns bytes into `Command`s, `frame` and
`error_data` make the responses); this module is what nsqlookupd does with them:

- `LookupProtocolV1.exec` applies one command to the RegistrationDB and returns the response bytes;
  `decode_identify` reads IDENTIFY's JSON as Go's json.Unmarshal would;
- `serve` is the only part that touches a socket.

Every V1 error is a FatalClientErr in Go: it is sent, then the connection closes, and (as on any exit
of Go's IOLoop) the peer's registrations go with it.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from typing import TYPE_CHECKING, Any

import attrs
import trio

from trio_nsq.lookupd.registration_db import PeerInfo, Producer, Registration
from trio_nsq.shared.lookup_protocol import V1Parser, decode_param, error_data, frame
from trio_nsq.shared.names import is_valid_channel_name, is_valid_topic_name
from trio_nsq.shared.protocol import Command, FatalClientError
from trio_nsq.shared.version import VERSION

if TYPE_CHECKING:
    from trio_nsq.lookupd.nsqlookupd import NSQLookupd

log = logging.getLogger("nsqlookupd")


# --- IDENTIFY's JSON, decoded as Go's json.Unmarshal into PeerInfo would -----------------------------

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
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
        params = [decode_param(p) for p in cmd.params]
        if name == b"PING":
            return self.ping(client)
        if name == b"IDENTIFY":
            return self.identify(client, cmd.body or b"")
        if name == b"REGISTER":
            return self.register(client, params)
        if name == b"UNREGISTER":
            return self.unregister(client, params)
        raise FatalClientError("E_INVALID", f"invalid command {decode_param(name)}")

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
