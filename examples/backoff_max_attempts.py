"""A handler that fails: requeue with a growing delay, backoff, and giving up after max_attempts.

    NSQD_TCP=127.0.0.1:4150 python examples/backoff_max_attempts.py

A handler that raises (or returns False) has its message REQ'd (delay requeue_delay_ms x attempts:
90 s x attempts by default, go-nsq's; 100 ms here) and raises the consumer's backoff level: RDY 0
everywhere for backoff_base x 2**(level-1) seconds (at most max_backoff), then one message to test the
water; each success lowers the level by one, and full RDY returns at level 0. A message that fails on
its max_attempts-th delivery is logged (WARNING), goes to on_give_up and is FIN'd: here "poison" fails
every time, the others only on their first delivery.
"""

import os

import trio

from trio_nsq.client import Consumer, Producer

NSQD_TCP = os.environ.get("NSQD_TCP", "127.0.0.1:4150")
TOPIC = os.environ.get("TOPIC", "flaky")


async def main() -> None:
    async with Producer(NSQD_TCP) as producer:
        await producer.mpub(TOPIC, [b"one", b"poison", b"two"])

    handled, given_up = [], []
    done = trio.Event()

    async def handler(message):
        body = message.body.decode()
        if body == "poison" or message.attempts == 1:
            raise RuntimeError(f"cannot handle {body} (attempt {message.attempts})")
        handled.append(body)
        check()

    def give_up(message):
        given_up.append((message.body.decode(), message.attempts))
        check()

    def check():
        if len(handled) == 2 and given_up:
            done.set()

    async with Consumer(TOPIC, "flaky-channel", handler, nsqd_tcp_addresses=[NSQD_TCP], max_in_flight=5,
                        max_attempts=3, on_give_up=give_up, requeue_delay_ms=100,
                        backoff_base=0.05, max_backoff=0.5) as consumer:
        with trio.fail_after(30):
            await done.wait()
    print("handled:", ", ".join(sorted(handled)))
    print("given up:", ", ".join(f"{body} after {attempts} attempts" for body, attempts in given_up))
    print("backoffs:", consumer.stats["backoffs"], "requeued:", consumer.stats["requeued"])


if __name__ == "__main__":
    trio.run(main)
