"""What recording delivery-to-FIN latency costs per FIN (broker/latency.py, called once per run of FINs
by Channel.finish_messages with one trio clock reading):

    python -m tests.bench.fin_latency

Runs of 1, 10 and 100 FINs, their messages delivered in one batch (a consumer FINs a pump's batch), in
10, or each in its own; the best of 7 rounds, with the clock reading's share beside it.
"""

from __future__ import annotations

import time

import trio

from trio_nsq.broker.latency import LatencyHistogram
from trio_nsq.broker.message import Message


def run_of(size: int, batches: int) -> list[Message]:
    msgs = [Message(b"%016d" % i, b"x") for i in range(size)]
    for i, msg in enumerate(msgs):
        msg.delivery_ts = 100.0 + (i * batches // size) * 0.01
    return msgs


async def main() -> None:
    for size, batches in ((1, 1), (10, 1), (100, 1), (100, 10), (100, 100)):
        msgs = run_of(size, batches)
        histogram = LatencyHistogram()
        reps = 100_000 // size
        best = best_clock = float("inf")
        for _ in range(7):
            started = time.perf_counter()
            for _ in range(reps):
                histogram.record_many(msgs, trio.current_time())
            best = min(best, time.perf_counter() - started)
            started = time.perf_counter()
            for _ in range(reps):
                trio.current_time()
            best_clock = min(best_clock, time.perf_counter() - started)
        n = reps * size
        print(f"runs of {size:3d} FINs from {batches:3d} delivery batches: {best / n * 1e9:5.0f} ns per FIN, "
              f"{best_clock / n * 1e9:4.0f} ns of it the clock reading")


if __name__ == "__main__":
    trio.run(main)
