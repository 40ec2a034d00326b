"""What a Spark task does with its messages, without Spark: batches bounded by count and body size, and
`POST /mpub?binary=true` over one reused HTTP connection with retries. Plain Python (stdlib HTTP), so it is
tested on its own and a Spark worker needs nothing beyond the package to run it.

Errors are split the way Spark's retry logic needs them:

- `NSQRefusedError`: the broker answered 4xx (message too big, bad topic...). Sending again cannot help,
  so it is raised at once and fails the task with the broker's own code in the message.
- `NSQUnavailableError`: no broker answered (connection refused, timeout, 5xx) after every retry.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import random
import time
import urllib.parse
from collections.abc import Iterator
from typing import Self

from trio_nsq.shared.protocol import encode_mpub_body

log = logging.getLogger("trio_nsq.spark")

# nsqd's defaults for --max-body-size and --max-msg-size
DEFAULT_MAX_BODY_SIZE = 5 * 1024 * 1024
DEFAULT_MAX_MSG_SIZE = 1024 * 1024


class NSQPublishError(RuntimeError):
    """A batch could not be published."""


class NSQRefusedError(NSQPublishError):
    """The broker refused a batch (4xx): retrying cannot help."""

    def __init__(self, text: str, status: int, code: str) -> None:
        super().__init__(text)
        self.status = status
        self.code = code


class NSQUnavailableError(NSQPublishError, ConnectionError):
    """No broker took the batch, after every retry."""


def mpub_size(bodies: list[bytes]) -> int:
    """Bytes of the binary /mpub body: [count:uint32] then [size:uint32][bytes] per message."""
    return 4 + 4 * len(bodies) + sum(map(len, bodies))


class Batcher:
    """Groups messages per topic into /mpub batches of at most `max_count` messages and `max_bytes` body
    bytes. Order within a topic is kept; a message larger than `max_bytes` on its own still makes a batch
    of one, so that the broker, not the connector, says why it is refused."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._pending: dict[str, tuple[list[bytes], list[int]]] = {}
        self._keys: dict[str, list] = {}  # add_keyed(): the rows' keys of each pending batch

    @property
    def pending_bytes(self) -> int:
        """Body bytes held back, over every topic (rows routed to many topics fill many small batches)."""
        return sum(size[0] for _, size in self._pending.values())

    def add(self, topic: str, body: bytes) -> tuple[str, list[bytes]] | None:
        """Queue one message; returns a full batch to send (of this topic) when adding it overflowed one."""
        entry = self._pending.get(topic)
        if entry is None:
            self._pending[topic] = ([body], [4 + 4 + len(body)])
            return None
        bodies, size = entry
        cost = 4 + len(body)
        if len(bodies) >= self.max_count or size[0] + cost > self.max_bytes:
            self._pending[topic] = ([body], [4 + cost])
            return topic, bodies
        bodies.append(body)
        size[0] += cost
        return None

    def flush(self) -> Iterator[tuple[str, list[bytes]]]:
        pending, self._pending = self._pending, {}
        for topic, (bodies, _) in pending.items():
            yield topic, bodies

    def add_keyed(self, topic: str, body: bytes, key: str | int) -> tuple[str, list[bytes], list] | None:
        """add(), carrying each message's row key along: a full batch comes with its messages' keys (a
        Batcher is fed by add() or by add_keyed(), not both)."""
        full = self.add(topic, body)
        if full is None:
            self._keys.setdefault(topic, []).append(key)
            return None
        keys, self._keys[topic] = self._keys[topic], [key]  # (`body` started the topic's next batch)
        return topic, full[1], keys

    def flush_keyed(self) -> Iterator[tuple[str, list[bytes], list]]:
        keys, self._keys = self._keys, {}
        for topic, bodies in self.flush():
            yield topic, bodies, keys[topic]


# a row key longer than this shows as a digest in a request's key, which so stays well within the broker's
# 256 characters, suffixes of a request cut in pieces (".0", ".h1"...) included
_SHOWN_KEY = 48


def _shown(key: str | int) -> str:
    """A row key as it appears in a request's key: itself when short printable ASCII, else a digest."""
    text = str(key)
    if len(text) <= _SHOWN_KEY and text.isascii() and text.isprintable():
        return text
    return "#" + hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def rows_key(keys: list) -> str:
    """The Idempotency-Key of a request carrying rows whose idempotency_key_column values are `keys`, in
    order: `rows/<first>..<last>/<count>/<digest of every key>`. It depends on the rows alone, not on
    Spark's query, batch or partition numbers, so the same rows published again (a replayed micro-batch,
    a query restarted from offsets) are refused as duplicates. At most 131 characters (the broker takes
    256)."""
    digest = hashlib.blake2b(json.dumps(keys, separators=(",", ":")).encode(), digest_size=8).hexdigest()
    return f"rows/{_shown(keys[0])}..{_shown(keys[-1])}/{len(keys)}/{digest}"


def split_to_fit(bodies: list[bytes], max_bytes: int) -> Iterator[list[bytes]]:
    """Consecutive slices of `bodies` whose /mpub bodies stay within max_bytes (a lone oversize message
    is a slice of its own)."""
    start, size = 0, 4
    for i, body in enumerate(bodies):
        cost = 4 + len(body)
        if i > start and size + cost > max_bytes:
            yield bodies[start:i]
            start, size = i, 4
        size += cost
    if start < len(bodies):
        yield bodies[start:]


def host_port(address: str, default_port: int) -> tuple[str, int]:
    """'host:port', 'http://host:port/', '[::1]:4151' or 'host' -> (host, port); ValueError if it is none."""
    parts = urllib.parse.urlsplit(address if "://" in address else "http://" + address)
    if parts.scheme != "http":
        raise ValueError("only http:// is supported")
    if not parts.hostname:
        raise ValueError("no host")
    return parts.hostname, parts.port or default_port  # .port raises ValueError for a bad port


def _broker_message(data: bytes) -> str:
    """nsqd's error body is {"message": "CODE"}; anything else is shown as text."""
    try:
        return str(json.loads(data)["message"])
    except (ValueError, KeyError, TypeError):
        return data.decode("utf-8", "replace").strip()[:200]


_said_at_least_once: set[str] = set()  # brokers already logged as lacking idempotent_publish, in this process


def at_least_once_once(reason: str) -> None:
    """Log, once per process and reason, that delivery falls back to at least once."""
    if reason not in _said_at_least_once:
        _said_at_least_once.add(reason)
        log.warning("nsq: %s: delivery is at least once (a retried task or request may publish twice)", reason)


class KeptConnection:
    """One HTTP/1.1 connection kept open from request to request, and the retry settings, of the package's
    two clients of a broker's HTTP API: MPubClient (the writer's /mpub) and log_client.LogClient (the
    reader's /log). A subclass says where a new connection goes (`_address`) and what it forgets when one
    is opened (`_opened`). Not thread-safe: one client per thread."""

    def __init__(self, *, timeout: float, max_retries: int, retry_backoff: float, retry_backoff_max: float,
                 sleep=time.sleep) -> None:
        self.timeout = timeout
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        self.retry_backoff_max = retry_backoff_max
        self._sleep = sleep
        self._conn: http.client.HTTPConnection | None = None
        self._fresh = False

    def _address(self) -> tuple[str, int]:
        raise NotImplementedError

    def _opened(self) -> None:
        """A new connection was opened (maybe to another broker)."""

    def _backoff(self, attempt: int) -> float:
        """The pause before retry `attempt` (1, 2, ...): doubling from retry_backoff up to retry_backoff_max,
        with jitter."""
        return min(self.retry_backoff_max, self.retry_backoff * 2 ** (attempt - 1)) * random.uniform(0.8, 1.2)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, method: str, path: str, body: bytes | None,
              headers: dict[str, str]) -> tuple[http.client.HTTPResponse, bytes]:
        """One request on the kept connection: (the response, its body read); a kept connection the server
        closed meanwhile is reopened once at no cost (that is not a failure of the broker)."""
        for _ in range(2):
            if self._conn is None:
                host, port = self._address()
                self._conn = http.client.HTTPConnection(host, port, timeout=self.timeout)
                self._fresh = True
                self._opened()
            reused = not self._fresh
            self._fresh = False
            try:
                self._conn.request(method, path, body=body, headers=headers)
                response = self._conn.getresponse()
                data = response.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()
                if reused:
                    continue
                raise
            except BaseException:
                self.close()
                raise
            if response.will_close:
                self.close()
            return response, data
        raise AssertionError("unreachable")


class MPubClient(KeptConnection):
    """Publishes batches through `POST /mpub?binary=true`, keeping one HTTP/1.1 connection open.

    `publish(topic, bodies, key)` with a key sends it as the `Idempotency-Key` header, to a broker whose
    `/info` says `"idempotent_publish": true`: the broker publishes a key once, so a request sent again
    (after a lost answer, a 5xx, a task retry) with the same key lands once. Every attempt of one request
    reuses its key; a request cut into smaller ones (the broker's body limit) gives each piece the key
    plus its position, the same on every run. A broker without the flag gets no header (at least once,
    logged once per process).

    `addresses` are nsqd HTTP addresses in order of preference: the first takes everything while it
    answers; a failed attempt moves on to the next one (round robin) after a backoff of
    `retry_backoff * 2**attempt` seconds (at most `retry_backoff_max`, with jitter). After `max_retries`
    failed retries the batch fails with NSQUnavailableError. The broker's own limits are read once per
    connection from `/config/max_body_size` and `/config/max_msg_size` (nsqd's GET /config/:opt), so
    batches are cut to what the broker takes even when the option says more.
    """

    def __init__(self, addresses: list[str], *, max_body_size: int = DEFAULT_MAX_BODY_SIZE,
                 max_retries: int = 8, retry_backoff: float = 0.5, retry_backoff_max: float = 5.0,
                 timeout: float = 30.0, sleep=time.sleep) -> None:
        if not addresses:
            raise ValueError("no nsqd HTTP address")
        super().__init__(timeout=timeout, max_retries=max_retries, retry_backoff=retry_backoff,
                         retry_backoff_max=retry_backoff_max, sleep=sleep)
        self.addresses = [host_port(a, 4151) for a in addresses]
        self.max_body_size = max_body_size
        self._index = 0
        self._limits: tuple[int, int, bool] | None = None  # the broker's max_body_size, max_msg_size
        self._idempotent: bool | None = None  # the broker's /info idempotent_publish, read with the limits
        # figures for the commit message
        self.requests = 0
        self.retries = 0
        self.messages = 0
        self.bytes = 0

    @property
    def address(self) -> str:
        host, port = self.addresses[self._index % len(self.addresses)]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _address(self) -> tuple[str, int]:
        return self.addresses[self._index % len(self.addresses)]

    def _opened(self) -> None:
        self._limits = None  # (read again from the broker this connection goes to)
        self._idempotent = None

    # --- HTTP ------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: bytes | None = None,
                 key: str | None = None) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/octet-stream"}
        if key is not None:
            headers["Idempotency-Key"] = key
        response, data = self._send(method, path, body, headers)
        return response.status, data

    def _broker_limits(self) -> tuple[int, int, bool]:
        """(max_body_size, max_msg_size, known): the broker's, or nsqd's defaults when it does not say."""
        if self._limits is None:
            limits = []
            for name in ("max_body_size", "max_msg_size"):
                status, data = self._request("GET", f"/config/{name}")
                try:
                    limits.append(int(json.loads(data)) if status == 200 else None)
                except (ValueError, TypeError):
                    limits.append(None)
            known = None not in limits
            self._limits = (limits[0] or DEFAULT_MAX_BODY_SIZE, limits[1] or DEFAULT_MAX_MSG_SIZE, known)
        return self._limits

    def _broker_idempotent(self) -> bool:
        """Whether this broker's /info has "idempotent_publish": true (Go nsqd's has not)."""
        if self._idempotent is None:
            status, data = self._request("GET", "/info")
            try:
                info = json.loads(data) if status == 200 else {}
                info = info.get("data", info) if isinstance(info, dict) else {}
                self._idempotent = info.get("idempotent_publish") is True
            except ValueError:
                self._idempotent = False
            if not self._idempotent:
                at_least_once_once(f"nsqd {self.address} does not support Idempotency-Key (no "
                                   "idempotent_publish in its /info)")
        return self._idempotent

    # --- publishing -------------------------------------------------------------------------------

    def publish(self, topic: str, bodies: list[bytes], key: str | None = None) -> None:
        """Publish every body to `topic` (at least once; once with a key, to a broker that supports keys),
        or raise NSQRefusedError / NSQUnavailableError."""
        path = "/mpub?" + urllib.parse.urlencode({"topic": topic, "binary": "true"})
        chunks = list(split_to_fit(bodies, self.max_body_size))
        for i, chunk in enumerate(chunks):
            self._publish(topic, path, chunk, _part(key, i, len(chunks)))

    def _publish(self, topic: str, path: str, bodies: list[bytes], key: str | None = None) -> None:
        started = time.monotonic()
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.retries += 1
                delay = self._backoff(attempt)
                log.warning("nsq: publishing %d messages to %r failed (%s); retry %d/%d in %.2fs", len(bodies),
                            topic, last_error, attempt, self.max_retries, delay)
                self._sleep(delay)
            try:
                max_body, max_msg, known = self._broker_limits()
                keyed = key is not None and self._broker_idempotent()
            except (OSError, http.client.HTTPException) as exc:
                last_error = self._failed(exc)
                continue
            if mpub_size(bodies) > max_body:
                if len(bodies) > 1:
                    # the broker takes less than the option said: send what fits, one request at a time
                    chunks = list(split_to_fit(bodies, max_body))
                    for i, chunk in enumerate(chunks):
                        self._publish(topic, path, chunk, _part(key, i, len(chunks)))
                    return
                if known:  # it would answer 413, maybe before reading the body: do not send it
                    text = self._refusal(topic, bodies, 413, "BODY_TOO_BIG", max_body, max_msg, sent=False)
                    raise NSQRefusedError(text, 413, "BODY_TOO_BIG")
            self.requests += 1
            try:
                status, data = self._request("POST", path, encode_mpub_body(bodies), key if keyed else None)
            except (OSError, http.client.HTTPException) as exc:
                last_error = self._failed(exc)
                continue
            if status == 200:
                self.messages += len(bodies)
                self.bytes += sum(map(len, bodies))
                return
            code = _broker_message(data)
            if status == 413 and code == "BODY_TOO_BIG" and len(bodies) > 1:
                half = len(bodies) // 2  # a broker behind a proxy, or limits that changed: halve and go on
                self._publish(topic, path, bodies[:half], _part(key, 0, 2, "h"))
                self._publish(topic, path, bodies[half:], _part(key, 1, 2, "h"))
                return
            if 400 <= status < 500:
                raise NSQRefusedError(self._refusal(topic, bodies, status, code, max_body, max_msg), status, code)
            last_error = self._failed(f"{status} {code}")
        where = ", ".join(f"{h}:{p}" for h, p in self.addresses)
        raise NSQUnavailableError(
            f"nsq: could not publish {len(bodies)} messages to topic {topic!r}: no broker took them after "
            f"{self.max_retries + 1} attempts in {time.monotonic() - started:.1f}s (brokers: {where}; last error: "
            f"{last_error}). Check that nsqd is running there, or allow more time with the max_retries and "
            f"retry_backoff options.")

    def _failed(self, error: object) -> str:
        """After a failed attempt: drop the connection; the next attempt goes to the next broker, if any."""
        text = f"nsqd {self.address}: {repr(error) if isinstance(error, BaseException) else error}"
        self.close()
        self._index += 1
        return text

    def _refusal(self, topic: str, bodies: list[bytes], status: int, code: str, max_body: int, max_msg: int,
                 sent: bool = True) -> str:
        largest = max(map(len, bodies))
        verb = "refused" if sent else "would refuse (its /config says so; not sent)"
        text = f"nsqd {self.address} {verb} {len(bodies)} messages to topic {topic!r}: {status} {code}"
        if code in ("MSG_TOO_BIG", "BAD_MESSAGE") and largest > max_msg:
            text += (f" (a message of {largest} bytes is larger than the broker's --max-msg-size of {max_msg} "
                     "bytes: make it smaller, or raise --max-msg-size)")
        elif code == "BAD_MESSAGE" and min(map(len, bodies)) == 0:
            text += " (NSQ messages cannot be empty)"
        elif code == "BODY_TOO_BIG":
            text += (f" (a message of {largest} bytes does not fit the broker's --max-body-size of {max_body} "
                     "bytes: make it smaller, or raise --max-body-size and --max-msg-size)")
        elif code == "INVALID_TOPIC":
            text += " (topic names are 1-64 characters of [.a-zA-Z0-9_-], optionally ending in #ephemeral)"
        return text


def _part(key: str | None, i: int, n: int, kind: str = "") -> str | None:
    """The key of piece i of n of a request cut in pieces: the same cut gives the same keys."""
    return key if key is None or n == 1 else f"{key}.{kind}{i}"


def nodes_from_lookupd(lookupd_http_addresses: list[str], timeout: float = 10.0) -> list[str]:
    """nsqd HTTP addresses ("broadcast_address:http_port") from every lookupd's `/nodes`, deduplicated.
    One lookupd that does not answer is skipped (as NSQ clients do); none answering is an error."""
    nodes: list[str] = []
    errors: list[str] = []
    for address in lookupd_http_addresses:
        host, port = host_port(address, 4161)
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.request("GET", "/nodes", headers={"Accept": "application/vnd.nsq; version=1.0"})
            response = conn.getresponse()
            data = response.read()
            if response.status != 200:
                errors.append(f"{address}: {response.status} {_broker_message(data)}")
                continue
            payload = json.loads(data)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            errors.append(f"{address}: {exc!r}")
            continue
        finally:
            conn.close()
        payload = payload.get("data", payload)  # nsqlookupd before 1.0 wrapped its answers in "data"
        for producer in payload.get("producers") or []:
            host = producer["broadcast_address"]
            host = f"[{host}]" if ":" in host else host
            nodes.append(f"{host}:{producer['http_port']}")
    if errors and len(errors) == len(lookupd_http_addresses):
        raise NSQUnavailableError(f"nsq: no lookupd answered /nodes ({'; '.join(errors)}); "
                                  "check the lookupd_http_address option")
    for error in errors:
        log.warning("nsq: lookupd %s did not answer /nodes", error)
    return list(dict.fromkeys(nodes))
