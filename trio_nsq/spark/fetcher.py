"""Fetcher: the streaming source's connections to nsqd, on a Trio thread of the source's process, and the
messages they delivered, held until Spark commits the micro-batch that carried them.

Who calls it: `NSQStreamReader` (source.py), from Spark's thread, through `call()`: `take()` when Spark
plans a micro-batch, `commit()` when Spark commits one.

Why several connections per broker: nsqd sends a connection at most RDY messages it has not FIN'd, and
caps RDY at its `--max-rdy-count` (2500 by default). A message is FIN'd only once its micro-batch is
committed, so one connection carries at most 2500 messages per micro-batch, whatever Spark could take.
Each broker therefore gets enough connections to hold its share of `max_in_flight` (the count is taken
from the `max_rdy_count` the broker answers to IDENTIFY): the window grows without asking the user to
change a broker flag, and it works the same on Go nsqd.

Bounds: nsqd never has more than `max_in_flight` messages out to us (the sum of the RDY counts); held
bytes above `2 * max_bytes_per_batch` set RDY to 0 everywhere until a commit brings them under
`max_bytes_per_batch` (what was already on its way still arrives: at most the RDY counts' worth).

Why chunks: at 100k+ messages/s, work per message in Python is what limits the source. So messages are
kept as the connection read them, undecoded frames in one list per read (a `Chunk`): taking a
micro-batch moves whole chunks, the record batch is cut from the frames column-wise (source.py), and a
commit FINs each connection's messages in one write.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from trio_nsq.client.backoff import backoff_delay
from trio_nsq.client.connection import Connection, NSQConnectionError, NSQError
from trio_nsq.shared.protocol import MIN_VALID_MSG_LENGTH, encode_cls, encode_sub

if TYPE_CHECKING:
    from trio_nsq.spark.source import ReadSettings

log = logging.getLogger("trio_nsq.spark")

T = TypeVar("T")
ID = slice(10, 26)  # a message frame: timestamp (8), attempts (2), id (16), body


class Chunk:
    """Messages one read delivered on one connection, as frames (the wire format of a message)."""

    __slots__ = ("conn", "frames", "body_bytes", "since")

    def __init__(self, conn: Connection, frames: list[bytes], since: float) -> None:
        self.conn = conn
        self.frames = frames
        self.body_bytes = sum(map(len, frames)) - MIN_VALID_MSG_LENGTH * len(frames)
        self.since = since  # trio.current_time() when it came

    def ids(self) -> list[bytes]:
        return [frame[ID] for frame in self.frames]

    def split(self, n: int) -> Chunk:
        """The first `n` messages, cut off this chunk."""
        head = Chunk(self.conn, self.frames[:n], self.since)
        self.frames = self.frames[n:]
        self.body_bytes -= head.body_bytes
        return head


class Fetcher:
    """A Trio run on a daemon thread: connections to every broker, and the messages they delivered until
    they are FIN'd. The thread dies with the process (the Python worker Spark runs the source in): its
    sockets close and nsqd gives what was not FIN'd to another consumer once msg_timeout has passed."""

    def __init__(self, settings: ReadSettings) -> None:
        self.settings = settings
        self.arrived: deque[Chunk] = deque()  # delivered, not yet in a micro-batch
        self.arrived_messages = 0
        self.batches: dict[int, list[Chunk]] = {}  # micro-batch number -> its messages, until its commit
        self.held_bytes = 0  # bodies of arrived + batches
        self.paused = False  # RDY 0 everywhere: held_bytes went over the bound (until a commit)
        self.stopped = False  # RDY 0 everywhere for good: no more messages wanted (stop_delivery)
        self.connections: dict[str, list[Connection]] = {}  # broker address -> its live connections
        self.brokers: dict[str, trio.CancelScope] = {}
        self.wanted: dict[str, int] = {}  # broker address -> connections its share needs
        self._token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="nsq-source", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` in the Trio thread (from Spark's thread) and return its result."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # noqa: BLE001 - reported to the thread that waits for the start
            self._failure = exc
            self._ready.set()
            log.error("nsq source: fetcher thread ended: %r", exc)

    def close(self, requeue_held: bool = False) -> None:
        """From Spark's thread: REQ what arrived and was not taken (and, with `requeue_held`, what was
        taken and not committed), so nsqd delivers it again at once rather than after msg_timeout; send
        what is queued (FINs included), close the connections and end the thread."""
        trio.from_thread.run(self._close, requeue_held, trio_token=self._token)
        self._thread.join()

    async def _close(self, requeue_held: bool) -> None:
        self.stop_delivery()
        conns = [conn for conns in self.connections.values() for conn in conns]
        with trio.move_on_after(5):
            # CLS: nsqd answers CLOSE_WAIT after the last message it sends us, so every message it has out
            # to us is here before the REQs
            async with trio.open_nursery() as nursery:
                for conn in conns:
                    nursery.start_soon(self._cls, conn)
            held = list(self.arrived) + ([h for b in self.batches.values() for h in b] if requeue_held else [])
            self.arrived.clear()
            self.arrived_messages = 0
            for conn, ids in by_connection(held).items():
                try:
                    conn.req_many(ids)
                except NSQConnectionError:
                    pass  # nsqd has them back already
            for conn in conns:
                await conn.flush()
        self._nursery.cancel_scope.cancel()

    @staticmethod
    async def _cls(conn: Connection) -> None:
        try:
            await conn.command(encode_cls())
        except (NSQError, NSQConnectionError) as exc:
            log.info("nsq: CLS on %s - %s", conn.address, exc)

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            for address in self.settings.nsqd_tcp_addresses:
                self._add_broker(address)
            if self.settings.lookupd_http_addresses:
                nursery.start_soon(self._poll_lookupd)
            nursery.start_soon(self._touch_loop)
            self._ready.set()

    # --- brokers and connections -------------------------------------------------------------------

    def _add_broker(self, address: str) -> None:
        scope = trio.CancelScope()
        self.brokers[address] = scope
        self.connections[address] = []
        self._nursery.start_soon(self._run_broker, address, scope)

    async def _run_broker(self, address: str, scope: trio.CancelScope) -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                # the first connection tells the broker's max_rdy_count, so how many more its share needs
                await nursery.start(self._keep_connection, address)
                for _ in range(self.wanted[address] - 1):
                    nursery.start_soon(self._keep_connection, address)
        self.connections.pop(address, None)

    def share(self) -> int:
        """Messages each broker may have out to us: max_in_flight over the brokers."""
        return max(1, self.settings.max_in_flight // max(1, len(self.brokers)))

    async def _keep_connection(self, address: str, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        s = self.settings
        identify = {"msg_timeout": s.msg_timeout} if s.msg_timeout else {}
        failures = 0
        while True:
            try:
                async with Connection(address, identify=identify, on_messages=self._on_messages) as conn:
                    await conn.command(encode_sub(s.topic, s.channel))
                    failures = 0
                    self.wanted.setdefault(address, max(1, math.ceil(self.share() / conn.max_rdy_count)))
                    task_status.started()
                    task_status = trio.TASK_STATUS_IGNORED
                    self.connections[address].append(conn)
                    self._apply_rdy()
                    try:
                        await conn.wait_closed()
                    finally:
                        self.connections[address].remove(conn)
                        self._apply_rdy()
                    log.warning("nsq source: lost %s - %s", address, conn.close_reason)
            except (OSError, NSQConnectionError, NSQError, trio.TooSlowError, ValueError) as exc:
                log.warning("nsq source: cannot connect to %s - %s", address, exc)
            failures += 1
            await trio.sleep(backoff_delay(failures, base=0.1, cap=5.0))

    def _apply_rdy(self) -> None:
        """Spread each broker's share over its connections (RDY is a window: nsqd sends while the
        connection has fewer than RDY messages not FIN'd, so it is sent again only when it changes).
        The share is cut in as many parts as connections are wanted, not as are open yet: a connection
        open early would otherwise get more than its part, and the sum more than the share."""
        share = self.share()
        for address, conns in self.connections.items():
            parts = max(len(conns), self.wanted.get(address, 1))
            for i, conn in enumerate(conns):
                rdy = 0 if self.paused or self.stopped else share // parts + (1 if i < share % parts else 0)
                rdy = min(rdy, conn.max_rdy_count)
                if rdy != conn.rdy and not conn.is_closed:
                    conn.send_rdy(rdy)

    async def _poll_lookupd(self) -> None:
        import httpx

        from trio_nsq.client.lookupd import lookup_producers

        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                found: set[str] = set()
                for lookupd in self.settings.lookupd_http_addresses:
                    producers = await lookup_producers(client, lookupd, self.settings.topic)
                    found.update(producers or ())
                for address in sorted(found - set(self.brokers)):
                    log.info("nsq source: lookupd found %s", address)
                    self._add_broker(address)
                if found - set(self.settings.nsqd_tcp_addresses):
                    self._apply_rdy()
                # quickly at first (a topic not yet made), then as a consumer does
                await trio.sleep((1.0 if not found else 15.0) * random.uniform(0.9, 1.1))

    # --- messages ------------------------------------------------------------------------------------

    def _on_messages(self, conn: Connection, frames: list[bytes]) -> None:
        chunk = Chunk(conn, frames, trio.current_time())
        self.arrived.append(chunk)
        self.arrived_messages += len(frames)
        self.held_bytes += chunk.body_bytes
        if not self.paused and self.held_bytes > 2 * self.settings.max_bytes_per_batch:
            self.paused = True
            self._apply_rdy()

    async def _touch_loop(self) -> None:
        """TOUCH what has been held for a quarter of msg_timeout, every quarter (so at most half of it
        passes between two TOUCHes); micro-batches that commit sooner are never touched."""
        while True:
            # the msg_timeout asked for, else the brokers' (known once connected: until then, look again soon)
            timeouts = [c.msg_timeout for conns in self.connections.values() for c in conns]
            period = (self.settings.msg_timeout or min(timeouts, default=4000)) / 4000
            await trio.sleep(period)
            old = trio.current_time() - period
            held = [h for b in self.batches.values() for h in b] + list(self.arrived)
            for conn, ids in by_connection([h for h in held if h.since <= old]).items():
                try:
                    conn.touch_many(ids)
                except NSQConnectionError:
                    pass  # nsqd has them back already

    # --- called from Spark's thread (through call) -----------------------------------------------------

    def take(self, batch: int) -> list[Chunk]:
        """Up to max_messages_per_batch and max_bytes_per_batch (at least one message) of what arrived,
        filed under `batch` until its commit. Messages whose connection has closed are taken too: they
        were received, so Spark gets them; only their FIN is impossible (nsqd delivers them again)."""
        s = self.settings
        taken: list[Chunk] = []
        count = size = 0
        arrived = self.arrived
        while arrived and count < s.max_messages_per_batch:
            chunk = arrived[0]
            room = s.max_messages_per_batch - count
            n = len(chunk.frames)
            if n > room or size + chunk.body_bytes > s.max_bytes_per_batch:
                # the last chunk of this batch: the part of it that fits
                n = fitting(chunk.frames[:room], s.max_bytes_per_batch - size, at_least_one=not taken)
                if not n:
                    break
            if n == len(chunk.frames):
                arrived.popleft()
            else:
                chunk = chunk.split(n)
            taken.append(chunk)
            count += len(chunk.frames)
            size += chunk.body_bytes
        self.arrived_messages -= count
        if taken:  # (a read planned twice for one batch adds to it)
            self.batches.setdefault(batch, []).extend(taken)
        return taken

    def stop_delivery(self) -> None:
        """RDY 0 everywhere, for good: nsqd sends no more (a FIN would otherwise make room for new
        messages, which would only be REQ'd when the connections close)."""
        self.stopped = True
        self._apply_rdy()

    def arrived_count(self) -> int:
        return self.arrived_messages

    def all_connected(self) -> bool:
        """Whether every broker has all the connections its share needs."""
        return bool(self.brokers) and all(
            len(self.connections.get(address, ())) >= self.wanted.get(address, 1) for address in self.brokers)

    def wait_connected(self, timeout: float) -> bool:
        """From Spark's thread: wait until every broker has its connections, at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not self.call(self.all_connected):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def wait_settled(self, count: int, quiet: float, timeout: float | None = None) -> None:
        """From Spark's thread: wait until `count` messages arrived, or none came for `quiet` seconds
        (at most `timeout` seconds): what a channel held when the connections opened has come."""
        start = since = time.monotonic()
        arrived = 0
        while arrived < count and time.monotonic() - since < quiet:
            if timeout is not None and time.monotonic() - start > timeout:
                return
            time.sleep(0.005)
            now = self.call(self.arrived_count)
            if now != arrived:
                arrived, since = now, time.monotonic()

    def holding(self, batch: int) -> bool:
        """Whether messages of batches before `batch` still wait for their commit."""
        return any(b < batch for b in self.batches)

    def commit(self, upto: int) -> int:
        """FIN every message of the batches up to `upto`, each on the connection it came on."""
        done = [chunk for b in sorted(b for b in self.batches if b <= upto) for chunk in self.batches.pop(b)]
        self.held_bytes -= sum(chunk.body_bytes for chunk in done)
        finished = 0
        for conn, ids in by_connection(done).items():
            try:
                conn.fin_many(ids)
                finished += len(ids)
            except NSQConnectionError:
                pass  # closed meanwhile: nsqd delivers them again
        if self.paused and self.held_bytes <= self.settings.max_bytes_per_batch:
            self.paused = False
            self._apply_rdy()
        return finished


def fitting(frames: list[bytes], room: int, at_least_one: bool) -> int:
    """How many of `frames`, from the first, have bodies that fit in `room` bytes (with `at_least_one`,
    a first message larger than `room` still counts: a batch holds at least one)."""
    n = size = 0
    for frame in frames:
        size += len(frame) - MIN_VALID_MSG_LENGTH
        if size > room and (n or not at_least_one):
            break
        n += 1
    return n


def by_connection(chunks: list[Chunk]) -> dict[Connection, list[bytes]]:
    """The ids of the chunks' messages, per connection still open (a closed one takes no FIN/REQ/TOUCH:
    nsqd gives its messages to another consumer)."""
    ids: dict[Connection, list[bytes]] = {}
    for chunk in chunks:
        if not chunk.conn.is_closed:
            ids.setdefault(chunk.conn, []).extend(chunk.ids())
    return ids
