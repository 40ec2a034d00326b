"""Discovery: the brokers that have a topic, from nsqlookupd's /lookup."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from trio_nsq.shared.addresses import join_host_port

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("trio_nsq.client")


def lookupd_url(address: str) -> str:
    return address.rstrip("/") if "://" in address else f"http://{address}"


async def lookup_producers(client: httpx.AsyncClient, lookupd_http_address: str, topic: str) -> list[str] | None:
    """TCP addresses ("host:port") of the brokers lookupd knows for `topic`.

    [] when lookupd does not know the topic (404 TOPIC_NOT_FOUND); None when lookupd could not be asked
    (unreachable, or an answer that is not a lookup), so the caller keeps what it already has.
    """
    import httpx  # loaded by the caller already: only consumers that use lookupd pay for it

    try:
        response = await client.get(f"{lookupd_url(lookupd_http_address)}/lookup", params={"topic": topic},
                                    headers={"Accept": "application/vnd.nsq; version=1.0"})
    except httpx.HTTPError as exc:
        log.warning("LOOKUPD: %s unreachable - %s", lookupd_http_address, exc)
        return None
    if response.status_code == 404:
        return []
    if response.status_code != 200:
        log.warning("LOOKUPD: %s answered %d %s", lookupd_http_address, response.status_code, response.text[:200])
        return None
    try:
        data = response.json()
        data = data.get("data", data)  # lookupd before 1.0 wrapped answers in {"status_code", "data"}
        return [join_host_port(p["broadcast_address"], int(p["tcp_port"])) for p in data.get("producers") or []]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("LOOKUPD: %s answered an unreadable lookup - %s", lookupd_http_address, exc)
        return None
