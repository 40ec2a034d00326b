"""`make bench`: start trio-nsqd per scenario with a fresh data dir, load it, print a table, write JSON.

    python -m tests.bench.run [--quick] [--runs N] [--only NAME ...] [--output bench-results.json]

Each figure is the median of --runs runs (3 by default, 1 with --quick). Scenarios follow NSQ's
bench.sh: 200-byte messages, the channel created before writing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

from trio_nsq.shared.protocol import MAGIC_V2
from tests.bench import tcp_load
from tests.bench.broker import Broker
from tests.bench.machine import describe, machine

MSG_SIZE = 200


def _run_procs(targets: list[tuple[Callable, tuple]]) -> list[tuple]:
    ctx = mp.get_context("fork")
    result = ctx.Queue()
    procs = [ctx.Process(target=_call, args=(fn, args, result)) for fn, args in targets]
    for proc in procs:
        proc.start()
    out = [result.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    return out


def _call(fn: Callable, args: tuple, result) -> None:
    try:
        fn(*args, result=result)
    except Exception as exc:  # report, don't hang the runner
        result.put(("error", repr(exc)))


def _check(results: list[tuple]) -> None:
    for item in results:
        if item[0] == "error":
            raise RuntimeError(item[1])


def _rate(results: list[tuple], kind: str) -> float:
    items = [r for r in results if r[0] == kind]
    return sum(r[1] for r in items) / max(r[2] for r in items)


# --- scenarios: each returns {figure name: value} ----------------------------------------------------


def write_scenario(batch: int, writers: int = 1, flags: tuple[str, ...] = ()) -> Callable[[float], dict]:
    def run(duration: float) -> dict:
        broker = Broker(*flags)
        try:
            broker.create_channel("bench", "ch")
            results = _run_procs([(tcp_load.writer, (broker.tcp, "bench", batch, MSG_SIZE, duration))] * writers)
            _check(results)
            return {"msg/s": _rate(results, "writer")}
        finally:
            broker.close()
    return run


def _drain(broker: Broker, fill: int, duration: float) -> float:
    results = _run_procs([(tcp_load.reader, (broker.tcp, "bench", "ch", duration * 3, 2500, fill))])
    _check(results)
    return _rate(results, "reader")


def reader_drain_scenario(duration: float) -> dict:
    broker = Broker()
    try:
        broker.create_channel("bench", "ch")
        fill = int(150_000 * duration)
        _fill(broker, fill)
        return {"msg/s": _drain(broker, fill, duration)}
    finally:
        broker.close()


def _fill(broker: Broker, count: int) -> None:
    from trio_nsq.shared.protocol import encode_mpub

    body = b"x" * MSG_SIZE
    command = encode_mpub("bench", [body] * 200)
    with socket.create_connection(broker.tcp) as sock:
        sock.sendall(MAGIC_V2)
        sent = 0
        while sent < count:
            sock.sendall(command * 10)
            need = 100
            while need > 0:
                need -= len(sock.recv(65536))
            sent += 2000


def write_and_read(duration: float) -> dict:
    broker = Broker()
    try:
        broker.create_channel("bench", "ch")
        results = _run_procs([
            (tcp_load.reader, (broker.tcp, "bench", "ch", duration)),
            (tcp_load.writer, (broker.tcp, "bench", 200, MSG_SIZE, duration)),
        ])
        _check(results)
        return {"write msg/s": _rate(results, "writer"), "read msg/s": _rate(results, "reader")}
    finally:
        broker.close()


def latency(duration: float) -> dict:
    broker = Broker()
    try:
        broker.create_channel("bench", "lat")
        results = _run_procs([
            (tcp_load.reader, (broker.tcp, "bench", "lat", duration + 1, 2500, 0, True)),
            (tcp_load.paced_writer, (broker.tcp, "bench", 10_000, MSG_SIZE, duration)),
        ])
        _check(results)
        lat = sorted(next(r for r in results if r[0] == "reader")[3])
        if not lat:
            raise RuntimeError("no messages received")
        return {
            "p50 ms": lat[len(lat) // 2] / 1e6,
            "p99 ms": lat[int(len(lat) * 0.99)] / 1e6,
            "msg/s": _rate(results, "writer"),
        }
    finally:
        broker.close()


def memory_1m(duration: float) -> dict:
    count = 1_000_000
    broker = Broker(f"--mem-queue-size={count + 10_000}")
    try:
        broker.create_channel("bench", "ch")
        base = broker.rss_mb()
        _fill(broker, count)
        time.sleep(1.0)  # let the topic pump move everything into the channel
        return {"RSS MB": broker.rss_mb(), "idle RSS MB": base}
    finally:
        broker.close()


def startup(duration: float) -> dict:
    times = []
    for _ in range(3):
        broker = Broker()
        times.append(broker.startup)
        broker.close()
    return {"seconds": statistics.median(times)}


SCENARIOS: dict[str, tuple[str, Callable[[float], dict]]] = {
    "pub": ("PUB, 1 per publish (2 connections)", write_scenario(1, writers=2)),
    "mpub20": ("MPUB 20", write_scenario(20)),
    "mpub200": ("MPUB 200", write_scenario(200)),
    "drain": ("reader drain", reader_drain_scenario),
    "pubsub": ("writer + reader together", write_and_read),
    "disk": ("--mem-queue-size=0, MPUB 200", write_scenario(200, flags=("--mem-queue-size=0",))),
    "sync": ("--mem-queue-size=0 --sync-every=1, MPUB 200 (4 connections)",
             write_scenario(200, writers=4, flags=("--mem-queue-size=0", "--sync-every=1"))),
    "latency": ("latency at 10k msg/s", latency),
    "memory": ("1M x 200 B queued in memory", memory_1m),
    "startup": ("start to accepting", startup),
}


def _http_scenarios() -> dict[str, tuple[str, Callable[[float], dict]]]:
    """HTTP loads come from tests/bench/http_load.py when it is there."""
    try:
        from tests.bench import http_load
    except ImportError:
        return {}
    out = {}
    if hasattr(http_load, "bench_pub"):
        out["http_pub"] = ("HTTP /pub, 4 connections", lambda d: _with_broker(http_load.bench_pub, d))
    if hasattr(http_load, "bench_mpub"):
        out["http_mpub"] = ("HTTP /mpub of 100", lambda d: _with_broker(http_load.bench_mpub, d))
    return out


def _with_broker(fn: Callable, duration: float) -> dict:
    broker = Broker()
    try:
        broker.create_channel("bench", "ch")
        return fn(broker.http_url, duration)
    finally:
        broker.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 s per scenario, one run")
    parser.add_argument("--runs", type=int, default=0, help="runs per scenario (median reported)")
    parser.add_argument("--only", nargs="*", default=None, help="scenario keys to run")
    parser.add_argument("--output", default="bench-results.json")
    args = parser.parse_args(argv)
    duration = 2.0 if args.quick else 10.0
    runs = args.runs or (1 if args.quick else 3)
    scenarios = {**SCENARIOS, **_http_scenarios()}
    keys = args.only or list(scenarios)
    report: dict[str, Any] = {
        "machine": machine(),
        "duration_s": duration, "runs": runs, "message_size": MSG_SIZE, "results": {},
    }
    print(f"machine: {describe(report['machine'])}")
    print(f"{'scenario':<58} figures (median of {runs})")
    for key in keys:
        title, fn = scenarios[key]
        samples: list[dict] = []
        for _ in range(runs):
            try:
                samples.append(fn(duration))
            except Exception as exc:  # one broken scenario must not hide the others
                samples.append({"error": repr(exc)})
                break
        if "error" in samples[-1]:
            figures: dict[str, Any] = samples[-1]
        else:
            figures = {name: statistics.median(s[name] for s in samples) for name in samples[0]}
        report["results"][key] = {"title": title, "figures": figures, "samples": samples}
        shown = "  ".join(f"{k}={v:,.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())
        print(f"{title:<58} {shown}", flush=True)
    with open(args.output, "w") as fh:
        json.dump(report, fh, indent=2)
    print(f"written {args.output}")


if __name__ == "__main__":
    main()
