"""What every NSQ utility shares, as nsqio/nsq's internal/app does for Go's: the command line (Go's flag
syntax through shared/options.py's parser), `--version`, log.Fatal, logging, SIGINT/SIGTERM, and
go-nsq's `--consumer-opt`/`--producer-opt` mapped onto our client's keywords.

Each tool declares its flags once as an attrs class of `option(...)` fields (the same declaration nsqd's
options use) and calls `run_app(Options, "nsq_tail", main, argv)`. The four consumer tools' Options extend
ConsumerOptions, the flags they share.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import attrs
import trio

from trio_nsq.shared import options as flags
from trio_nsq.shared.options import option
from trio_nsq.shared.version import PACKAGE_VERSION, VERSION

log = logging.getLogger("trio_nsq.apps")


class GoLogFormatter(logging.Formatter):
    """Go's log package with its default flags: `2026/11/25 16:05:30 message`."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(record.created))
        return f"{stamp} {record.getMessage()}"


def setup_logging(formatter: logging.Formatter | None = None, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter or GoLogFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("httpx", "httpcore"):  # one line per request is not what Go's tools log
        logging.getLogger(name).setLevel(logging.WARNING)


class Fatal(Exception):
    """Go's log.Fatal: run_app writes the message with a timestamp on stderr and exits with status 1."""


def fatal(message: str) -> NoReturn:
    raise Fatal(message)


def user_agent(app: str) -> str:
    """As Go's tools identify: `nsq_tail/1.3.0 go-nsq/1.1.0`; ours names our client instead."""
    return f"{app}/{VERSION} trio-nsq/{PACKAGE_VERSION}"


def parse_command_line(cls: type, app: str, argv: list[str] | None) -> Any:
    """Go's flag package over `cls`'s fields: Go's messages and exit status 2 for a bad command line,
    the usage and exit 0 for -h, `<app> v1.3.0` and exit 0 for --version (as Go's tools print it)."""
    argv = sys.argv[1:] if argv is None else argv
    text = _usage(cls, app)
    try:
        values, _ = flags.parse_flags(cls, argv)
        if "config" in values:  # shared/options.py knows -config for the daemons; Go's tools have none
            raise flags.FlagError("flag provided but not defined: -config")
        for name in ("consumer_opt", "producer_opt"):  # go-nsq's ConfigFlag refuses a bad one as it parses
            for opt in values.get(name, []):
                try:
                    parse_config_opts([opt], consumer=name == "consumer_opt")
                except ConfigError as exc:
                    raise flags.FlagError(f"invalid value {flags._go_quote(opt)} for flag -{name.replace('_', '-')}: {exc}")
            try:  # and together (snappy with deflate)
                parse_config_opts(values.get(name, []), consumer=name == "consumer_opt")
            except ConfigError as exc:
                raise flags.FlagError(f"invalid flags -{name.replace('_', '-')}: {exc}")
    except flags.HelpRequested:
        sys.stderr.write(text)
        raise SystemExit(0) from None
    except flags.FlagError as exc:
        sys.stderr.write(f"{exc}\n{text}")
        raise SystemExit(2) from None
    if values.pop("version", False):
        sys.stdout.write(f"{app} v{VERSION}\n")
        raise SystemExit(0)
    return cls(**values)


def _usage(cls: type, app: str) -> str:
    # flags.usage is nsqd's listing, with -config (which the tools do not have) taken out
    prog = sys.argv[0] if sys.argv and not sys.argv[0].endswith((".py", "-c")) else app
    lines = flags.usage(cls, prog).splitlines(keepends=True)
    i = lines.index("  -config string\n")
    return "".join(lines[:i] + lines[i + 2:])


Main = Callable[[trio.Event], Awaitable["int | None"]]
SIGPIPE_STATUS = 128 + signal.SIGPIPE


def run_app(cls: type, app: str, setup: Callable[[Any], Main], argv: list[str] | None = None) -> int:
    """Parse the command line; `setup(options)` checks them (fatal() as Go's tools refuse, before
    anything starts) and returns `main(stop)`, run under Trio. `stop` is set by SIGINT or SIGTERM:
    main finishes what it holds (a clean close) and returns its exit status (None: 0). A fatal() inside
    exits 1 with Go's log line; a closed stdout (`| head`) ends the tool with status 141, the status a
    shell shows for Go's tools, which die of SIGPIPE."""
    opts = parse_command_line(cls, app, argv)
    failure: list[str] = []

    async def with_signals() -> int | None:
        stop = trio.Event()
        status = None
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                async def watch() -> None:
                    async for signum in signals:
                        log.info("%s: signal %s, stopping", app, signal.Signals(signum).name)
                        stop.set()

                nursery.start_soon(watch)
                try:
                    status = await main(stop)
                except* Fatal as group:
                    failure.append(str(_first(group)))
                except* BrokenPipeError:
                    status = SIGPIPE_STATUS
                nursery.cancel_scope.cancel()
        return status

    status: int | None = None
    try:
        main = setup(opts)
        status = trio.run(with_signals)
    except Fatal as exc:
        failure.append(str(exc))
    if status == SIGPIPE_STATUS:
        # stdout went away: say nothing more (Python would complain when it flushes at exit)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if failure:
        sys.stderr.write(time.strftime("%Y/%m/%d %H:%M:%S ") + failure[0] + "\n")
        return 1
    return status or 0


def command(cls: type, app: str, setup: Callable[[Any], Main]) -> Callable[..., int]:
    """The console script's entry point: `main = command(Options, "nsq_tail", setup)`. Logs go to stderr
    in Go's log format unless setup() installs its own (nsq_to_file's NSQ-style lines)."""

    def main(argv: list[str] | None = None) -> int:
        setup_logging()
        return run_app(cls, app, setup, argv)

    return main


def client_settings(opts: list[str], app: str, *, consumer: bool, **defaults: Any) -> dict[str, Any]:
    """--consumer-opt/--producer-opt as Consumer/Producer keywords over `defaults`, with the tool's
    user agent in IDENTIFY unless an option sets one."""
    settings = {**defaults, **parse_config_opts(opts, consumer=consumer)}
    settings.setdefault("identify", {}).setdefault("user_agent", user_agent(app))
    return settings


CONSUMER_OPT_HELP = ("option to passthrough to nsq.Consumer (may be given multiple times, "
                     "http://godoc.org/github.com/nsqio/go-nsq#Config)")


@attrs.define
class ConsumerOptions:
    """The flags Go's nsq_tail, nsq_to_file, nsq_to_http and nsq_to_nsq declare alike, and what they do
    with them. Each tool's Options extends this class; a field it declares again replaces the one here
    (attrs keeps the subclass's), as nsq_to_nsq's --consumer-opt with Go's other help text."""

    consumer_opt: list = option([], CONSUMER_OPT_HELP, repeat=True)
    lookupd_http_address: list = option([], "lookupd HTTP address (may be given multiple times)", repeat=True)
    max_in_flight: int = option(200, "max number of messages to allow in flight")
    nsqd_tcp_address: list = option([], "nsqd TCP address (may be given multiple times)", repeat=True)

    def check_sources(self, required: str = "--nsqd-tcp-address or --lookupd-http-address required") -> None:
        """fatal() unless one of --nsqd-tcp-address and --lookupd-http-address is given, with Go's messages
        (`required`: nsq_to_file's ends with a period)."""
        if not self.nsqd_tcp_address and not self.lookupd_http_address:
            fatal(required)
        if self.nsqd_tcp_address and self.lookupd_http_address:
            fatal("use --nsqd-tcp-address or --lookupd-http-address not both")

    def consumer_settings(self, app: str, **defaults: Any) -> dict[str, Any]:
        """The Consumer's keywords (client_settings of --consumer-opt over `defaults`), max_in_flight
        included: as Go's tools set --max-in-flight after the options, it wins over
        --consumer-opt=max_in_flight."""
        return {**client_settings(self.consumer_opt, app, consumer=True, **defaults),
                "max_in_flight": self.max_in_flight}


def _first(group: BaseException) -> BaseException:
    while isinstance(group, BaseExceptionGroup):
        group = group.exceptions[0]
    return group


# --- go-nsq's Config keys -----------------------------------------------------------------------------

# go-nsq Config keys and what they become on our Consumer/Producer; README lists them
_DURATION_KEYS = {"dial_timeout", "read_timeout", "write_timeout", "lookupd_poll_interval", "default_requeue_delay",
                  "max_requeue_delay", "max_backoff_duration", "backoff_multiplier", "heartbeat_interval",
                  "output_buffer_timeout", "msg_timeout", "low_rdy_idle_timeout", "low_rdy_timeout",
                  "rdy_redistribute_interval", "lookupd_poll_jitter"}
# go-nsq knows these; our client has no such setting, so they are accepted and logged as ignored
IGNORED_KEYS = frozenset({"read_timeout", "write_timeout", "local_addr", "lookupd_poll_jitter",
                          "low_rdy_idle_timeout", "low_rdy_timeout", "max_rdy_count"})
CONSUMER_KEYS = frozenset({"max_in_flight", "max_attempts", "default_requeue_delay", "max_requeue_delay",
                           "max_backoff_duration", "backoff_multiplier", "lookupd_poll_interval",
                           "rdy_redistribute_interval"})
CONNECTION_KEYS = frozenset({"dial_timeout", "heartbeat_interval", "output_buffer_size", "output_buffer_timeout",
                             "msg_timeout", "sample_rate", "client_id", "hostname", "user_agent", "tls_v1",
                             "tls_root_ca_file", "tls_insecure_skip_verify", "tls_cert", "tls_key", "snappy",
                             "deflate", "deflate_level", "auth_secret"})


class ConfigError(ValueError):
    """A --consumer-opt/--producer-opt go-nsq would refuse."""


def parse_config_opts(opts: list[str], *, consumer: bool) -> dict[str, Any]:
    """go-nsq's ConfigFlag: each `key,value` (a bare `key` means true) as keywords for our Consumer
    (consumer=True) or Producer. Raises ConfigError for a key go-nsq does not know or a bad value."""
    raw: dict[str, str] = {}
    for opt in opts:
        key, sep, value = opt.partition(",")
        raw[key] = value if sep else "true"
    known = CONNECTION_KEYS | (CONSUMER_KEYS if consumer else frozenset()) | IGNORED_KEYS
    kwargs: dict[str, Any] = {}
    identify: dict[str, Any] = {}
    tls: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"invalid option {key}")
        try:
            parsed: Any = _parse_value(key, value)
        except ValueError:
            raise ConfigError(f"invalid value {value!r} for option {key}") from None
        if key in IGNORED_KEYS:
            log.warning("option %s is accepted and ignored (our client has no such setting)", key)
        elif key == "dial_timeout":
            kwargs["connect_timeout"] = parsed
        elif key in ("heartbeat_interval", "output_buffer_timeout", "msg_timeout"):
            identify[key] = int(parsed * 1000)
        elif key in ("output_buffer_size", "sample_rate", "client_id", "hostname", "user_agent"):
            identify[key] = parsed
        elif key in ("snappy", "deflate", "auth_secret"):
            kwargs[key] = parsed
        elif key == "deflate_level":
            identify["deflate_level"] = parsed  # IDENTIFY's field, which Connection's keyword also sets
        elif key.startswith("tls_"):
            tls[key] = parsed
        elif key == "max_backoff_duration":
            kwargs["max_backoff"] = parsed
        elif key == "backoff_multiplier":
            kwargs["backoff_base"] = parsed
        elif key == "default_requeue_delay":
            kwargs["requeue_delay_ms"] = int(parsed * 1000)
        elif key == "max_requeue_delay":
            kwargs["max_requeue_delay_ms"] = int(parsed * 1000)
        else:  # max_in_flight, max_attempts, lookupd_poll_interval, rdy_redistribute_interval
            kwargs[key] = parsed
    if kwargs.get("snappy") and kwargs.get("deflate"):
        raise ConfigError("snappy and deflate cannot both be on")
    if identify:
        kwargs["identify"] = identify
    if tls.get("tls_v1") or any(k != "tls_v1" for k in tls):
        from trio_nsq.client.connection import tls_context

        try:
            kwargs["tls"] = tls_context(ca_file=tls.get("tls_root_ca_file"), cert_file=tls.get("tls_cert"),
                                        key_file=tls.get("tls_key"), verify=not tls.get("tls_insecure_skip_verify"))
        except OSError as exc:
            raise ConfigError(f"TLS: {exc}") from None
    return kwargs


_INT_KEYS = {"max_in_flight", "max_attempts", "output_buffer_size", "sample_rate", "deflate_level", "max_rdy_count"}
_BOOL_KEYS = {"tls_v1", "tls_insecure_skip_verify", "snappy", "deflate"}


def _parse_value(key: str, value: str) -> Any:
    if key in _DURATION_KEYS:
        return flags.parse_duration(value)
    if key in _INT_KEYS:
        return int(value)
    if key in _BOOL_KEYS:
        return flags._parse_bool(value)
    return value

