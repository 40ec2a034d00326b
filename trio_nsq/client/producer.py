"""Producer: publish to one nsqd over TCP, pipelined, reconnecting when the broker goes away."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import attrs
import trio

from trio_nsq.client.backoff import backoff_delay
from trio_nsq.client.connection import (
    ConnectOptions,
    Connection,
    NSQConnectionError,
    NSQError,
    OwnedNursery,
    connect_refusal,
    fresh_error,
)
from trio_nsq.shared.protocol import encode_dpub, encode_mpub, encode_nop, encode_pub

log = logging.getLogger("trio_nsq.client")


@attrs.define(eq=False, slots=False)
class Producer(ConnectOptions):
    """`async with Producer("127.0.0.1:4150") as p: await p.pub("topic", b"body")`; the connection
    keywords (identify, auth_secret, tls, snappy, deflate, connect_timeout, heartbeat_interval...) are
    ConnectOptions'. snappy=True with deflate=True raises ValueError here.

    Any number of tasks may publish at once: their commands share one connection, pipelined, and each
    gets its own answer (nsqd answers in order). An error frame raises NSQError (nsqd closes the
    connection after it; the producer reconnects at once).

    A task owned by the producer keeps the connection up, reconnecting with exponential backoff. A
    publish made while the broker is away waits up to `reconnect_timeout` seconds for the connection,
    then raises NSQConnectionError. When nsqd refuses the connection itself (IDENTIFY's E_BAD_BODY, an
    AUTH failure, E_TLS_NOT_OFFERED) a publish raises that NSQError at once, as go-nsq's does, and so
    does a failed TLS handshake (NSQConnectionError naming the SSL error: a certificate refused by
    either side); the task keeps trying (the broker may be fixed). Outside the `async with` a publish
    raises RuntimeError. A publish that nsqd certainly did not execute when the connection
    broke (never written, or queued behind a refused command) is sent again on the next connection;
    one whose answer was lost with the connection raises NSQConnectionError with maybe_processed=True:
    it may have been stored (NSQ delivers at least once; publish again if in doubt).
    """

    address: str
    reconnect_timeout: float = attrs.field(default=5.0, kw_only=True)
    max_reconnect_delay: float = attrs.field(default=5.0, kw_only=True)

    def __attrs_post_init__(self) -> None:
        self.conn: Connection | None = None
        self.connects = 0  # how many connections were made (1 + reconnects)
        self.last_error: BaseException | None = None
        self._refusal: Exception | None = None  # why the last connection was refused (cleared on success)
        self._changed = trio.Event()  # set (and replaced) when a connection comes, fails, or the producer stops
        self._open = False
        self._tasks = OwnedNursery()

    async def __aenter__(self) -> Producer:
        nursery = await self._tasks.open()
        self._open = True
        nursery.start_soon(self._keep_connected)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool:
        self._open = False
        self._wake()
        return await self._tasks.close(exc_info)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _keep_connected(self) -> None:
        failures = 0
        while True:
            try:
                async with self.connect(self.address) as conn:
                    self.conn = conn
                    self.connects += 1
                    failures = 0
                    self._refusal = None
                    self._wake()
                    log.info("PRODUCER: connected to %s", self.address)
                    await conn.wait_closed()
                    self.last_error = conn.close_reason
                    log.info("PRODUCER: connection to %s closed - %s", self.address, conn.close_reason)
            except (OSError, NSQConnectionError, NSQError, trio.BrokenResourceError, trio.TooSlowError,
                    ValueError) as exc:
                self.last_error = exc
                self._refusal = connect_refusal(self.address, exc)
                log.warning("PRODUCER: cannot connect to %s - %s", self.address, self._refusal or exc)
            finally:
                self.conn = None
                self._wake()
            if failures:
                await trio.sleep(backoff_delay(failures, base=0.1, cap=self.max_reconnect_delay))
            failures += 1  # the first retry after a working connection is immediate

    async def _connection(self, deadline: float) -> Connection:
        """The live connection; waits for one until `deadline`. Raises RuntimeError outside the `async
        with`, nsqd's refusal of the last connection at once, else NSQConnectionError at the deadline."""
        while True:
            if not self._open:
                raise RuntimeError(f"Producer({self.address}) is not open: publish inside `async with`")
            conn = self.conn
            if conn is not None and not conn.is_closed:
                return conn
            if self._refusal is not None:  # a fresh exception for each caller: it may raise in many tasks
                raise fresh_error(self._refusal)
            if trio.current_time() >= deadline:
                raise NSQConnectionError(
                    f"not connected to {self.address} after {self.reconnect_timeout:g}s"
                    + (f": {self.last_error}" if self.last_error else ""), maybe_processed=False)
            with trio.move_on_at(deadline):
                await self._changed.wait()

    async def _command(self, data: bytes) -> bytes:
        deadline = trio.current_time() + self.reconnect_timeout
        while True:
            conn = await self._connection(deadline)
            try:
                return await conn.command(data)
            except NSQConnectionError as exc:
                if exc.maybe_processed or trio.current_time() >= deadline:
                    raise
                # nsqd never executed it: send it again on the next connection

    async def ping(self) -> None:
        """Wait for the connection and send NOP (go-nsq's Producer.Ping): checks that the producer is
        configured right before the first publish. Raises as pub() does."""
        conn = await self._connection(trio.current_time() + self.reconnect_timeout)
        conn.write(encode_nop())
        await conn.flush()

    async def pub(self, topic: str, body: bytes) -> None:
        """Publish one message and return once nsqd answered OK (it is stored: in memory, or on disk
        past --mem-queue-size, fsynced first with --sync-every=1).

        Raises NSQError for nsqd's refusal (E_BAD_TOPIC, E_BAD_MESSAGE for an empty or too big body,
        E_UNAUTHORIZED, E_PUB_FAILED), NSQConnectionError when no connection came within
        `reconnect_timeout` or the answer was lost (see `maybe_processed`)."""
        await self._command(encode_pub(topic, body))

    async def mpub(self, topic: str, bodies: Iterable[bytes]) -> None:
        """Publish several messages in one command: all are stored, or none (E_BAD_BODY, E_MPUB_FAILED...).
        Raises as pub() does."""
        await self._command(encode_mpub(topic, bodies))

    async def dpub(self, topic: str, delay_ms: int, body: bytes) -> None:
        """Publish one message that consumers get only after `delay_ms` (at most nsqd's --max-req-timeout,
        or trio-nsqd's --max-defer-time when set: E_INVALID beyond it). Raises as pub() does."""
        await self._command(encode_dpub(topic, int(delay_ms), body))
