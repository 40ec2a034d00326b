"""The HTTP layer nsqd and nsqlookupd share, in the role of NSQ's internal/http_api and the router both
daemons use (julienschmidt/httprouter v1.3.0): replies in the V1 shape, Go's query parsing and JSON,
httprouter's dispatch and redirects, and the request log line. Pure: no sockets, no framework; each
shared/http_server writes a Reply's bytes.

httprouter, as the daemons configure it: a route is found in the tree of the request's method; a path
that misses by a trailing slash, or by case or `//`, `.`, `..` (CleanPath), is redirected to the route
(301 for GET, 307 otherwise, the query kept); a path another method has is 405 with `Allow` (OPTIONS is
200 with `Allow`); anything else is 404. Route parameters are httprouter's `:name` segments.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import attrs

from trio_nsq.shared.options import format_duration_ns

JSON_TYPE = "application/json; charset=utf-8"
TEXT_TYPE = "text/plain; charset=utf-8"
HTML_TYPE = "text/html; charset=utf-8"
NSQ_CONTENT_TYPE = ("X-NSQ-Content-Type", "nsq; version=1.0")


class HTTPError(Exception):
    """http_api.Err: answered as {"message": text} with this status."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


# --- replies ---------------------------------------------------------------------------------------


@attrs.frozen
class Reply:
    status: int
    body: bytes | memoryview  # (a memoryview: part of a larger buffer, sent without a copy)
    content_type: str | None = TEXT_TYPE
    # the V1 decorator marks every answer; PlainText (/ping) and the router's own answers do not
    nsq_header: bool = True
    headers: tuple[tuple[str, str], ...] = ()
    # bytes sent after the body, as part of it (a large answer goes out in pieces, never joined)
    more: bytes = b""

    def header_list(self) -> list[tuple[str, str]]:
        out = list(self.headers)
        if self.content_type:
            out.append(("Content-Type", self.content_type))
        if self.nsq_header:
            out.append(NSQ_CONTENT_TYPE)
        return out


OK = Reply(200, b"OK")
EMPTY = Reply(200, b"", None)


def plain(text: str, status: int = 200) -> Reply:
    """http_api.PlainText."""
    return Reply(status, text.encode(), TEXT_TYPE, nsq_header=False)


def ok_json(value: Any) -> Reply:
    return Reply(200, go_json(value), JSON_TYPE)


def error_reply(status: int, text: str) -> Reply:
    return Reply(status, go_json({"message": text}), JSON_TYPE)


def respond_v1(status: int, value: Any) -> Reply:
    """http_api.RespondV1: 200 with nothing is an empty body, a string is text, anything else JSON;
    an error status carries {"message": value}."""
    if status == 200 and value is None:
        return EMPTY
    if status == 200 and isinstance(value, str):
        return Reply(200, value.encode(), TEXT_TYPE)
    return ok_json(value) if status == 200 else error_reply(status, value)


# --- Go's encoding/json, url.ParseQuery and strconv ----------------------------------------------

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


def go_number(value: float) -> float:
    """A float64 as json.Marshal writes it: a whole number without ".0" (1, not 1.0; 59815304, not
    59815304.0). go_json cannot do this for every float without walking the value, so the few places
    that put floats into JSON (e2e percentiles, float options) pass them through here."""
    if type(value) is float and value.is_integer() and abs(value) < 1e21:
        return int(value)
    return value


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


_GO_INT = re.compile(r"[+-]?[0-9]+")


def parse_go_int(text: str) -> int:
    """strconv.ParseInt(s, 10, 64)."""
    if not _GO_INT.fullmatch(text):
        raise ValueError(text)
    value = int(text)
    if not -(1 << 63) <= value < (1 << 63):
        raise ValueError(text)
    return value


# --- httprouter v1.3.0 -----------------------------------------------------------------------------

H = TypeVar("H")


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
class Resolved(Generic[H]):
    """What the router does with a request: kind is handle, redirect, options, not_allowed or not_found."""

    kind: str
    handler: H | None = None
    params: Mapping[str, str] = attrs.Factory(dict)
    location: str = ""
    status: int = 0
    allow: str = ""


class Router(Generic[H]):
    """httprouter's Router for static routes and `:name` parameter segments. Routes: method -> pattern
    -> handler (whatever the daemon dispatches on)."""

    def __init__(self, routes: Mapping[str, Mapping[str, H]]) -> None:
        self.routes = routes
        self._split = {method: [(pattern, pattern.split("/"), handler) for pattern, handler in tree.items()]
                       for method, tree in routes.items()}
        # a path spelled exactly as a route without parameters: found by one look-up (the hot routes)
        self._exact = {(method, pattern): Resolved("handle", handler=handler)
                       for method, tree in routes.items() for pattern, handler in tree.items() if ":" not in pattern}

    def _match(self, method: str, path: str, fold: bool = False) -> tuple[str, H, dict[str, str]] | None:
        """The route of `method` that `path` names (ignoring case if fold): its spelling, handler, params."""
        parts = path.split("/")
        for _, pattern, handler in self._split.get(method, ()):
            if len(pattern) != len(parts):
                continue
            params: dict[str, str] = {}
            spelled: list[str] = []
            for want, got in zip(pattern, parts):
                if want.startswith(":"):
                    if not got:
                        break
                    params[want[1:]] = got
                    spelled.append(got)
                elif want == got or (fold and want.lower() == got.lower()):
                    spelled.append(want)
                else:
                    break
            else:
                return "/".join(spelled), handler, params
        return None

    def allowed(self, path: str, method: str) -> str:
        """The Allow header: the other methods that have `path`, plus OPTIONS, sorted; "" if none."""
        methods = [m for m in self.routes if m not in (method, "OPTIONS") and self._match(m, path)]
        return ", ".join(sorted(methods + ["OPTIONS"])) if methods else ""

    def resolve(self, method: str, path: str) -> Resolved[H]:
        """Router.ServeHTTP."""
        exact = self._exact.get((method, path))
        if exact is not None:
            return exact
        if method in self.routes:
            found = self._match(method, path)
            if found is not None:
                return Resolved("handle", handler=found[1], params=found[2])
            if method != "CONNECT" and path != "/":
                status = 301 if method == "GET" else 307
                other = path[:-1] if len(path) > 1 and path.endswith("/") else path + "/"
                if self._match(method, other):
                    return Resolved("redirect", location=other, status=status)
                fixed = self._case_insensitive(method, clean_path(path))
                if fixed is not None:
                    return Resolved("redirect", location=fixed, status=status)
        allow = self.allowed(path, method)
        if allow:
            return Resolved("options" if method == "OPTIONS" else "not_allowed", allow=allow)
        return Resolved("not_found")

    def _case_insensitive(self, method: str, path: str) -> str | None:
        """findCaseInsensitivePath with fixTrailingSlash: the route's own spelling, or None."""
        other = path[:-1] if len(path) > 1 and path.endswith("/") else path + "/"
        for candidate in (path, other):
            found = self._match(method, candidate, fold=True)
            if found is not None:
                return found[0]
        return None


def redirect_reply(method: str, location: str, status: int) -> Reply:
    """Go's http.Redirect: Location (non-ASCII bytes %-escaped), and for GET a short HTML body.

    `location` holds one character per byte (the query is decoded as latin-1), so bytes round-trip.
    """
    reason = {301: "Moved Permanently", 307: "Temporary Redirect"}[status]
    headers = (("Location", "".join(c if ord(c) < 0x80 else f"%{ord(c):x}" for c in location)),)
    if method == "GET":
        href = (location.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
                .replace('"', "&#34;").replace("'", "&#39;"))
        body = f'<a href="{href}">{reason}</a>.\n\n'.encode("latin-1")
        return Reply(status, body, HTML_TYPE, nsq_header=False, headers=headers)
    return Reply(status, b"", None, nsq_header=False, headers=headers)


def routed_reply(method: str, query: bytes, where: Resolved[Any]) -> Reply | None:
    """The router's own answer (redirect, OPTIONS, 405, 404), or None when a handler answers."""
    if where.kind == "handle":
        return None
    if where.kind == "redirect":
        location = where.location + ("?" + query.decode("latin-1") if query else "")
        return redirect_reply(method, location, where.status)
    if where.kind == "options":
        return Reply(200, b"", None, nsq_header=False, headers=(("Allow", where.allow),))
    if where.kind == "not_allowed":
        return attrs.evolve(error_reply(405, "METHOD_NOT_ALLOWED"), headers=(("Allow", where.allow),))
    return error_reply(404, "NOT_FOUND")


# --- logging ---------------------------------------------------------------------------------------


def log_request(log: logging.Logger, status: int, method: str, uri: str, remote: str, elapsed_ns: int) -> None:
    """http_api.Log's line: `200 GET /ping (127.0.0.1:5000) 41.2µs`."""
    if log.isEnabledFor(logging.INFO):
        log.info("%d %s %s (%s) %s", status, method, uri, remote, format_duration_ns(elapsed_ns))


def call_logged(log: logging.Logger, handler: Callable[[], Any]) -> tuple[int, Any]:
    """Run a handler as the daemons' Decorate chain does: (200, value), (err.status, err.text) for an
    HTTPError, and for anything else Go's PanicHandler: one log line, 500 INTERNAL_ERROR."""
    try:
        return 200, handler()
    except HTTPError as err:
        return err.status, err.text
    except Exception as exc:  # our bug, not the client's input: worth its traceback
        log.error("panic in HTTP handler - %r", exc, exc_info=exc)
        return 500, "INTERNAL_ERROR"
