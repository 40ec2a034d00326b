"""trio-nsqlookupd / python -m lookupd: run the directory until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import signal
import sys

import trio

from lookupd.nsqlookupd import NSQLookupd
from lookupd.options import parse_options
from shared.logs import setup_logging
from shared.version import VERSION

log = logging.getLogger("nsqlookupd")


async def _run(lookupd: NSQLookupd) -> None:
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            await nursery.start(lookupd.run)
            async for signum in signals:
                log.info("received signal %s, exiting", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break


def main(argv: list[str] | None = None) -> None:
    options = parse_options(argv)
    setup_logging(options.log_prefix, options.log_level)
    log.info("trio-nsqlookupd v%s (nsqlookupd %s compatible)", VERSION, VERSION)
    try:
        trio.run(_run, NSQLookupd(options))
    except* (RuntimeError, OSError) as group:
        for exc in group.exceptions:
            log.critical("%s", exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
