"""nsq_stat: poll /stats of every nsqd that has a topic and print a channel's totals, as nsqio/nsq's
apps/nsq_stat.

    nsq_stat --topic=T --channel=C --nsqd-http-address=127.0.0.1:4151 [--interval=2s] [--count=N]
    nsq_stat --topic=T --channel=C --lookupd-http-address=127.0.0.1:4161

Every --interval it asks the brokers (given, or the topic's producers according to lookupd) for the
channel's stats, adds them up over the brokers and prints one line: ingress and egress per second over
the interval, depth (total, memory, disk), in flight, deferred, requeued, timed out, messages, clients;
a header every 25 lines. The first poll only takes the baseline. With --count=N it exits 0 after N lines;
SIGINT/SIGTERM exit 0. A broker or lookupd that cannot be asked, or a channel no broker has, exits 1.
"""

from __future__ import annotations

import functools
import sys

import attrs
import trio

from trio_nsq.apps.app import Main, command, fatal
from trio_nsq.shared.options import option

APP = "nsq_stat"
FIELDS = ("depth", "backend_depth", "in_flight_count", "deferred_count", "requeue_count", "timeout_count",
          "message_count", "client_count")


@attrs.define
class Options:
    channel: str = option("", "NSQ channel")
    count: int = option(0, "number of reports")
    http_client_connect_timeout: float = option(2.0, "timeout for HTTP connect", kind="duration")
    http_client_request_timeout: float = option(5.0, "timeout for HTTP request", kind="duration")
    interval: float = option(2.0, "duration of time between polling/printing output", kind="duration")
    lookupd_http_address: list = option([], "lookupd HTTP address (may be given multiple times)", repeat=True)
    nsqd_http_address: list = option([], "nsqd HTTP address (may be given multiple times)", repeat=True)
    topic: str = option("", "NSQ topic")


def setup(opts: Options) -> Main:
    if not opts.topic or not opts.channel:
        fatal("--topic and --channel are required")
    for name in ("interval", "http_client_connect_timeout", "http_client_request_timeout"):
        if getattr(opts, name) <= 0:
            fatal(f"--{name.replace('_', '-')} should be positive")
    if opts.count < 0:
        fatal("--count should be positive")
    if not opts.nsqd_http_address and not opts.lookupd_http_address:
        fatal("--nsqd-http-address or --lookupd-http-address required")
    if opts.nsqd_http_address and opts.lookupd_http_address:
        fatal("use --nsqd-http-address or --lookupd-http-address not both")
    for flag, addresses in (("--nsqd-http-address", opts.nsqd_http_address),
                            ("--lookupd-http-address", opts.lookupd_http_address)):
        if any(a.startswith("http") for a in addresses):
            fatal(f"{flag} error - address should not contain scheme")
    return functools.partial(stat_loop, opts)


HEADER = ("%s+%s+%s\n" % ("------rate------", "----------------depth----------------",
                          "--------------metadata---------------")
          + "%7s %7s | %7s %7s %7s %5s %5s | %7s %7s %12s %7s\n" % (
              "ingress", "egress", "total", "mem", "disk", "inflt", "def", "req", "t-o", "msgs", "clients"))


def row(new: dict[str, int], old: dict[str, int], interval: float) -> str:
    """One line of the table: nsq_stat's columns and widths (rates truncated toward zero, as Go's int64)."""
    received = new["message_count"] - old["message_count"]
    ingress = int(received / interval)
    egress = int((received - (new["depth"] - old["depth"])) / interval)
    return "%7d %7d | %7d %7d %7d %5d %5d | %7d %7d %12d %7d\n" % (
        ingress, egress, new["depth"], new["depth"] - new["backend_depth"], new["backend_depth"],
        new["in_flight_count"], new["deferred_count"], new["requeue_count"], new["timeout_count"],
        new["message_count"], new["client_count"])


def add_channel(stats: list[dict], topic: str, channel: str) -> dict[str, int] | None:
    """The channel's counters summed over every broker's /stats answer (None: no broker has it)."""
    total: dict[str, int] | None = None
    for answer in stats:
        for t in answer.get("topics") or []:
            if t.get("topic_name") != topic:
                continue
            for c in t.get("channels") or []:
                if c.get("channel_name") == channel:
                    total = total or dict.fromkeys(FIELDS, 0)
                    for field in FIELDS:
                        total[field] += int(c.get(field) or 0)
    return total


async def stat_loop(opts: Options, stop: trio.Event) -> int:
    import httpx

    from trio_nsq.shared.addresses import join_host_port

    timeout = httpx.Timeout(opts.http_client_request_timeout, connect=opts.http_client_connect_timeout)
    headers = {"Accept": "application/vnd.nsq; version=1.0"}

    async def get_json(client: httpx.AsyncClient, url: str, params: dict) -> dict:
        try:
            response = await client.get(url, params=params, headers=headers)
            response.raise_for_status()
            return response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise OSError(f"{url}: {exc}") from None

    async def producers(client: httpx.AsyncClient) -> list[str]:
        if not opts.lookupd_http_address:
            return list(opts.nsqd_http_address)
        found: dict[str, None] = {}
        errors = []
        for lookupd in opts.lookupd_http_address:
            try:
                data = await get_json(client, f"http://{lookupd}/lookup", {"topic": opts.topic})
            except OSError as exc:
                errors.append(exc)
                continue
            for p in data.get("producers") or []:
                found[join_host_port(p["broadcast_address"], int(p["http_port"]))] = None
        if errors and len(errors) == len(opts.lookupd_http_address):
            fatal(f"ERROR: failed to get topic producers - {errors[0]}")
        return list(found)

    with trio.CancelScope() as scope:
        async with httpx.AsyncClient(timeout=timeout) as client, trio.open_nursery() as nursery:
            async def watch_stop() -> None:
                await stop.wait()
                scope.cancel()

            nursery.start_soon(watch_stop)
            old: dict[str, int] | None = None
            i = 0
            while not opts.count or opts.count >= i:
                params = {"format": "json", "topic": opts.topic, "channel": opts.channel, "include_clients": "false"}
                stats = []
                for address in await producers(client):
                    try:
                        stats.append(await get_json(client, f"http://{address}/stats", params))
                    except OSError as exc:
                        fatal(f"ERROR: failed to get nsqd stats - {exc}")
                new = add_channel(stats, opts.topic, opts.channel)
                if new is None:
                    fatal(f"ERROR: failed to find channel({opts.channel}) in stats metadata for topic({opts.topic})")
                text = HEADER if i % 25 == 0 else ""
                if old is not None:
                    text += row(new, old, opts.interval)
                sys.stdout.write(text)
                sys.stdout.flush()
                old = new
                i += 1
                if not opts.count or opts.count >= i:  # nsq_stat sleeps once more after the last line
                    await trio.sleep(opts.interval)
            nursery.cancel_scope.cancel()
    return 0


main = command(Options, APP, setup)


if __name__ == "__main__":
    raise SystemExit(main())
