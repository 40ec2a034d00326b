"""Exponential backoff with a cap, as NSQ clients use for reconnects and for consumer backoff."""

from __future__ import annotations

import random


def backoff_delay(attempt: int, base: float = 0.5, cap: float = 30.0, jitter: float = 0.1) -> float:
    """The wait before try number `attempt` (1-based): base * 2^(attempt-1), capped, with a little jitter."""
    delay = min(cap, base * (2 ** max(0, attempt - 1)))
    return delay * (1 + random.uniform(-jitter, jitter))
