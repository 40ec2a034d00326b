"""The connector's options, checked at planning time against the DataFrame's schema.

Spark hands a data source its options lower-cased, every value a string. Everything a task needs is
turned here into one frozen, picklable `WriteSettings` (the writer is pickled into every task), and every
mistake is a `ValueError` saying what to change, raised before any task runs.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import TypeVar

from pyspark.sql.types import BinaryType, StringType, StructType

from trio_nsq.shared.names import is_valid_topic_name
from trio_nsq.spark.publisher import DEFAULT_MAX_BODY_SIZE, host_port, nodes_from_lookupd

# option name -> (default, meaning); the README's options table says the same
OPTIONS = {
    "topic": (None, "topic for every row; without it each row's `topic` column is used"),
    "nsqd_http_address": (None, "nsqd HTTP address(es), comma-separated: host:4151[,host2:4151]"),
    "lookupd_http_address": (None, "nsqlookupd HTTP address(es), comma-separated: brokers come from /nodes"),
    "batch_size": ("5000", "messages per /mpub request, at most"),
    "max_body_size": (str(DEFAULT_MAX_BODY_SIZE), "bytes per /mpub request, at most (also capped by the broker's)"),
    "max_retries": ("8", "retries of a request no broker took (connection refused, timeout, HTTP 5xx)"),
    "retry_backoff": ("0.5", "seconds before the first retry; doubles on each retry"),
    "retry_backoff_max": ("5", "longest wait between two retries, in seconds"),
    "timeout": ("30", "seconds to wait for a broker to answer one request"),
    "idempotent": ("true", "key every /mpub request (Idempotency-Key) so that Spark running the same work again "
                           "publishes it once, on brokers that support it; false: at least once"),
    "key_field": (None, "JSON rows only: add this field, holding an idempotency key"),
}
# set by Spark itself, not by the user of this data source
SPARK_OPTIONS = {"checkpointlocation"}

TOPIC_RULE = "1-64 characters of [.a-zA-Z0-9_-], optionally ending in #ephemeral"


@dataclass(frozen=True)
class WriteSettings:
    """What a task needs, and nothing else: plain values only, since the writer is pickled to every task."""

    topic: str | None
    has_value: bool
    key_field: str | None
    addresses: tuple[str, ...]
    batch_size: int
    max_body_size: int
    max_retries: int
    retry_backoff: float
    retry_backoff_max: float
    timeout: float
    idempotent: bool = True


N = TypeVar("N", int, float)


def _number(options: dict[str, str], name: str, kind: type[N], minimum: float) -> N:
    text = options.get(name, OPTIONS[name][0])
    value: N | None = None
    try:
        value = None if text is None else kind(text)
    except ValueError:
        pass
    if value is None or value < minimum:
        raise ValueError(f"nsq: option {name}={text!r} must be {'an integer' if kind is int else 'a number'} "
                         f">= {minimum}; {OPTIONS[name][1]}")
    return value


def _addresses(options: dict[str, str], name: str, default_port: int) -> list[str]:
    addresses = [a.strip() for a in (options.get(name) or "").split(",") if a.strip()]
    for address in addresses:
        try:
            host_port(address, default_port)
        except ValueError as exc:
            raise ValueError(f"nsq: option {name}: {address!r} is not an address ({exc}); "
                             f"write host:port[,host2:port]") from None
    return addresses


def write_settings(options: dict[str, str], schema: StructType) -> WriteSettings:
    """Check the options against the schema; raise ValueError telling what to change."""
    options = {k.lower(): v for k, v in options.items()}
    if "path" in options:
        raise ValueError("nsq: a topic is not a path: call .save() with no argument (.start() when streaming) "
                         "and set .option('topic', ...)")
    unknown = sorted(set(options) - set(OPTIONS) - SPARK_OPTIONS)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, OPTIONS, n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(f"nsq: unknown option {', '.join(hints)}; the options are {', '.join(OPTIONS)}")

    fields = {f.name: f.dataType for f in schema.fields}
    topic = options.get("topic") or None
    if topic is not None and not is_valid_topic_name(topic):
        raise ValueError(f"nsq: invalid topic {topic!r}: topic names are {TOPIC_RULE}")
    if topic is None:
        if "topic" not in fields:
            raise ValueError("nsq: no topic: set .option('topic', 'name'), or give the DataFrame a string "
                             "'topic' column naming each row's topic")
        if not isinstance(fields["topic"], StringType):
            raise ValueError(f"nsq: the 'topic' column is {fields['topic'].simpleString()}, it must be a string: "
                             "cast it with col('topic').cast('string'), or set .option('topic', ...)")
    has_value = "value" in fields
    if has_value and not isinstance(fields["value"], (StringType, BinaryType)):
        raise ValueError(f"nsq: the 'value' column is {fields['value'].simpleString()}, it must be string or "
                         "binary: cast it (col('value').cast('string')), build it with "
                         "to_json(struct(...)).alias('value'), or rename it to send each row as JSON")
    key_field = options.get("key_field") or None
    if key_field is not None:
        if has_value:
            raise ValueError("nsq: key_field adds a field to rows sent as JSON, but this DataFrame has a 'value' "
                             "column (sent as it is): drop the option, or put your own key in the value")
        if key_field in fields:
            raise ValueError(f"nsq: key_field {key_field!r} is already a column: choose another name")
    if not fields:
        raise ValueError("nsq: the DataFrame has no columns: give it a 'value' column, or columns to send as JSON")

    batch_size = _number(options, "batch_size", int, 1)
    max_body_size = _number(options, "max_body_size", int, 64)
    max_retries = _number(options, "max_retries", int, 0)
    retry_backoff = _number(options, "retry_backoff", float, 0)
    retry_backoff_max = _number(options, "retry_backoff_max", float, 0)
    timeout = _number(options, "timeout", float, 0.1)

    addresses = _addresses(options, "nsqd_http_address", 4151)
    lookupds = _addresses(options, "lookupd_http_address", 4161)
    if lookupds:
        found = nodes_from_lookupd(lookupds)
        if not found and not addresses:
            raise ValueError(f"nsq: lookupd {', '.join(lookupds)} knows no nsqd (empty /nodes): start nsqd with "
                             "--lookupd-tcp-address pointing at it, or set .option('nsqd_http_address', ...)")
        addresses += found
    if not addresses:
        raise ValueError("nsq: no broker: set .option('nsqd_http_address', 'host:4151[,host2:4151]') or "
                         ".option('lookupd_http_address', 'host:4161')")

    idempotent = options.get("idempotent", "true").strip().lower()
    if idempotent not in ("true", "false"):
        raise ValueError(f"nsq: option idempotent={options['idempotent']!r} must be true or false; "
                         f"{OPTIONS['idempotent'][1]}")

    return WriteSettings(
        idempotent=idempotent == "true",
        topic=topic,
        has_value=has_value,
        key_field=key_field,
        addresses=tuple(dict.fromkeys(addresses)),
        batch_size=batch_size,
        max_body_size=max_body_size,
        max_retries=max_retries,
        retry_backoff=retry_backoff,
        retry_backoff_max=retry_backoff_max,
        timeout=timeout,
    )


# the streaming source's options (spark.readStream.format("nsq")); the README's reader table says the same
READ_OPTIONS = {
    "topic": (None, "the topic to read"),
    "channel": (None, "the channel to read; queries sharing a channel share its messages"),
    "nsqd_tcp_address": (None, "nsqd TCP address(es), comma-separated: host:4150[,host2:4150]"),
    "lookupd_http_address": (None, "nsqlookupd HTTP address(es), comma-separated: the topic's brokers are "
                                   "found there and polled for, as a consumer does"),
    "max_messages_per_batch": ("100000", "messages per micro-batch, at most"),
    "max_bytes_per_batch": ("67108864", "bytes of message bodies per micro-batch, at most (one message more "
                                        "if it alone is larger)"),
    "max_in_flight": ("200000", "messages held unacknowledged, at most, over every broker (each broker gets "
                                "as many connections as its --max-rdy-count needs for its share)"),
    "msg_timeout": (None, "milliseconds nsqd waits for a TOUCH or FIN before giving a message to someone "
                          "else (IDENTIFY msg_timeout); default: the broker's --msg-timeout"),
}
# the batch read's (spark.read.format("nsq")): the same, with limits for the whole read
BATCH_READ_OPTIONS = {
    **{k: v for k, v in READ_OPTIONS.items() if k not in ("max_messages_per_batch", "max_bytes_per_batch",
                                                           "max_in_flight")},
    "max_messages": ("100000", "messages to read, at most"),
    "max_bytes": ("67108864", "bytes of message bodies to read, at most (one message more per task if it "
                              "alone is larger)"),
    "partitions_per_broker": ("2", "tasks reading each broker, sharing its part of max_messages"),
    "idle_timeout": ("1000", "milliseconds without a message after which a task considers its broker drained"),
}


def read_settings(options: dict[str, str], batch: bool = False):
    """Check the options of the streaming source (or, with `batch`, of the batch read); raise ValueError
    telling what to change."""
    from trio_nsq.shared.names import is_valid_channel_name
    from trio_nsq.spark.source import ReadSettings

    known = BATCH_READ_OPTIONS if batch else READ_OPTIONS
    options = {k.lower(): v for k, v in options.items()}
    unknown = sorted(set(options) - set(known) - SPARK_OPTIONS - {"path"})
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, known, n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(f"nsq: unknown option {', '.join(hints)} for reading; the options are "
                         f"{', '.join(known)}")
    topic, channel = options.get("topic") or options.get("path"), options.get("channel")
    if not topic or not is_valid_topic_name(topic):
        raise ValueError(f"nsq: set .option('topic', ...) to a valid topic ({TOPIC_RULE}); got {topic!r}")
    if not channel or not is_valid_channel_name(channel):
        raise ValueError(f"nsq: set .option('channel', ...) to a valid channel ({TOPIC_RULE}); got {channel!r}")
    nsqds = _addresses(options, "nsqd_tcp_address", 4150)
    lookupds = _addresses(options, "lookupd_http_address", 4161)
    if not nsqds and not lookupds:
        raise ValueError("nsq: no broker: set .option('nsqd_tcp_address', 'host:4150[,host2:4150]') or "
                         ".option('lookupd_http_address', 'host:4161')")

    def number(name: str, minimum: int) -> int:
        text = options.get(name, known[name][0])
        if text is None or not text.strip().isdigit() or int(text) < minimum:
            raise ValueError(f"nsq: option {name}={text!r} must be an integer >= {minimum}; {known[name][1]}")
        return int(text)

    if batch:
        max_messages = number("max_messages", 1)
        return ReadSettings(
            topic=topic, channel=channel, nsqd_tcp_addresses=tuple(dict.fromkeys(nsqds)),
            lookupd_http_addresses=tuple(dict.fromkeys(lookupds)), max_messages_per_batch=max_messages,
            max_bytes_per_batch=number("max_bytes", 1), max_in_flight=max_messages,
            msg_timeout=number("msg_timeout", 1000) if options.get("msg_timeout") else None), \
            (number("partitions_per_broker", 1), number("idle_timeout", 1) / 1000)
    return ReadSettings(
        topic=topic, channel=channel, nsqd_tcp_addresses=tuple(dict.fromkeys(nsqds)),
        lookupd_http_addresses=tuple(dict.fromkeys(lookupds)),
        max_messages_per_batch=number("max_messages_per_batch", 1),
        max_bytes_per_batch=number("max_bytes_per_batch", 1), max_in_flight=number("max_in_flight", 1),
        msg_timeout=number("msg_timeout", 1000) if options.get("msg_timeout") else None)
