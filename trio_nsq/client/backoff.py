"""Exponential backoff with a cap, as NSQ clients use for reconnects and for consumer backoff."""

from __future__ import annotations

import random


def backoff_delay(attempt: int, base: float = 0.5, cap: float = 30.0, jitter: float = 0.1) -> float:
    """The wait before try number `attempt` (1-based): base * 2^(attempt-1), capped, with a little jitter
    (±jitter of the delay) so that many clients do not retry in step."""
    if attempt <= 0:
        return 0.0
    delay = min(cap, base * (2 ** min(attempt - 1, 62)))
    return max(0.0, delay * (1 + random.uniform(-jitter, jitter)))


def requeue_delay_ms(attempts: int, base_ms: int, cap_ms: int) -> int:
    """The REQ delay for a message that failed on its `attempts`-th delivery: base × attempts, capped
    (go-nsq and pynsq grow it linearly with the attempts)."""
    return max(0, min(cap_ms, base_ms * max(1, attempts)))
