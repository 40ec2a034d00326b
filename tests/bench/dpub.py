"""Deferred publishes at scale, beside Go nsqd (`make bench NSQ_REFERENCE=<dir>`; without it, ours only):

    python -m tests.bench.dpub [--reference DIR] [--counts 100000 200000 1000000] [--rounds N]

`DPUB t 3600000` of 100-byte bodies, pipelined by 1,000 (1,000 commands sent, then their 1,000 answers
read), to a topic whose channel was created first, at default flags and with --mem-queue-size=0: the time
until the last answer, then until /stats counts every message in the channel (deferred; Go nsqd with
--mem-queue-size=0 drops the delay on the way through its disk queue: queued), and the broker's RSS. Each count in turn, Go nsqd and trio-nsqd alternately; the time must grow as the count does
(linearly), and stay within Go nsqd's.

Then a consumer subscribes (RDY 1), so the channel reads every deferred record it was handed (the time
until a DPUB due at once published behind them comes, and the RSS with all of them held deferred: what a
channel keeps per deferred message);
and, on a second topic, as many `DPUB t2 <short>` (a delay past the time publishing took), a consumer
subscribed once they are all published, every message delivered when due and FIN'd: the time from the
first delivery to the last, and the broker's peak RSS (VmHWM) over the whole run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
import urllib.request

from tests.bench.broker import Broker, post
from tests.bench.machine import describe, machine, merge_report
from trio_nsq.shared.protocol import MAGIC_V2, FrameParser, encode_dpub, encode_rdy, encode_sub

FLAGS = {"default flags": (), "--mem-queue-size=0": ("--mem-queue-size=0",)}
PIPELINE = 1000
BODY = b"d" * 100



def _held(broker: Broker) -> tuple[int, int]:
    """The channel's (deferred_count, depth): Go nsqd with --mem-queue-size=0 writes a DPUB's message to
    the topic's disk queue without its delay (the channel gets it as a plain message, at once)."""
    with urllib.request.urlopen(f"{broker.http_url}/stats?format=json&topic=t", timeout=30) as resp:
        doc = json.loads(resp.read())
    channels = [c for t in doc.get("topics") or [] for c in t["channels"]]
    return (channels[0]["deferred_count"], channels[0]["depth"]) if channels else (0, 0)


def _dpub(broker: Broker, topic: str, delay_ms: int, count: int) -> float:
    """`count` DPUBs, pipelined by PIPELINE: the seconds until the last answer."""
    command_bytes = encode_dpub(topic, delay_ms, BODY) * PIPELINE
    parser = FrameParser()
    with socket.create_connection(broker.tcp) as sock:
        sock.sendall(MAGIC_V2)
        started = time.perf_counter()
        for _ in range(count // PIPELINE):
            send_answered(sock, parser, command_bytes, PIPELINE)
        return time.perf_counter() - started


def send_answered(sock: socket.socket, parser: FrameParser, commands: bytes, count: int) -> None:
    """Send `count` pipelined publishing commands and read their `count` answers (each must be OK)."""
    sock.sendall(commands)
    answered = 0
    while answered < count:
        data = sock.recv(1 << 16)
        if not data:
            raise RuntimeError("the broker closed the connection")
        parser.feed(data)
        while (frame := parser.next_frame()) is not None:
            if frame[0] != 0:
                raise RuntimeError(f"DPUB refused: {frame!r}")
            answered += 1


def _subscribe(broker: Broker, topic: str, rdy: int) -> tuple[socket.socket, FrameParser]:
    sock = socket.create_connection(broker.tcp)
    sock.sendall(MAGIC_V2 + encode_sub(topic, "c"))
    parser = FrameParser()
    while (frame := parser.next_frame()) is None:
        parser.feed(sock.recv(1 << 16))
    if frame != (0, b"OK"):
        raise RuntimeError(f"SUB refused: {frame!r}")
    sock.sendall(encode_rdy(rdy))
    return sock, parser


def _read_all(broker: Broker, topic: str) -> tuple[float, int]:
    """A consumer subscribes with RDY 1 to a channel whose log holds the deferred records and, behind them,
    one `DPUB <topic> 1` (due at once): the seconds until that one comes, when the channel has read every
    deferred record (none is sent) and reached it; and how many deferred records came early instead (Go
    nsqd's disk queue drops their delay: each is FIN'd and counted)."""
    with socket.create_connection(broker.tcp) as pub:
        pub.sendall(MAGIC_V2 + encode_dpub(topic, 1, b"marker"))
        parser = FrameParser()
        while (frame := parser.next_frame()) is None:
            parser.feed(pub.recv(1 << 16))
        if frame != (0, b"OK"):
            raise RuntimeError(f"DPUB refused: {frame!r}")
    started = time.perf_counter()
    early = 0
    sock, parser = _subscribe(broker, topic, 1)
    with sock:
        sock.settimeout(600)
        while True:
            frame = parser.next_frame()
            if frame is None:
                parser.feed(sock.recv(1 << 16))
            elif frame[1] == b"_heartbeat_":
                sock.sendall(b"NOP\n")
            elif frame[0] == 2:
                sock.sendall(b"FIN " + frame[1][10:26] + b"\n")
                if frame[1].endswith(b"marker"):
                    return time.perf_counter() - started, early
                early += 1
            else:
                raise RuntimeError(f"unexpected frame {frame!r}")


def _consume(broker: Broker, topic: str, count: int, timeout: float) -> tuple[float, float]:
    """Subscribe with RDY 2500, FIN every message: (when the first came, perf_counter; seconds from the
    first to the count-th)."""
    sock, parser = _subscribe(broker, topic, 2500)
    first = 0.0
    got = 0
    with sock:
        sock.settimeout(timeout)
        while got < count:
            data = sock.recv(1 << 18)
            if not data:
                raise RuntimeError("the broker closed the connection")
            parser.feed(data)
            fins = []
            while True:
                run = parser.message_run()
                if run:
                    if not got:
                        first = time.perf_counter()
                    got += len(run)
                    fins.extend(b"FIN " + msg[10:26] + b"\n" for msg in run)
                    continue
                frame = parser.next_frame()
                if frame is None:
                    break
                if frame[1] == b"_heartbeat_":
                    fins.append(b"NOP\n")
                elif frame[0] != 0:
                    raise RuntimeError(f"unexpected frame {frame!r}")
            if fins:
                sock.sendall(b"".join(fins))
        return first, time.perf_counter() - first


def run_once(side: str, reference: str | None, flags: tuple[str, ...], count: int) -> dict[str, float]:
    command = [os.path.join(reference, "nsqd")] if side == "go" and reference else None
    broker = Broker(*flags, command=command)
    try:
        for topic in ("t", "t2"):
            post(f"{broker.http_url}/topic/create?topic={topic}")
            post(f"{broker.http_url}/channel/create?topic={topic}&channel=c")
        started = time.perf_counter()
        published = _dpub(broker, "t", 3_600_000, count)
        while sum(held := _held(broker)) < count:
            time.sleep(0.05)
        in_channel = time.perf_counter() - started
        rss = broker.rss_mb()
        read_s, early = _read_all(broker, "t")
        held_rss = broker.rss_mb()
        # deliveries: a delay the publishing cannot outlast, so every record is read before it is due
        delay = int(published * 2 + 5)
        started = time.perf_counter()
        _dpub(broker, "t2", delay * 1000, count)
        first, delivering = _consume(broker, "t2", count, timeout=delay + 60)
        return {"publish_s": published, "deferred_s": in_channel, "deferred": held[0], "rss_mb": rss,
                "read_s": read_s, "early": early, "held_rss_mb": held_rss, "delay_s": delay,
                "late_s": first - (started + delay), "deliver_s": delivering,
                "peak_rss_mb": broker.memory()["VmHWM"] / (1024 * 1024), "cpu_s": broker.cpu_seconds()}
    finally:
        broker.close()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", help="folder with Go's nsqd 1.3.0 (else ours only)")
    parser.add_argument("--counts", type=int, nargs="*", default=[100_000, 200_000, 1_000_000])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--output", default="bench-results.json")
    args = parser.parse_args(argv)
    print(f"machine: {describe(machine())}")
    sides = ("go", "trio") if args.reference else ("trio",)
    samples: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for title, flags in FLAGS.items():
            for count in args.counts:
                for side in sides:
                    figures = run_once(side, args.reference, flags, count)
                    samples.setdefault(f"{title}|{count}|{side}", []).append(figures)
                    print(f"DPUB x {count:>9,} {title:<20} {side:<5} answered in {figures['publish_s']:7.2f} s, "
                          f"all in the channel in {figures['deferred_s']:7.2f} s ({figures['deferred']:,.0f} "
                          f"deferred), RSS {figures['rss_mb']:5.0f} MB; read by the channel in "
                          f"{figures['read_s']:6.2f} s ({figures['early']:,} of them delivered early), "
                          f"RSS {figures['held_rss_mb']:5.0f} MB; "
                          f"DPUB {figures['delay_s']:.0f} s delivered in {figures['deliver_s']:6.2f} s "
                          f"(the first {figures['late_s']:+.2f} s after due), peak RSS {figures['peak_rss_mb']:5.0f} MB",
                          flush=True)
    results = {}
    print(f"\n{'DPUB t 3600000, pipelined by 1,000':<44} {'Go nsqd':>10} {'trio-nsqd':>10} {'ratio':>6}  (s until all in the channel)")
    for title in FLAGS:
        for count in args.counts:
            med = {side: statistics.median(s["deferred_s"] for s in samples[f"{title}|{count}|{side}"]) for side in sides}
            rss = {side: statistics.median(s["rss_mb"] for s in samples[f"{title}|{count}|{side}"]) for side in sides}
            key = f"{count}_{'mem0' if flags_key(title) else 'default'}"
            extra = {name: {side: statistics.median(s[name] for s in samples[f"{title}|{count}|{side}"]) for side in sides}
                     for name in ("read_s", "held_rss_mb", "deliver_s", "peak_rss_mb")}
            results[key] = {"count": count, "flags": title, "seconds": med, "rss_mb": rss, **extra}
            go = med.get("go")
            print(f"{count:>10,} {title:<33} {go if go is not None else float('nan'):>10.2f} {med['trio']:>10.2f} "
                  f"{(med['trio'] / go) if go else float('nan'):>6.2f}")
    merge_report(args.output, results, "dpub")
    return results


def flags_key(title: str) -> bool:
    return "mem-queue-size" in title


if __name__ == "__main__":
    main()
