"""nsq_to_nsq: relay topics from one NSQ cluster to other nsqd, as nsqio/nsq's apps/nsq_to_nsq.

    nsq_to_nsq --topic=T --nsqd-tcp-address=SRC:4150 --destination-nsqd-tcp-address=DST:4150
               [--destination-topic=U] [--mode=hostpool|round-robin|epsilon-greedy]
               [--require-json-field=F [--require-json-value=V]] [--whitelist-json-field=F ...]

A message is FIN'd only once a destination answered OK to its PUB; a publish that fails (destination
down past the producer's reconnect timeout, or refusing) REQs the message with a growing delay and
backs the consumer off, so nothing is lost while a destination is away. Unlike go-nsq's default of 5,
--consumer-opt max_attempts defaults to 0 (unlimited) here: a message is never dropped for its
destination being down. SIGINT/SIGTERM close cleanly: what was received is published and FIN'd.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from contextlib import AsyncExitStack

import attrs
import trio

from trio_nsq.apps.app import ConsumerOptions, Main, client_settings, command, fatal
from trio_nsq.apps.relay import HostPool, StatusTimer
from trio_nsq.shared.names import is_valid_channel_name, is_valid_topic_name
from trio_nsq.shared.options import option

APP = "nsq_to_nsq"
log = logging.getLogger("trio_nsq.apps")


@attrs.define
class Options(ConsumerOptions):
    channel: str = option("nsq_to_nsq", "nsq channel")
    # ConsumerOptions' own, but Go's nsq_to_nsq words its help with a "see"
    consumer_opt: list = option([], "option to passthrough to nsq.Consumer (may be given multiple times, "
                                    "see http://godoc.org/github.com/nsqio/go-nsq#Config)", repeat=True)
    destination_nsqd_tcp_address: list = option([], "destination nsqd TCP address (may be given multiple times)",
                                                repeat=True)
    destination_topic: str = option("", "use this destination topic for all consumed topics (default is consumed "
                                        "topic name)")
    mode: str = option("hostpool", "the upstream request mode options: round-robin, hostpool (default), "
                                   "epsilon-greedy")
    producer_opt: list = option([], "option to passthrough to nsq.Producer (may be given multiple times, "
                                    "see http://godoc.org/github.com/nsqio/go-nsq#Config)", repeat=True)
    require_json_field: str = option("", "for JSON messages: only pass messages that contain this field")
    require_json_value: str = option("", "for JSON messages: only pass messages in which the required field has "
                                         "this value")
    status_every: int = option(250, "the # of requests between logging status (per destination), 0 disables")
    topic: list = option([], "nsq topic (may be given multiple times)", repeat=True)
    whitelist_json_field: list = option([], "for JSON messages: pass this field (may be given multiple times)",
                                        repeat=True)


def setup(opts: Options) -> Main:
    if not opts.topic or not opts.channel:
        fatal("--topic and --channel are required")
    if not all(is_valid_topic_name(t) for t in opts.topic):
        fatal("--topic is invalid")
    if opts.destination_topic and not is_valid_topic_name(opts.destination_topic):
        fatal("--destination-topic is invalid")
    if not is_valid_channel_name(opts.channel):
        fatal("--channel is invalid")
    opts.check_sources()
    if not opts.destination_nsqd_tcp_address:
        fatal("--destination-nsqd-tcp-address required")
    consumer = opts.consumer_settings(APP, max_attempts=0)
    producer = client_settings(opts.producer_opt, APP, consumer=False)
    return functools.partial(relay, opts, consumer, producer)


class Backoff(Exception):
    """A JSON message without the required field when a value is required: REQ and back off, as Go's."""


def json_filter(opts: Options, body: bytes) -> bytes | None:
    """--require-json-field/--require-json-value/--whitelist-json-field: the body to publish, None to
    drop the message (FIN without publishing), Backoff to REQ it. Without those flags, the body."""
    if not opts.require_json_field and not opts.whitelist_json_field:
        return body
    try:
        js = json.loads(body)
        if not isinstance(js, dict):
            raise ValueError("not an object")
    except ValueError:
        log.error("ERROR: Unable to decode json: %s", body[:1000].decode(errors="replace"))
        return None
    if opts.require_json_field:
        if opts.require_json_field not in js:
            if opts.require_json_value:
                log.error("ERROR: missing field to check required value")
                raise Backoff()
            return None
        if opts.require_json_value:
            value = js[opts.require_json_field]
            if isinstance(value, str):
                if value != opts.require_json_value:
                    return None
            else:
                try:
                    wanted = float(opts.require_json_value)
                except ValueError:
                    return None
                if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) != wanted:
                    return None
    if not opts.whitelist_json_field:
        return body
    kept = {key: js[key] for key in opts.whitelist_json_field if key in js}
    # Go's encoding/json: keys sorted, no spaces, floats with a whole value written as integers
    kept = {k: (int(v) if isinstance(v, float) and v.is_integer() else v) for k, v in kept.items()}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


async def relay(opts: Options, consumer_settings: dict, producer_settings: dict, stop: trio.Event) -> int:
    from trio_nsq.client import Consumer, NSQConnectionError, NSQError, Producer

    pool = HostPool(opts.destination_nsqd_tcp_address, opts.mode)
    aggregate = StatusTimer(opts.status_every, "[aggregate]:")
    per_host = {h: StatusTimer(opts.status_every if len(pool.hosts) > 1 else 0, f"[{h}]:") for h in pool.hosts}

    async with AsyncExitStack() as stack:
        producers = {h: await stack.enter_async_context(Producer(h, **producer_settings)) for h in pool.hosts}

        def handler_for(topic: str):
            destination = opts.destination_topic or topic

            async def handle(message) -> None:
                body = json_filter(opts, message.body)
                if body is None:
                    return
                started = time.monotonic()
                host = pool.pick()
                try:
                    await producers[host].pub(destination, body)
                except (NSQError, NSQConnectionError):
                    pool.mark(host, False)
                    raise  # the consumer REQs it and backs off
                pool.mark(host, True)
                per_host[host].status(started)
                aggregate.status(started)

            return handle

        consumers = []
        for topic in opts.topic:
            consumers.append(await stack.enter_async_context(Consumer(
                topic, opts.channel, handler_for(topic), nsqd_tcp_addresses=opts.nsqd_tcp_address,
                lookupd_http_addresses=opts.lookupd_http_address, **consumer_settings)))
        await stop.wait()
        async with trio.open_nursery() as nursery:
            for consumer in consumers:
                nursery.start_soon(consumer.close)
    return 0


main = command(Options, APP, setup)


if __name__ == "__main__":
    raise SystemExit(main())
