"""A Trio program with nsqd inside it: publish two messages, consume one, exit cleanly.

    python examples/embed_trio.py [DATA_PATH]

With DATA_PATH, the message left unconsumed is on disk afterwards (nsqd's clean exit).
"""

import sys

import trio

from trio_nsq import Consumer, Producer, run_nsqd


async def main(data_path: str = "") -> None:
    async with trio.open_nursery() as nursery:
        nsqd = await nursery.start(lambda task_status: run_nsqd(data_path=data_path, task_status=task_status))
        got = trio.Event()

        async def handler(message):
            print("consumed", message.body.decode())
            got.set()

        async with Producer(nsqd.tcp_address) as producer:
            await producer.pub("events", b"one")
            async with Consumer("events", "worker", handler, nsqd_tcp_addresses=[nsqd.tcp_address]):
                await got.wait()
            await producer.pub("events", b"two")  # stays queued on the channel
        nursery.cancel_scope.cancel()  # stops nsqd: "two" goes to DATA_PATH


if __name__ == "__main__":
    trio.run(main, *sys.argv[1:2])
