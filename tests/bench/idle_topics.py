"""Idle topics, beside Go nsqd (issue 33): `python -m tests.bench.idle_topics [--reference DIR]`.

5,000 topics made by /topic/create and left idle: the broker's CPU over 20 s (from /proc, after 5 s of
rest) and the median time of 10 `/stats?format=json` answers. Go nsqd and trio-nsqd alternately, 2
rounds (trio-nsqd alone without --reference).
"""

from __future__ import annotations

import argparse
import statistics
import time
import urllib.request

from tests.bench.broker import Broker, post

TOPICS = 5000



def run_once(command: list[str] | None) -> tuple[float, float]:
    broker = Broker(command=command)
    try:
        for i in range(TOPICS):
            post(f"{broker.http_url}/topic/create?topic=idle{i}", timeout=30)
        time.sleep(5)
        cpu = broker.cpu_seconds()
        time.sleep(20)
        cpu = broker.cpu_seconds() - cpu
        times = []
        for _ in range(10):
            started = time.perf_counter()
            urllib.request.urlopen(f"{broker.http_url}/stats?format=json", timeout=30).read()
            times.append(time.perf_counter() - started)
        return cpu / 20 * 100, statistics.median(times) * 1000
    finally:
        broker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", help="folder with Go's nsqd 1.3.0")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    sides = [("go", [f"{args.reference}/nsqd"]), ("trio", None)] if args.reference else [("trio", None)]
    for _ in range(args.rounds):
        for name, command in sides:
            cpu, stats_ms = run_once(command)
            print(f"{name:<5} {TOPICS:,} idle topics: CPU {cpu:.2f} %, /stats median {stats_ms:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
