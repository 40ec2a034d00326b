"""/metrics: the /stats figures in the Prometheus text exposition format (version 0.0.4), from a snapshot
(broker/stats.py). broker/http/endpoints.py calls prometheus_text."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

from trio_nsq.broker.stats import ClientStats, E2eLatency, get_stats

if TYPE_CHECKING:
    from trio_nsq.broker.nsqd import NSQD


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


# per level, in the order /metrics lists them: (metric name after "nsq_<level>_", record attribute, help
# with {} for the level); a name ending in _total is a counter, any other a gauge
_DEPTHS = (("depth", "depth", "Messages queued in the {} (memory and disk)."),
           ("backend_depth", "backend_depth", "Messages queued in the {}'s disk queue."))
_PAUSED = ("paused", "paused", "1 if the {} is paused.")
_FIGURES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "topic": (
        *_DEPTHS,
        ("messages_total", "message_count", "Messages published to the topic."),
        ("message_bytes_total", "message_bytes", "Bytes of message bodies published to the topic."),
        _PAUSED,
        ("log_messages", "log_messages", "Records the topic's log keeps (unfinished, or retained)."),
        ("log_bytes", "log_bytes", "Bytes of the topic's log on disk."),
    ),
    "channel": (
        *_DEPTHS,
        ("in_flight_count", "in_flight_count", "Messages sent to consumers and not yet finished."),
        ("deferred_count", "deferred_count", "Messages deferred (DPUB, REQ with a delay)."),
        ("messages_total", "message_count", "Messages the channel received from its topic."),
        ("requeued_total", "requeue_count", "Messages requeued by consumers (REQ)."),
        ("timed_out_total", "timeout_count", "In-flight messages that timed out."),
        ("client_count", "client_count", "Consumers connected to the channel."),
        _PAUSED,
        ("lag_messages", "lag_messages", "Messages the channel has not finished (queued, in flight, deferred)."),
        ("dead_lettered_total", "dead_lettered_count", "Messages sent to the channel's dead-letter topic."),
        ("expired_total", "expired_count", "Messages past their TTL, not delivered."),
        ("refused_total", "refused_count", "Publishes refused because the channel was at its maximum depth."),
        ("dropped_total", "dropped_count", "Messages dropped for room (drop-oldest, an ephemeral channel's overflow)."),
    ),
    "client": (
        ("ready_count", "ready_count", "The consumer's RDY count."),
        ("in_flight_count", "in_flight_count", "Messages in flight to the consumer."),
        ("messages_total", "message_count", "Messages sent to the consumer."),
        ("finished_total", "finish_count", "Messages the consumer finished (FIN)."),
        ("requeued_total", "requeue_count", "Messages the consumer requeued (REQ)."),
    ),
}


def _add_all(m: _Metrics, level: str, record: Any, labels: dict[str, str]) -> None:
    for name, attribute, help in _FIGURES[level]:
        kind = "counter" if name.endswith("_total") else "gauge"
        m.add(f"nsq_{level}_{name}", kind, help.format(level), getattr(record, attribute), labels)


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
        _add_all(m, "topic", t, tl)
        m.add("nsq_topic_channels", "gauge", "Channels of the topic.", len(t.channels), tl)
        _latency(m, "nsq_topic_e2e_processing_latency_seconds",
                 "End-to-end processing latency (publish to FIN) over the topic's channels.",
                 t.e2e_processing_latency, tl)
        for c in t.channels:
            cl = {"topic": t.topic_name, "channel": c.channel_name}
            _add_all(m, "channel", c, cl)
            m.add("nsq_channel_oldest_unfinished_age_seconds", "gauge",
                  "Age of the channel's oldest unfinished message (0: none).", c.oldest_unfinished_age_ms / 1000, cl)
            _latency(m, "nsq_channel_e2e_processing_latency_seconds",
                     "End-to-end processing latency (publish to FIN) of the channel.", c.e2e_processing_latency, cl)
            _latency(m, "nsq_channel_delivery_to_fin_latency_seconds",
                     "Delivery-to-FIN latency of the channel over the last 5-10 minutes.", c.delivery_to_fin_latency, cl)
            for client in c.clients or ():
                _add_all(m, "client", client, {**cl, **_client_labels(client)})
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
