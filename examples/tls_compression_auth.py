"""TLS with a CA file and a client certificate, snappy or deflate, and AUTH, with the Trio client.

    NSQD_TCP=127.0.0.1:4150 TLS_CA=ca.pem TLS_CERT=client.pem TLS_KEY=client.pem AUTH_SECRET=s3cret \\
        COMPRESSION=snappy python examples/tls_compression_auth.py

The broker runs with `--tls-cert=... --tls-key=... --tls-root-ca-file=ca.pem --tls-client-auth-policy=require`
(TLS_CERT/TLS_KEY then present our certificate) and `--auth-http-address=...` (AUTH_SECRET is sent when
it asks). Any of the four can be left out: the client negotiates what it is given.
"""

import os

import trio

from trio_nsq.client import Consumer, NSQConnectionError, NSQError, Producer, tls_context

NSQD_TCP = os.environ.get("NSQD_TCP", "127.0.0.1:4150")
TOPIC = os.environ.get("TOPIC", "secure")
COMPRESSION = os.environ.get("COMPRESSION", "snappy")  # snappy, deflate or none


def connection_options() -> dict:
    """The keywords Producer and Consumer share for how each connection is made."""
    options = {"snappy": COMPRESSION == "snappy", "deflate": COMPRESSION == "deflate"}
    if os.environ.get("TLS_CA"):
        # verifies nsqd's certificate against our CA; the client certificate is for
        # --tls-client-auth-policy (nsqd sees its common name, and so does the auth server)
        options["tls"] = tls_context(ca_file=os.environ["TLS_CA"], cert_file=os.environ.get("TLS_CERT"),
                                     key_file=os.environ.get("TLS_KEY"))
    if os.environ.get("AUTH_SECRET"):
        options["auth_secret"] = os.environ["AUTH_SECRET"]
    return options


async def main() -> None:
    options = connection_options()
    try:
        async with Producer(NSQD_TCP, reconnect_timeout=3, **options) as producer:
            await producer.mpub(TOPIC, [b"over", b"tls"])
    except NSQError as exc:  # nsqd refused, at once: AUTH (E_UNAUTHORIZED: a secret it does not know), the
        raise SystemExit(f"refused: {exc}") from None  # publish, or TLS (E_TLS_NOT_OFFERED: nsqd has none)
    except NSQConnectionError as exc:  # a TLS handshake failed (at once), or no broker within reconnect_timeout
        raise SystemExit(f"cannot connect: {exc}") from None

    received = []
    done = trio.Event()

    async def handler(message):
        received.append(message.body.decode())
        conn = message.conn
        print(f"received {message.body.decode()!r} (tls={conn.features.get('tls_v1')}, snappy="
              f"{conn.features.get('snappy')}, deflate={conn.features.get('deflate')}, "
              f"identity={(conn.auth or {}).get('identity')})")
        if len(received) == 2:
            done.set()

    async with Consumer(TOPIC, "secure-channel", handler, nsqd_tcp_addresses=[NSQD_TCP], **options):
        with trio.fail_after(10):
            await done.wait()
    print("done:", ", ".join(sorted(received)))


if __name__ == "__main__":
    trio.run(main)
