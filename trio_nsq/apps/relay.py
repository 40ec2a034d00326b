"""What nsq_to_nsq and nsq_to_http share: choosing a destination (--mode) and their status lines.

Modes as the Go tools name them: `round-robin` takes the destinations in turn; `hostpool` (the default)
and `epsilon-greedy` take them in turn too but skip one that failed until its retry time (30 s, doubling
up to 15 min, as go-hostpool's), and when all have failed they are all tried again. nsq_to_http's
`ModeAll` (every destination gets every message) is what Go falls into for a --mode it does not know,
and so do we; `all` names it.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("trio_nsq.apps")

INITIAL_RETRY = 30.0
MAX_RETRY = 900.0


class HostPool:
    """Destinations with their health; `pick()` the next one, `mark(host, ok)` its outcome."""

    def __init__(self, hosts: list[str], mode: str) -> None:
        self.hosts = list(dict.fromkeys(hosts))
        self.mode = mode
        self.counter = 0
        self.dead_until: dict[str, float] = {}
        self.retry: dict[str, float] = {}

    def pick(self) -> str:
        self.counter += 1
        if self.mode == "round-robin":
            return self.hosts[self.counter % len(self.hosts)]
        now = time.monotonic()
        for i in range(len(self.hosts)):
            host = self.hosts[(self.counter + i) % len(self.hosts)]
            if self.dead_until.get(host, 0.0) <= now:
                return host
        self.dead_until.clear()  # all failed: try them all again, as go-hostpool does
        return self.hosts[self.counter % len(self.hosts)]

    def mark(self, host: str, ok: bool) -> None:
        if self.mode == "round-robin":
            return
        if ok:
            self.dead_until.pop(host, None)
            self.retry.pop(host, None)
            return
        delay = min(MAX_RETRY, self.retry.get(host, INITIAL_RETRY / 2) * 2)
        self.retry[host] = delay
        self.dead_until[host] = time.monotonic() + delay


class StatusTimer:
    """bitly/timer_metrics's status line every `every` requests: count, 99th and 95th percentile, mean."""

    def __init__(self, every: int, prefix: str) -> None:
        self.every = every
        self.prefix = prefix
        self.count = 0
        self.timings: list[float] = []

    def status(self, started: float) -> None:
        if self.every <= 0:
            return
        self.timings.append(time.monotonic() - started)
        self.count += 1
        if len(self.timings) >= self.every:
            timings = sorted(self.timings)
            self.timings = []

            def pct(p: float) -> float:
                return timings[min(len(timings) - 1, int(len(timings) * p))] * 1000

            log.info("%s finished %d - 99th: %.02fms - 95th: %.02fms - avg: %.02fms", self.prefix, self.count,
                     pct(0.99), pct(0.95), sum(timings) / len(timings) * 1000)
