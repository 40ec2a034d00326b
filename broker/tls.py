"""TLS for the broker: the server context built from nsqd's --tls-* options.

Python's ssl module cannot request a client certificate without verifying it, so Go's "require"
(any certificate) is not available: both "require" and "require-verify" verify against
--tls-root-ca-file, which they therefore need. --tls-min-version below tls1.2 means tls1.2 (OpenSSL here
refuses older versions).
"""

from __future__ import annotations

import ssl

from trio_nsq.broker.options import Options

_MIN_VERSIONS = {
    "tls1.2": ssl.TLSVersion.TLSv1_2,
    "tls1.3": ssl.TLSVersion.TLSv1_3,
    # Go nsqd also accepts ssl3.0/tls1.0/tls1.1; OpenSSL here refuses them, so they map to 1.2
    "ssl3.0": ssl.TLSVersion.TLSv1_2,
    "tls1.0": ssl.TLSVersion.TLSv1_2,
    "tls1.1": ssl.TLSVersion.TLSv1_2,
}


class TLSConfigError(RuntimeError):
    pass


def build_server_context(options: Options) -> ssl.SSLContext | None:
    """None when TLS is not configured (no --tls-cert/--tls-key)."""
    if not options.tls_cert and not options.tls_key:
        if options.tls_required != "false" or options.tls_client_auth_policy:
            raise TLSConfigError("cannot require TLS client connections without TLS key and cert")
        return None
    if not (options.tls_cert and options.tls_key):
        raise TLSConfigError("--tls-cert and --tls-key must be given together")
    try:
        minimum = _MIN_VERSIONS[options.tls_min_version.lower()]
    except KeyError:
        raise TLSConfigError(f"unknown --tls-min-version {options.tls_min_version!r}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = minimum
    try:
        context.load_cert_chain(options.tls_cert, options.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise TLSConfigError(f"failed to load TLS certificate/key - {exc}") from None
    policy = options.tls_client_auth_policy
    if policy in ("require", "require-verify"):
        if not options.tls_root_ca_file:
            raise TLSConfigError(f"--tls-client-auth-policy={policy} needs --tls-root-ca-file here")
        context.verify_mode = ssl.CERT_REQUIRED
    elif policy:
        raise TLSConfigError(f"unknown --tls-client-auth-policy {policy!r}")
    if options.tls_root_ca_file:
        try:
            context.load_verify_locations(options.tls_root_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise TLSConfigError(f"failed to load --tls-root-ca-file - {exc}") from None
    return context


def tls_required(options: Options) -> bool:
    """TLS required of TCP clients: --tls-required=true or tcp-https; a client auth policy implies it."""
    return options.tls_required != "false" or bool(options.tls_client_auth_policy)


def tls_required_http(options: Options) -> bool:
    """TLS required of HTTP clients too: all but --tls-required=tcp-https (nsqd's TLSRequiredExceptHTTP)."""
    return tls_required(options) and options.tls_required != "tcp-https"
