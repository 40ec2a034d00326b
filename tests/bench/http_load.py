"""HTTP load for the broker's /pub and /mpub: keep-alive connections, one request in flight on each.

    python -m tests.bench.http_load --spawn                      # start a broker, run both loads
    python -m tests.bench.http_load --url http://127.0.0.1:4151 --mode pub --connections 4 --seconds 10

Each connection is a process with a blocking socket sending one pre-built request and reading the
answer by Content-Length (no HTTP library on the client side, no pipelining), so what is measured is
the broker. Figures: requests/s, messages/s, latency p50/p99, and non-200 answers (which are counted,
not hidden). `make bench` calls bench_pub/bench_mpub with a broker of its own.

With --spawn the broker gets a memory queue large enough to hold the whole run (no channel, nothing
consumed), so the figure is the HTTP path's and not the disk queue's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import time
from urllib.parse import urlsplit

from tests.bench.broker import Broker

MSG_SIZE = 200
MPUB_BATCH = 100


def build_request(host: str, port: int, path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/octet-stream\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _read_response(sock: socket.socket, buf: bytes) -> tuple[int, bool, bytes]:
    """(status, connection closing, leftover bytes) of one response."""
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            break
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("broker closed the connection")
        buf += data
    head = buf[:end].decode("latin-1")
    lines = head.split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length = 0
    closing = False
    for line in lines[1:]:
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "content-length":
            length = int(value)
        elif key == "connection" and value.strip().lower() == "close":
            closing = True
    total = end + 4 + length
    while len(buf) < total:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("broker closed the connection mid-response")
        buf += data
    return status, closing, buf[total:]


def _connect(host: str, port: int) -> socket.socket:
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def http_writer(host: str, port: int, path: str, body: bytes, duration: float, *, result) -> None:
    """Send the same request back to back for `duration` s on one keep-alive connection."""
    request = build_request(host, port, path, body)
    sock = _connect(host, port)
    buf = b""
    ok = errors = 0
    latencies: list[float] = []
    first_error = ""
    clock = time.perf_counter
    start = clock()
    deadline = start + duration
    while True:
        t0 = clock()
        if t0 >= deadline:
            break
        sock.sendall(request)
        status, closing, buf = _read_response(sock, buf)
        latencies.append(clock() - t0)
        if status == 200:
            ok += 1
        else:
            errors += 1
            first_error = first_error or f"HTTP {status}"
        if closing:
            sock.close()
            sock = _connect(host, port)
            buf = b""
    elapsed = clock() - start
    sock.close()
    latencies.sort()
    result.put(("http", ok, elapsed, errors, first_error, latencies[len(latencies) // 2],
                latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]))


def _run(targets: list[tuple]) -> list[tuple]:
    ctx = mp.get_context("fork")
    result = ctx.Queue()
    procs = [ctx.Process(target=_call, args=(args, result)) for args in targets]
    for proc in procs:
        proc.start()
    out = [result.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    for item in out:
        if item[0] == "error":
            raise RuntimeError(item[1])
    return out


def _call(args: tuple, result) -> None:
    try:
        http_writer(*args, result=result)
    except Exception as exc:  # report, don't hang the parent
        result.put(("error", repr(exc)))


def load(url: str, mode: str, *, connections: int = 4, seconds: float = 10.0, size: int = MSG_SIZE,
         batch: int = MPUB_BATCH, topic: str = "bench") -> dict:
    """Run one load; figures as a dict."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 4151
    message = b"x" * size
    if mode == "pub":
        path, body, per_request = f"/pub?topic={topic}", message, 1
    elif mode == "mpub":
        path, body, per_request = f"/mpub?topic={topic}", b"\n".join([message] * batch), batch
    elif mode == "mpub-binary":
        body = struct.pack(">i", batch) + (struct.pack(">i", size) + message) * batch
        path, per_request = f"/mpub?topic={topic}&binary=true", batch
    else:
        raise ValueError(mode)
    results = _run([(host, port, path, body, seconds)] * connections)
    elapsed = max(r[2] for r in results)
    ok = sum(r[1] for r in results)
    errors = sum(r[3] for r in results)
    return {
        "req/s": round(ok / elapsed, 1),
        "msg/s": round(ok * per_request / elapsed, 1),
        "p50 ms": round(statistics.median(r[5] for r in results) * 1000, 3),
        "p99 ms": round(max(r[6] for r in results) * 1000, 3),
        "errors": errors,
        **({"first error": next(r[4] for r in results if r[4])} if errors else {}),
    }


# --- `make bench` entry points (tests/bench/run.py starts the broker) ---------------------------------


def bench_pub(url: str, duration: float) -> dict:
    return load(url, "pub", connections=4, seconds=duration)


def bench_mpub(url: str, duration: float) -> dict:
    return load(url, "mpub", connections=4, seconds=duration)


# --- a broker of our own ---------------------------------------------------------------------------


def spawn_broker(extra: list[str]) -> Broker:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return Broker("--mem-queue-size=100000000", *extra, env=env)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.http_load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running broker's HTTP address (else use --spawn)")
    parser.add_argument("--spawn", action="store_true", help="start a broker for the run")
    parser.add_argument("--broker-flag", action="append", default=[], help="extra flag for the spawned broker")
    parser.add_argument("--mode", default="both", choices=["pub", "mpub", "mpub-binary", "both"])
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--size", type=int, default=MSG_SIZE)
    parser.add_argument("--batch", type=int, default=MPUB_BATCH)
    parser.add_argument("--topic", default="bench")
    args = parser.parse_args(argv)
    if not args.url and not args.spawn:
        parser.error("give --url or --spawn")
    modes = ["pub", "mpub"] if args.mode == "both" else [args.mode]
    for mode in modes:
        broker = spawn_broker(args.broker_flag) if args.spawn else None
        url = broker.http_url if broker else args.url
        try:
            figures = load(url, mode, connections=args.connections, seconds=args.seconds, size=args.size,
                           batch=args.batch, topic=args.topic)
            if broker:
                figures["broker RSS MB"] = round(broker.rss_mb(), 1)
        finally:
            if broker:
                broker.close()
        label = f"{mode} x{args.batch}" if mode != "pub" else "pub"
        print(f"{label:<16} {args.connections} conn {args.seconds:g}s  " + json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
