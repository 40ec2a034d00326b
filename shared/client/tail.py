"""nsq_tail with the Trio client: print the bodies of a topic's messages, one per line.

    python -m trio_nsq.shared.client.tail --nsqd-tcp-address 127.0.0.1:4150 --topic T [--channel C] [-n N]
    python -m trio_nsq.shared.client.tail --lookupd-http-address 127.0.0.1:4161 --topic T

Without --channel it reads on an ephemeral channel of its own, as nsq_tail does. A command-line tool,
so it prints.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys

import trio

from trio_nsq.shared.client import Consumer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trio_nsq.shared.client.tail", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nsqd-tcp-address", action="append", default=[], help="nsqd TCP address (repeatable)")
    parser.add_argument("--lookupd-http-address", action="append", default=[],
                        help="nsqlookupd HTTP address (repeatable)")
    parser.add_argument("--topic", required=True)
    parser.add_argument("--channel", default=None, help="default: tail<random>#ephemeral")
    parser.add_argument("-n", "--total-messages", type=int, default=0, help="exit after this many (0 = forever)")
    parser.add_argument("--max-in-flight", type=int, default=200)
    parser.add_argument("-v", "--verbose", action="store_true", help="log the client's doings to stderr")
    args = parser.parse_args(argv)
    if not args.nsqd_tcp_address and not args.lookupd_http_address:
        parser.error("give --nsqd-tcp-address or --lookupd-http-address")
    if args.channel is None:
        args.channel = f"tail{random.randrange(1_000_000)}#ephemeral"
    return args


async def tail(args: argparse.Namespace) -> None:
    out = sys.stdout.buffer
    limit = args.total_messages
    printed = 0
    done = trio.Event()

    async def handler(message) -> None:
        nonlocal printed
        if limit and printed >= limit:
            # one too many was in flight: give it back, untouched, for whoever reads next
            await message.requeue(delay_ms=0, backoff=False)
            return
        out.write(message.body + b"\n")
        out.flush()
        printed += 1
        if limit and printed >= limit:
            done.set()

    max_in_flight = min(args.max_in_flight, limit) if limit else args.max_in_flight
    async with Consumer(args.topic, args.channel, handler, nsqd_tcp_addresses=args.nsqd_tcp_address,
                        lookupd_http_addresses=args.lookupd_http_address, max_in_flight=max_in_flight,
                        concurrency=1, lookupd_poll_interval=15):
        await done.wait()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        trio.run(tail, args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
