"""A follower's task: one per topic this broker follows (ReplicaManager._start_follower starts it under a
cancel scope of its own; a role change cancels it).

First the truncation (KIP-101/279: core.truncation_point against the etcd epochs list, never the HWM),
then the fetch loop against the leader's `GET /replica/fetch` (http/replica_api.py, one connection):
the records are appended at the leader's positions (TopicLog.append_at: its segments roll where the
leader's do), fsynced (the topic's sync group), and the next fetch reports the fsynced end
(core.follower_synced). A log id other than the leader's, or an end before the leader's start: the log
is reset (TopicLog.reset_to). The leader's channels are mirrored (made, seeked to their cursors, paused,
deleted), and so are the topic's pause and its settings (issue 35's: the topic's, its channels'), without
delivering anything: followers refuse SUB and PUB.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING
from urllib.parse import urlencode

import attrs
import trio

from trio_nsq.broker.http.replica_api import FetchAnswer, decode, long_poll
from trio_nsq.broker.queue_settings import QueueSettings
from trio_nsq.broker.replication import core
from trio_nsq.broker.replication.fetch_client import FetchClient, FetchError
from trio_nsq.broker.replication.manager import _read_epochs, _write_epochs, truncate
from trio_nsq.broker.storage.backend import BackendError
from trio_nsq.broker.storage.log_index import PositionError
from trio_nsq.shared.names import is_ephemeral

if TYPE_CHECKING:
    from trio_nsq.broker.replication.manager import ReplicaManager, TopicReplica

log = logging.getLogger("nsqd")

FETCH_BYTES = 1024 * 1024
# a fetch long-polls replica_api.long_poll(--replica-lag-time) on the leader: this much longer is a leader
# that does not answer
FETCH_TIMEOUT = 5.0
RETRY = 0.25


async def follow(manager: ReplicaManager, replica: TopicReplica, scope: trio.CancelScope, address: str) -> None:
    with scope:
        try:
            await _follow(manager, replica, address)
        except (BackendError, OSError, ValueError) as exc:
            log.error("TOPIC(%s): following failed - %s", replica.name, exc)
            await trio.sleep(RETRY)
    manager.role_ended(replica, scope)


async def _follow(manager: ReplicaManager, replica: TopicReplica, address: str) -> None:
    topic = replica.topic
    log_ = topic.log
    assert log_ is not None and replica.state is not None
    data_path = manager.nsqd.data_path
    local: list[tuple[int, int]] | None = None  # the epoch cache, once truncated
    failing = ""
    # one keep-alive connection, not httpx (see fetch_client.py)
    client = FetchClient(address, long_poll(manager.lag_time) + FETCH_TIMEOUT)
    try:
        while True:
            state = replica.state  # (the manager updates it: isr changes of the same epoch)
            assert state is not None
            if local is None and log_.log_id == state.log_id:
                local = await truncate(data_path, replica, state, None)
            position = log_.end_position()
            params = {
                "topic": replica.name, "epoch": str(state.epoch), "replica": manager.me,
                "position": str(position),
                "synced": str(core.follower_synced(position, min(log_.durable_tail.position, position))),
                "max_bytes": str(FETCH_BYTES),
            }
            try:
                status, body = await client.get("/replica/fetch?" + urlencode(params))
            except FetchError as exc:
                if failing != str(exc):
                    log.warning("TOPIC(%s): fetch from %s failed - %s", replica.name, address, exc)
                    failing = str(exc)
                manager.wake()
                await trio.sleep(RETRY)
                continue
            if status != 200:
                try:
                    message = str(json.loads(body)["message"])
                except (ValueError, TypeError, KeyError):
                    message = body[:100].decode(errors="replace")
                if failing != message:
                    log.warning("TOPIC(%s): fetch from %s: HTTP %d %s", replica.name, address, status, message)
                    failing = message
                manager.wake()
                if message in ("FENCED", "STALE_LEADER"):
                    return  # etcd is read again; the manager follows what it says
                await trio.sleep(RETRY)
                continue
            failing = ""
            answer = decode(body)
            if core.check_fetch_epoch(answer.epoch, state.epoch) is not None:
                manager.wake()
                return
            if answer.log_id != log_.log_id or log_.end_position() < answer.log_start:
                empty = log_.end_position() == log_.first_position()
                log.log(logging.INFO if empty else logging.WARNING,
                        "TOPIC(%s): its log (%s, end %d) is not the leader's (%s, from %d): reset", replica.name,
                        log_.log_id, log_.end_position(), answer.log_id, answer.log_start)
                _write_epochs(data_path, replica.name, [])
                await log_.reset(answer.log_start, answer.log_id)
                local = []
                continue
            if local is None:
                local = await truncate(data_path, replica, state, None)
            if log_.end_position() > answer.log_end:
                local = await truncate(data_path, replica, state, answer.log_end)
                if log_.end_position() > answer.log_end:
                    # (the epochs do not explain it: this state is stale; etcd is read again)
                    log.error("TOPIC(%s): its log ends at %d, past the leader's %d, and its epochs keep it",
                              replica.name, log_.end_position(), answer.log_end)
                    manager.wake()
                    await trio.sleep(1.0)
                    return
                continue
            if answer.records and answer.positions[0] >= log_.end_position():
                before = log_.end_position()
                log_.append_at(answer.records, answer.positions, answer.deadlines)
                extended = list(core.extend_epochs(local, state, before, log_.end_position()))
                if extended != local:
                    _write_epochs(data_path, replica.name, extended)
                    local = extended
                await topic.group.sync()
            hwm = min(answer.hwm, log_.durable_tail.position)
            if hwm > replica.last_hwm:
                replica.set_hwm(hwm)
            _mirror_channels(replica, answer.channels, answer.cursors)
            _mirror_settings(replica, answer)
    finally:
        await client.aclose()


def _mirror_channels(replica: TopicReplica, channels: list[tuple[str, int, bool]], cursors: list[str]) -> None:
    """The leader's durable channels here: made, paused as there, their cursors where the leader's are
    (once this log holds that position), those that are /log/commit's cursors flagged so (a positional
    reader commits to them here after a failover), the others deleted. Nothing is delivered here."""
    topic = replica.topic
    log_ = topic.log
    assert log_ is not None
    nsqd = replica.manager.nsqd
    wanted = {name: (cursor, paused) for name, cursor, paused in channels}
    for name, (cursor, paused) in wanted.items():
        channel = topic.channels.get(name)
        if channel is None:
            channel = topic.get_channel(name)
        if name in cursors and not channel.cursor:
            channel.make_cursor()
            nsqd.persist_metadata(topic.name, name)
        if channel.paused != paused:
            if paused:
                channel.pause()
            else:
                channel.unpause()
            nsqd.persist_metadata(topic.name, name)
        reader = channel.backend.reader
        if reader is None or reader.mark_delete() == cursor:
            continue
        if not log_.first_position() <= cursor <= log_.durable_tail.position:
            continue
        try:
            place = log_.index.locate(cursor, log_.durable_tail)
        except (PositionError, OSError, ValueError):
            continue
        channel.seek(place.position, place.index)
    for name in list(topic.channels):
        if name not in wanted and not is_ephemeral(name):
            topic.delete_channel(name)


def _mirror_settings(replica: TopicReplica, answer: FetchAnswer) -> None:
    """The leader's topic pause and issue 35's settings (the topic's, its channels') here, persisted in
    nsqd.dat as /topic/pause and /topic/config would: after a failover they hold on the new leader."""
    topic = replica.topic
    nsqd = replica.manager.nsqd
    changed = False
    if topic.paused != answer.paused:
        if answer.paused:
            topic.pause()
        else:
            topic.unpause()
        changed = True
    reapply = False
    wanted = QueueSettings.from_json(answer.settings)
    if topic.settings != wanted:
        topic.settings.update(attrs.asdict(wanted))
        reapply = True
    for name, channel in topic.channels.items():
        if channel.ephemeral:
            continue
        wanted = QueueSettings.from_json(answer.channel_settings.get(name))
        if channel.settings != wanted:
            channel.settings.update(attrs.asdict(wanted))
            reapply = True
    if reapply:
        log.info("TOPIC(%s): settings as on its leader: %s", topic.name, answer.settings)
        topic.apply_settings()
    if changed or reapply:
        nsqd.persist_metadata(topic.name)
