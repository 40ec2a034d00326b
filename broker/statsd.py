"""statsd_loop: push counters and gauges to a statsd daemon over UDP every --statsd-interval (nsqd/statsd.go).

Counters are sent as the difference since the last push (`|c`), depths and counts as gauges (`|g`),
under --statsd-prefix with "%s" replaced by this broker's host key. Lines are packed into packets of at
most --statsd-udp-packet-size bytes.
"""

from __future__ import annotations

import gc
import logging
import resource
from typing import TYPE_CHECKING

import trio

from trio_nsq.broker.stats import ChannelStats, E2eLatency, TopicStats, get_stats
from trio_nsq.shared.http import split_host_port
from trio_nsq.shared.names import is_ephemeral

if TYPE_CHECKING:
    from trio_nsq.broker.nsqd import NSQD

log = logging.getLogger("nsqd")


# (statsd name, stats record attribute, counter?) in nsqd's order; counters are sent as differences
TOPIC_FIGURES = (("message_count", "message_count", True), ("message_bytes", "message_bytes", True),
                 ("depth", "depth", False), ("backend_depth", "backend_depth", False))
CHANNEL_FIGURES = (("message_count", "message_count", True), ("depth", "depth", False),
                   ("backend_depth", "backend_depth", False), ("in_flight_count", "in_flight_count", False),
                   ("deferred_count", "deferred_count", False), ("requeue_count", "requeue_count", True),
                   ("timeout_count", "timeout_count", True), ("clients", "client_count", False))


def host_key(address: str) -> str:
    return address.replace(".", "_").replace(":", "_")


def collect(nsqd: NSQD, last: dict[str, int]) -> tuple[list[str], dict[str, int]]:
    """The statsd lines for this push, and the counter values to diff against next time."""
    lines: list[str] = []
    now: dict[str, int] = {}

    def incr(key: str, value: int) -> None:
        now[key] = value
        lines.append(f"{key}:{value - last.get(key, 0)}|c")

    def gauge(key: str, value: float) -> None:
        lines.append(f"{key}:{int(value)}|g")

    def latency(key: str, e2e: E2eLatency) -> None:
        for p in e2e.percentiles or ():
            gauge(f"{key}.e2e_processing_latency_{p.quantile * 100:.0f}", p.value)

    def figures(prefix: str, record: TopicStats | ChannelStats, table: tuple[tuple[str, str, bool], ...]) -> None:
        """A topic's or a channel's figures in the order of its table, then its e2e percentiles."""
        for name, attribute, counter in table:
            (incr if counter else gauge)(f"{prefix}.{name}", getattr(record, attribute))
        latency(prefix, record.e2e_processing_latency)

    exclude_ephemeral = nsqd.options.statsd_exclude_ephemeral
    for topic in get_stats(nsqd, include_clients=False).topics or ():
        if exclude_ephemeral and topic.ephemeral:
            continue
        t = f"topic.{topic.topic_name}"
        figures(t, topic, TOPIC_FIGURES)
        for channel in topic.channels:
            if exclude_ephemeral and is_ephemeral(channel.channel_name):
                continue
            c = f"{t}.channel.{channel.channel_name}"
            figures(c, channel, CHANNEL_FIGURES)
    if nsqd.options.statsd_mem_stats:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        gauge("mem.max_rss_bytes", usage.ru_maxrss * 1024)
        incr("mem.gc_runs", sum(s["collections"] for s in gc.get_stats()))
    return lines, now


def pack(lines: list[str], prefix: str, packet_size: int) -> list[bytes]:
    # every line ends with "\n", as nsqd's statsd client writes them
    packets: list[bytes] = []
    current = b""
    for line in lines:
        data = (prefix + line).encode() + b"\n"
        if current and len(current) + len(data) > packet_size:
            packets.append(current)
            current = b""
        current += data
    if current:
        packets.append(current)
    return packets


async def statsd_loop(nsqd: NSQD) -> None:
    opts = nsqd.options
    last: dict[str, int] = {}
    host, port = split_host_port(opts.statsd_address, default_host="127.0.0.1")
    while True:
        await trio.sleep(opts.statsd_interval)
        await nsqd.loaded.wait()  # every topic open: counters are taken over all of them
        prefix = opts.statsd_prefix
        if "%s" in prefix:
            prefix = prefix.replace("%s", host_key(f"{opts.broadcast_address}:{nsqd.broadcast_http_port}"))
        if prefix and not prefix.endswith("."):
            prefix += "."
        lines, last = collect(nsqd, last)
        log.info("STATSD: pushing stats to %s", opts.statsd_address)
        try:
            sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
            with sock:
                await sock.connect((host, port))
                for packet in pack(lines, prefix, opts.statsd_udp_packet_size):
                    await sock.send(packet)
        except OSError as exc:
            log.error("failed to send UDP packets to statsd(%s) - %s", opts.statsd_address, exc)
