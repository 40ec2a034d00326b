"""A snapshot of the broker's figures (nsqd/stats.go): get_stats walks topics, channels and clients
into records that the renderers read: stats_json (/stats?format=json), stats_text (/stats),
stats_prometheus (/metrics) and statsd (the push to a statsd daemon); broker/http/endpoints.py takes
the snapshots for /stats; mem_stats and GC_PAUSES (installed by broker/http/serve.py) are the memory part.

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
import trio

from trio_nsq.broker.latency import QUANTILES
from trio_nsq.broker.quantile import aggregate
from trio_nsq.shared.names import is_ephemeral
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
# attrs.define, not attrs.frozen: a frozen class's __init__ sets each field through object.__setattr__,
# several times slower, and /stats makes one TopicStats per topic (thousands, issue 33). Nothing changes
# a record once made.


@attrs.define
class Percentile:
    quantile: float
    value: float


@attrs.define
class E2eLatency:
    """nsqd's quantile.Result: the window's count and, when percentiles are configured, their values."""

    count: int = 0
    percentiles: tuple[Percentile, ...] | None = None

    @classmethod
    def from_result(cls, result: dict[str, Any] | None) -> E2eLatency:
        if result is None:
            return NO_LATENCY
        found = result.get("percentiles")
        percentiles = None if found is None else tuple(Percentile(p["quantile"], p["value"]) for p in found)
        return cls(result["count"], percentiles)


NO_LATENCY = E2eLatency()  # shared by every topic and channel without a window


@attrs.define
class PubCount:
    topic: str
    count: int


@attrs.define
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


@attrs.define
class CursorStats:
    last_commit: int | None  # unix ms; None: not committed since the broker started
    pins_retention: bool  # its position keeps the topic's log (not once idle past --cursor-idle-timeout)


@attrs.define
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
    # not in nsqd: delivery-to-FIN latency over the last 5-10 minutes (broker/latency.py), nanoseconds
    delivery_to_fin_latency: E2eLatency = NO_LATENCY
    # not in nsqd: what the channel's settings did (broker/queue_settings.py)
    dead_lettered_count: int = 0
    expired_count: int = 0
    refused_count: int = 0
    dropped_count: int = 0
    # not in nsqd: a positional reader's cursor (POST /log/commit); None for a consumer's channel
    cursor: CursorStats | None = None


@attrs.define
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
    # not in nsqd: the topic's log (positions: where records are in the log's life; none for an ephemeral
    # topic), and its durable tail (what a round has fsynced: positions are served to clients up to it)
    log_first_position: int = 0
    log_end_position: int = 0
    log_messages: int = 0
    log_bytes: int = 0
    log_durable_position: int = 0
    # cluster mode: the topic's replication (role, replicas, leader, epoch, isr, min_isr, high_watermark, log_end)
    replication: dict[str, Any] | None = None

    @property
    def ephemeral(self) -> bool:
        return is_ephemeral(self.topic_name)


@attrs.define
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

    def figures(self) -> dict[str, int]:
        return attrs.asdict(self)  # fields in nsqd's order


@attrs.define
class NsqdStats:
    """One snapshot: what /stats (JSON and text), /metrics and statsd all render."""

    health: str
    start_time: int
    topics: tuple[TopicStats, ...] | None  # None: a topic filter that matched nothing
    producers: tuple[ClientStats, ...] | None  # None when clients were not asked for, or there are none
    memory: MemStats | None
    version: str = VERSION


# --- taking a snapshot --------------------------------------------------------------------------

# the ClientV2 attributes a ClientStats takes as they are
_CLIENT_AS_IS = ("client_id", "hostname", "remote_address", "ready_count", "in_flight_count", "message_count",
                 "finish_count", "requeue_count", "sample_rate", "deflate", "snappy", "user_agent", "tls",
                 "output_buffer_size")


def client_stats(client: ClientV2, topic_filter: str = "") -> ClientStats:
    auth = client.auth_state
    authed = bool(auth is not None and auth.authorizations)
    cipher_suite, tls_version, protocol = _tls_details(client) if client.tls else ("", "", "")
    return ClientStats(
        **{name: getattr(client, name) for name in _CLIENT_AS_IS},
        state=int(client.state),
        connect_ts=int(client.connect_time),
        tls_cipher_suite=cipher_suite,
        tls_version=tls_version,
        tls_negotiated_protocol=protocol,
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
        return NO_LATENCY
    return E2eLatency.from_result(aggregate(streams, topic.nsqd.options.e2e_processing_latency_percentiles))


def channel_stats(channel: Channel, include_clients: bool, topic_filter: str, now: float) -> ChannelStats:
    clients = None
    if include_clients:
        clients = tuple(client_stats(c, topic_filter) for _, c in sorted(channel.clients.items()))  # type: ignore[arg-type]
    depth = channel.depth()
    in_flight = len(channel.in_flight)
    deferred = channel.deferred_count()
    return ChannelStats(
        channel_name=channel.name,
        depth=depth,
        backend_depth=channel.backend_depth(),
        in_flight_count=in_flight,
        deferred_count=deferred,
        message_count=channel.message_count,
        requeue_count=channel.requeue_count,
        timeout_count=channel.timeout_count,
        client_count=len(channel.clients),
        clients=clients,
        paused=channel.paused,
        e2e_processing_latency=NO_LATENCY if channel.e2e is None else E2eLatency.from_result(channel.e2e.result()),
        lag_messages=depth + in_flight + deferred,
        oldest_unfinished_age_ms=_age_ms(channel.oldest_unfinished_timestamp()),
        delivery_to_fin_latency=fin_latency(channel, now),
        dead_lettered_count=channel.dead_lettered_count,
        expired_count=channel.expired_count,
        refused_count=channel.refused_count,
        dropped_count=channel.dropped_count,
        cursor=CursorStats(channel.last_commit_ms, channel.pins) if channel.cursor else None,
    )


def fin_latency(channel: Channel, now: float) -> E2eLatency:
    """The channel's delivery-to-FIN figures at `now` (trio's clock): the FINs of the window and the
    latency at QUANTILES (one shared record for every channel without FINs: /stats may list thousands)."""
    count, values = channel.fin_latency.figures(now)
    if not count:
        return NO_FINS
    return E2eLatency(count, tuple([Percentile(q, float(value)) for q, value in zip(QUANTILES, values)]))


NO_FINS = E2eLatency(0, tuple([Percentile(q, 0.0) for q in QUANTILES]))


def _age_ms(timestamp_ns: int | None) -> int:
    if timestamp_ns is None:
        return 0
    return max(0, (time.time_ns() - timestamp_ns) // 1_000_000)


def topic_stats(topic: Topic, channels: tuple[ChannelStats, ...]) -> TopicStats:
    # positionally: keywords cost a third more per topic, and /stats makes thousands (issue 33)
    record = TopicStats(topic.name, channels, topic.depth(), topic.backend_depth(), topic.message_count,
                        topic.message_bytes, topic.paused, topic_e2e(topic), _idempotency_keys(topic))
    log_ = topic.log
    if log_ is not None:
        segments = log_.segments
        record.log_first_position = segments.start
        record.log_end_position = segments.tail
        record.log_messages = segments.tail_index - segments.start_index()
        record.log_bytes = segments.segment_bytes()
        record.log_durable_position = log_.durable_tail.position
    if topic.replica is not None:
        record.replication = topic.replica.stats()
    return record


def _idempotency_keys(topic: Topic) -> int:
    keys = topic.idempotency
    # held() expires keys first: with none there is nothing to expire (or read the clock for)
    return keys.held() if keys.keys else 0


def get_stats(
    nsqd: NSQD, topic: str = "", channel: str = "", include_clients: bool = True, include_mem: bool = False
) -> NsqdStats:
    """nsqd's GetStats (and what /stats adds around it): one consistent snapshot."""
    producers = None
    if include_clients:
        producers = tuple(client_stats(c, topic) for _, c in sorted(nsqd.clients.items()) if c.pub_counts) or None
    topics: tuple[TopicStats, ...] | None = None
    if not topic:
        # by name: sorting the names (unique) compares strings only, no key function call per topic
        chosen = [t for _, t in sorted(nsqd.topics.items())]
    elif topic in nsqd.topics:
        chosen = [nsqd.topics[topic]]
    else:
        chosen, producers = [], None
    if chosen:
        now = trio.current_time()  # once: read per channel it was a tenth of /stats with thousands
        found = []
        for t in chosen:
            if not channel:
                channels = [c for _, c in sorted(t.channels.items())]
            elif channel in t.channels:
                channels = [t.channels[channel]]
            else:
                continue
            # a list, not a generator: most topics of a broker with thousands have no channel
            found.append(topic_stats(t, tuple([channel_stats(c, include_clients, topic, now) for c in channels])))
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
