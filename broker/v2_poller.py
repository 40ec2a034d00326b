"""V2Poller: protocol V2 connections served in place by one task between their reads.

A connection's task (ProtocolV2.io_loop) parks its connection here while nothing needs an await: a
plain socket, publishing or subscribed, every answer written. One task (run) waits on an epoll of its
own; when a parked connection is readable, ProtocolV2.step reads it, executes its commands, writes the
answers and, for a consumer, the messages its FINs and RDYs made room for, right there, for every
readable connection of one wake-up. The connection's own task is woken only when the connection needs
it (a command that awaits, an error, an fsync to wait for, an answer the socket did not take, CLS, the
end of the stream); its message_pump still sends what arrives in the channel. A task per round trip
cost a wake-up, an epoll re-registration and a cancel-scope deadline per command, more than a PUB or a
FIN itself (the HTTP side's ConnectionPoller is the same idea for /pub).

Owned by NSQD's nursery (run and expire_loop); Linux only (epoll: elsewhere every connection reads in
its task). The read deadline of a parked connection (twice its heartbeat interval, nsqd's) is
expire_loop's, checked every second.
"""

from __future__ import annotations

import logging
import select
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from trio_nsq.broker.client_v2 import ClientV2
    from trio_nsq.broker.protocol_v2 import ProtocolV2
    from trio_nsq.shared.protocol import CommandParser

log = logging.getLogger("nsqd")

MAX_EVENTS = 256

# how a parked connection comes back to its task
READ = "read"  # its task has work: commands to execute, answers to write or an fsync to wait for
EOF = "eof"  # the peer closed, or the socket failed
TIMEOUT = "timeout"  # nothing came within twice the heartbeat interval
FAILED = "failed"  # a bug while it was served in place: it costs this connection


class _Parked:
    __slots__ = ("client", "parser", "done", "outcome", "last_read")

    def __init__(self, client: ClientV2, parser: CommandParser, now: float) -> None:
        self.client = client
        self.parser = parser
        self.done = trio.Event()
        self.outcome = READ
        self.last_read = now


class V2Poller:
    def __init__(self, protocol: ProtocolV2) -> None:
        self.protocol = protocol
        self.epoll = select.epoll()
        self.parked: dict[int, _Parked] = {}

    async def park(self, client: ClientV2, parser: CommandParser) -> str:
        """Hold the connection until it needs its task again; returns why (READ, EOF, TIMEOUT, FAILED).
        Cancelling the caller (the connection ends) takes it out."""
        fd = client.fd
        if self.epoll.closed:
            return EOF  # the broker is exiting
        entry = _Parked(client, parser, trio.current_time())
        self.parked[fd] = entry
        self.epoll.register(fd, select.EPOLLIN)
        try:
            await entry.done.wait()
        finally:
            if self.parked.get(fd) is entry:
                self._release(fd)
        return entry.outcome

    def _release(self, fd: int) -> None:
        del self.parked[fd]
        if not self.epoll.closed:
            self.epoll.unregister(fd)

    def _hand_back(self, fd: int, entry: _Parked, outcome: str) -> None:
        self._release(fd)
        entry.outcome = outcome
        entry.done.set()

    async def run(self) -> None:
        parked = self.parked
        step = self.protocol.step
        try:
            while True:
                await trio.lowlevel.wait_readable(self.epoll.fileno())
                now = trio.current_time()
                for fd, _ in self.epoll.poll(0, MAX_EVENTS):
                    entry = parked.get(fd)
                    if entry is None:
                        continue
                    try:
                        outcome = step(entry.client, entry.parser)
                    except Exception as exc:  # our bug: it costs this connection
                        log.error("[%s] - failed to serve in place - %s: %s", entry.client, type(exc).__name__, exc)
                        outcome = FAILED
                    if outcome is None:
                        entry.last_read = now
                    else:
                        self._hand_back(fd, entry, outcome)
        finally:
            for fd, entry in list(parked.items()):
                self._hand_back(fd, entry, EOF)
            self.epoll.close()

    async def expire_loop(self) -> None:
        """nsqd's read deadline for parked connections: twice the heartbeat interval without a read."""
        while True:
            await trio.sleep(1)
            now = trio.current_time()
            for fd, entry in list(self.parked.items()):
                interval = entry.client.heartbeat_interval
                if interval > 0 and now - entry.last_read > interval * 2:
                    self._hand_back(fd, entry, TIMEOUT)

