"""Consumer: subscribe to a topic/channel on brokers given directly or found through nsqlookupd.

    async def handler(message):
        ...                       # returns: FIN; raises: REQ (with a growing delay) and backoff

    async with Consumer("topic", "channel", handler, lookupd_http_addresses=["127.0.0.1:4161"],
                        max_in_flight=100) as consumer:
        await trio.sleep_forever()

RDY follows NSQ's "Building Client Libraries" guide:

- max_in_flight is split over the connections, at least 1 each; the remainder goes to the first ones,
  so the sum is exactly max_in_flight. With more connections than max_in_flight, RDY 1 goes to
  max_in_flight of them and rotates every `rdy_redistribute_interval` seconds, so none starves.
- RDY is sent again when the messages received since the last RDY leave less than 25 % of it (or 1).
- Backoff: a handler that fails (or requeue(backoff=True)) sets RDY 0 on every connection for an
  interval growing exponentially with the backoff counter (capped by max_backoff); results that
  arrive during that interval are ignored. Then one connection gets RDY 1 to test the water: a success
  resumes the normal RDY (and decrements the counter, so a run of successes forgets old failures); a
  failure backs off again, longer.

A message whose handler fails is REQ'd with a delay of requeue_delay_ms × attempts (capped). The
handler runs at most max_attempts times for one message: when it fails on the last attempt, or a
message arrives with more attempts than that, `on_give_up(message)` is called and the message FIN'd.

Handlers run in `concurrency` worker tasks (default: max_in_flight) in the consumer's nursery, which
take the messages in the order they arrived; with concurrency=1 messages are handled one at a time in
order, as go-nsq's AddHandler does. Leaving the `async
with` normally (or `await consumer.close()`) closes cleanly: CLS on every connection, every message
already received is handled and FIN'd, nsqd reads it all and closes. Leaving with an exception cancels
the handlers: their messages go back to the queue after nsqd's msg_timeout.
"""

from __future__ import annotations

import inspect
import logging
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import trio

from trio_nsq.client.backoff import backoff_delay, requeue_delay_ms
from trio_nsq.client.connection import ConnectOptions, Connection, NSQConnectionError, NSQError, OwnedNursery
from trio_nsq.client.lookupd import lookup_producers
from trio_nsq.shared.protocol import DecodedMessage, encode_sub

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("trio_nsq.client")


class Message:
    """A message given to a handler: `.id .body .attempts .timestamp` (ns) and `.conn` it came on.

    The handler may answer it itself with finish(), requeue() or touch(); if it does not, the consumer
    FINs it when the handler returns and REQs it when the handler raises. Answering a message whose
    connection has gone is a no-op: nsqd gives the message to someone else after its msg_timeout.
    """

    __slots__ = ("_consumer", "conn", "id", "body", "attempts", "timestamp", "_responded")

    def __init__(self, consumer: Consumer, conn: Connection, decoded: DecodedMessage) -> None:
        self._consumer = consumer
        self.conn = conn
        self.id = decoded.id
        self.body = decoded.body
        self.attempts = decoded.attempts
        self.timestamp = decoded.timestamp
        self._responded = False

    def __repr__(self) -> str:
        return f"Message({self.id.decode()}, attempts={self.attempts}, {len(self.body)} bytes)"

    @property
    def has_responded(self) -> bool:
        return self._responded

    async def finish(self) -> None:
        """FIN: the message is done; nsqd forgets it. Once per message (later answers do nothing); never
        raises: on a connection that has gone, nsqd redelivers the message after its msg_timeout."""
        if not self._responded:
            self._responded = True
            self._consumer._finished(self)
            await self.conn.drain()

    async def requeue(self, delay_ms: int | None = None, backoff: bool = True) -> None:
        """REQ: deliver it again after `delay_ms` (default requeue_delay_ms × attempts, capped).
        With backoff=True this counts as a failure for the consumer's backoff. Never raises (as finish)."""
        if not self._responded:
            self._responded = True
            self._consumer._requeued(self, delay_ms, backoff)
            await self.conn.drain()

    async def touch(self) -> None:
        """TOUCH: reset the message's timeout on the broker (msg_timeout, see conn.msg_timeout ms), for a
        handler that needs longer; any number of times, up to nsqd's --max-msg-timeout. Never raises."""
        if not self._responded:
            try:
                self.conn.touch(self.id)
            except NSQConnectionError:
                log.debug("CONSUMER: TOUCH %s on a closed connection", self.id.decode())
            await self.conn.drain()


Handler = Callable[[Message], Awaitable[None]]
GiveUpHook = Callable[[Message], "Awaitable[None] | None"]


def _addresses(addresses: Sequence[str]) -> list[str]:
    return list(addresses)


@attrs.define(eq=False, slots=False, repr=False)
class Consumer(ConnectOptions):
    """Subscribes `handler` to topic/channel (see the module's docstring); the connection keywords
    (identify, auth_secret, tls, snappy, deflate, connect_timeout) are ConnectOptions'.

    Raises ValueError when made without nsqd_tcp_addresses or lookupd_http_addresses, or with
    max_in_flight < 1. Entering does not wait for a broker: an unreachable one, or one refusing
    (E_AUTH..., a TLS failure), is logged and retried with backoff; `await consumer.wait_connected()`
    waits for the first subscription. A handler's exception never leaves the consumer: it REQs."""

    topic: str
    channel: str
    handler: Handler
    nsqd_tcp_addresses: list[str] = attrs.field(factory=list, converter=_addresses, kw_only=True)
    lookupd_http_addresses: list[str] = attrs.field(factory=list, converter=_addresses, kw_only=True)
    max_in_flight: int = attrs.field(default=1, kw_only=True)
    concurrency: int = attrs.field(default=0, kw_only=True)  # 0: max_in_flight
    max_attempts: int = attrs.field(default=5, kw_only=True)
    on_give_up: GiveUpHook | None = attrs.field(default=None, kw_only=True)
    # REQ delay of a failed message: requeue_delay_ms × attempts, at most max_requeue_delay_ms
    requeue_delay_ms: int = attrs.field(default=1000, kw_only=True)
    max_requeue_delay_ms: int = attrs.field(default=60_000, kw_only=True)
    # backoff after a failure: backoff_base × 2**counter seconds, at most max_backoff
    backoff_base: float = attrs.field(default=0.5, kw_only=True)
    max_backoff: float = attrs.field(default=30.0, kw_only=True)
    lookupd_poll_interval: float = attrs.field(default=60.0, kw_only=True)
    rdy_redistribute_interval: float = attrs.field(default=5.0, kw_only=True)
    max_reconnect_delay: float = attrs.field(default=15.0, kw_only=True)
    close_timeout: float = attrs.field(default=30.0, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if not self.nsqd_tcp_addresses and not self.lookupd_http_addresses:
            raise ValueError("give nsqd_tcp_addresses or lookupd_http_addresses")
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.concurrency = self.concurrency or self.max_in_flight

        self.connections: dict[str, Connection] = {}  # subscribed connections by address
        self.backoff_counter = 0
        self.in_backoff = False  # RDY 0 everywhere until the backoff interval ends
        self.testing = False  # RDY 1 on one connection until a result arrives
        self.closing = False
        self.stats = {"received": 0, "finished": 0, "requeued": 0, "failed": 0, "given_up": 0, "backoffs": 0}

        self._addresses: dict[str, trio.CancelScope] = {}  # every address with a task keeping it connected
        # Received messages wait here for a worker. Unbounded as a channel, bounded in fact: nsqd sends
        # no more unanswered messages than RDY, and the RDY we hand out adds up to max_in_flight.
        self._inbox_send, self._inbox = trio.open_memory_channel[Message](math.inf)
        self._unfinished = 0  # messages received and not yet through their handler
        self._unfinished_lot = trio.lowlevel.ParkingLot()
        self._connected_lot = trio.lowlevel.ParkingLot()
        self._rotation = 0
        self._tasks = OwnedNursery()
        self._nursery: trio.Nursery | None = None  # handlers
        self._bg: trio.Nursery | None = None  # connections, discovery, RDY rotation, backoff timer
        self._bg_scope = trio.CancelScope()
        self._closed = trio.Event()
        self._close_started = False

    def __repr__(self) -> str:
        return f"Consumer({self.topic}/{self.channel})"

    @property
    def bg(self) -> trio.Nursery:
        """The nursery of connections, discovery, RDY rotation and backoff timers (open while running)."""
        if self._bg is None:
            raise RuntimeError(f"{self} is not running")
        return self._bg

    # --- life ---------------------------------------------------------------------------------

    async def __aenter__(self) -> Consumer:
        self._nursery = await self._tasks.open()
        try:
            for _ in range(self.concurrency):
                self._nursery.start_soon(self._worker)
            await self._nursery.start(self._run_background)
        except BaseException as exc:
            await self._tasks.close((type(exc), exc, exc.__traceback__))
            raise
        return self

    async def __aexit__(self, *exc_info: Any) -> bool:
        if exc_info[0] is None:
            await self.close()
        return await self._tasks.close(exc_info)

    async def _run_background(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self._bg_scope:
            async with trio.open_nursery() as bg:
                self._bg = bg
                for address in self.nsqd_tcp_addresses:
                    self._add_address(address)
                if self.lookupd_http_addresses:
                    bg.start_soon(self._poll_lookupd)
                bg.start_soon(self._rdy_loop)
                task_status.started()

    async def close(self) -> None:
        """Close cleanly: CLS everywhere, let every handler finish (FIN), wait for nsqd to close.

        Not from inside a handler (close waits for the handlers): let the handler set an event that
        the owner of the `async with` waits on instead.
        """
        if self._close_started:
            await self._closed.wait()
            return
        self._close_started = True
        self.closing = True
        with trio.move_on_after(self.close_timeout) as scope:
            async with trio.open_nursery() as nursery:
                for conn in list(self.connections.values()):
                    nursery.start_soon(conn.close_gracefully, self.close_timeout)
            await self.wait_handlers()
        if scope.cancelled_caught:
            log.warning("%s: close timed out with %d messages unfinished", self, self._unfinished)
        self._bg_scope.cancel()
        self._closed.set()

    async def wait_handlers(self) -> None:
        """Wait until every message received so far has been through its handler."""
        while self._unfinished:
            await self._unfinished_lot.park()
        await trio.lowlevel.checkpoint()

    async def wait_connected(self, count: int = 1) -> None:
        """Wait until at least `count` connections are subscribed."""
        while len(self.connections) < count:
            await self._connected_lot.park()
        await trio.lowlevel.checkpoint()

    # --- connections --------------------------------------------------------------------------

    def _add_address(self, address: str) -> None:
        scope = trio.CancelScope()
        self._addresses[address] = scope
        self.bg.start_soon(self._run_address, address, scope)

    async def _run_address(self, address: str, scope: trio.CancelScope) -> None:
        try:
            with scope:
                await self._keep_connected(address)
        finally:
            if self._addresses.get(address) is scope:
                del self._addresses[address]

    async def _keep_connected(self, address: str) -> None:
        failures = 0
        while not self.closing:
            try:
                async with self.connect(address, on_message=self._on_message) as conn:
                    await conn.command(encode_sub(self.topic, self.channel))
                    if self.closing:
                        await conn.close_gracefully(self.close_timeout)
                        return
                    failures = 0
                    self._attach(address, conn)
                    try:
                        await conn.wait_closed()
                    finally:
                        self._detach(address, conn)
                    if not self.closing:
                        log.warning("%s: lost %s - %s", self, address, conn.close_reason)
            except (OSError, NSQConnectionError, NSQError, trio.TooSlowError, ValueError) as exc:
                log.warning("%s: cannot connect to %s - %s", self, address, exc)
            if self.closing:
                return
            failures += 1
            await trio.sleep(backoff_delay(failures, base=0.1, cap=self.max_reconnect_delay))

    def _attach(self, address: str, conn: Connection) -> None:
        self.connections[address] = conn
        log.info("%s: subscribed on %s (max_rdy_count %d, msg_timeout %d ms)", self, address,
                 conn.max_rdy_count, conn.msg_timeout)
        self._connected_lot.unpark_all()
        self._apply_rdy()

    def _detach(self, address: str, conn: Connection) -> None:
        if self.connections.get(address) is conn:
            del self.connections[address]
        self._apply_rdy()

    async def _poll_lookupd(self) -> None:
        import httpx  # only a consumer that uses lookupd loads an HTTP client

        async with httpx.AsyncClient(timeout=self.connect_timeout) as client:
            while True:
                await self._query_lookupd(client)
                # jitter, so that many consumers do not ask at the same instant
                await trio.sleep(self.lookupd_poll_interval * random.uniform(0.9, 1.1))

    async def _query_lookupd(self, client: httpx.AsyncClient) -> None:
        found: set[str] = set()
        everyone_answered = True
        for lookupd in self.lookupd_http_addresses:
            producers = await lookup_producers(client, lookupd, self.topic)
            if producers is None:
                everyone_answered = False
            else:
                found.update(producers)
        if self.closing:
            return
        for address in sorted(found - self._addresses.keys()):
            log.info("%s: lookupd found %s", self, address)
            self._add_address(address)
        if everyone_answered:
            # a broker lookupd no longer lists is not retried once its connection is gone
            for address in list(self._addresses):
                if address not in found and address not in self.nsqd_tcp_addresses \
                        and address not in self.connections:
                    self._addresses.pop(address).cancel()

    # --- RDY ----------------------------------------------------------------------------------

    def _live(self) -> list[Connection]:
        return [conn for _, conn in sorted(self.connections.items()) if not conn.is_closed]

    def rdy_plan(self) -> dict[Connection, int]:
        """The RDY each live connection should have now."""
        live = self._live()
        if not live:
            return {}
        if self.in_backoff:
            return {conn: 0 for conn in live}
        if self.testing:
            chosen = live[self._rotation % len(live)]
            return {conn: 1 if conn is chosen else 0 for conn in live}
        n = len(live)
        if n <= self.max_in_flight:
            share, extra = divmod(self.max_in_flight, n)
            return {conn: min(conn.max_rdy_count, share + (1 if i < extra else 0)) for i, conn in enumerate(live)}
        chosen_idx = {(self._rotation + i) % n for i in range(self.max_in_flight)}
        return {conn: 1 if i in chosen_idx else 0 for i, conn in enumerate(live)}

    def _apply_rdy(self) -> None:
        if self.closing:
            return
        plan = self.rdy_plan()
        # lower first, then raise: the total never passes max_in_flight on our side
        for lowering in (True, False):
            for conn, count in plan.items():
                if count != conn.rdy and (count < conn.rdy) == lowering:
                    self._send_rdy(conn, count)

    def _send_rdy(self, conn: Connection, count: int) -> None:
        try:
            conn.send_rdy(count)
        except NSQConnectionError:
            pass  # its task notices and detaches it

    def _maybe_update_rdy(self, conn: Connection) -> None:
        """Send RDY again when what is left of the last one falls under 25 % (the guide's refill rule)."""
        if self.closing or self.in_backoff or self.testing or conn.rdy <= 0:
            return
        if conn.rdy_remaining <= 1 or conn.rdy_remaining < conn.rdy / 4:
            self._send_rdy(conn, self.rdy_plan().get(conn, conn.rdy))

    async def _rdy_loop(self) -> None:
        """Rotate RDY among connections when there are more of them than max_in_flight, and move the
        test RDY 1 of backoff to another connection when the tested one has nothing to deliver."""
        while True:
            await trio.sleep(self.rdy_redistribute_interval)
            live = self._live()
            if self.in_backoff or self.closing or len(live) < 2:
                continue
            if self.testing:
                tested = self.rdy_plan()
                if any(count and conn.in_flight == 0 for conn, count in tested.items()):
                    self._rotation += 1
                    self._apply_rdy()
            elif len(live) > self.max_in_flight:
                self._rotation += self.max_in_flight
                self._apply_rdy()

    # --- backoff ------------------------------------------------------------------------------

    def _backoff_signal(self, success: bool) -> None:
        if self.in_backoff or self.closing or self.max_backoff <= 0 or self._bg_scope.cancel_called:
            return  # results during the backoff interval say nothing about now
        if success:
            if self.backoff_counter == 0:
                return
            self.backoff_counter -= 1
            if self.testing:
                self.testing = False
                log.info("%s: backoff test passed, resuming (counter %d)", self, self.backoff_counter)
                self._apply_rdy()
            return
        self.backoff_counter += 1
        self.stats["backoffs"] += 1
        self.in_backoff = True
        self.testing = False
        delay = backoff_delay(self.backoff_counter, base=self.backoff_base, cap=self.max_backoff)
        log.warning("%s: backing off for %.3fs (counter %d)", self, delay, self.backoff_counter)
        self._apply_rdy()
        self.bg.start_soon(self._end_backoff_after, delay)

    async def _end_backoff_after(self, delay: float) -> None:
        await trio.sleep(delay)
        self.in_backoff = False
        self.testing = True
        self._rotation += 1  # test another connection than last time
        self._apply_rdy()

    # --- messages -----------------------------------------------------------------------------

    def _on_message(self, conn: Connection, decoded: DecodedMessage) -> None:
        """Called by a connection's reader for every message frame: hand it to the workers."""
        self.stats["received"] += 1
        self._unfinished += 1
        self._inbox_send.send_nowait(Message(self, conn, decoded))
        self._maybe_update_rdy(conn)

    async def _worker(self) -> None:
        async for msg in self._inbox:
            try:
                await self._process(msg)
            finally:
                self._unfinished -= 1
                if not self._unfinished:
                    self._unfinished_lot.unpark_all()

    async def _process(self, msg: Message) -> None:
        if self.max_attempts and msg.attempts > self.max_attempts:
            await self._give_up(msg)
            return
        try:
            await self.handler(msg)
        except Exception as exc:
            self.stats["failed"] += 1
            log.warning("%s: handler failed for %s - %r", self, msg, exc)
            if msg.has_responded:
                return
            if self.max_attempts and msg.attempts >= self.max_attempts:
                self._backoff_signal(False)
                await self._give_up(msg)
            else:
                await msg.requeue()
            return
        if not msg.has_responded:
            await msg.finish()

    async def _give_up(self, msg: Message) -> None:
        log.warning("%s: giving up on %s after %d attempts", self, msg, msg.attempts)
        if self.on_give_up is not None:
            try:
                result = self.on_give_up(msg)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("%s: on_give_up failed for %s; requeued", self, msg)
                await msg.requeue(backoff=False)
                return
        self.stats["given_up"] += 1
        if not msg.has_responded:
            msg._responded = True
            self._respond(msg, lambda conn: conn.fin(msg.id))
            await msg.conn.drain()

    def _respond(self, msg: Message, send: Callable[[Connection], None]) -> bool:
        try:
            send(msg.conn)
        except NSQConnectionError:
            log.info("%s: %s answered after its connection closed; nsqd redelivers it", self, msg)
            return False
        return True

    def _finished(self, msg: Message) -> None:
        if self._respond(msg, lambda conn: conn.fin(msg.id)):
            self.stats["finished"] += 1
            self._backoff_signal(True)

    def _requeued(self, msg: Message, delay_ms: int | None, backoff: bool) -> None:
        if delay_ms is None:
            delay_ms = requeue_delay_ms(msg.attempts, self.requeue_delay_ms, self.max_requeue_delay_ms)
        if self._respond(msg, lambda conn: conn.req(msg.id, delay_ms)):
            self.stats["requeued"] += 1
        if backoff:
            self._backoff_signal(False)
