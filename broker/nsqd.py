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
from typing import TYPE_CHECKING, Any

import trio

from trio_nsq.broker.channel import Channel
from trio_nsq.broker.client_v2 import ClientV2
from trio_nsq.broker.storage.data_dir import DataDir
from trio_nsq.broker.storage.files import fsync_dir, remove_quietly
from trio_nsq.broker.lookup import LookupManager
from trio_nsq.broker.metadata import METADATA_FILE, Metadata, valid
from trio_nsq.broker.options import Options
from trio_nsq.broker.v2_poller import V2Poller
from trio_nsq.broker.protocol_v2 import ProtocolV2
from trio_nsq.broker.queue_scan import queue_scan_loop
from trio_nsq.broker.queue_settings import QueueSettings
from trio_nsq.broker.statsd import statsd_loop
from trio_nsq.broker.tls import build_server_context, tls_required, tls_required_http
from trio_nsq.broker.topic import ReplicationError, Topic
from trio_nsq.shared.http import address_text, is_unix_address, open_unix_listener, split_host_port
from trio_nsq.shared.lookup_protocol import register_cmd
from trio_nsq.shared.names import is_ephemeral, is_valid_channel_name, is_valid_topic_name
from trio_nsq.shared.protocol import FRAME_TYPE_ERROR, MAGIC_V2, encode_frame
from trio_nsq.shared.service import error_text
from trio_nsq.shared.tcp import serve_connection
from trio_nsq.shared.version import VERSION

if TYPE_CHECKING:
    from trio_nsq.broker.replication.manager import ReplicaManager

log = logging.getLogger("nsqd")

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
        self.meta = Metadata(self)  # nsqd.dat and its journal
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
        # cluster mode (--etcd-endpoints): every non-ephemeral topic replicated (replication/manager.py)
        self.replication: ReplicaManager | None = None
        if options.etcd_endpoints:
            from trio_nsq.broker.replication.manager import ReplicaManager

            self.replication = ReplicaManager(self)

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
                tcp_address = await self._start_tcp(nursery)
                if self.replication is not None:
                    # cluster mode: in etcd (its id is its HTTP address) before it says it listens
                    await nursery.start(self.replication.run)
                log.info("TCP: listening on %s", address_text(*tcp_address))
                if self.http_address is not None:
                    log.info("HTTP: listening on %s", address_text(*self.http_address))
                await nursery.start(self.lookup.run)
                nursery.start_soon(queue_scan_loop, self)
                nursery.start_soon(self.meta.run)
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
        replication = self.replication
        for topic in self.topics.values():
            if replication is not None and not replication.registers(topic.name):
                continue  # cluster mode: only a topic's leader registers it
            if not topic.channels:
                commands.append(register_cmd(topic.name))
            for channel in topic.channels.values():
                commands.append(register_cmd(topic.name, channel.name))
        for name, entry in list(self._pending.items()) if replication is None else ():  # from nsqd.dat, not open yet
            channels = [c["name"] for c in valid(entry.get("channels") or (), is_valid_channel_name, "channel")
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
        if self.replication is not None:
            self.replication.attach(topic)
        if not self._loading:
            topic.channels_from_lookupd = self.lookup.topic_channels
        if self._nursery is not None:
            self._nursery.start_soon(topic.run)
        self._notify(topic, True)
        return topic

    def topic_for_client(self, name: str) -> Topic:
        """get_topic for a client's PUB, MPUB, DPUB, SUB, /pub, /mpub, /topic/create. Cluster mode: a topic
        etcd places on other brokers only is not made here (an empty copy nobody fetches, that nsqd.dat
        would keep): ReplicationError NOT_LEADER naming its leader, as a follower refuses."""
        if self.replication is not None and name not in self.topics and name not in self._pending:
            refused = self.replication.elsewhere(name)
            if refused is not None:
                raise ReplicationError("NOT_LEADER", refused)
        return self.get_topic(name)

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
        if self.replication is not None:
            self.replication.detach(topic, deleted=True)
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
        if isinstance(obj, Topic):
            if obj.ephemeral:
                pass
            elif created:
                self.meta.created(obj.name)
            else:
                self.persist_metadata(obj.name)
        elif not obj.ephemeral and not obj.topic.ephemeral:
            if created:
                self.meta.created(obj.topic_name, obj.name)
            else:
                self.persist_metadata(obj.topic_name, obj.name)

    # --- metadata (nsqd.dat, broker/metadata.py) ------------------------------------------------

    def metadata(self) -> dict[str, Any]:
        """nsqd.dat as Go nsqd writes it: its key order, and null for no topics or no channels (a Go
        nil slice), so the file is byte for byte what nsqd 1.3.0 writes for the same topics."""
        return json.loads(self.meta.metadata_bytes())

    def persist_metadata(self, topic: str, channel: str = "") -> None:
        """`topic` (or only its `channel`) changed: on disk with the next write."""
        self.meta.changed(topic, channel)

    async def metadata_persisted(self) -> None:
        """Return once a write begun after this call's changes is on disk (group commit: creations
        arriving together share one write). Raises OSError if the write covering them failed."""
        await self.meta.persisted()

    async def persist_metadata_now(self) -> None:
        """Write what changed now and return once it is on disk (a settings change is answered after it)."""
        await self.meta.persist_now()

    def write_metadata_now(self) -> None:
        self.meta.write_now()

    def pending_topics(self) -> list[dict[str, Any]]:
        """The entries of the topics nsqd.dat names that are not open yet."""
        return list(self._pending.values())

    def load_metadata(self) -> None:
        """nsqd.dat (and its journal) read and the data directory listed, once. The topics nsqd.dat names
        are opened once the broker listens (_open_pending_topics), or at once when something asks first."""
        self.data_dir = DataDir.read(self.data_path)
        try:
            topics = self.meta.load()
        except ValueError as exc:
            path = os.path.join(self.data_path, METADATA_FILE)
            raise RuntimeError(f"failed to parse metadata in {path} - {exc}") from None
        if self.meta.found:
            self._remove_unnamed_files(topics)
        for t in valid(topics, is_valid_topic_name, "topic"):
            self._pending.setdefault(t["name"], t)
        if not self._pending:
            self.loaded.set()

    def _remove_unnamed_files(self, topics: list[dict[str, Any]]) -> None:
        """Files of topics and channels nsqd.dat (with its journal) does not name: what a deletion left
        (a removal that failed; a broker, ours before this or Go's, that did not fsync the removals).
        Removed now, so a topic or channel made later under the name starts afresh, as one deleted
        does. Only called when nsqd.dat was there and loaded: a missing one says nothing was deleted.
        Ephemeral names are left alone (nsqd.dat never names them)."""
        named = {t.get("name", ""): t for t in topics}
        removed = False
        for name in self.data_dir.topics():
            if is_ephemeral(name):
                continue
            entry = named.get(name)
            if entry is None:
                files, what = self.data_dir.take(name), f"TOPIC({name})"
            else:
                channels = {c.get("name", "") for c in entry.get("channels") or ()}
                files, what = self.data_dir.take_channels(
                    name, lambda channel: channel not in channels and not is_ephemeral(channel)), f"TOPIC({name}) channels"
            if not files:
                continue
            for file in files:
                failed = remove_quietly(os.path.join(self.data_path, file))
                if failed is not None:
                    log.error("%s: failed to remove %s - %s", what, file, failed)
            removed = True
            log.warning("%s: not in %s (deleted before a crash): removed %s", what, METADATA_FILE, " ".join(sorted(files)))
        if removed:
            fsync_dir(self.data_path)  # gone for good before anything is made again under the name

    def _open_from_metadata(self, t: dict[str, Any]) -> Topic:
        """A topic nsqd.dat names, with its channels, pauses and settings as it says (nothing told to the
        lookupds, nothing written: they know it already)."""
        name = t["name"]
        loading, self._loading = self._loading, True
        try:
            topic = Topic(self, name, self.data_dir.take(name))
            self.topics[name] = topic
            if self.replication is not None:
                self.replication.attach(topic)
            topic.paused = bool(t.get("paused"))
            for c in valid(t.get("channels") or (), is_valid_channel_name, "channel"):
                channel = topic.get_channel(c["name"])
                channel.paused = bool(c.get("paused"))
                if c.get("cursor") is True:  # (not in Go's nsqd.dat: broker/metadata.py channel_entry)
                    channel.make_cursor()
                    channel.set_pins(c.get("cursor_idle") is not True)
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
