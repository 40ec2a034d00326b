"""/stats?format=text (the default): a snapshot (broker/stats.py) as nsqd's printStats writes it, line
for line (nsq_stat and people read it). broker/http/endpoints.py calls stats_text."""

from __future__ import annotations

import sys
import time

from trio_nsq.broker.stats import ChannelStats, ClientStats, E2eLatency, NsqdStats, TopicStats
from trio_nsq.shared.options import format_duration_ns


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


def _ours_text(c: ChannelStats) -> str:
    """Not in nsqd, after its line: the delivery-to-FIN percentiles (p50, p90, p99, p99.9) once there are
    FINs, the age of the oldest unfinished message while there is one, what the channel's settings
    did (dead-lettered, expired, refused, dropped) where they did something, and a cursor's state."""
    out = ""
    if c.delivery_to_fin_latency.count:
        out += f" fin%: {_e2e_text(c.delivery_to_fin_latency)}"
    if c.oldest_unfinished_age_ms:
        out += f" oldest: {nanoseconds_to_human(c.oldest_unfinished_age_ms * 1e6)}"
    for label, value in (("dead-lettered", c.dead_lettered_count), ("expired", c.expired_count),
                         ("refused", c.refused_count), ("dropped", c.dropped_count)):
        if value:
            out += f" {label}: {value}"
    if c.cursor is not None:  # a positional reader's cursor (/log/commit): does it keep the log
        out += " cursor: " + ("keeps the log" if c.cursor.pins_retention else "idle")
    return out


def _queue_text(name: str, width: int, record: TopicStats | ChannelStats, counts: str) -> str:
    """A topic's or a channel's line, from the name on: what they both show around the channel's counts."""
    return (f"[{name:<{width}}] depth: {record.depth:<5} be-depth: {record.backend_depth:<5} {counts}"
            f"msgs: {record.message_count:<8} e2e%: {_e2e_text(record.e2e_processing_latency)}")


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
        lines += [f"   {key:<25}\t{value}" for key, value in stats.memory.figures().items()]
    out = "\n".join(lines) + "\n"
    out += "\nTopics: None\n" if not stats.topics else "\nTopics:"
    for t in stats.topics or ():
        out += (
            f"\n{'*P ' if t.paused else '   '}{_queue_text(t.topic_name, 15, t, '')}"
            + (f" idempotency-keys: {t.idempotency_keys}" if t.idempotency_keys else "") + "\n"
        )
        for c in t.channels:
            counts = (f"inflt: {c.in_flight_count:<4} def: {c.deferred_count:<4} re-q: {c.requeue_count:<5} "
                      f"timeout: {c.timeout_count:<5} ")
            out += f"{'   *P ' if c.paused else '      '}{_queue_text(c.channel_name, 25, c, counts)}{_ours_text(c)}\n"
            for client in c.clients or ():
                out += f"        {_client_text(client, now)}\n"
    if not stats.producers:
        out += "\nProducers: None\n"
    else:
        out += "\nProducers:\n"
        for client in stats.producers:
            out += f"   {_client_text(client, now)}\n"
    return out


