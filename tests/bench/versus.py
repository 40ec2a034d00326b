"""Side by side with Go nsqd, measured by NSQ's own tools (issue 14): `make bench NSQ_REFERENCE=<dir>`.

    python -m tests.bench.versus --reference DIR [--rounds N] [--runfor S] [--output FILE]

DIR holds Go's `nsqd`, `bench_writer` and `bench_reader` (nsq 1.3.0). Each round runs every scenario
against Go nsqd and then against trio-nsqd, each on a fresh data directory with the same flags, so
both see the same machine state; the figure per side is the median over the rounds, and the ratio is
trio-nsqd's median over Go's. Where the hot modules are compiled (trio_nsq/compiled.py), trio-nsqd also
runs as pure Python (TRIO_NSQ_COMPILE=0) in the same rounds: Go, compiled, pure, Go, compiled, pure...
The machine (CPU, cores, Python) and the compiled modules are printed and written with the figures.
With --baseline CHECKOUT (another checkout of trio-nsq with its own .venv, e.g. a `git worktree` of an
earlier commit after `make .venv/.installed`), that trio-nsqd runs as a side of its own in the same rounds
(`base`), so a change is measured against what it changes, interleaved, on the same machine state.
The shape is NSQ's bench.sh: the topic and channel are created first,
`bench_writer --size=200 --batch-size=200` publishes for --runfor, then `bench_reader` (RDY 2500, a FIN
per message) reads the same broker for --runfor. Both tools open one connection per CPU.
The `fanout` scenario is the same shape on a topic with 8 channels and --mem-queue-size=0 (the reader
reads one of them). The `backlog` scenario reads as the Spark source does (backlog_reader below); its second figure is
messages per CPU-second of the broker, the others are messages per second.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from tests.bench.broker import Broker, post, publish
from tests.bench.machine import describe, machine, merge_report
from trio_nsq import compiled

OPS = re.compile(r"([0-9.]+)ops/s")

# scenario key -> (title, nsqd flags, whether bench_reader runs after the writer)
SCENARIOS: dict[str, tuple[str, tuple[str, ...], bool]] = {
    "default": ("default flags", (), True),
    "disk": ("--mem-queue-size=0", ("--mem-queue-size=0",), False),
    "sync": ("--mem-queue-size=0 --sync-every=1", ("--mem-queue-size=0", "--sync-every=1"), False),
}


def _tool(path: str, *args: str) -> float:
    """Run one of NSQ's bench tools; its last line is `duration: ... - N ops/s - ...`."""
    out = subprocess.run([path, *args], capture_output=True, text=True, timeout=600)
    match = OPS.search(out.stdout + out.stderr)
    if out.returncode != 0 or not match:
        raise RuntimeError(f"{os.path.basename(path)} failed: {(out.stdout + out.stderr)[-500:]}")
    return float(match.group(1))



# side -> how its broker starts: Go's nsqd, trio-nsqd as installed (compiled where it could be built),
# trio-nsqd from its .py sources, and trio-nsqd of the --baseline checkout
SIDES = ("go", "trio", "pure")
BASELINE: list[str] = []  # the --baseline checkout, when given


def side_broker(reference: str, side: str, *flags: str) -> Broker:
    """A fresh broker of `side` with these flags."""
    if side == "go":
        return Broker(*flags, command=[os.path.join(reference, "nsqd")])
    if side == "base":
        # its own checkout on the path, not this one (nor the current directory: -P)
        python = os.path.join(BASELINE[0], ".venv", "bin", "python")
        return Broker(*flags, command=[python, "-P", "-m", "trio_nsq.broker"], env={"PYTHONPATH": BASELINE[0]})
    return Broker(*flags, env={compiled.ENV: "0"} if side == "pure" else None)


def run_once(reference: str, side: str, flags: tuple[str, ...], read: bool, runfor: float,
             channels: int = 1) -> dict[str, float]:
    broker = side_broker(reference, side, *flags)
    try:
        post(f"{broker.http_url}/topic/create?topic=bench")
        post(f"{broker.http_url}/channel/create?topic=bench&channel=ch")
        for i in range(1, channels):
            post(f"{broker.http_url}/channel/create?topic=bench&channel=ch{i}")
        address = f"--nsqd-tcp-address={broker.tcp[0]}:{broker.tcp[1]}"
        common = (address, "--topic=bench", "--size=200", f"--runfor={runfor}s")
        written = _write_bytes(broker)
        figures = {"writer": _tool(os.path.join(reference, "bench_writer"), *common, "--batch-size=200")}
        if channels > 1:
            # until every channel holds every message (Go nsqd copies them from the topic's disk queue)
            count = _held_by_all(broker)
            figures["written_per_payload_byte"] = (_write_bytes(broker) - written) / (count * 200)
        if read:
            cpu = broker.cpu_seconds()
            figures["reader"] = _tool(os.path.join(reference, "bench_reader"), *common, "--channel=ch")
            # the broker's CPU per message read: what the noise of a shared machine moves least
            figures["reader_per_cpu_s"] = figures["reader"] * runfor / max(broker.cpu_seconds() - cpu, 1e-9)
        return figures
    finally:
        broker.close()


def durable_reader(reference: str, side: str, runfor: float) -> dict[str, float]:
    """bench_reader on a channel filled beforehand (bench_writer, default flags, then a clean stop), the
    broker restarted with --mem-queue-size=0 --sync-every=1: every message comes from disk and its FIN
    is bookkept durably (trio-nsqd: the channel's cursor; Go nsqd: its disk queue's read position)."""
    broker = side_broker(reference, side)
    try:
        post(f"{broker.http_url}/topic/create?topic=bench")
        post(f"{broker.http_url}/channel/create?topic=bench&channel=ch")
        common = ("--topic=bench", "--size=200", f"--runfor={runfor}s")
        address = f"--nsqd-tcp-address={broker.tcp[0]}:{broker.tcp[1]}"
        _tool(os.path.join(reference, "bench_writer"), address, *common, "--batch-size=200")
        broker.args += ["--mem-queue-size=0", "--sync-every=1"]
        broker.restart(timeout=120)  # a large queue on disk: opening may take a while
        address = f"--nsqd-tcp-address={broker.tcp[0]}:{broker.tcp[1]}"
        return {"reader": _tool(os.path.join(reference, "bench_reader"), address, *common, "--channel=ch")}
    finally:
        broker.close()


BACKLOG = 1_000_000


def backlog_reader(reference: str, side: str, runfor: float) -> dict[str, float]:
    """The Spark source's way of reading, without Spark: BACKLOG messages published to a topic with no
    channel (default flags), then one consumer (tests/bench/backlog_reader.py) subscribes a new channel
    over 80 connections of RDY 2500 (the source's default window, 200,000) and FINs in runs of 100,000 (a
    micro-batch's commit). The figures: messages/s, and messages per CPU-second of the broker over the
    read (its hand-off from topic to channel, deliveries and FINs). `runfor` is not used: the run ends
    when the backlog is read."""
    broker = side_broker(reference, side)
    try:
        publish(broker.http_address, "backlog", BACKLOG)
        cpu = broker.cpu_seconds()
        out = subprocess.run([sys.executable, "-m", "tests.bench.backlog_reader", *map(str, broker.tcp), "backlog",
                              "ch", str(BACKLOG), "80", "2500", "100000"], capture_output=True, text=True, timeout=600)
        cpu = broker.cpu_seconds() - cpu
        if out.returncode != 0:
            raise RuntimeError(f"backlog_reader failed: {(out.stdout + out.stderr)[-500:]}")
        seconds = json.loads(out.stdout)["seconds"]
        return {"backlog": BACKLOG / seconds, "backlog_per_cpu_s": BACKLOG / cpu}
    finally:
        broker.close()


def _write_bytes(broker: Broker) -> int:
    """What the broker process has sent to storage (/proc/PID/io write_bytes, counted as pages dirty)."""
    with open(f"/proc/{broker.proc.pid}/io") as fh:
        return int(dict(line.split(": ") for line in fh.read().splitlines())["write_bytes"])


def _held_by_all(broker: Broker, timeout: float = 300.0) -> int:
    """Wait until every channel of topic `bench` holds every message published; how many that is."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"{broker.http_url}/stats?format=json&topic=bench", timeout=30) as resp:
            topic = json.loads(resp.read())["topics"][0]
        count = topic["message_count"]
        if all(c["depth"] >= count for c in topic["channels"]) or time.monotonic() > deadline:
            return count
        time.sleep(0.2)


def fan_out(reference: str, side: str, runfor: float) -> dict[str, float]:
    """NSQ's bench shape on a topic with 8 channels created first, --mem-queue-size=0: bench_writer, then
    bench_reader on one of them (the copy-per-channel design writes every message 8 times more)."""
    return run_once(reference, side, ("--mem-queue-size=0",), True, runfor, channels=8)


def limits_on(reference: str, side: str, runfor: float) -> dict[str, float]:
    """NSQ's bench shape with trio-nsqd's attempt limit and TTL on (--max-attempts=5 --message-ttl=1h; Go
    nsqd has neither and runs its defaults): beside the `default` row, what they cost the reader."""
    flags = () if side == "go" else ("--max-attempts=5", "--message-ttl=1h")
    return run_once(reference, side, flags, True, runfor)


# scenario key -> (title, runner) for scenarios that are not one broker run of SCENARIOS' shape
RUNNERS: dict[str, tuple[str, Callable[[str, str, float], dict[str, float]]]] = {
    "fanout": ("8 channels, --mem-queue-size=0", fan_out),
    "sync_reader": ("--mem-queue-size=0 --sync-every=1, channel filled first", durable_reader),
    "backlog": ("1M waiting, new channel, FIN per 100k", backlog_reader),
    "limits": ("default, ours --max-attempts=5 --message-ttl=1h", limits_on),
}

# figure -> how the table names it: NSQ's tools, or ours (msg/s, or messages per broker CPU-second)
LABELS = {"writer": "bench_writer", "reader": "bench_reader", "reader_per_cpu_s": "bench_reader per broker CPU-s",
          "backlog": "backlog_reader",
          "backlog_per_cpu_s": "backlog_reader per CPU-s", "written_per_payload_byte": "bytes written per payload byte"}


def _fmt(value: float) -> str:
    return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, help="folder with Go nsqd, bench_writer, bench_reader")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runfor", type=float, default=10.0, help="seconds per tool run")
    parser.add_argument("--only", nargs="*", default=None, help="scenario keys: " + " ".join([*SCENARIOS, *RUNNERS]))
    parser.add_argument("--output", default="bench-results.json", help="merged into this JSON file")
    parser.add_argument("--baseline", help="another trio-nsq checkout (with its .venv) to run beside this one")
    parser.add_argument("--no-pure", action="store_true", help="leave the pure Python side out")
    args = parser.parse_args(argv)
    keys = args.only or [*SCENARIOS, *RUNNERS]
    info = machine()
    print(f"machine: {describe(info)}")
    # pure Python is a side of its own only where the installed trio-nsqd is compiled
    sides: tuple[str, ...] = SIDES if info["compiled_modules"] and not args.no_pure else ("go", "trio")
    if args.baseline:
        BASELINE.append(os.path.abspath(args.baseline))
        sides = (*sides, "base")
    samples: dict[str, dict[str, list[dict[str, float]]]] = {k: {side: [] for side in sides} for k in keys}
    for round_no in range(1, args.rounds + 1):
        for key in keys:
            title = RUNNERS[key][0] if key in RUNNERS else SCENARIOS[key][0]
            for side in sides:  # interleaved: Go, ours, Go, ours, ...
                if key in RUNNERS:
                    figures = RUNNERS[key][1](args.reference, side, args.runfor)
                else:
                    figures = run_once(args.reference, side, *SCENARIOS[key][1:], args.runfor)
                samples[key][side].append(figures)
                shown = "  ".join(f"{LABELS[k]}={_fmt(v)}" for k, v in figures.items())
                print(f"round {round_no} {title:<36} {side:<5} {shown}", flush=True)
    results: dict[str, Any] = {}
    pure = "pure" in sides
    print(f"\n{'scenario':<44} {'Go nsqd':>12} {'trio-nsqd':>12} {'ratio':>7}"
          + (f" {'pure Python':>12} {'ratio':>7}" if pure else "") + f"   (medians of {args.rounds})")
    for key in keys:
        title = RUNNERS[key][0] if key in RUNNERS else SCENARIOS[key][0]
        for figure in samples[key]["go"][0]:
            medians = {side: statistics.median(s[figure] for s in samples[key][side]) for side in sides}
            go = medians["go"]
            ratios = {side: (medians[side] / go if go else float("inf")) for side in sides}
            name = f"{key}_{figure}"
            results[name] = {"title": f"{LABELS[figure]}, {title}", "go_msg_s": go, "trio_msg_s": medians["trio"],
                             "ratio": ratios["trio"], "samples": samples[key]}
            line = f"{LABELS[figure] + ', ' + title:<44} {_fmt(go):>12} {_fmt(medians['trio']):>12} {ratios['trio']:>7.2f}"
            if pure:
                results[name].update(pure_msg_s=medians["pure"], pure_ratio=ratios["pure"])
                line += f" {_fmt(medians['pure']):>12} {ratios['pure']:>7.2f}"
            if "base" in medians:
                base = medians["base"]
                results[name].update(base_msg_s=base, trio_over_base=medians["trio"] / base if base else float("inf"))
                line += f"   baseline {_fmt(base)}: trio/baseline {results[name]['trio_over_base']:.3f}"
            print(line)
    merge_report(args.output, {"reference": os.path.abspath(args.reference), "baseline": args.baseline,
                               "rounds": args.rounds,
                               "runfor_s": args.runfor, "machine": info, "cpus": info["cpus"],
                               "compiled_modules": info["compiled_modules"], "results": results},
                 "versus_go_nsqd")
    print(f"written {args.output}")
    return results


if __name__ == "__main__":
    main()
