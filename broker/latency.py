"""Delivery-to-FIN latency of a channel: how long its consumers take from the moment a message is sent to
them to its FIN (nsqd has only publish-to-FIN, and only when percentiles are configured).

Always on, so it must cost next to nothing on the FIN path: a log-scale histogram of counters, SUB
buckets per doubling (a bucket's bounds are 2^(1/8), about 9 %, apart), from 1 µs to about 19 hours
(longer ones count in the last bucket, shorter than 1 µs in the first). A run of FINs is recorded in
one call with one clock reading; the messages of a run were mostly delivered in one batch (one
`delivery_ts`), so a bucket is found once per batch, not per message. Fixed size (two lists of
BUCKETS counters) whatever the traffic.

Like nsqd's e2e window, two half-window histograms alternate: FINs count in the current one, a figure
merges both, and the older one is dropped when a half-window has passed (so a figure covers the last
half-window to window). Figures are the buckets' midpoints in nanoseconds (within ~4.5 % of the true
value), as nsqd's e2e percentiles are nanoseconds.

Channel.finish_messages records; broker/stats.py reads `figures` for /stats, /metrics and nsqadmin.
"""

from __future__ import annotations

from math import log2

from trio_nsq.broker.message import Message

SUB = 8  # buckets per doubling
OCTAVES = 36  # 2^36 µs: 19 hours
TOP = SUB * OCTAVES  # the last bucket: that long or longer
BUCKETS = TOP + 1
QUANTILES = (0.5, 0.9, 0.99, 0.999)
WINDOW = 600.0  # seconds, nsqd's default --e2e-processing-latency-window-time


def bucket_of(seconds: float) -> int:
    """The bucket a latency counts in: 0 below 1 µs, i in [1, TOP) for [2^((i-1)/SUB), 2^(i/SUB)) µs."""
    us = seconds * 1e6
    if us < 1.0:
        return 0
    index = int(log2(us) * SUB) + 1
    return index if index < TOP else TOP


def bucket_value_ns(index: int) -> int:
    """What a bucket stands for, in nanoseconds: its geometric middle (the lower bound for the last,
    which has no upper one)."""
    if index <= 0:
        return 500
    if index >= TOP:
        return int(2.0 ** OCTAVES * 1000)
    return int(2.0 ** ((index - 0.5) / SUB) * 1000)


class LatencyHistogram:
    """One channel's delivery-to-FIN latencies over a sliding window (see the module's docstring). Times
    are trio clock seconds, the clock Message.delivery_ts is read on."""

    __slots__ = ("half_window", "_current", "_previous", "_count", "_previous_count", "_rotate_at",
                 "_last_delivery", "_bucket_until", "_bucket")

    def __init__(self, window: float = WINDOW) -> None:
        self.half_window = window / 2
        # made at the first FIN: a broker of ten thousand idle channels keeps no 4.6 KB of zeros each
        self._current = _UNUSED
        self._previous = _UNUSED
        self._count = 0
        self._previous_count = 0
        self._rotate_at = _NEVER  # set by the first FIN
        # record_many's cache: the bucket of the last delivery time seen, right until that time
        self._last_delivery = _NEVER
        self._bucket_until = _NEVER
        self._bucket = 0

    def record_many(self, msgs: list[Message], now: float) -> None:
        """A run of FINs at `now`: each message's `now - delivery_ts`. The bucket of the last delivery
        batch seen is kept with the time until which it stays right (the clock only moves on), so FINs
        of one batch, in one run or in several, find it with two comparisons."""
        if now >= self._rotate_at:
            self._advance(now)
        counts = self._current
        last = self._last_delivery
        until = self._bucket_until
        index = self._bucket
        for msg in msgs:
            delivered = msg.delivery_ts
            if delivered != last or now >= until:  # another batch, or this one's latency grew past its bucket
                last = delivered
                us = (now - delivered) * 1e6
                if us < 1.0:
                    index = 0
                else:
                    index = int(log2(us) * SUB) + 1
                    if index > TOP:
                        index = TOP
                until = delivered + _UPPER[index]
            counts[index] += 1
        self._count += len(msgs)
        self._last_delivery = last
        self._bucket_until = until
        self._bucket = index

    def record(self, seconds: float, now: float) -> None:
        """One latency (tests, and anything that is not a run of messages)."""
        if now >= self._rotate_at:
            self._advance(now)
        self._current[bucket_of(seconds)] += 1
        self._count += 1

    def _advance(self, now: float) -> None:
        """The half-window is over: the current histogram becomes the previous one (or, after a whole
        window without FINs, both are dropped)."""
        if self._rotate_at == _NEVER:
            self._current = [0] * BUCKETS
            self._previous = [0] * BUCKETS
            self._rotate_at = now + self.half_window
            return
        if now >= self._rotate_at + self.half_window:
            if self._count or self._previous_count:
                self._current = [0] * BUCKETS
                self._previous = [0] * BUCKETS
                self._count = self._previous_count = 0
            self._rotate_at = now + self.half_window
            return
        emptied = self._previous_count  # the previous histogram, made the current one, holds this many
        self._previous, self._current = self._current, self._previous
        self._previous_count, self._count = self._count, 0
        if emptied:
            self._current[:] = _ZEROS
        self._rotate_at += self.half_window

    def count(self, now: float) -> int:
        """FINs the window holds."""
        if self._rotate_at == _NEVER:
            return 0  # none ever
        if now >= self._rotate_at:
            self._advance(now)
        return self._count + self._previous_count

    def figures(self, now: float, quantiles: tuple[float, ...] = QUANTILES) -> tuple[int, list[int]]:
        """(FINs in the window, the latency in nanoseconds at each quantile (ascending): 0 with none).
        Walks the buckets once (BUCKETS steps), whatever the traffic."""
        total = self.count(now)
        if not total:
            return 0, [0] * len(quantiles)
        current, previous = self._current, self._previous
        # the rank each quantile needs (nsqd's: the value at index int(q * n + 0.5) - 1 of the sorted ones)
        ranks = [max(1, min(total, int(q * total + 0.5))) for q in quantiles]
        out = [0] * len(quantiles)
        seen = 0
        at = 0  # the next quantile to find (they come in ascending order)
        for index in range(BUCKETS):
            seen += current[index] + previous[index]
            while at < len(ranks) and ranks[at] <= seen:
                out[at] = bucket_value_ns(index)
                at += 1
            if at == len(ranks):
                break
        return total, out


_ZEROS = [0] * BUCKETS
_UNUSED: list[int] = []  # the histograms of a channel without a FIN yet (never written to)
# each bucket's upper bound, in seconds (the last has none)
_UPPER = [2.0 ** (index / SUB) / 1e6 for index in range(TOP)] + [float("inf")]
_NEVER = float("-inf")  # no time is this: no delivery, no rotation yet
