"""nsqlookupd's options: flag names, TOML keys and defaults as Go nsqlookupd has them."""

from __future__ import annotations

import socket

import attrs

from shared.logs import parse_level
from shared.options import build_parser, load_options, option

PROG = "trio-nsqlookupd"
DESCRIPTION = "trio-nsq directory service (nsqlookupd)"


@attrs.define
class Options:
    """nsqlookupd's Options (nsqlookupd/options.go): the field is the TOML key, `--field-name` the flag.

    Durations are seconds (floats); flags and the config file take Go durations ("300s", "5m", "100ms")
    or plain seconds.
    """

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
    """Defaults, then the --config TOML file, then the command line (flags win). A bad value exits 2
    with a usage message, as Go's flag package does."""
    options = load_options(Options, argv, PROG, DESCRIPTION)
    try:
        parse_level(options.log_level)
    except ValueError as exc:
        build_parser(Options, PROG, DESCRIPTION).error(f"--log-level: {exc}")
    return options
