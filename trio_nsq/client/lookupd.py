"""Discovery: the brokers that have a topic, from nsqlookupd's /lookup."""

from __future__ import annotations

import logging
import urllib.parse
from typing import TYPE_CHECKING

from trio_nsq.shared.addresses import join_host_port

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("trio_nsq.client")


def lookup_url(address: str, topic: str) -> str:
    """The URL that asks lookupd at `address` for `topic`, built as go-nsq and pynsq build it: "host:port"
    is http://host:port; a URL keeps its scheme, host, path and query; an empty path (or "/") becomes
    /lookup; `topic=` is added to the query. Raises ValueError for an address with neither a scheme nor
    a port (go-nsq's "missing port": lookupd's 4161 is not guessed)."""
    parts = urllib.parse.urlsplit(address if "://" in address else f"http://{address}")
    try:
        port = parts.port
    except ValueError as exc:  # a port that is not a number
        raise ValueError(f"lookupd address {address!r}: {exc}") from None
    if not parts.hostname:
        raise ValueError(f"lookupd address {address!r}: no host")
    if port is None and "://" not in address:
        raise ValueError(f"lookupd address {address!r}: missing port")
    path = parts.path if parts.path not in ("", "/") else "/lookup"
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True) + [("topic", topic)]
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, urllib.parse.urlencode(query), ""))


async def lookup_producers(client: httpx.AsyncClient, lookupd_http_address: str, topic: str, *,
                           auth_secret: bytes | str | None = None) -> list[str] | None:
    """TCP addresses ("host:port") of the brokers lookupd knows for `topic`.

    [] when lookupd does not know the topic (404 TOPIC_NOT_FOUND); None when lookupd could not be asked
    (an invalid address, unreachable, or an answer that is not a lookup: another 404 is a wrong path,
    not an empty topic), so the caller keeps what it already has. `auth_secret` goes as
    `Authorization: Bearer <secret>`, as go-nsq sends its AuthSecret (LookupdAuthorization).
    """
    import httpx  # loaded by the caller already: only consumers that use lookupd pay for it

    try:
        url = lookup_url(lookupd_http_address, topic)
    except ValueError as exc:
        log.warning("LOOKUPD: %s", exc)
        return None
    headers = {"Accept": "application/vnd.nsq; version=1.0"}
    if auth_secret:
        secret = auth_secret.decode() if isinstance(auth_secret, bytes) else auth_secret
        headers["Authorization"] = f"Bearer {secret}"
    try:
        response = await client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        log.warning("LOOKUPD: %s unreachable - %s", lookupd_http_address, exc)
        return None
    if response.status_code == 404 and _message(response) == "TOPIC_NOT_FOUND":
        return []
    if response.status_code != 200:
        log.warning("LOOKUPD: %s answered %d %s", url, response.status_code, response.text[:200].strip())
        return None
    try:
        data = response.json()
        data = data.get("data", data)  # lookupd before 1.0 wrapped answers in {"status_code", "data"}
        return [join_host_port(p["broadcast_address"], int(p["tcp_port"])) for p in data.get("producers") or []]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("LOOKUPD: %s answered an unreadable lookup - %s", lookupd_http_address, exc)
        return None


def _message(response: httpx.Response) -> str:
    """lookupd's error text: {"message": ...} (1.0 and later) or {"status_txt": ...} (before)."""
    try:
        data = response.json()
    except ValueError:
        return ""
    return str(data.get("message") or data.get("status_txt") or "") if isinstance(data, dict) else ""
