"""nsqlookupd's HTTP API (nsqlookupd/http.go) on quart-trio: the same paths, methods, status codes and bodies.

Modern nsqlookupd answers every client alike, whatever its Accept header: plain JSON, no
{"status_code", "data"} envelope (pynsq and gnsq take both), `X-NSQ-Content-Type: nsq; version=1.0`,
errors as `{"message": "TOPIC_NOT_FOUND"}`. Go's routing is httprouter v1.3.0's, and a client sees it,
so it is copied rather than left to werkzeug: an unknown path is 404 NOT_FOUND, a known path with
another method 405 METHOD_NOT_ALLOWED with `Allow`, OPTIONS answers `Allow`, a trailing slash or a
wrongly cased path is redirected (301 for GET, 307 otherwise). The query string is parsed as Go's
url.ParseQuery does (a bad %-escape or a `;` is 400 INVALID_REQUEST) and only by the handlers that parse
it in Go. Bodies are encoded as Go's encoding/json does: struct fields in order, map keys sorted, `<>&`
escaped. Go's /debug/pprof is not served.

The pieces are pure functions (`resolve`, `parse_query`, `clean_path`, `go_json` and the handlers) that
the tests call directly; `create_app` wires them into Quart.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
from quart import Response, request
from quart_trio import QuartTrio

from lookupd.registration_db import Registration, filter_active, filter_registrations, keys, subkeys
from shared.http import join_host_port
from shared.names import is_valid_channel_name, is_valid_topic_name
from shared.options import format_duration
from shared.version import VERSION

if TYPE_CHECKING:
    from lookupd.nsqlookupd import NSQLookupd

log = logging.getLogger("nsqlookupd")

JSON_TYPE = "application/json; charset=utf-8"
TEXT_TYPE = "text/plain; charset=utf-8"
HTML_TYPE = "text/html; charset=utf-8"
NSQ_CONTENT_TYPE = "nsq; version=1.0"

# Go's time.Time{}.UnixNano(): what /debug reports as tombstoned_at for a producer never tombstoned.
GO_ZERO_TIME_UNIX_NANO = -6795364578871345152


class HTTPError(Exception):
    """Go's http_api.Err: a status code and the text that becomes {"message": text}."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


# --- Go's encoding/json and url.ParseQuery -------------------------------------------------------

_GO_JSON_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def go_json(value: Any) -> bytes:
    """json.Marshal's bytes: compact, UTF-8 unescaped, but <, >, &, U+2028 and U+2029 escaped.

    Dict order is kept: build Go maps with sorted keys and structs in field order.
    """
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    # these characters can only occur inside JSON strings, so replacing them in the text is safe
    for char, escape in _GO_JSON_ESCAPES.items():
        if char in text:
            text = text.replace(char, escape)
    return text.encode("utf-8", "replace")


_HEX = "0123456789abcdefABCDEF"


def go_query_unescape(text: str) -> str:
    """url.QueryUnescape: '+' is a space, %XX a byte; a bad escape is a ValueError."""
    if "%" not in text and "+" not in text:
        return text
    out = bytearray()
    raw = text.encode("utf-8", "surrogateescape")
    i = 0
    while i < len(raw):
        c = raw[i]
        if c == 0x25:  # %
            hexdigits = raw[i + 1 : i + 3].decode("latin-1")
            if len(hexdigits) < 2 or any(h not in _HEX for h in hexdigits):
                raise ValueError(f"invalid URL escape {raw[i:i + 3]!r}")
            out.append(int(hexdigits, 16))
            i += 3
        else:
            out.append(0x20 if c == 0x2B else c)
            i += 1
    return out.decode("utf-8", "surrogateescape")


def parse_query(raw: bytes | str) -> dict[str, list[str]]:
    """url.ParseQuery: values by key in order; the first error (a ';', a bad escape) is raised after
    the whole string is read, as Go returns the values with the first error."""
    text = raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else raw
    values: dict[str, list[str]] = {}
    error: ValueError | None = None
    for part in text.split("&"):
        if not part:
            continue
        if ";" in part:
            error = error or ValueError("invalid semicolon separator in query")
            continue
        key, _, value = part.partition("=")
        try:
            key, value = go_query_unescape(key), go_query_unescape(value)
        except ValueError as exc:
            error = error or exc
            continue
        values.setdefault(key, []).append(value)
    if error is not None:
        raise error
    return values


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
            entry = {  # a Go map: keys sorted
                "broadcast_address": peer.broadcast_address, "hostname": peer.hostname,
                "http_port": peer.http_port, "id": peer.id, "last_update": wall_ns(peer.last_update),
                "tcp_port": peer.tcp_port, "tombstoned": p.tombstoned,
                "tombstoned_at": wall_ns(p.tombstoned_at) if p.tombstoned else GO_ZERO_TIME_UNIX_NANO,
                "topology_region": peer.topology_region, "topology_zone": peer.topology_zone,
                "version": peer.version,
            }
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
            p.tombstone()


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
class Route:
    handler: Handler
    plain: bool = False  # Go's PlainText decorator (only /ping), else V1


# method -> path -> route, as httprouter's trees
ROUTES: dict[str, dict[str, Route]] = {
    "GET": {
        "/ping": Route(ping, plain=True),
        "/info": Route(info),
        "/debug": Route(debug),
        "/lookup": Route(lookup),
        "/topics": Route(topics),
        "/channels": Route(channels),
        "/nodes": Route(nodes),
    },
    "POST": {
        "/topic/create": Route(topic_create),
        "/topic/delete": Route(topic_delete),
        "/channel/create": Route(channel_create),
        "/channel/delete": Route(channel_delete),
        "/topic/tombstone": Route(topic_tombstone),
    },
}


# --- httprouter v1.3.0's dispatch ----------------------------------------------------------------


def clean_path(p: str) -> str:
    """httprouter.CleanPath: rooted, no '.', '..' or empty elements; a trailing slash (or a final '.')
    is kept as a trailing slash."""
    if not p:
        return "/"
    elements = p.split("/")
    trailing = (len(p) > 1 and p.endswith("/")) or elements[-1] == "."
    parts: list[str] = []
    for element in elements:
        if element in ("", "."):
            continue
        if element == "..":
            if parts:
                parts.pop()
            continue
        parts.append(element)
    cleaned = "/" + "/".join(parts)
    if trailing and cleaned != "/":
        cleaned += "/"
    return cleaned


@attrs.frozen
class Resolved:
    """What the router does with a request: kind is handle, redirect, options, not_allowed or not_found."""

    kind: str
    route: Route | None = None
    location: str = ""
    status: int = 0
    allow: str = ""


def allowed(path: str, method: str, routes: dict[str, dict[str, Route]] = ROUTES) -> str:
    """The Allow header: the other methods that have `path`, plus OPTIONS, sorted; "" if none."""
    methods = [m for m, tree in routes.items() if m not in (method, "OPTIONS") and path in tree]
    return ", ".join(sorted(methods + ["OPTIONS"])) if methods else ""


def resolve(method: str, path: str, routes: dict[str, dict[str, Route]] = ROUTES) -> Resolved:
    """Router.ServeHTTP, for static routes."""
    tree = routes.get(method)
    if tree is not None:
        if path in tree:
            return Resolved("handle", route=tree[path])
        if method != "CONNECT" and path != "/":
            status = 301 if method == "GET" else 307
            other = path[:-1] if len(path) > 1 and path.endswith("/") else path + "/"
            if other in tree:
                return Resolved("redirect", location=other, status=status)
            fixed = _case_insensitive(tree, clean_path(path))
            if fixed is not None:
                return Resolved("redirect", location=fixed, status=status)
    allow = allowed(path, method, routes)
    if allow:
        return Resolved("options" if method == "OPTIONS" else "not_allowed", allow=allow)
    return Resolved("not_found")


def _case_insensitive(tree: dict[str, Route], path: str) -> str | None:
    """findCaseInsensitivePath with fixTrailingSlash: the route's own spelling, or None."""
    folded = {p.lower(): p for p in tree}
    candidates = [path.lower()]
    if len(path) > 1 and path.endswith("/"):
        candidates.append(path[:-1].lower())
    else:
        candidates.append(path.lower() + "/")
    for candidate in candidates:
        if candidate in folded:
            return folded[candidate]
    return None


# --- responses -------------------------------------------------------------------------------------


def respond_v1(status: int, value: Any) -> Response:
    """Go's http_api.RespondV1."""
    if status == 200 and value is None:
        response = Response(b"", status=200)
        del response.headers["Content-Type"]
    elif status == 200 and isinstance(value, str):
        response = Response(value.encode(), status=200, content_type=TEXT_TYPE)
    else:
        body = go_json(value) if status == 200 else go_json({"message": value})
        response = Response(body, status=status, content_type=JSON_TYPE)
    response.headers["X-NSQ-Content-Type"] = NSQ_CONTENT_TYPE
    return response


def _redirect(method: str, location: str, status: int) -> Response:
    """Go's http.Redirect: Location (non-ASCII bytes %-escaped), and for GET a short HTML body.
    Only GET and POST have routes, so only they are ever redirected.

    `location` holds one character per byte (the query is decoded as latin-1), so bytes round-trip.
    """
    reason = {301: "Moved Permanently", 307: "Temporary Redirect"}[status]
    if method == "GET":
        href = (location.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
                .replace('"', "&#34;").replace("'", "&#39;"))
        body = f'<a href="{href}">{reason}</a>.\n\n'.encode("latin-1")
        response = Response(body, status=status, content_type=HTML_TYPE)
    else:
        response = Response(b"", status=status)
        del response.headers["Content-Type"]
    response.headers["Location"] = "".join(c if ord(c) < 0x80 else f"%{ord(c):x}" for c in location)
    return response


def create_app(lookupd: NSQLookupd) -> QuartTrio:
    app = QuartTrio(__name__)

    @app.before_request
    async def dispatch() -> Response:
        # every request is answered here, so werkzeug's routing never gets a say
        start = time.perf_counter()
        # the ASGI path as received (percent-decoded), as Go's URL.Path: Quart's request.path is normalised
        method, path = request.method, request.scope.get("path") or request.path
        query = request.query_string
        where = resolve(method, path)
        if where.kind == "redirect":
            location = where.location + ("?" + query.decode("latin-1") if query else "")
            return _redirect(method, location, where.status)
        if where.kind == "options":
            response = Response(b"", status=200)
            del response.headers["Content-Type"]
            response.headers["Allow"] = where.allow
            return response
        if where.kind == "handle":
            assert where.route is not None
            response = _call(where.route, lookupd, query)
        elif where.kind == "not_allowed":
            response = respond_v1(405, "METHOD_NOT_ALLOWED")
            response.headers["Allow"] = where.allow
        else:
            response = respond_v1(404, "NOT_FOUND")
        _log_request(response.status_code, method, query, time.perf_counter() - start)
        return response

    return app


def _call(route: Route, lookupd: NSQLookupd, query: bytes) -> Response:
    try:
        value = route.handler(lookupd, query)
    except HTTPError as err:
        status, value = err.status, err.text
    except Exception as exc:  # Go's PanicHandler: one request fails, the server goes on
        log.error("panic in HTTP handler - %r", exc, exc_info=exc)
        status, value = 500, "INTERNAL_ERROR"
    else:
        status = 200
    if route.plain:
        return Response(str(value).encode(), status=status, content_type=TEXT_TYPE)
    return respond_v1(status, value)


def _log_request(status: int, method: str, query: bytes, elapsed: float) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    scope = request.scope
    uri = scope.get("raw_path", b"").decode("latin-1") or request.path
    if query:
        uri += "?" + query.decode("latin-1")
    client = scope.get("client") or ("", 0)
    log.info("%d %s %s (%s) %s", status, method, uri, join_host_port(client[0], client[1]), format_duration(elapsed))
