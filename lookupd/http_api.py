"""nsqlookupd's HTTP API (nsqlookupd/http.go) on quart-trio: the same paths, status codes and JSON."""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from lookupd.registration_db import Registration, filter_active, keys, subkeys
from shared.names import is_valid_channel_name, is_valid_topic_name
from shared.version import VERSION

if TYPE_CHECKING:
    from lookupd.nsqlookupd import NSQLookupd

log = logging.getLogger("nsqlookupd")

JSON_TYPE = "application/json; charset=utf-8"


class HTTPError(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


def reply(status: int, value: Any, *, plain: bool = False) -> Response:
    if plain:
        response = Response(value, status=status, content_type="text/plain; charset=utf-8")
    else:
        body = b"" if value is None else json.dumps(value, separators=(",", ":")).encode()
        response = Response(body, status=status, content_type=JSON_TYPE)
        response.headers["X-NSQ-Content-Type"] = "nsq; version=1.0"
    return response


def _arg(name: str, missing: str) -> str:
    values = request.args.getlist(name)
    if not values:
        raise HTTPError(400, missing)
    return values[0]


def _topic_channel() -> tuple[str, str]:
    """Go's http_api.GetTopicChannelArgs."""
    topic = _arg("topic", "MISSING_ARG_TOPIC")
    if not is_valid_topic_name(topic):
        raise HTTPError(400, "INVALID_ARG_TOPIC")
    channel = _arg("channel", "MISSING_ARG_CHANNEL")
    if not is_valid_channel_name(channel):
        raise HTTPError(400, "INVALID_ARG_CHANNEL")
    return topic, channel


def create_app(lookupd: NSQLookupd) -> QuartTrio:
    app = QuartTrio(__name__)
    db = lookupd.db
    opts = lookupd.options

    def route(rule: str, method: str):
        def wrap(fn):
            async def view() -> Response:
                start = time.perf_counter()
                try:
                    response = fn()
                except HTTPError as err:
                    response = reply(err.status, {"message": err.text})
                log.debug("%d %s %s (%s) %.3fms", response.status_code, request.method, request.full_path,
                          request.remote_addr, (time.perf_counter() - start) * 1000)
                return response

            view.__name__ = fn.__name__
            app.add_url_rule(rule, fn.__name__, view, methods=[method])
            return fn

        return wrap

    @route("/ping", "GET")
    def ping() -> Response:
        return reply(200, "OK", plain=True)

    @route("/info", "GET")
    def info() -> Response:
        return reply(200, {"version": VERSION})

    @route("/topics", "GET")
    def topics() -> Response:
        return reply(200, {"topics": keys(db.find_registrations("topic", "*", ""))})

    @route("/channels", "GET")
    def channels() -> Response:
        topic = _arg("topic", "MISSING_ARG_TOPIC")
        return reply(200, {"channels": subkeys(db.find_registrations("channel", topic, "*"))})

    @route("/lookup", "GET")
    def lookup() -> Response:
        topic = _arg("topic", "MISSING_ARG_TOPIC")
        if not db.find_registrations("topic", topic, ""):
            raise HTTPError(404, "TOPIC_NOT_FOUND")
        producers = filter_active(db.find_producers("topic", topic, ""), opts.inactive_producer_timeout,
                                  opts.tombstone_lifetime)
        return reply(200, {
            "channels": subkeys(db.find_registrations("channel", topic, "*")),
            "producers": [p.peer.public() for p in producers],
        })

    @route("/nodes", "GET")
    def nodes() -> Response:
        out = []
        for p in filter_active(db.find_producers("client", "", ""), opts.inactive_producer_timeout, 0):
            topic_names = keys([r for r in db.lookup_registrations(p.peer.id) if r.category == "topic"])
            tombstones = []
            for t in topic_names:
                tp = next((x for x in db.find_producers("topic", t, "") if x.peer is p.peer), None)
                tombstones.append(bool(tp and tp.is_tombstoned(opts.tombstone_lifetime)))
            out.append({**p.peer.public(), "tombstones": tombstones, "topics": topic_names})
        return reply(200, {"producers": out})

    @route("/debug", "GET")
    def debug() -> Response:
        data: dict[str, list] = {}
        for r, producers in db.registrations.items():
            key = f"{r.category}:{r.key}:{r.subkey}"
            for p in producers.values():
                data.setdefault(key, []).append({
                    "id": p.peer.id, **p.peer.public(),
                    "last_update": int((time.time() - (time.monotonic() - p.peer.last_update)) * 1e9),
                    "tombstoned": p.tombstoned,
                    "tombstoned_at": int((time.time() - (time.monotonic() - p.tombstoned_at)) * 1e9)
                    if p.tombstoned else 0,
                })
        return reply(200, data)

    @route("/topic/create", "POST")
    def topic_create() -> Response:
        topic = _arg("topic", "MISSING_ARG_TOPIC")
        if not is_valid_topic_name(topic):
            raise HTTPError(400, "INVALID_ARG_TOPIC")
        log.info("DB: adding topic(%s)", topic)
        db.add_registration(Registration("topic", topic, ""))
        return reply(200, None)

    @route("/topic/delete", "POST")
    def topic_delete() -> Response:
        topic = _arg("topic", "MISSING_ARG_TOPIC")
        for r in db.find_registrations("channel", topic, "*"):
            log.info("DB: removing channel(%s) from topic(%s)", r.subkey, topic)
            db.remove_registration(r)
        for r in db.find_registrations("topic", topic, ""):
            log.info("DB: removing topic(%s)", topic)
            db.remove_registration(r)
        return reply(200, None)

    @route("/topic/tombstone", "POST")
    def topic_tombstone() -> Response:
        topic = _arg("topic", "MISSING_ARG_TOPIC")
        node = _arg("node", "MISSING_ARG_NODE")
        log.info("DB: setting tombstone for producer@%s of topic(%s)", node, topic)
        for p in db.find_producers("topic", topic, ""):
            if f"{p.peer.broadcast_address}:{p.peer.http_port}" == node:
                p.tombstone()
        return reply(200, None)

    @route("/channel/create", "POST")
    def channel_create() -> Response:
        topic, channel = _topic_channel()
        log.info("DB: adding channel(%s) in topic(%s)", channel, topic)
        db.add_registration(Registration("channel", topic, channel))
        db.add_registration(Registration("topic", topic, ""))
        return reply(200, None)

    @route("/channel/delete", "POST")
    def channel_delete() -> Response:
        topic, channel = _topic_channel()
        found = db.find_registrations("channel", topic, channel)
        if not found:
            raise HTTPError(404, "CHANNEL_NOT_FOUND")
        log.info("DB: removing channel(%s) from topic(%s)", channel, topic)
        for r in found:
            db.remove_registration(r)
        return reply(200, None)

    @app.errorhandler(404)
    async def not_found(exc: HTTPException) -> Response:
        return reply(404, {"message": "NOT_FOUND"})

    @app.errorhandler(405)
    async def not_allowed(exc: MethodNotAllowed) -> Response:
        return reply(405, {"message": "METHOD_NOT_ALLOWED"})

    @app.errorhandler(Exception)
    async def internal(exc: Exception) -> Response:
        if isinstance(exc, HTTPException):
            return reply(exc.code or 500, {"message": (exc.name or "ERROR").upper().replace(" ", "_")})
        log.error("panic in HTTP handler - %r", exc, exc_info=exc)
        return reply(500, {"message": "INTERNAL_ERROR"})

    return app
