"""HTTPProducer: publish through nsqd's HTTP API, batching into /mpub?binary=true."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import attrs
import trio

from trio_nsq.client.backoff import backoff_delay
from trio_nsq.client.connection import NSQConnectionError, NSQError, OwnedNursery, fresh_error
from trio_nsq.shared.protocol import encode_mpub_body

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("trio_nsq.client")


def _base_url(url: str) -> str:
    return (url if "://" in url else f"http://{url}").rstrip("/")


class Queued:
    """A message HTTPProducer.pub() queued: `await queued.wait()` returns once nsqd stored it and raises
    its own error (NSQError for nsqd's refusal of this body, e.g. MSG_TOO_BIG; NSQConnectionError when it
    could not be delivered). `error` holds that error once answered, `answered` says whether it is."""

    __slots__ = ("topic", "body", "error", "answered", "_event")

    def __init__(self, topic: str, body: bytes) -> None:
        self.topic = topic
        self.body = body
        self.error: Exception | None = None
        self.answered = False
        self._event: trio.Event | None = None  # made only for a caller that waits

    def __repr__(self) -> str:
        state = "queued" if not self.answered else "failed" if self.error else "published"
        return f"Queued({self.topic}, {len(self.body)} bytes, {state})"

    def _answer(self, error: Exception | None) -> None:
        self.error, self.answered = error, True
        if self._event is not None:
            self._event.set()

    async def wait(self) -> None:
        if not self.answered:
            self._event = self._event or trio.Event()
            await self._event.wait()
        else:
            await trio.lowlevel.checkpoint()
        if self.error is not None:
            raise fresh_error(self.error)


@attrs.define(eq=False, slots=False)
class HTTPProducer:
    """`async with HTTPProducer("http://127.0.0.1:4151") as hp: await hp.pub("t", b"x"); await hp.flush()`.

    pub() queues the message and returns; a task owned by the producer posts what is queued when a
    batch is full (`batch_size` messages or `batch_bytes` bytes for a topic) or `flush_interval`
    seconds after the first message of a batch was queued. A batch of one goes to /pub, larger ones to
    /mpub?binary=true (so bodies may contain newlines). The queue is bounded by `max_queued` messages:
    pub() waits for room. dpub() posts at once to /pub?defer=.

    pub() returns the message's `Queued`, whose `wait()` raises that message's own error. nsqd refuses
    a whole /mpub for one bad body (413 BAD_MESSAGE: too big or empty) or for its size (413
    BODY_TOO_BIG), storing none of it: the batch is then posted again in halves, down to the bodies
    nsqd refuses, so the others are published and only the bad ones fail (log2(batch) more requests per
    bad body). A message nsqd refuses (NSQError with nsqd's message as code, e.g. MSG_TOO_BIG, and the
    HTTP status) or that cannot be delivered (NSQConnectionError) is counted in `failed`; flush(), and
    leaving the `async with` normally, raise the first such error since the last flush. pub() never
    raises another message's error. A connection refused is retried `retries` times with backoff
    (nothing was sent, so nothing can be duplicated).
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

        self._queues: dict[str, list[Queued]] = {}  # waiting for the sender
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
                for queued in self._queues.values():  # left with an exception: never sent
                    for message in queued:
                        message._answer(NSQConnectionError(f"{self.url}: the producer closed",
                                                           maybe_processed=False))
                if self._client is not None:
                    with trio.CancelScope(shield=True):
                        await self._client.aclose()
        return suppressed

    async def pub(self, topic: str, body: bytes) -> Queued:
        """Queue one message (waits while `max_queued` are queued); `await (await pub(...)).wait()` waits
        for nsqd's answer to this one."""
        if not self._open:
            raise RuntimeError("HTTPProducer is not open")
        while self._queued >= self.max_queued:
            await self._room_lot.park()
        queued = Queued(topic, body)
        queue = self._queues.setdefault(topic, [])
        queue.append(queued)
        self._queued += 1
        self._unsent += 1
        self._unsent_bytes += len(body)
        self._has_data.set()
        if len(queue) >= self.batch_size or self._unsent_bytes >= self.batch_bytes:
            self._batch_ready.set()
        await trio.lowlevel.checkpoint()
        return queued

    async def mpub(self, topic: str, bodies: list[bytes]) -> list[Queued]:
        return [await self.pub(topic, body) for body in bodies]

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
        if self._error is not None:
            error, self._error = self._error, None
            raise fresh_error(error)

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

    def _batches(self, queued: list[Queued]) -> list[list[Queued]]:
        batches: list[list[Queued]] = []
        batch: list[Queued] = []
        size = 0
        for message in queued:
            if batch and (len(batch) >= self.batch_size or size + len(message.body) > self.batch_bytes):
                batches.append(batch)
                batch, size = [], 0
            batch.append(message)
            size += len(message.body)
        if batch:
            batches.append(batch)
        return batches

    async def _post_batch(self, topic: str, batch: list[Queued]) -> None:
        try:
            if len(batch) == 1:
                await self._post_retrying("/pub", {"topic": topic}, batch[0].body)
            else:
                body = encode_mpub_body([message.body for message in batch])
                await self._post_retrying("/mpub", {"topic": topic, "binary": "true"}, body)
        except NSQError as exc:
            if len(batch) > 1 and exc.status == 413:
                # nsqd stored none of it: halves, down to the bodies it refuses, publish the others
                half = len(batch) // 2
                await self._post_batch(topic, batch[:half])
                await self._post_batch(topic, batch[half:])
            else:
                self._failed(topic, batch, exc)
        except NSQConnectionError as exc:
            self._failed(topic, batch, exc)
        else:
            self.published += len(batch)
            for message in batch:
                message._answer(None)

    def _failed(self, topic: str, batch: list[Queued], error: Exception) -> None:
        log.error("HTTP PRODUCER: %d message(s) for %s failed - %s", len(batch), topic, error)
        self.failed += len(batch)
        self._error = self._error or error
        for message in batch:
            message._answer(error)

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
