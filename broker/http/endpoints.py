"""nsqd's HTTP endpoints (nsqd/http.go): class Api, one method per endpoint, free of any framework.

Each takes an Request and returns a Reply. Parameters, checks, their order, status codes and messages
are nsqd's, so nsqadmin, nsq_stat, nsq_to_http and every client library keep working."""

from __future__ import annotations

import datetime
import json
import logging
import socket
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import trio

from trio_nsq.broker.storage.backend import BackendError
from trio_nsq.broker.channel import Channel
from trio_nsq.broker.channel_messages import ListingError, list_messages, listing_args
from trio_nsq.broker.http.openapi import openapi_bytes
from trio_nsq.broker.idempotency import valid_key
from trio_nsq.broker.stats import get_stats, health
from trio_nsq.broker.stats_json import stats_json
from trio_nsq.broker.stats_prometheus import prometheus_text
from trio_nsq.broker.stats_text import stats_text
from trio_nsq.broker.queue_settings import KEYS, QueueSettings, Resolved, SettingsError, parse_updates, resolve
from trio_nsq.broker.topic import DEAD_LETTERS_CHANNEL, Published, ReplicationError, Topic, TopicFull
from trio_nsq.broker.storage.topic_log import SeekError
from trio_nsq.shared.http_api import (
    EMPTY,
    JSON_TYPE,
    OK,
    TEXT_TYPE,
    HTTPError,
    Reply,
    go_number,
    ok_json,
    parse_go_int,
    parse_query,
    plain,
)
from trio_nsq.shared.http_server import Request
from trio_nsq.shared.logs import GO_LOG_LEVELS, parse_level
from trio_nsq.shared.options import format_duration
from trio_nsq.shared.names import is_valid_channel_name, is_valid_topic_name
from trio_nsq.shared.protocol import FatalClientError, parse_mpub_body, topology_fields
from trio_nsq.shared.version import VERSION

log = logging.getLogger("nsqd")


PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"

REDRIVE_BATCH = 512  # messages moved between two checkpoints of a re-drive

QUERY_CACHE = 1024  # distinct query strings kept parsed, each of at most QUERY_CACHE_KEY bytes
QUERY_CACHE_KEY = 512

# nsqd's boolParams: anything else is "not given" (stats) or "true" (mpub's binary)
BOOL_PARAMS = {"true": True, "1": True, "false": False, "0": False}

# Options nsqd has without a flag tag, which /config/:opt therefore does not show
_UNFLAGGED_OPTIONS = frozenset(
    {"queue_scan_interval", "queue_scan_refresh_interval", "queue_scan_dirty_percent", "client_timeout"}
)


class Api:
    """nsqd's httpServer handlers, one method per endpoint, each returning a Reply."""

    def __init__(self, nsqd: Any) -> None:
        self.nsqd = nsqd
        self.options = nsqd.options
        self.https_address: tuple[str, int] | None = None
        self._queries: dict[bytes, dict[str, list[str]]] = {}  # raw query -> parsed, at most QUERY_CACHE
        # a /pub query whose checks passed -> its topic name and defer (a publisher sends the same one
        # every time: nothing to parse or check again), at most QUERY_CACHE
        self._pub_queries: dict[bytes, tuple[str, float]] = {}

    # --- query helpers (nsqd's getTopicFromQuery and friends) ----------------------------

    def _params(self, req: Request) -> dict[str, list[str]]:
        """The query parsed (read-only: a publisher's query is parsed once, then looked up)."""
        params = self._queries.get(req.query)
        if params is None:
            try:
                params = parse_query(req.query)
            except ValueError as exc:
                log.error("failed to parse request params - %s", exc)
                raise HTTPError(400, "INVALID_REQUEST") from None
            if len(req.query) <= QUERY_CACHE_KEY:
                if len(self._queries) >= QUERY_CACHE:
                    self._queries.clear()
                self._queries[req.query] = params
        return params

    def _topic_from_query(self, req: Request) -> tuple[dict[str, list[str]], Topic]:
        """Creates the topic if needed, as nsqd's GetTopic."""
        params = self._params(req)
        return params, self._topic_for_client(_name_arg(params, "topic", "INVALID_TOPIC", is_valid_topic_name))

    def _topic_for_client(self, name: str) -> Topic:
        """NSQD.topic_for_client: cluster mode's 503 NOT_LEADER for a topic placed on other brokers only."""
        try:
            return self.nsqd.topic_for_client(name)
        except ReplicationError as exc:
            log.info("TOPIC(%s): refused here - %s", name, exc)
            raise HTTPError(503, exc.reason) from None

    def _topic_name(self, req: Request) -> str:
        names = self._params(req).get("topic")
        if names is None:
            raise HTTPError(400, "MISSING_ARG_TOPIC")
        return names[0]

    def _existing_topic(self, name: str) -> Topic:
        topic = self.nsqd.get_existing_topic(name)
        if topic is None:
            raise HTTPError(404, "TOPIC_NOT_FOUND")
        return topic

    def _existing_topic_and_channel_name(self, req: Request) -> tuple[Topic, str]:
        """nsqd's getExistingTopicFromQuery (the channel endpoints' argument checks)."""
        params = self._params(req)
        topic = _name_arg(params, "topic", "INVALID_ARG_TOPIC", is_valid_topic_name)
        channel = _name_arg(params, "channel", "INVALID_ARG_CHANNEL", is_valid_channel_name)
        return self._existing_topic(topic), channel

    def _existing_channel(self, req: Request) -> Channel:
        topic, name = self._existing_topic_and_channel_name(req)
        channel = topic.get_existing_channel(name)
        if channel is None:
            raise HTTPError(404, "CHANNEL_NOT_FOUND")
        return channel

    # --- /ping /info ------------------------------------------------------------------------

    async def ping(self, req: Request, params: Mapping[str, str]) -> Reply:
        return self.ping_now(req, params)

    def ping_now(self, req: Request, params: Mapping[str, str]) -> Reply:
        text = health(self.nsqd)
        # nsqd's PlainText decorator: its error too is the text as it is
        return plain(text, 500) if self.nsqd.health_error is not None else plain(text)

    async def info(self, req: Request, params: Mapping[str, str]) -> Reply:
        opts = self.options
        tcp = self.nsqd.tcp_address
        http = self.nsqd.http_address
        return ok_json({
            "version": VERSION,
            "broadcast_address": opts.broadcast_address,
            "hostname": socket.gethostname(),
            "http_port": http[1] if http else req.server_port,
            "tcp_port": tcp[1] if tcp else -1,
            "start_time": self.nsqd.start_time,
            "max_heartbeat_interval": _ns(opts.max_heartbeat_interval),
            "max_output_buffer_size": opts.max_output_buffer_size,
            "max_output_buffer_timeout": _ns(opts.max_output_buffer_timeout),
            "max_deflate_level": opts.max_deflate_level,
            **topology_fields(opts.topology_zone, opts.topology_region),
            "idempotent_publish": True,  # /pub and /mpub honour Idempotency-Key (Go nsqd lacks the field)
        })

    # --- publishing -------------------------------------------------------------------------

    async def pub(self, req: Request, params: Mapping[str, str]) -> Reply:
        key = self._pub_head(req)
        body = await req.read(self.options.max_msg_size)
        topic, bodies, deferred = self._pub_body(req, body)
        await self._publish(topic, bodies, "pub", key, deferred)
        await self._named(topic)
        return OK

    def pub_now(self, req: Request, params: Mapping[str, str]) -> Reply | None:
        if not self._publishes_now(req):
            return None
        checked = self._pub_queries.get(req.query)
        if not self._named_now(checked[0] if checked is not None else self._topic_arg(req)):
            return None
        self._pub_head(req)
        topic, bodies, deferred = self._pub_body(req, req.body_now(self.options.max_msg_size))
        self._publish_sync(topic, bodies, "pub", deferred)
        return OK

    def _pub_head(self, req: Request) -> str | None:
        """/pub's checks before its body is read; its Idempotency-Key."""
        key = self._idempotency_key(req)
        if req.content_length is not None and req.content_length > self.options.max_msg_size:
            raise HTTPError(413, "MSG_TOO_BIG")
        return key

    def _pub_body(self, req: Request, body: bytes | None) -> tuple[Topic, list[bytes], float]:
        """/pub's checks of the body read (None: past max_msg_size) and the query: what to publish."""
        if body is None:
            raise HTTPError(413, "MSG_TOO_BIG")
        if not body:
            raise HTTPError(400, "MSG_EMPTY")
        checked = self._pub_queries.get(req.query)
        if checked is not None:  # a query checked before: its topic name and defer, as they were found
            return self._topic_for_client(checked[0]), [body], checked[1]
        params, topic = self._topic_from_query(req)
        deferred = 0.0
        defer = params.get("defer")
        if defer is not None:
            try:
                ms = parse_go_int(defer[0])
            except ValueError:
                raise HTTPError(400, "INVALID_DEFER") from None
            if ms < 0 or ms > self.options.max_defer * 1000:
                raise HTTPError(400, "INVALID_DEFER")
            deferred = ms / 1000
        if req.query in self._queries:  # kept parsed, so bounded as that table is
            if len(self._pub_queries) >= QUERY_CACHE:
                self._pub_queries.clear()
            self._pub_queries[req.query] = (topic.name, deferred)
        return topic, [body], deferred

    async def mpub(self, req: Request, params: Mapping[str, str]) -> Reply:
        key, topic, binary = self._mpub_head(req)
        body = await req.read(self.options.max_body_size)
        await self._publish(topic, self._mpub_bodies(body, binary), "mpub", key)
        await self._named(topic)
        return OK

    def mpub_now(self, req: Request, params: Mapping[str, str]) -> Reply | None:
        if not self._publishes_now(req) or not self._named_now(self._topic_arg(req)):
            return None
        _, topic, binary = self._mpub_head(req)
        self._publish_sync(topic, self._mpub_bodies(req.body_now(self.options.max_body_size), binary), "mpub")
        return OK

    def _mpub_head(self, req: Request) -> tuple[str | None, Topic, bool]:
        """/mpub's checks before its body is read: the Idempotency-Key, the topic, binary or not."""
        key = self._idempotency_key(req)
        opts = self.options
        if req.content_length is not None and req.content_length > opts.max_body_size:
            raise HTTPError(413, "BODY_TOO_BIG")
        params, topic = self._topic_from_query(req)
        binary = False
        values = params.get("binary")
        if values is not None:
            binary = BOOL_PARAMS.get(values[0], True)
            if values[0] not in BOOL_PARAMS:
                log.warning("deprecated value '%s' used for /mpub binary param", values[0])
        return key, topic, binary

    def _mpub_bodies(self, body: bytes | None, binary: bool) -> list[bytes]:
        opts = self.options
        if body is None:
            raise HTTPError(413, "BODY_TOO_BIG")
        if binary:
            try:
                return parse_mpub_body(body, opts.max_msg_size, opts.max_body_size, surplus_ok=True)
            except FatalClientError as exc:  # nsqd's HTTP codes are the TCP ones without "E_"
                raise HTTPError(413, exc.code.removeprefix("E_")) from None
        # newline-separated; empty lines are skipped, as nsqd has done since 0.2.22
        bodies = [line for line in body.split(b"\n") if line]
        max_msg_size = opts.max_msg_size
        if any(len(line) > max_msg_size for line in bodies):
            raise HTTPError(413, "MSG_TOO_BIG")
        return bodies

    def _publishes_now(self, req: Request) -> bool:
        """A publish answered without awaiting: no Idempotency-Key (its journal awaits) and no fsync to
        wait for (--sync-every=1)."""
        # (cluster mode: every publish awaits its replicas)
        return req.idempotency_key is None and self.options.sync_every != 1 and not self.options.etcd_endpoints

    def _named_now(self, name: str) -> bool:
        """The topic is there and nsqd.dat names it: a publish to it may be answered without awaiting (else
        the awaiting path makes it and answers once it is named)."""
        return name in self.nsqd.topics and self.nsqd.meta.is_named(name)

    def _topic_arg(self, req: Request) -> str:
        """The query's topic, or "" (a query that does not parse is refused by the awaiting path)."""
        try:
            names = self._params(req).get("topic")
        except HTTPError:
            return ""
        return names[0] if names else ""

    async def _named(self, topic: Topic, channel: str = "") -> None:
        """A publish or a commit that made its topic (or channel), or came while another's making of it
        is not on disk yet, is answered once nsqd.dat names it: at start, files of a topic or channel
        nsqd.dat does not name are removed (what was deleted), and an answered message must not be."""
        if not self.nsqd.meta.is_named(topic.name, channel):
            await self._metadata_persisted()

    @staticmethod
    def _idempotency_key(req: Request) -> str | None:
        key = req.idempotency_key
        if key is not None and not valid_key(key):
            log.error("invalid Idempotency-Key header (%d bytes) on %s", len(key), req.path)
            raise HTTPError(400, "INVALID_IDEMPOTENCY_KEY")
        return key

    async def _publish(self, topic: Topic, bodies: list[bytes], what: str, key: str | None,
                       deferred: float = 0.0) -> None:
        """Topic.publish for /pub and /mpub, once per Idempotency-Key when one is given."""
        if key is None:
            await self._publish_now(topic, bodies, what, deferred)
        else:
            await topic.idempotency.publish_once(key, lambda: self._publish_now(topic, bodies, what, deferred))

    async def _publish_now(self, topic: Topic, bodies: list[bytes], what: str,
                           deferred: float) -> tuple[bool, int | None]:
        """Publish; with --sync-every=1 answer only once on disk, over HTTP as over TCP (concurrent
        requests share the fsync: the backend's sync is a group commit). Whether every message is on
        disk and fsynced now (so an Idempotency-Key covering them may be journalled), and, when every
        message went to the log, the log position they end at (the key is journalled with it)."""
        published = self._publish_sync(topic, bodies, what, deferred)
        log_end = topic.log.segments.tail if published.in_log and topic.log is not None else None
        if published.sync is not None:
            try:
                await published.sync.sync()
            except ReplicationError as exc:
                # appended, not confirmed by enough replicas in time: the client cannot know (retry)
                log.error("TOPIC(%s): HTTP %s not confirmed by its replicas - %s", topic.name, what, exc)
                raise HTTPError(503, exc.reason) from None
            except BackendError as exc:
                log.error("TOPIC(%s): failed to sync published messages - %s", topic.name, exc)
                raise HTTPError(500, "INTERNAL_ERROR") from None
        return published.all_durable, log_end

    def _publish_sync(self, topic: Topic, bodies: list[bytes], what: str, deferred: float = 0.0) -> Published:
        """Topic.publish, its failure as nsqd answers it; what is left to await is in the result."""
        try:
            return topic.publish(bodies, deferred)
        except TopicFull as exc:
            log.info("TOPIC(%s): HTTP %s refused - %s", topic.name, what, exc)
            raise HTTPError(503, "TOPIC_FULL") from None
        except ReplicationError as exc:
            log.info("TOPIC(%s): HTTP %s refused - %s", topic.name, what, exc)
            raise HTTPError(503, exc.reason) from None
        except BackendError as exc:
            log.error("TOPIC(%s): HTTP %s failed - %s", topic.name, what, exc)
            raise HTTPError(503, "EXITING") from None

    # --- /stats /metrics /openapi.json -----------------------------------------------------

    async def stats(self, req: Request, params: Mapping[str, str]) -> Reply:
        await self.nsqd.loaded.wait()  # every topic nsqd.dat names is open (start-up opens them after listening)
        query = self._params(req)

        def first(key: str) -> str:
            return query.get(key, [""])[0]

        snapshot = get_stats(self.nsqd, first("topic"), first("channel"),
                             include_clients=BOOL_PARAMS.get(first("include_clients"), True),
                             include_mem=BOOL_PARAMS.get(first("include_mem"), True))
        if first("format") != "json":
            return Reply(200, stats_text(snapshot).encode(), TEXT_TYPE)
        return Reply(200, stats_json(snapshot), JSON_TYPE)

    async def metrics(self, req: Request, params: Mapping[str, str]) -> Reply:
        await self.nsqd.loaded.wait()
        return Reply(200, prometheus_text(self.nsqd).encode(), PROMETHEUS_TYPE, nsq_header=False)

    async def openapi(self, req: Request, params: Mapping[str, str]) -> Reply:
        return Reply(200, openapi_bytes(), JSON_TYPE, nsq_header=False)

    # --- topics -----------------------------------------------------------------------------

    async def topic_create(self, req: Request, params: Mapping[str, str]) -> Reply:
        self._topic_from_query(req)
        await self._metadata_persisted()
        return EMPTY

    async def _metadata_persisted(self) -> None:
        """A creation is answered once nsqd.dat names it (one write covers the creations that arrive
        together), so a crash right after the answer does not lose the topic or channel."""
        try:
            await self.nsqd.metadata_persisted()
        except OSError as exc:
            log.error("failed to persist metadata - %s", exc)
            raise HTTPError(500, "INTERNAL_ERROR") from None

    async def topic_delete(self, req: Request, params: Mapping[str, str]) -> Reply:
        return await self._deleted(self.nsqd.delete_topic, self._topic_name(req), "TOPIC_NOT_FOUND")

    async def _deleted(self, delete: Callable[[str], object], name: str, not_found: str) -> Reply:
        """A topic or channel delete, answered once the deletion is on disk (a power loss now does not
        bring it back)."""
        try:
            delete(name)
        except KeyError:
            raise HTTPError(404, not_found) from None
        await self._metadata_persisted()
        return EMPTY

    async def topic_empty(self, req: Request, params: Mapping[str, str]) -> Reply:
        name = self._topic_name(req)
        if not is_valid_topic_name(name):
            raise HTTPError(400, "INVALID_TOPIC")
        topic = self._existing_topic(name)
        self._on_leader(topic, "empty")
        topic.empty()
        await self._persisted(topic, f"TOPIC({name})")
        return EMPTY

    async def _persisted(self, topic: Topic, what: str) -> None:
        """An empty or a seek is on disk before it is answered, as nsqd's empty removes the files first."""
        try:
            await topic.group.sync_round()
        except BackendError as exc:
            log.error("%s: failed to persist - %s", what, exc)
            raise HTTPError(500, "INTERNAL_ERROR") from None

    @staticmethod
    def _on_leader(topic: Topic, what: str) -> None:
        """Cluster mode: a pause, a setting, a channel made, deleted, emptied or seeked is changed on the
        topic's leader only, and its followers mirror it (their next fetch would undo one of their own). Elsewhere 503 NOT_LEADER: nsqadmin calls the
        brokers nsqlookupd lists for the topic, which is its leader alone."""
        refused = topic.replica.refuses_consumers() if topic.replica is not None else None
        if refused is not None:
            log.info("TOPIC(%s): %s refused - %s", topic.name, what, refused)
            raise HTTPError(503, "NOT_LEADER")

    async def topic_pause(self, req: Request, params: Mapping[str, str]) -> Reply:
        return await self._set_paused(self._existing_topic(self._topic_name(req)), True)

    async def topic_unpause(self, req: Request, params: Mapping[str, str]) -> Reply:
        return await self._set_paused(self._existing_topic(self._topic_name(req)), False)

    async def _set_paused(self, target: Topic | Channel, paused: bool) -> Reply:
        self._on_leader(target if isinstance(target, Topic) else target.topic, "pause" if paused else "unpause")
        if paused:
            target.pause()
        else:
            target.unpause()
        # on disk before the answer so a crash cannot silently (un)pause it, as nsqd
        if isinstance(target, Topic):
            self.nsqd.persist_metadata(target.name)
        else:
            self.nsqd.persist_metadata(target.topic_name, target.name)
        await self._metadata_persisted()
        return EMPTY

    # --- channels ---------------------------------------------------------------------------

    async def channel_create(self, req: Request, params: Mapping[str, str]) -> Reply:
        topic, name = self._existing_topic_and_channel_name(req)
        self._on_leader(topic, f"channel {name} create")
        topic.get_channel(name)
        await self._metadata_persisted()
        return EMPTY

    async def channel_delete(self, req: Request, params: Mapping[str, str]) -> Reply:
        topic, name = self._existing_topic_and_channel_name(req)
        self._on_leader(topic, f"channel {name} delete")
        return await self._deleted(topic.delete_channel, name, "CHANNEL_NOT_FOUND")

    async def channel_empty(self, req: Request, params: Mapping[str, str]) -> Reply:
        channel = self._existing_channel(req)
        self._on_leader(channel.topic, f"channel {channel.name} empty")
        channel.empty()
        await self._persisted(channel.topic, f"CHANNEL({channel.name})")
        return EMPTY

    async def channel_seek(self, req: Request, params: Mapping[str, str]) -> Reply:
        """Not in nsqd: move the channel's cursor in its topic's log (`to`: earliest, latest, unix
        milliseconds or an RFC 3339 time): afterwards it delivers, in publish order, every message the log
        holds from there. What it held (queued in memory, in flight, deferred) is dropped; a FIN of a
        message that was in flight is then "ID not in flight". Persisted before the answer, which says
        where the channel now is and how many messages it has to deliver."""
        channel = self._existing_channel(req)
        self._on_leader(channel.topic, f"channel {channel.name} seek")
        texts = self._params(req).get("to")
        if not texts or not texts[0]:
            raise HTTPError(400, "MISSING_ARG_TO")
        to = parse_seek_to(texts[0])
        if to is None:
            raise HTTPError(400, "INVALID_ARG_TO")
        topic = channel.topic
        if topic.log is None:
            raise HTTPError(400, "TOPIC_HAS_NO_LOG")  # an ephemeral topic keeps nothing to go back to
        try:
            at = topic.log.seek_position(to)
        except SeekError:
            raise HTTPError(400, "TIME_BEFORE_RETENTION") from None
        topic.log.reload_deadlines(at.position)
        channel.seek(at.position, at.index)
        log.info("CHANNEL(%s:%s): seek to %s: position %d", topic.name, channel.name, texts[0], at.position)
        await self._persisted(topic, f"CHANNEL({channel.name})")
        return ok_json({"position": at.position, "depth": channel.depth()})

    async def channel_messages(self, req: Request, params: Mapping[str, str]) -> Reply:
        """Not in nsqd: a look at a channel's messages in one state (in_flight, deferred, queued), at most
        `limit` of them (default 100, at most 1000): broker/channel_messages.py."""
        channel = self._existing_channel(req)
        states, limits = self._params(req).get("state"), self._params(req).get("limit")
        try:
            state, limit = listing_args(states[0] if states else None, limits[0] if limits else None)
        except ListingError as exc:
            raise HTTPError(400, str(exc)) from None
        return ok_json(list_messages(channel, state, limit))

    async def channel_pause(self, req: Request, params: Mapping[str, str]) -> Reply:
        return await self._set_paused(self._existing_channel(req), True)

    async def channel_unpause(self, req: Request, params: Mapping[str, str]) -> Reply:
        return await self._set_paused(self._existing_channel(req), False)

    # --- settings per topic and channel, dead letters (not in nsqd) --------------------------

    async def topic_config(self, req: Request, params: Mapping[str, str]) -> Reply:
        """GET: what is set on the topic and what it obeys; POST: set (or, with an empty value, unset)
        any of queue_settings.KEYS, persisted before the answer. Its channels follow what they do not set."""
        topic = self._existing_topic(self._topic_name(req))
        if req.method == "POST":
            self._on_leader(topic, "config")
            replicated = await self._replication_config(req, topic)
            changes = self._settings_changes(req, topic.name, "", skip=replicated)
            self._check_resolves(topic.settings, changes, topic.name, "")
            if changes or not replicated:
                topic.settings.update(changes)
                topic.apply_settings()
                await self._settings_persisted(f"TOPIC({topic.name})", changes, topic)
        resolved = resolve(self.options, topic.settings, topic=topic.name)
        reply = {"topic": topic.name, "config": topic.settings.to_json(), "effective": _effective(resolved)}
        if topic.replica is not None:
            reply["replication"] = topic.replica.stats()
        return ok_json(reply)

    async def _replication_config(self, req: Request, topic: Topic) -> tuple[str, ...]:
        """Cluster mode: `replicas` and `min_isr` of /topic/config, changed in etcd by the topic's leader
        (a CAS): replicas raised, alive brokers join `replicas` (not the isr: they catch up first);
        lowered, followers leave. Which of the two keys the query had."""
        manager = self.nsqd.replication
        params = self._params(req)
        given = tuple(key for key in ("replicas", "min_isr") if key in params)
        if manager is None or not given or topic.replica is None:
            return ()
        values: dict[str, int] = {}
        for key in given:
            try:
                value = parse_go_int(params[key][-1])
            except ValueError:
                raise HTTPError(400, f"INVALID_ARG_{key.upper()}") from None
            if value < 1:
                raise HTTPError(400, f"INVALID_ARG_{key.upper()}")
            values[key] = value
        error = await manager.configure(topic.name, values.get("replicas"), values.get("min_isr"))
        if error is not None:
            log.info("TOPIC(%s): replication config refused - %s", topic.name, error)
            raise HTTPError(409 if error == "CONFLICT" else 503, error)
        return given

    async def channel_config(self, req: Request, params: Mapping[str, str]) -> Reply:
        """/topic/config for one channel: what it sets wins over its topic's settings."""
        channel = self._existing_channel(req)
        topic = channel.topic
        if req.method == "POST":
            self._on_leader(topic, "config")
            changes = self._settings_changes(req, topic.name, channel.name)
            self._check_resolves(channel.settings, changes, topic.name, channel.name, topic.settings)
            channel.settings.update(changes)
            topic.apply_settings()
            await self._settings_persisted(f"CHANNEL({topic.name}:{channel.name})", changes, topic)
        resolved = resolve(self.options, channel.settings, topic.settings, topic=topic.name, channel=channel.name)
        return ok_json({"topic": topic.name, "channel": channel.name, "config": channel.settings.to_json(),
                        "effective": _effective(resolved)})

    def _settings_changes(self, req: Request, topic: str, channel: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
        params = self._params(req)
        if skip:
            params = {key: values for key, values in params.items() if key not in skip}
        try:
            return parse_updates(params, topic=topic, channel=channel)
        except SettingsError as exc:
            log.info("TOPIC(%s): config refused - %s", topic, exc)
            raise HTTPError(400, str(exc)) from None

    def _check_resolves(self, settings: QueueSettings, changes: dict[str, Any], topic: str, channel: str,
                        *under: QueueSettings) -> None:
        """A channel that would limit attempts with no dead-letter topic to send them to (its default
        name too long for a topic name) is refused, changing nothing."""
        if not channel:
            return
        after = attrs.evolve(settings, **changes)
        resolved = resolve(self.options, after, *under, topic=topic, channel=channel)
        if resolved.max_attempts and not resolved.dead_letter_topic:
            log.info("CHANNEL(%s:%s): config refused - max_attempts without a dead_letter_topic", topic, channel)
            raise HTTPError(400, "MISSING_ARG_DEAD_LETTER_TOPIC")

    async def _settings_persisted(self, what: str, changes: dict[str, Any], topic: Topic) -> None:
        """nsqd.dat, and the dead-letter topics the topic's channels now have, on disk before the answer."""
        log.info("%s: config %s", what, ", ".join(f"{key}={'' if v is None else v}" for key, v in changes.items()))
        self.nsqd.persist_metadata(topic.name)
        try:
            await self.nsqd.persist_metadata_now()
        except OSError as exc:
            log.error("failed to persist metadata - %s", exc)
            raise HTTPError(500, "INTERNAL_ERROR") from None
        for name in {ch.dead_letter_topic for ch in topic.channels.values() if ch.max_attempts or ch.expired_to_dead_letter}:
            dead = self.nsqd.get_existing_topic(name)
            if dead is not None:
                await self._persisted(dead, f"TOPIC({name})")

    async def channel_redrive(self, req: Request, params: Mapping[str, str]) -> Reply:
        """Move what the channel's dead-letter topic holds (queued in its DEAD_LETTERS_CHANNEL) back into
        the channel, attempts reset: at most `limit`, and never more than was there when it began (what
        fails again meanwhile stays for the next re-drive)."""
        channel = self._existing_channel(req)
        limit_text = (self._params(req).get("limit") or [""])[-1]
        if limit_text and not limit_text.isdigit():
            raise HTTPError(400, "INVALID_ARG_LIMIT")
        name = channel.dead_letter_topic
        dead_topic = self.nsqd.get_existing_topic(name) if name else None
        dead = dead_topic.get_existing_channel(DEAD_LETTERS_CHANNEL) if dead_topic is not None else None
        moved = 0
        if dead is not None:
            left = dead.depth()
            if limit_text:
                left = min(left, int(limit_text))
            while left > 0:
                n = channel.redrive_from(dead, min(left, REDRIVE_BATCH))
                if not n:
                    break
                moved += n
                left -= n
                await trio.lowlevel.checkpoint()
            if moved:
                log.info("CHANNEL(%s:%s): redrove %d messages from %s", channel.topic_name, channel.name, moved, name)
                # its own queue first, then what the dead-letter channel finished
                await self._persisted(channel.topic, f"CHANNEL({channel.name})")
                await self._persisted(dead.topic, f"CHANNEL({dead.name})")
        return ok_json({"topic": channel.topic_name, "channel": channel.name, "dead_letter_topic": name,
                        "moved": moved})

    # --- /config/:opt -----------------------------------------------------------------------

    async def config(self, req: Request, params: Mapping[str, str]) -> Reply:
        opt = params["opt"]
        """GET any option by its config-file name; PUT nsqlookupd_tcp_addresses (a JSON list) or
        log_level (debug, info, warn, error, fatal; bare or as a JSON string). Answers with the value."""
        if req.method == "PUT":
            body = await req.read(self.options.max_msg_size)
            if not body:  # None (too big) or empty
                raise HTTPError(413, "INVALID_VALUE")
            if opt == "nsqlookupd_tcp_addresses":
                try:
                    addresses = json.loads(body)
                except ValueError:
                    raise HTTPError(400, "INVALID_VALUE") from None
                if addresses is None:
                    addresses = []
                if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
                    raise HTTPError(400, "INVALID_VALUE")
                self.nsqd.set_lookupd_addresses(addresses)
            elif opt == "log_level":
                self._set_log_level(body)
            else:
                raise HTTPError(400, "INVALID_OPTION")
        try:
            return ok_json(option_value(self.options, opt))
        except KeyError:
            raise HTTPError(400, "INVALID_OPTION") from None

    def _set_log_level(self, body: bytes) -> None:
        text = body.decode("utf-8", "replace")
        if text.startswith('"'):
            try:
                text = json.loads(text)
            except ValueError:
                raise HTTPError(400, "INVALID_VALUE") from None
        level = str(text).lower()
        if level not in GO_LOG_LEVELS:
            raise HTTPError(400, "INVALID_VALUE")
        self.options.log_level = level
        root = logging.getLogger()
        root.setLevel(parse_level(level))
        logging.getLogger("hypercorn").setLevel(max(logging.WARNING, root.level))
        log.info("log level set to %s", level)


def option_value(options: Any, name: str) -> Any:
    """An option as nsqd's getOptByCfgName shows it in JSON: durations in nanoseconds, the log level
    as lg.LogLevel's number. Raises KeyError for an unknown name."""
    for field in attrs.fields(type(options)):
        if (field.metadata.get("cfg") or field.name) != name or field.name in _UNFLAGGED_OPTIONS:
            continue
        value = getattr(options, field.name)
        if field.name == "log_level":
            level = str(value).lower()
            return GO_LOG_LEVELS.get("warn" if level == "warning" else level, 0)
        if field.metadata.get("kind") == "duration":
            return _ns(value)
        if isinstance(value, list):
            return [go_number(v) for v in value]
        return go_number(value)
    raise KeyError(name)


def _ns(seconds: float) -> int:
    return int(round(seconds * 1_000_000_000))


def _effective(resolved: Resolved) -> dict[str, Any]:
    """What a topic or channel obeys, with the API's keys and forms."""
    out = attrs.asdict(resolved)
    out["depth_policy"] = "refuse" if out.pop("refuse_when_full") else "drop-oldest"
    out["message_ttl"] = format_duration(resolved.message_ttl)
    return {key: out[key] for key in KEYS}


def _name_arg(params: dict[str, list[str]], key: str, invalid: str, is_valid: Callable[[str], bool]) -> str:
    """The first `key` parameter: 400 MISSING_ARG_<KEY> without one, 400 `invalid` when it is not a name."""
    values = params.get(key)
    if values is None:
        raise HTTPError(400, f"MISSING_ARG_{key.upper()}")
    if not is_valid(values[0]):
        raise HTTPError(400, invalid)
    return values[0]


def parse_seek_to(text: str) -> str | int | None:
    """/channel/seek's `to`: "earliest", "latest", unix milliseconds, or an RFC 3339 time (as unix
    nanoseconds, the unit of a message's timestamp); None when it is none of them."""
    if text in ("earliest", "latest"):
        return text
    if text.isdigit():
        return int(text) * 1_000_000
    try:
        when = datetime.datetime.fromisoformat(text.replace("z", "Z").replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        return None  # RFC 3339 always has an offset
    return int(when.timestamp() * 1_000_000) * 1000
