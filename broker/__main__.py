"""trio-nsqd / python -m broker: run the broker until SIGTERM or SIGINT."""

from __future__ import annotations

import gc
import logging

from broker.nsqd import NSQD
from broker.options import parse_options
from shared.logs import setup_logging
from shared.service import run_service
from shared.version import VERSION

log = logging.getLogger("nsqd")


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
    run_service(lambda: NSQD(options), log)


if __name__ == "__main__":
    main()
