"""AUTH: asking an auth server what a client may do (nsqd's internal/auth).

The server is queried with the client's remote_ip, tls, secret and common_name and answers
{"ttl", "identity", "identity_url", "authorizations": [{"topic", "channels", "permissions"}]}, the topic
and channels being regular expressions matched anywhere in the name (Go's MatchString).
"""

from __future__ import annotations

import json
import random
import re
import time
import urllib.parse

import attrs

from trio_nsq.shared.http import httpx_module

ACCEPT = "application/vnd.nsq; version=1.0"


class AuthError(Exception):
    pass


@attrs.frozen
class Authorization:
    topic: re.Pattern
    channels: tuple[re.Pattern, ...]
    permissions: frozenset[str]

    def is_allowed(self, topic: str, channel: str) -> bool:
        if ("subscribe" if channel else "publish") not in self.permissions:
            return False
        if not self.topic.search(topic):
            return False
        return any(c.search(channel) for c in self.channels)


@attrs.frozen
class AuthState:
    identity: str
    identity_url: str
    ttl: int
    authorizations: tuple[Authorization, ...]
    expires: float

    def is_allowed(self, topic: str, channel: str = "") -> bool:
        return any(a.is_allowed(topic, channel) for a in self.authorizations)

    def is_expired(self) -> bool:
        return self.expires < time.monotonic()


def parse_auth_response(body: bytes) -> AuthState:
    try:
        raw = json.loads(body)
        authorizations = []
        for item in raw.get("authorizations") or []:
            permissions = frozenset(item.get("permissions") or [])
            unknown = permissions - {"subscribe", "publish"}
            if unknown:
                raise AuthError(f"unknown permission {sorted(unknown)[0]}")
            try:
                topic = re.compile(item.get("topic", ""))
                channels = tuple(re.compile(c) for c in item.get("channels") or [])
            except re.error as exc:
                raise AuthError(f"unable to compile regex - {exc}") from None
            authorizations.append(Authorization(topic, channels, permissions))
        ttl = int(raw.get("ttl", 0))
    except (ValueError, TypeError, AttributeError) as exc:
        raise AuthError(f"invalid auth response - {exc}") from None
    if ttl <= 0:
        raise AuthError(f"invalid TTL {ttl} (must be >0)")
    return AuthState(
        identity=str(raw.get("identity", "")),
        identity_url=str(raw.get("identity_url", "")),
        ttl=ttl,
        authorizations=tuple(authorizations),
        expires=time.monotonic() + ttl,
    )


async def query_any_authd(
    addresses: list[str], remote_ip: str, tls: bool, common_name: str, secret: str, *,
    method: str = "get", connect_timeout: float = 2.0, request_timeout: float = 5.0,
) -> AuthState:
    """Ask the auth servers in turn, starting at a random one, until one answers."""
    values = {"remote_ip": remote_ip, "tls": "true" if tls else "false", "secret": secret, "common_name": common_name}
    errors = []
    start = random.randrange(len(addresses))
    httpx = await httpx_module()
    timeout = httpx.Timeout(request_timeout, connect=connect_timeout)
    async with httpx.AsyncClient(timeout=timeout) as client:
        for i in range(len(addresses)):
            address = addresses[(start + i) % len(addresses)]
            endpoint = address if "://" in address else f"http://{address}/auth"
            try:
                if method.lower() == "post":
                    body = json.dumps({k: [v] for k, v in values.items()})
                    response = await client.post(endpoint, content=body, headers={
                        "Accept": ACCEPT, "Content-Type": "application/json"})
                else:
                    response = await client.get(f"{endpoint}?{urllib.parse.urlencode(values)}",
                                                headers={"Accept": ACCEPT})
                if response.status_code != 200:
                    raise AuthError(f"got response {response.status_code} {response.text!r}")
                return parse_auth_response(response.content)
            except (httpx.HTTPError, AuthError) as exc:
                errors.append(f"failed to auth against {address} - {exc}")
    raise AuthError("; ".join(errors))
