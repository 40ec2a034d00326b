"""Running a server process (trio-nsqd, trio-nsqlookupd): until SIGTERM/SIGINT, which cancel it."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio


class Server(Protocol):
    """NSQD and NSQLookupd: run until cancelled, calling task_status.started() once serving."""

    async def run(self, *, task_status: trio.TaskStatus[None] = ...) -> None: ...


async def run_until_signalled(start: Callable[..., Awaitable[None]], log: logging.Logger) -> None:
    """Start the server's `run(task_status=...)`, then cancel it on the first SIGTERM or SIGINT."""
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            await nursery.start(start)
            async for signum in signals:
                log.info("received signal %s, exiting", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break


def run_service(make_server: Callable[[], Server], log: logging.Logger) -> None:
    """trio.run the server; a start-up failure (bad options, port in use, data dir) exits 1 with a log line."""
    try:
        server = make_server()
        trio.run(run_until_signalled, server.run, log)
    except* (RuntimeError, OSError) as group:
        for exc in _leaves(group):
            log.critical("%s", exc)
        sys.exit(1)


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def error_text(group: BaseExceptionGroup) -> str:
    """The first leaf exception's text, without Python's "[Errno 98]" (as Go words a listen failure)."""
    exc: BaseException = _leaves(group)[0]
    return getattr(exc, "strerror", None) or str(exc)
