"""Deferred publishes at scale, beside Go nsqd (`make bench NSQ_REFERENCE=<dir>`; without it, ours only):

    python -m tests.bench.dpub [--reference DIR] [--counts 100000 200000 1000000] [--rounds N]

`DPUB t 3600000` of 100-byte bodies, pipelined by 1,000 (1,000 commands sent, then their 1,000 answers
read), to a topic whose channel was created first, at default flags and with --mem-queue-size=0: the time
until the last answer, then until /stats counts every message in the channel (deferred; Go nsqd with
--mem-queue-size=0 drops the delay on the way through its disk queue: queued), and the broker's RSS. Each count in turn, Go nsqd and trio-nsqd alternately; the time must grow as the count does
(linearly), and stay within Go nsqd's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
import urllib.request

from tests.bench.broker import Broker
from tests.bench.machine import describe, machine, merge_report
from trio_nsq.shared.protocol import MAGIC_V2, FrameParser, encode_dpub

FLAGS = {"default flags": (), "--mem-queue-size=0": ("--mem-queue-size=0",)}
PIPELINE = 1000
BODY = b"d" * 100


def _post(url: str) -> None:
    urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=10).read()


def _held(broker: Broker) -> tuple[int, int]:
    """The channel's (deferred_count, depth): Go nsqd with --mem-queue-size=0 writes a DPUB's message to
    the topic's disk queue without its delay (the channel gets it as a plain message, at once)."""
    with urllib.request.urlopen(f"{broker.http_url}/stats?format=json&topic=t", timeout=30) as resp:
        doc = json.loads(resp.read())
    channels = [c for t in doc.get("topics") or [] for c in t["channels"]]
    return (channels[0]["deferred_count"], channels[0]["depth"]) if channels else (0, 0)


def run_once(side: str, reference: str | None, flags: tuple[str, ...], count: int) -> dict[str, float]:
    command = [os.path.join(reference, "nsqd")] if side == "go" and reference else None
    broker = Broker(*flags, command=command)
    try:
        _post(f"{broker.http_url}/topic/create?topic=t")
        _post(f"{broker.http_url}/channel/create?topic=t&channel=c")
        command_bytes = encode_dpub("t", 3_600_000, BODY) * PIPELINE
        parser = FrameParser()
        with socket.create_connection(broker.tcp) as sock:
            sock.sendall(MAGIC_V2)
            started = time.perf_counter()
            for _ in range(count // PIPELINE):
                sock.sendall(command_bytes)
                answered = 0
                while answered < PIPELINE:
                    data = sock.recv(1 << 16)
                    if not data:
                        raise RuntimeError("the broker closed the connection")
                    parser.feed(data)
                    while (frame := parser.next_frame()) is not None:
                        if frame[0] != 0:
                            raise RuntimeError(f"DPUB refused: {frame!r}")
                        answered += 1
            published = time.perf_counter() - started
            while sum(held := _held(broker)) < count:
                time.sleep(0.05)
            in_channel = time.perf_counter() - started
        return {"publish_s": published, "deferred_s": in_channel, "deferred": held[0], "rss_mb": broker.rss_mb(),
                "cpu_s": broker.cpu_seconds()}
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
                          f"deferred), RSS {figures['rss_mb']:5.0f} MB", flush=True)
    results = {}
    print(f"\n{'DPUB t 3600000, pipelined by 1,000':<44} {'Go nsqd':>10} {'trio-nsqd':>10} {'ratio':>6}  (s until all in the channel)")
    for title in FLAGS:
        for count in args.counts:
            med = {side: statistics.median(s["deferred_s"] for s in samples[f"{title}|{count}|{side}"]) for side in sides}
            rss = {side: statistics.median(s["rss_mb"] for s in samples[f"{title}|{count}|{side}"]) for side in sides}
            key = f"{count}_{'mem0' if flags_key(title) else 'default'}"
            results[key] = {"count": count, "flags": title, "seconds": med, "rss_mb": rss}
            go = med.get("go")
            print(f"{count:>10,} {title:<33} {go if go is not None else float('nan'):>10.2f} {med['trio']:>10.2f} "
                  f"{(med['trio'] / go) if go else float('nan'):>6.2f}")
    merge_report(args.output, results, "dpub")
    return results


def flags_key(title: str) -> bool:
    return "mem-queue-size" in title


if __name__ == "__main__":
    main()
