"""HTTPProducer: publish through nsqd's HTTP API, batching into /mpub?binary=true."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import attrs
import trio

from trio_nsq.client.backoff import backoff_delay
from trio_nsq.client.connection import NSQConnectionError, NSQError, OwnedNursery
from trio_nsq.shared.protocol import encode_mpub_body

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("trio_nsq.client")


def _base_url(url: str) -> str:
    return (url if "://" in url else f"http://{url}").rstrip("/")


@attrs.define(eq=False, slots=False)
class HTTPProducer:
    """`async with HTTPProducer("http://127.0.0.1:4151") as hp: await hp.pub("t", b"x"); await hp.flush()`.

    pub() queues the message and returns; a task owned by the producer posts what is queued when a
    batch is full (`batch_size` messages or `batch_bytes` bytes for a topic) or `flush_interval`
    seconds after the first message of a batch was queued. A batch of one goes to /pub, larger ones to
    /mpub?binary=true (so bodies may contain newlines). The queue is bounded by `max_queued` messages:
    pub() waits for room. dpub() posts at once to /pub?defer=.

    A batch nsqd refuses (NSQError with nsqd's message as code, e.g. MSG_TOO_BIG, and the HTTP status)
    or that cannot be delivered (NSQConnectionError) is counted in `failed` and the first such error is
    raised by the next pub() or flush(), and by leaving the `async with` normally. A connection refused
    is retried `retries` times with backoff (nothing was sent, so nothing can be duplicated).
    """

    url: str = attrs.field(converter=_base_url)
    batch_size: int = attrs.field(default=200, kw_only=True)
    batch_bytes: int = attrs.field(default=512 * 1024, kw_only=True)
    flush_interval: float = attrs.field(default=0.05, kw_only=True)
    max_queued: int = attrs.field(default=10_000, kw_only=True)
    timeout: float = attrs.field(default=10.0, kw_only=True)
    retries: int = attrs.field(default=3, kw_only=True)

    def __attrs_post_init__(self) -> None:
        self.published = 0  # messages nsqd accepted
        self.failed = 0  # messages in refused or undeliverable batches
        self.posts = 0  # HTTP requests made

        self._queues: dict[str, list[bytes]] = {}  # waiting for the sender
        self._unsent = 0
        self._unsent_bytes = 0
        self._queued = 0  # queued and not yet answered by nsqd (includes the batch being posted)
        self._has_data = trio.Event()
        self._batch_ready = trio.Event()
        self._room_lot = trio.lowlevel.ParkingLot()
        self._idle_lot = trio.lowlevel.ParkingLot()
        self._error: Exception | None = None
        self._client: httpx.AsyncClient | None = None
        self._tasks = OwnedNursery()
        self._open = False

    async def __aenter__(self) -> HTTPProducer:
        import httpx  # loaded when an HTTPProducer opens, not when the client is imported

        self._client = httpx.AsyncClient(timeout=self.timeout)
        nursery = await self._tasks.open()
        nursery.start_soon(self._sender)
        self._open = True
        return self

    async def __aexit__(self, *exc_info: Any) -> bool:
        try:
            if exc_info[0] is None:
                await self.flush()
        finally:
            self._open = False
            try:
                suppressed = await self._tasks.close(exc_info)
            finally:
                if self._client is not None:
                    with trio.CancelScope(shield=True):
                        await self._client.aclose()
        return suppressed

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    async def pub(self, topic: str, body: bytes) -> None:
        """Queue one message (waits while `max_queued` are queued)."""
        if not self._open:
            raise RuntimeError("HTTPProducer is not open")
        self._raise_error()
        while self._queued >= self.max_queued:
            await self._room_lot.park()
        queue = self._queues.setdefault(topic, [])
        queue.append(body)
        self._queued += 1
        self._unsent += 1
        self._unsent_bytes += len(body)
        self._has_data.set()
        if len(queue) >= self.batch_size or self._unsent_bytes >= self.batch_bytes:
            self._batch_ready.set()
        await trio.lowlevel.checkpoint()

    async def mpub(self, topic: str, bodies: list[bytes]) -> None:
        for body in bodies:
            await self.pub(topic, body)

    async def dpub(self, topic: str, delay_ms: int, body: bytes) -> None:
        """Publish one deferred message now (/pub?defer=delay_ms); raises its error."""
        await self._post_retrying("/pub", {"topic": topic, "defer": str(int(delay_ms))}, body)
        self.published += 1

    async def flush(self) -> None:
        """Post everything queued now and wait for nsqd's answers; raise the first failure."""
        self._batch_ready.set()
        while self._queued:
            await self._idle_lot.park()
        await trio.lowlevel.checkpoint()
        self._raise_error()

    async def _sender(self) -> None:
        while True:
            await self._has_data.wait()
            with trio.move_on_after(self.flush_interval):
                await self._batch_ready.wait()
            queues, self._queues = self._queues, {}
            self._unsent = self._unsent_bytes = 0
            self._has_data = trio.Event()
            self._batch_ready = trio.Event()
            for topic, bodies in queues.items():
                for batch in self._batches(bodies):
                    await self._post_batch(topic, batch)
                    self._queued -= len(batch)
                    self._room_lot.unpark_all()
            if not self._queued:
                self._idle_lot.unpark_all()

    def _batches(self, bodies: list[bytes]) -> list[list[bytes]]:
        batches: list[list[bytes]] = []
        batch: list[bytes] = []
        size = 0
        for body in bodies:
            if batch and (len(batch) >= self.batch_size or size + len(body) > self.batch_bytes):
                batches.append(batch)
                batch, size = [], 0
            batch.append(body)
            size += len(body)
        if batch:
            batches.append(batch)
        return batches

    async def _post_batch(self, topic: str, batch: list[bytes]) -> None:
        try:
            if len(batch) == 1:
                await self._post_retrying("/pub", {"topic": topic}, batch[0])
            else:
                await self._post_retrying("/mpub", {"topic": topic, "binary": "true"}, encode_mpub_body(batch))
        except (NSQError, NSQConnectionError) as exc:
            log.error("HTTP PRODUCER: %d messages for %s failed - %s", len(batch), topic, exc)
            self.failed += len(batch)
            self._error = self._error or exc
        else:
            self.published += len(batch)

    async def _post_retrying(self, path: str, params: dict[str, str], content: bytes) -> None:
        import httpx

        attempt = 0
        while True:
            try:
                self.posts += 1
                if self._client is None:
                    raise NSQConnectionError(f"{self.url}: the producer is not open", maybe_processed=False)
                response = await self._client.post(f"{self.url}{path}", params=params, content=content)
            except httpx.ConnectError as exc:  # nothing was sent: safe to try again
                attempt += 1
                if attempt > self.retries:
                    raise NSQConnectionError(f"{self.url}: {exc}", maybe_processed=False) from exc
                await trio.sleep(backoff_delay(attempt, base=0.1, cap=2.0))
                continue
            except httpx.HTTPError as exc:
                raise NSQConnectionError(f"{self.url}: {exc!r}") from exc
            break
        if response.status_code != 200:
            try:
                message = response.json().get("message", response.text)
            except ValueError:
                message = response.text.strip()
            raise NSQError(str(message), f"(HTTP {response.status_code} from {path})", status=response.status_code)
