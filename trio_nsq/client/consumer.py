"""Consumer: subscribe to a topic/channel on brokers given directly or found through nsqlookupd.

    async def handler(message):
        ...                       # returns: FIN; returns False or raises: REQ (with a growing delay), backoff

    async with Consumer("topic", "channel", handler, lookupd_http_addresses=["127.0.0.1:4161"],
                        max_in_flight=100) as consumer:
        await trio.sleep_forever()

A plain function works too (pynsq's style): it runs in a worker thread, and answers by returning
(True or None: FIN; False: REQ) or raising (REQ).

RDY follows NSQ's "Building Client Libraries" guide and go-nsq:

- max_in_flight is split over the connections, at least 1 each; the remainder goes to the first ones,
  so the sum is exactly max_in_flight. With more connections than max_in_flight, RDY 1 goes to
  max_in_flight of them; every `rdy_redistribute_interval` a connection that received nothing in the
  last interval gives its RDY to the connection that has waited longest (so it finds the brokers that
  have messages), and one that has kept it for `low_rdy_timeout` gives it up to let the others have
  a turn (go-nsq's LowRdyIdleTimeout and LowRdyTimeout). max_in_flight 0 pauses (RDY 0 everywhere);
  `change_max_in_flight(n)` changes it at run time.
- RDY is sent again when the messages received since the last RDY leave less than 25 % of it (or 1).
- Backoff (go-nsq's): a handler that fails (or requeue(backoff=True)) raises the backoff level by one
  (not past the level whose interval would exceed max_backoff) and sets RDY 0 on every connection for
  backoff_strategy(level) seconds; results that arrive during that interval are ignored. Then one
  connection gets RDY 1 to test the water: a failure raises the level and backs off again; a success
  lowers it by one, and backs off again (shorter) until the level is 0, when the full RDY returns.

A message whose handler fails is REQ'd with a delay of requeue_delay_ms × attempts (90 s × attempts,
at most 15 min: go-nsq's). The handler runs at most max_attempts times (5) for one message: when it
fails on the last attempt, or a message arrives with more attempts than that, a WARNING names it,
`on_give_up(message)` is called and the message FIN'd.

Handlers run in `concurrency` worker tasks (default: max_in_flight) in the consumer's nursery, which
take the messages in the order they arrived; with concurrency=1 messages are handled one at a time in
order, as go-nsq's AddHandler does. A message that waited for a worker longer than the connection's
msg_timeout is dropped unhandled (nsqd has already given it to someone else), so a handler slower
than msg_timeout cannot grow the waiting line. Leaving the `async
with` normally (or `await consumer.close()`) closes cleanly: CLS on every connection, every message
already received is handled and FIN'd, nsqd reads it all and closes. Leaving with an exception cancels
the handlers: their messages go back to the queue after nsqd's msg_timeout.
"""

from __future__ import annotations

import collections
import inspect
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import trio

from trio_nsq.client.backoff import ExponentialBackoff, backoff_delay, requeue_delay_ms
from trio_nsq.client.connection import ConnectOptions, Connection, NSQConnectionError, NSQError, OwnedNursery
from trio_nsq.client.connection import connect_refusal, fresh_error
from trio_nsq.client.lookupd import lookup_producers
from trio_nsq.shared.names import is_valid_channel_name, is_valid_topic_name
from trio_nsq.shared.protocol import DecodedMessage, encode_sub

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("trio_nsq.client")


class Message:
    """A message given to a handler: `.id .body .attempts .timestamp` (ns) and `.conn` it came on.

    The handler may answer it itself with finish(), requeue() or touch(); if it does not, the consumer
    FINs it when the handler returns and REQs it when the handler raises or returns False. After
    disable_auto_response() the consumer does neither: the message waits, in flight, for the
    handler's code to answer it later. Answering a message whose connection has gone is a no-op: nsqd
    gives the message to someone else after its msg_timeout.
    """

    __slots__ = ("_consumer", "conn", "id", "body", "attempts", "timestamp", "_responded", "auto_response")

    def __init__(self, consumer: Consumer, conn: Connection, decoded: DecodedMessage) -> None:
        self._consumer = consumer
        self.conn = conn
        self.id = decoded.id
        self.body = decoded.body
        self.attempts = decoded.attempts
        self.timestamp = decoded.timestamp
        self._responded = False
        self.auto_response = True

    def __repr__(self) -> str:
        return f"Message({self.id.decode()}, attempts={self.attempts}, {len(self.body)} bytes)"

    @property
    def has_responded(self) -> bool:
        return self._responded

    def disable_auto_response(self) -> None:
        """Answer this message later, outside the handler (go-nsq's DisableAutoResponse, pynsq's
        enable_async): the consumer will not FIN or REQ it when the handler returns or raises."""
        self.auto_response = False

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


Handler = Callable[[Message], "Awaitable[bool | None] | bool | None"]
GiveUpHook = Callable[[Message], "Awaitable[None] | None"]


def _addresses(addresses: Sequence[str]) -> list[str]:
    return list(addresses)


def _is_async(handler: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(getattr(handler, "__call__", None))


@attrs.define(eq=False, slots=False, repr=False)
class Consumer(ConnectOptions):
    """Subscribes `handler` to topic/channel (see the module's docstring); the connection keywords
    (identify, auth_secret, tls, snappy, deflate, connect_timeout) are ConnectOptions'.

    Raises ValueError when made without nsqd_tcp_addresses or lookupd_http_addresses, with an invalid
    topic or channel name, or with max_in_flight < 0; TypeError when handler is not callable. Entering
    does not wait for a broker: an unreachable one, or one refusing (E_AUTH..., a TLS failure), is
    logged and retried with backoff; `await consumer.wait_connected()` waits for the first
    subscription, and raises the broker's error when every broker known has refused it (E_AUTH_FAILED,
    E_UNAUTHORIZED...). A handler's exception never leaves the consumer: it is logged and REQs."""

    topic: str
    channel: str
    handler: Handler
    nsqd_tcp_addresses: list[str] = attrs.field(factory=list, converter=_addresses, kw_only=True)
    lookupd_http_addresses: list[str] = attrs.field(factory=list, converter=_addresses, kw_only=True)
    max_in_flight: int = attrs.field(default=1, kw_only=True)  # go-nsq's default
    concurrency: int = attrs.field(default=0, kw_only=True)  # 0: max_in_flight (and follows it)
    max_attempts: int = attrs.field(default=5, kw_only=True)  # go-nsq's; 0: no limit
    on_give_up: GiveUpHook | None = attrs.field(default=None, kw_only=True)
    # REQ delay of a failed message: requeue_delay_ms × attempts, at most max_requeue_delay_ms (go-nsq's
    # DefaultRequeueDelay 90 s and MaxRequeueDelay 15 min: a downstream outage of minutes drops nothing)
    requeue_delay_ms: int = attrs.field(default=90_000, kw_only=True)
    max_requeue_delay_ms: int = attrs.field(default=900_000, kw_only=True)
    # backoff after a failure: backoff_strategy(level) seconds (default backoff_base × 2**(level-1)),
    # the level capped where the interval would pass max_backoff (go-nsq's 2 s first, 2 min at most)
    backoff_base: float = attrs.field(default=2.0, kw_only=True)
    max_backoff: float = attrs.field(default=120.0, kw_only=True)
    backoff_strategy: Callable[[int], float] | None = attrs.field(default=None, kw_only=True)
    lookupd_poll_interval: float = attrs.field(default=60.0, kw_only=True)  # go-nsq's
    # with more connections than max_in_flight: how often an idle RDY moves on, and how long a busy
    # connection may keep it while others wait (go-nsq: 5 s loop, 10 s idle, 30 s)
    rdy_redistribute_interval: float = attrs.field(default=1.0, kw_only=True)
    low_rdy_timeout: float = attrs.field(default=30.0, kw_only=True)
    max_reconnect_delay: float = attrs.field(default=15.0, kw_only=True)
    close_timeout: float = attrs.field(default=30.0, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if not self.nsqd_tcp_addresses and not self.lookupd_http_addresses:
            raise ValueError("give nsqd_tcp_addresses or lookupd_http_addresses")
        if not is_valid_topic_name(self.topic):
            raise ValueError(f"invalid topic name {self.topic!r}")
        if not is_valid_channel_name(self.channel):
            raise ValueError(f"invalid channel name {self.channel!r}")
        if not callable(self.handler):
            raise TypeError(f"handler must be callable, not {type(self.handler).__name__}")
        if self.max_in_flight < 0:
            raise ValueError("max_in_flight must be 0 or more")
        self._handler_is_async = _is_async(self.handler)
        self._concurrency_follows = not self.concurrency
        self.concurrency = self.concurrency or max(1, self.max_in_flight)
        if self.backoff_strategy is None:
            self.backoff_strategy = ExponentialBackoff(self.backoff_base)

        self.connections: dict[str, Connection] = {}  # subscribed connections by address
        self.backoff_counter = 0  # the backoff level
        self.in_backoff = False  # RDY 0 everywhere until the backoff interval ends
        self.testing = False  # RDY 1 on one connection until a result arrives
        self.closing = False
        self.stats = {"received": 0, "finished": 0, "requeued": 0, "failed": 0, "given_up": 0, "backoffs": 0,
                      "expired": 0}

        self._addresses: dict[str, trio.CancelScope] = {}  # every address with a task keeping it connected
        self._refused: dict[str, Exception] = {}  # addresses whose last attempt a broker refused (fatal error)
        # Received messages wait here for a worker, with the time they arrived. Those that waited longer
        # than their connection's msg_timeout are dropped (nsqd has requeued them), so what is left is
        # at most what nsqd counts in flight for us: the RDY we gave, max_in_flight in all.
        self._waiting: collections.deque[tuple[float, Message]] = collections.deque()
        self._waiting_lot = trio.lowlevel.ParkingLot()
        self._unfinished = 0  # messages received and not yet through their handler
        self._unfinished_lot = trio.lowlevel.ParkingLot()
        self._connected_lot = trio.lowlevel.ParkingLot()
        self._rotation = 0  # which connection tests the water after a backoff
        # more connections than max_in_flight: those holding RDY 1, when each got it, when each last
        # held it (the longest without goes first), and its messages_received at the last round
        self._holders: list[Connection] = []
        self._granted_at: dict[Connection, float] = {}
        self._last_held: dict[Connection, float] = {}
        self._received_at_round: dict[Connection, int] = {}
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

    @property
    def waiting(self) -> int:
        """Messages received and waiting for a worker."""
        return len(self._waiting)

    def is_starved(self) -> bool:
        """True when some connection has 85 % or more of its RDY in flight (go-nsq's IsStarved): a
        handler that batches messages should process its batch now, as no more may come."""
        return any(conn.in_flight > 0 and conn.in_flight >= int(conn.rdy * 0.85) for conn in self._live())

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
        self._connected_lot.unpark_all()
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
        """Wait until at least `count` connections are subscribed.

        Raises the broker's NSQError when every broker known refused the last attempt with a fatal
        error (the consumer goes on retrying), and trio.ClosedResourceError once closing."""
        while len(self.connections) < count:
            if self.closing:
                raise trio.ClosedResourceError(f"{self} is closed")
            if self._refused and not self.connections and self._refused.keys() >= self._addresses.keys():
                raise fresh_error(next(reversed(self._refused.values())))
            await self._connected_lot.park()
        await trio.lowlevel.checkpoint()

    def change_max_in_flight(self, max_in_flight: int) -> None:
        """Change max_in_flight now (go-nsq's ChangeMaxInFlight, pynsq's set_max_in_flight): the RDY of
        every connection follows at once. 0 pauses (RDY 0 everywhere); above 0 again resumes. With
        the default concurrency, workers are added to match a higher max_in_flight."""
        if max_in_flight < 0:
            raise ValueError("max_in_flight must be 0 or more")
        self.max_in_flight = max_in_flight
        if self._concurrency_follows and max_in_flight > self.concurrency:
            if self._nursery is not None:
                for _ in range(max_in_flight - self.concurrency):
                    self._nursery.start_soon(self._worker)
            self.concurrency = max_in_flight
        del self._holders[max_in_flight:]
        log.info("%s: max_in_flight %d", self, max_in_flight)
        self._apply_rdy()

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
            self._refused.pop(address, None)

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
            except (OSError, NSQConnectionError, NSQError, trio.BrokenResourceError, trio.TooSlowError,
                    ValueError) as exc:
                refusal = connect_refusal(address, exc)
                log.warning("%s: cannot connect to %s - %s", self, address, refusal or exc)
                if refusal is not None:
                    self._refused[address] = refusal  # wait_connected raises it once every broker refused
                    self._connected_lot.unpark_all()
                else:
                    self._refused.pop(address, None)
            if self.closing:
                return
            failures += 1
            await trio.sleep(backoff_delay(failures, base=0.1, cap=self.max_reconnect_delay))

    def _attach(self, address: str, conn: Connection) -> None:
        self.connections[address] = conn
        self._refused.pop(address, None)
        log.info("%s: subscribed on %s (max_rdy_count %d, msg_timeout %d ms)", self, address,
                 conn.max_rdy_count, conn.msg_timeout)
        self._connected_lot.unpark_all()
        self._apply_rdy()

    def _detach(self, address: str, conn: Connection) -> None:
        if self.connections.get(address) is conn:
            del self.connections[address]
        if conn in self._holders:
            self._holders.remove(conn)
        for state in (self._granted_at, self._last_held, self._received_at_round):
            state.pop(conn, None)
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
            producers = await lookup_producers(client, lookupd, self.topic, auth_secret=self.auth_secret)
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
        if self.in_backoff or self.max_in_flight == 0:
            return {conn: 0 for conn in live}
        if self.testing:
            chosen = live[self._rotation % len(live)]
            return {conn: 1 if conn is chosen else 0 for conn in live}
        n = len(live)
        if n <= self.max_in_flight:
            share, extra = divmod(self.max_in_flight, n)
            return {conn: min(conn.max_rdy_count, share + (1 if i < extra else 0)) for i, conn in enumerate(live)}
        self._fill_holders(live)
        return {conn: 1 if conn in self._holders else 0 for conn in live}

    def _fill_holders(self, live: list[Connection]) -> None:
        """Up to max_in_flight connections hold RDY 1: a free place goes to the connection that has
        waited longest since it last held RDY (one that never did first)."""
        self._holders = [conn for conn in self._holders if conn in live][: self.max_in_flight]
        waiting = sorted((conn for conn in live if conn not in self._holders),
                         key=lambda conn: self._last_held.get(conn, -1.0))
        now = trio.current_time()
        for conn in waiting[: self.max_in_flight - len(self._holders)]:
            self._holders.append(conn)
            self._granted_at[conn] = self._last_held[conn] = now
            self._received_at_round[conn] = conn.messages_received

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
        """Move RDY to where the messages are when there are more connections than max_in_flight, and
        move the test RDY 1 of backoff to another connection when the tested one has nothing to deliver."""
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
            elif len(live) > self.max_in_flight > 0:
                self._redistribute(live)

    def _redistribute(self, live: list[Connection]) -> None:
        """A holder that received nothing since the last round gives its RDY up (its broker has
        nothing for us now), and so does one that has held it for low_rdy_timeout while others wait;
        the RDY goes to those that have waited longest (go-nsq's redistributeRDY, without its coin)."""
        now = trio.current_time()
        for conn in list(self._holders):
            held_for = now - self._granted_at.get(conn, now)
            # idle: nothing arrived in the last round, and it held RDY for most of that round
            idle = conn.messages_received == self._received_at_round.get(conn) \
                and held_for >= self.rdy_redistribute_interval / 2
            if idle or held_for >= self.low_rdy_timeout:
                log.debug("%s: %s gives up RDY (%s)", self, conn, "idle" if idle else "low_rdy_timeout")
                self._holders.remove(conn)
                self._last_held[conn] = now
            self._received_at_round[conn] = conn.messages_received
        self._apply_rdy()

    # --- backoff ------------------------------------------------------------------------------

    def _backoff_interval(self, level: int) -> float:
        assert self.backoff_strategy is not None
        return self.backoff_strategy(level)

    def _backoff_signal(self, success: bool) -> None:
        if self.in_backoff or self.closing or self.max_backoff <= 0 or self._bg_scope.cancel_called:
            return  # results during the backoff interval say nothing about now
        if success:
            if self.backoff_counter == 0:
                return
            # one success steps the level down by one (go-nsq, pynsq): a long outage is not forgotten
            # on one good message
            self.backoff_counter -= 1
            if self.backoff_counter == 0:
                self.testing = False
                log.warning("%s: exiting backoff, returning all to RDY", self)
                self._apply_rdy()
                return
        else:
            # the level stops where the next interval would pass max_backoff
            if self._backoff_interval(self.backoff_counter + 1) <= self.max_backoff:
                self.backoff_counter += 1
            self.stats["backoffs"] += 1
        self.in_backoff = True
        self.testing = False
        delay = min(self._backoff_interval(self.backoff_counter), self.max_backoff)
        log.warning("%s: backing off for %.3fs (backoff level %d), setting all to RDY 0", self, delay,
                    self.backoff_counter)
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
        now = trio.current_time()
        self._drop_expired(now)
        self._waiting.append((now, Message(self, conn, decoded)))
        self._waiting_lot.unpark()
        self._maybe_update_rdy(conn)

    def _expired(self, received_at: float, msg: Message, now: float) -> bool:
        return now - received_at >= msg.conn.msg_timeout / 1000

    def _drop_expired(self, now: float) -> None:
        while self._waiting and self._expired(*self._waiting[0], now):
            self._drop(self._waiting.popleft()[1])

    def _drop(self, msg: Message) -> None:
        """A message that waited for a worker longer than msg_timeout: nsqd has already requeued it
        (a FIN or REQ now would fail), so it is dropped without running the handler."""
        msg._responded = True
        msg.conn.responded()  # no longer in flight on our side: a clean close does not wait for it
        self.stats["expired"] += 1
        log.warning("%s: %s waited longer than msg_timeout (%d ms) for a handler; nsqd has requeued it, "
                    "dropped (a handler slower than msg_timeout: lower max_in_flight or call touch())",
                    self, msg, msg.conn.msg_timeout)
        self._one_unfinished_less()

    def _one_unfinished_less(self) -> None:
        self._unfinished -= 1
        if not self._unfinished:
            self._unfinished_lot.unpark_all()

    async def _worker(self) -> None:
        while True:
            while not self._waiting:
                await self._waiting_lot.park()
            received_at, msg = self._waiting.popleft()
            if self._expired(received_at, msg, trio.current_time()):
                self._drop(msg)
                continue
            try:
                await self._process(msg)
            finally:
                self._one_unfinished_less()

    async def _call_handler(self, msg: Message) -> Any:
        if self._handler_is_async:
            return await self.handler(msg)  # type: ignore[misc]
        # a plain function (pynsq's style) runs in a thread, one per worker at most
        result = await trio.to_thread.run_sync(self.handler, msg)
        if inspect.isawaitable(result):
            result = await result
        return result

    async def _process(self, msg: Message) -> None:
        if self.max_attempts and msg.attempts > self.max_attempts:
            await self._give_up(msg)
            return
        try:
            result = await self._call_handler(msg)
        except Exception as exc:
            self.stats["failed"] += 1
            log.warning("%s: handler failed for %s - %r", self, msg, exc, exc_info=True)
            await self._failed(msg)
            return
        if result is False:  # pynsq's "requeue"
            self.stats["failed"] += 1
            log.info("%s: handler returned False for %s; requeued", self, msg)
            await self._failed(msg)
        elif not msg.has_responded and msg.auto_response:
            await msg.finish()

    async def _failed(self, msg: Message) -> None:
        if msg.has_responded or not msg.auto_response:
            return
        if self.max_attempts and msg.attempts >= self.max_attempts:
            self._backoff_signal(False)
            await self._give_up(msg)
        else:
            await msg.requeue()

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
