"""The connector's options, checked at planning time: the writer's against the DataFrame's schema, the
channel source's, and the positional reader's (with the choice between the two readers, `mode`).

Spark hands a data source its options lower-cased, every value a string. Everything a task needs is
turned here into one frozen, picklable `WriteSettings` (the writer is pickled into every task), and every
mistake is a `ValueError` saying what to change, raised before any task runs.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from typing import TypeVar

from pyspark.sql.types import BinaryType, IntegerType, LongType, StringType, StructType

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
    "idempotency_key_column": (None, "a string or long column naming each row's source (e.g. `position` from the "
                                     "positional reader): a request's Idempotency-Key is made from its rows' keys, "
                                     "so the same rows published again, in any micro-batch or query, publish "
                                     "once; the column is not sent (unless it is the value)"),
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
    key_column: str | None = None  # idempotency_key_column: requests keyed by their rows' keys


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

    key_column = _key_column(options, fields, idempotent == "true")

    return WriteSettings(
        idempotent=idempotent == "true",
        key_column=key_column,
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


def _key_column(options: dict[str, str], fields: dict, idempotent: bool) -> str | None:
    """The idempotency_key_column option, checked against the schema."""
    name = (options.get("idempotency_key_column") or "").strip() or None
    if name is None:
        return None
    if not idempotent:
        raise ValueError("nsq: idempotency_key_column keys requests so that they publish once, and "
                         "idempotent=false sends no key: drop one of the two options")
    if name not in fields:
        close = [f for f in fields if f.lower() == name.lower()] or difflib.get_close_matches(name, fields, n=1)
        raise ValueError(f"nsq: idempotency_key_column {name!r} is not a column of this DataFrame"
                         + (f" (did you mean {close[0]!r}?)" if close else "")
                         + f"; its columns are {', '.join(fields)}. Keep the column naming each row's source "
                           "(e.g. `position` from readStream.format('nsq') with mode=log) in the DataFrame")
    if not isinstance(fields[name], (StringType, LongType, IntegerType)):
        raise ValueError(f"nsq: idempotency_key_column {name!r} is {fields[name].simpleString()}, it must be a "
                         f"string or a long: cast it (col({name!r}).cast('string')) or build one, e.g. "
                         "concat_ws('/', nsqd_address, position)")
    return name


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


# --- the positional reader's options (mode=log: positional.py), and the choice of the reading source -------

# option name -> (default, meaning); the README's table says the same. Spark hands them lower-cased.
LOG_OPTIONS: dict[str, tuple[str | None, str]] = {
    "topic": (None, "the topic to read"),
    "channel": (None, "streams only, optional: the name of a durable cursor the query keeps on each broker (a "
                      "channel whose depth is the query's lag, pinning retention from the query's place); the same "
                      "on every restart from one checkpoint, another for each query. Without it nothing is kept "
                      "on the brokers: the query's place is in its checkpoint alone, as with Kafka"),
    "nsqd_http_address": (None, "trio-nsqd HTTP address(es), comma-separated: host:4151[,host2:4151]"),
    "lookupd_http_address": (None, "nsqlookupd HTTP address(es), comma-separated: the topic's brokers are found "
                                   "there (again for every micro-batch)"),
    "startingOffsets": (None, "earliest, latest, or JSON {\"topic\": {\"host:4151\": {\"log_id\": \"...\", "
                              "\"position\": 123}}} (a position -2: earliest, -1: latest); default: latest for "
                              "streams, earliest for spark.read"),
    "startingTimestamp": (None, "unix ms: start at each broker's first record published at or after it (wins "
                                "over startingOffsets)"),
    "endingOffsets": ("latest", "spark.read only: latest, or JSON as startingOffsets (-1: latest)"),
    "endingTimestamp": (None, "spark.read only, unix ms: end before each broker's first record published at or "
                              "after it (wins over endingOffsets)"),
    "maxOffsetsPerTrigger": (None, "streams only: records per micro-batch, at most, shared over the brokers by "
                                   "their backlog (a broker with a backlog gets at least one)"),
    "minOffsetsPerTrigger": (None, "streams only: records a micro-batch waits for, at least, unless "
                                   "maxTriggerDelay has passed since the last micro-batch"),
    "maxTriggerDelay": ("15m", "streams only, with minOffsetsPerTrigger: the longest wait for a micro-batch, as "
                               "a duration (500ms, 30s, 15m, 1h; a bare number is milliseconds)"),
    "maxBytesPerTrigger": (None, "streams only: bytes of records (as stored, headers included) per micro-batch; "
                                 "a broker given a share takes at least one record"),
    "minPartitions": (None, "tasks per read, at least: the largest ranges are cut at record boundaries"),
    "failOnDataLoss": ("true", "fail when records to read are gone (retention, a topic deleted, a log replaced); "
                               "false: log a warning and go on from the earliest record kept"),
    "read_max_bytes": (str(4 << 20), "bytes per HTTP read of a task, at most (1 to 67108864)"),
    "max_bytes_per_partition": (str(64 << 20), "bytes of records per task, at most: a larger range of a broker "
                                               "is cut at record boundaries (a task each 64 MiB by default)"),
    "broker_gone_timeout": ("1h", "streams only: a broker that has not answered for this long (a duration, as "
                                  "maxTriggerDelay) leaves the query: records it still had to read are a data loss "
                                  "(failOnDataLoss), and it is asked again once per such period"),
    "mode": ("auto", "log: read by position (trio-nsqd's log); channel: consume a channel (the channel source); "
                     "auto: log when the options are the positional reader's and the brokers have the /log API"),
}
MAX_READ_BYTES = 64 << 20  # the broker's cap for one /log/read
_LOG_NAMES = {name.lower(): name for name in LOG_OPTIONS}  # as Spark hands them -> as documented
STREAM_ONLY = ("maxOffsetsPerTrigger", "maxBytesPerTrigger", "minOffsetsPerTrigger", "maxTriggerDelay",
               "broker_gone_timeout")
# Kafka source options with no meaning here (lower-cased, as Spark hands them): named as such, not "did you
# mean" a supported option that often means the opposite (a hint where there is an equivalent)
KAFKA_UNSUPPORTED = {
    "kafka.bootstrap.servers": "nsqd_http_address or lookupd_http_address", "subscribe": "topic",
    "subscribepattern": "topic", "assign": "startingOffsets (JSON)", "groupidprefix": "channel",
    "kafka.group.id": "channel", "includeheaders": "", "startingoffsetsbytimestamp": "startingTimestamp",
    "endingoffsetsbytimestamp": "endingTimestamp", "startingoffsetsbytimestampstrategy": "",
    "kafkaconsumer.polltimeoutms": "", "fetchoffset.numretries": "", "fetchoffset.retryintervalms": "",
    "maxrecordsperpartition": "max_bytes_per_partition",
}
BATCH_ONLY = ("endingOffsets", "endingTimestamp")
# the channel source's own options (READ_OPTIONS and BATCH_READ_OPTIONS, less those both sources take)
CHANNEL_ONLY = tuple(name for name in {**READ_OPTIONS, **BATCH_READ_OPTIONS}
                     if name not in ("topic", "channel", "lookupd_http_address"))
EARLIEST, LATEST = -2, -1  # a position in JSON offsets options, as Kafka's


@dataclass(frozen=True)
class LogSettings:
    """The positional reader's checked options: plain values only (the reader is pickled into every task)."""

    topic: str
    channel: str | None  # streams: the cursor's name; spark.read: None
    addresses: tuple[str, ...]  # nsqd HTTP addresses, normalised (as the offsets name brokers)
    lookupds: tuple[str, ...]
    starting: str  # earliest | latest | json
    starting_positions: dict[str, tuple[str | None, int]] = field(default_factory=dict)  # broker -> (log_id, pos)
    starting_timestamp: int | None = None  # ms
    ending: str = "latest"  # latest | json
    ending_positions: dict[str, tuple[str | None, int]] = field(default_factory=dict)
    ending_timestamp: int | None = None
    max_records: int | None = None
    max_bytes: int | None = None
    min_records: int | None = None  # minOffsetsPerTrigger
    max_trigger_delay_ms: int = 15 * 60 * 1000
    broker_gone_ms: int = 3600 * 1000
    min_partitions: int | None = None
    fail_on_data_loss: bool = True
    read_max_bytes: int = 4 << 20
    max_bytes_per_partition: int = 64 << 20


def _http_addresses(options: dict[str, str], name: str, default_port: int) -> tuple[str, ...]:
    """The option's addresses, normalised to host:port (a broker's key in the offsets)."""
    from trio_nsq.spark.log_client import normal_address

    found = []
    for address in (a.strip() for a in (options.get(name) or "").split(",")):
        if not address:
            continue
        try:
            found.append(normal_address(address, default_port))
        except ValueError as exc:
            raise ValueError(f"nsq: option {name}: {address!r} is not an address ({exc}); write "
                             f"host:port[,host2:port]") from None
    return tuple(dict.fromkeys(found))


def _log_integer(options: dict[str, str], name: str, minimum: int, maximum: int | None = None) -> int | None:
    text = options.get(name.lower(), LOG_OPTIONS[name][0])
    if text is None:
        return None
    try:
        value = int(text.strip())
    except ValueError:
        value = minimum - 1
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
        raise ValueError(f"nsq: option {name}={text!r} must be an integer {bound}; {LOG_OPTIONS[name][1]}")
    return value


DURATION_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}


def _duration_ms(options: dict[str, str], name: str) -> int:
    """A duration option (as Spark's: 500ms, 30s, 15m, 1h, 1d; a bare number is milliseconds) in ms."""
    text = (options.get(name.lower()) or LOG_OPTIONS[name][0] or "").strip().lower()
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz").strip()
    unit = text[len(number):].strip() or "ms"
    if not number.isdigit() or unit not in DURATION_UNITS_MS:
        raise ValueError(f"nsq: option {name}={text!r} must be a duration such as 500ms, 30s, 15m or 1h; "
                         f"{LOG_OPTIONS[name][1]}")
    return int(number) * DURATION_UNITS_MS[unit]


def parse_offsets_option(name: str, text: str, topic: str) -> dict[str, tuple[str | None, int]]:
    """startingOffsets / endingOffsets as JSON, in the offsets' format (a broker's value may also be a bare
    position): broker -> (log_id or None, position), a position -2 (earliest) or -1 (latest)."""
    from trio_nsq.spark.log_client import normal_address

    example = f'{{"{topic}": {{"127.0.0.1:4151": {{"log_id": "...", "position": 0}}}}}}'
    try:
        parsed = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"nsq: option {name} is neither earliest, latest nor JSON ({exc}); write e.g. "
                         f"{example}") from None
    if not isinstance(parsed, dict) or set(parsed) != {topic} or not isinstance(parsed[topic], dict):
        raise ValueError(f"nsq: option {name} must name the topic {topic!r} alone, with a position per broker: "
                         f"{example}")
    out: dict[str, tuple[str | None, int]] = {}
    for broker, value in parsed[topic].items():
        log_id = None
        if isinstance(value, dict):
            log_id, value = value.get("log_id"), value.get("position")
        if isinstance(value, bool) or not isinstance(value, int) or value < EARLIEST \
                or (log_id is not None and not isinstance(log_id, str)):
            raise ValueError(f"nsq: option {name}: broker {broker!r} needs a position (an integer >= 0, -2 for "
                             f"earliest, -1 for latest) and optionally its log_id (a string); got "
                             f"{parsed[topic][broker]!r}")
        try:
            out[normal_address(broker)] = (log_id, value)
        except ValueError as exc:
            raise ValueError(f"nsq: option {name}: {broker!r} is not a broker's HTTP address ({exc})") from None
    return out


def _unknown_log_options(options: dict[str, str], batch: bool) -> None:
    """Raise a ValueError naming each option the positional reader does not take, with a hint."""
    unknown = sorted(set(options) - set(_LOG_NAMES) - SPARK_OPTIONS - {"path"})
    if not unknown:
        return
    hints = []
    for name in unknown:
        if name in CHANNEL_ONLY:
            hints.append(f"{name!r} (the channel source's: set mode=channel to consume a channel)")
            continue
        if name in KAFKA_UNSUPPORTED:
            instead = KAFKA_UNSUPPORTED[name]
            hints.append(f"{name!r} (a Kafka option trio-nsq does not support" + (f"; see {instead}" if instead
                                                                                   else "") + ")")
            continue
        close = difflib.get_close_matches(name, list(_LOG_NAMES), n=1)
        hints.append(f"{name!r}" + (f" (did you mean {_LOG_NAMES[close[0]]!r}?)" if close else ""))
    kind = "spark.read" if batch else "spark.readStream"
    names = [n for n in LOG_OPTIONS
             if n not in (STREAM_ONLY if batch else BATCH_ONLY) and not (batch and n == "channel")]
    raise ValueError(f"nsq: unknown option {', '.join(hints)} for reading by position ({kind}, mode=log); the "
                     f"options are {', '.join(names)}")


def log_settings(options: dict[str, str], batch: bool) -> LogSettings:
    """Check the positional reader's options (`batch`: spark.read, else spark.readStream); raise ValueError
    saying what to change. No broker is asked here."""
    options = {k.lower(): v for k, v in options.items()}
    _unknown_log_options(options, batch)
    topic = options.get("topic") or options.get("path") or ""
    if not is_valid_topic_name(topic):
        raise ValueError(f"nsq: set .option('topic', ...) to a valid topic ({TOPIC_RULE}); got {topic!r}")
    if topic.endswith("#ephemeral"):
        raise ValueError(f"nsq: topic {topic!r} is #ephemeral: it keeps no log to read by position; read it with "
                         "mode=channel")
    wrong = [name for name in (STREAM_ONLY if batch else BATCH_ONLY) if name.lower() in options]
    if wrong:
        where = "streams (spark.readStream)" if batch else "spark.read"
        raise ValueError(f"nsq: option {wrong[0]} is for {where} only: drop it")

    channel = options.get("channel") or None
    if batch and channel is not None:
        raise ValueError("nsq: spark.read by position takes no channel (it commits nothing): drop "
                         ".option('channel', ...), or set mode=channel to consume the channel's messages")
    if not batch and channel is not None:
        from trio_nsq.shared.names import is_valid_channel_name

        if not is_valid_channel_name(channel) or channel.endswith("#ephemeral"):
            raise ValueError(f"nsq: option channel={channel!r} must be a valid channel name (1-64 characters of "
                             "[.a-zA-Z0-9_-]), not #ephemeral: it is the query's durable cursor")

    addresses = _http_addresses(options, "nsqd_http_address", 4151)
    lookupds = _http_addresses(options, "lookupd_http_address", 4161)

    def positions_option(name: str, allowed: tuple[str, ...]) -> tuple[str, dict[str, tuple[str | None, int]]]:
        text = (options.get(name.lower()) or "").strip()
        if not text:
            return "", {}
        if text.lower() in allowed:
            return text.lower(), {}
        if text.lower() in ("earliest", "latest"):
            why = "nothing would be read" if text.lower() != "latest" or name == "endingOffsets" else \
                "spark.read would read nothing"
            raise ValueError(f"nsq: option {name}={text} is refused ({why}): use {' or '.join(allowed)}, or JSON")
        return "json", parse_offsets_option(name, text, topic)

    starting, starting_positions = positions_option("startingOffsets",
                                                    ("earliest",) if batch else ("earliest", "latest"))
    ending, ending_positions = positions_option("endingOffsets", ("latest",))
    if batch and any(pos == LATEST for _, pos in starting_positions.values()):
        raise ValueError("nsq: startingOffsets cannot be latest (-1) for spark.read: nothing would be read")
    if any(pos == EARLIEST for _, pos in ending_positions.values()):
        raise ValueError("nsq: endingOffsets cannot be earliest (-2): nothing would be read")
    if not (addresses or lookupds or starting_positions):
        raise ValueError("nsq: no broker: set .option('nsqd_http_address', 'host:4151[,host2:4151]') or "
                         ".option('lookupd_http_address', 'host:4161') (reading by position asks trio-nsqd's "
                         "HTTP API)")

    fail = (options.get("failondataloss") or "true").strip().lower()
    if fail not in ("true", "false"):
        raise ValueError(f"nsq: option failOnDataLoss={options['failondataloss']!r} must be true or false; "
                         f"{LOG_OPTIONS['failOnDataLoss'][1]}")
    read_max_bytes = _log_integer(options, "read_max_bytes", 1, MAX_READ_BYTES)
    assert read_max_bytes is not None  # (it has a default)
    return LogSettings(
        topic=topic, channel=channel, addresses=addresses, lookupds=lookupds,
        starting=starting or ("earliest" if batch else "latest"), starting_positions=starting_positions,
        starting_timestamp=_log_integer(options, "startingTimestamp", 0),
        ending=ending or "latest", ending_positions=ending_positions,
        ending_timestamp=_log_integer(options, "endingTimestamp", 0) if batch else None,
        max_records=None if batch else _log_integer(options, "maxOffsetsPerTrigger", 1),
        max_bytes=None if batch else _log_integer(options, "maxBytesPerTrigger", 1),
        min_records=None if batch else _log_integer(options, "minOffsetsPerTrigger", 1),
        max_trigger_delay_ms=_duration_ms(options, "maxTriggerDelay"),
        broker_gone_ms=_duration_ms(options, "broker_gone_timeout"),
        min_partitions=_log_integer(options, "minPartitions", 1),
        fail_on_data_loss=fail == "true", read_max_bytes=read_max_bytes,
        max_bytes_per_partition=_log_integer(options, "max_bytes_per_partition", 1) or 64 << 20)


def explicit_mode(options: dict[str, str]) -> str:
    """The `mode` option: auto (the default), log or channel."""
    options = {k.lower(): v for k, v in options.items()}
    mode = (options.get("mode") or "auto").strip().lower()
    if mode not in ("auto", "log", "channel"):
        raise ValueError(f"nsq: option mode={options['mode']!r} must be auto, log or channel; "
                         f"{LOG_OPTIONS['mode'][1]}")
    return mode


def choose_source(options: dict[str, str]) -> tuple[str, str]:
    """("log" or "channel", why), by the `mode` option. With mode=auto (the default): the channel source when
    the options are the channel source's (a query written for it reads as it did: the same `channel`
    option means a channel consumed there, a cursor here; without a `channel` it cannot run), else the
    positional reader when every broker
    that answers has the /log API (GET /log/positions; 404 TOPIC_NOT_FOUND is a trio-nsqd whose topic does
    not exist yet). A broker that does not answer does not count: one down for a restart must not switch a
    query to the other source, whose offsets have another form."""
    from trio_nsq.spark.log_client import LogAPIError, LogClient, LogUnavailableError, lookup_http_addresses

    mode = explicit_mode(options)
    if mode != "auto":
        return mode, f"mode={mode}"
    options = {k.lower(): v for k, v in options.items()}
    channel_only = [name for name in CHANNEL_ONLY if name in options]
    if channel_only:
        return "channel", f"option {channel_only[0]} is the channel source's"
    positional = [name for name in _LOG_NAMES if name in options and name not in
                  ("topic", "channel", "lookupd_http_address", "mode")]
    if not positional and "channel" in options:
        return "channel", ("no option is the positional reader's alone (nsqd_http_address, startingOffsets, ...): "
                           "these options consume a channel, as before the positional reader existed; set "
                           "mode=log to read by position")
    # (without a channel the channel source cannot run; the positional reader needs none, as Kafka's)
    topic = options.get("topic") or options.get("path") or ""
    if topic.endswith("#ephemeral"):
        return "channel", f"topic {topic!r} is #ephemeral: it keeps no log"
    try:
        brokers = list(_http_addresses(options, "nsqd_http_address", 4151))
        lookupds = _http_addresses(options, "lookupd_http_address", 4161)
    except ValueError:
        return "log", "the options are the positional reader's"  # (which then says what is wrong)
    if not is_valid_topic_name(topic):
        return "log", "the options are the positional reader's"
    if lookupds:
        brokers += lookup_http_addresses(lookupds, topic, timeout=5.0)[0]
    answered = 0
    for broker in dict.fromkeys(brokers):
        with LogClient(broker, timeout=5.0, max_retries=0) as client:
            try:
                client.positions(topic)
                answered += 1
            except LogAPIError as exc:
                if exc.code == "TOPIC_NOT_FOUND":
                    answered += 1
                elif exc.code == "TOPIC_HAS_NO_LOG":
                    return "channel", f"topic {topic!r} keeps no log on broker {broker}"
                else:
                    return "channel", (f"broker {broker} has no /log API (GET /log/positions answered {exc.status} "
                                       f"{exc.code}): Go nsqd, or a trio-nsqd without it")
            except LogUnavailableError:
                pass
    if not answered:
        return "log", "the options are the positional reader's; no broker answered yet"
    return "log", f"{'every broker' if answered > 1 else 'the broker'} that answered serves /log/positions"


def channel_options(options: dict[str, str]) -> dict[str, str]:
    """The options as the channel source takes them: without `mode`, and brokers named by their HTTP address
    (nsqd_http_address, when mode=auto found no /log API there) by their TCP address, from their /info."""
    from trio_nsq.spark.log_client import tcp_address_of

    options = {k.lower(): v for k, v in options.items() if k.lower() != "mode"}
    positional = [_LOG_NAMES[name] for name in options if name in _LOG_NAMES and name not in
                  ("topic", "channel", "lookupd_http_address", "nsqd_http_address")]
    if positional:
        raise ValueError(f"nsq: option {positional[0]} is the positional reader's, and this read consumes a channel "
                         "(the channel source: mode=channel, or mode=auto found a broker without the /log API, as "
                         "logged when the DataFrame was loaded): drop it, or read trio-nsqd brokers with mode=log")
    http = _http_addresses(options, "nsqd_http_address", 4151)
    if http:
        del options["nsqd_http_address"]
        tcp = [a for a in (options.get("nsqd_tcp_address") or "").split(",") if a.strip()]
        options["nsqd_tcp_address"] = ",".join(tcp + [tcp_address_of(address) for address in http])
    return options
