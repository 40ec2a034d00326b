"""to_nsq: publish the lines of stdin to a topic, as nsqio/nsq's apps/to_nsq.

    producer | to_nsq --topic=T --nsqd-tcp-address=127.0.0.1:4150 [--rate=N] [--delimiter=X]

Each line (split at --delimiter, one byte, default newline; empty lines skipped) is published to every
--nsqd-tcp-address in turn, one at a time; --rate caps messages per second (a bucket of at most one
second's worth, as to_nsq's). The end of stdin, SIGINT or SIGTERM stop it after the message being
published: exit 0. A publish that fails (refused, or the broker gone past the producer's reconnect
timeout) exits 1 with the error, as to_nsq's log.Fatal.
"""

from __future__ import annotations

import functools
import logging
import os

import attrs
import trio

from trio_nsq.apps.app import Main, client_settings, command, fatal
from trio_nsq.shared.options import option

APP = "to_nsq"
READ_SIZE = 65536
log = logging.getLogger("trio_nsq.apps")


@attrs.define
class Options:
    delimiter: str = option("\n", "character to split input from stdin")
    nsqd_tcp_address: list = option([], "destination nsqd TCP address (may be given multiple times)", repeat=True)
    producer_opt: list = option([], "option to passthrough to nsq.Producer (may be given multiple times, "
                                    "http://godoc.org/github.com/nsqio/go-nsq#Config)", repeat=True)
    rate: int = option(0, "Throttle messages to n/second. 0 to disable")
    topic: str = option("", "NSQ topic to publish to")


def setup(opts: Options) -> Main:
    if not opts.topic:
        fatal("--topic required")
    delimiter = opts.delimiter.encode()
    if len(delimiter) != 1:
        fatal("--delimiter must be a single byte")
    if not opts.nsqd_tcp_address:
        fatal("--nsqd-tcp-address required")
    settings = client_settings(opts.producer_opt, APP, consumer=False)
    return functools.partial(publish_stdin, opts, delimiter, settings)


class Throttle:
    """to_nsq's --rate: a bucket gaining `rate` tokens a second, holding at most `rate` (one second of
    capacity), starting with one; each message takes a token, waiting for one when there is none."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.tokens = 1.0
        self.last = trio.current_time()

    async def take(self) -> None:
        now = trio.current_time()
        self.tokens = min(float(self.rate), self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1:
            await trio.sleep((1 - self.tokens) / self.rate)
            self.tokens, self.last = 1.0, trio.current_time()
        self.tokens -= 1


async def lines(delimiter: bytes, fd: int = 0):
    """The delimited records of `fd`, without their delimiter; the last one may lack it."""
    pending = b""
    while True:
        # a worker thread reads, so a signal is not held up by a silent stdin
        chunk = await trio.to_thread.run_sync(os.read, fd, READ_SIZE, abandon_on_cancel=True)
        if not chunk:
            break
        parts = (pending + chunk).split(delimiter)
        pending = parts.pop()
        for part in parts:
            yield part
    if pending:
        yield pending


async def publish_stdin(opts: Options, delimiter: bytes, settings: dict, stop: trio.Event) -> int:
    from contextlib import AsyncExitStack

    from trio_nsq.client import NSQConnectionError, NSQError, Producer

    throttle = Throttle(opts.rate) if opts.rate >= 1 else None
    if throttle:
        log.info("Throttling messages rate to max:%d/second", opts.rate)
    async with AsyncExitStack() as stack:
        producers = [await stack.enter_async_context(Producer(address, **settings))
                     for address in dict.fromkeys(opts.nsqd_tcp_address)]
        with trio.CancelScope() as reading:
            async def stop_reading() -> None:
                await stop.wait()
                reading.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(stop_reading)
                async for line in lines(delimiter):
                    if not line:
                        continue
                    if throttle:
                        await throttle.take()
                    for producer in producers:
                        try:
                            # the message being published is finished even when a signal comes
                            with trio.CancelScope(shield=True):
                                await producer.pub(opts.topic, line)
                        except (NSQError, NSQConnectionError) as exc:
                            fatal(str(exc))
                nursery.cancel_scope.cancel()
    return 0


main = command(Options, APP, setup)


if __name__ == "__main__":
    raise SystemExit(main())
