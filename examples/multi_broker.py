"""Several brokers behind one lookupd: publish to each broker, consume from all of them via lookupd.

    NSQD_TCPS=127.0.0.1:4150,127.0.0.1:4250 LOOKUPD_HTTP=127.0.0.1:4161 python examples/multi_broker.py

With `make run` there is one broker; start a second one registered with the same lookupd:
    .venv/bin/python -m trio_nsq.broker --tcp-address=127.0.0.1:4250 --http-address=127.0.0.1:4251 \\
        --data-path=./data2 --lookupd-tcp-address=127.0.0.1:4160
"""

import os

import httpx
import trio

from trio_nsq.client import Consumer, Producer

NSQD_TCPS = os.environ.get("NSQD_TCPS", "127.0.0.1:4150").split(",")
LOOKUPD_HTTP = os.environ.get("LOOKUPD_HTTP", "127.0.0.1:4161")
TOPIC = os.environ.get("TOPIC", "multi")


async def main() -> None:
    expected = set()
    for i, address in enumerate(NSQD_TCPS):
        async with Producer(address) as producer:
            bodies = [f"broker{i}-msg{j}".encode() for j in range(5)]
            await producer.mpub(TOPIC, bodies)
            expected.update(bodies)
    # lookupd learns of the topic from each broker's lookup loop
    async with httpx.AsyncClient() as client:
        with trio.fail_after(10):
            while True:
                r = await client.get(f"http://{LOOKUPD_HTTP}/lookup", params={"topic": TOPIC})
                if r.status_code == 200 and len(r.json()["producers"]) >= len(NSQD_TCPS):
                    break
                await trio.sleep(0.1)
    got = set()
    done = trio.Event()

    async def handler(message):
        got.add(message.body)
        if got >= expected:
            done.set()

    async with Consumer(TOPIC, "multi-channel", handler, lookupd_http_addresses=[LOOKUPD_HTTP],
                        max_in_flight=20, lookupd_poll_interval=1):
        with trio.fail_after(15):
            await done.wait()
    print(f"received {len(got)} messages from {len(NSQD_TCPS)} brokers found through lookupd")


if __name__ == "__main__":
    trio.run(main)
