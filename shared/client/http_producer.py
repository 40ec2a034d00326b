"""HTTPProducer: publish through a broker's HTTP API, batching into /mpub?binary=true."""

from __future__ import annotations

import logging

import httpx
import trio

from shared.client.connection import NSQError
from shared.protocol import encode_mpub_body

log = logging.getLogger("trio_nsq.client")


class HTTPProducer:
    """`async with HTTPProducer("http://127.0.0.1:4151") as hp: await hp.pub("t", b"x"); await hp.flush()`.

    pub() queues; an owned task posts a batch when `batch_size` messages are queued or `flush_interval`
    has passed. A refused batch (e.g. MSG_TOO_BIG) is raised from the next pub() or flush(). The queue is
    bounded by `max_queued`: pub() waits for room.
    """

    def __init__(self, url: str, *, batch_size: int = 200, flush_interval: float = 0.05,
                 max_queued: int = 10_000, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.timeout = timeout
        self._queue: dict[str, list[bytes]] = {}
        self._queued = 0
        self._max_queued = max_queued
        self._wake = trio.Event()
        self._idle = trio.Event()
        self._idle.set()
        self._room = trio.Event()
        self._error: Exception | None = None

    async def __aenter__(self) -> HTTPProducer:
        self._client = httpx.AsyncClient(timeout=self.timeout)
        self._nursery_cm = trio.open_nursery()
        self._nursery = await self._nursery_cm.__aenter__()
        self._nursery.start_soon(self._sender)
        return self

    async def __aexit__(self, *exc) -> bool | None:
        try:
            if exc[0] is None:
                await self.flush()
        finally:
            self._nursery.cancel_scope.cancel()
            result = await self._nursery_cm.__aexit__(*exc)
            await self._client.aclose()
        return result

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    async def pub(self, topic: str, body: bytes) -> None:
        self._raise_error()
        while self._queued >= self._max_queued:
            self._room = trio.Event()
            await self._room.wait()
        self._queue.setdefault(topic, []).append(body)
        self._queued += 1
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        if self._queued >= self.batch_size:
            self._wake.set()

    async def flush(self) -> None:
        """Wait until everything queued is posted; raise the first refusal."""
        self._wake.set()
        await self._idle.wait()
        self._raise_error()

    async def _sender(self) -> None:
        while True:
            with trio.move_on_after(self.flush_interval):
                await self._wake.wait()
            self._wake = trio.Event()
            while self._queue:
                topic, bodies = next(iter(self._queue.items()))
                batch, rest = bodies[: self.batch_size], bodies[self.batch_size :]
                if rest:
                    self._queue[topic] = rest
                else:
                    del self._queue[topic]
                try:
                    await self._post(topic, batch)
                except Exception as exc:  # surfaced to the caller of pub()/flush()
                    log.error("HTTP PRODUCER: %s", exc)
                    self._error = self._error or exc
                self._queued -= len(batch)
                self._room.set()
            self._idle.set()

    async def _post(self, topic: str, batch: list[bytes]) -> None:
        response = await self._client.post(f"{self.url}/mpub", params={"topic": topic, "binary": "true"},
                                           content=encode_mpub_body(batch))
        if response.status_code != 200:
            try:
                message = response.json().get("message", response.text)
            except ValueError:
                message = response.text
            raise NSQError(f"{message} (HTTP {response.status_code})")
