"""A broker holding many topics (issue 43), in process: the data directory is listed once at start however
many topics it holds, the broker listens before its topics are open and answers correctly meanwhile (a
request opens what it names; /stats waits for them all), nsqd.dat keeps the topics not open yet, a
creation is answered once nsqd.dat names it, and the names of the data directory go to their topics."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from trio_nsq.broker.metadata import read_metadata
from trio_nsq.broker.storage.data_dir import ChannelNames, DataDir, topic_of
from trio_nsq.testing.embed import run_nsqd


def test_each_file_goes_to_its_topic():
    names = ["t.diskqueue.000000.dat", "t.diskqueue.meta.dat", "t.diskqueue.meta.dat.123.tmp",
             "t.diskqueue.deadlines.000001.dat", "t:c.cursor.dat", "t:c.cursor.dat.9.tmp",
             "t:c.diskqueue.000003.dat", "t:c.diskqueue.cursor.dat", "t.idempotency.dat",
             "a.b.diskqueue.000000.dat", "x.diskqueue.diskqueue.meta.dat", "x.diskqueue:ch.cursor.dat",
             "nsqd.dat", "nsqd.dat.7.tmp", "lost+found"]
    assert [topic_of(n) for n in names] == ["t"] * 9 + ["a.b", "x.diskqueue", "x.diskqueue", None, None, None]
    listing = DataDir(names)
    assert sorted(listing.topics()) == ["a.b", "t", "x.diskqueue"]
    assert len(listing.take("t")) == 9 and listing.take("t") == []  # taken once: the topic owns them now


async def http(running: Any, method: str, path: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=f"http://{running.http_address}") as client:
        return await client.request(method, path)


async def make_topics(data: Path, count: int) -> None:
    """`count` topics with two channels and a message each, made through the HTTP API, then a clean exit."""
    async with trio.open_nursery() as nursery:
        running = await nursery.start(lambda task_status: run_nsqd(data_path=str(data), mem_queue_size=0,
                                                                   task_status=task_status))
        async with httpx.AsyncClient(base_url=f"http://{running.http_address}") as client:
            for i in range(count):
                assert (await client.post(f"/topic/create?topic=t{i}")).status_code == 200
                for channel in ("a", "b"):
                    assert (await client.post(f"/channel/create?topic=t{i}&channel={channel}")).status_code == 200
                assert (await client.post(f"/pub?topic=t{i}", content=b"m%d" % i)).status_code == 200
        nursery.cancel_scope.cancel()


def test_a_channel_finds_its_own_files_among_its_topics():
    """Channel names may hold dots: `c` and `c.v2` share a bucket. A channel gets the names that start with
    its own `<topic>:<channel>.` (`c`'s include `c.v2`'s, as the whole listing did before: each reader and
    queue tests its exact file names), never another bucket's."""
    names = ["t.diskqueue.000000.dat", "t:c.cursor.dat", "t:c.diskqueue.000001.dat", "t:c.v2.cursor.dat",
             "t:c.v2.cursor.dat.9.tmp", "t:cc.cursor.dat", "t:d.diskqueue.meta.dat"]
    channels = ChannelNames(names)
    assert channels.of("t:c") == ["t:c.cursor.dat", "t:c.diskqueue.000001.dat", "t:c.v2.cursor.dat",
                                  "t:c.v2.cursor.dat.9.tmp"]
    assert channels.of("t:c.v2") == ["t:c.v2.cursor.dat", "t:c.v2.cursor.dat.9.tmp"]
    assert channels.of("t:d") == ["t:d.diskqueue.meta.dat"] and channels.of("t:e") == []
    channels.forget("t:c.v2")
    assert channels.of("t:c.v2") == [] and channels.of("t:c") == ["t:c.cursor.dat", "t:c.diskqueue.000001.dat"]


async def test_the_data_directory_is_listed_once_whatever_it_holds(tmp_path, monkeypatch):
    """Opening a topic looks at its own files: the directory is listed once at start, for 10 topics as for
    60 (it was listed for every log, cursor and topic: start-up quadratic in topics)."""
    listings: list[int] = []
    real = os.listdir

    def counting(path: Any = ".") -> list[str]:
        listings.append(1)
        return real(path)
    for count in (10, 60):
        data = tmp_path / f"d{count}"
        data.mkdir()
        await make_topics(data, count)
        monkeypatch.setattr(os, "listdir", counting)
        listings.clear()
        async with trio.open_nursery() as nursery:
            running = await nursery.start(lambda task_status: run_nsqd(data_path=str(data), mem_queue_size=0,
                                                                       task_status=task_status))
            stats = (await http(running, "GET", "/stats?format=json")).json()
            assert len(stats["topics"]) == count
            assert all(c["depth"] == 1 for t in stats["topics"] for c in t["channels"])
            nursery.cancel_scope.cancel()
        monkeypatch.setattr(os, "listdir", real)
        assert len(listings) == 1, (count, len(listings))


async def test_the_broker_answers_before_its_topics_are_open(tmp_path):
    """Listening comes first; the topics nsqd.dat names open after, one a turn of the event loop. What
    asks for one opens it at once; /stats waits until every one is open; nsqd.dat written meanwhile
    keeps those not open yet."""
    await make_topics(tmp_path, 30)
    async with trio.open_nursery() as nursery:
        running = await nursery.start(lambda task_status: run_nsqd(data_path=str(tmp_path), mem_queue_size=0,
                                                                   task_status=task_status))
        nsqd = running.server
        assert not nsqd.loaded.is_set() and len(nsqd.topics) < 30  # listening, topics still to open
        # a creation now: nsqd.dat names it and every topic not open yet
        nsqd.get_topic("late")
        await nsqd.metadata_persisted()
        written = on_disk(tmp_path)
        assert {t["name"] for t in written} == {f"t{i}" for i in range(30)} | {"late"}
        assert all(len(t["channels"]) == 2 for t in written if t["name"] != "late")
        # a request naming one not open yet opens it (with its channels and its message)
        pending = next(f"t{i}" for i in range(30) if f"t{i}" not in nsqd.topics)
        answer = await http(running, "POST", f"/channel/empty?topic={pending}&channel=a")
        assert answer.status_code == 200
        stats = (await http(running, "GET", "/stats?format=json")).json()  # waits for them all
        assert nsqd.loaded.is_set() and len(stats["topics"]) == 31
        depths = {(t["topic_name"], c["channel_name"]): c["depth"] for t in stats["topics"] for c in t["channels"]}
        assert depths[(pending, "a")] == 0 and depths[(pending, "b")] == 1
        nursery.cancel_scope.cancel()


async def test_a_creation_is_answered_once_nsqd_dat_names_it(tmp_path):
    async with trio.open_nursery() as nursery:
        running = await nursery.start(lambda task_status: run_nsqd(data_path=str(tmp_path), task_status=task_status))

        async def create(i: int) -> None:
            answer = await http(running, "POST", f"/topic/create?topic=c{i}")
            assert answer.status_code == 200
            names = [t["name"] for t in on_disk(tmp_path)]
            assert f"c{i}" in names  # on disk before the answer
            answer = await http(running, "POST", f"/channel/create?topic=c{i}&channel=x")
            assert answer.status_code == 200
            topics = on_disk(tmp_path)
            assert [c["name"] for t in topics if t["name"] == f"c{i}" for c in t["channels"]] == ["x"]
        async with trio.open_nursery() as clients:
            for i in range(20):  # together: they share writes
                clients.start_soon(create, i)
        nursery.cancel_scope.cancel()


async def test_a_failed_nsqd_dat_write_is_a_500_and_the_next_one_succeeds(tmp_path, monkeypatch):
    async with trio.open_nursery() as nursery:
        running = await nursery.start(lambda task_status: run_nsqd(data_path=str(tmp_path), task_status=task_status))
        nsqd = running.server
        real = nsqd.meta._append

        def failing(lines: bytes) -> None:
            with open(tmp_path / "nsqd.dat.journal", "ab") as fh:
                fh.write(lines[:7])  # a short write: what it left is written over by the next append
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(nsqd.meta, "_append", failing)
        assert (await http(running, "POST", "/topic/create?topic=refused")).status_code == 500
        monkeypatch.setattr(nsqd.meta, "_append", real)
        await trio.sleep(1.2)  # the writer tries again
        assert [t["name"] for t in on_disk(tmp_path)] == ["refused"]
        assert (await http(running, "POST", "/topic/create?topic=next")).status_code == 200
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("changes", ["pause", "config"])
async def test_what_changes_a_topics_entry_is_written(tmp_path, changes):
    """nsqd.dat keeps each topic's entry as written and makes again only what changed: a pause, a channel's
    pause and a setting each reach the file."""
    async with trio.open_nursery() as nursery:
        running = await nursery.start(lambda task_status: run_nsqd(data_path=str(tmp_path), task_status=task_status))
        for path in ("/topic/create?topic=t", "/channel/create?topic=t&channel=c", "/topic/create?topic=u"):
            assert (await http(running, "POST", path)).status_code == 200
        if changes == "pause":
            assert (await http(running, "POST", "/channel/pause?topic=t&channel=c")).status_code == 200
            assert (await http(running, "POST", "/topic/pause?topic=u")).status_code == 200
            await running.server.metadata_persisted()
            want = [{"name": "t", "paused": False, "channels": [{"name": "c", "paused": True}]},
                    {"name": "u", "paused": True, "channels": None}]
        else:
            assert (await http(running, "POST", "/channel/config?topic=t&channel=c&max_depth=5")).status_code == 200
            want = [{"name": "t", "paused": False, "channels": [{"name": "c", "paused": False, "config": {"max_depth": 5}}]},
                    {"name": "u", "paused": False, "channels": None}]
        assert on_disk(tmp_path) == want
        nursery.cancel_scope.cancel()
    assert json.loads((tmp_path / "nsqd.dat").read_bytes())["topics"] == want  # a clean exit compacts


def on_disk(data: Path) -> list[dict[str, Any]]:
    """The topics nsqd.dat and its journal hold (what a broker started on `data` now would load)."""
    topics, good, size = read_metadata(str(data))
    assert good == size
    return topics
