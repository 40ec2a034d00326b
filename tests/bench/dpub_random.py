"""Day-long deferred publishes with random delays through a broker, past the first segment:

    python -m tests.bench.dpub_random [--counts 1000000 4000000] [--rounds N]

A broker with --max-defer-time=48h, a topic `t` whose channel `c` has one consumer subscribed with RDY 1
(so the channel reads every record as it is written and indexes the deferred ones), then `count`
`DPUB t <1-24 h, random>` of 100-byte bodies, pipelined by 1,000: the seconds each 500,000 took, the total,
the ratio of the largest count's total to the smallest's (the time must grow as the count does: once the
topic's first segment is full, reclaim moves the deferred records keeping it to the channel's own queue, and
each of its calls asks the channel's DeferredIndex for a few thousand positions among millions), the longest
/ping (HTTP, polled every 50 ms by a process of its own through the run: how long the event loop stalls at most), and
the broker's RSS (VmRSS at the end, VmHWM the peak) and CPU seconds (each 500k's too). The broker runs
with its event-loop steps timed (tests/bench/loop_steps.py): the longest step's CPU time is what the loop
stalls by its own work, whatever else the machine runs (which a /ping's wall time includes).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from tests.bench.broker import Broker, post
from tests.bench.dpub import _subscribe, send_answered
from tests.bench.machine import describe, machine, merge_report
from trio_nsq.shared.protocol import MAGIC_V2, FrameParser, encode_dpub

PIPELINE = 1000
BODY = b"d" * 100
SLICE = 500_000
HOUR_MS = 3_600_000


class TimedBroker(Broker):
    """A trio-nsqd whose event-loop steps are timed (tests/bench/loop_steps.py)."""

    def __init__(self, *flags: str) -> None:
        self.steps_file = f"{tempfile.mkdtemp(prefix='trio-nsq-steps-')}/steps.json"
        super().__init__(*flags, env={"TRIO_NSQ_LOOP_STEPS": self.steps_file})

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tests.bench.loop_steps"]

    def steps(self) -> dict:
        with open(self.steps_file) as fh:
            return json.load(fh)

    def close(self) -> None:
        super().close()
        shutil.rmtree(os.path.dirname(self.steps_file), ignore_errors=True)


# GET /ping every 50 ms until stdin closes, then print the longest answer (s) and the count
POLL = """
import select, sys, time, urllib.request
longest, polls = 0.0, 0
while not select.select([sys.stdin], [], [], 0.05)[0]:
    started = time.perf_counter()
    with urllib.request.urlopen(sys.argv[1], timeout=60) as resp:
        resp.read()
    longest = max(longest, time.perf_counter() - started)
    polls += 1
print(longest, polls)
"""


class PingPoller:
    """/ping polled from a process of its own (a thread here would wait on the publishing loop's GIL: its
    answers looked up to 105 ms late when the broker's longest loop step was 17 ms)."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", POLL, url], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def stop(self) -> tuple[float, int]:
        """(the longest answer in seconds, how many polls)"""
        out, _ = self.proc.communicate("", timeout=120)
        longest, polls = out.split()
        return float(longest), int(polls)


class Consumer(threading.Thread):
    """Subscribed with RDY 1 to t/c through the run: answers heartbeats, FINs what comes (nothing should:
    every delay is an hour or more)."""

    def __init__(self, broker: Broker) -> None:
        super().__init__(daemon=True)
        self.sock, self.parser = _subscribe(broker, "t", 1)
        self.sock.settimeout(1)
        self.stop = threading.Event()
        self.received = 0

    def run(self) -> None:
        with self.sock:
            while not self.stop.is_set():
                try:
                    data = self.sock.recv(1 << 16)
                except TimeoutError:
                    continue
                if not data:
                    return
                self.parser.feed(data)
                while (frame := self.parser.next_frame()) is not None:
                    if frame[1] == b"_heartbeat_":
                        self.sock.sendall(b"NOP\n")
                    elif frame[0] == 2:
                        self.received += 1
                        self.sock.sendall(b"FIN " + frame[1][10:26] + b"\n")


def _dpub_random(broker: Broker, count: int, seed: int) -> tuple[list[float], list[float]]:
    """`count` DPUBs of 1-24 h random delays, pipelined by PIPELINE: the seconds each SLICE took, and the
    broker's CPU seconds in each (what the machine's other load does not change)."""
    rng = random.Random(seed)
    parser = FrameParser()
    slices: list[float] = []
    cpu: list[float] = []
    cpu_last = broker.cpu_seconds()
    with socket.create_connection(broker.tcp) as sock:
        sock.sendall(MAGIC_V2)
        last = time.perf_counter()
        for sent in range(0, count, PIPELINE):
            send_answered(sock, parser, b"".join(encode_dpub("t", rng.randint(HOUR_MS, 24 * HOUR_MS), BODY)
                                                 for _ in range(PIPELINE)), PIPELINE)
            if (sent + PIPELINE) % SLICE == 0 or sent + PIPELINE >= count:
                now = time.perf_counter()
                slices.append(now - last)
                last = now
                cpu_now = broker.cpu_seconds()
                cpu.append(cpu_now - cpu_last)
                cpu_last = cpu_now
    return slices, cpu


def run_once(count: int, seed: int) -> dict[str, object]:
    broker = TimedBroker("--max-defer-time=48h")
    try:
        post(f"{broker.http_url}/topic/create?topic=t")
        post(f"{broker.http_url}/channel/create?topic=t&channel=c")
        consumer = Consumer(broker)
        consumer.start()
        poller = PingPoller(f"{broker.http_url}/ping")
        cpu = broker.cpu_seconds()
        slices, cpu_slices = _dpub_random(broker, count, seed)
        ping_longest, pings = poller.stop()
        memory = broker.memory()
        time.sleep(1.5)  # the step times are written once a second
        steps = broker.steps()
        consumer.stop.set()
        consumer.join()
        return {"count": count, "slices_s": slices, "total_s": sum(slices), "ping_max_ms": ping_longest * 1000,
                "pings": pings, "rss_mb": memory["VmRSS"] / (1024 * 1024),
                "peak_rss_mb": memory["VmHWM"] / (1024 * 1024), "cpu_s": broker.cpu_seconds() - cpu,
                "cpu_slices_s": cpu_slices, "step_max_cpu_ms": steps["max_cpu_ms"],
                "step_max_wall_ms": steps["max_wall_ms"], "steps_cpu_over_50ms": steps["cpu_over_50ms"],
                "step_top": steps["top"],
                "delivered": consumer.received}
    finally:
        broker.close()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=int, nargs="*", default=[1_000_000, 4_000_000])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=48)
    parser.add_argument("--output", default="bench-results.json")
    args = parser.parse_args(argv)
    print(f"machine: {describe(machine())}")
    samples: dict[int, list[dict[str, object]]] = {}
    for _ in range(args.rounds):
        for count in args.counts:
            figures = run_once(count, args.seed)
            samples.setdefault(count, []).append(figures)
            slices = " ".join(f"{s:.1f}" for s in figures["slices_s"])
            cpu_slices = " ".join(f"{s:.1f}" for s in figures["cpu_slices_s"])
            print(f"DPUB x {count:>9,} random 1-24 h: {figures['total_s']:7.1f} s (per 500k: {slices}), "
                  f"/ping max {figures['ping_max_ms']:.0f} ms over {figures['pings']} polls, "
                  f"RSS {figures['rss_mb']:.0f} MB (peak {figures['peak_rss_mb']:.0f} MB), "
                  f"broker CPU {figures['cpu_s']:.1f} s (per 500k: {cpu_slices}), delivered {figures['delivered']}; "
                  f"longest loop step {figures['step_max_cpu_ms']:.0f} ms CPU ({figures['step_max_wall_ms']:.0f} ms "
                  f"wall at most), {figures['steps_cpu_over_50ms']} steps over 50 ms CPU {figures['step_top']}",
                  flush=True)
    results: dict[str, object] = {}
    for count, runs in samples.items():
        results[str(count)] = {
            "total_s": statistics.median(float(r["total_s"]) for r in runs),
            "ping_max_ms": max(float(r["ping_max_ms"]) for r in runs),
            "rss_mb": statistics.median(float(r["rss_mb"]) for r in runs),
            "peak_rss_mb": max(float(r["peak_rss_mb"]) for r in runs),
            "cpu_s": statistics.median(float(r["cpu_s"]) for r in runs),
            "step_max_cpu_ms": max(float(r["step_max_cpu_ms"]) for r in runs),
            "step_max_wall_ms": max(float(r["step_max_wall_ms"]) for r in runs),
            "slices_s": runs[0]["slices_s"], "cpu_slices_s": runs[0]["cpu_slices_s"]}
    counts = sorted(samples)
    if len(counts) > 1:
        low, high = results[str(counts[0])], results[str(counts[-1])]
        ratio = high["total_s"] / low["total_s"]
        cpu_ratio = high["cpu_s"] / low["cpu_s"]
        results["ratio"] = ratio
        results["cpu_ratio"] = cpu_ratio
        print(f"{counts[-1]:,} / {counts[0]:,}: x{ratio:.2f} the time, x{cpu_ratio:.2f} the broker's CPU "
              f"(x{counts[-1] / counts[0]:.0f} the count)")
    merge_report(args.output, results, "dpub_random")
    return results


if __name__ == "__main__":
    main()
