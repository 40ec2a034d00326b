"""Backoff intervals: exponential with a cap for reconnects, and the consumer's backoff strategies
(go-nsq's ExponentialStrategy and FullJitterStrategy; any callable level -> seconds will do)."""

from __future__ import annotations

import random


def backoff_delay(attempt: int, base: float = 0.5, cap: float = 30.0, jitter: float = 0.1) -> float:
    """The wait before try number `attempt` (1-based): base * 2^(attempt-1), capped, with a little jitter
    (±jitter of the delay) so that many clients do not retry in step."""
    if attempt <= 0:
        return 0.0
    delay = min(cap, base * (2 ** min(attempt - 1, 62)))
    return max(0.0, delay * (1 + random.uniform(-jitter, jitter)))


class ExponentialBackoff:
    """The consumer's backoff interval at backoff level `level` (1-based): base × 2^(level-1) seconds,
    as go-nsq's ExponentialStrategy (its 1 s multiplier × 2^level is base=2.0). No jitter: the
    consumer caps the level where the next interval would pass max_backoff, as go-nsq does."""

    def __init__(self, base: float = 2.0) -> None:
        self.base = base

    def __call__(self, level: int) -> float:
        return self.base * 2.0 ** min(max(level, 1) - 1, 62)


class FullJitterBackoff(ExponentialBackoff):
    """go-nsq's FullJitterStrategy: uniform in [0, base × 2^(level-1)), so that many consumers that
    failed together do not come back together."""

    def __call__(self, level: int) -> float:
        return random.uniform(0.0, super().__call__(level))


def requeue_delay_ms(attempts: int, base_ms: int, cap_ms: int) -> int:
    """The REQ delay for a message that failed on its `attempts`-th delivery: base × attempts, capped
    (go-nsq and pynsq grow it linearly with the attempts)."""
    return max(0, min(cap_ms, base_ms * max(1, attempts)))
