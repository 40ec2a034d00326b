"""nsq_to_file: write topics' messages to files, one per line, rotating them, as nsqio/nsq's
apps/nsq_to_file.

    nsq_to_file --topic=T --nsqd-tcp-address=127.0.0.1:4150 --output-dir=/var/log/nsq [--gzip]
                [--rotate-size=BYTES] [--rotate-interval=1h] [--work-dir=DIR] [--filename-format=...]
    nsq_to_file --topic-pattern='^app\\.' --lookupd-http-address=127.0.0.1:4161 --output-dir=...

A message is FIN'd only once the file holding it is fsynced (with --gzip, once the gzip member holding it
is complete: each sync ends one member and starts the next, so a file is a series of members, as
nsq_to_file writes it). Syncs happen when the messages held reach 85 % of --max-in-flight (go-nsq's
"starved"), every --sync-interval, at rotation and at exit. A file being written lives in --work-dir
and moves to --output-dir once closed. SIGINT/SIGTERM: stop receiving, sync and close every file, FIN
what they hold, exit 0; nothing received is lost. SIGHUP closes the files (the next message opens new
ones).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import socket
import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import trio

from trio_nsq.apps.app import ConsumerOptions, Main, command, fatal
from trio_nsq.shared.logs import NSQFormatter, parse_level
from trio_nsq.shared.options import option

if TYPE_CHECKING:
    from trio_nsq.client import Message

APP = "nsq_to_file"
log = logging.getLogger("trio_nsq.apps")


@attrs.define
class Options(ConsumerOptions):
    channel: str = option("nsq_to_file", "nsq channel")
    datetime_format: str = option("%Y-%m-%d_%H", "strftime compatible format for <DATETIME> in filename format")
    filename_format: str = option("<TOPIC>.<HOST><REV>.<DATETIME>.log",
                                  "output filename format (<TOPIC>, <HOST>, <PID>, <DATETIME>, <REV> are replaced. "
                                  "<REV> is increased when file already exists)")
    gzip: bool = option(False, "gzip output files.")
    gzip_level: int = option(6, "gzip compression level (1-9, 1=BestSpeed, 9=BestCompression)")
    host_identifier: str = option("", "value to output in log filename in place of hostname. <SHORT_HOST> and "
                                      "<HOSTNAME> are valid replacement tokens")
    http_client_connect_timeout: float = option(2.0, "timeout for HTTP connect", kind="duration")
    http_client_request_timeout: float = option(5.0, "timeout for HTTP request", kind="duration")
    log_level: str = option("info", "set log verbosity: debug, info, warn, error, or fatal")
    log_prefix: str = option("[nsq_to_file] ", "log message prefix")
    output_dir: str = option("/tmp", "directory to write output files to")
    rotate_interval: float = option(0.0, "rotate the file every duration", kind="duration")
    rotate_size: int = option(0, "rotate the file when it grows bigger than `rotate-size` bytes")
    skip_empty_files: bool = option(False, "skip writing empty files")
    sync_interval: float = option(30.0, "sync file to disk every duration", kind="duration")
    topic: list = option([], "nsq topic (may be given multiple times)", repeat=True)
    topic_pattern: str = option("", "only log topics matching the following pattern")
    topic_refresh: float = option(60.0, "how frequently the topic list should be refreshed", kind="duration")
    work_dir: str = option("", "directory for in-progress files before moving to output-dir")


def setup(opts: Options) -> Main:
    try:
        level = parse_level(opts.log_level)
    except ValueError:
        fatal("--log-level is invalid")
    handler = logging.StreamHandler()
    handler.setFormatter(NSQFormatter(opts.log_prefix))
    logging.getLogger().handlers[:] = [handler]
    logging.getLogger().setLevel(level)
    if not opts.channel:
        fatal("--channel is required")
    for name in ("http_client_connect_timeout", "http_client_request_timeout"):
        if getattr(opts, name) <= 0:
            fatal(f"--{name.replace('_', '-')} should be positive")
    opts.check_sources(required="--nsqd-tcp-address or --lookupd-http-address required.")
    if not 1 <= opts.gzip_level <= 9:
        fatal(f"invalid --gzip-level value ({opts.gzip_level}), should be 1-9")
    if not opts.topic and not opts.topic_pattern:
        fatal("--topic or --topic-pattern required")
    if not opts.topic and not opts.lookupd_http_address:
        fatal("--lookupd-http-address must be specified when no --topic specified")
    opts.work_dir = opts.work_dir or opts.output_dir
    settings = opts.consumer_settings(APP)
    return functools.partial(discover_topics, opts, settings)


# --- file names ---------------------------------------------------------------------------------------

_STRFTIME = set("BbmAadHIMSYypZz%")


def strftime(fmt: str, t: float) -> str:
    """nsq_to_file's strftime: the conversions it knows (%Y %m %d %H %M %S %y %B %b %A %a %I %p %Z %z %%),
    anything else verbatim."""
    local = time.localtime(t)
    out = []
    i = 0
    while i < len(fmt):
        if fmt[i] == "%" and i + 1 < len(fmt) and fmt[i + 1] in _STRFTIME:
            out.append(time.strftime("%" + fmt[i + 1], local))
            i += 2
        else:
            out.append(fmt[i])
            i += 1
    return "".join(out)


def filename_format(opts: Options, topic: str) -> str:
    """The file name template of one topic, with <TOPIC>, <HOST> and <PID> filled in (<REV> and <DATETIME>
    stay). Raises ValueError when rotation, gzip or a work dir need <REV> and the format has none."""
    hostname = socket.gethostname()
    short = hostname.split(".")[0]
    identifier = short
    if opts.host_identifier:
        identifier = opts.host_identifier.replace("<SHORT_HOST>", short).replace("<HOSTNAME>", hostname)
    fmt = opts.filename_format
    if opts.gzip or opts.rotate_size > 0 or opts.rotate_interval > 0 or opts.work_dir != opts.output_dir:
        if "<REV>" not in fmt:
            raise ValueError("missing <REV> in --filename-format when gzip, rotation, or work dir enabled")
    else:
        fmt = fmt.replace("<REV>", "")
    fmt = fmt.replace("<TOPIC>", topic).replace("<HOST>", identifier).replace("<PID>", str(os.getpid()))
    if opts.gzip and not fmt.endswith(".gz"):
        fmt += ".gz"
    return fmt


# --- one topic's file ---------------------------------------------------------------------------------

class FileLogger:
    """The file one topic's messages go to (nsq_to_file's FileLogger), owned by `log_topic`.

    write() appends a message (gzip-compressed when asked); sync() makes everything written so far
    durable (ends the gzip member, fsyncs); close() ends the file and moves it from the work dir to the
    output dir without overwriting anything there (a taken name gets the next <REV>). Blocking file
    calls, as nsq_to_file's: each is one small write, and the fsyncs run in a worker thread.
    """

    def __init__(self, opts: Options, topic: str, fmt: str) -> None:
        self.opts = opts
        self.tag = f"[{topic}/{opts.channel}]"
        self.fmt = fmt
        self.out: int | None = None  # the open file's descriptor
        self.path = ""
        self.filename = ""
        self.rev = 0
        self.opened_at = 0.0
        self.size = 0
        self.gz: zlib._Compress | None = None

    def current_filename(self) -> str:
        return self.fmt.replace("<DATETIME>", strftime(self.opts.datetime_format, time.time()))

    def needs_rotation(self) -> bool:
        if self.out is None:
            return True
        filename = self.current_filename()
        if filename != self.filename:
            log.info("%s new filename %s, rotating...", self.tag, filename)
            return True
        if self.opts.rotate_interval > 0 and time.monotonic() - self.opened_at > self.opts.rotate_interval:
            log.info("%s %.3fs since last open, rotating...", self.tag, time.monotonic() - self.opened_at)
            return True
        if self.opts.rotate_size > 0 and self.size > self.opts.rotate_size:
            log.info("%s %s currently %d bytes (> %d), rotating...", self.tag, self.path, self.size,
                     self.opts.rotate_size)
            return True
        return False

    def write(self, body: bytes) -> None:
        data = body + b"\n"
        self.size += len(data)  # as nsq_to_file: bytes given to the writer (before compression)
        if self.gz is not None:
            data = self.gz.compress(data)
        self._write_all(data)

    def _write_all(self, data: bytes) -> None:
        assert self.out is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self.out, view):]

    async def sync(self) -> None:
        if self.out is None:
            return
        if self.gz is not None:
            # end this gzip member (its trailer's checksum covers the messages about to be FIN'd)
            self._write_all(self.gz.flush(zlib.Z_FINISH))
            self.gz = self._gzip()
        await trio.to_thread.run_sync(os.fsync, self.out)

    def _gzip(self) -> zlib._Compress:
        return zlib.compressobj(self.opts.gzip_level, zlib.DEFLATED, 16 + zlib.MAX_WBITS)

    async def close(self) -> None:
        if self.out is None:
            return
        if self.gz is not None:
            self._write_all(self.gz.flush(zlib.Z_FINISH))
            self.gz = None
        fd, self.out = self.out, None
        await trio.to_thread.run_sync(os.fsync, fd)
        os.close(fd)
        if self.opts.work_dir != self.opts.output_dir:
            self._move_to_output()

    def _output_path(self, path: str) -> str:
        return os.path.join(self.opts.output_dir, os.path.relpath(path, self.opts.work_dir))

    def _move_to_output(self) -> None:
        src = self.path
        dst = self._output_path(src)
        log.info("%s moving finished file %s to %s", self.tag, src, dst)
        rev = self.rev
        while True:
            try:
                os.link(src, dst)  # never overwrites, as nsq_to_file's exclusiveRename
                os.remove(src)
                return
            except FileExistsError:
                log.warning("%s destination file already exists: %s", self.tag, dst)
                rev += 1
                dst = self._output_path(os.path.join(self.opts.work_dir, self.filename.replace("<REV>", f"-{rev:06d}")))

    def open_next(self) -> None:
        """Open the file the next message goes to (nsq_to_file's updateFile, after close())."""
        filename = self.current_filename()
        self.rev = 0 if filename != self.filename else self.rev + 1
        self.filename = filename
        self.opened_at = time.monotonic()
        full = os.path.join(self.opts.work_dir, filename)
        os.makedirs(os.path.dirname(full) or ".", mode=0o770, exist_ok=True)
        exclusive = self.opts.gzip or self.opts.rotate_interval > 0
        while True:
            path = full.replace("<REV>", f"-{self.rev:06d}")
            if self.opts.work_dir != self.opts.output_dir:
                out_path = self._output_path(path)
                os.makedirs(os.path.dirname(out_path) or ".", mode=0o770, exist_ok=True)
                if os.path.exists(out_path):
                    log.warning("%s output file already exists: %s", self.tag, out_path)
                    self.rev += 1
                    continue
            flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_APPEND)
            try:
                fd = os.open(path, flags, 0o666)
            except FileExistsError:
                log.warning("%s working file already exists: %s", self.tag, path)
                self.rev += 1
                continue
            log.info("%s opening %s", self.tag, path)
            self.size = os.fstat(fd).st_size
            if self.opts.rotate_size > 0 and self.size > self.opts.rotate_size:
                log.info("%s %s currently %d bytes (> %d), rotating...", self.tag, path, self.size,
                         self.opts.rotate_size)
                os.close(fd)
                self.rev += 1
                continue
            self.out, self.path = fd, path
            self.gz = self._gzip() if self.opts.gzip else None
            return


async def log_topic(opts: Options, settings: dict, topic: str, stop: trio.Event, hup: Callable[[], int]) -> None:
    """One topic: a consumer whose handlers hand each message to the writer and wait until a sync
    has made it durable; then the consumer FINs it."""
    from trio_nsq.client import Consumer

    try:
        fmt = filename_format(opts, topic)
    except ValueError as exc:
        log.error("couldn't create logger for new topic %s: %s", topic, exc)
        return
    logger = FileLogger(opts, topic, fmt)
    incoming: list[tuple[Message, trio.Event]] = []  # received, for the router to write
    held: list[trio.Event] = []  # written and not yet synced: set once they are on disk
    wake = trio.Event()
    sync_at = max(1, int(opts.max_in_flight * 0.85))  # go-nsq's "starved": the RDY is nearly all held
    closing = finished = False

    async def handle(message: Message) -> None:
        synced = trio.Event()
        incoming.append((message, synced))
        wake.set()
        await synced.wait()  # returning FINs it: only once it is on disk

    async def sync_held() -> None:
        nonlocal held
        if held:
            log.info("%s syncing %d records to disk", logger.tag, len(held))
            await logger.sync()
            done, held = held, []
            for event in done:
                event.set()

    async def router() -> None:
        """nsq_to_file's router: the one writer of the file, in the order messages were published."""
        nonlocal incoming, wake
        last_hup = hup()
        next_sync = trio.current_time() + opts.sync_interval
        while True:
            with trio.move_on_at(next_sync):
                await wake.wait()
            wake = trio.Event()
            tick = trio.current_time() >= next_sync
            if tick:
                next_sync = trio.current_time() + opts.sync_interval
            # handlers woken together may run in any order: what arrived together is written by
            # nsqd's timestamp, as one reader of one nsqd would see it
            batch = sorted(incoming, key=lambda item: (item[0].timestamp, item[0].id))
            incoming = []
            if hup() != last_hup:
                last_hup = hup()
                await sync_held()
                await logger.close()
            if tick and not batch and logger.out is not None and logger.needs_rotation():
                await sync_held()
                await logger.close()
                if not opts.skip_empty_files:
                    logger.open_next()
            for message, synced in batch:
                if logger.needs_rotation():
                    await sync_held()  # what is held is in the old file
                    await logger.close()
                    logger.open_next()
                logger.write(message.body)
                held.append(synced)
            if tick or closing or len(held) >= sync_at:
                await sync_held()
            if finished:
                await sync_held()
                await logger.close()
                return

    # up to max_in_flight handlers wait on their message's event until a sync
    async with Consumer(topic, opts.channel, handle, nsqd_tcp_addresses=opts.nsqd_tcp_address,
                        lookupd_http_addresses=opts.lookupd_http_address, concurrency=settings["max_in_flight"],
                        **settings) as consumer:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(router)
            await stop.wait()
            # no more messages come (CLS); every one held is synced and FIN'd, then the file is closed
            closing = True
            wake.set()
            await consumer.close()
            finished = True
            wake.set()


async def discover_topics(opts: Options, settings: dict, stop: trio.Event) -> int:
    """nsq_to_file's TopicDiscoverer: a logger per --topic, or per topic lookupd lists that matches
    --topic-pattern (asked every --topic-refresh)."""
    pattern = re.compile(opts.topic_pattern) if opts.topic_pattern else None
    started: set[str] = set()
    hups = 0

    async with trio.open_nursery() as nursery:
        def start(topics: list[str]) -> None:
            for topic in topics:
                if topic in started:
                    continue
                if pattern is not None and not pattern.search(topic):
                    log.warning("skipping topic %s (doesn't match pattern %s)", topic, opts.topic_pattern)
                    started.add(topic)
                    continue
                started.add(topic)
                nursery.start_soon(log_topic, opts, settings, topic, stop, lambda: hups)

        hup_scope = trio.CancelScope()

        async def on_hup() -> None:
            nonlocal hups
            with hup_scope, trio.open_signal_receiver(signal.SIGHUP) as signals:
                async for _ in signals:
                    hups += 1

        nursery.start_soon(on_hup)
        start(opts.topic)
        if not opts.topic:
            import httpx

            timeout = httpx.Timeout(opts.http_client_request_timeout, connect=opts.http_client_connect_timeout)
            async with httpx.AsyncClient(timeout=timeout) as client:
                while not stop.is_set():
                    with trio.move_on_after(opts.topic_refresh):
                        await stop.wait()
                    if stop.is_set():
                        break
                    topics: list[str] = []
                    for lookupd in opts.lookupd_http_address:
                        try:
                            response = await client.get(f"http://{lookupd}/topics",
                                                        headers={"Accept": "application/vnd.nsq; version=1.0"})
                            topics += response.json().get("topics") or []
                        except (httpx.HTTPError, ValueError) as exc:
                            log.error("could not retrieve topic list: %s", exc)
                    start(sorted(set(topics)))
        await stop.wait()
        hup_scope.cancel()  # the loggers close their files and end
    return 0


main = command(Options, APP, setup)


if __name__ == "__main__":
    raise SystemExit(main())
