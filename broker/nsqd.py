"""NSQD: the broker. Owns the root nursery and every long-lived task (nsqd/nsqd.go)."""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import logging
import os
import select
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import trio

from trio_nsq.broker.channel import Channel
from trio_nsq.broker.client_v2 import ClientV2
from trio_nsq.broker.storage.data_dir import DataDir
from trio_nsq.broker.storage.files import write_synced
from trio_nsq.broker.lookup import LookupManager
from trio_nsq.broker.options import Options
from trio_nsq.broker.v2_poller import V2Poller
from trio_nsq.broker.protocol_v2 import ProtocolV2
from trio_nsq.broker.queue_scan import queue_scan_loop
from trio_nsq.broker.queue_settings import QueueSettings
from trio_nsq.broker.statsd import statsd_loop
from trio_nsq.broker.tls import build_server_context, tls_required, tls_required_http
from trio_nsq.broker.topic import Topic
from trio_nsq.shared.http import address_text, is_unix_address, open_unix_listener, split_host_port
from trio_nsq.shared.lookup_protocol import register_cmd
from trio_nsq.shared.names import is_ephemeral, is_valid_channel_name, is_valid_topic_name
from trio_nsq.shared.protocol import FRAME_TYPE_ERROR, MAGIC_V2, encode_frame
from trio_nsq.shared.service import error_text
from trio_nsq.shared.tcp import serve_connection
from trio_nsq.shared.version import VERSION

log = logging.getLogger("nsqd")

METADATA_FILE = "nsqd.dat"
# topics closing at once at a clean exit
CLOSING_AT_ONCE = 32


class NSQD:
    """The broker (nsqd's NSQD): topics by name, connected clients, metadata, and the tasks of the
    whole process. `run` (called by trio-nsqd, or embed's run_nsqd) owns one nursery holding: each
    Topic's `run`, the HTTP server, the TCP accept loop (one ProtocolV2.serve task per connection), the
    V2Poller (which serves producers' connections between their commands), the lookup_loop, the queue_scan_loop, the metadata persist loop and statsd. Protocol and HTTP tasks call
    get_topic/delete_topic and persist_metadata; Topics call back through TopicOwner. On cancellation
    `_exit` writes what memory holds to disk and closes every queue."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.data_path = options.data_path or os.getcwd()
        self.clock = time.time  # deadlines kept across a restart are unix seconds
        self.topics: dict[str, Topic] = {}
        self.clients: dict[int, ClientV2] = {}
        self._client_seq = 0
        self.protocol = ProtocolV2(self)
        self.v2_poller: V2Poller | None = None  # made by run()
        self.tcp_address: tuple[str, int] | None = None
        self.http_address: tuple[str, int] | None = None
        self.start_time = 0  # unix seconds, set in run()
        # bumped whenever a channel comes or goes, so the queue scan refreshes its list early
        self.channels_generation = 0
        self.health_error: str | None = None
        self._nursery: trio.Nursery | None = None
        # nsqd.dat: changes counted, what the last write covered, each topic's entry kept as JSON (a write
        # makes again only the entries of topics that changed: ten thousand topics are not dumped per
        # creation), the writer woken by `_meta_wake`, callers waiting for a write woken by `_meta_written`
        self._meta_changes = 0
        self._meta_covered = 0
        self._meta_failed = 0  # changes a failed write covered (retried by the next)
        self._meta_entries: dict[str, bytes] = {}
        self._meta_stale: set[str] = set()
        self._meta_wake = trio.Event()
        self._meta_written = trio.Event()
        self._metadata_lock = trio.Lock()  # one nsqd.dat write at a time
        self._lock_fd: int | None = None
        self._unix_paths: list[str] = []
        self._loading = False
        # the data directory, listed once at start; topics take their names from it
        self.data_dir = DataDir([])
        # topics nsqd.dat names that are not open yet (in its order): opened in the background once the
        # broker listens, or at once when something asks for one; `loaded` is set when none is left
        self._pending: dict[str, dict[str, Any]] = {}
        self.loaded = trio.Event()
        # lookup_loop subscribes here to hear of topics/channels coming and going
        self.notify_hooks: list[Callable[[str, Topic | Channel, bool], None]] = []
        self.lookup = LookupManager(self)
        try:
            options.check()
        except ValueError as exc:
            raise RuntimeError(f"failed to instantiate nsqd - {exc}") from None
        self.tls_context = build_server_context(options)
        self.tls_required = tls_required(options)
        self.tls_required_http = tls_required_http(options)
        self.auth_enabled = bool(options.auth_http_addresses)

    # --- life ---------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; task_status.started() once the TCP listener is bound."""
        self.start_time = int(time.time())
        self._lock_data_path()
        try:
            self.load_metadata()
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for topic in self.topics.values():
                    nursery.start_soon(topic.run)
                if hasattr(select, "epoll"):  # Linux: producers are served in place between commands
                    self.v2_poller = poller = V2Poller(self.protocol)
                    nursery.start_soon(poller.run)
                    nursery.start_soon(poller.expire_loop)
                # HTTP first: once TCP accepts connections, the whole broker is up (logged in nsqd's order)
                await self._start_http(nursery)
                log.info("TCP: listening on %s", address_text(*await self._start_tcp(nursery)))
                if self.http_address is not None:
                    log.info("HTTP: listening on %s", address_text(*self.http_address))
                await nursery.start(self.lookup.run)
                nursery.start_soon(queue_scan_loop, self)
                nursery.start_soon(self._persist_loop)
                nursery.start_soon(self._open_pending_topics)
                if self.options.statsd_address:
                    nursery.start_soon(statsd_loop, self)
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                await self._exit()
            for path in self._unix_paths:  # as Go's unix listener does on close
                try:
                    os.unlink(path)
                except OSError:
                    pass
            self._unlock_data_path()

    async def _exit(self) -> None:
        """Clean shutdown (nsqd's Exit): metadata, then every topic writes what its memory holds to disk
        and persists it in a last sync round. Runs after every task has been cancelled."""
        log.info("NSQ: closing topics")
        try:
            self.write_metadata_now()
        except OSError as exc:
            log.error("failed to persist metadata - %s", exc)
        # topics close side by side, a few at a time: each waits for its last round's fsyncs, and ten
        # thousand of them one after the other kept a clean exit (and so a restart) for minutes
        limiter = trio.CapacityLimiter(CLOSING_AT_ONCE)

        async def close(topic: Topic) -> None:
            async with limiter:
                await topic.close()
        async with trio.open_nursery() as nursery:
            for topic in list(self.topics.values()):
                nursery.start_soon(close, topic)

    async def _start_http(self, nursery: trio.Nursery) -> None:
        """HTTP (and HTTPS) unless --http-address is empty, which turns it off as in nsqd."""
        from trio_nsq.broker.http.serve import serve_http  # imported here: the HTTP API imports this module

        if not self.options.http_address:
            return
        try:
            self.http_address = await nursery.start(serve_http, self)
            if is_unix_address(self.options.http_address):
                self._unix_paths.append(self.options.http_address)
        except* OSError as group:
            raise RuntimeError(f"listen ({self.options.http_address}) failed - {error_text(group)}") from None

    async def _start_tcp(self, nursery: trio.Nursery) -> tuple[str, int]:
        """The TCP listener: host:port, or a path for a unix socket (as nsqd takes --tcp-address)."""
        address = self.options.tcp_address
        try:
            if is_unix_address(address):
                listeners = [await open_unix_listener(address)]
                nursery.start_soon(trio.serve_listeners, self._handle_tcp, listeners)
                self.tcp_address = (address, 0)
                self._unix_paths.append(address)
                return self.tcp_address
            host, port = split_host_port(address)
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, self._handle_tcp, port, host=host or None)
            )
        except* OSError as group:  # trio.serve_tcp raises it inside a group
            raise RuntimeError(f"listen ({address}) failed - {error_text(group)}") from None
        sockname = listeners[0].socket.getsockname()
        self.tcp_address = (sockname[0], sockname[1])
        return self.tcp_address

    @property
    def broadcast_tcp_port(self) -> int:
        return self.options.broadcast_tcp_port or (self.tcp_address[1] if self.tcp_address else 0)

    @property
    def broadcast_http_port(self) -> int:
        return self.options.broadcast_http_port or (self.http_address[1] if self.http_address else 0)

    def registration_commands(self) -> list[bytes]:
        """What a lookupd must be told of after (re)connecting: each channel, or the bare topic."""
        commands = []
        for topic in self.topics.values():
            if not topic.channels:
                commands.append(register_cmd(topic.name))
            for channel in topic.channels.values():
                commands.append(register_cmd(topic.name, channel.name))
        for name, entry in list(self._pending.items()):  # known from nsqd.dat, not open yet
            channels = [c["name"] for c in _valid(entry.get("channels") or (), is_valid_channel_name, "channel")
                        if not is_ephemeral(c["name"])]
            commands.extend(register_cmd(name, channel) for channel in channels)
            if not channels:
                commands.append(register_cmd(name))
        return commands

    def set_health(self, error: str | None) -> None:
        """nsqd's SetHealth: a backend's failed write or fsync makes /ping answer 500 `NOK - <error>` (and
        /stats say so) until a write succeeds again."""
        self.health_error = error

    def set_lookupd_addresses(self, addresses: list[str]) -> None:
        self.options.nsqlookupd_tcp_addresses = list(addresses)
        self.lookup.set_addresses(self.options.nsqlookupd_tcp_addresses)

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run fn in the broker's nursery (work that outlives the caller, e.g. closing a client)."""
        assert self._nursery is not None
        self._nursery.start_soon(fn, *args)

    # --- TCP ----------------------------------------------------------------------------------

    async def _handle_tcp(self, stream: trio.SocketStream) -> None:
        await serve_connection(
            stream, magic=MAGIC_V2, bad_magic_reply=encode_frame(FRAME_TYPE_ERROR, b"E_BAD_PROTOCOL"),
            magic_timeout=self.options.client_timeout, handler=self._serve_v2, log=log,
        )

    async def _serve_v2(self, stream: trio.SocketStream, remote: str) -> None:
        self._client_seq += 1
        client = ClientV2(self._client_seq, stream, remote, self)
        self.clients[client.id] = client
        await self.protocol.serve(client)

    def remove_client(self, client: ClientV2) -> None:
        self.clients.pop(client.id, None)

    # --- topics -------------------------------------------------------------------------------

    def get_topic(self, name: str) -> Topic:
        topic = self.topics.get(name)
        if topic is not None:
            return topic
        entry = self._pending.pop(name, None)
        if entry is not None:
            return self._open_from_metadata(entry)
        topic = Topic(self, name, self.data_dir.take(name))
        self.topics[name] = topic
        log.info("TOPIC(%s): created", name)
        if not self._loading:
            topic.channels_from_lookupd = self.lookup.topic_channels
        if self._nursery is not None:
            self._nursery.start_soon(topic.run)
        self._notify(topic, True)
        return topic

    def get_existing_topic(self, name: str) -> Topic | None:
        topic = self.topics.get(name)
        if topic is None and name in self._pending:
            return self.get_topic(name)
        return topic

    def delete_topic(self, name: str) -> None:
        if name in self._pending:
            self.get_topic(name)
        topic = self.topics.pop(name)  # KeyError(name) for a topic there is not
        log.info("TOPIC(%s): deleting", name)
        topic.exit()
        for channel_name in list(topic.channels):
            topic.delete_channel(channel_name)
        topic.cancel()
        topic.delete()  # the files are gone before the caller answers, as in nsqd
        self._notify(topic, False)

    def notify_channel(self, channel: Channel, created: bool) -> None:
        self.channels_generation += 1
        self._notify(channel, created)

    def all_channels(self) -> list[Channel]:
        return [ch for topic in self.topics.values() for ch in topic.channels.values()]

    def _notify(self, obj: Topic | Channel, created: bool) -> None:
        if self._loading:
            return
        for hook in self.notify_hooks:
            hook("topic" if isinstance(obj, Topic) else "channel", obj, created)
        if not obj.ephemeral and not (isinstance(obj, Channel) and obj.topic.ephemeral):
            self.persist_metadata(obj.name if isinstance(obj, Topic) else obj.topic_name)

    # --- metadata (nsqd.dat) ------------------------------------------------------------------

    def metadata(self) -> dict[str, Any]:
        """nsqd.dat as Go nsqd writes it: its key order, and null for no topics or no channels (a Go
        nil slice), so the file is byte for byte what nsqd 1.3.0 writes for the same topics."""
        return json.loads(self._metadata_bytes())

    @staticmethod
    def _topic_entry(topic: Topic) -> dict[str, Any]:
        channels = [
            _with_settings({"name": ch.name, "paused": ch.paused}, ch.settings)
            for ch in topic.channels.values() if not ch.ephemeral
        ]
        entry = {"name": topic.name, "paused": topic.paused, "channels": channels or None}
        return _with_settings(entry, topic.settings)

    def _metadata_bytes(self) -> bytes:
        """nsqd.dat's bytes: each topic's entry made again only if it changed since the last call."""
        entries = self._meta_entries
        stale = self._meta_stale
        for name in stale:
            entries.pop(name, None)
        stale.clear()
        parts: list[bytes] = []
        for topic in self.topics.values():
            if topic.ephemeral:
                continue
            entry = entries.get(topic.name)
            if entry is None:
                entry = entries[topic.name] = _json(self._topic_entry(topic))
            parts.append(entry)
        parts.extend(map(_json, self._pending.values()))  # as nsqd.dat had them: not open yet
        topics = b"[" + b",".join(parts) + b"]" if parts else b"null"
        return b'{"topics":' + topics + b',"version":' + _json(VERSION) + b"}"

    def persist_metadata(self, topic: str | None = None) -> None:
        """nsqd.dat is to be written again (`topic` changed; None: any may have): the writer does it,
        one write covering every change made before it began."""
        if topic is None:
            self._meta_entries.clear()
        else:
            self._meta_stale.add(topic)
        self._meta_changes += 1
        self._meta_wake.set()

    async def metadata_persisted(self) -> None:
        """Return once a write begun after this call's changes has put nsqd.dat on disk (group commit:
        creations arriving together share one write). Raises OSError if the write covering them failed."""
        target = self._meta_changes
        while self._meta_covered < target:
            if self._meta_failed >= target:
                raise OSError("failed to persist metadata")
            await self._meta_written.wait()

    async def _persist_loop(self) -> None:
        while True:
            if self._meta_covered >= self._meta_changes:
                await self._meta_wake.wait()
                self._meta_wake = trio.Event()
                continue
            try:
                await self.persist_metadata_now()
            except OSError as exc:
                log.error("failed to persist metadata - %s", exc)
                await trio.sleep(1.0)  # the disk is failing: again in a moment, not in a loop

    async def persist_metadata_now(self) -> None:
        """Write nsqd.dat now and return once it is on disk (a settings change is answered after it);
        one write at a time, as they share a temporary file name. Raises OSError."""
        async with self._metadata_lock:
            covers = self._meta_changes
            try:
                await trio.to_thread.run_sync(self._write_metadata, self._metadata_bytes())
            except OSError:
                self._meta_failed = max(self._meta_failed, covers)
                raise
            finally:
                written, self._meta_written = self._meta_written, trio.Event()
                written.set()
            self._meta_covered = max(self._meta_covered, covers)

    def write_metadata_now(self) -> None:
        self._write_metadata(self._metadata_bytes())

    def _write_metadata(self, data: bytes) -> None:
        path = os.path.join(self.data_path, METADATA_FILE)
        tmp = f"{path}.{os.getpid()}.tmp"
        write_synced(tmp, data)  # 0600, as Go nsqd's writeSyncFile
        os.replace(tmp, path)

    def load_metadata(self) -> None:
        """nsqd.dat read and the data directory listed, once. The topics nsqd.dat names are opened once
        the broker listens (_open_pending_topics), or at once when something asks for one first."""
        self.data_dir = DataDir.read(self.data_path)
        path = os.path.join(self.data_path, METADATA_FILE)
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except FileNotFoundError:
            self.loaded.set()
            return
        try:
            topics = _parse_metadata(raw)
        except ValueError as exc:
            raise RuntimeError(f"failed to parse metadata in {path} - {exc}") from None
        for t in _valid(topics, is_valid_topic_name, "topic"):
            self._pending.setdefault(t["name"], t)
        if not self._pending:
            self.loaded.set()

    def _open_from_metadata(self, t: dict[str, Any]) -> Topic:
        """A topic nsqd.dat names, with its channels, pauses and settings as it says (nothing told to the
        lookupds, nothing written: they know it already)."""
        name = t["name"]
        loading, self._loading = self._loading, True
        try:
            topic = Topic(self, name, self.data_dir.take(name))
            self.topics[name] = topic
            topic.paused = bool(t.get("paused"))
            for c in _valid(t.get("channels") or (), is_valid_channel_name, "channel"):
                channel = topic.get_channel(c["name"])
                channel.paused = bool(c.get("paused"))
                if "config" in c:
                    channel.settings = QueueSettings.from_json(c["config"])
            configured = "config" in t or any("config" in c for c in t.get("channels") or ())
            if configured:
                topic.settings = QueueSettings.from_json(t.get("config"))
        finally:
            self._loading = loading
        if configured:
            topic.apply_settings()  # a dead-letter topic it makes now is told of and written as new
        if self._nursery is not None:
            self._nursery.start_soon(topic.run)
        if not self._pending:
            self.loaded.set()
        return topic

    async def _open_pending_topics(self) -> None:
        """The topics nsqd.dat names, opened one at a time between the event loop's other work (the
        broker answers meanwhile: what asks for a topic opens it first; what needs them all, /stats,
        waits for `loaded`)."""
        while self._pending:
            self.get_topic(next(iter(self._pending)))
            await trio.lowlevel.checkpoint()
        self.loaded.set()

    # --- data directory lock ------------------------------------------------------------------

    def _lock_data_path(self) -> None:
        """Two brokers must not share a data directory (nsqd's dirlock)."""
        try:
            fd = os.open(self.data_path, os.O_RDONLY)
        except OSError as exc:
            raise RuntimeError(f"--data-path={self.data_path} is not usable - {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RuntimeError(
                    f"--data-path={self.data_path} in use (possibly by another instance of nsqd)"
                ) from exc
            raise
        self._lock_fd = fd

    def _unlock_data_path(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _json(value: Any) -> bytes:
    """JSON as Go's encoding/json writes it here (compact; the keys in the order given)."""
    return json.dumps(value, separators=(",", ":")).encode()


def _with_settings(entry: dict[str, Any], settings: QueueSettings) -> dict[str, Any]:
    """A topic's or channel's nsqd.dat entry, with what was set on it under "config" (not in nsqd, which
    ignores the key; nothing is added where nothing is set, so the file stays Go's byte for byte)."""
    if not settings.is_empty():
        entry["config"] = settings.to_json()
    return entry


def _valid(entries: Any, is_valid: Callable[[str], bool], kind: str) -> Iterator[dict[str, Any]]:
    """The nsqd.dat entries with a valid name; nsqd skips the others with a warning."""
    for entry in entries:
        name = entry.setdefault("name", "")
        if is_valid(name):
            yield entry
        else:
            log.warning("skipping creation of invalid %s %s", kind, name)


def _parse_metadata(raw: bytes) -> list[dict[str, Any]]:
    """The topics of an nsqd.dat; Go writes null for an empty list. Raises ValueError for a file Go's
    json.Unmarshal into nsqd's struct would refuse (not JSON, or a field of the wrong type)."""
    meta = json.loads(raw)
    if not isinstance(meta, dict):
        raise ValueError("not a JSON object")
    topics = meta.get("topics") or []
    if not isinstance(topics, list) or not all(isinstance(t, dict) for t in topics):
        raise ValueError("'topics' is not a list of objects")
    for t in topics:
        channels = t.get("channels") or []
        if not isinstance(channels, list) or not all(isinstance(c, dict) for c in channels):
            raise ValueError("'channels' is not a list of objects")
        for item in [t, *channels]:
            if not isinstance(item.get("name", ""), str) or not isinstance(item.get("paused", False), bool):
                raise ValueError("a name that is not a string or a paused that is not a bool")
    return topics

