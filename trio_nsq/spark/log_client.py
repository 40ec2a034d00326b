"""A small synchronous client for trio-nsqd's log API (`/log/*`: a topic's log read by position), and the
discovery of the brokers that hold a topic. Plain Python (http.client), so the positional reader's driver
side and its executor tasks need nothing beyond the package.

Who calls it: positional.py. The stream reader's driver process asks for positions and commits the
cursor (`positions`, `position_at`, `position_after`, `splits`, `role`, `commit`); an executor task reads
its range (`read`).

Errors are split the way the reader needs them:

- `LogAPIError`: the broker answered with an error (`status` and NSQ's message `code`, e.g. 404
  POSITION_GONE, 409 LOG_ID_MISMATCH, 404 TOPIC_NOT_FOUND). Asking again would give the same answer;
  the reader turns the code into what a Spark user can act on.
- `LogUnavailableError`: the broker did not answer (connection refused, reset, timeout, 5xx) after every
  retry: a broker down for a restart, not a loss of data.

The answers and their headers are the broker's (trio_nsq/broker/http/log_api.py); a range of a log reads
the same every time, which is what makes a Spark task run again read the same rows.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from trio_nsq.shared.addresses import join_host_port
from trio_nsq.spark.publisher import KeptConnection, _broker_message, host_port

log = logging.getLogger("trio_nsq.spark")


class LogAPIError(RuntimeError):
    """The broker answered a /log request with an error: `status` (HTTP) and `code` (its message, as
    POSITION_GONE); `address` and `request` say where and what."""

    def __init__(self, address: str, request: str, status: int, code: str) -> None:
        super().__init__(f"nsqd {address} answered {status} {code} to {request}")
        self.address = address
        self.request = request
        self.status = status
        self.code = code


class LogUnavailableError(ConnectionError):
    """The broker did not answer a /log request (connection refused, timeout, 5xx), after every retry."""

    def __init__(self, address: str, request: str, error: str) -> None:
        super().__init__(f"nsqd {address} did not answer {request} ({error})")
        self.address = address


@dataclass(frozen=True)
class Positions:
    """GET /log/positions: the log's first record kept and its durable tail."""

    log_id: str
    first: int
    first_index: int
    end: int
    end_index: int
    first_timestamp: int | None  # ns


@dataclass(frozen=True)
class Position:
    """GET /log/position: a record boundary and its index (record number)."""

    log_id: str
    position: int
    index: int


@dataclass(frozen=True)
class ReadResult:
    """GET /log/read: `records` records starting at `position`, in `body` as the broker sent it: the
    records (`records_bytes` bytes), then (records + 1) int32 LE start offsets, then `deadlines` entries
    of (position int64 LE, deadline ms int64 LE)."""

    log_id: str
    position: int
    next_position: int
    first_index: int
    records: int
    records_bytes: int
    deadlines: int
    end: int
    body: bytes

    def check(self, address: str) -> None:
        """The body has the size its headers announce (a cut answer must not become rows)."""
        expected = self.records_bytes + 4 * (self.records + 1) + 16 * self.deadlines
        if len(self.body) != expected:
            raise LogUnavailableError(address, f"/log/read at {self.position}",
                                      f"a body of {len(self.body)} bytes, {expected} announced")


def normal_address(address: str, default_port: int = 4151) -> str:
    """'http://host:4151/', 'host:4151' or 'host' -> 'host:4151' (the key of a broker in the offsets)."""
    host, port = host_port(address, default_port)
    return join_host_port(host, port)


class LogClient(KeptConnection):
    """One broker's /log API over one kept-alive HTTP/1.1 connection. A request that fails to get an
    answer (connection refused or reset, timeout, 5xx) is tried again `max_retries` times after
    `retry_backoff * 2**attempt` seconds (at most `retry_backoff_max`, with jitter); every /log request is
    safe to send again (reads, and a commit that sets the cursor to a position). Not thread-safe: one
    client per thread."""

    def __init__(self, address: str, *, timeout: float = 30.0, max_retries: int = 8, retry_backoff: float = 0.5,
                 retry_backoff_max: float = 5.0, sleep=time.sleep) -> None:
        super().__init__(timeout=timeout, max_retries=max_retries, retry_backoff=retry_backoff,
                         retry_backoff_max=retry_backoff_max, sleep=sleep)
        self.address = normal_address(address)
        self._host, self._port = host_port(address, 4151)

    def _address(self) -> tuple[str, int]:
        return self._host, self._port

    # --- HTTP ------------------------------------------------------------------------------------

    def request(self, method: str, endpoint: str, **params: Any) -> tuple[dict[str, str], bytes]:
        """`method endpoint?params` -> (headers, body) of a 200; LogAPIError for a 4xx answer,
        LogUnavailableError once every retry failed."""
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        path = f"{endpoint}?{query}"
        error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self._sleep(self._backoff(attempt))
            try:
                response, data = self._send(method, path, None, {"Accept": "application/json"})
            except (OSError, http.client.HTTPException) as exc:
                error = repr(exc)
                continue
            status = response.status
            if status == 200:
                return {k.lower(): v for k, v in response.getheaders()}, data
            if status < 500:
                raise LogAPIError(self.address, f"{method} {path}", status, _broker_message(data))
            error = f"{status} {_broker_message(data)}"
        raise LogUnavailableError(self.address, f"{method} {path}", error)

    def _json(self, method: str, endpoint: str, **params: Any) -> dict:
        _, data = self.request(method, endpoint, **params)
        try:
            payload = json.loads(data)
            if isinstance(payload, dict) and "status_code" in payload and "data" in payload:
                payload = payload["data"]  # nsqd's v1 envelope, should a proxy ask for it
            if not isinstance(payload, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            raise LogUnavailableError(self.address, f"{method} {endpoint}", f"an unreadable answer: {exc}") from None
        return payload

    # --- the log API -------------------------------------------------------------------------------

    def positions(self, topic: str) -> Positions:
        p = self._json("GET", "/log/positions", topic=topic)
        return Positions(str(p["log_id"]), int(p["first"]), int(p["first_index"]), int(p["end"]),
                         int(p["end_index"]), None if p.get("first_timestamp") is None else int(p["first_timestamp"]))

    def position_at(self, topic: str, timestamp_ms: int) -> Position:
        """The first record published at or after `timestamp_ms` (the log's end when none is)."""
        p = self._json("GET", "/log/position", topic=topic, timestamp=timestamp_ms)
        return Position(str(p["log_id"]), int(p["position"]), int(p["index"]))

    def position_after(self, topic: str, start: int, records: int | None = None,
                       max_bytes: int | None = None) -> Position:
        """The record boundary after at most `records` records and `max_bytes` bytes from `start` (at least
        one record when there is one); without either, `start` itself, checked, with its index."""
        p = self._json("GET", "/log/position", topic=topic, **{"from": start}, records=records, bytes=max_bytes)
        return Position(str(p["log_id"]), int(p["position"]), int(p["index"]))

    def splits(self, topic: str, start: int, end: int, parts: int) -> tuple[str, list[int]]:
        """Up to parts - 1 record boundaries strictly between start and end, cutting it in similar sizes."""
        p = self._json("GET", "/log/splits", topic=topic, start=start, end=end, parts=parts)
        return str(p["log_id"]), [int(x) for x in p["positions"]]

    def read(self, topic: str, position: int, end: int | None = None, max_bytes: int | None = None,
             log_id: str | None = None) -> ReadResult:
        headers, body = self.request("GET", "/log/read", topic=topic, position=position, end=end,
                                     max_bytes=max_bytes, log_id=log_id)
        try:
            result = ReadResult(
                log_id=headers["x-nsq-log-id"], position=int(headers["x-nsq-position"]),
                next_position=int(headers["x-nsq-next-position"]), first_index=int(headers["x-nsq-first-index"]),
                records=int(headers["x-nsq-records"]), records_bytes=int(headers["x-nsq-records-bytes"]),
                deadlines=int(headers.get("x-nsq-deadlines", "0")), end=int(headers["x-nsq-end"]), body=body)
        except (KeyError, ValueError) as exc:
            raise LogUnavailableError(self.address, f"/log/read at {position}",
                                      f"an answer without its headers ({exc!r})") from None
        result.check(self.address)
        return result

    def role(self, topic: str) -> str | None:
        """Cluster mode (issue 52): the broker's role for the topic ("leader", "follower"; its /stats'
        "replication" key), or None (not replicated, or no such topic)."""
        p = self._json("GET", "/stats", format="json", topic=topic, include_clients="false")
        for t in p.get("topics") or []:
            if isinstance(t, dict) and t.get("topic_name") == topic and isinstance(t.get("replication"), dict):
                return str(t["replication"].get("role"))
        return None

    def commit(self, topic: str, channel: str, position: int, log_id: str | None = None) -> dict:
        """Move the durable cursor `channel` to `position`: every record before it is finished."""
        return self._json("POST", "/log/commit", topic=topic, channel=channel, position=position, log_id=log_id)


def lookup_http_addresses(lookupds: tuple[str, ...] | list[str], topic: str,
                          timeout: float = 10.0) -> tuple[list[str], list[str]]:
    """(the HTTP addresses "broadcast_address:http_port" of the brokers lookupd lists for `topic`, over
    every lookupd that answers; the lookupds that did not answer, with why). A lookupd that does not
    know the topic (404) lists none."""
    found: list[str] = []
    failed: list[str] = []
    for lookupd in lookupds:
        host, port = host_port(lookupd, 4161)
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.request("GET", "/lookup?" + urllib.parse.urlencode({"topic": topic}),
                         headers={"Accept": "application/vnd.nsq; version=1.0"})
            response = conn.getresponse()
            data = response.read()
            if response.status == 404:
                continue
            if response.status != 200:
                failed.append(f"{lookupd}: {response.status} {_broker_message(data)}")
                continue
            payload = json.loads(data)
            payload = payload.get("data", payload)  # lookupd before 1.0 wrapped its answers in "data"
            for producer in payload.get("producers") or []:
                found.append(join_host_port(str(producer["broadcast_address"]), int(producer["http_port"])))
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError, AttributeError) as exc:
            failed.append(f"{lookupd}: {exc!r}")
        finally:
            conn.close()
    return list(dict.fromkeys(found)), failed


def tcp_address_of(http_address: str, timeout: float = 10.0) -> str:
    """The TCP address of the nsqd at `http_address`: its host, and the tcp_port its /info tells (for
    the channel source, when the options name brokers by their HTTP address)."""
    host, port = host_port(http_address, 4151)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/info", headers={"Accept": "application/vnd.nsq; version=1.0"})
        response = conn.getresponse()
        data = response.read()
        info = json.loads(data) if response.status == 200 else {}
        info = info.get("data", info) if isinstance(info, dict) else {}
        return join_host_port(host, int(info["tcp_port"]))
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as exc:
        raise LogUnavailableError(normal_address(http_address), "GET /info", repr(exc)) from None
    finally:
        conn.close()
