"""End-to-end processing latency percentiles over a sliding window (nsqd's internal/quantile).

Like nsqd, two half-window buckets alternate: samples go into the current one, a query merges both,
and a bucket is cleared when its half-window has passed. Each bucket keeps a bounded uniform sample
(reservoir sampling) instead of perks' targeted summary: exact for small counts, a fair estimate for
large ones, and O(1) per insert on the FIN path.
"""

from __future__ import annotations

import random
import time

BUCKET_SAMPLES = 4096


class Quantile:
    __slots__ = ("percentiles", "half_window", "_buckets", "_counts", "_current", "_last_move")

    def __init__(self, window: float, percentiles: list[float]) -> None:
        self.percentiles = list(percentiles)
        self.half_window = window / 2
        self._buckets: list[list[float]] = [[], []]
        self._counts = [0, 0]
        self._current = 0
        self._last_move = time.monotonic()

    def _move_windows(self, now: float) -> None:
        while now > self._last_move + self.half_window:
            self._current ^= 1
            self._buckets[self._current] = []
            self._counts[self._current] = 0
            self._last_move += self.half_window
            if now - self._last_move > 2 * self.half_window:
                self._last_move = now  # long idle: no need to step through every empty window

    def insert(self, msg_timestamp_ns: int) -> None:
        self._move_windows(time.monotonic())
        value = float(time.time_ns() - msg_timestamp_ns)
        i = self._current
        self._counts[i] += 1
        bucket = self._buckets[i]
        if len(bucket) < BUCKET_SAMPLES:
            bucket.append(value)
        else:
            j = random.randrange(self._counts[i])
            if j < BUCKET_SAMPLES:
                bucket[j] = value

    def merge_into(self, samples: list[float]) -> int:
        self._move_windows(time.monotonic())
        samples.extend(self._buckets[0])
        samples.extend(self._buckets[1])
        return self._counts[0] + self._counts[1]

    def result(self) -> dict:
        samples: list[float] = []
        count = self.merge_into(samples)
        return result_from(samples, count, self.percentiles)


def result_from(samples: list[float], count: int, percentiles: list[float]) -> dict:
    """nsqd's quantile.Result as JSON: {"count", "percentiles": [{"quantile", "value"}]}."""
    samples.sort()
    out = []
    for p in percentiles:
        value = 0.0
        if samples:
            value = samples[min(len(samples) - 1, max(0, int(p * len(samples) + 0.5) - 1))]
        out.append({"quantile": p, "value": value})
    return {"count": count, "percentiles": out}


def aggregate(quantiles: list[Quantile], percentiles: list[float]) -> dict:
    """A topic's figure: its channels' samples merged (nsqd's AggregateChannelE2eProcessingLatency)."""
    samples: list[float] = []
    count = sum(q.merge_into(samples) for q in quantiles)
    return result_from(samples, count, percentiles)
