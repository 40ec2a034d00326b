"""Run nsqd and nsqlookupd inside your own program.

In a Trio program, start a broker in a nursery you own; it serves until that nursery is cancelled::

    import trio
    from trio_nsq.testing.embed import run_nsqd

    async def main():
        async with trio.open_nursery() as nursery:
            nsqd = await nursery.start(run_nsqd)          # port 0: any free loopback ports
            print(nsqd.tcp_address, nsqd.http_address)   # "127.0.0.1:NNNNN" strings
            ...                                          # publish/consume with any client
            nursery.cancel_scope.cancel()                # nsqd's clean exit

In an asyncio or plain-thread program, run it on a thread of its own::

    from trio_nsq.testing.embed import nsqd_in_thread

    with nsqd_in_thread(data_path="/var/lib/myapp/nsq") as nsqd:
        ...  # nsqd.tcp_address is ready here; leaving the block stops the broker cleanly

Options are keyword arguments with nsqd's option names (``mem_queue_size=0``, ``max_msg_size=...``,
see ``broker/options.py``); an unknown name raises ``TypeError``. Addresses default to
``127.0.0.1:0``. When no ``data_path`` is given the broker uses a temporary directory that is removed
once it stops; when one is given, what is queued at shutdown is written there (nsqd's Exit).
"""

from __future__ import annotations

import contextlib
import functools
import queue
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import attrs
import trio

from trio_nsq.shared.addresses import join_host_port

_LOOPBACK_ANY = "127.0.0.1:0"


@attrs.define
class Running:
    """A broker that is serving: its bound addresses as "host:port" strings.

    ``server`` is the underlying ``broker.nsqd.NSQD`` or ``lookupd.nsqlookupd.NSQLookupd``;
    ``data_path`` is the directory the broker writes to (nsqd only)."""

    tcp_address: str
    http_address: str
    server: Any
    data_path: str = ""


def _address(pair: tuple[str, int] | None) -> str:
    assert pair is not None, "address read before the listener was bound"
    return join_host_port(*pair)


async def run_nsqd(*, task_status: trio.TaskStatus[Running] = trio.TASK_STATUS_IGNORED, **options: Any) -> None:
    """Serve an nsqd until cancelled; use it as ``await nursery.start(run_nsqd, ...)``.

    ``nursery.start`` returns a :class:`Running` once both TCP and HTTP listeners are bound.
    Cancelling the nursery runs nsqd's clean exit: metadata and every queued, in-flight and
    deferred message go to ``data_path``. Raises ``TypeError`` for an unknown option name,
    ``RuntimeError`` for a value nsqd refuses at start (``node_id=2000``), and ``OSError`` when a
    listener cannot bind or the data path is locked by another nsqd."""
    from trio_nsq.broker.nsqd import NSQD
    from trio_nsq.broker.options import Options

    options.setdefault("tcp_address", _LOOPBACK_ANY)
    options.setdefault("http_address", _LOOPBACK_ANY)
    options.setdefault("https_address", _LOOPBACK_ANY)
    options.setdefault("broadcast_address", "127.0.0.1")
    with contextlib.ExitStack() as stack:
        if not options.get("data_path"):
            options["data_path"] = stack.enter_context(tempfile.TemporaryDirectory(prefix="trio-nsqd-"))
        nsqd = NSQD(Options(**options))
        async with trio.open_nursery() as nursery:
            await nursery.start(nsqd.run)
            task_status.started(Running(_address(nsqd.tcp_address), _address(nsqd.http_address), nsqd,
                                        options["data_path"]))


async def run_nsqlookupd(*, task_status: trio.TaskStatus[Running] = trio.TASK_STATUS_IGNORED,
                         **options: Any) -> None:
    """Serve an nsqlookupd until cancelled; use it as ``await nursery.start(run_nsqlookupd, ...)``.

    Returns a :class:`Running` with the bound addresses; raises ``TypeError`` for an unknown
    option name and ``OSError`` when a listener cannot bind."""
    from trio_nsq.lookupd.nsqlookupd import NSQLookupd
    from trio_nsq.lookupd.options import Options

    options.setdefault("tcp_address", _LOOPBACK_ANY)
    options.setdefault("http_address", _LOOPBACK_ANY)
    lookupd = NSQLookupd(Options(**options))
    async with trio.open_nursery() as nursery:
        await nursery.start(lookupd.run)
        task_status.started(Running(_address(lookupd.tcp_address), _address(lookupd.http_address), lookupd))


@contextlib.contextmanager
def _in_thread(runner: Any, options: dict[str, Any]) -> Iterator[Running]:
    started: queue.Queue[Running | BaseException] = queue.Queue(maxsize=1)
    tokens: list[trio.lowlevel.TrioToken] = []
    stop: list[trio.Event] = []
    errors: list[BaseException] = []

    async def main() -> None:
        tokens.append(trio.lowlevel.current_trio_token())
        stop.append(trio.Event())
        async with trio.open_nursery() as nursery:
            started.put(await nursery.start(functools.partial(runner, **options)))
            await stop[0].wait()
            nursery.cancel_scope.cancel()  # the broker's clean exit runs here, on this thread

    def target() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # handed to the caller's thread, unwrapped from Trio's groups
            while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]
            errors.append(exc)
            if started.empty():
                started.put(exc)

    thread = threading.Thread(target=target, name="trio-nsq", daemon=True)
    thread.start()
    first = started.get()
    if isinstance(first, BaseException):
        thread.join()
        raise first
    try:
        yield first
    finally:
        tokens[0].run_sync_soon(stop[0].set)  # works from any thread, a Trio one included
        thread.join()
        if errors:
            raise errors[0]


def nsqd_in_thread(**options: Any) -> contextlib.AbstractContextManager[Running]:
    """Run an nsqd on a thread of its own for the length of a ``with`` block.

    For asyncio and plain-thread programs. Entering returns a :class:`Running` once the broker
    listens; leaving stops it with nsqd's clean exit and waits for that to finish. Options and
    errors are those of :func:`run_nsqd` (raised on entering)."""
    return _in_thread(run_nsqd, options)


def nsqlookupd_in_thread(**options: Any) -> contextlib.AbstractContextManager[Running]:
    """Run an nsqlookupd on a thread of its own for the length of a ``with`` block."""
    return _in_thread(run_nsqlookupd, options)
