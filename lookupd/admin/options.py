"""nsqadmin's options: flag names, TOML keys and defaults as Go nsqadmin 1.3.0 has them."""

from __future__ import annotations

import attrs

from trio_nsq.shared.options import load_options, option


@attrs.define
class Options:
    """nsqadmin's Options (nsqadmin/options.go): the field is the TOML key, `--field-name` the flag."""

    log_level: str = option("info", "set log verbosity: debug, info, warn, error, or fatal", kind="log_level")
    log_prefix: str = option("[nsqadmin] ", "log message prefix")
    http_address: str = option("0.0.0.0:4171", "<addr>:<port> to listen on for HTTP clients")
    base_path: str = option("/", "URL base path")
    graphite_url: str = option("", "graphite HTTP address")
    nsqlookupd_http_addresses: list = option(
        [], "lookupd HTTP address (may be given multiple times)", flag="--lookupd-http-address", repeat=True)
    nsqd_http_addresses: list = option(
        [], "nsqd HTTP address (may be given multiple times)", flag="--nsqd-http-address", repeat=True)
    http_client_connect_timeout: float = option(2.0, "timeout for HTTP connect", kind="duration")
    http_client_request_timeout: float = option(5.0, "timeout for HTTP request", kind="duration")
    http_client_tls_insecure_skip_verify: bool = option(False, "configure the HTTP client to skip verification of TLS certificates")
    http_client_tls_root_ca_file: str = option("", "path to CA file for the HTTP client")
    http_client_tls_cert: str = option("", "path to certificate file for the HTTP client")
    http_client_tls_key: str = option("", "path to key file for the HTTP client")
    allow_config_from_cidr: str = option("127.0.0.1/8", "A CIDR from which to allow HTTP requests to the /config endpoint")
    notification_http_endpoint: str = option("", "HTTP endpoint (fully qualified) to which POST notifications of admin actions will be sent")
    acl_http_header: str = option("X-Forwarded-User", "HTTP header to check for authenticated admin users")
    admin_users: list = option([], "admin user (may be given multiple times; if specified, only these users will be able to perform privileged actions)", flag="--admin-user", repeat=True)
    max_nodes: int = option(100, "most nsqd nodes read per request (not in nsqadmin: a bound on fan-out)")


def parse_command_line(argv: list[str] | None = None) -> tuple[Options, list[str]]:
    """Defaults, then the --config TOML file, then the command line (flags win)."""
    return load_options(Options, argv, "nsqadmin", {})
