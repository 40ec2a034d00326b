"""HTTP side by side with Go nsqd, loaded by wrk (issue 22): `make bench [NSQ_REFERENCE=<dir>]`.

    python -m tests.bench.http_versus [--reference DIR] [--rounds N] [--seconds S] [--output FILE]

Scenarios (200-byte messages, default flags, topic and channel created first): POST /pub keep-alive on
16 connections; POST /pub with `Connection: close` (a new connection per request, as curl in a shell
loop), 8 at a time; POST /mpub of 100 messages on 8 connections, then the same with a unique
Idempotency-Key per request (a wrk Lua script); GET /ping on one connection; GET /stats?format=json
on one connection; nsqlookupd's GET /lookup?topic=bench on 16 connections (a broker of the same side
registered with it: the topic, one channel, one producer). Each run gets a fresh broker. With DIR (Go's `nsqd` 1.3.0) the runs interleave, Go
then ours, round after round; the figure per side is the median over the rounds and the ratio ours
over Go's. Without DIR only trio-nsqd runs. Without wrk (`apt-get install wrk`) this prints that it
skipped and does nothing. Figures go to bench-results.json under "http_versus_go_nsqd" (merged).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from typing import Any

from pathlib import Path

from tests.bench.broker import Broker, post
from tests.bench.machine import merge_report, process_stat
from tests.processes import LookupdProcess, wait_for

WRK = shutil.which("wrk")
MSG_SIZE = 200

# Lua for wrk: one Idempotency-Key per request, unique across threads and runs
_KEYED = """
local counter = 0
local prefix = ""
function setup(thread) thread:set("tid", tostring(math.random(1, 1e9))) end
function init(args) prefix = tid .. "-" .. tostring(os.time()) .. "-" end
function request()
  counter = counter + 1
  wrk.headers["Idempotency-Key"] = prefix .. counter
  return wrk.format("POST", nil, nil, nil)
end
"""

# key -> (title, path, connections, messages per request (0: a GET), extra wrk args, keyed)
SCENARIOS: dict[str, tuple[str, str, int, int, tuple[str, ...], bool]] = {
    "pub": ("POST /pub keep-alive, 16 connections", "/pub?topic=bench", 16, 1, (), False),
    "pub_close": ("POST /pub Connection: close, 8 at a time", "/pub?topic=bench", 8, 1,
                  ("-H", "Connection: close"), False),
    "mpub": ("POST /mpub of 100, 8 connections", "/mpub?topic=bench", 8, 100, (), False),
    "mpub_key": ("POST /mpub of 100 + Idempotency-Key, 8 conn.", "/mpub?topic=bench", 8, 100, (), True),
    "ping": ("GET /ping, 1 connection", "/ping", 1, 0, (), False),
    "stats": ("GET /stats?format=json, 1 connection", "/stats?format=json", 1, 0, (), False),
    "lookup": ("nsqlookupd GET /lookup, 16 connections", "/lookup?topic=bench", 16, 0, (), False),
}
LOOKUPD_SCENARIOS = {"lookup"}  # loaded on an nsqlookupd a broker registers with, not on the broker
FLOOR_SCENARIOS = {"pub", "pub_close"}  # the floor side answers these as a broker would (200 OK)

_RATE = re.compile(r"Requests/sec:\s+([0-9.]+)")
_BAD = re.compile(r"Non-2xx or 3xx responses:\s+(\d+)")
_REQUESTS = re.compile(r"(\d+) requests in ")


def _script(folder: str, key: str) -> str:
    """A wrk Lua script: the method and body (messages of MSG_SIZE bytes, one per line) and, if keyed, a
    fresh Idempotency-Key each request."""
    messages, keyed = SCENARIOS[key][3], SCENARIOS[key][5]
    text = ""
    if messages:
        one = f'string.rep("m", {MSG_SIZE})'
        body = one if messages == 1 else f'string.rep({one} .. "\\n", {messages - 1}) .. {one}'
        text = f'wrk.method = "POST"\nwrk.body = {body}\n'
    path = os.path.join(folder, f"{key}.lua")
    with open(path, "w") as fh:
        fh.write(text + (_KEYED if keyed else ""))
    return path



class _Lookupd(LookupdProcess):
    """nsqlookupd for the /lookup scenario: ours, or Go's binary with the same flags."""

    ready_by_log = False

    def __init__(self, base_dir: str, command: list[str] | None) -> None:
        super().__init__(Path(base_dir), "--log-level=warn")
        self._command = command

    def command(self) -> list[str]:
        return self._command or super().command()


def run_once(reference: str | None, side: str, key: str, seconds: float, folder: str) -> dict[str, float]:
    _, path, connections, per_request, extra, _ = SCENARIOS[key]
    go = side == "go" and reference
    if side == "floor":  # tests/bench/floor.py: epoll, read, a fixed answer; the ceiling of one Python process
        command = [sys.executable, "-m", "tests.bench.floor"]
    elif go:
        command = [os.path.join(reference, "nsqd")]  # type: ignore[arg-type]
    else:
        command = None
    lookupd = None
    if key in LOOKUPD_SCENARIOS:
        lookupd = _Lookupd(folder, [os.path.join(reference, "nsqlookupd")] if go else None)  # type: ignore[arg-type]
        lookupd.start()
    flags = (f"--lookupd-tcp-address={lookupd.tcp_address}",) if lookupd else ()
    broker = Broker(*flags, command=command)
    try:
        if side != "floor":
            post(f"{broker.http_url}/topic/create?topic=bench")
            post(f"{broker.http_url}/channel/create?topic=bench&channel=ch")
        target = broker
        if lookupd:
            target = lookupd
            wait_for(lambda: b'"ch"' in urllib.request.urlopen(lookupd.http_url + path, timeout=5).read(),
                     timeout=10, message="the broker's topic and channel in nsqlookupd", ignore=(OSError,))
        assert WRK is not None
        args = [WRK, f"-t{min(2, connections)}", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "5s",
                "-s", _script(folder, key), *extra, target.http_url + path]
        cpu_of = (lambda: process_stat(lookupd.proc.pid)[1]) if lookupd else broker.cpu_seconds  # type: ignore[union-attr]
        cpu_before = cpu_of()
        out = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 60)
        cpu = cpu_of() - cpu_before
        match = _RATE.search(out.stdout)
        requests = _REQUESTS.search(out.stdout)
        if out.returncode != 0 or not match:
            raise RuntimeError(f"wrk failed: {(out.stdout + out.stderr)[-500:]}")
        bad = _BAD.search(out.stdout)
        rate = float(match.group(1))
        figures = {"req_s": rate, "non_2xx": float(bad.group(1)) if bad else 0.0}
        if requests and int(requests.group(1)):
            # the broker's user + system CPU per request: steadier across machines and load than req/s
            figures["cpu_us"] = cpu / int(requests.group(1)) * 1e6
        if per_request:
            figures["msg_s"] = rate * per_request
        return figures
    finally:
        broker.close()
        if lookupd:
            lookupd.stop()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", help="folder with Go nsqd 1.3.0 (else only trio-nsqd runs)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0, help="seconds per wrk run")
    parser.add_argument("--only", nargs="*", default=None, help="scenario keys: " + " ".join(SCENARIOS))
    parser.add_argument("--output", default="bench-results.json", help="merged into this JSON file")
    args = parser.parse_args(argv)
    if WRK is None:
        print("HTTP scenarios skipped: wrk not found (apt-get install wrk)", flush=True)
        return {}
    keys = args.only or list(SCENARIOS)
    sides = ("go", "trio", "floor") if args.reference else ("trio",)
    samples: dict[str, dict[str, list[dict[str, float]]]] = {k: {s: [] for s in sides} for k in keys}
    with tempfile.TemporaryDirectory(prefix="trio-nsq-wrk-") as folder:
        for round_no in range(1, args.rounds + 1):
            for key in keys:
                for side in sides:  # interleaved: Go, ours, the floor, Go, ours, ...
                    if side == "floor" and key not in FLOOR_SCENARIOS:
                        continue
                    figures = run_once(args.reference, side, key, args.seconds, folder)
                    samples[key][side].append(figures)
                    print(f"round {round_no} {SCENARIOS[key][0]:<46} {side:<5} {figures['req_s']:>10,.0f} req/s"
                          + (f"  ({figures['non_2xx']:.0f} non-2xx)" if figures["non_2xx"] else ""), flush=True)
    results: dict[str, Any] = {}
    print(f"\n{'HTTP scenario (wrk)':<48} {'Go nsqd':>10} {'trio-nsqd':>10} {'ratio':>6} {'floor':>10}   req/s, medians"
          f" of {args.rounds}; broker CPU µs per request, Go / ours / the floor (tests/bench/floor.py)")
    for key in keys:
        trio = statistics.median(s["req_s"] for s in samples[key]["trio"])
        entry: dict[str, Any] = {"title": SCENARIOS[key][0], "trio_req_s": trio, "samples": samples[key]}
        cpu_text = _median_cpu(samples[key]["trio"], entry, "trio_cpu_us")
        go_text, ratio_text = "-", "-"
        if "go" in samples[key]:
            go = statistics.median(s["req_s"] for s in samples[key]["go"])
            entry.update(go_req_s=go, ratio=trio / go if go else float("inf"))
            go_text, ratio_text = f"{go:,.0f}", f"{entry['ratio']:.2f}"
            cpu_text = _median_cpu(samples[key]["go"], entry, "go_cpu_us") + " / " + cpu_text
        results[key] = entry
        floor_text = "-"
        if samples[key].get("floor"):
            floor = statistics.median(s["req_s"] for s in samples[key]["floor"])
            entry.update(floor_req_s=floor, floor_ratio=floor / entry["go_req_s"] if entry.get("go_req_s") else None)
            floor_text = f"{floor:,.0f}"
            cpu_text += " / " + _median_cpu(samples[key]["floor"], entry, "floor_cpu_us")
        print(f"{SCENARIOS[key][0]:<48} {go_text:>10} {trio:>10,.0f} {ratio_text:>6} {floor_text:>10}   {cpu_text}")
    merge_report(args.output, {"reference": os.path.abspath(args.reference) if args.reference else None,
                               "rounds": args.rounds, "seconds": args.seconds, "cpus": os.cpu_count(),
                               "tool": "wrk", "results": results},
                 "http_versus_go_nsqd")
    print(f"written {args.output}")
    return results


def _median_cpu(samples: list[dict[str, float]], entry: dict[str, Any], key: str) -> str:
    values = [s["cpu_us"] for s in samples if "cpu_us" in s]
    if not values:
        return "-"
    entry[key] = statistics.median(values)
    return f"{entry[key]:.0f}"


if __name__ == "__main__":
    main()
