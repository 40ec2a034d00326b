"""Addresses as NSQ writes them: `host:port`, `[::1]:port`, or a path for a unix socket.

Pure functions with no imports beyond the standard library: the client, the daemons and the tools all
use them, and importing the client must not load the servers' HTTP stack (shared/http.py).
"""

from __future__ import annotations


def split_host_port(address: str, default_host: str = "0.0.0.0") -> tuple[str, int]:
    """'127.0.0.1:4151', ':4151', '[::1]:4151' -> (host, port). Raises ValueError without a port."""
    host, sep, port = address.rpartition(":")
    if not sep:
        raise ValueError(f"address {address!r} has no port")
    host = host.strip("[]") or default_host
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    """Go's net.JoinHostPort: an IPv6 host goes in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_unix_address(address: str) -> bool:
    """nsqd's TypeOfAddr: what is not host:port is a path for a unix socket."""
    host, sep, port = address.rpartition(":")
    return not (sep and port.isdigit())


def address_text(host: str, port: int) -> str:
    """A bound address as nsqd logs it: host:port, or the unix socket's path."""
    return host if is_unix_address(host) and port == 0 and host.startswith(("/", ".")) else join_host_port(host, port)
