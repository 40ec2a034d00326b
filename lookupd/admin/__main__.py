"""trio-nsqadmin / python -m trio_nsq.lookupd.admin: serve the admin until SIGTERM or SIGINT."""

from __future__ import annotations

import logging

from trio_nsq.lookupd.admin.nsqadmin import NSQAdmin
from trio_nsq.lookupd.admin.options import parse_command_line
from trio_nsq.shared.logs import setup_logging
from trio_nsq.shared.service import run_service
from trio_nsq.shared.version import version_line

log = logging.getLogger("nsqadmin")


def main(argv: list[str] | None = None) -> None:
    options, _ = parse_command_line(argv)
    setup_logging(options.log_prefix, options.log_level)
    log.info("%s", version_line("nsqadmin"))
    run_service(lambda: NSQAdmin(options), log)


if __name__ == "__main__":
    main()
