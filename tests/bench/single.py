"""One message per command, beside Go nsqd (issue 33): `make bench NSQ_REFERENCE=<dir>`.

    python -m tests.bench.single --reference DIR [--rounds N] [--runfor S] [--only KEY ...] [--output FILE]

NSQ's own tools, as a user runs them, against Go nsqd and trio-nsqd alternately (fresh broker and data
directory per run, default flags, the topic and channel created first), medians of interleaved rounds:

- `pub1`: `bench_writer --batch-size=1` (its 2 connections, each waiting for its answer);
- `pub1x8`: 8 of them at once (16 connections);
- `pub1m`: `bench_writer --size=1048576 --batch-size=1` (MB/s);
- `rdy1`: 16 × NSQ's `nsq_tail --max-in-flight=1 -n 15000` at once (go-nsq consumers: RDY 1, a FIN
  per message, 16 connections) on a channel filled first by `bench_writer`; the rate is every message
  over the time until the last of them exits. (`bench_reader --rdy=1` cannot do it: it flushes its FINs
  only when `count % rdy > 0.75 * rdy`, never with RDY 1.)

Each run also gives the CPU per round trip (µs) of the broker (its /proc times) and of the tools (their
rusage), so a ratio can be read apart from how the two cores were shared.

A third side runs in the same rounds, the floor (tests/bench/floor.py): a Python process that only
epolls, reads and writes the answers, with no broker behind them. Its rate is the most a one-process
Python broker can reach on this machine with these clients: the ceiling a goal is measured against.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from tests.bench.broker import Broker, post
from tests.bench.machine import describe, machine, merge_report

OPS = re.compile(r"([0-9.]+)ops/s")
MIB = 1024 * 1024
TAIL_EACH = 15_000  # messages each nsq_tail of `rdy1` takes

# key -> (title, tool, processes, tool arguments, message size)
SCENARIOS: dict[str, tuple[str, str, int, tuple[str, ...], int]] = {
    "pub1": ("bench_writer --batch-size=1 (2 connections)", "bench_writer", 1, ("--batch-size=1",), 200),
    "pub1x8": ("8 x bench_writer --batch-size=1 (16 connections)", "bench_writer", 8, ("--batch-size=1",), 200),
    "pub1m": ("bench_writer --size=1048576 --batch-size=1", "bench_writer", 1, ("--batch-size=1",), MIB),
    "rdy1": ("16 x nsq_tail --max-in-flight=1 (RDY 1, FIN each)", "nsq_tail", 16,
             ("--max-in-flight=1", "--channel=ch", f"-n={TAIL_EACH}"), 200),
}



def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run_tools(path: str, processes: int, args: list[str]) -> float:
    """Start `processes` copies at once; the sum of their ops/s."""
    procs = [subprocess.Popen([path, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(processes)]
    total = 0.0
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        match = OPS.search(out)
        if proc.returncode != 0 or not match:
            raise RuntimeError(f"{os.path.basename(path)} failed: {out[-500:]}")
        total += float(match.group(1))
    return total


def _run_tails(path: str, processes: int, args: list[str]) -> float:
    """Start `processes` nsq_tails at once, each taking TAIL_EACH messages; every message over the time
    until the last exits."""
    started = time.perf_counter()
    procs = [subprocess.Popen([path, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(processes)]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"nsq_tail failed: {err[-500:]}")
    return processes * TAIL_EACH / (time.perf_counter() - started)


SIDES = ("go", "trio", "floor")
FLOOR = [sys.executable, "-m", "tests.bench.floor"]


def run_once(reference: str, side: str, key: str, runfor: float) -> dict[str, float]:
    _, tool, processes, tool_args, size = SCENARIOS[key]
    command = {"go": [os.path.join(reference, "nsqd")], "floor": FLOOR}.get(side)
    broker = Broker(command=command)
    try:
        if side != "floor":
            post(f"{broker.http_url}/topic/create?topic=bench")
            post(f"{broker.http_url}/channel/create?topic=bench&channel=ch")
        address = f"--nsqd-tcp-address={broker.tcp[0]}:{broker.tcp[1]}"
        common = [address, "--topic=bench", f"--size={size}"]
        tail = tool == "nsq_tail"
        if tail and side != "floor":  # something to read: MPUBs of 200, more than the tails take
            _run_tools(os.path.join(reference, "bench_writer"), 1, [*common, "--runfor=2s"])
        cpu, tools_cpu, started = broker.cpu_seconds(), _children_cpu(), time.perf_counter()
        if tail:
            rate = _run_tails(os.path.join(reference, tool), processes, [address, "--topic=bench", *tool_args])
        else:
            rate = _run_tools(os.path.join(reference, tool), processes, [*common, *tool_args, f"--runfor={runfor}s"])
        elapsed = time.perf_counter() - started
        cpu, tools_cpu = broker.cpu_seconds() - cpu, _children_cpu() - tools_cpu
    finally:
        broker.close()
    # NSQ's bench tools count ops over --runfor; the CPU is over the tools' whole run (start-up included)
    round_trips = processes * TAIL_EACH if tail else rate * runfor
    figures = {"rate": rate * size / 1e6 if size == MIB else rate,
               "broker_us": cpu / round_trips * 1e6, "tools_us": tools_cpu / round_trips * 1e6,
               "elapsed_s": elapsed}
    return figures


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, help="folder with Go nsqd, bench_writer, bench_reader")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runfor", type=float, default=6.0, help="seconds per tool run")
    parser.add_argument("--only", nargs="*", default=None, help="scenario keys: " + " ".join(SCENARIOS))
    parser.add_argument("--output", default="bench-results.json", help="merged into this JSON file")
    args = parser.parse_args(argv)
    keys = args.only or list(SCENARIOS)
    info = machine()
    print(f"machine: {describe(info)}")
    samples: dict[str, dict[str, list[dict[str, float]]]] = {k: {s: [] for s in SIDES} for k in keys}
    for round_no in range(1, args.rounds + 1):
        for key in keys:
            for side in SIDES:  # interleaved: Go, ours, the floor, Go, ours, ...
                figures = run_once(args.reference, side, key, args.runfor)
                samples[key][side].append(figures)
                unit = "MB/s" if SCENARIOS[key][4] == MIB else "msg/s"
                print(f"round {round_no} {SCENARIOS[key][0]:<50} {side:<5} {figures['rate']:>10,.0f} {unit}"
                      f"  broker {figures['broker_us']:.1f} µs  tools {figures['tools_us']:.1f} µs per message",
                      flush=True)
    results: dict[str, Any] = {}
    print(f"\n{'scenario':<50} {'Go nsqd':>10} {'trio-nsqd':>10} {'ratio':>6} {'floor':>10} {'ratio':>6}"
          f"   broker µs/msg Go/ours/floor   (medians of {args.rounds}; ratios to Go)")
    for key in keys:
        medians = {side: {f: statistics.median(s[f] for s in samples[key][side]) for f in samples[key][side][0]}
                   for side in SIDES}
        go, ours, floor = medians["go"], medians["trio"], medians["floor"]
        ratio = ours["rate"] / go["rate"] if go["rate"] else float("inf")
        floor_ratio = floor["rate"] / go["rate"] if go["rate"] else float("inf")
        unit = "MB/s" if SCENARIOS[key][4] == MIB else "msg/s"
        results[key] = {"title": SCENARIOS[key][0], "unit": unit, "go": go, "trio": ours, "ratio": ratio,
                        "floor": floor, "floor_ratio": floor_ratio, "samples": samples[key]}
        print(f"{SCENARIOS[key][0]:<50} {go['rate']:>10,.0f} {ours['rate']:>10,.0f} {ratio:>6.2f}"
              f" {floor['rate']:>10,.0f} {floor_ratio:>6.2f}"
              f"   {go['broker_us']:.1f} / {ours['broker_us']:.1f} / {floor['broker_us']:.1f}")
    merge_report(args.output, {"reference": os.path.abspath(args.reference), "rounds": args.rounds,
                               "runfor_s": args.runfor, "machine": info, "results": results},
                 "single_message_versus_go_nsqd")
    print(f"written {args.output}")
    return results


if __name__ == "__main__":
    main()
