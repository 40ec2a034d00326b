"""QueueSettings: what a topic or a channel is told at run time beyond nsqd's flags (not in nsqd).

Go nsqd has one --mem-queue-size for every topic and no depth limit, TTL or attempt limit at all; its
users ask for them per topic and per channel (nsqio/nsq #549, #567, #796, #1396, #302, #591). Each topic
and channel here has a QueueSettings: only what was set on it (None: not set). What a channel obeys is
`resolve`d from its own settings, then its topic's, then the flags; a topic's from its own, then the
flags. They change through POST /topic/config and /channel/config (broker/http/endpoints.py, which
parses the query with `parse_updates`), and are kept in nsqd.dat under a "config" key beside the name
(broker/nsqd.py), written only where something is set, so a data directory without settings stays byte
for byte Go's and Go nsqd ignores the key where there is one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from trio_nsq.shared.names import is_ephemeral, is_valid_topic_name
from trio_nsq.shared.options import format_duration, parse_duration

if TYPE_CHECKING:
    from trio_nsq.broker.options import Options

REFUSE = "refuse"  # a publish that would pass the maximum depth is refused (E_PUB_FAILED, HTTP 503)
DROP_OLDEST = "drop-oldest"  # the oldest queued messages make room, counted
DEPTH_POLICIES = (REFUSE, DROP_OLDEST)
MAX_ATTEMPTS = 0xFFFF  # a message's attempts are a uint16 on the wire
MAX_QUEUE_SIZE = 1 << 40  # a depth or memory queue size past this is a typo, not a plan
MAX_TTL = 10 * 365 * 86400.0
DEAD_LETTER_SUFFIX = "-dlq"

# the keys, in the order the API and nsqd.dat write them
KEYS = ("mem_queue_size", "max_depth", "depth_policy", "message_ttl", "expired_to_dead_letter",
        "max_attempts", "dead_letter_topic")


class SettingsError(ValueError):
    """A value POST /topic/config or /channel/config cannot take: its message is the 400's."""


@attrs.define
class QueueSettings:
    """What was set on one topic or channel; None is "not set here" (its topic's, then the flag's)."""

    mem_queue_size: int | None = None
    max_depth: int | None = None  # 0: no limit
    depth_policy: str | None = None  # REFUSE or DROP_OLDEST
    message_ttl: float | None = None  # seconds; 0: messages do not expire
    expired_to_dead_letter: bool | None = None  # an expired message goes to the dead-letter topic
    max_attempts: int | None = None  # 0: no limit
    dead_letter_topic: str | None = None  # "": <topic>-<channel>-dlq

    def is_empty(self) -> bool:
        return all(getattr(self, key) is None for key in KEYS)

    def to_json(self) -> dict[str, Any]:
        """What is set, as the API and nsqd.dat write it (a duration as Go writes one)."""
        out: dict[str, Any] = {}
        for key in KEYS:
            value = getattr(self, key)
            if value is not None:
                out[key] = format_duration(value) if key == "message_ttl" else value
        return out

    @classmethod
    def from_json(cls, raw: Any) -> QueueSettings:
        """nsqd.dat's "config" object; what does not parse is left unset (one warning line is the
        caller's), as Go nsqd ignores what it does not know."""
        settings = cls()
        if isinstance(raw, dict):
            for key in KEYS:
                value = raw.get(key)
                if value is not None:
                    try:
                        settings.update({key: _parse(key, value if isinstance(value, str) else str(value).lower())})
                    except SettingsError:
                        pass
        return settings

    def update(self, changes: Mapping[str, Any]) -> None:
        for key, value in changes.items():
            setattr(self, key, value)


@attrs.frozen
class Resolved:
    """The settings a topic or channel obeys, every one given."""

    mem_queue_size: int
    max_depth: int
    refuse_when_full: bool
    message_ttl: float
    expired_to_dead_letter: bool
    max_attempts: int
    dead_letter_topic: str


def resolve(options: Options, *layers: QueueSettings, topic: str = "", channel: str = "") -> Resolved:
    """The first value set among `layers` (the channel's, then its topic's), else the flag's. The
    dead-letter topic's default is named after the topic and channel."""

    def pick(key: str, default: Any) -> Any:
        for layer in layers:
            value = getattr(layer, key)
            if value is not None:
                return value
        return default

    dead_letter = pick("dead_letter_topic", "") or default_dead_letter_topic(topic, channel)
    return Resolved(
        mem_queue_size=pick("mem_queue_size", options.mem_queue_size),
        max_depth=pick("max_depth", options.max_depth),
        refuse_when_full=pick("depth_policy", options.depth_policy) == REFUSE,
        message_ttl=pick("message_ttl", options.message_ttl),
        expired_to_dead_letter=pick("expired_to_dead_letter", False),
        max_attempts=pick("max_attempts", options.max_attempts),
        dead_letter_topic=dead_letter,
    )


def default_dead_letter_topic(topic: str, channel: str) -> str:
    """<topic>-<channel>-dlq, as Pulsar names its dead-letter topics; "" where that is no valid topic
    name (too long: one must then be given)."""
    name = f"{_base(topic)}-{_base(channel)}{DEAD_LETTER_SUFFIX}"
    return name if channel and is_valid_topic_name(name) else ""


def _base(name: str) -> str:
    return name[:-len("#ephemeral")] if is_ephemeral(name) else name


def parse_updates(query: Mapping[str, list[str]], *, topic: str, channel: str = "") -> dict[str, Any]:
    """The settings a POST /topic/config or /channel/config query changes: key -> value, None where the
    value is empty (back to the topic's or the flag's). Raises SettingsError, naming the first bad one;
    nothing is changed then."""
    changes: dict[str, Any] = {}
    for key, values in query.items():
        if key in ("topic", "channel"):
            continue
        if key not in KEYS:
            raise SettingsError(f"INVALID_ARG_{key.upper()}" if key.isidentifier() else "INVALID_ARG")
        text = values[-1]
        changes[key] = None if text == "" else _parse(key, text)
    dead_letter = changes.get("dead_letter_topic")
    if dead_letter is not None and dead_letter == topic:
        raise SettingsError("INVALID_ARG_DEAD_LETTER_TOPIC")  # it would publish into what it reads
    return changes


def _parse(key: str, text: str) -> Any:
    error = SettingsError(f"INVALID_ARG_{key.upper()}")
    if key == "depth_policy":
        if text not in DEPTH_POLICIES:
            raise error
        return text
    if key == "expired_to_dead_letter":
        if text not in ("true", "false", "1", "0"):
            raise error
        return text in ("true", "1")
    if key == "dead_letter_topic":
        if text and (not is_valid_topic_name(text) or is_ephemeral(text)):
            raise error  # an ephemeral topic would forget them
        return text
    if key == "message_ttl":
        try:
            seconds = parse_duration(text)
        except ValueError:
            raise error from None
        if not 0 <= seconds <= MAX_TTL:
            raise error
        return seconds
    limit = MAX_ATTEMPTS if key == "max_attempts" else MAX_QUEUE_SIZE
    if not text.isdigit() or int(text) > limit:
        raise error
    return int(text)
