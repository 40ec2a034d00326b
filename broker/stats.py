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

import attrs

from trio_nsq.broker.quantile import aggregate
from trio_nsq.shared.http_api import go_number
from trio_nsq.shared.names import is_ephemeral
from trio_nsq.shared.options import format_duration_ns
from trio_nsq.shared.version import VERSION

if TYPE_CHECKING:
    from trio_nsq.broker.channel import Channel
    from trio_nsq.broker.client_v2 import ClientV2
    from trio_nsq.broker.nsqd import NSQD
    from trio_nsq.broker.topic import Topic

def health(nsqd: NSQD) -> str:
    """nsqd's GetHealth: "OK", or "NOK - <error>"."""
    return "OK" if nsqd.health_error is None else f"NOK - {nsqd.health_error}"


# --- the records (nsqd's TopicStats, ChannelStats, ClientV2Stats, memStats) -----------------------


@attrs.frozen
class Percentile:
    quantile: float
    value: float


@attrs.frozen
class E2eLatency:
    """nsqd's quantile.Result: the window's count and, when percentiles are configured, their values."""

    count: int = 0
    percentiles: tuple[Percentile, ...] | None = None

    @classmethod
    def from_result(cls, result: dict[str, Any] | None) -> E2eLatency:
        if result is None:
            return cls()
        found = result.get("percentiles")
        percentiles = None if found is None else tuple(Percentile(p["quantile"], p["value"]) for p in found)
        return cls(result["count"], percentiles)

    def to_json(self) -> dict[str, Any]:
        percentiles = None
        if self.percentiles is not None:
            percentiles = [{"quantile": go_number(p.quantile), "value": go_number(p.value)} for p in self.percentiles]
        return {"count": self.count, "percentiles": percentiles}


@attrs.frozen
class PubCount:
    topic: str
    count: int


@attrs.frozen
class ClientStats:
    """nsqd's ClientV2Stats. pub_counts lists every topic the client published to (nsqd stops after the
    first one, which hides the rest from nsqadmin); it is omitted when empty, as nsqd's omitempty does."""

    client_id: str
    hostname: str
    remote_address: str
    state: int
    ready_count: int
    in_flight_count: int
    message_count: int
    finish_count: int
    requeue_count: int
    connect_ts: int
    sample_rate: int
    deflate: bool
    snappy: bool
    user_agent: str
    tls: bool
    tls_cipher_suite: str
    tls_version: str
    tls_negotiated_protocol: str
    # not in nsqd's stats, but what a client negotiated in IDENTIFY is worth seeing
    output_buffer_size: int
    output_buffer_timeout: int  # ms
    authed: bool
    auth_identity: str
    auth_identity_url: str
    pub_counts: tuple[PubCount, ...]
    version: str = "V2"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "client_id": self.client_id,
            "hostname": self.hostname,
            "version": self.version,
            "remote_address": self.remote_address,
            "state": self.state,
            "ready_count": self.ready_count,
            "in_flight_count": self.in_flight_count,
            "message_count": self.message_count,
            "finish_count": self.finish_count,
            "requeue_count": self.requeue_count,
            "connect_ts": self.connect_ts,
            "sample_rate": self.sample_rate,
            "deflate": self.deflate,
            "snappy": self.snappy,
            "user_agent": self.user_agent,
            "tls": self.tls,
            "tls_cipher_suite": self.tls_cipher_suite,
            "tls_version": self.tls_version,
            "tls_negotiated_protocol": self.tls_negotiated_protocol,
            "tls_negotiated_protocol_is_mutual": False,
            "output_buffer_size": self.output_buffer_size,
            "output_buffer_timeout": self.output_buffer_timeout,
        }
        if self.authed:  # nsqd's omitempty
            out["authed"] = True
            if self.auth_identity:
                out["auth_identity"] = self.auth_identity
            if self.auth_identity_url:
                out["auth_identity_url"] = self.auth_identity_url
        if self.pub_counts:
            out["pub_counts"] = [{"topic": p.topic, "count": p.count} for p in self.pub_counts]
        return out


@attrs.frozen
class ChannelStats:
    channel_name: str
    depth: int
    backend_depth: int
    in_flight_count: int
    deferred_count: int
    message_count: int
    requeue_count: int
    timeout_count: int
    client_count: int
    clients: tuple[ClientStats, ...] | None  # None when clients were not asked for
    paused: bool
    e2e_processing_latency: E2eLatency
    # not in nsqd: how far behind the channel is (unfinished messages: queued, in flight, deferred), and
    # the age of its oldest unfinished message (0: none)
    lag_messages: int = 0
    oldest_unfinished_age_ms: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "channel_name": self.channel_name,
            "depth": self.depth,
            "backend_depth": self.backend_depth,
            "in_flight_count": self.in_flight_count,
            "deferred_count": self.deferred_count,
            "message_count": self.message_count,
            "requeue_count": self.requeue_count,
            "timeout_count": self.timeout_count,
            "client_count": self.client_count,
            "clients": None if self.clients is None else [c.to_json() for c in self.clients],
            "paused": self.paused,
            "e2e_processing_latency": self.e2e_processing_latency.to_json(),
            "lag_messages": self.lag_messages,
            "oldest_unfinished_age_ms": self.oldest_unfinished_age_ms,
        }


@attrs.frozen
class TopicStats:
    topic_name: str
    channels: tuple[ChannelStats, ...]
    depth: int
    backend_depth: int
    message_count: int
    message_bytes: int
    paused: bool
    e2e_processing_latency: E2eLatency
    idempotency_keys: int  # not in nsqd: Idempotency-Keys the topic holds
    # not in nsqd: the topic's log (positions are file << 40 | offset; none for an ephemeral topic)
    log_first_position: int = 0
    log_end_position: int = 0
    log_messages: int = 0
    log_bytes: int = 0

    @property
    def ephemeral(self) -> bool:
        return is_ephemeral(self.topic_name)

    def to_json(self) -> dict[str, Any]:
        return {
            "topic_name": self.topic_name,
            "channels": [c.to_json() for c in self.channels],
            "depth": self.depth,
            "backend_depth": self.backend_depth,
            "message_count": self.message_count,
            "message_bytes": self.message_bytes,
            "paused": self.paused,
            "e2e_processing_latency": self.e2e_processing_latency.to_json(),
            "idempotency_keys": self.idempotency_keys,
            "log_first_position": self.log_first_position,
            "log_end_position": self.log_end_position,
            "log_messages": self.log_messages,
            "log_bytes": self.log_bytes,
        }


@attrs.frozen
class MemStats:
    """nsqd's memStats keys with CPython's nearest figures (see mem_stats)."""

    heap_objects: int
    heap_idle_bytes: int
    heap_in_use_bytes: int
    heap_released_bytes: int
    gc_pause_usec_100: int
    gc_pause_usec_99: int
    gc_pause_usec_95: int
    next_gc_bytes: int
    gc_total_runs: int

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)  # fields in nsqd's order


@attrs.frozen
class NsqdStats:
    """One snapshot: what /stats (JSON and text), /metrics and statsd all render."""

    health: str
    start_time: int
    topics: tuple[TopicStats, ...] | None  # None: a topic filter that matched nothing
    producers: tuple[ClientStats, ...] | None  # None when clients were not asked for, or there are none
    memory: MemStats | None
    version: str = VERSION

    def to_json(self) -> dict[str, Any]:
        """The whole /stats?format=json answer, keys in nsqd's order."""
        doc: dict[str, Any] = {
            "version": self.version,
            "health": self.health,
            "start_time": self.start_time,
            "topics": None if self.topics is None else [t.to_json() for t in self.topics],
        }
        if self.memory is not None:
            doc["memory"] = self.memory.to_json()
        doc["producers"] = None if self.producers is None else [c.to_json() for c in self.producers]
        return doc


# --- taking a snapshot --------------------------------------------------------------------------


def client_stats(client: ClientV2, topic_filter: str = "") -> ClientStats:
    auth = client.auth_state
    authed = bool(auth is not None and auth.authorizations)
    cipher_suite, tls_version, protocol = _tls_details(client) if client.tls else ("", "", "")
    return ClientStats(
        client_id=client.client_id,
        hostname=client.hostname,
        remote_address=client.remote_address,
        state=int(client.state),
        ready_count=client.ready_count,
        in_flight_count=client.in_flight_count,
        message_count=client.message_count,
        finish_count=client.finish_count,
        requeue_count=client.requeue_count,
        connect_ts=int(client.connect_time),
        sample_rate=client.sample_rate,
        deflate=client.deflate,
        snappy=client.snappy,
        user_agent=client.user_agent,
        tls=client.tls,
        tls_cipher_suite=cipher_suite,
        tls_version=tls_version,
        tls_negotiated_protocol=protocol,
        output_buffer_size=client.output_buffer_size,
        output_buffer_timeout=int(client.output_buffer_timeout * 1000),
        authed=authed,
        auth_identity=(auth.identity or "") if auth is not None and authed else "",
        auth_identity_url=(auth.identity_url or "") if auth is not None and authed else "",
        pub_counts=tuple(PubCount(topic, count) for topic, count in sorted(client.pub_counts.items())
                         if not topic_filter or topic == topic_filter),
    )


def _tls_details(client: ClientV2) -> tuple[str, str, str]:
    """(cipher suite, version as nsqd names it, negotiated ALPN protocol); empty when unknown."""
    ssl_object = _find_ssl_stream(client.stream)
    if ssl_object is None:
        return "", "", ""
    try:
        cipher = ssl_object.cipher()
        version = (ssl_object.version() or "").replace("TLSv", "TLS")
        return (cipher[0] if cipher else ""), version, ssl_object.selected_alpn_protocol() or ""
    except (AttributeError, ValueError):
        return "", "", ""


def _find_ssl_stream(stream: Any) -> Any:
    """The trio.SSLStream under snappy/deflate wrappers, if any."""
    for _ in range(4):
        if stream is None:
            return None
        if hasattr(stream, "cipher") and hasattr(stream, "version"):
            return stream
        # trio_nsq.shared.streams wrappers (snappy, deflate) keep the stream they wrap as `inner`
        stream = getattr(stream, "inner", None) or getattr(stream, "transport_stream", None) or getattr(stream, "stream", None)
    return None


def topic_e2e(topic: Topic) -> E2eLatency:
    """nsqd's AggregateChannelE2eProcessingLatency: null percentiles while no channel keeps a window."""
    streams = [ch.e2e for ch in topic.channels.values() if ch.e2e is not None]
    if not streams:
        return E2eLatency()
    return E2eLatency.from_result(aggregate(streams, topic.nsqd.options.e2e_processing_latency_percentiles))


def channel_stats(channel: Channel, include_clients: bool, topic_filter: str = "") -> ChannelStats:
    clients = None
    if include_clients:
        clients = tuple(client_stats(c, topic_filter) for _, c in sorted(channel.clients.items()))  # type: ignore[arg-type]
    return ChannelStats(
        channel_name=channel.name,
        depth=channel.depth(),
        backend_depth=channel.backend_depth(),
        in_flight_count=len(channel.in_flight),
        deferred_count=channel.deferred_count(),
        message_count=channel.message_count,
        requeue_count=channel.requeue_count,
        timeout_count=channel.timeout_count,
        client_count=len(channel.clients),
        clients=clients,
        paused=channel.paused,
        e2e_processing_latency=E2eLatency.from_result(channel.e2e.result() if channel.e2e is not None else None),
        lag_messages=channel.depth() + len(channel.in_flight) + channel.deferred_count(),
        oldest_unfinished_age_ms=_age_ms(channel.oldest_unfinished_timestamp()),
    )


def _age_ms(timestamp_ns: int | None) -> int:
    if timestamp_ns is None:
        return 0
    return max(0, (time.time_ns() - timestamp_ns) // 1_000_000)


def topic_stats(topic: Topic, channels: tuple[ChannelStats, ...]) -> TopicStats:
    return TopicStats(
        topic_name=topic.name,
        channels=channels,
        depth=topic.depth(),
        backend_depth=topic.backend_depth(),
        message_count=topic.message_count,
        message_bytes=topic.message_bytes,
        paused=topic.paused,
        e2e_processing_latency=topic_e2e(topic),
        idempotency_keys=topic.idempotency.held(),
        **_log_stats(topic),
    )


def _log_stats(topic: Topic) -> dict[str, int]:
    log_ = topic.log
    if log_ is None:
        return {}
    segments = log_.segments
    return {"log_first_position": segments.start, "log_end_position": segments.tail,
            "log_messages": segments.tail_index - segments.start_index(), "log_bytes": segments.segment_bytes()}


def get_stats(
    nsqd: NSQD, topic: str = "", channel: str = "", include_clients: bool = True, include_mem: bool = False
) -> NsqdStats:
    """nsqd's GetStats (and what /stats adds around it): one consistent snapshot."""
    producers = None
    if include_clients:
        producers = tuple(client_stats(c, topic) for _, c in sorted(nsqd.clients.items()) if c.pub_counts) or None
    topics: tuple[TopicStats, ...] | None = None
    if not topic:
        chosen = sorted(nsqd.topics.values(), key=lambda t: t.name)
    elif topic in nsqd.topics:
        chosen = [nsqd.topics[topic]]
    else:
        chosen, producers = [], None
    if chosen:
        found = []
        for t in chosen:
            if not channel:
                channels = sorted(t.channels.values(), key=lambda c: c.name)
            elif channel in t.channels:
                channels = [t.channels[channel]]
            else:
                continue
            found.append(topic_stats(t, tuple(channel_stats(c, include_clients, topic) for c in channels)))
        topics = tuple(found)
    elif not topic:
        topics = ()
    return NsqdStats(health=health(nsqd), start_time=nsqd.start_time, topics=topics, producers=producers,
                     memory=mem_stats() if include_mem else None)


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


def mem_stats() -> MemStats:
    """nsqd's memStats keys with CPython's nearest figures: heap_objects = allocated blocks, heap_in_use
    = resident set size, GC pauses from GC_PAUSES, next_gc_bytes = 0 (CPython triggers collections by
    object counts, not bytes), gc_total_runs = collections of every generation."""
    return MemStats(
        heap_objects=sys.getallocatedblocks(),
        heap_idle_bytes=0,
        heap_in_use_bytes=_rss_bytes(),
        heap_released_bytes=0,
        gc_pause_usec_100=GC_PAUSES.percentile_usec(100),
        gc_pause_usec_99=GC_PAUSES.percentile_usec(99),
        gc_pause_usec_95=GC_PAUSES.percentile_usec(95),
        next_gc_bytes=0,
        gc_total_runs=sum(s["collections"] for s in gc.get_stats()),
    )


# --- text (/stats?format=text, the default) ---------------------------------------------------


def nanoseconds_to_human(v: float) -> str:
    """nsqd's stringy.NanoSecondToHuman."""
    if v > 1e9:
        return f"{v / 1e9:.1f}s"
    if v > 1e6:
        return f"{v / 1e6:.1f}ms"
    if v > 1e3:
        return f"{v / 1e3:.1f}us"
    return f"{v:.1f}ns"


def _e2e_text(latency: E2eLatency) -> str:
    return ", ".join(nanoseconds_to_human(p.value) for p in latency.percentiles or ())


def _client_text(stats: ClientStats, now: float) -> str:
    connected = format_duration_ns(int(max(0, now - stats.connect_ts)) * 1_000_000_000)
    port = stats.remote_address.rsplit(":", 1)[-1]
    ident = f"{stats.hostname}:{port} {stats.user_agent}"
    if stats.pub_counts:
        total = sum(p.count for p in stats.pub_counts)
        topics = ",".join(f"{p.topic}={p.count}" for p in stats.pub_counts)
        return f"[{stats.version} {ident:<21}] msgs: {total:<8} topics: {topics} connected: {connected}"
    return (
        f"[{stats.version} {ident:<21}] state: {stats.state} inflt: {stats.in_flight_count:<4} "
        f"rdy: {stats.ready_count:<4} fin: {stats.finish_count:<8} re-q: {stats.requeue_count:<8} "
        f"msgs: {stats.message_count:<8} connected: {connected}"
    )


def stats_text(stats: NsqdStats) -> str:
    """nsqd's printStats, line for line."""
    now = time.time()
    started = time.localtime(stats.start_time)
    offset = time.strftime("%z", started)
    rfc3339 = time.strftime("%Y-%m-%dT%H:%M:%S", started) + ("Z" if offset in ("+0000", "-0000") else f"{offset[:3]}:{offset[3:]}")
    uptime_ns = max(0, time.time_ns() - stats.start_time * 1_000_000_000)
    impl = f"python{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    lines = [
        f"nsqd v{stats.version} (built w/{impl})",
        f"start_time {rfc3339}",
        f"uptime {format_duration_ns(uptime_ns)}",
        "",
        f"Health: {stats.health}",
    ]
    if stats.memory is not None:
        lines += ["", "Memory:"]
        lines += [f"   {key:<25}\t{value}" for key, value in stats.memory.to_json().items()]
    out = "\n".join(lines) + "\n"
    out += "\nTopics: None\n" if not stats.topics else "\nTopics:"
    for t in stats.topics or ():
        prefix = "*P " if t.paused else "   "
        out += (
            f"\n{prefix}[{t.topic_name:<15}] depth: {t.depth:<5} be-depth: {t.backend_depth:<5} "
            f"msgs: {t.message_count:<8} e2e%: {_e2e_text(t.e2e_processing_latency)}"
            + (f" idempotency-keys: {t.idempotency_keys}" if t.idempotency_keys else "") + "\n"
        )
        for c in t.channels:
            prefix = "   *P " if c.paused else "      "
            out += (
                f"{prefix}[{c.channel_name:<25}] depth: {c.depth:<5} be-depth: {c.backend_depth:<5} "
                f"inflt: {c.in_flight_count:<4} def: {c.deferred_count:<4} re-q: {c.requeue_count:<5} "
                f"timeout: {c.timeout_count:<5} msgs: {c.message_count:<8} "
                f"e2e%: {_e2e_text(c.e2e_processing_latency)}\n"
            )
            for client in c.clients or ():
                out += f"        {_client_text(client, now)}\n"
    if not stats.producers:
        out += "\nProducers: None\n"
    else:
        out += "\nProducers:\n"
        for client in stats.producers:
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


# (metric, type, help, record attribute) per level; counters carry the _total suffix
_TOPIC_METRICS = [
    ("nsq_topic_depth", "gauge", "Messages queued in the topic (memory and disk).", "depth"),
    ("nsq_topic_backend_depth", "gauge", "Messages queued in the topic's disk queue.", "backend_depth"),
    ("nsq_topic_messages_total", "counter", "Messages published to the topic.", "message_count"),
    ("nsq_topic_message_bytes_total", "counter", "Bytes of message bodies published to the topic.", "message_bytes"),
    ("nsq_topic_paused", "gauge", "1 if the topic is paused.", "paused"),
    ("nsq_topic_log_messages", "gauge", "Records the topic's log keeps (unfinished, or retained).", "log_messages"),
    ("nsq_topic_log_bytes", "gauge", "Bytes of the topic's log on disk.", "log_bytes"),
]
_CHANNEL_METRICS = [
    ("nsq_channel_depth", "gauge", "Messages queued in the channel (memory and disk).", "depth"),
    ("nsq_channel_backend_depth", "gauge", "Messages queued in the channel's disk queue.", "backend_depth"),
    ("nsq_channel_in_flight_count", "gauge", "Messages sent to consumers and not yet finished.", "in_flight_count"),
    ("nsq_channel_deferred_count", "gauge", "Messages deferred (DPUB, REQ with a delay).", "deferred_count"),
    ("nsq_channel_messages_total", "counter", "Messages the channel received from its topic.", "message_count"),
    ("nsq_channel_requeued_total", "counter", "Messages requeued by consumers (REQ).", "requeue_count"),
    ("nsq_channel_timed_out_total", "counter", "In-flight messages that timed out.", "timeout_count"),
    ("nsq_channel_client_count", "gauge", "Consumers connected to the channel.", "client_count"),
    ("nsq_channel_paused", "gauge", "1 if the channel is paused.", "paused"),
    ("nsq_channel_lag_messages", "gauge", "Messages the channel has not finished (queued, in flight, deferred).",
     "lag_messages"),
]
_CLIENT_METRICS = [
    ("nsq_client_ready_count", "gauge", "The consumer's RDY count.", "ready_count"),
    ("nsq_client_in_flight_count", "gauge", "Messages in flight to the consumer.", "in_flight_count"),
    ("nsq_client_messages_total", "counter", "Messages sent to the consumer.", "message_count"),
    ("nsq_client_finished_total", "counter", "Messages the consumer finished (FIN).", "finish_count"),
    ("nsq_client_requeued_total", "counter", "Messages the consumer requeued (REQ).", "requeue_count"),
]


def _add_all(m: _Metrics, table: list[tuple[str, str, str, str]], record: Any, labels: dict[str, str]) -> None:
    for name, kind, help, attribute in table:
        m.add(name, kind, help, getattr(record, attribute), labels)


def prometheus_text(nsqd: NSQD) -> str:
    """The /stats figures in the Prometheus text exposition format (version 0.0.4).

    Counters carry the ``_total`` suffix; depths and counts of what is held now are gauges; e2e latency
    percentiles are a summary in seconds. Labels: topic, channel, and for clients client_id, hostname,
    remote_address and user_agent."""
    stats = get_stats(nsqd, include_clients=True, include_mem=True)
    m = _Metrics()
    m.add("nsq_up", "gauge", "1 while the broker is healthy, 0 when it reports an error.",
          1 if stats.health == "OK" else 0)
    m.add("nsq_info", "gauge", "Constant 1, labelled with the NSQ version this broker implements.", 1,
          {"version": stats.version, "broadcast_address": nsqd.options.broadcast_address})
    m.add("nsq_start_time_seconds", "gauge", "When the broker started, in seconds since the epoch.", stats.start_time)
    for t in stats.topics or ():
        tl = {"topic": t.topic_name}
        _add_all(m, _TOPIC_METRICS, t, tl)
        m.add("nsq_topic_channels", "gauge", "Channels of the topic.", len(t.channels), tl)
        _latency(m, "nsq_topic_e2e_processing_latency_seconds",
                 "End-to-end processing latency (publish to FIN) over the topic's channels.",
                 t.e2e_processing_latency, tl)
        for c in t.channels:
            cl = {"topic": t.topic_name, "channel": c.channel_name}
            _add_all(m, _CHANNEL_METRICS, c, cl)
            m.add("nsq_channel_oldest_unfinished_age_seconds", "gauge",
                  "Age of the channel's oldest unfinished message (0: none).", c.oldest_unfinished_age_ms / 1000, cl)
            _latency(m, "nsq_channel_e2e_processing_latency_seconds",
                     "End-to-end processing latency (publish to FIN) of the channel.", c.e2e_processing_latency, cl)
            for client in c.clients or ():
                _add_all(m, _CLIENT_METRICS, client, {**cl, **_client_labels(client)})
    for client in stats.producers or ():
        for pub in client.pub_counts:
            m.add("nsq_producer_published_total", "counter", "Messages a TCP producer published, per topic.",
                  pub.count, {"topic": pub.topic, **_client_labels(client)})
    m.add("nsq_clients", "gauge", "TCP client connections.", len(nsqd.clients))
    assert stats.memory is not None  # asked for above
    m.add("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", stats.memory.heap_in_use_bytes)
    m.add("python_allocated_blocks", "gauge", "Memory blocks currently allocated by the interpreter.",
          stats.memory.heap_objects)
    for generation, gen in enumerate(gc.get_stats()):
        m.add("python_gc_collections_total", "counter", "Garbage collections, per generation.",
              gen["collections"], {"generation": str(generation)})
    return m.render()


def _client_labels(client: ClientStats) -> dict[str, str]:
    return {
        "client_id": client.client_id,
        "hostname": client.hostname,
        "remote_address": client.remote_address,
        "user_agent": client.user_agent,
    }


def _latency(m: _Metrics, name: str, help: str, latency: E2eLatency, labels: dict[str, str]) -> None:
    """A summary: one sample per configured quantile (ns converted to seconds) and the window's count."""
    if latency.percentiles is None:
        return
    for p in latency.percentiles:
        m.add(name, "summary", help, p.value / 1e9, {**labels, "quantile": _number(float(p.quantile))})
    m.add(name, "summary", help, latency.count, labels, suffix="_count")
