"""nsqlookupd's HTTP API (nsqlookupd/http.go): the same paths, methods, status codes and bodies.

Modern nsqlookupd answers every client alike, whatever its Accept header: plain JSON, no
{"status_code", "data"} envelope (pynsq and gnsq take both), `X-NSQ-Content-Type: nsq; version=1.0`,
errors as `{"message": "TOPIC_NOT_FOUND"}`. Go's routing is httprouter v1.3.0's, and a client sees it,
so it is copied rather than left to werkzeug: an unknown path is 404 NOT_FOUND, a known path with
another method 405 METHOD_NOT_ALLOWED with `Allow`, OPTIONS answers `Allow`, a trailing slash or a
wrongly cased path is redirected (301 for GET, 307 otherwise). The query string is parsed as Go's
url.ParseQuery does (a bad %-escape or a `;` is 400 INVALID_REQUEST) and only by the handlers that parse
it in Go. Bodies are encoded as Go's encoding/json does: struct fields in order, map keys sorted, `<>&`
escaped. Go's /debug/pprof is not served.

The handlers are pure functions the tests call directly; the router, replies, query parsing and JSON
are shared/http_api.py's (nsqd uses the same); `lookupd_site` hands them to the shared HTTP server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from trio_nsq.lookupd.registration_db import Registration, filter_active, filter_registrations, keys, subkeys
from trio_nsq.shared.http_api import (
    HTTPError,
    Reply,
    Router,
    call_logged,
    parse_query,
    plain,
    respond_v1,
)
from trio_nsq.shared.http_server import Request, Route, Site
from trio_nsq.shared.names import is_valid_channel_name, is_valid_topic_name
from trio_nsq.shared.protocol import topology_fields
from trio_nsq.shared.version import VERSION

if TYPE_CHECKING:
    from trio_nsq.lookupd.nsqlookupd import NSQLookupd

log = logging.getLogger("nsqlookupd")

# Go's time.Time{}.UnixNano(): what /debug reports as tombstoned_at for a producer never tombstoned.
GO_ZERO_TIME_UNIX_NANO = -6795364578871345152


def _query(raw: bytes) -> dict[str, list[str]]:
    """Go's http_api.NewReqParams, as the handlers that call it see it."""
    try:
        return parse_query(raw)
    except ValueError:
        raise HTTPError(400, "INVALID_REQUEST") from None


def _get(args: dict[str, list[str]], key: str, missing: str) -> str:
    """ReqParams.Get: the first value; present-but-empty counts as present."""
    values = args.get(key)
    if not values:
        raise HTTPError(400, missing)
    return values[0]


def _topic_channel(args: dict[str, list[str]]) -> tuple[str, str]:
    """Go's http_api.GetTopicChannelArgs."""
    topic = _get(args, "topic", "MISSING_ARG_TOPIC")
    if not is_valid_topic_name(topic):
        raise HTTPError(400, "INVALID_ARG_TOPIC")
    channel = _get(args, "channel", "MISSING_ARG_CHANNEL")
    if not is_valid_channel_name(channel):
        raise HTTPError(400, "INVALID_ARG_CHANNEL")
    return topic, channel


# --- handlers: (lookupd, raw query) -> value (None: empty 200) or HTTPError ------------------------

Handler = Callable[["NSQLookupd", bytes], Any]


def ping(lookupd: NSQLookupd, query: bytes) -> str:
    return "OK"


def info(lookupd: NSQLookupd, query: bytes) -> dict:
    return {"version": VERSION}


def topics(lookupd: NSQLookupd, query: bytes) -> dict:
    return {"topics": keys(lookupd.db.find_registrations("topic", "*", ""))}


def channels(lookupd: NSQLookupd, query: bytes) -> dict:
    topic = _get(_query(query), "topic", "MISSING_ARG_TOPIC")
    return {"channels": subkeys(lookupd.db.find_registrations("channel", topic, "*"))}


def lookup(lookupd: NSQLookupd, query: bytes) -> dict:
    topic = _get(_query(query), "topic", "MISSING_ARG_TOPIC")
    db, opts = lookupd.db, lookupd.options
    if not db.find_registrations("topic", topic, ""):
        raise HTTPError(404, "TOPIC_NOT_FOUND")
    producers = filter_active(db.find_producers("topic", topic, ""), opts.inactive_producer_timeout,
                              opts.tombstone_lifetime)
    return {
        "channels": subkeys(db.find_registrations("channel", topic, "*")),
        "producers": [p.peer.public() for p in producers],
    }


def lookup_holds_until(lookupd: NSQLookupd, query: bytes) -> float:
    """Until when (time.monotonic()) /lookup's answer to `query` stays the same while the DB's generation
    does: the first moment a producer of the topic goes quiet (a PING only moves that later) or its
    tombstone's lifetime ends. A producer already quiet could come back with its next PING, which
    changes no generation: such an answer is not kept at all."""
    topic = _get(_query(query), "topic", "MISSING_ARG_TOPIC")
    opts, now = lookupd.options, time.monotonic()
    until = now + opts.inactive_producer_timeout
    for p in lookupd.db.find_producers("topic", topic, ""):
        quiet_at = p.peer.last_update + opts.inactive_producer_timeout
        if quiet_at < now:
            return 0.0
        until = min(until, quiet_at)
        if p.is_tombstoned(opts.tombstone_lifetime):
            until = min(until, p.tombstoned_at + opts.tombstone_lifetime)
    return until


def nodes(lookupd: NSQLookupd, query: bytes) -> dict:
    db, opts = lookupd.db, lookupd.options
    out = []
    topic_producers: dict[str, list] = {}
    # tombstoned producers are listed (lifetime 0), with a tombstone flag per topic
    for p in filter_active(db.find_producers("client", "", ""), opts.inactive_producer_timeout, 0):
        topic_names = keys(filter_registrations(db.lookup_registrations(p.peer.id), "topic", "*", ""))
        tombstones = []
        for t in topic_names:
            if t not in topic_producers:
                topic_producers[t] = db.find_producers("topic", t, "")
            tp = next((x for x in topic_producers[t] if x.peer is p.peer), None)
            tombstones.append(bool(tp and tp.is_tombstoned(opts.tombstone_lifetime)))
        out.append({**p.peer.public(), "tombstones": tombstones, "topics": topic_names})
    return {"producers": out}


def debug(lookupd: NSQLookupd, query: bytes) -> dict:
    now_ns, now = time.time_ns(), time.monotonic()

    def wall_ns(monotonic: float) -> int:
        return now_ns - int((now - monotonic) * 1e9)

    data: dict[str, list] = {}
    for r, producers in lookupd.db.registrations.items():
        for p in producers.values():
            peer = p.peer
            entry = {
                "broadcast_address": peer.broadcast_address, "hostname": peer.hostname,
                "http_port": peer.http_port, "id": peer.id, "last_update": wall_ns(peer.last_update),
                "tcp_port": peer.tcp_port, "tombstoned": p.tombstoned,
                "tombstoned_at": wall_ns(p.tombstoned_at) if p.tombstoned else GO_ZERO_TIME_UNIX_NANO,
                "version": peer.version, **topology_fields(peer.topology_zone, peer.topology_region),
            }
            entry = dict(sorted(entry.items()))  # a Go map: keys sorted
            data.setdefault(f"{r.category}:{r.key}:{r.subkey}", []).append(entry)
    return dict(sorted(data.items()))


def topic_create(lookupd: NSQLookupd, query: bytes) -> None:
    topic = _get(_query(query), "topic", "MISSING_ARG_TOPIC")
    if not is_valid_topic_name(topic):
        raise HTTPError(400, "INVALID_ARG_TOPIC")
    log.info("DB: adding topic(%s)", topic)
    lookupd.db.add_registration(Registration("topic", topic, ""))


def topic_delete(lookupd: NSQLookupd, query: bytes) -> None:
    topic = _get(_query(query), "topic", "MISSING_ARG_TOPIC")
    db = lookupd.db
    for r in db.find_registrations("channel", topic, "*"):
        log.info("DB: removing channel(%s) from topic(%s)", r.subkey, topic)
        db.remove_registration(r)
    for r in db.find_registrations("topic", topic, ""):
        log.info("DB: removing topic(%s)", topic)
        db.remove_registration(r)


def topic_tombstone(lookupd: NSQLookupd, query: bytes) -> None:
    args = _query(query)
    topic = _get(args, "topic", "MISSING_ARG_TOPIC")
    node = _get(args, "node", "MISSING_ARG_NODE")
    log.info("DB: setting tombstone for producer@%s of topic(%s)", node, topic)
    # as Go: no producer matching `node` is not an error (nsqadmin reports PRODUCER_NOT_FOUND itself)
    for p in lookupd.db.find_producers("topic", topic, ""):
        if f"{p.peer.broadcast_address}:{p.peer.http_port}" == node:
            lookupd.db.tombstone(p)


def channel_create(lookupd: NSQLookupd, query: bytes) -> None:
    topic, channel = _topic_channel(_query(query))
    log.info("DB: adding channel(%s) in topic(%s)", channel, topic)
    lookupd.db.add_registration(Registration("channel", topic, channel))
    log.info("DB: adding topic(%s)", topic)
    lookupd.db.add_registration(Registration("topic", topic, ""))


def channel_delete(lookupd: NSQLookupd, query: bytes) -> None:
    topic, channel = _topic_channel(_query(query))
    found = lookupd.db.find_registrations("channel", topic, channel)
    if not found:
        raise HTTPError(404, "CHANNEL_NOT_FOUND")
    log.info("DB: removing channel(%s) from topic(%s)", channel, topic)
    for r in found:
        lookupd.db.remove_registration(r)


@attrs.frozen
class Endpoint:
    """One of nsqlookupd's endpoints: a pure handler and how its value is answered (lookupd_site makes
    each a shared Route, answered in place: none of them awaits)."""

    handler: Handler
    plain: bool = False  # Go's PlainText decorator (only /ping), else V1
    # the answer may be kept (AnswerCache) until this says, given the same DB generation
    holds_until: Callable[[NSQLookupd, bytes], float] | None = None


ANSWERS_KEPT = 1024  # distinct query strings whose answers AnswerCache keeps (then it starts over)


class AnswerCache:
    """Answers kept by query string, for the routes that say how long theirs hold (/lookup). Every
    consumer polls /lookup (go-nsq and pynsq each 60 s, per topic and lookupd), and the answer is the same
    bytes until a broker registers or leaves, a tombstone is set or lapses, or a producer goes quiet: kept,
    it costs a dict lookup instead of the DB walk and the JSON. Owned by lookupd_site's routes."""

    def __init__(self, lookupd: NSQLookupd) -> None:
        self.lookupd = lookupd
        self.kept: dict[bytes, tuple[int, float, Reply]] = {}

    def get(self, query: bytes) -> Reply | None:
        hit = self.kept.get(query)
        if hit is None or hit[0] != self.lookupd.db.generation or time.monotonic() >= hit[1]:
            return None
        return hit[2]

    def keep(self, endpoint: Endpoint, query: bytes, reply: Reply) -> None:
        assert endpoint.holds_until is not None
        until = endpoint.holds_until(self.lookupd, query)
        if until <= time.monotonic():
            self.kept.pop(query, None)
            return
        if len(self.kept) >= ANSWERS_KEPT:
            self.kept.clear()
        self.kept[query] = (self.lookupd.db.generation, until, reply)


# method -> path -> endpoint, as httprouter's trees
ROUTES: dict[str, dict[str, Endpoint]] = {
    "GET": {
        "/ping": Endpoint(ping, plain=True),
        "/info": Endpoint(info),
        "/debug": Endpoint(debug),
        "/lookup": Endpoint(lookup, holds_until=lookup_holds_until),
        "/topics": Endpoint(topics),
        "/channels": Endpoint(channels),
        "/nodes": Endpoint(nodes),
    },
    "POST": {
        "/topic/create": Endpoint(topic_create),
        "/topic/delete": Endpoint(topic_delete),
        "/channel/create": Endpoint(channel_create),
        "/channel/delete": Endpoint(channel_delete),
        "/topic/tombstone": Endpoint(topic_tombstone),
    },
}


ROUTER = Router(ROUTES)


def lookupd_site(lookupd: NSQLookupd, answers: AnswerCache | None = None) -> Site:
    """nsqlookupd's endpoints as the shared HTTP server's Site (`answers`: its AnswerCache, given by a
    test): every one answered in place, a handler's error as nsqlookupd's V1 reply."""
    if answers is None:
        answers = AnswerCache(lookupd)

    def route(endpoint: Endpoint) -> Route:
        def now(req: Request, params: Mapping[str, str]) -> Reply:
            if endpoint.holds_until is not None:
                kept = answers.get(req.query)
                if kept is not None:
                    return kept
            status, value = call_logged(log, lambda: endpoint.handler(lookupd, req.query))
            if endpoint.plain:
                return plain(str(value), status)
            reply = respond_v1(status, value)
            if endpoint.holds_until is not None and status == 200:
                answers.keep(endpoint, req.query, reply)
            return reply

        async def handler(req: Request, params: Mapping[str, str]) -> Reply:
            return now(req, params)

        return Route(handler, now)

    routes = {method: {path: route(endpoint) for path, endpoint in tree.items()} for method, tree in ROUTES.items()}
    return Site(Router(routes), log, max_body=0)
