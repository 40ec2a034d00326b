"""Compression with the Trio client: snappy or deflate, chosen per connection (nsqd offers both).

    NSQD_TCP=127.0.0.1:4150 python examples/compression.py

Here the Producer's connection is snappy and the Consumer's deflate; either keyword works on both.
"""

import os

import trio

from trio_nsq.client import Consumer, Producer

NSQD_TCP = os.environ.get("NSQD_TCP", "127.0.0.1:4150")


async def main() -> None:
    async with Producer(NSQD_TCP, snappy=True) as producer:
        await producer.mpub("logs", [b"GET /index.html 200 " * 50, b"GET /missing 404 " * 50])
    received = []
    done = trio.Event()

    async def handler(message):
        features = message.conn.features
        print(f"received {len(message.body)} bytes, snappy={features['snappy']}, deflate={features['deflate']}")
        received.append(message.body)
        if len(received) == 2:
            done.set()

    async with Consumer("logs", "archive", handler, nsqd_tcp_addresses=[NSQD_TCP], deflate=True):
        with trio.fail_after(10):
            await done.wait()


if __name__ == "__main__":
    trio.run(main)
