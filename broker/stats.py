"""The figures behind GET /stats and GET /metrics, built from the broker's state (nsqd/stats.go).

Pure functions of an NSQD: nothing here awaits, so a snapshot is consistent (no message moves while it
is taken). Field names, nesting, ordering and null-vs-empty choices follow nsqd's JSON, because nsqadmin,
nsq_stat and nsq_to_* read it:

- topics sorted by name, channels sorted by name; a topic filter that matches nothing gives
  ``"topics": null``, a channel filter skips topics without that channel;
- ``clients`` and ``producers`` are ``null`` when include_clients is off;
- ``e2e_processing_latency`` is ``{"count": 0, "percentiles": null}`` unless percentiles are configured;
- ``memory`` appears only with include_mem.

Where Python has no twin of a Go figure the nearest honest one is reported (see mem_stats).
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from broker.quantile import aggregate
from shared.version import VERSION

if TYPE_CHECKING:
    from broker.channel import Channel
    from broker.client_v2 import ClientV2
    from broker.nsqd import NSQD
    from broker.topic import Topic

NO_LATENCY: dict[str, Any] = {"count": 0, "percentiles": None}


def health(nsqd: NSQD) -> str:
    """nsqd's GetHealth: "OK", or "NOK - <error>"."""
    return "OK" if nsqd.health_error is None else f"NOK - {nsqd.health_error}"


# --- JSON (/stats?format=json) ----------------------------------------------------------------


def client_stats(client: ClientV2, topic_filter: str = "") -> dict[str, Any]:
    """nsqd's ClientV2Stats. pub_counts lists every topic the client published to (nsqd stops after the
    first one, which hides the rest from nsqadmin); it is omitted when empty, as nsqd's omitempty does."""
    auth = client.auth_state
    authed = bool(auth is not None and auth.authorizations)
    stats: dict[str, Any] = {
        "client_id": client.client_id,
        "hostname": client.hostname,
        "version": "V2",
        "remote_address": client.remote_address,
        "state": client.state,
        "ready_count": client.ready_count,
        "in_flight_count": client.in_flight_count,
        "message_count": client.message_count,
        "finish_count": client.finish_count,
        "requeue_count": client.requeue_count,
        "connect_ts": int(client.connect_time),
        "sample_rate": client.sample_rate,
        "deflate": client.deflate,
        "snappy": client.snappy,
        "user_agent": client.user_agent,
        "topology_zone": "",
        "topology_region": "",
        "tls": client.tls,
        "tls_cipher_suite": "",
        "tls_version": "",
        "tls_negotiated_protocol": "",
        "tls_negotiated_protocol_is_mutual": False,
        # not in nsqd's stats, but what a client negotiated in IDENTIFY is worth seeing
        "output_buffer_size": client.output_buffer_size,
        "output_buffer_timeout": int(client.output_buffer_timeout * 1000),
    }
    if authed:
        stats["authed"] = True
        if auth.identity:
            stats["auth_identity"] = auth.identity
        if auth.identity_url:
            stats["auth_identity_url"] = auth.identity_url
    pub_counts = [
        {"topic": topic, "count": count}
        for topic, count in sorted(client.pub_counts.items())
        if not topic_filter or topic == topic_filter
    ]
    if pub_counts:
        stats["pub_counts"] = pub_counts
    if client.tls:
        _tls_details(client, stats)
    return stats


def _tls_details(client: ClientV2, stats: dict[str, Any]) -> None:
    ssl_object = _find_ssl_stream(client.stream)
    if ssl_object is None:
        return
    try:
        cipher = ssl_object.cipher()
        stats["tls_cipher_suite"] = cipher[0] if cipher else ""
        version = ssl_object.version() or ""
        stats["tls_version"] = version.replace("TLSv", "TLS")
        stats["tls_negotiated_protocol"] = ssl_object.selected_alpn_protocol() or ""
    except (AttributeError, ValueError):
        pass


def _find_ssl_stream(stream: Any) -> Any:
    """The trio.SSLStream under snappy/deflate wrappers, if any."""
    for _ in range(4):
        if stream is None:
            return None
        if hasattr(stream, "cipher") and hasattr(stream, "version"):
            return stream
        # shared.streams wrappers (snappy, deflate) keep the stream they wrap as `inner`
        stream = getattr(stream, "inner", None) or getattr(stream, "transport_stream", None) or getattr(stream, "stream", None)
    return None


def channel_e2e(channel: Channel) -> dict[str, Any]:
    return channel.e2e.result() if channel.e2e is not None else dict(NO_LATENCY)


def topic_e2e(topic: Topic) -> dict[str, Any]:
    """nsqd's AggregateChannelE2eProcessingLatency: null percentiles while no channel keeps a window."""
    streams = [ch.e2e for ch in topic.channels.values() if ch.e2e is not None]
    if not streams:
        return dict(NO_LATENCY)
    return aggregate(streams, topic.nsqd.options.e2e_processing_latency_percentiles)


def channel_stats(channel: Channel, include_clients: bool, topic_filter: str = "") -> dict[str, Any]:
    clients = None
    if include_clients:
        clients = [client_stats(c, topic_filter) for _, c in sorted(channel.clients.items())]  # type: ignore[arg-type]
    return {
        "channel_name": channel.name,
        "depth": channel.depth(),
        "backend_depth": channel.backend.depth(),
        "in_flight_count": len(channel.in_flight),
        "deferred_count": len(channel.deferred),
        "message_count": channel.message_count,
        "requeue_count": channel.requeue_count,
        "timeout_count": channel.timeout_count,
        "client_count": len(channel.clients),
        "clients": clients,
        "paused": channel.paused,
        "e2e_processing_latency": channel_e2e(channel),
    }


def topic_stats(topic: Topic, channels: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "topic_name": topic.name,
        "channels": channels,
        "depth": topic.depth(),
        "backend_depth": topic.backend.depth(),
        "message_count": topic.message_count,
        "message_bytes": topic.message_bytes,
        "paused": topic.paused,
        "e2e_processing_latency": topic_e2e(topic),
        "idempotency_keys": len(topic.idempotency),
    }


def get_stats(
    nsqd: NSQD, topic: str = "", channel: str = "", include_clients: bool = True
) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None]:
    """nsqd's GetStats: (topics, producers)."""
    if not topic:
        topics = sorted(nsqd.topics.values(), key=lambda t: t.name)
    elif topic in nsqd.topics:
        topics = [nsqd.topics[topic]]
    else:
        return None, None
    out = []
    for t in topics:
        if not channel:
            channels = sorted(t.channels.values(), key=lambda c: c.name)
        elif channel in t.channels:
            channels = [t.channels[channel]]
        else:
            continue
        out.append(topic_stats(t, [channel_stats(c, include_clients, topic) for c in channels]))
    producers = None
    if include_clients:
        producers = [client_stats(c, topic) for _, c in sorted(nsqd.clients.items()) if c.pub_counts] or None
    return out, producers


def stats_document(
    nsqd: NSQD, *, topic: str = "", channel: str = "", include_clients: bool = True, include_mem: bool = True
) -> dict[str, Any]:
    """The whole /stats?format=json answer, keys in nsqd's order."""
    topics, producers = get_stats(nsqd, topic, channel, include_clients)
    doc: dict[str, Any] = {
        "version": VERSION,
        "health": health(nsqd),
        "start_time": nsqd.start_time,
        "topics": topics,
    }
    if include_mem:
        doc["memory"] = mem_stats()
    doc["producers"] = producers
    return doc


# --- memory -------------------------------------------------------------------------------------


class GCPauses:
    """The last 256 collection pauses (Go's MemStats.PauseNs ring), timed with gc.callbacks.

    Installed once per process when the HTTP API starts; one clock read per collection, never per
    message."""

    SIZE = 256

    def __init__(self) -> None:
        self.pauses: deque[int] = deque(maxlen=self.SIZE)
        self._started = 0
        self.installed = False

    def install(self) -> None:
        if not self.installed:
            gc.callbacks.append(self._callback)
            self.installed = True

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter_ns()
        elif self._started:
            self.pauses.append(time.perf_counter_ns() - self._started)
            self._started = 0

    def percentile_usec(self, perc: float) -> int:
        """nsqd's percentile() over the sorted pauses, in microseconds."""
        data = sorted(self.pauses)
        if not data:
            return 0
        index = min(len(data) - 1, int(perc / 100 * len(data) + 0.5))
        return data[index] // 1000


GC_PAUSES = GCPauses()


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def mem_stats() -> dict[str, Any]:
    """nsqd's memStats keys with CPython's nearest figures: heap_objects = allocated blocks, heap_in_use
    = resident set size, GC pauses from GC_PAUSES, next_gc_bytes = 0 (CPython triggers collections by
    object counts, not bytes), gc_total_runs = collections of every generation."""
    return {
        "heap_objects": sys.getallocatedblocks(),
        "heap_idle_bytes": 0,
        "heap_in_use_bytes": _rss_bytes(),
        "heap_released_bytes": 0,
        "gc_pause_usec_100": GC_PAUSES.percentile_usec(100),
        "gc_pause_usec_99": GC_PAUSES.percentile_usec(99),
        "gc_pause_usec_95": GC_PAUSES.percentile_usec(95),
        "next_gc_bytes": 0,
        "gc_total_runs": sum(s["collections"] for s in gc.get_stats()),
    }


# --- text (/stats?format=text, the default) ---------------------------------------------------


def go_duration(ns: int) -> str:
    """Go's time.Duration.String(): "0s", "1.5µs", "12.3ms", "1m2.5s", "2h0m0s"."""
    if ns == 0:
        return "0s"
    sign = "-" if ns < 0 else ""
    u = abs(ns)
    if u < 1_000_000_000:
        for unit, scale in (("ns", 1), ("µs", 1_000), ("ms", 1_000_000)):
            if u < scale * 1000:
                return sign + _go_frac(u, scale) + unit
    seconds, frac = divmod(u, 1_000_000_000)
    out = _go_frac(seconds % 60 * 1_000_000_000 + frac, 1_000_000_000) + "s"
    minutes = seconds // 60
    if minutes:
        out = f"{minutes % 60}m" + out
        hours = minutes // 60
        if hours:
            out = f"{hours}h" + out
    return sign + out


def _go_frac(value: int, scale: int) -> str:
    whole, frac = divmod(value, scale)
    if not frac:
        return str(whole)
    digits = len(str(scale)) - 1
    return f"{whole}.{frac:0{digits}d}".rstrip("0")


def nanoseconds_to_human(v: float) -> str:
    """nsqd's stringy.NanoSecondToHuman."""
    if v > 1e9:
        return f"{v / 1e9:.1f}s"
    if v > 1e6:
        return f"{v / 1e6:.1f}ms"
    if v > 1e3:
        return f"{v / 1e3:.1f}us"
    return f"{v:.1f}ns"


def _e2e_text(result: dict[str, Any]) -> str:
    return ", ".join(nanoseconds_to_human(p["value"]) for p in result.get("percentiles") or [])


def _client_text(stats: dict[str, Any], now: float) -> str:
    connected = go_duration(int(max(0, now - stats["connect_ts"])) * 1_000_000_000)
    port = stats["remote_address"].rsplit(":", 1)[-1]
    ident = f"{stats['hostname']}:{port} {stats['user_agent']}"
    pub_counts = stats.get("pub_counts")
    if pub_counts:
        total = sum(p["count"] for p in pub_counts)
        topics = ",".join(f"{p['topic']}={p['count']}" for p in pub_counts)
        return f"[{stats['version']} {ident:<21}] msgs: {total:<8} topics: {topics} connected: {connected}"
    return (
        f"[{stats['version']} {ident:<21}] state: {stats['state']} inflt: {stats['in_flight_count']:<4} "
        f"rdy: {stats['ready_count']:<4} fin: {stats['finish_count']:<8} re-q: {stats['requeue_count']:<8} "
        f"msgs: {stats['message_count']:<8} connected: {connected}"
    )


def stats_text(
    nsqd: NSQD, *, topic: str = "", channel: str = "", include_clients: bool = True, include_mem: bool = True
) -> str:
    """nsqd's printStats, line for line."""
    topics, producers = get_stats(nsqd, topic, channel, include_clients)
    now = time.time()
    started = time.localtime(nsqd.start_time)
    offset = time.strftime("%z", started)
    rfc3339 = time.strftime("%Y-%m-%dT%H:%M:%S", started) + ("Z" if offset in ("+0000", "-0000") else f"{offset[:3]}:{offset[3:]}")
    uptime_ns = max(0, time.time_ns() - nsqd.start_time * 1_000_000_000)
    impl = f"python{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    lines = [
        f"nsqd v{VERSION} (built w/{impl})",
        f"start_time {rfc3339}",
        f"uptime {go_duration(uptime_ns)}",
        "",
        f"Health: {health(nsqd)}",
    ]
    if include_mem:
        lines += ["", "Memory:"]
        lines += [f"   {key:<25}\t{value}" for key, value in mem_stats().items()]
    out = "\n".join(lines) + "\n"
    out += "\nTopics: None\n" if not topics else "\nTopics:"
    for t in topics or []:
        prefix = "*P " if t["paused"] else "   "
        out += (
            f"\n{prefix}[{t['topic_name']:<15}] depth: {t['depth']:<5} be-depth: {t['backend_depth']:<5} "
            f"msgs: {t['message_count']:<8} e2e%: {_e2e_text(t['e2e_processing_latency'])}"
            + (f" idempotency-keys: {t['idempotency_keys']}" if t.get("idempotency_keys") else "") + "\n"
        )
        for c in t["channels"]:
            prefix = "   *P " if c["paused"] else "      "
            out += (
                f"{prefix}[{c['channel_name']:<25}] depth: {c['depth']:<5} be-depth: {c['backend_depth']:<5} "
                f"inflt: {c['in_flight_count']:<4} def: {c['deferred_count']:<4} re-q: {c['requeue_count']:<5} "
                f"timeout: {c['timeout_count']:<5} msgs: {c['message_count']:<8} "
                f"e2e%: {_e2e_text(c['e2e_processing_latency'])}\n"
            )
            for client in c["clients"] or []:
                out += f"        {_client_text(client, now)}\n"
    if not producers:
        out += "\nProducers: None\n"
    else:
        out += "\nProducers:\n"
        for client in producers:
            out += f"   {_client_text(client, now)}\n"
    return out


# --- Prometheus (/metrics) --------------------------------------------------------------------


class _Metrics:
    """Collects samples per metric family so each family's HELP/TYPE is written once, samples after it."""

    def __init__(self) -> None:
        self.families: dict[str, tuple[str, str, list[str]]] = {}

    def add(self, name: str, kind: str, help: str, value: float, labels: dict[str, str] | None = None,
            suffix: str = "") -> None:
        family = self.families.setdefault(name, (kind, help, []))
        label_text = ""
        if labels:
            label_text = "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items()) + "}"
        family[2].append(f"{name}{suffix}{label_text} {_number(value)}")

    def render(self) -> str:
        out = []
        for name, (kind, help, samples) in self.families.items():
            out.append(f"# HELP {name} {help}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(samples)
        return "\n".join(out) + "\n"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if value != value:
        return "NaN"
    return repr(float(value))


def prometheus_text(nsqd: NSQD) -> str:
    """The /stats figures in the Prometheus text exposition format (version 0.0.4).

    Counters carry the ``_total`` suffix; depths and counts of what is held now are gauges; e2e latency
    percentiles are a summary in seconds. Labels: topic, channel, and for clients client_id, hostname,
    remote_address and user_agent."""
    m = _Metrics()
    m.add("nsq_up", "gauge", "1 while the broker is healthy, 0 when it reports an error.",
          1 if nsqd.health_error is None else 0)
    m.add("nsq_info", "gauge", "Constant 1, labelled with the NSQ version this broker implements.", 1,
          {"version": VERSION, "broadcast_address": nsqd.options.broadcast_address})
    m.add("nsq_start_time_seconds", "gauge", "When the broker started, in seconds since the epoch.", nsqd.start_time)
    topics, producers = get_stats(nsqd, include_clients=True)
    for t in topics or []:
        tl = {"topic": t["topic_name"]}
        m.add("nsq_topic_depth", "gauge", "Messages queued in the topic (memory and disk).", t["depth"], tl)
        m.add("nsq_topic_backend_depth", "gauge", "Messages queued in the topic's disk queue.", t["backend_depth"], tl)
        m.add("nsq_topic_messages_total", "counter", "Messages published to the topic.", t["message_count"], tl)
        m.add("nsq_topic_message_bytes_total", "counter", "Bytes of message bodies published to the topic.",
              t["message_bytes"], tl)
        m.add("nsq_topic_paused", "gauge", "1 if the topic is paused.", t["paused"], tl)
        m.add("nsq_topic_channels", "gauge", "Channels of the topic.", len(t["channels"]), tl)
        _latency(m, "nsq_topic_e2e_processing_latency_seconds",
                 "End-to-end processing latency (publish to FIN) over the topic's channels.",
                 t["e2e_processing_latency"], tl)
        for c in t["channels"]:
            cl = {"topic": t["topic_name"], "channel": c["channel_name"]}
            m.add("nsq_channel_depth", "gauge", "Messages queued in the channel (memory and disk).", c["depth"], cl)
            m.add("nsq_channel_backend_depth", "gauge", "Messages queued in the channel's disk queue.",
                  c["backend_depth"], cl)
            m.add("nsq_channel_in_flight_count", "gauge", "Messages sent to consumers and not yet finished.",
                  c["in_flight_count"], cl)
            m.add("nsq_channel_deferred_count", "gauge", "Messages deferred (DPUB, REQ with a delay).",
                  c["deferred_count"], cl)
            m.add("nsq_channel_messages_total", "counter", "Messages the channel received from its topic.",
                  c["message_count"], cl)
            m.add("nsq_channel_requeued_total", "counter", "Messages requeued by consumers (REQ).",
                  c["requeue_count"], cl)
            m.add("nsq_channel_timed_out_total", "counter", "In-flight messages that timed out.",
                  c["timeout_count"], cl)
            m.add("nsq_channel_client_count", "gauge", "Consumers connected to the channel.", c["client_count"], cl)
            m.add("nsq_channel_paused", "gauge", "1 if the channel is paused.", c["paused"], cl)
            _latency(m, "nsq_channel_e2e_processing_latency_seconds",
                     "End-to-end processing latency (publish to FIN) of the channel.", c["e2e_processing_latency"], cl)
            for client in c["clients"] or []:
                kl = {**cl, **_client_labels(client)}
                m.add("nsq_client_ready_count", "gauge", "The consumer's RDY count.", client["ready_count"], kl)
                m.add("nsq_client_in_flight_count", "gauge", "Messages in flight to the consumer.",
                      client["in_flight_count"], kl)
                m.add("nsq_client_messages_total", "counter", "Messages sent to the consumer.",
                      client["message_count"], kl)
                m.add("nsq_client_finished_total", "counter", "Messages the consumer finished (FIN).",
                      client["finish_count"], kl)
                m.add("nsq_client_requeued_total", "counter", "Messages the consumer requeued (REQ).",
                      client["requeue_count"], kl)
    for client in producers or []:
        for pub in client.get("pub_counts", []):
            m.add("nsq_producer_published_total", "counter", "Messages a TCP producer published, per topic.",
                  pub["count"], {"topic": pub["topic"], **_client_labels(client)})
    m.add("nsq_clients", "gauge", "TCP client connections.", len(nsqd.clients))
    mem = mem_stats()
    m.add("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", mem["heap_in_use_bytes"])
    m.add("python_allocated_blocks", "gauge", "Memory blocks currently allocated by the interpreter.",
          mem["heap_objects"])
    for generation, s in enumerate(gc.get_stats()):
        m.add("python_gc_collections_total", "counter", "Garbage collections, per generation.",
              s["collections"], {"generation": str(generation)})
    return m.render()


def _client_labels(client: dict[str, Any]) -> dict[str, str]:
    return {
        "client_id": client["client_id"],
        "hostname": client["hostname"],
        "remote_address": client["remote_address"],
        "user_agent": client["user_agent"],
    }


def _latency(m: _Metrics, name: str, help: str, result: dict[str, Any], labels: dict[str, str]) -> None:
    """A summary: one sample per configured quantile (ns converted to seconds) and the window's count."""
    percentiles = result.get("percentiles")
    if percentiles is None:
        return
    for p in percentiles:
        m.add(name, "summary", help, p["value"] / 1e9, {**labels, "quantile": _number(float(p["quantile"]))})
    m.add(name, "summary", help, result["count"], labels, suffix="_count")
