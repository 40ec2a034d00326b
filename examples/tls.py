"""TLS with the Trio client: every connection is upgraded after IDENTIFY, nsqd's certificate checked.

    NSQD_TCP=127.0.0.1:4150 TLS_CA=ca.pem python examples/tls.py

against nsqd run with `--tls-cert=server.pem --tls-key=server.pem` (`--tls-required=true` refuses the
connections that do not ask for TLS). Without TLS_CA the system's CAs check the certificate.
"""

import os

import trio

from trio_nsq.client import Consumer, Producer, tls_context

NSQD_TCP = os.environ.get("NSQD_TCP", "127.0.0.1:4150")


async def main() -> None:
    tls = tls_context(ca_file=os.environ.get("TLS_CA"))  # also cert_file=, key_file= for a client certificate
    async with Producer(NSQD_TCP, tls=tls) as producer:
        await producer.pub("payments", b"order 17 paid")
    done = trio.Event()

    async def handler(message):
        print(f"received {message.body.decode()!r} over TLS: {message.conn.features['tls_v1']}")
        done.set()

    async with Consumer("payments", "audit", handler, nsqd_tcp_addresses=[NSQD_TCP], tls=tls):
        with trio.fail_after(10):
            await done.wait()


if __name__ == "__main__":
    trio.run(main)
