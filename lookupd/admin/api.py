"""nsqadmin 1.3.0's HTTP API: the same paths, methods and JSON shapes, the actions and their
notifications, `/config/:opt`, and the page (static/) under --base-path.

Routing is shared/http_api's httprouter; answers are nsqadmin's: JSON with a `message` ("" or the
nodes that failed), 400 {"message": ...} for a bad request, 403 for an action a non-admin asks for,
404 for an unknown topic, 502 when no node answered.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import trio

from trio_nsq.lookupd.admin.cluster import (
    Cluster,
    Errors,
    aggregate_channel,
    aggregate_topic,
    node_topic_rows,
    replica_ids,
    replication_source,
    replication_view,
)
from trio_nsq.lookupd.admin.options import Options
from trio_nsq.shared.http_api import (
    HTML_TYPE,
    JSON_TYPE,
    HTTPError,
    Reply,
    Router,
    go_json,
    plain,
)
from trio_nsq.shared.http_server import Request, Route, Site
from trio_nsq.shared.names import is_valid_channel_name, is_valid_topic_name
from trio_nsq.shared.version import VERSION

log = logging.getLogger("nsqadmin")

STATIC = Path(__file__).parent / "static"
STATIC_TYPES = {".html": HTML_TYPE, ".js": "application/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
MAX_BODY = 1 << 20  # an action's JSON body
MESSAGES_LIMIT = 100  # rows a node gives the channel page's look at its messages


def _client_host(request: Request) -> str:
    return request.remote.rpartition(":")[0].strip("[]")



def _ok(value: dict[str, Any], errors: Errors | None = None) -> Reply:
    return Reply(200, go_json({**value, "message": errors.message() if errors else ""}), JSON_TYPE)


class Admin:
    """The handlers; one per process, called by admin_site's Site for each request."""

    def __init__(self, options: Options, cluster: Cluster) -> None:
        self.options = options
        self.cluster = cluster
        self.nursery: trio.Nursery | None = None  # where notifications are sent from (set by create_app)

    # --- reads ------------------------------------------------------------------------------------

    async def topics(self, req: Request, params: Mapping[str, str]) -> Reply:
        errors = Errors()
        names = await self.cluster.topics(errors)
        if not names and errors.failed and len(errors.failed) >= len(self.cluster.lookupds or self.cluster.nsqds):
            raise HTTPError(502, f"UPSTREAM_ERROR: {errors.message()}")
        return _ok({"topics": names}, errors)

    async def _topic_rows(self, topic: str, errors: Errors,
                          every_node: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The topic's row on each node that has it: the nodes the lookupds list for it (a page), or every
        node they know, tombstoned for the topic or not (`every_node`: an action reaches them all)."""
        if every_node:
            producers = await self.cluster.producers(errors)
        else:
            producers = await self.cluster.topic_producers(topic, errors)
        nodes = [p["node"] for p in producers]
        stats = await self.cluster.stats(nodes, errors, topic)
        return node_topic_rows(stats, producers, topic), producers

    async def topic(self, req: Request, params: Mapping[str, str]) -> Reply:
        errors = Errors()
        topic = params["topic"]
        producers = await self.cluster.topic_producers(topic, errors)
        nodes = [p["node"] for p in producers]
        found: dict[str, Any] = {}

        async def stats() -> None:
            found["stats"] = await self.cluster.stats(nodes, errors, topic)

        async def settings() -> None:
            found["settings"] = await self._settings_of(nodes, f"/topic/config?topic={_q(topic)}")
        # side by side: the page waits for one round trip after the lookupds', as Go's nsqadmin's does
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stats)
            nursery.start_soon(settings)
        rows = node_topic_rows(found["stats"], producers, topic)
        if not rows:
            raise HTTPError(404, "TOPIC_NOT_FOUND" if not errors.failed else f"UPSTREAM_ERROR: {errors.message()}")
        out = aggregate_topic(rows)
        out["settings"] = found["settings"]
        source = replication_source(rows)
        if source is not None:  # (absent, not null, for a topic not replicated: nsqadmin's keys stay its own)
            out["replication"] = await self._replication(topic, source, rows)
        return _ok(out, errors)

    async def _replication(self, topic: str, source: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
        """A replicated topic's replicas, each as it reports itself: the followers are not in nsqlookupd (only the
        leader registers a replicated topic), so they are asked by their broker id, which is their HTTP address.
        One that does not answer (a killed leader, until its lease expires) is shown as unreachable: it is not
        an error of the page."""
        known = {r["node"]: r.get("replication") for r in rows}
        missing = [replica for replica in replica_ids(source) if replica not in known]
        stats = await self.cluster.stats(missing, Errors(), topic) if missing else {}
        for replica, answer in stats.items():
            known[replica] = next((t.get("replication") for t in answer.get("topics") or []
                                   if t.get("topic_name") == topic), None)
        return replication_view(source, {k: v for k, v in known.items() if isinstance(v, dict)})

    async def channel(self, req: Request, params: Mapping[str, str]) -> Reply:
        errors = Errors()
        rows, _ = await self._topic_rows(params["topic"], errors)
        channel_rows = [c for r in rows for c in r["channels"] if c["channel_name"] == params["channel"]]
        if not channel_rows:
            raise HTTPError(404, "CHANNEL_NOT_FOUND")
        out = aggregate_channel(channel_rows)
        query = f"topic={_q(params['topic'])}&channel={_q(params['channel'])}"
        out["settings"] = await self._settings(channel_rows, f"/channel/config?{query}")
        return _ok(out, errors)

    async def channel_messages(self, req: Request, params: Mapping[str, str]) -> Reply:
        """trio-nsqd's /channel/messages on every node that has the channel (`state`: in_flight, deferred or
        queued; `limit`, at most MESSAGES_LIMIT a node): the rows with their node, `count` summed. A Go
        nsqd has no such endpoint: its 404 is reported in `message`."""
        query = urllib.parse.parse_qs(req.query.decode("latin-1"))
        state = (query.get("state") or ["in_flight"])[-1]
        if state not in ("in_flight", "deferred", "queued"):
            raise HTTPError(400, "INVALID_ARG_STATE")
        limit_text = (query.get("limit") or [str(MESSAGES_LIMIT)])[-1]
        if not limit_text.isdigit() or int(limit_text) > MESSAGES_LIMIT:
            raise HTTPError(400, "INVALID_ARG_LIMIT")
        topic, channel = params["topic"], params["channel"]
        errors = Errors()
        rows, _ = await self._topic_rows(topic, errors)
        nodes = sorted({r["node"] for r in rows for c in r["channels"] if c["channel_name"] == channel})
        if not nodes:
            raise HTTPError(404, "CHANNEL_NOT_FOUND")
        path = f"/channel/messages?topic={_q(topic)}&channel={_q(channel)}&state={state}&limit={limit_text}"
        count = 0
        messages: list[dict[str, Any]] = []
        for node in nodes:
            try:
                answer = await self.cluster.get_json(node, path)
            except (httpx.HTTPError, ValueError) as exc:
                errors.add(node, exc)
                continue
            count += int(answer.get("count", 0))
            messages.extend(dict(m, node=node) for m in answer.get("messages") or [])
        return _ok({"state": state, "count": count, "messages": messages}, errors)

    async def _settings(self, rows: list[dict[str, Any]], path: str) -> dict[str, Any] | None:
        return await self._settings_of([r["node"] for r in rows], path)

    async def _settings_of(self, nodes: list[str], path: str) -> dict[str, Any] | None:
        """trio-nsqd's settings of the topic or channel, as the first node that has them answers (a Go
        nsqd has none: 404); None when no node does. Each node keeps its own: the page edits them all."""
        for node in sorted(set(nodes)):
            try:
                answer = await self.cluster.get_json(node, path)
            except (httpx.HTTPError, ValueError):
                continue
            if isinstance(answer, dict) and "effective" in answer:
                return {"config": answer.get("config", {}), "effective": answer["effective"]}
        return None

    async def nodes(self, req: Request, params: Mapping[str, str]) -> Reply:
        errors = Errors()
        producers = await self.cluster.producers(errors)
        return _ok({"nodes": [{k: v for k, v in p.items() if k != "node"} for p in producers]}, errors)

    async def node(self, req: Request, params: Mapping[str, str]) -> Reply:
        errors = Errors()
        node = params["node"]
        producers = await self.cluster.producers(errors)
        if node not in {p["node"] for p in producers} and node not in self.cluster.nsqds:
            raise HTTPError(404, "NODE_NOT_FOUND")
        stats = await self.cluster.stats([node], errors)
        rows = node_topic_rows(stats, producers)
        return _ok({
            "node": node, "topics": rows,
            "total_messages": sum(r["message_count"] for r in rows),
            "total_clients": sum(c["client_count"] for r in rows for c in r["channels"]),
        }, errors)

    async def counter(self, req: Request, params: Mapping[str, str]) -> Reply:
        errors = Errors()
        producers = await self.cluster.producers(errors)
        stats = await self.cluster.stats([p["node"] for p in producers], errors)
        out: dict[str, Any] = {}
        for row in node_topic_rows(stats, producers):
            for c in row["channels"]:
                key = f"{row['topic_name']}:{c['channel_name']}:{row['node']}"
                out[key] = {"node": row["node"], "topic_name": row["topic_name"], "channel_name": c["channel_name"],
                            "message_count": c["message_count"]}
        return _ok({"stats": out}, errors)

    async def graphite(self, req: Request, params: Mapping[str, str]) -> Reply:
        raise HTTPError(404, "NOT_FOUND")  # only with --graphite-url, which this nsqadmin does not proxy

    async def ping(self, req: Request, params: Mapping[str, str]) -> Reply:
        return plain("OK")

    # --- actions ----------------------------------------------------------------------------------

    def _admin(self, req: Request) -> str:
        """The acting user; 403 when --admin-user is set and the ACL header names none of them."""
        user = req.headers.get(self.options.acl_http_header.lower(), "")
        if self.options.admin_users and user not in self.options.admin_users:
            raise HTTPError(403, "FORBIDDEN")
        return user

    @staticmethod
    async def _body(req: Request) -> bytes:
        """The request's body, up to MAX_BODY (413 past it)."""
        body = await req.read(MAX_BODY)
        if body is None:
            raise HTTPError(413, "REQUEST_ENTITY_TOO_LARGE")
        return body

    async def _json_body(self, req: Request) -> dict[str, Any]:
        body = await self._body(req)
        try:
            value = json.loads(body or b"{}")
        except ValueError:
            raise HTTPError(400, "INVALID_BODY") from None
        if not isinstance(value, dict):
            raise HTTPError(400, "INVALID_BODY")
        return value

    async def _on_nodes(self, topic: str, path: str, errors: Errors,
                        post: Callable[[str, str], Awaitable[Any]] | None = None) -> list[Any]:
        """POST path on every nsqd that has the topic (through `post`, cluster.post by default); what each
        that took it answered (one entry a node)."""
        rows, _ = await self._topic_rows(topic, errors, every_node=True)
        post = post or self.cluster.post
        answers: list[Any] = []
        for node in sorted({r["node"] for r in rows}):
            try:
                answers.append(await post(node, path))
            except httpx.HTTPError as exc:
                errors.add(node, exc)
        return answers

    async def _on_lookupds(self, path: str, errors: Errors) -> None:
        for lookupd in self.cluster.lookupds:
            try:
                await self.cluster.post(lookupd, path)
            except httpx.HTTPError as exc:
                errors.add(lookupd, exc)

    async def create(self, req: Request, params: Mapping[str, str]) -> Reply:
        user = self._admin(req)
        args = await self._json_body(req)
        topic, channel = str(args.get("topic", "")), str(args.get("channel", ""))
        if not is_valid_topic_name(topic):
            raise HTTPError(400, "INVALID_TOPIC")
        if channel and not is_valid_channel_name(channel):
            raise HTTPError(400, "INVALID_CHANNEL")
        errors = Errors()
        await self._on_lookupds(f"/topic/create?topic={topic}", errors)
        if channel:
            await self._on_lookupds(f"/channel/create?topic={topic}&channel={channel}", errors)
        if not self.cluster.lookupds:  # without lookupd, every listed nsqd gets the topic
            for node in await self.cluster.nodes(errors):
                try:
                    await self.cluster.post(node, f"/topic/create?topic={topic}")
                except httpx.HTTPError as exc:
                    errors.add(node, exc)
        if channel:
            await self._on_nodes(topic, f"/channel/create?topic={topic}&channel={channel}", errors)
        self._notify(req, "create_channel" if channel else "create_topic", user, topic, channel)
        return _ok({}, errors)

    async def topic_action(self, req: Request, params: Mapping[str, str]) -> Reply:
        return await self._pause_or_empty(req, params, "topic", "")

    async def channel_action(self, req: Request, params: Mapping[str, str]) -> Reply:
        return await self._pause_or_empty(req, params, "channel", f"&channel={params['channel']}")

    async def _pause_or_empty(self, req: Request, params: Mapping[str, str], kind: str, channel_arg: str) -> Reply:
        """{"action": "pause" | "unpause" | "empty"} on the topic or channel, on every nsqd that has it;
        on a channel also {"action": "seek", "to": "earliest" | "latest" | unix ms | RFC 3339} (trio-nsqd's
        /channel/seek: a Go nsqd answers it 404, reported in `message`)."""
        user = self._admin(req)
        args = await self._json_body(req)
        action = args.get("action")
        extra = ""
        if action == "config" or (action == "redrive" and kind == "channel"):
            return await self._settings_action(req, params, kind, args, user)
        if action == "seek" and kind == "channel":
            to = args.get("to")
            if not isinstance(to, (str, int)) or isinstance(to, bool) or str(to) == "":
                raise HTTPError(400, "INVALID_ARG_TO")
            extra = f"&to={urllib.parse.quote(str(to))}"
        elif action not in ("pause", "unpause", "empty"):
            raise HTTPError(400, "INVALID_ACTION")
        topic = params["topic"]
        errors = Errors()
        if not await self._on_nodes(topic, f"/{kind}/{action}?topic={topic}{channel_arg}{extra}", errors) and not errors.failed:
            raise HTTPError(404, "TOPIC_NOT_FOUND")
        self._notify(req, f"{action}_{kind}", user, topic, params.get("channel", ""))
        return _ok({}, errors)

    async def _settings_action(self, req: Request, params: Mapping[str, str], kind: str, args: dict[str, Any],
                               user: str) -> Reply:
        """{"action": "config", "settings": {key: value or ""}} (trio-nsqd's /topic/config and
        /channel/config, on every nsqd that has the topic) or, on a channel, {"action": "redrive"}
        (/channel/redrive: `moved` is the sum over the nodes). A node's refusal is reported in `message`
        with its own words; a Go nsqd answers 404."""
        action = args["action"]
        topic = params["topic"]
        query = f"topic={_q(topic)}" + (f"&channel={_q(params['channel'])}" if kind == "channel" else "")
        if action == "config":
            settings = args.get("settings")
            if not isinstance(settings, dict) or not all(isinstance(v, (str, int, bool)) for v in settings.values()):
                raise HTTPError(400, "INVALID_ARG_SETTINGS")
            query += "".join(f"&{_q(str(k))}={_q(str(v).lower() if isinstance(v, bool) else str(v))}"
                             for k, v in settings.items())
            path = f"/{kind}/config?{query}"
        else:
            path = f"/channel/redrive?{query}"
        errors = Errors()
        answers = await self._on_nodes(topic, path, errors, self.cluster.post_json)
        moved = sum(int(answer.get("moved", 0)) for answer in answers)
        if not answers and not errors.failed:
            raise HTTPError(404, "TOPIC_NOT_FOUND")
        self._notify(req, f"{action}_{kind}", user, topic, params.get("channel", ""))
        return _ok({"moved": moved} if action == "redrive" else {}, errors)

    async def delete_topic(self, req: Request, params: Mapping[str, str]) -> Reply:
        user = self._admin(req)
        topic = params["topic"]
        errors = Errors()
        await self._on_lookupds(f"/topic/delete?topic={topic}", errors)
        await self._on_nodes(topic, f"/topic/delete?topic={topic}", errors)
        self._notify(req, "delete_topic", user, topic)
        return _ok({}, errors)

    async def delete_channel(self, req: Request, params: Mapping[str, str]) -> Reply:
        user = self._admin(req)
        topic, channel = params["topic"], params["channel"]
        errors = Errors()
        await self._on_lookupds(f"/channel/delete?topic={topic}&channel={channel}", errors)
        await self._on_nodes(topic, f"/channel/delete?topic={topic}&channel={channel}", errors)
        self._notify(req, "delete_channel", user, topic, channel)
        return _ok({}, errors)

    async def tombstone(self, req: Request, params: Mapping[str, str]) -> Reply:
        """DELETE /api/nodes/:node {"topic": t}: tombstone the topic on that node in every lookupd,
        then delete it on the node (nsqadmin's tombstoneNodeForTopicHandler)."""
        user = self._admin(req)
        topic = str((await self._json_body(req)).get("topic", ""))
        if not is_valid_topic_name(topic):
            raise HTTPError(400, "INVALID_TOPIC")
        node = params["node"]
        errors = Errors()
        await self._on_lookupds(f"/topic/tombstone?topic={topic}&node={node}", errors)
        try:
            await self.cluster.post(node, f"/topic/delete?topic={topic}")
        except httpx.HTTPError as exc:
            errors.add(node, exc)
        self._notify(req, "tombstone_topic_producer", user, topic, node=node)
        return _ok({}, errors)

    def _notify(self, request: Request, action: str, user: str, topic: str, channel: str = "", node: str = "") -> None:
        """nsqadmin's AdminAction, POSTed to --notification-http-endpoint in the background."""
        endpoint = self.options.notification_http_endpoint
        if not endpoint:
            return
        url = f"http://{request.headers.get('host', '')}{request.raw_path}"
        if request.query:
            url += "?" + request.query.decode("latin-1")
        event = {"action": action, "topic": topic, "channel": channel, "node": node, "timestamp": int(time.time()),
                 "user": user, "remote_ip": _client_host(request), "user_agent": request.headers.get("user-agent", ""),
                 "url": url, "via": "trio-nsqadmin"}
        if self.nursery is not None:
            self.nursery.start_soon(self._send_notification, endpoint, event)

    async def _send_notification(self, endpoint: str, event: dict[str, Any]) -> None:
        try:
            await self.cluster.client.post(endpoint, content=go_json(event),
                                           headers={"Content-Type": "application/json"})
        except httpx.HTTPError as exc:
            log.error("failed to send notification to %s - %s", endpoint, exc)

    # --- /config/:opt -------------------------------------------------------------------------------

    def _config_allowed(self, req: Request) -> None:
        try:
            allowed = ipaddress.ip_address(_client_host(req)) in ipaddress.ip_network(self.options.allow_config_from_cidr,
                                                                              strict=False)
        except ValueError:
            allowed = False
        if not allowed:
            raise HTTPError(403, "FORBIDDEN")

    async def config(self, req: Request, params: Mapping[str, str]) -> Reply:
        self._config_allowed(req)
        opt = params["opt"]
        if req.method == "PUT":
            try:
                value = json.loads(await self._body(req))
            except ValueError:
                raise HTTPError(400, "INVALID_VALUE") from None
            if opt == "nsqlookupd_http_addresses" and isinstance(value, list) and all(isinstance(v, str) for v in value):
                self.options.nsqlookupd_http_addresses = value
                self.cluster.lookupds = list(value)
            elif opt == "log_level" and value in ("debug", "info", "warn", "error", "fatal"):
                self.options.log_level = value
                logging.getLogger().setLevel({"warn": "WARNING", "fatal": "CRITICAL"}.get(value, value.upper()))
            else:
                raise HTTPError(400, "INVALID_OPTION")
        if opt == "nsqlookupd_http_addresses":
            return Reply(200, go_json(self.options.nsqlookupd_http_addresses), JSON_TYPE)
        if opt == "log_level":
            return Reply(200, go_json(self.options.log_level), JSON_TYPE)
        raise HTTPError(400, "INVALID_OPTION")

    # --- the page -----------------------------------------------------------------------------------

    async def page(self, req: Request, params: Mapping[str, str]) -> Reply:
        """index.html for every page path (the app routes itself); the settings it needs inline."""
        html = (STATIC / "index.html").read_text()
        base = self.options.base_path.rstrip("/") + "/"
        settings = {"version": VERSION, "basePath": base, "lookupds": self.options.nsqlookupd_http_addresses,
                    "isAdmin": not self.options.admin_users}
        html = html.replace("/*SETTINGS*/", "window.NSQADMIN = " + json.dumps(settings) + ";")
        html = html.replace("{{BASE}}", base)
        return Reply(200, html.encode(), HTML_TYPE, nsq_header=False)

    async def static(self, req: Request, params: Mapping[str, str]) -> Reply:
        name = params["file"]
        path = STATIC / name
        if "/" in name or name.startswith(".") or path.suffix not in STATIC_TYPES or not path.is_file():
            raise HTTPError(404, "NOT_FOUND")
        return Reply(200, path.read_bytes(), STATIC_TYPES[path.suffix], nsq_header=False)


PAGES = ("/", "/topics/:topic", "/topics/:topic/:channel", "/nodes", "/nodes/:node", "/counter")


def routes(admin: Admin) -> dict[str, dict[str, Route]]:
    """nsqadmin's routes (method -> path -> Route), as httprouter's trees; none is answered in place."""
    return {
        "GET": {
            **dict.fromkeys(PAGES, Route(admin.page)),
            "/static/:file": Route(admin.static),
            "/ping": Route(admin.ping),
            "/api/topics": Route(admin.topics),
            "/api/topics/:topic": Route(admin.topic),
            "/api/topics/:topic/:channel": Route(admin.channel),
            "/api/topics/:topic/:channel/messages": Route(admin.channel_messages),
            "/api/nodes": Route(admin.nodes),
            "/api/nodes/:node": Route(admin.node),
            "/api/counter": Route(admin.counter),
            "/api/graphite": Route(admin.graphite),
            "/config/:opt": Route(admin.config),
        },
        "POST": {
            "/api/topics": Route(admin.create),
            "/api/topics/:topic": Route(admin.topic_action),
            "/api/topics/:topic/:channel": Route(admin.channel_action),
        },
        "DELETE": {
            "/api/topics/:topic": Route(admin.delete_topic),
            "/api/topics/:topic/:channel": Route(admin.delete_channel),
            "/api/nodes/:node": Route(admin.tombstone),
        },
        "PUT": {"/config/:opt": Route(admin.config)},
    }


def admin_site(admin: Admin, nursery: trio.Nursery) -> Site:
    """nsqadmin's routes under --base-path as the shared HTTP server's Site; notifications are sent
    from `nursery`."""
    admin.nursery = nursery
    return Site(Router(routes(admin)), log, base_path=admin.options.base_path, max_body=MAX_BODY)


def _q(text: str) -> str:
    """A query value, escaped (names are checked by nsqd; a setting's value may hold anything)."""
    return urllib.parse.quote(text, safe="")
