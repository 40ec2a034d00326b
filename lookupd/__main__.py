"""trio-nsqlookupd / python -m lookupd: run the directory until SIGTERM or SIGINT."""

from __future__ import annotations

import logging

from lookupd.nsqlookupd import NSQLookupd
from lookupd.options import parse_options
from shared.logs import setup_logging
from shared.service import run_service
from shared.version import VERSION

log = logging.getLogger("nsqlookupd")


def main(argv: list[str] | None = None) -> None:
    options = parse_options(argv)
    setup_logging(options.log_prefix, options.log_level)
    log.info("trio-nsqlookupd v%s (nsqlookupd %s compatible)", VERSION, VERSION)
    run_service(lambda: NSQLookupd(options), log)


if __name__ == "__main__":
    main()
