"""Not in nsqd: cluster mode's fetch, served by a topic's leader to its followers (issue 52).

    GET /replica/fetch?topic=T&epoch=E&replica=ID&position=P&synced=S&max_bytes=B

`replica` is the follower's broker id, `epoch` the leader epoch of the TopicState it read from etcd,
`position` its log end (it has everything below: the leader records it), `synced` its fsynced end
(what counts towards the high watermark). The leader checks the epoch (`core.check_fetch_epoch`: an
older one gets 409 FENCED and re-reads etcd; a newer one means this leader is stale: 409 STALE_LEADER and
it steps down), then answers the records from `position` up to its log end (not only the HWM: the
followers' copies are what moves the HWM). With nothing new it waits for an append or an HWM change
first, up to long_poll(--replica-lag-time) seconds.

The answer (200, application/octet-stream):

    uint32 big-endian n | n bytes of JSON header | the records, concatenated, as stored

    header = {"epoch": E, "hwm": int, "log_start": int, "log_end": int, "log_id": str,
              "positions": [int, ...], "sizes": [int, ...],        # one per record, in order
              "deadlines": [[position, unix deadline], ...],      # deferred records among them
              "channels": [[name, cursor position, paused], ...],  # the leader's durable channels
              "paused": bool, "settings": {...},                 # the topic's pause and settings
              "channel_settings": {name: {...}, ...},            # its channels' settings (those set)
              "cursors": [name, ...]}                            # those of its channels that are cursors

No record is sent when `position` is outside [log_start, log_end]: the follower compares log ids and
starts, and resets or truncates its log (follower.py). Errors are NSQ-style JSON: 400 MISSING_ARG_X /
INVALID_ARG_X, 404 TOPIC_NOT_FOUND, 409 NOT_LEADER / FENCED / STALE_LEADER / NOT_A_REPLICA.

Who calls it: the broker's HTTP server (serve.py routes); the follower task (replication/follower.py)
is its only client.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import trio

from trio_nsq.broker.replication import core
from trio_nsq.broker.http.log_api import number_arg
from trio_nsq.shared.http_api import HTTPError, Reply
from trio_nsq.shared.http_server import Request
from trio_nsq.shared.names import is_valid_topic_name

if TYPE_CHECKING:
    from trio_nsq.broker.http.endpoints import Api
    from trio_nsq.broker.replication.manager import TopicReplica
    from trio_nsq.broker.storage.topic_log import TopicLog
    from trio_nsq.broker.topic import Topic

log = logging.getLogger("nsqd")

BINARY_TYPE = "application/octet-stream"
# how long a fetch with nothing to answer waits for an append or an HWM change: a quarter of
# --replica-lag-time (a caught-up follower fetches 4 times in it: it does not leave the isr for an idle
# log), from LONG_POLL to MAX_LONG_POLL. An idle topic costs each follower and its leader a request every
# long poll: at the default 10s lag, 2.5 s (a follower gives up on a fetch FETCH_TIMEOUT after it)
LONG_POLL = 0.5
MAX_LONG_POLL = 2.5
DEFAULT_FETCH_BYTES = 1024 * 1024
MAX_FETCH_BYTES = 16 * 1024 * 1024
_HEADER_SIZE = struct.Struct(">I")
MAX_HEADER = 64 * 1024 * 1024


@attrs.frozen
class FetchAnswer:
    """A fetch's answer as the follower reads it (decode)."""

    epoch: int
    hwm: int
    log_start: int
    log_end: int
    log_id: str
    positions: list[int]
    records: list[bytes]
    deadlines: list[tuple[int, float]]
    channels: list[tuple[str, int, bool]]
    # (issue 35's settings as QueueSettings.to_json writes them; followers mirror them, and the pause)
    paused: bool = False
    settings: dict[str, Any] = attrs.field(factory=dict)
    channel_settings: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    # the channels made by /log/commit (a positional reader's cursors): a follower marks its copies so,
    # so a new leader takes the reader's commits (else CHANNEL_NOT_A_CURSOR after a failover)
    cursors: list[str] = attrs.field(factory=list)


def long_poll(lag_time: float) -> float:
    return min(MAX_LONG_POLL, max(LONG_POLL, lag_time / 4))


def encode(header: dict[str, Any], records: list[bytes]) -> bytes:
    data = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([_HEADER_SIZE.pack(len(data)), data, *records])


def decode(body: bytes) -> FetchAnswer:
    """ValueError on anything that is not a fetch answer."""
    if len(body) < _HEADER_SIZE.size:
        raise ValueError("short answer")
    (size,) = _HEADER_SIZE.unpack_from(body)
    if size > MAX_HEADER or _HEADER_SIZE.size + size > len(body):
        raise ValueError("bad header size")
    try:
        header = json.loads(body[_HEADER_SIZE.size:_HEADER_SIZE.size + size])
        positions = [int(p) for p in header["positions"]]
        sizes = [int(s) for s in header["sizes"]]
        deadlines = [(int(p), float(d)) for p, d in header["deadlines"]]
        channels = [(str(n), int(c), bool(p)) for n, c, p in header["channels"]]
        answer = (int(header["epoch"]), int(header["hwm"]), int(header["log_start"]), int(header["log_end"]),
                  str(header["log_id"]))
        paused = bool(header.get("paused", False))
        settings = dict(header.get("settings") or {})
        channel_settings = {str(n): dict(c) for n, c in (header.get("channel_settings") or {}).items()}
        cursors = [str(n) for n in header.get("cursors") or []]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"bad header - {exc}") from None
    if len(positions) != len(sizes) or any(s <= 0 for s in sizes):
        raise ValueError("positions and sizes do not match")
    records: list[bytes] = []
    at = _HEADER_SIZE.size + size
    for s in sizes:
        if at + s > len(body):
            raise ValueError("records cut short")
        records.append(body[at:at + s])
        at += s
    return FetchAnswer(*answer, positions, records, deadlines, channels, paused, settings, channel_settings,
                       cursors)


class ReplicaApi:
    """/replica/fetch, routed by serve.py; the topic's TopicReplica (replication/manager.py) says whether
    this broker leads it and records the follower's progress."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.nsqd = api.nsqd

    async def fetch(self, req: Request, params: Mapping[str, str]) -> Reply:
        try:
            return await self._fetch(req)
        except HTTPError as exc:
            if exc.status == 400:  # (the route is not logged: a follower fetches several times a second)
                log.warning("replica fetch refused: %s (%s)", exc.text, req.query.decode(errors="replace")[:200])
            raise

    async def _fetch(self, req: Request) -> Reply:
        manager = self.nsqd.replication
        if manager is None:
            raise HTTPError(400, "NOT_IN_CLUSTER_MODE")
        args = self.api._params(req)
        names = args.get("topic")
        if not names:
            raise HTTPError(400, "MISSING_ARG_TOPIC")
        if not is_valid_topic_name(names[0]):
            raise HTTPError(400, "INVALID_ARG_TOPIC")
        replicas = args.get("replica")
        if not replicas or not replicas[0]:
            raise HTTPError(400, "MISSING_ARG_REPLICA")
        replica_id = replicas[0]
        epoch = number_arg(args, "epoch")
        position = number_arg(args, "position")
        synced = number_arg(args, "synced")
        max_bytes = min(max(number_arg(args, "max_bytes", DEFAULT_FETCH_BYTES), 1), MAX_FETCH_BYTES)
        replica: TopicReplica | None = manager.replicas.get(names[0])
        if replica is None:
            raise HTTPError(404, "TOPIC_NOT_FOUND")
        progress = replica.progress
        if replica.role != "leader" or progress is None or not manager.lease_live():
            manager.wake()  # (a lapsed lease: etcd is read again)
            raise HTTPError(409, "NOT_LEADER")
        verdict = core.check_fetch_epoch(replica.epoch, epoch)
        if verdict is not None:
            log.warning("TOPIC(%s): fetch of %s at epoch %d, leading epoch %d - %s", replica.name, replica_id,
                        epoch, replica.epoch, verdict)
            if verdict == "STALE_LEADER":
                manager.step_down(replica, "a follower knows a newer epoch")
            raise HTTPError(409, verdict)
        if replica_id not in progress.state.replicas or replica_id == manager.me:
            raise HTTPError(409, "NOT_A_REPLICA")
        topic: Topic = replica.topic
        log_ = topic.log
        assert log_ is not None
        start, end = log_.first_position(), log_.end_position()
        if start <= position <= end:
            replica.fetched(replica_id, position, min(synced, position), end)
            if position == end:
                with trio.move_on_after(long_poll(manager.lag_time)):
                    await replica.wait_data()
                if replica.role != "leader" or replica.progress is not progress:
                    raise HTTPError(409, "NOT_LEADER")
        return self._answer(replica, log_, position, max_bytes)

    def _answer(self, replica: TopicReplica, log_: TopicLog, position: int, max_bytes: int) -> Reply:
        start, end = log_.first_position(), log_.end_position()
        positions: list[int] = []
        records: list[bytes] = []
        deadlines: list[tuple[int, float]] = []
        if start <= position < end:
            try:
                positions, records = log_.read_raw(position, max_bytes, end)
                if positions:
                    deadlines = log_.deadlines_for(positions[0], positions[-1] + 4 + len(records[-1]))
            except (OSError, ValueError) as exc:
                log.error("TOPIC(%s): cannot read its log at %d for a follower - %s", replica.name, position, exc)
                raise HTTPError(500, "INTERNAL_ERROR") from None
        channels = []
        channel_settings = {}
        cursors = []
        for channel in replica.topic.channels.values():
            reader = channel.backend.reader
            if channel.ephemeral or reader is None:
                continue
            channels.append([channel.name, reader.mark_delete(), channel.paused])
            if channel.cursor:
                cursors.append(channel.name)
            if not channel.settings.is_empty():
                channel_settings[channel.name] = channel.settings.to_json()
        header = {
            "epoch": replica.epoch, "hwm": replica.high_watermark(), "log_start": start, "log_end": end,
            "log_id": log_.log_id, "positions": positions, "sizes": [len(r) for r in records],
            "deadlines": [[p, d] for p, d in deadlines], "channels": channels,
            "paused": replica.topic.paused, "settings": replica.topic.settings.to_json(),
            "channel_settings": channel_settings, "cursors": cursors,
        }
        return Reply(200, encode(header, records), BINARY_TYPE)
