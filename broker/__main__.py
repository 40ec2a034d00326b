"""trio-nsqd / python -m broker: run the broker until SIGTERM or SIGINT."""

from __future__ import annotations

import gc
import logging
import signal
import sys

import trio

from broker.nsqd import NSQD
from broker.options import parse_options
from shared.logs import setup_logging
from shared.version import VERSION

log = logging.getLogger("nsqd")


async def _run(nsqd: NSQD) -> None:
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            await nursery.start(nsqd.run)
            async for signum in signals:
                log.info("received signal %s, exiting", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break


def _tune_gc() -> None:
    # Queued messages are millions of long-lived objects without cycles; the default gen-0 threshold
    # (700) makes the cyclic collector run, and walk them, every few hundred allocations.
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, 50, 1000)


GC_THRESHOLD = 100_000


def main(argv: list[str] | None = None) -> None:
    options = parse_options(argv)
    setup_logging(options.log_prefix, options.log_level)
    log.info("trio-nsqd v%s (nsqd %s compatible)", VERSION, VERSION)
    _tune_gc()
    try:
        nsqd = NSQD(options)
        trio.run(_run, nsqd)
    except* (RuntimeError, OSError) as group:
        for exc in group.exceptions:
            log.critical("%s", exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
