"""nsqlookupd's TCP protocol V1 (nsqlookupd/lookup_protocol_v1.go): IDENTIFY, REGISTER, UNREGISTER, PING.

Command parsing is the sans-IO CommandParser of shared.protocol; this module decides what each command
does to the RegistrationDB, and answers `[size int32 BE][data]`. Every error is fatal, as in Go, and is
sent as a plain response carrying "E_CODE description".
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import time
from typing import TYPE_CHECKING

import trio

from lookupd.registration_db import PeerInfo, Producer, Registration
from shared.names import is_valid_channel_name, is_valid_topic_name
from shared.protocol import Command, CommandParser, FatalClientError
from shared.version import VERSION

if TYPE_CHECKING:
    from lookupd.nsqlookupd import NSQLookupd

log = logging.getLogger("nsqlookupd")

_SIZE = struct.Struct(">i")
MAX_IDENTIFY_BODY = 1024 * 1024


def frame(data: bytes) -> bytes:
    return _SIZE.pack(len(data)) + data


def _check_body(name: bytes, params: tuple[bytes, ...], size: int | None) -> None:
    if name != b"IDENTIFY":
        raise FatalClientError("E_INVALID", f"invalid command {name.decode(errors='replace')}")
    if size is not None and not 0 < size <= MAX_IDENTIFY_BODY:
        raise FatalClientError("E_BAD_BODY", f"IDENTIFY invalid body size {size}")


class ClientV1:
    def __init__(self, remote_address: str) -> None:
        self.remote_address = remote_address
        self.peer: PeerInfo | None = None

    def __repr__(self) -> str:
        return self.remote_address


class LookupProtocolV1:
    def __init__(self, lookupd: NSQLookupd) -> None:
        self.lookupd = lookupd
        self.db = lookupd.db

    async def serve(self, stream: trio.abc.Stream, client: ClientV1, initial: bytes = b"") -> None:
        parser = CommandParser(_check_body, max_line_length=4096)
        parser.feed(initial)
        try:
            while True:
                out = bytearray()
                try:
                    while (cmd := parser.next_command()) is not None:
                        out += frame(self.exec(client, cmd))
                except FatalClientError as err:
                    log.error("[%s] - %s", client, err)
                    await stream.send_all(bytes(out) + frame(err.frame_data()))
                    return
                if out:
                    await stream.send_all(bytes(out))
                data = await stream.receive_some(65536)
                if not data:
                    return
                parser.feed(data)
        finally:
            log.info("PROTOCOL(V1): [%s] exiting ioloop", client)
            self.remove_peer(client)

    def remove_peer(self, client: ClientV1) -> None:
        if client.peer is None:
            return
        for key in self.db.lookup_registrations(client.peer.id):
            removed, _ = self.db.remove_producer(key, client.peer.id)
            if removed:
                log.info("DB: client(%s) UNREGISTER category:%s key:%s subkey:%s",
                         client, key.category, key.key, key.subkey)

    def exec(self, client: ClientV1, cmd: Command) -> bytes:
        # Go trims the line with TrimSpace: a trailing space or tab is not a parameter
        params = [p.decode(errors="replace") for p in cmd.params]
        while params and not params[-1].strip():
            params.pop()
        name = cmd.name.decode(errors="replace").strip()
        if name == "PING":
            return self.ping(client)
        if name == "IDENTIFY":
            return self.identify(client, cmd.body or b"")
        if name == "REGISTER":
            return self.register(client, params)
        if name == "UNREGISTER":
            return self.unregister(client, params)
        raise FatalClientError("E_INVALID", f"invalid command {name}")

    def ping(self, client: ClientV1) -> bytes:
        if client.peer is not None:
            client.peer.last_update = time.monotonic()
        return b"OK"

    def identify(self, client: ClientV1, body: bytes) -> bytes:
        if client.peer is not None:
            raise FatalClientError("E_INVALID", "cannot IDENTIFY again")
        try:
            raw = json.loads(body)
            if not isinstance(raw, dict):
                raise ValueError("not an object")
            peer = PeerInfo(
                id=client.remote_address,
                remote_address=client.remote_address,
                hostname=str(raw.get("hostname", "")),
                broadcast_address=str(raw.get("broadcast_address", "")),
                tcp_port=int(raw.get("tcp_port", 0)),
                http_port=int(raw.get("http_port", 0)),
                version=str(raw.get("version", "")),
                topology_zone=str(raw.get("topology_zone", "")),
                topology_region=str(raw.get("topology_region", "")),
            )
        except (ValueError, TypeError, UnicodeDecodeError):
            raise FatalClientError("E_BAD_BODY", "IDENTIFY failed to decode JSON body") from None
        if not peer.broadcast_address or not peer.tcp_port or not peer.http_port or not peer.version:
            raise FatalClientError("E_BAD_BODY", "IDENTIFY missing fields")
        log.info("CLIENT(%s): IDENTIFY Address:%s TCP:%d HTTP:%d Version:%s",
                 client, peer.broadcast_address, peer.tcp_port, peer.http_port, peer.version)
        client.peer = peer
        if self.db.add_producer(Registration("client", "", ""), Producer(peer)):
            log.info("DB: client(%s) REGISTER category:client key: subkey:", client)
        lookupd = self.lookupd
        return json.dumps({
            "tcp_port": lookupd.tcp_address[1] if lookupd.tcp_address else 0,
            "http_port": lookupd.http_address[1] if lookupd.http_address else 0,
            "version": VERSION,
            "broadcast_address": lookupd.options.broadcast_address,
            "hostname": socket.gethostname(),
        }).encode()

    def _topic_channel(self, command: str, params: list[str]) -> tuple[str, str]:
        if not params:
            raise FatalClientError("E_INVALID", f"{command} insufficient number of params")
        topic = params[0]
        channel = params[1] if len(params) >= 2 else ""
        if not is_valid_topic_name(topic):
            raise FatalClientError("E_BAD_TOPIC", f"{command} topic name '{topic}' is not valid")
        if channel and not is_valid_channel_name(channel):
            raise FatalClientError("E_BAD_CHANNEL", f"{command} channel name '{channel}' is not valid")
        return topic, channel

    def register(self, client: ClientV1, params: list[str]) -> bytes:
        if client.peer is None:
            raise FatalClientError("E_INVALID", "client must IDENTIFY")
        topic, channel = self._topic_channel("REGISTER", params)
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
        topic, channel = self._topic_channel("UNREGISTER", params)
        peer_id = client.peer.id
        if channel:
            key = Registration("channel", topic, channel)
            removed, left = self.db.remove_producer(key, peer_id)
            if removed:
                log.info("DB: client(%s) UNREGISTER category:channel key:%s subkey:%s", client, topic, channel)
            if left == 0 and channel.endswith("#ephemeral"):
                self.db.remove_registration(key)
        else:
            # a topic going away takes its channels with it
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
