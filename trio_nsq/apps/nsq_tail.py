"""nsq_tail: print a topic's messages to stdout, one per line, as nsqio/nsq's apps/nsq_tail.

    nsq_tail --nsqd-tcp-address=127.0.0.1:4150 --topic=T [--topic=U] [--channel=C] [-n N] [--print-topic]
    nsq_tail --lookupd-http-address=127.0.0.1:4161 --topic=T

Without --channel it reads on an ephemeral channel of its own (`tail123456#ephemeral`). `-n N` exits
after N messages of one topic; SIGINT/SIGTERM close every consumer cleanly (what was received is
printed and FIN'd) and exit 0. A command-line tool, so it prints.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import sys

import attrs
import trio

from trio_nsq.apps.app import ConsumerOptions, Main, command, fatal
from trio_nsq.shared.options import option

APP = "nsq_tail"
log = logging.getLogger("trio_nsq.apps")


@attrs.define
class Options(ConsumerOptions):
    channel: str = option("", "NSQ channel")
    n: int = option(0, "total messages to show (will wait if starved)")
    print_topic: bool = option(False, "print topic name where message was received")
    topic: list = option([], "NSQ topic (may be given multiple times)", repeat=True)


def setup(opts: Options) -> Main:
    if not opts.channel:
        opts.channel = f"tail{random.randrange(999999):06d}#ephemeral"
    opts.check_sources()
    if not opts.topic:
        fatal("--topic required")
    settings = opts.consumer_settings(APP)
    if 0 < opts.n < settings["max_in_flight"]:
        settings["max_in_flight"] = opts.n  # don't ask for more messages than we want
    return functools.partial(tail, opts, settings)


async def tail(opts: Options, settings: dict, stop: trio.Event) -> int:
    from trio_nsq.client import Consumer

    out = sys.stdout.buffer
    broken = trio.Event()

    def handler_for(topic: str):
        shown = 0
        prefix = f"{topic} | ".encode() if opts.print_topic else b""

        async def handle(message) -> None:
            nonlocal shown
            if opts.n and shown >= opts.n:
                # one more than wanted was in flight: give it back untouched for whoever reads next
                await message.requeue(delay_ms=0, backoff=False)
                return
            try:
                out.write(prefix + message.body + b"\n")
                out.flush()
            except BrokenPipeError:
                # stdout is gone (`| head`): give the message back and end, as Go's tool dies of SIGPIPE
                await message.requeue(delay_ms=0, backoff=False)
                broken.set()
                stop.set()
                return
            shown += 1
            if opts.n and shown >= opts.n:
                stop.set()

        return handle

    async with contextlib.AsyncExitStack() as stack:
        for topic in opts.topic:
            log.info("Adding consumer for topic: %s", topic)
            await stack.enter_async_context(Consumer(
                topic, opts.channel, handler_for(topic), nsqd_tcp_addresses=opts.nsqd_tcp_address,
                lookupd_http_addresses=opts.lookupd_http_address, concurrency=1, **settings))
        await stop.wait()
    if broken.is_set():
        raise BrokenPipeError()
    return 0


main = command(Options, APP, setup)


if __name__ == "__main__":
    raise SystemExit(main())
