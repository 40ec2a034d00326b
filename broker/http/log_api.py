"""Not in nsqd: a topic's log read by position over HTTP, for readers that plan by position and read ranges
themselves (Spark's positional source: trio_nsq/spark/positional.py; later, a follower).

    GET  /log/positions?topic=T                      first and end positions, the log id
    GET  /log/position?topic=T&timestamp=MS          the first record published at or after a time
    GET  /log/position?topic=T&from=P&records=N&bytes=B   a boundary within limits (admission control)
    GET  /log/splits?topic=T&start=P&end=E&parts=N   record boundaries cutting a range into N parts
    GET  /log/read?topic=T&position=P&end=E&max_bytes=B   raw records, as in the files
    POST /log/commit?topic=T&channel=C&position=P    a durable cursor: everything before P is finished

Every answer names the log (`log_id`: its epoch, made with the log) and nothing at or past the durable
tail (a replicated topic's: its high watermark, when lower: TopicLog.served_end) is served (after a power
loss a new record may take a lost one's position: a reader that had read the
lost one would skip the new one). The README's "Reading a topic by position" documents the answers.
Any of them marks the topic as read by position: every message it gets from then on goes to its log.

Who calls it: the broker's HTTP server (serve.py routes), with the Api of endpoints.py for what they share.
"""

from __future__ import annotations

import logging
import struct
from array import array
from collections.abc import Mapping
from typing import TYPE_CHECKING

from trio_nsq.broker.storage.backend import BackendError
from trio_nsq.broker.storage.log_index import PositionError
from trio_nsq.broker.storage.segment_log import Place
from trio_nsq.broker.storage.topic_log import TopicLog
from trio_nsq.broker.topic import Topic
from trio_nsq.shared.http_api import HTTPError, Reply, ok_json, parse_go_int
from trio_nsq.shared.http_server import Request
from trio_nsq.shared.names import is_ephemeral, is_valid_channel_name, is_valid_topic_name

if TYPE_CHECKING:
    from trio_nsq.broker.channel import Channel
    from trio_nsq.broker.http.endpoints import Api

log = logging.getLogger("nsqd")

BINARY_TYPE = "application/octet-stream"
DEFAULT_READ_BYTES = 4 * 1024 * 1024
MAX_READ_BYTES = 64 * 1024 * 1024
MAX_PARTS = 10_000
_POSITION_STATUS = {"POSITION_GONE": 404, "POSITION_PAST_END": 400, "POSITION_NOT_A_RECORD": 400}



def number_arg(params: dict[str, list[str]], key: str, default: int | None = None, minimum: int = 0) -> int:
    """An integer query argument (Go's syntax): 400 MISSING_ARG_<KEY> without a default, 400
    INVALID_ARG_<KEY> when it is not a number or is below `minimum`. The log API's and /replica/fetch's."""
    values = params.get(key)
    if not values:
        if default is None:
            raise HTTPError(400, f"MISSING_ARG_{key.upper()}")
        return default
    try:
        value = parse_go_int(values[0])
    except ValueError:
        raise HTTPError(400, f"INVALID_ARG_{key.upper()}") from None
    if value < minimum:
        raise HTTPError(400, f"INVALID_ARG_{key.upper()}")
    return value


class LogApi:
    def __init__(self, api: Api) -> None:
        self.api = api
        self.nsqd = api.nsqd

    # --- arguments ----------------------------------------------------------------------------

    async def _log(self, req: Request, create: bool = False) -> tuple[dict[str, list[str]], Topic, TopicLog]:
        """The topic's log, its id on disk, the topic marked as read by position; 409 when `log_id` names
        another log."""
        params = self.api._params(req)
        names = params.get("topic")
        if not names:
            raise HTTPError(400, "MISSING_ARG_TOPIC")
        if not is_valid_topic_name(names[0]):
            raise HTTPError(400, "INVALID_ARG_TOPIC")
        if create and is_ephemeral(names[0]):
            raise HTTPError(400, "TOPIC_HAS_NO_LOG")  # (refused before it is made)
        wanted = params.get("log_id")
        if create and wanted and self.nsqd.get_existing_topic(names[0]) is None:
            raise HTTPError(409, "LOG_ID_MISMATCH")  # the log named is gone: not made again by a commit
        topic = self.nsqd.get_topic(names[0]) if create else self.api._existing_topic(names[0])
        log_ = topic.log
        if log_ is None:
            raise HTTPError(400, "TOPIC_HAS_NO_LOG")  # an ephemeral topic keeps no log
        if topic.exiting:
            raise HTTPError(503, "EXITING")
        topic.keep_whole_log()
        if not (log_.epoch_on_disk and log_.positional_on_disk):
            # the id is given out only once a crash cannot make another, and a position only once a
            # crash cannot undo the positional flag (after it, messages would go through memory again)
            log_.request_meta()
            try:
                await topic.group.sync_round()
            except BackendError as exc:
                log.error("TOPIC(%s): failed to persist its log's metadata - %s", topic.name, exc)
                raise HTTPError(500, "INTERNAL_ERROR") from None
        if wanted and wanted[0] != log_.log_id:
            raise HTTPError(409, "LOG_ID_MISMATCH")
        return params, topic, log_

    def _locate(self, log_: TopicLog, pos: int) -> Place:
        try:
            return log_.index.locate(pos, log_.served_end())
        except PositionError as exc:
            raise HTTPError(_POSITION_STATUS[exc.code], exc.code) from None
        except (OSError, ValueError) as exc:
            log.error("TOPIC(%s): cannot read its log at %d - %s", log_.name, pos, exc)
            raise HTTPError(500, "INTERNAL_ERROR") from None

    # --- endpoints ----------------------------------------------------------------------------

    async def positions(self, req: Request, params: Mapping[str, str]) -> Reply:
        _, topic, log_ = await self._log(req)
        segments = log_.segments
        end = log_.served_end()
        first = Place(segments.start, segments.start_index())
        if first.position > end.position:  # (an empty log whose first segment rolled: nothing kept)
            first = end
        stamp = log_.oldest_timestamp(first.position) if first.position < end.position else None
        return ok_json({"topic": topic.name, "log_id": log_.log_id, "first": first.position,
                        "first_index": first.index, "end": end.position, "end_index": end.index,
                        "first_timestamp": stamp})

    async def position(self, req: Request, params: Mapping[str, str]) -> Reply:
        args, _, log_ = await self._log(req)
        end = log_.served_end()
        try:
            if "timestamp" in args:
                ms = number_arg(args, "timestamp")
                place = log_.index.at_time(ms * 1_000_000, end, log_.first_stamp)
            else:
                start = self._locate(log_, number_arg(args, "from"))
                records = number_arg(args, "records", 1 << 62, 1)
                max_bytes = number_arg(args, "bytes", 1 << 62, 1)
                place = start
                if "records" in args or "bytes" in args:
                    place = log_.index.after(start, end, records, max_bytes)
        except PositionError as exc:
            raise HTTPError(_POSITION_STATUS[exc.code], exc.code) from None
        except (OSError, ValueError) as exc:
            log.error("TOPIC(%s): cannot read its log - %s", log_.name, exc)
            raise HTTPError(500, "INTERNAL_ERROR") from None
        return ok_json({"log_id": log_.log_id, "position": place.position, "index": place.index})

    async def splits(self, req: Request, params: Mapping[str, str]) -> Reply:
        args, _, log_ = await self._log(req)
        start = self._locate(log_, number_arg(args, "start"))
        stop = self._locate(log_, number_arg(args, "end")).position
        parts = number_arg(args, "parts", None, 1)
        if parts > MAX_PARTS:
            raise HTTPError(400, "INVALID_ARG_PARTS")
        try:
            cuts = log_.index.splits(start, log_.served_end(), stop, parts)
        except PositionError as exc:
            raise HTTPError(_POSITION_STATUS[exc.code], exc.code) from None
        except (OSError, ValueError) as exc:
            log.error("TOPIC(%s): cannot read its log - %s", log_.name, exc)
            raise HTTPError(500, "INTERNAL_ERROR") from None
        return ok_json({"log_id": log_.log_id, "positions": cuts})

    async def read(self, req: Request, params: Mapping[str, str]) -> Reply:
        """Raw records (see the module's docstring and the README): the bytes of one segment, then each
        record's start (little-endian int32, n+1 of them: Arrow's offsets), then the deferred records'
        (position, deadline ms) as little-endian int64 pairs."""
        args, _, log_ = await self._log(req)
        end = log_.served_end()
        start = self._locate(log_, number_arg(args, "position"))
        stop = number_arg(args, "end", end.position)
        max_bytes = min(number_arg(args, "max_bytes", DEFAULT_READ_BYTES, 1), MAX_READ_BYTES)
        try:
            block = log_.index.read(start, end, stop, max_bytes)
            deadlines = log_.deadlines_between(block.position, block.position + block.size) if len(block) else []
        except PositionError as exc:
            raise HTTPError(_POSITION_STATUS[exc.code], exc.code) from None
        except (OSError, ValueError) as exc:
            log.error("TOPIC(%s): cannot read its log at %d - %s", log_.name, start.position, exc)
            raise HTTPError(500, "INTERNAL_ERROR") from None
        # (struct, not array("i", starts): array converts each item through PyArg_Parse, half again slower)
        trailer = struct.pack(f"<{len(block.starts)}i", *block.starts)
        if deadlines:
            pairs = array("q")
            for pos, deadline in deadlines:
                pairs.append(pos)
                pairs.append(int(round(deadline * 1000)))
            trailer += pairs.tobytes()
        headers = (
            ("X-NSQ-Log-Id", log_.log_id),
            ("X-NSQ-Position", str(block.position)),
            ("X-NSQ-Next-Position", str(block.next)),
            ("X-NSQ-First-Index", str(block.index)),
            ("X-NSQ-Records", str(len(block))),
            ("X-NSQ-Records-Bytes", str(block.size)),
            ("X-NSQ-Deadlines", str(len(deadlines))),
            ("X-NSQ-End", str(end.position)),
        )
        # (the block read may end inside a record: the answer is a view of the whole records, not a copy)
        body = block.data if block.size == len(block.data) else memoryview(block.data)[:block.size]
        return Reply(200, body, BINARY_TYPE, headers=headers, more=trailer)

    async def commit(self, req: Request, params: Mapping[str, str]) -> Reply:
        """The durable cursor of a positional reader: the channel (made if need be) finishes everything
        before the position and nothing after it, on disk before the answer. Only a cursor: a channel
        with consumers, or one SUB or /channel/create made, is refused (a seek would drop its messages);
        `adopt=true` makes one without consumers a cursor (an older trio-nsq's cursor has no flag)."""
        args = self.api._params(req)
        names = args.get("channel")
        if not names:
            raise HTTPError(400, "MISSING_ARG_CHANNEL")
        name = names[0]
        if not is_valid_channel_name(name) or is_ephemeral(name):
            raise HTTPError(400, "INVALID_ARG_CHANNEL")  # (an ephemeral channel's cursor would not survive a restart)
        adopt = _flag(args, "adopt")
        topic = self.nsqd.get_existing_topic(args["topic"][0]) if args.get("topic") else None
        if topic is not None:
            _check_cursor(topic, name, adopt)  # before the topic is marked as read by position
        args, topic, log_ = await self._log(req, create=True)
        place = self._locate(log_, number_arg(args, "position"))
        channel = _check_cursor(topic, name, adopt)  # (again: the wait above let others in)
        created = channel is None
        if channel is None:
            channel = topic.get_channel(name)
        adopted = not (created or channel.cursor)
        was_idle = not channel.pins
        if not channel.cursor:  # (made now, before nsqd.dat's line is written; or adopted)
            channel.make_cursor()
            if adopted:
                log.warning("CHANNEL(%s:%s): adopted as a cursor (/log/commit adopt=true): a SUB to it is refused "
                            "from now on", topic.name, name)
                self.nsqd.persist_metadata(topic.name, name)
        log_.reload_deadlines(place.position)
        channel.commit(place.position, place.index)
        await self.api._persisted(topic, f"CHANNEL({topic.name}:{channel.name})")
        if created or adopted or was_idle:
            await self.api._metadata_persisted()  # (its name, that it is a cursor, that it pins: on disk first)
        else:
            await self.api._named(topic, channel.name)  # (made by a request not answered yet)
        return ok_json({"log_id": log_.log_id, "position": place.position, "depth": channel.depth()})


def _flag(args: dict[str, list[str]], key: str) -> bool:
    """A boolean query argument, as Go's strconv.ParseBool reads it (absent: false)."""
    values = args.get(key)
    if not values:
        return False
    value = values[0]
    if value in ("1", "t", "T", "true", "TRUE", "True"):
        return True
    if value in ("0", "f", "F", "false", "FALSE", "False"):
        return False
    raise HTTPError(400, f"INVALID_ARG_{key.upper()}")


def _check_cursor(topic: Topic, name: str, adopt: bool) -> Channel | None:
    """The channel a commit may seek (None: not there yet, the commit makes it a cursor). Refused, with
    one log line, when consumers are subscribed, or when it is not a cursor and not to be adopted."""
    channel = topic.get_existing_channel(name)
    if channel is None:
        return None
    if channel.clients:
        log.warning("CHANNEL(%s:%s): /log/commit refused - CHANNEL_HAS_CONSUMERS (%d subscribed): a cursor needs "
                    "a channel of its own", topic.name, name, len(channel.clients))
        raise HTTPError(409, "CHANNEL_HAS_CONSUMERS")
    if not (channel.cursor or adopt):
        log.warning("CHANNEL(%s:%s): /log/commit refused - CHANNEL_NOT_A_CURSOR (made by SUB or /channel/create, "
                    "or by a trio-nsq before cursors were flagged: adopt=true makes it one)", topic.name, name)
        raise HTTPError(409, "CHANNEL_NOT_A_CURSOR")
    return channel
