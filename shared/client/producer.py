"""Producer: publish to one broker over TCP, pipelined, reconnecting when the broker goes away."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import trio

from shared.client.backoff import backoff_delay
from shared.client.connection import Connection, NSQError
from shared.protocol import encode_dpub, encode_mpub, encode_pub

log = logging.getLogger("trio_nsq.client")


class Producer:
    """`async with Producer("127.0.0.1:4150") as p: await p.pub("topic", b"body")`.

    Any number of tasks may publish at once; their commands are pipelined on one connection. While the
    broker is unreachable, a publish waits up to `reconnect_timeout` for the connection to come back,
    then raises ConnectionError. A publish whose connection breaks before its answer raises too: it may
    or may not have been stored (NSQ is at least once; publish again if in doubt).
    """

    def __init__(self, address: str, *, reconnect_timeout: float = 5.0, identify: dict | None = None) -> None:
        self.address = address
        self.reconnect_timeout = reconnect_timeout
        self.identify = identify or {}
        self.conn: Connection | None = None
        self._connected = trio.Event()
        self._nursery: trio.Nursery | None = None

    async def __aenter__(self) -> Producer:
        self._nursery_cm = trio.open_nursery()
        self._nursery = await self._nursery_cm.__aenter__()
        self._nursery.start_soon(self._maintain)
        with trio.move_on_after(self.reconnect_timeout):
            await self._connected.wait()
        return self

    async def __aexit__(self, *exc) -> bool | None:
        self._nursery.cancel_scope.cancel()
        return await self._nursery_cm.__aexit__(*exc)

    async def _maintain(self) -> None:
        attempt = 0
        while True:
            conn = Connection(self.address, identify=self.identify)
            try:
                async with trio.open_nursery() as nursery:
                    self.conn = await nursery.start(conn.run)
                    attempt = 0
                    self._connected.set()
                    log.info("PRODUCER: connected to %s", self.address)
            except* (OSError, ConnectionError, trio.TooSlowError, NSQError) as group:
                log.warning("PRODUCER: %s - %s", self.address, group.exceptions[0])
            if self._connected.is_set():
                self._connected = trio.Event()
            self.conn = None
            attempt += 1
            await trio.sleep(backoff_delay(attempt, base=0.2, cap=5.0))

    async def _command(self, data: bytes) -> bytes:
        with trio.move_on_after(self.reconnect_timeout):
            await self._connected.wait()
        conn = self.conn
        if conn is None:
            raise ConnectionError(f"not connected to {self.address} after {self.reconnect_timeout}s")
        return await conn.command(data)

    async def pub(self, topic: str, body: bytes) -> None:
        await self._command(encode_pub(topic, body))

    async def mpub(self, topic: str, bodies: Iterable[bytes]) -> None:
        await self._command(encode_mpub(topic, bodies))

    async def dpub(self, topic: str, delay_ms: int, body: bytes) -> None:
        await self._command(encode_dpub(topic, delay_ms, body))
