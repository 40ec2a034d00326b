"""trio-nsq: NSQ's nsqd and nsqlookupd rebuilt in Python on Trio, and their public API in one place::

    from trio_nsq import Producer, Consumer, run_nsqd, nsqd_in_thread

The daemons and what they share: trio_nsq.broker (nsqd), trio_nsq.lookupd (nsqlookupd and
trio-nsqadmin), trio_nsq.shared (protocol codecs, names, options, logs, the HTTP and TCP serving layer);
the repository keeps these three folders at its top. Above them, for users: trio_nsq.client (the Trio
client), trio_nsq.spark (the PySpark connector), trio_nsq.apps (NSQ's utilities), trio_nsq.testing (a
broker in your program and tests, the pytest plugin). The daemons never import the packages above them
(tests/test_layout.py). Names below are loaded on first use, so importing the package costs nothing.

Client: Producer, Consumer, Message, HTTPProducer, Connection, NSQError, NSQConnectionError, tls_context
(trio_nsq.client). Embedding: run_nsqd, run_nsqlookupd, nsqd_in_thread, nsqlookupd_in_thread, Running
(trio_nsq.testing.embed).
"""

from __future__ import annotations

import importlib
from typing import Any

from trio_nsq import compiled as _compiled

_compiled.use_source_when_disabled()  # TRIO_NSQ_COMPILE=0: the .py files, even where compiled ones exist
_compiled.warn_if_stale()

_EXPORTS = {
    **dict.fromkeys(["Connection", "Consumer", "HTTPProducer", "Message", "NSQConnectionError", "NSQError",
                     "Producer", "tls_context"], "trio_nsq.client"),
    **dict.fromkeys(["Running", "nsqd_in_thread", "nsqlookupd_in_thread", "run_nsqd", "run_nsqlookupd"],
                    "trio_nsq.testing.embed"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trio_nsq' has no attribute {name!r}")
