"""trio-nsqd / python -m trio_nsq.broker: run the broker until SIGTERM or SIGINT."""

from __future__ import annotations

import gc
import logging

from trio_nsq.broker.options import DEPRECATED, parse_command_line
from trio_nsq.shared.logs import setup_logging
from trio_nsq.shared.service import run_service
from trio_nsq.shared.version import version_line

log = logging.getLogger("nsqd")


def _tune_gc() -> None:
    # Queued messages are millions of long-lived objects without cycles; the default gen-0 threshold
    # (700) makes the cyclic collector run, and walk them, every few hundred allocations.
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, 50, 1000)


GC_THRESHOLD = 100_000


def main(argv: list[str] | None = None) -> None:
    options, deprecated = parse_command_line(argv)
    setup_logging(options.log_prefix, options.log_level)
    log.info("%s", version_line("nsqd"))
    log.info("ID: %d", options.node_id)
    for name in deprecated:
        log.warning("-%s is deprecated and %s", name, DEPRECATED[name])
    from trio_nsq.broker.nsqd import NSQD  # after the command line: `--version` and `-h` skip its imports

    _tune_gc()
    run_service(lambda: NSQD(options), log)


if __name__ == "__main__":
    main()
