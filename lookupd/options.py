"""nsqlookupd's options: flag names, TOML keys and defaults as Go nsqlookupd has them."""

from __future__ import annotations

import socket

import attrs

from shared.options import load_options, option


@attrs.define
class Options:
    log_level: str = option("info", "set log verbosity: debug, info, warn, error, or fatal")
    log_prefix: str = option("[nsqlookupd] ", "log message prefix")
    tcp_address: str = option("0.0.0.0:4160", "<addr>:<port> to listen on for TCP clients")
    http_address: str = option("0.0.0.0:4161", "<addr>:<port> to listen on for HTTP clients")
    broadcast_address: str = option(socket.gethostname(), "address of this lookupd node (default: hostname)")
    inactive_producer_timeout: float = option(
        300.0, "duration of time a producer will remain in the active list since its last ping", kind="duration")
    tombstone_lifetime: float = option(45.0, "duration of time a producer will remain tombstoned if registration remains",
                                       kind="duration")


def parse_options(argv: list[str] | None = None) -> Options:
    return load_options(Options, argv, "trio-nsqlookupd", "trio-nsq directory service (nsqlookupd)")
