"""Start-up beside Go nsqd (issue 34): `make bench [NSQ_REFERENCE=<dir>]`.

    python -m tests.bench.startup [--reference DIR] [--rounds N] [--output FILE]

The time from spawning a daemon to the first `200` answer of `GET /ping` on its HTTP port (fresh data
directory, free loopback ports, default flags but --log-level=warn), for Go's nsqd (with DIR),
trio-nsqd, trio-nsqlookupd, and the floor: a Python process that imports Trio and answers /ping from a
Trio task, nothing else (what any Trio daemon pays before its first line of its own). Interleaved
rounds, medians. Client libraries' test harnesses spawn nsqd before each test and give it 2 s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from tests.bench.machine import merge_report
from tests.processes import free_port

# the floor: Trio imported, a listener, one task answering /ping
FLOOR = """
import sys, trio
async def serve(stream):
    await stream.receive_some(4096)
    await stream.send_all(b"HTTP/1.1 200 OK\\r\\ncontent-length: 2\\r\\n\\r\\nOK")
    await stream.aclose()
host, port = sys.argv[1].rsplit(":", 1)
trio.run(lambda: trio.serve_tcp(serve, int(port), host=host))
"""


def _pinged(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"GET /ping HTTP/1.1\r\nHost: bench\r\n\r\n")
            return sock.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def start_once(side: str, reference: str | None) -> float:
    """Milliseconds from spawn to the first answered /ping."""
    tcp, http = free_port(), free_port()
    folder = tempfile.mkdtemp(prefix="trio-nsq-start-")
    flags = [f"--tcp-address=127.0.0.1:{tcp}", f"--http-address=127.0.0.1:{http}", "--log-level=warn"]
    if side == "go":
        assert reference is not None
        argv = [os.path.join(reference, "nsqd"), *flags, f"--data-path={folder}"]
    elif side == "trio-nsqd":
        argv = [sys.executable, "-m", "trio_nsq.broker", *flags, f"--data-path={folder}"]
    elif side == "trio-nsqlookupd":
        argv = [sys.executable, "-m", "trio_nsq.lookupd", *flags]
    else:
        argv = [sys.executable, "-c", FLOOR, f"127.0.0.1:{http}"]
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        while not _pinged(http):
            if proc.poll() is not None:
                raise RuntimeError(f"{side} exited with {proc.returncode}: {argv}")
            if time.perf_counter() - started > 30:
                raise RuntimeError(f"{side} did not answer /ping in 30 s")
            time.sleep(0.001)
        return (time.perf_counter() - started) * 1000
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", help="folder with Go nsqd 1.3.0 (else only ours and the floor run)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--output", default="bench-results.json", help="merged into this JSON file")
    args = parser.parse_args(argv)
    sides = (["go"] if args.reference else []) + ["trio-nsqd", "trio-nsqlookupd", "floor"]
    samples: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(args.rounds):
        for side in sides:  # interleaved
            samples[side].append(start_once(side, args.reference))
    results = {side: {"median_ms": statistics.median(values), "samples_ms": values} for side, values in samples.items()}
    print(f"start-up to the first /ping answer, medians of {args.rounds} interleaved rounds:")
    for side, entry in results.items():
        print(f"  {side:<16} {entry['median_ms']:7.0f} ms   ({', '.join(f'{v:.0f}' for v in entry['samples_ms'])})")
    merge_report(args.output, {"reference": os.path.abspath(args.reference) if args.reference else None,
                               "rounds": args.rounds, "results": results,
                               "floor": "python -c 'import trio' and one task answering /ping"},
                 "startup")
    print(f"written {args.output}")
    return results


if __name__ == "__main__":
    main()
