"""What the cluster says, as nsqadmin's clusterinfo reads and aggregates it.

Producers come from every lookupd's /nodes (or, without lookupd, from each --nsqd-http-address's /info);
figures from each nsqd's /stats?format=json. A topic's or channel's figures are summed over the nodes
that have it, with the per-node rows beside the total (`node` "*" for the total). A node that does not
answer costs its rows, never the answer: its error is collected and reported with the rest.
Called by api.py's handlers; each call makes its own requests (nothing is cached).
"""

from __future__ import annotations

import logging
import urllib.parse
from typing import Any

import attrs
import httpx
import trio

log = logging.getLogger("nsqadmin")

CHANNEL_SUMS = ("depth", "memory_depth", "backend_depth", "in_flight_count", "deferred_count", "requeue_count",
                "timeout_count", "message_count", "client_count")
TOPIC_SUMS = ("depth", "memory_depth", "backend_depth", "message_count")
# trio-nsqd's figures, after nsqadmin's fields (a client of nsqadmin's shape finds those where they were)
CHANNEL_EXTRA_SUMS = ("lag_messages", "dead_lettered_count", "expired_count", "refused_count", "dropped_count")
TOPIC_EXTRA_SUMS = ("log_messages", "log_bytes")


class NodeRefused(httpx.HTTPError):
    """An nsqd answered an action with an error: its status and message."""


@attrs.define
class Errors:
    """The nodes that did not answer in one request, and why (nsqadmin reports them in `message`)."""

    failed: dict[str, str] = attrs.Factory(dict)

    def add(self, node: str, exc: BaseException) -> None:
        self.failed[node] = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

    def message(self) -> str:
        if not self.failed:
            return ""
        return "WARNING: " + "; ".join(f"{node} - {why}" for node, why in sorted(self.failed.items()))


class Cluster:
    """HTTP reads and writes of the lookupds and nsqds (one httpx client, nsqadmin's timeouts)."""

    def __init__(self, lookupd_http_addresses: list[str], nsqd_http_addresses: list[str], *,
                 connect_timeout: float, request_timeout: float, verify: Any = True, max_nodes: int = 100) -> None:
        self.lookupds = list(lookupd_http_addresses)
        self.nsqds = list(nsqd_http_addresses)
        self.max_nodes = max_nodes
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=connect_timeout), verify=verify)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def _get_json(self, address: str, path: str) -> Any:
        response = await self.client.get(f"http://{address}{path}")
        response.raise_for_status()
        return response.json()

    async def post(self, address: str, path: str) -> None:
        response = await self.client.post(f"http://{address}{path}")
        response.raise_for_status()

    async def post_json(self, address: str, path: str) -> dict[str, Any]:
        """POST path and its JSON answer; a refusal raises NodeRefused with the node's `message`."""
        response = await self.client.post(f"http://{address}{path}")
        try:
            answer = response.json()
        except ValueError:
            answer = {}
        if response.is_error:
            raise NodeRefused(f"{response.status_code} {answer.get('message', response.reason_phrase)}")
        return answer if isinstance(answer, dict) else {}

    async def get_json(self, address: str, path: str) -> Any:
        return await self._get_json(address, path)

    async def _each(self, addresses: list[str], path: str, errors: Errors) -> dict[str, Any]:
        """GET path on every address at once; the answers by address (failures go to errors)."""
        out: dict[str, Any] = {}

        async def one(address: str) -> None:
            try:
                out[address] = await self._get_json(address, path)
            except (httpx.HTTPError, ValueError) as exc:
                errors.add(address, exc)

        async with trio.open_nursery() as nursery:
            for address in addresses[: self.max_nodes]:
                nursery.start_soon(one, address)
        return out

    # --- producers (nodes) -------------------------------------------------------------------------

    async def producers(self, errors: Errors) -> list[dict[str, Any]]:
        """nsqadmin's GetProducers: every nsqd the lookupds know (merged by broadcast address and HTTP
        port, with the lookupd/remote address each one registered through), or the --nsqd-http-address
        list when there is no lookupd."""
        if not self.lookupds:
            infos = await self._each(self.nsqds, "/info", errors)
            return [{
                "remote_addresses": [], "remote_address": "", "hostname": info.get("hostname", ""),
                "broadcast_address": info.get("broadcast_address", ""), "tcp_port": info.get("tcp_port", 0),
                "http_port": info.get("http_port", 0), "version": info.get("version", ""), "topics": [],
                "out_of_date": False, "node": address,
            } for address, info in sorted(infos.items())]
        merged: dict[str, dict[str, Any]] = {}
        for lookupd, answer in sorted((await self._each(self.lookupds, "/nodes", errors)).items()):
            for p in answer.get("producers") or []:
                entry = _merged(merged, lookupd, p, [])
                known = {t["topic"] for t in entry["topics"]}
                tombstones = p.get("tombstones") or [False] * len(p.get("topics") or [])
                for topic, tombstoned in zip(p.get("topics") or [], tombstones):
                    if topic not in known:
                        entry["topics"].append({"topic": topic, "tombstoned": bool(tombstoned)})
        for entry in merged.values():
            entry["topics"].sort(key=lambda t: t["topic"])
        return [merged[node] for node in sorted(merged)]

    async def topic_producers(self, topic: str, errors: Errors) -> list[dict[str, Any]]:
        """The nsqds that have `topic`, as nsqadmin's GetTopicProducers: each lookupd's /lookup?topic=
        (not /nodes, which lists every topic of every node: ten thousand names for one page), merged by
        broadcast address and HTTP port; every nsqd when there is no lookupd."""
        if not self.lookupds:
            return await self.producers(errors)
        merged: dict[str, dict[str, Any]] = {}
        path = "/lookup?topic=" + urllib.parse.quote(topic, safe="")
        for lookupd, answer in sorted((await self._each(self.lookupds, path, errors)).items()):
            for p in answer.get("producers") or []:
                _merged(merged, lookupd, p, [{"topic": topic, "tombstoned": False}])
        return [merged[node] for node in sorted(merged)]

    async def nodes(self, errors: Errors) -> list[str]:
        """The HTTP addresses of every nsqd (host:http_port)."""
        return [p["node"] for p in await self.producers(errors)]

    async def topics(self, errors: Errors) -> list[str]:
        if self.lookupds:
            names: set[str] = set()
            for answer in (await self._each(self.lookupds, "/topics", errors)).values():
                names.update(answer.get("topics") or [])
            return sorted(names)
        stats = await self.stats(await self.nodes(errors), errors)
        return sorted({t["topic_name"] for node in stats.values() for t in node.get("topics") or []})

    async def stats(self, nodes: list[str], errors: Errors, topic: str = "") -> dict[str, dict[str, Any]]:
        """Each node's /stats?format=json, by node."""
        path = "/stats?format=json" + ("&topic=" + urllib.parse.quote(topic, safe="") if topic else "")
        return await self._each(nodes, path, errors)

    # --- the rows nsqadmin shows ---------------------------------------------------------------------


def _merged(merged: dict[str, dict[str, Any]], lookupd: str, p: dict[str, Any],
            topics: list[dict[str, Any]]) -> dict[str, Any]:
    """A lookupd's producer `p` merged into `merged` by broadcast address and HTTP port (nsqadmin's
    producer: the lookupd/remote address it registered through added); its entry."""
    node = f"{p['broadcast_address']}:{p['http_port']}"
    entry = merged.setdefault(node, {
        "remote_addresses": [], "remote_address": p.get("remote_address", ""),
        "hostname": p.get("hostname", ""), "broadcast_address": p["broadcast_address"],
        "tcp_port": p["tcp_port"], "http_port": p["http_port"], "version": p.get("version", ""),
        "topics": topics, "out_of_date": False, "node": node,
    })
    entry["remote_addresses"].append(f"{lookupd}/{p.get('remote_address', '')}")
    return entry


def e2e(result: dict[str, Any] | None, topic: str = "", channel: str = "", host: str = "") -> dict[str, Any]:
    result = result or {}
    return {"count": result.get("count", 0), "percentiles": result.get("percentiles"), "topic": topic,
            "channel": channel, "host": host}


def channel_row(node: str, hostname: str, topic: str, c: dict[str, Any]) -> dict[str, Any]:
    return {
        "node": node, "hostname": hostname, "topic_name": topic, "channel_name": c["channel_name"],
        "depth": c["depth"], "memory_depth": c["depth"] - c["backend_depth"], "backend_depth": c["backend_depth"],
        "in_flight_count": c["in_flight_count"], "deferred_count": c["deferred_count"],
        "requeue_count": c["requeue_count"], "timeout_count": c["timeout_count"], "message_count": c["message_count"],
        "client_count": c["client_count"], "nodes": None,
        "clients": [dict(client, node=node) for client in c.get("clients") or []],
        "paused": c["paused"], "e2e_processing_latency": e2e(c.get("e2e_processing_latency")),
        # trio-nsqd's (Go nsqd has none): how far behind the channel is
        "lag_messages": c.get("lag_messages", c["depth"] + c["in_flight_count"] + c["deferred_count"]),
        "oldest_unfinished_age_ms": c.get("oldest_unfinished_age_ms", 0),
        # trio-nsqd's: delivery to FIN, p50/p90/p99/p99.9 in ns over its last 5-10 minutes
        "delivery_to_fin_latency": c.get("delivery_to_fin_latency") or {"count": 0, "percentiles": None},
        # what its settings did (trio-nsqd's /channel/config)
        **{key: c.get(key, 0) for key in ("dead_lettered_count", "expired_count", "refused_count", "dropped_count")},
    }


def topic_row(node: str, hostname: str, t: dict[str, Any]) -> dict[str, Any]:
    name = t["topic_name"]
    return {
        "node": node, "hostname": hostname, "topic_name": name, "depth": t["depth"],
        "memory_depth": t["depth"] - t["backend_depth"], "backend_depth": t["backend_depth"],
        "message_count": t["message_count"], "nodes": None,
        "channels": [channel_row(node, hostname, name, c) for c in t.get("channels") or []],
        "paused": t["paused"], "e2e_processing_latency": e2e(t.get("e2e_processing_latency")),
        # trio-nsqd's topic log (Go nsqd has none)
        "log_messages": t.get("log_messages", 0), "log_bytes": t.get("log_bytes", 0),
        "log_first_position": t.get("log_first_position", 0), "log_end_position": t.get("log_end_position", 0),
        # trio-nsqd in cluster mode (docs/cluster.md): this node's view of the topic's replicas
        **({"replication": t["replication"]} if isinstance(t.get("replication"), dict) else {}),
    }


def _hostname(producers: list[dict[str, Any]], node: str) -> str:
    return next((p["hostname"] for p in producers if p["node"] == node), node.rsplit(":", 1)[0])


def node_topic_rows(stats: dict[str, dict[str, Any]], producers: list[dict[str, Any]],
                    topic: str = "") -> list[dict[str, Any]]:
    rows = []
    for node, answer in sorted(stats.items()):
        for t in answer.get("topics") or []:
            if not topic or t["topic_name"] == topic:
                rows.append(topic_row(node, _hostname(producers, node), t))
    return rows


def aggregate_channel(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A channel's total over its per-node rows (nsqadmin's ChannelStats.Add)."""
    first = rows[0]
    total = {key: first[key] for key in ("topic_name", "channel_name")}
    out: dict[str, Any] = {"node": "*", "hostname": "", **total}
    for key in CHANNEL_SUMS:
        out[key] = sum(r[key] for r in rows)
    out["nodes"] = rows
    out["clients"] = None
    out["paused"] = any(r["paused"] for r in rows)
    out["e2e_processing_latency"] = e2e({"count": sum(r["e2e_processing_latency"]["count"] for r in rows)},
                                        first["topic_name"], first["channel_name"], "*")
    for key in CHANNEL_EXTRA_SUMS:
        out[key] = sum(r[key] for r in rows)
    out["oldest_unfinished_age_ms"] = max(r["oldest_unfinished_age_ms"] for r in rows)
    out["delivery_to_fin_latency"] = worst_latency([r["delivery_to_fin_latency"] for r in rows])
    return out


def worst_latency(latencies: list[dict[str, Any]]) -> dict[str, Any]:
    """Several nodes' latency figures as one: the FINs summed and, percentiles not being mergeable, each
    quantile's worst value among the nodes that had FINs (an upper bound)."""
    worst: dict[float, float] = {}
    for latency in latencies:
        if latency.get("count") and latency.get("percentiles"):
            for p in latency["percentiles"]:
                worst[p["quantile"]] = max(worst.get(p["quantile"], 0), p["value"])
    percentiles = [{"quantile": q, "value": v} for q, v in sorted(worst.items())] if worst else None
    return {"count": sum(latency.get("count", 0) for latency in latencies), "percentiles": percentiles}


def aggregate_topic(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A topic's total over its per-node rows, with its channels merged by name (nsqadmin's TopicStats.Add)."""
    first = rows[0]
    out: dict[str, Any] = {"node": "*", "hostname": "", "topic_name": first["topic_name"]}
    for key in TOPIC_SUMS:
        out[key] = sum(r[key] for r in rows)
    out["nodes"] = rows
    by_name: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        for c in r["channels"]:
            by_name.setdefault(c["channel_name"], []).append(c)
    out["channels"] = [group[0] if len(group) == 1 else aggregate_channel(group)
                       for _, group in sorted(by_name.items())]
    out["paused"] = any(r["paused"] for r in rows)
    out["e2e_processing_latency"] = e2e({"count": sum(r["e2e_processing_latency"]["count"] for r in rows)},
                                        first["topic_name"], "", "*")
    for key in TOPIC_EXTRA_SUMS:
        out[key] = sum(r[key] for r in rows)
    return out


def replication_source(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The `replication` a replicated topic's page starts from: a leader's of the highest epoch among the rows
    (nsqlookupd lists only the leader; without lookupd every node has a row), else any row's; None for a topic
    no node replicates (a Go nsqd, a trio-nsqd without --etcd-endpoints, an #ephemeral topic)."""
    found = [r["replication"] for r in rows if isinstance(r.get("replication"), dict)]
    if not found:
        return None
    return max(found, key=lambda rep: (rep.get("role") == "leader", rep.get("epoch", 0)))


def replica_ids(source: dict[str, Any]) -> list[str]:
    """The replicas' ids (`host:http_port`) a `replication` names."""
    return [r for r in source.get("replicas") or [] if isinstance(r, str)]


def replication_view(source: dict[str, Any], replicas: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """A replicated topic as trio-nsqadmin shows it: the leader's view (`source`: leader, epoch, isr, min_isr and
    its high watermark) and a row per replica with what the replica itself says (`replicas`: id -> its
    `replication`, None when it did not answer or has no copy)."""
    isr = list(source.get("isr") or [])
    rows = []
    for replica in replica_ids(source):
        own = replicas.get(replica)
        rows.append({
            "id": replica, "leader": replica == source.get("leader"), "in_isr": replica in isr,
            "reachable": own is not None, "role": own.get("role", "") if own else "",
            "epoch": own.get("epoch", 0) if own else 0,
            "high_watermark": own.get("high_watermark", 0) if own else 0, "log_end": own.get("log_end", 0) if own else 0,
        })
    return {"leader": source.get("leader"), "epoch": source.get("epoch", 0), "isr": isr,
            "min_isr": source.get("min_isr", 0), "high_watermark": source.get("high_watermark", 0),
            "log_end": source.get("log_end", 0), "replicas": rows}
