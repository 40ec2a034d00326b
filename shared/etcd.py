"""A small etcd v3 client for Trio, over etcd's JSON gateway (`POST /v3/kv/range` ...), with httpx.

Used by cluster mode (trio-nsqd --etcd-endpoints=...): the broker's registration under a lease, and
the topics' states, every change a compare-and-swap on the key's mod_revision (no locks: etcd's locks
are not mutual exclusion, Jepsen found). Only what that needs:

    etcd = Etcd(["http://127.0.0.1:2379"], timeout=2.0)
    kv = await etcd.get("/trio-nsq/topics/t")               # KeyValue | None
    ok = await etcd.create(key, value, lease=lease)         # only if absent
    ok = await etcd.swap(key, value, kv.mod_revision)       # only if unchanged since read
    async with contextlib.aclosing(etcd.watch_prefix(prefix, revision + 1)) as events:
        async for batch in events: ...                      # list of KeyValue | Deleted
    await etcd.aclose()

Keys are str (UTF-8), values bytes; both travel base64 in the JSON. httpx is imported on first use (in
a thread), so a broker without cluster mode never loads it.

Failures: every request is bounded by `timeout`; with several endpoints, one that cannot be reached is
skipped for the next, each tried at most once per call, then EtcdError says what each one did. A
request that may have reached etcd (the connection broke or timed out after sending) is only sent again
elsewhere when repeating it is harmless (reads, put, keepalive, revoke, delete); a transaction or a
lease grant is not: EtcdError, "outcome unknown", and the caller re-reads (a CAS retried blindly could
answer False for its own success). Errors etcd answers (a bad lease, ...) raise EtcdError at once.
So an EtcdError from create, swap or delete_if means "maybe": read the key again before deciding.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import trio

from trio_nsq.shared.http import httpx_module

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("nsqd")

# a watch stream with nothing to say for this long is reopened (at the next revision): a member that
# hangs (stopped, partitioned) shows up as a failed reopen instead of a stream silent forever
WATCH_IDLE = 10.0
# between a broken watch stream and its reopening: a member that takes watches and drops them at once
# costs a request every so often, not a busy loop
WATCH_REOPEN_DELAY = 0.1
# one watch response's size bound; etcd's own request limit is 1.5 MiB, a response a few of those
MAX_WATCH_LINE = 16 * 1024 * 1024


class EtcdError(Exception):
    """An answer we cannot use, an error etcd answered, or every endpoint failed (the message says which)."""


@attrs.frozen
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


@attrs.frozen
class Deleted:
    """A watch event: `key` was deleted (or its lease expired) at `mod_revision`."""

    key: str
    mod_revision: int


class _Unsent(Exception):
    """This endpoint did not take the request (no connection, or it is unavailable): the next may."""


class _Unknown(Exception):
    """The request may or may not have reached etcd (sent, then the connection failed or timed out)."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: object) -> bytes:
    if not isinstance(text, str):
        raise EtcdError(f"expected base64 text, got {text!r:.80}")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise EtcdError(f"bad base64 from etcd: {text!r:.80}") from None


def _int(obj: dict[str, Any], name: str) -> int:
    """An int64 field: proto3 JSON writes them as strings and leaves out zeros."""
    value = obj.get(name, 0)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise EtcdError(f"bad {name} from etcd: {value!r:.80}") from None


def _dict(obj: object, what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise EtcdError(f"bad {what} from etcd: {obj!r:.80}")
    return obj


def _key_value(obj: object) -> KeyValue:
    kv = _dict(obj, "key-value")
    try:
        key = _unb64(kv.get("key")).decode()
    except UnicodeDecodeError:
        raise EtcdError(f"key not UTF-8 from etcd: {kv.get('key')!r:.80}") from None
    value = _unb64(kv["value"]) if "value" in kv else b""  # an empty value is left out
    return KeyValue(key, value, _int(kv, "mod_revision"), _int(kv, "create_revision"), _int(kv, "lease"))


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that makes [prefix, end) every key starting with prefix (etcd's clientv3.GetPrefixRangeEnd)."""
    for i in range(len(prefix) - 1, -1, -1):
        if prefix[i] < 0xFF:
            return prefix[:i] + bytes([prefix[i] + 1])
    return b"\0"  # all 0xff (or empty): every key from prefix on


class Etcd:
    """One broker's connection to an etcd cluster (the replication's registry and topic states use it).

    Not for concurrent aclose(): calls may run concurrently from many tasks (httpx's pool is shared)."""

    def __init__(self, endpoints: Sequence[str], *, timeout: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout = timeout
        self._current = 0  # the endpoint that answered last: tried first
        self._client: httpx.AsyncClient | None = None
        self._httpx: Any = None

    async def _get_client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._httpx = await httpx_module()
            if self._client is None:  # another task got here first while we imported
                # trust_env off: an HTTP_PROXY in the environment must not reroute the cluster's own traffic
                self._client = self._httpx.AsyncClient(timeout=self.timeout, trust_env=False)
        assert self._client is not None
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    # -- requests -----------------------------------------------------------------------------------

    async def _post(self, path: str, body: dict[str, Any], *, repeatable: bool) -> dict[str, Any]:
        """POST body to path on the current endpoint, then the others; the answer's JSON object."""
        client = await self._get_client()
        failures: list[str] = []
        n = len(self.endpoints)
        for i in range(n):
            index = (self._current + i) % n
            endpoint = self.endpoints[index]
            try:
                answer = await self._post_one(client, endpoint + path, body)
            except _Unsent as exc:
                failures.append(f"{endpoint}: {exc}")
            except _Unknown as exc:
                if not repeatable:
                    raise EtcdError(f"{path} to {endpoint}: {exc} (outcome unknown)") from None
                failures.append(f"{endpoint}: {exc}")
            else:
                if index != self._current:
                    log.warning("ETCD: using %s (%s)", endpoint, "; ".join(failures))
                    self._current = index
                return answer
        raise EtcdError(f"{path}: every etcd endpoint failed: {'; '.join(failures)}")

    async def _post_one(self, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
        httpx = self._httpx
        # httpx's timeout bounds each read or write; this one bounds the whole request
        with trio.move_on_after(self.timeout) as scope:
            try:
                response = await client.post(url, json=body)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                raise _Unsent(f"{type(exc).__name__}: {exc}") from None
            except httpx.HTTPError as exc:
                raise _Unknown(f"{type(exc).__name__}: {exc}") from None
        if scope.cancelled_caught:
            raise _Unknown(f"no answer in {self.timeout}s")
        try:
            answer = response.json()
        except ValueError:
            raise EtcdError(f"{url}: HTTP {response.status_code}, not JSON: {response.text!r:.200}") from None
        if not isinstance(answer, dict):
            raise EtcdError(f"{url}: HTTP {response.status_code}, not a JSON object: {response.text!r:.200}")
        if response.status_code == 503:
            # gRPC Unavailable: "no leader" and "too many requests", but also "request timed out" and
            # "leader changed", after which the proposal may still be applied: not a definite failure
            raise _Unknown(f"HTTP 503 {answer.get('message', '')}")
        if response.status_code != 200:
            raise EtcdError(f"{url}: HTTP {response.status_code} {answer.get('message', response.text)!r:.200}")
        return answer

    # -- KV -----------------------------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        answer = await self._post("/v3/kv/range", {"key": _b64(key.encode())}, repeatable=True)
        kvs = answer.get("kvs") or []
        if not isinstance(kvs, list):
            raise EtcdError(f"bad kvs from etcd: {kvs!r:.80}")
        return _key_value(kvs[0]) if kvs else None

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key starting with prefix, sorted by key, and the store's revision they are as of
        (a watch from that revision + 1 misses nothing)."""
        raw = prefix.encode()
        answer = await self._post("/v3/kv/range", {"key": _b64(raw), "range_end": _b64(prefix_end(raw))},
                                  repeatable=True)
        kvs = answer.get("kvs") or []
        if not isinstance(kvs, list):
            raise EtcdError(f"bad kvs from etcd: {kvs!r:.80}")
        return [_key_value(kv) for kv in kvs], _int(_dict(answer.get("header"), "header"), "revision")

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Set key to value (attached to `lease` if not 0); the store's revision after it."""
        body: dict[str, Any] = {"key": _b64(key.encode()), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        answer = await self._post("/v3/kv/put", body, repeatable=True)
        return _int(_dict(answer.get("header"), "header"), "revision")

    async def _txn(self, compare: dict[str, Any], success: dict[str, Any]) -> bool:
        answer = await self._post("/v3/kv/txn", {"compare": [compare], "success": [success]}, repeatable=False)
        succeeded = answer.get("succeeded", False)  # proto3 JSON leaves a false out
        if not isinstance(succeeded, bool):
            raise EtcdError(f"bad txn answer from etcd: {answer!r:.200}")
        return succeeded

    async def create(self, key: str, value: bytes, *, lease: int = 0) -> bool:
        """Set key only if it does not exist (create_revision == 0); whether it was set."""
        k = _b64(key.encode())
        put: dict[str, Any] = {"key": k, "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        return await self._txn({"key": k, "target": "CREATE", "create_revision": "0", "result": "EQUAL"},
                               {"request_put": put})

    async def swap(self, key: str, value: bytes, mod_revision: int) -> bool:
        """Compare-and-swap: set key only if its mod_revision is still `mod_revision`; whether it was set.
        The key is left without a lease (as any put without one: topic states have none)."""
        k = _b64(key.encode())
        return await self._txn({"key": k, "target": "MOD", "mod_revision": str(mod_revision), "result": "EQUAL"},
                               {"request_put": {"key": k, "value": _b64(value)}})

    async def delete_if(self, key: str, mod_revision: int) -> bool:
        """Delete key only if its mod_revision is still `mod_revision`; whether it was deleted."""
        k = _b64(key.encode())
        return await self._txn({"key": k, "target": "MOD", "mod_revision": str(mod_revision), "result": "EQUAL"},
                               {"request_delete_range": {"key": k}})

    async def delete(self, key: str) -> None:
        await self._post("/v3/kv/deleterange", {"key": _b64(key.encode())}, repeatable=True)

    # -- leases -------------------------------------------------------------------------------------

    async def grant(self, ttl: int) -> int:
        """A new lease of `ttl` seconds; its id."""
        answer = await self._post("/v3/lease/grant", {"TTL": str(ttl)}, repeatable=False)
        if answer.get("error"):
            raise EtcdError(f"lease grant refused: {answer['error']!r:.200}")
        lease = _int(answer, "ID")
        if lease == 0:
            raise EtcdError(f"lease grant without an ID: {answer!r:.200}")
        return lease

    async def keepalive(self, lease: int) -> int:
        """Renew the lease; its TTL from now, in seconds: 0 or less when it had expired (or never existed).
        The caller's deadline is when it *sent* this + the TTL (the answer may come late)."""
        answer = await self._post("/v3/lease/keepalive", {"ID": str(lease)}, repeatable=True)
        # a stream RPC through the gateway: the answer is wrapped in {"result": ...} (or {"error": ...})
        if "error" in answer:
            raise EtcdError(f"lease keepalive refused: {answer['error']!r:.200}")
        return _int(_dict(answer.get("result"), "keepalive answer"), "TTL")

    async def revoke(self, lease: int) -> None:
        """Revoke the lease (its keys are deleted); a lease already gone is no error."""
        try:
            await self._post("/v3/lease/revoke", {"ID": str(lease)}, repeatable=True)
        except EtcdError as exc:
            if "lease not found" not in str(exc):
                raise

    # -- watch --------------------------------------------------------------------------------------

    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncGenerator[list[KeyValue | Deleted], None]:
        """Every change to a key starting with prefix from `start_revision` on, in revision order, in
        the batches etcd sends (the events of one revision are never split between two). Built on the streaming `/v3/watch` (httpx streaming), reopened
        at the next revision when it breaks or stays silent WATCH_IDLE seconds; EtcdError when no
        endpoint takes it back, or when start_revision was compacted away (then: get_prefix again).

        An async generator: close it (contextlib.aclosing) rather than leaving it to the garbage collector.
        (httpx's own generators under it are still left to trio's finalizer: a ResourceWarning, hidden
        by default; the connection itself is closed with the stream.)"""
        client = await self._get_client()
        httpx = self._httpx
        raw = prefix.encode()
        next_revision = start_revision
        failures: list[str] = []
        while True:
            request = {"create_request": {"key": _b64(raw), "range_end": _b64(prefix_end(raw)),
                                          "start_revision": str(next_revision)}}
            endpoint = self.endpoints[self._current]
            created = False
            try:
                async with client.stream("POST", endpoint + "/v3/watch", json=request,
                                         timeout=httpx.Timeout(self.timeout, read=WATCH_IDLE)) as response:
                    if response.status_code != 200:
                        body = await response.aread()
                        raise EtcdError(f"watch on {endpoint}: HTTP {response.status_code} {body[:200]!r}")
                    async with contextlib.aclosing(_lines(response, endpoint)) as messages:
                        async for line in messages:
                            result = _watch_result(line)
                            if result.get("canceled"):
                                compacted = _int(result, "compact_revision")
                                if compacted:
                                    raise EtcdError(f"watch from revision {next_revision}: compacted up to {compacted}")
                                raise EtcdError(f"watch canceled by etcd: {result.get('cancel_reason', '')!r:.200}")
                            if result.get("created"):
                                created = True
                                failures.clear()  # this endpoint works: a later break gets every endpoint again
                            batch = _watch_events(result)
                            if batch:
                                next_revision = max(next_revision, batch[-1].mod_revision + 1)
                                yield batch
            except httpx.ReadTimeout as exc:
                if created:
                    continue  # an open stream silent for WATCH_IDLE: reopen it (a hung member fails to)
                failures.append(f"{endpoint}: {type(exc).__name__}: {exc}")
            except httpx.HTTPError as exc:
                failures.append(f"{endpoint}: {type(exc).__name__}: {exc}")
            else:
                failures.append(f"{endpoint}: the watch stream ended")
            # since the last stream that opened: each endpoint once, and the one that broke once more
            if len(failures) > len(self.endpoints):
                raise EtcdError(f"watch: every etcd endpoint failed: {'; '.join(failures)}")
            self._current = (self._current + 1) % len(self.endpoints)
            log.warning("ETCD: watch reopens on %s (%s)", self.endpoints[self._current], failures[-1])
            await trio.sleep(WATCH_REOPEN_DELAY)


async def _lines(response: httpx.Response, endpoint: str) -> AsyncGenerator[bytes, None]:
    """The stream's non-empty lines (one JSON message each), none longer than MAX_WATCH_LINE: httpx's
    aiter_lines() would buffer a line without end."""
    buffer = bytearray()
    async for chunk in response.aiter_bytes():
        buffer += chunk
        while (end := buffer.find(b"\n")) >= 0:
            line = bytes(buffer[:end]).strip()
            del buffer[:end + 1]
            if line:
                yield line
        if len(buffer) > MAX_WATCH_LINE:
            raise EtcdError(f"watch on {endpoint}: an answer longer than {MAX_WATCH_LINE} bytes")
    if buffer.strip():
        yield bytes(buffer).strip()


def _watch_result(line: bytes) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except ValueError:
        raise EtcdError(f"watch: not JSON from etcd: {line!r:.200}") from None
    message = _dict(message, "watch message")
    if "error" in message:
        raise EtcdError(f"watch: etcd error {message['error']!r:.200}")
    return _dict(message.get("result"), "watch result")


def _watch_events(result: dict[str, Any]) -> list[KeyValue | Deleted]:
    events = result.get("events") or []
    if not isinstance(events, list):
        raise EtcdError(f"bad watch events from etcd: {events!r:.80}")
    out: list[KeyValue | Deleted] = []
    for event in events:
        event = _dict(event, "watch event")
        kv = _key_value(event.get("kv"))
        if event.get("type") == "DELETE":  # PUT, the default, is left out
            out.append(Deleted(kv.key, kv.mod_revision))
        else:
            out.append(kv)
    return out
