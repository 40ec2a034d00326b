"""lookup_loop: keep every nsqlookupd told which topics and channels this broker has (nsqd/lookup.go).

One LookupPeer task per --lookupd-tcp-address: connect, IDENTIFY, REGISTER everything, then send
REGISTER/UNREGISTER as topics and channels come and go and PING every 15 s; on any failure it
reconnects with backoff and registers everything again (lookupd forgets a peer that disconnects).
The bytes are shared/lookup_protocol.py's; this module does the I/O and decides what to send.
"""

from __future__ import annotations

import json
import logging
import socket
from typing import TYPE_CHECKING, cast

import trio

from trio_nsq.shared.http import httpx_module, split_host_port
from trio_nsq.shared.lookup_protocol import (
    MAGIC_V1, PING_CMD, ResponseParser, identify_cmd, is_error, register_cmd, unregister_cmd,
)
from trio_nsq.shared.version import VERSION

if TYPE_CHECKING:
    from trio_nsq.broker.channel import Channel
    from trio_nsq.broker.nsqd import NSQD
    from trio_nsq.broker.topic import Topic

log = logging.getLogger("nsqd")

PING_INTERVAL = 15.0
CONNECT_TIMEOUT = 2.0
RESPONSE_TIMEOUT = 5.0
BACKOFF_MAX = 15.0
INBOX_SIZE = 4096


class LookupdError(Exception):
    """lookupd answered an error or the conversation broke; the peer reconnects."""


class LookupPeer:
    def __init__(self, nsqd: NSQD, address: str) -> None:
        self.nsqd = nsqd
        self.address = address
        self.info: dict = {}
        self.connected = False
        self._send, self._recv = trio.open_memory_channel[bytes](INBOX_SIZE)
        # set when the inbox overflowed: the next session re-registers everything instead
        self._resync = False
        self.scope = trio.CancelScope()

    def __repr__(self) -> str:
        return self.address

    def notify(self, command: bytes) -> None:
        if not self.connected:
            return  # the next session registers the whole current state anyway
        try:
            self._send.send_nowait(command)
        except trio.WouldBlock:
            self._resync = True

    async def run(self) -> None:
        with self.scope:
            backoff = 1.0
            while True:
                try:
                    await self._session()
                except* (OSError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError,
                         LookupdError, ValueError) as group:
                    exc = group.exceptions[0]
                    log.error("LOOKUPD(%s): %s", self.address, exc or type(exc).__name__)
                finally:
                    if self.connected:
                        backoff = 0.5  # a working session ended: retry soon, then back off again
                    self.connected = False
                await trio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)

    async def _session(self) -> None:
        host, port = split_host_port(self.address, default_host="127.0.0.1")
        with trio.fail_after(CONNECT_TIMEOUT):
            stream = await trio.open_tcp_stream(host, port)
        # lookupd answers each command before the next is sent; one parser for the connection keeps
        # whatever a read brought beyond the answer it was waiting for
        responses = ResponseParser(self.nsqd.options.max_body_size)
        async with stream:
            await stream.send_all(MAGIC_V1)
            identify = {
                "version": VERSION,
                "tcp_port": self.nsqd.broadcast_tcp_port,
                "http_port": self.nsqd.broadcast_http_port,
                "hostname": socket.gethostname(),
                "broadcast_address": self.nsqd.options.broadcast_address,
            }
            response = await self._command(stream, responses, identify_cmd(identify))
            try:
                self.info = json.loads(response)
            except ValueError:
                raise LookupdError(f"parsing response - {response!r}") from None
            log.info("LOOKUPD(%s): peer info %s", self.address, self.info)
            # state snapshot and inbox drain happen with no await between, so nothing is missed
            self.connected = True
            self._resync = False
            while True:
                try:
                    self._recv.receive_nowait()
                except trio.WouldBlock:
                    break
            for command in self.nsqd.registration_commands():
                log.info("LOOKUPD(%s): %s", self.address, command.decode().strip())
                await self._command(stream, responses, command)
            next_ping = trio.current_time() + PING_INTERVAL
            while True:
                if self._resync:
                    raise LookupdError("notification backlog overflowed, re-registering")
                if responses.buffered():
                    raise LookupdError("unexpected data from lookupd")
                notification = await self._next_command(stream, next_ping)
                if notification is None:
                    command = PING_CMD
                    next_ping = trio.current_time() + PING_INTERVAL
                else:
                    command = notification
                    log.info("LOOKUPD(%s): %s", self.address, command.decode().strip())
                await self._command(stream, responses, command)

    async def _next_command(self, stream: trio.abc.Stream, deadline: float) -> bytes | None:
        """The next notification, or None when it is time to PING. lookupd never speaks unasked, so
        the stream is watched meanwhile: a lookupd that goes away is noticed at once, not at the PING."""
        command = None
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                data = await stream.receive_some(1)
                raise LookupdError("lookupd closed the connection" if not data else "unexpected data from lookupd")

            nursery.start_soon(watch)
            with trio.move_on_at(deadline):
                command = await self._recv.receive()
            nursery.cancel_scope.cancel()
        return command

    async def _command(self, stream: trio.abc.Stream, responses: ResponseParser, command: bytes) -> bytes:
        await stream.send_all(command)
        with trio.fail_after(RESPONSE_TIMEOUT):
            while (data := responses.next_response()) is None:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    raise trio.BrokenResourceError("lookupd closed the connection")
                responses.feed(chunk)
        if is_error(data):
            # lookupd refused this one command (e.g. E_BAD_TOPIC); log it and go on
            log.error("LOOKUPD(%s): %s - %s", self.address, command.decode(errors="replace").strip(),
                      data.decode(errors="replace"))
            if data == b"E_INVALID" and command.startswith(b"IDENTIFY"):
                raise LookupdError("lookupd returned E_INVALID")
        return data


class LookupManager:
    """Owns the peer tasks; the peer set can change at run time (PUT /config/nsqlookupd_tcp_addresses)."""

    def __init__(self, nsqd: NSQD) -> None:
        self.nsqd = nsqd
        self.peers: dict[str, LookupPeer] = {}
        self._nursery: trio.Nursery | None = None
        self._httpx_loading = False
        nsqd.notify_hooks.append(self._on_change)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.set_addresses(self.nsqd.options.nsqlookupd_tcp_addresses)
            task_status.started()
            await trio.sleep_forever()

    def set_addresses(self, addresses: list[str]) -> None:
        assert self._nursery is not None
        wanted = list(dict.fromkeys(addresses))
        for address in list(self.peers):
            if address not in wanted:
                log.info("LOOKUP(%s): removing peer", address)
                self.peers.pop(address).scope.cancel()
        if wanted and not self._httpx_loading:
            # loaded now, in a thread, for topic_channels: a topic created soon after start-up would
            # otherwise wait for the import before asking, and what it asks would be that much older
            self._httpx_loading = True
            self._nursery.start_soon(httpx_module)
        for address in wanted:
            if address not in self.peers:
                log.info("LOOKUP(%s): adding peer", address)
                peer = LookupPeer(self.nsqd, address)
                self.peers[address] = peer
                self._nursery.start_soon(peer.run)

    def http_addresses(self) -> list[str]:
        """lookupd HTTP addresses learnt from IDENTIFY answers (nsqd's lookupdHTTPAddrs)."""
        out = []
        for peer in self.peers.values():
            address = peer.info.get("broadcast_address")
            if address:
                out.append(f"{address}:{peer.info.get('http_port')}")
        return out

    async def topic_channels(self, topic: str) -> list[str]:
        """The channels every lookupd knows for `topic` (nsqd's GetLookupdTopicChannels), for a topic
        created here; a lookupd that fails is logged and skipped."""
        addresses = self.http_addresses()
        if not addresses:
            if self.peers:
                log.error("no available nsqlookupd to query for channels to pre-create for topic %s", topic)
            return []
        opts = self.nsqd.options
        httpx = await httpx_module()
        timeout = httpx.Timeout(opts.http_client_request_timeout, connect=opts.http_client_connect_timeout)
        names: dict[str, None] = {}
        async with httpx.AsyncClient(timeout=timeout) as client:
            for address in addresses:
                try:
                    resp = await client.get(f"http://{address}/channels", params={"topic": topic})
                    resp.raise_for_status()
                    names.update(dict.fromkeys(resp.json().get("channels") or []))
                except (httpx.HTTPError, ValueError, AttributeError) as exc:
                    log.warning("failed to query nsqlookupd for channels to pre-create for topic %s - %s", topic, exc)
        return [name for name in names if isinstance(name, str)]

    def _on_change(self, kind: str, obj: Topic | Channel, created: bool) -> None:
        if kind == "channel":
            topic, channel = cast("Channel", obj).topic_name, obj.name
        else:
            topic, channel = obj.name, ""
        replication = self.nsqd.replication
        if replication is not None and not replication.registers(topic):
            return  # cluster mode: only the topic's leader tells the lookupds (announce)
        command = register_cmd(topic, channel) if created else unregister_cmd(topic, channel)
        for peer in self.peers.values():
            peer.notify(command)

    def announce(self, topic: Topic, registered: bool) -> None:
        """Cluster mode: this broker began (or stopped) leading `topic`: the lookupds are told of it and its
        channels (or that they are gone from here), so consumers find the leader."""
        channels = [name for name in topic.channels if not topic.channels[name].ephemeral]
        if registered:
            commands = [register_cmd(topic.name)] + [register_cmd(topic.name, name) for name in channels]
        else:
            commands = [unregister_cmd(topic.name, name) for name in channels] + [unregister_cmd(topic.name)]
        for peer in self.peers.values():
            for command in commands:
                peer.notify(command)
