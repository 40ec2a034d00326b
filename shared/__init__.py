"""trio-nsq's public API, importable from one place::

    from shared import Producer, Consumer, run_nsqd, nsqd_in_thread

Client: Producer, Consumer, Message, HTTPProducer, Connection, NSQError, NSQConnectionError
(shared.client). Embedding: run_nsqd, run_nsqlookupd, nsqd_in_thread, nsqlookupd_in_thread, Running
(shared.embed). Names are loaded on first use, so the broker importing shared.* pays for none of it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    **dict.fromkeys(["Connection", "Consumer", "HTTPProducer", "Message", "NSQConnectionError", "NSQError",
                     "Producer", "tls_context"], "shared.client"),
    **dict.fromkeys(["Running", "nsqd_in_thread", "nsqlookupd_in_thread", "run_nsqd", "run_nsqlookupd"],
                    "shared.embed"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'shared' has no attribute {name!r}")
