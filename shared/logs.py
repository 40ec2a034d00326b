"""NSQ-style log lines through the logging module: `[nsqd] 2026/11/23 04:54:05.123456 INFO: message`."""

from __future__ import annotations

import logging
import sys
import time

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING, "warning": logging.WARNING,
          "error": logging.ERROR, "fatal": logging.CRITICAL}
# nsqd's lg.LogLevel numbers, which GET /config/log_level reports
GO_LOG_LEVELS = {"debug": 1, "info": 2, "warn": 3, "error": 4, "fatal": 5}
_NAMES = {logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARNING", logging.ERROR: "ERROR",
          logging.CRITICAL: "FATAL"}


class NSQFormatter(logging.Formatter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        t = time.localtime(record.created)
        micros = int((record.created % 1) * 1_000_000)
        stamp = time.strftime("%Y/%m/%d %H:%M:%S", t) + f".{micros:06d}"
        level = _NAMES.get(record.levelno, record.levelname)
        line = f"{self.prefix}{stamp} {level}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def parse_level(name: str) -> int:
    try:
        return LEVELS[name.lower()]
    except KeyError:
        raise ValueError(f"invalid log level {name!r}") from None


def setup_logging(prefix: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(NSQFormatter(prefix))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(parse_level(level))
    # the libraries' own info chatter (hypercorn's access lines, httpx's "HTTP Request: ..." per lookupd
    # or auth query) stays out of NSQ-style logs; our code logs what nsqd logs about those requests
    for name in ("hypercorn", "httpx", "httpcore"):
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
