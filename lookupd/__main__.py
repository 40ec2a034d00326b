"""trio-nsqlookupd / python -m trio_nsq.lookupd: run the directory until SIGTERM or SIGINT."""

from __future__ import annotations

import logging

from trio_nsq.lookupd.options import DEPRECATED, parse_command_line
from trio_nsq.shared.logs import setup_logging
from trio_nsq.shared.service import run_service
from trio_nsq.shared.version import version_line

log = logging.getLogger("nsqlookupd")


def main(argv: list[str] | None = None) -> None:
    options, deprecated = parse_command_line(argv)
    setup_logging(options.log_prefix, options.log_level)
    log.info("%s", version_line("nsqlookupd"))
    for name in deprecated:
        log.warning("-%s is deprecated and %s", name, DEPRECATED[name])
    from trio_nsq.lookupd.nsqlookupd import NSQLookupd  # after the command line: `--version` and `-h` skip its imports

    run_service(lambda: NSQLookupd(options), log)


if __name__ == "__main__":
    main()
