"""Discovery: the brokers that have a topic, from nsqlookupd's /lookup."""

from __future__ import annotations

import logging

import httpx

log = logging.getLogger("trio_nsq.client")


async def lookup_producers(client: httpx.AsyncClient, lookupd_http_address: str, topic: str) -> list[str]:
    """TCP addresses ("host:port") of the brokers lookupd knows for `topic`; [] if none or unreachable."""
    base = lookupd_http_address if "://" in lookupd_http_address else f"http://{lookupd_http_address}"
    try:
        response = await client.get(f"{base}/lookup", params={"topic": topic},
                                    headers={"Accept": "application/vnd.nsq; version=1.0"})
    except httpx.HTTPError as exc:
        log.warning("LOOKUPD: %s unreachable - %s", lookupd_http_address, exc)
        return []
    if response.status_code == 404:
        return []
    if response.status_code != 200:
        log.warning("LOOKUPD: %s answered %d", lookupd_http_address, response.status_code)
        return []
    data = response.json()
    data = data.get("data", data)  # old lookupds wrap answers in {"status_code", "data"}
    return [f"{p['broadcast_address']}:{p['tcp_port']}" for p in data.get("producers", [])]
