"""nsqlookupd's options: flag names, TOML keys and defaults as Go nsqlookupd has them."""

from __future__ import annotations

import socket

import attrs

from trio_nsq.shared.options import load_options, option


@attrs.define
class Options:
    """nsqlookupd's Options (nsqlookupd/options.go): the field is the TOML key, `--field-name` the flag.

    Durations are seconds (floats); flags and the config file take Go durations ("300s", "5m", "100ms")
    or plain seconds.
    """

    log_level: str = option("info", "set log verbosity: debug, info, warn, error, or fatal", kind="log_level")
    log_prefix: str = option("[nsqlookupd] ", "log message prefix")
    tcp_address: str = option("0.0.0.0:4160", "<addr>:<port> to listen on for TCP clients")
    http_address: str = option("0.0.0.0:4161", "<addr>:<port> to listen on for HTTP clients")
    broadcast_address: str = option(socket.gethostname(), "address of this lookupd node (default: hostname)")
    inactive_producer_timeout: float = option(
        300.0, "duration of time a producer will remain in the active list since its last ping", kind="duration")
    tombstone_lifetime: float = option(45.0, "duration of time a producer will remain tombstoned if registration remains",
                                       kind="duration")


# flags nsqlookupd 1.3.0 still accepts and ignores
DEPRECATED = {"verbose": "has no effect, use --log-level"}


def parse_command_line(argv: list[str] | None = None) -> tuple[Options, list[str]]:
    """Defaults, then the --config TOML file, then the command line (flags win); and the deprecated
    flags given. A bad value exits 2 with a usage message, as Go's flag package does."""
    return load_options(Options, argv, "nsqlookupd", DEPRECATED)


def parse_options(argv: list[str] | None = None) -> Options:
    return parse_command_line(argv)[0]
