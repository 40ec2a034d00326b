"""Consumer: subscribe to a topic/channel on brokers given directly or found through lookupd.

RDY follows NSQ's client guidelines: max_in_flight is split over the connections (at least 1 each;
with more connections than max_in_flight, RDY 1 rotates among them). A handler that raises puts the
consumer in backoff: RDY 0 everywhere for an exponentially growing interval, then RDY 1 on one
connection to test; a success steps back towards normal, a failure backs off longer.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import httpx
import trio

from shared.client.backoff import backoff_delay
from shared.client.connection import Connection, Message, NSQError
from shared.client.lookupd import lookup_producers
from shared.protocol import encode_cls, encode_sub

log = logging.getLogger("trio_nsq.client")

Handler = Callable[[Message], Awaitable[None]]


class Consumer:
    def __init__(
        self,
        topic: str,
        channel: str,
        handler: Handler,
        *,
        nsqd_tcp_addresses: Sequence[str] = (),
        lookupd_http_addresses: Sequence[str] = (),
        max_in_flight: int = 1,
        max_attempts: int = 5,
        requeue_delay_ms: int = 1000,
        max_backoff: float = 30.0,
        backoff_base: float = 0.5,
        lookupd_poll_interval: float = 60.0,
        rdy_rotate_interval: float = 5.0,
        on_give_up: Callable[[Message], Awaitable[None] | None] | None = None,
        identify: dict | None = None,
    ) -> None:
        if not nsqd_tcp_addresses and not lookupd_http_addresses:
            raise ValueError("give nsqd_tcp_addresses or lookupd_http_addresses")
        self.topic, self.channel, self.handler = topic, channel, handler
        self.nsqd_tcp_addresses = list(nsqd_tcp_addresses)
        self.lookupd_http_addresses = list(lookupd_http_addresses)
        self.max_in_flight = max_in_flight
        self.max_attempts = max_attempts
        self.requeue_delay_ms = requeue_delay_ms
        self.max_backoff = max_backoff
        self.backoff_base = backoff_base
        self.lookupd_poll_interval = lookupd_poll_interval
        self.rdy_rotate_interval = rdy_rotate_interval
        self.on_give_up = on_give_up
        self.identify = identify or {}

        self.connections: dict[str, Connection] = {}
        self.backoff_level = 0
        self.in_backoff = False
        self.closing = False
        self.stats = {"finished": 0, "requeued": 0, "given_up": 0}
        self._handlers = trio.CapacityLimiter(max_in_flight)
        self._rotation = 0
        self._backoff_wake = trio.Event()

    # --- life ---------------------------------------------------------------------------------

    async def __aenter__(self) -> Consumer:
        self._outer_cm = trio.open_nursery()
        self._outer = await self._outer_cm.__aenter__()
        self._handler_nursery = await self._outer.start(self._run_handler_nursery)
        self._conn_scope = trio.CancelScope()
        self._outer.start_soon(self._run_connections)
        return self

    async def __aexit__(self, *exc) -> bool | None:
        if exc[0] is None:
            await self.close()
        self._outer.cancel_scope.cancel()
        return await self._outer_cm.__aexit__(*exc)

    async def _run_handler_nursery(self, *, task_status) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started(nursery)
            await trio.sleep_forever()

    async def _run_connections(self) -> None:
        with self._conn_scope:
            async with trio.open_nursery() as nursery:
                self._conn_nursery = nursery
                for address in self.nsqd_tcp_addresses:
                    nursery.start_soon(self._keep_connected, address)
                if self.lookupd_http_addresses:
                    nursery.start_soon(self._poll_lookupd)
                nursery.start_soon(self._rotate_rdy)
                nursery.start_soon(self._backoff_loop)

    async def close(self) -> None:
        """CLS everywhere, let in-flight handlers finish (they FIN), then disconnect."""
        self.closing = True
        for conn in list(self.connections.values()):
            try:
                await conn.command(encode_cls())
            except (ConnectionError, NSQError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        with trio.move_on_after(30):
            while any(c.in_flight > 0 for c in self.connections.values()):
                await trio.sleep(0.01)
        self._conn_scope.cancel()

    # --- connections --------------------------------------------------------------------------

    async def _poll_lookupd(self) -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            while True:
                for lookupd in self.lookupd_http_addresses:
                    for address in await lookup_producers(client, lookupd, self.topic):
                        if address not in self.connections and not self.closing:
                            self.connections[address] = None  # claimed; _keep_connected fills it in
                            self._conn_nursery.start_soon(self._keep_connected, address)
                await trio.sleep(self.lookupd_poll_interval)

    async def _keep_connected(self, address: str) -> None:
        attempt = 0
        while not self.closing:
            conn = Connection(address, identify=self.identify, on_message=self._on_message)
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(conn.run)
                    await conn.command(encode_sub(self.topic, self.channel))
                    self.connections[address] = conn
                    attempt = 0
                    log.info("CONSUMER(%s/%s): connected to %s", self.topic, self.channel, address)
                    await self._redistribute_rdy()
            except* (OSError, ConnectionError, trio.TooSlowError, trio.BrokenResourceError, NSQError) as group:
                log.warning("CONSUMER: %s - %s", address, group.exceptions[0])
            if self.connections.get(address) is conn:
                self.connections[address] = None
            if not self.closing:
                await self._redistribute_rdy()
            attempt += 1
            await trio.sleep(backoff_delay(attempt, base=0.2, cap=10.0))

    def _live(self) -> list[Connection]:
        return [c for c in self.connections.values() if c is not None and not c.closed.is_set()]

    async def _send_rdy(self, conn: Connection, count: int) -> None:
        if conn.rdy != count:
            try:
                await conn.set_rdy(min(count, conn.features.get("max_rdy_count", 2500)))
            except (ConnectionError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async def _redistribute_rdy(self) -> None:
        """Split max_in_flight over live connections; in backoff only the test connection gets RDY 1."""
        live = self._live()
        if not live or self.closing:
            return
        if self.in_backoff:
            for conn in live:
                await self._send_rdy(conn, 0)
            return
        if self.backoff_level > 0:
            # testing the water after a backoff interval: one message at a time on one connection
            for i, conn in enumerate(live):
                await self._send_rdy(conn, 1 if i == 0 else 0)
            return
        if len(live) <= self.max_in_flight:
            share = max(1, self.max_in_flight // len(live))
            for conn in live:
                await self._send_rdy(conn, share)
        else:
            start = self._rotation % len(live)
            chosen = {id(c) for c in (live + live)[start : start + self.max_in_flight]}
            for conn in live:
                await self._send_rdy(conn, 1 if id(conn) in chosen else 0)

    async def _rotate_rdy(self) -> None:
        while True:
            await trio.sleep(self.rdy_rotate_interval)
            if len(self._live()) > self.max_in_flight:
                self._rotation += self.max_in_flight
                await self._redistribute_rdy()

    # --- messages -----------------------------------------------------------------------------

    def _on_message(self, msg: Message) -> None:
        self._handler_nursery.start_soon(self._handle, msg)

    async def _handle(self, msg: Message) -> None:
        async with self._handlers:
            try:
                if self.max_attempts and msg.attempts > self.max_attempts:
                    log.warning("CONSUMER: msg %s attempted %d times, giving up", msg.id.decode(), msg.attempts)
                    if self.on_give_up is not None:
                        result = self.on_give_up(msg)
                        if result is not None:
                            await result
                    self.stats["given_up"] += 1
                    await msg.finish()
                    return
                try:
                    await self.handler(msg)
                except Exception as exc:
                    log.warning("CONSUMER: handler failed for msg %s - %r", msg.id.decode(), exc)
                    if not msg.responded:
                        await msg.requeue(min(self.requeue_delay_ms * msg.attempts, 60_000))
                        self.stats["requeued"] += 1
                    await self._on_failure()
                    return
                if not msg.responded:
                    await msg.finish()
                self.stats["finished"] += 1
                await self._on_success()
            except (ConnectionError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the connection went away; the broker redelivers after msg_timeout

    async def _on_failure(self) -> None:
        self.backoff_level = min(self.backoff_level + 1, 16)
        if not self.in_backoff:
            self.in_backoff = True
            await self._redistribute_rdy()
            self._backoff_wake.set()

    async def _on_success(self) -> None:
        if self.backoff_level > 0 and not self.in_backoff:
            self.backoff_level -= 1
            await self._redistribute_rdy()

    async def _backoff_loop(self) -> None:
        while True:
            await self._backoff_wake.wait()
            self._backoff_wake = trio.Event()
            await trio.sleep(backoff_delay(self.backoff_level, base=self.backoff_base, cap=self.max_backoff))
            self.in_backoff = False
            await self._redistribute_rdy()
