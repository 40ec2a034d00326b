"""nsq_to_http: deliver a topic's messages to HTTP endpoints, as nsqio/nsq's apps/nsq_to_http.

    nsq_to_http --topic=T --nsqd-tcp-address=127.0.0.1:4150 --post=http://host/path [--post=...]
    nsq_to_http --topic=T --lookupd-http-address=127.0.0.1:4161 --get='http://host/path?data=%s'

--post sends the body (Content-Type --content-type); --get puts it, query-escaped, in place of the one
`%s`. --mode picks the endpoint (see trio_nsq/apps/relay.py); -n requests run at once. A message is
FIN'd only once its endpoint answered 2xx (GET: 200); a failure (refused, timed out, another status)
REQs it with a growing delay and backs the consumer off, so nothing is lost while an endpoint is away.
--consumer-opt max_attempts defaults to 0 (unlimited) here, where go-nsq's default 5 would drop a
message after five failed deliveries. SIGINT/SIGTERM close cleanly.
"""

from __future__ import annotations

import functools
import logging
import random
import ssl
import time
import urllib.parse
from contextlib import AsyncExitStack

import attrs
import trio

from trio_nsq.apps.app import ConsumerOptions, Main, command, fatal
from trio_nsq.apps.relay import HostPool, StatusTimer
from trio_nsq.shared.options import option
from trio_nsq.shared.version import VERSION

APP = "nsq_to_http"
DEFAULT_CONTENT_TYPE = "application/octet-stream"
log = logging.getLogger("trio_nsq.apps")


@attrs.define
class Options(ConsumerOptions):
    channel: str = option("nsq_to_http", "nsq channel")
    content_type: str = option(DEFAULT_CONTENT_TYPE, "the Content-Type used for POST requests")
    get: list = option([], "HTTP address to make a GET request to. '%s' will be printf replaced with data (may be "
                           "given multiple times)", repeat=True)
    header: list = option([], "Custom header for HTTP requests (may be given multiple times)", repeat=True)
    http_client_connect_timeout: float = option(2.0, "timeout for HTTP connect", kind="duration")
    http_client_request_timeout: float = option(20.0, "timeout for HTTP request", kind="duration")
    mode: str = option("hostpool", "the upstream request mode options: round-robin, hostpool (default), "
                                   "epsilon-greedy")
    n: int = option(100, "number of concurrent publishers")
    post: list = option([], "HTTP address to make a POST request to.  data will be in the body (may be given "
                            "multiple times)", repeat=True)
    sample: float = option(1.0, "% of messages to publish (float b/w 0 -> 1)", kind="float")
    status_every: int = option(250, "the # of requests between logging status (per handler), 0 disables")
    topic: str = option("", "nsq topic")


def parse_headers(values: list[str]) -> dict[str, str]:
    """--header `Key: value` (nsq_to_http splits at the first colon); ValueError for a bad one."""
    headers = {}
    for text in values:
        key, sep, value = text.partition(":")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"invalid header: {text!r}")
        headers[key.strip()] = value.strip()
    return headers


def setup(opts: Options) -> Main:
    try:
        headers = parse_headers(opts.header)
    except ValueError:
        fatal("--header value format should be 'key=value'")
    if not opts.topic or not opts.channel:
        fatal("--topic and --channel are required")
    if opts.content_type != DEFAULT_CONTENT_TYPE:
        if not opts.post:
            fatal("--content-type only used with --post")
        if not opts.content_type:
            fatal("--content-type requires a value when used")
    opts.check_sources()
    if not opts.get and not opts.post:
        fatal("--get or --post required")
    if opts.get and opts.post:
        fatal("use --get or --post not both")
    if any(get.count("%s") != 1 for get in opts.get):
        fatal("invalid GET address - must be a printf string")
    if not 0.0 <= opts.sample <= 1.0:
        fatal("ERROR: --sample must be between 0.0 and 1.0")
    consumer = opts.consumer_settings(APP, max_attempts=0)
    return functools.partial(deliver, opts, consumer, headers)


class DeliveryError(Exception):
    """An endpoint that did not accept a message (the consumer REQs it)."""


async def deliver(opts: Options, consumer_settings: dict, headers: dict[str, str], stop: trio.Event) -> int:
    import httpx

    from trio_nsq.client import Consumer

    addresses = opts.post or opts.get
    mode = opts.mode if opts.mode in ("round-robin", "hostpool", "epsilon-greedy") else "all"
    pool = HostPool(addresses, mode)
    aggregate = StatusTimer(opts.status_every, "[aggregate]:")
    per_address = {a: StatusTimer(opts.status_every if len(pool.hosts) > 1 else 0, f"[{a}]:") for a in pool.hosts}
    headers = {"User-Agent": f"nsq_to_http v{VERSION}", **headers}
    if opts.post:
        headers["Content-Type"] = opts.content_type
    timeout = httpx.Timeout(opts.http_client_request_timeout, connect=opts.http_client_connect_timeout)
    # one client (one keep-alive connection per endpoint) per concurrent publisher: httpx's pool scans
    # every connection for each request, which with -n 100 in one pool took most of the time
    limits = httpx.Limits(max_connections=len(pool.hosts), max_keepalive_connections=len(pool.hosts))
    idle: list[httpx.AsyncClient] = []
    tls = ssl.create_default_context()  # one for all: each client making its own took seconds for -n 100

    async with AsyncExitStack() as stack:
        for _ in range(max(1, opts.n)):
            idle.append(await stack.enter_async_context(
                httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers, verify=tls)))

        async def send(address: str, body: bytes) -> None:
            started = time.monotonic()
            client = idle.pop()  # there are as many as handlers run at once (the consumer's concurrency)
            try:
                if opts.post:
                    response = await client.post(address, content=body)
                    ok = 200 <= response.status_code < 300
                else:
                    response = await client.get(address.replace("%s", urllib.parse.quote_plus(body), 1))
                    ok = response.status_code == 200
            except httpx.HTTPError as exc:
                raise DeliveryError(f"{address}: {exc!r}") from None
            finally:
                idle.append(client)
            if not ok:
                raise DeliveryError(f"got status code {response.status_code}")
            per_address[address].status(started)

        async def handle(message) -> None:
            if opts.sample < 1.0 and random.random() > opts.sample:
                return
            started = time.monotonic()
            if mode == "all":
                for address in pool.hosts:
                    await send(address, message.body)
            else:
                address = pool.pick()
                try:
                    await send(address, message.body)
                except DeliveryError:
                    pool.mark(address, False)
                    raise  # the consumer REQs it and backs off
                pool.mark(address, True)
            aggregate.status(started)

        async with Consumer(opts.topic, opts.channel, handle, nsqd_tcp_addresses=opts.nsqd_tcp_address,
                            lookupd_http_addresses=opts.lookupd_http_address, concurrency=max(1, opts.n),
                            **consumer_settings) as consumer:
            await stop.wait()
            await consumer.close()
    return 0


main = command(Options, APP, setup)


if __name__ == "__main__":
    raise SystemExit(main())
