"""What is deleted stays deleted and what is answered is on disk, through power losses (issue 48, findings
1, 5, 6 and 8): a whole NSQD in process (its metadata writer, its topics, its HTTP handlers called
directly, no listener) over tests/power_loss.py, killed as kill -9 leaves it, then the disk as a power
loss leaves it, then started again on the same directory."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import trio

from trio_nsq.broker.http.endpoints import Api
from trio_nsq.broker.http.log_api import LogApi
from trio_nsq.broker.metadata import JOURNAL_FILE, METADATA_FILE, dumps
from trio_nsq.broker.nsqd import NSQD
from trio_nsq.broker.options import Options
from trio_nsq.broker.storage.data_dir import DataDir, channel_of
from trio_nsq.broker.topic import Topic
from trio_nsq.shared.http_api import HTTPError
from trio_nsq.shared.http_server import Request
from tests.power_loss import PowerLoss, power_loss  # noqa: F401 (the fixture)
from tests.topic_owner import kill


class Broker:
    """An NSQD in process with no listener: its metadata writer, its topics and the HTTP API's handlers
    (`call`). `kill` is kill -9: nothing more is written (no clean exit), every descriptor closed."""

    def __init__(self, data: Path | str, **options: Any) -> None:
        opts = Options()
        opts.node_id = 1
        opts.data_path = str(data)
        opts.mem_queue_size = 0
        for key, value in options.items():
            setattr(opts, key, value)
        self.data, self.options = data, options
        self.nsqd = NSQD(opts)
        self.api = Api(self.nsqd)
        self.log_api = LogApi(self.api)
        self._scope: trio.CancelScope | None = None
        self._done = trio.Event()

    async def start(self, nursery: trio.Nursery) -> Broker:
        await nursery.start(self._run)
        return self

    async def _run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        nsqd = self.nsqd
        nsqd._lock_data_path()
        try:
            nsqd.load_metadata()
            with trio.CancelScope() as self._scope:
                async with trio.open_nursery() as nursery:
                    nsqd._nursery = nursery
                    nursery.start_soon(nsqd.meta.run)
                    nursery.start_soon(nsqd._open_pending_topics)
                    task_status.started()
                    await trio.sleep_forever()
        finally:
            nsqd._unlock_data_path()
            self._done.set()

    async def kill(self) -> None:
        for topic in list(self.nsqd.topics.values()):
            kill(topic)
        assert self._scope is not None
        self._scope.cancel()
        await self._done.wait()

    async def restarted_after(self, power_loss: PowerLoss, nursery: trio.Nursery) -> Broker:
        """Killed, the power lost, and a new broker started on the same directory with the same options."""
        await self.kill()
        power_loss.crash("strict")
        return await Broker(self.data, **self.options).start(nursery)

    async def call(self, method: str, path: str, query: str, body: bytes = b"") -> Any:
        """An HTTP endpoint's handler, as the server calls it; its Reply, or the HTTPError it raised."""
        if path.startswith("/log/"):
            handler = getattr(self.log_api, path.removeprefix("/log/"))
        else:
            handler = getattr(self.api, path.strip("/").replace("/", "_"))

        async def reader(cap: int) -> bytes | None:
            return body
        req = Request(method, path, query.encode(), {"content-length": str(len(body))}, reader=reader)
        try:
            return await handler(req, {})
        except HTTPError as exc:
            return exc

    async def channel(self, topic: str, channel: str) -> None:
        ok(await self.call("POST", "/topic/create", f"topic={topic}"))
        ok(await self.call("POST", "/channel/create", f"topic={topic}&channel={channel}"))

    def topic(self, name: str) -> Topic:
        topic = self.nsqd.get_existing_topic(name)
        assert topic is not None, name
        return topic


def ok(reply: Any) -> Any:
    assert not isinstance(reply, HTTPError), reply
    return reply


def journal_lines(data: Path) -> list[bytes]:
    try:
        return (data / JOURNAL_FILE).read_bytes().splitlines()
    except FileNotFoundError:
        return []


# --- finding 1: a deleted topic stays deleted --------------------------------------------------------


async def _deleted_among_creates_then_power_loss(b: Broker, power_loss: PowerLoss, path: str, query: str) -> None:
    """A delete between two creations (journal lines before and after it), then a power loss."""
    ok(await b.call("POST", "/topic/create", "topic=x"))
    ok(await b.call("POST", path, query))
    ok(await b.call("POST", "/topic/create", "topic=other"))
    await b.kill()
    power_loss.crash("strict")


async def test_a_deleted_topic_made_again_after_a_power_loss_has_a_new_log_and_no_old_keys(power_loss):
    """Issue 48's recipe: `t` with channel `c`, 5 messages and a key; `x` made (a journal exists), `t`
    deleted, `other` made; a power loss: `t` made again is another log, empty, without the old key."""
    data = Path(power_loss.data_dir)
    async with trio.open_nursery() as nursery:
        b = await Broker(data, sync_every=1).start(nursery)
        await b.channel("t", "c")
        t = b.topic("t")
        old_id = t.log.log_id
        for i in range(5):
            await b.api._publish(t, [b"m%d" % i], "pub", None if i else "K1")
        await t.group.sync_round()
        await _deleted_among_creates_then_power_loss(b, power_loss, "/topic/delete", "topic=t")

        b = await Broker(data, sync_every=1).start(nursery)
        assert b.nsqd.get_existing_topic("t") is None
        await b.channel("t", "c")
        t = b.topic("t")
        assert t.log.log_id != old_id
        assert t.channels["c"].depth() == 0
        assert "K1" not in t.idempotency.keys
        await b.api._publish(t, [b"again"], "pub", "K1")  # a key of the deleted topic is not honoured
        assert t.channels["c"].depth() == 1
        await b.kill()


async def test_a_deleted_channel_made_again_after_a_power_loss_starts_at_the_end(power_loss):
    """A channel deleted, then a power loss: made again, it does not take the old cursor back (a new
    channel starts at the log's end, as a new one does)."""
    data = Path(power_loss.data_dir)
    async with trio.open_nursery() as nursery:
        b = await Broker(data, sync_every=1).start(nursery)
        await b.channel("t", "keep")
        await b.channel("t", "c")
        t = b.topic("t")
        for i in range(5):
            await b.api._publish(t, [b"m%d" % i], "pub", None)
        await t.group.sync_round()
        await _deleted_among_creates_then_power_loss(b, power_loss, "/channel/delete", "topic=t&channel=c")

        b = await Broker(data, sync_every=1).start(nursery)
        t = b.topic("t")
        assert "c" not in t.channels
        assert t.channels["keep"].depth() == 5
        await b.channel("t", "c")
        assert t.channels["c"].depth() == 0
        await b.kill()


async def test_files_of_a_topic_nsqd_dat_does_not_name_are_removed_at_start(tmp_path, caplog):
    """Files a deleted topic left (a removal that failed, or a broker before this fix) are removed at
    start when nsqd.dat loaded and does not name the topic; those of a topic it names stay; without an
    nsqd.dat nothing is removed (a lost nsqd.dat must not cost every topic its data)."""
    async with trio.open_nursery() as nursery:
        b = await Broker(tmp_path).start(nursery)
        for name in ("gone", "kept"):
            await b.channel(name, "c")
            await b.api._publish(b.topic(name), [b"m"], "pub", None)
            await b.topic(name).group.sync_round()
        b.nsqd.write_metadata_now()  # nsqd.dat names both
        await b.kill()
    gone = sorted(n for n in os.listdir(tmp_path) if n.startswith("gone"))
    assert gone
    saved = {n: (tmp_path / n).read_bytes() for n in gone}
    lines = [dumps(["T", "gone", None])]
    with open(tmp_path / JOURNAL_FILE, "ab") as fh:
        fh.write(b"".join(line + b"\n" for line in lines))

    caplog.set_level(logging.INFO, logger="nsqd")
    async with trio.open_nursery() as nursery:
        b = await Broker(tmp_path).start(nursery)
        assert not [n for n in os.listdir(tmp_path) if n.startswith("gone")]
        assert [r for r in caplog.records if "gone" in r.getMessage() and "removed" in r.getMessage()]
        assert b.topic("kept").channels["c"].depth() == 1
        await b.channel("gone", "c")
        assert b.topic("gone").channels["c"].depth() == 0
        await b.kill()

    # no nsqd.dat and no journal: the files are left for a topic made later (as Go nsqd does)
    for name in os.listdir(tmp_path):
        os.remove(tmp_path / name)
    for name, raw in saved.items():
        (tmp_path / name).write_bytes(raw)
    async with trio.open_nursery() as nursery:
        b = await Broker(tmp_path).start(nursery)
        assert sorted(n for n in os.listdir(tmp_path) if n.startswith("gone")) == gone
        await b.channel("gone", "c")
        assert b.topic("gone").channels["c"].depth() == 1
        await b.kill()


# --- finding 5: the journal's name is durable before a line in it is answered ------------------------


async def test_a_journal_whose_directory_fsync_failed_is_fsynced_into_it_by_the_next_append(power_loss):
    data = Path(power_loss.data_dir)
    async with trio.open_nursery() as nursery:
        b = await Broker(data).start(nursery)
        power_loss.fail_fsync(lambda p: os.path.realpath(p) == os.path.realpath(data))
        reply = await b.call("POST", "/topic/create", "topic=a")
        assert isinstance(reply, HTTPError) and reply.status == 500
        power_loss.fail_fsync(None)
        ok(await b.call("POST", "/topic/create", "topic=b"))
        assert power_loss.durable(data / JOURNAL_FILE) is not None
        b = await b.restarted_after(power_loss, nursery)
        assert b.nsqd.get_existing_topic("b") is not None
        await b.kill()


async def test_an_empty_journal_a_kill_left_is_fsynced_into_its_directory(power_loss):
    """A kill between the journal's O_CREAT and its first write leaves it empty (and its name maybe not
    durable): the next creation's answer waits for the name too."""
    data = Path(power_loss.data_dir)
    fd = os.open(data / JOURNAL_FILE, os.O_WRONLY | os.O_CREAT, 0o600)
    os.close(fd)
    async with trio.open_nursery() as nursery:
        b = await Broker(data).start(nursery)
        ok(await b.call("POST", "/topic/create", "topic=b"))
        assert power_loss.durable(data / JOURNAL_FILE) is not None or power_loss.durable(data / METADATA_FILE)
        b = await b.restarted_after(power_loss, nursery)
        assert b.nsqd.get_existing_topic("b") is not None
        await b.kill()


async def test_journal_lines_a_kill_left_unfsynced_are_fsynced_before_they_are_acted_on(power_loss):
    """A kill -9 leaves lines in the page cache only; the broker that starts on them acts on them (a topic
    named there is served): they are fsynced, with the journal's name, before."""
    data = Path(power_loss.data_dir)
    line = dumps(["T", "seen", {"name": "seen", "paused": True, "channels": None}]) + b"\n"
    fd = os.open(data / JOURNAL_FILE, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, line)
    os.close(fd)
    async with trio.open_nursery() as nursery:
        b = await Broker(data).start(nursery)
        assert b.topic("seen").paused
        assert power_loss.durable(data / JOURNAL_FILE) == line
        await b.kill()


# --- finding 6: pause, unpause and delete are answered once on disk ---------------------------------


@pytest.mark.parametrize("what", ["topic", "channel"])
async def test_a_pause_answered_survives_a_power_loss_at_once(power_loss, what):
    data = Path(power_loss.data_dir)
    query = "topic=t&channel=c" if what == "channel" else "topic=t"
    async with trio.open_nursery() as nursery:
        b = await Broker(data).start(nursery)
        await b.channel("t", "c")
        ok(await b.call("POST", f"/{what}/pause", query))
        b = await b.restarted_after(power_loss, nursery)
        target = b.topic("t") if what == "topic" else b.topic("t").channels["c"]
        assert target.paused
        ok(await b.call("POST", f"/{what}/unpause", query))
        b = await b.restarted_after(power_loss, nursery)
        target = b.topic("t") if what == "topic" else b.topic("t").channels["c"]
        assert not target.paused
        await b.kill()


async def test_a_delete_answered_survives_a_power_loss_at_once(power_loss):
    data = Path(power_loss.data_dir)
    async with trio.open_nursery() as nursery:
        b = await Broker(data).start(nursery)
        await b.channel("t", "c")
        await b.channel("u", "c")
        ok(await b.call("POST", "/channel/delete", "topic=u&channel=c"))
        ok(await b.call("POST", "/topic/delete", "topic=t"))
        b = await b.restarted_after(power_loss, nursery)
        assert b.nsqd.get_existing_topic("t") is None
        assert b.topic("u").channels == {}
        await b.kill()


@pytest.mark.parametrize("path", ["/pub", "/mpub"])
async def test_a_topic_made_by_a_publish_is_named_on_disk_before_the_answer(power_loss, path):
    data = Path(power_loss.data_dir)
    async with trio.open_nursery() as nursery:
        b = await Broker(data).start(nursery)
        ok(await b.call("POST", "/topic/create", "topic=x"))  # a journal exists
        ok(await b.call("POST", path, "topic=made", b"m"))
        b = await b.restarted_after(power_loss, nursery)
        assert b.nsqd.get_existing_topic("made") is not None
        await b.kill()


# --- finding 8: the positional flag is on disk before a position is given out ------------------------


async def test_the_positional_flag_is_on_disk_before_the_first_log_answer(power_loss):
    data = Path(power_loss.data_dir)
    async with trio.open_nursery() as nursery:
        b = await Broker(data, mem_queue_size=10000).start(nursery)
        await b.channel("t", "c")
        t = b.topic("t")
        await b.api._publish(t, [b"m"], "pub", None)
        t.log.request_meta()
        await t.group.sync_round()  # the log id is on disk already: only the flag is new
        assert t.log.epoch_on_disk and not t.log.positional
        ok(await b.call("GET", "/log/positions", "topic=t"))
        await b.kill()
        power_loss.crash("strict")
        b = await Broker(data, mem_queue_size=10000).start(nursery)
        assert b.topic("t").log.positional
        await b.kill()


def test_the_channel_of_a_file_and_the_channels_taken_away():
    """A channel's files by name (channel names may hold dots, even ".cursor." or ".diskqueue."): those of
    the channels selected are taken from the topic's, the rest stay (a name whose channel cannot be told
    stays the topic's)."""
    assert channel_of("t:c.cursor.dat") == "c"
    assert channel_of("t:c.cursor.dat.123.tmp") == "c"
    assert channel_of("t:a.b.diskqueue.000001.dat") == "a.b"
    assert channel_of("t:x.diskqueue.y.cursor.dat") == "x.diskqueue.y"
    assert channel_of("t:a.cursor.b.diskqueue.meta.dat") == "a.cursor.b"
    assert channel_of("t.diskqueue.000000.dat") is None
    assert channel_of("t:odd") is None
    names = ["t.diskqueue.meta.dat", "t:a.cursor.dat", "t:a.b.cursor.dat", "t:a.b.diskqueue.meta.dat", "t:odd",
             "u:a.cursor.dat"]
    data_dir = DataDir(names)
    assert sorted(data_dir.take_channels("t", lambda channel: channel == "a.b")) == [
        "t:a.b.cursor.dat", "t:a.b.diskqueue.meta.dat"]
    assert sorted(data_dir.take("t")) == ["t.diskqueue.meta.dat", "t:a.cursor.dat", "t:odd"]
    assert data_dir.take_channels("v", lambda channel: True) == []
