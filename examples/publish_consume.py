"""Publish with the Trio client, then consume what was published.

    python examples/publish_consume.py            # against `make run` (127.0.0.1:4150)
    NSQD_TCP=host:port python examples/publish_consume.py
"""

import os

import trio

from trio_nsq.client import Consumer, Producer

NSQD_TCP = os.environ.get("NSQD_TCP", "127.0.0.1:4150")
TOPIC = os.environ.get("TOPIC", "example")


async def main() -> None:
    async with Producer(NSQD_TCP) as producer:
        await producer.pub(TOPIC, b"hello")
        await producer.mpub(TOPIC, [b"from", b"trio-nsq"])
    received = []
    done = trio.Event()

    async def handler(message):
        received.append(message.body.decode())
        print("received:", message.body.decode())
        if len(received) == 3:
            done.set()

    async with Consumer(TOPIC, "example-channel", handler, nsqd_tcp_addresses=[NSQD_TCP], max_in_flight=10):
        with trio.fail_after(10):
            await done.wait()
    print("done:", ", ".join(sorted(received)))  # NSQ does not promise order


if __name__ == "__main__":
    trio.run(main)
