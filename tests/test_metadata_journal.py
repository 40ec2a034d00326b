"""nsqd.dat's journal (broker/metadata.py): a creation is a line appended and fsynced, nsqd.dat is written
again only once the journal is as large as it, a second after the last change and at a clean exit, and
whatever the files hold at any moment (nsqd.dat old or new, the journal torn, there or not) loads as the
broker's topics and channels were."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_nsq.broker import metadata
from trio_nsq.broker.metadata import JOURNAL_FILE, METADATA_FILE, dumps, read_metadata, replay
from trio_nsq.testing.embed import run_nsqd


def _topics(*entries: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in entries}


def test_replay_sets_each_topic_and_channel_to_what_its_last_line_says():
    topics = _topics({"name": "a", "paused": False, "channels": [{"name": "x", "paused": False}]})
    journal = b"".join(dumps(r) + b"\n" for r in [
        ["T", "b", {"name": "b", "paused": False, "channels": None}],
        ["C", "b", "y", {"name": "y", "paused": False}],
        ["C", "a", "x", {"name": "x", "paused": True}],
        ["C", "a", "z", {"name": "z", "paused": False}],
        ["C", "a", "x", None],
        ["T", "c", {"name": "c", "paused": False, "channels": None}],
        ["T", "c", None],
        ["C", "c", "q", {"name": "q", "paused": False}],  # its topic is gone: nothing to do
    ])
    assert replay(topics, journal) == len(journal)
    assert list(topics.values()) == [
        {"name": "a", "paused": False, "channels": [{"name": "z", "paused": False}]},
        {"name": "b", "paused": False, "channels": [{"name": "y", "paused": False}]},
    ]
    again = json.loads(json.dumps(list(topics.values())))
    replay(topics, journal)  # replayed over what already holds it: nothing changes
    assert list(topics.values()) == again


def test_a_torn_or_foreign_line_ends_the_journal():
    first = dumps(["T", "a", {"name": "a", "paused": False, "channels": None}]) + b"\n"
    second = dumps(["T", "b", {"name": "b", "paused": False, "channels": None}]) + b"\n"
    for tail in (second[:9], b"\x00" * 40 + b"\n", b'["X","b"]\n', b'["T",7,null]\n', b'["C","a",null,{}]\n',
                 b'["T","b",{"name":"b","paused":"yes"}]\n'):
        topics: dict[str, dict[str, Any]] = {}
        assert replay(topics, first + tail + second) == len(first)
        assert list(topics) == ["a"]


_ops = st.lists(st.tuples(st.sampled_from(["topic", "channel", "pause", "delete_channel", "delete_topic"]),
                          st.integers(0, 3), st.integers(0, 3)), max_size=40)


@given(ops=_ops, compacted_at=st.integers(0, 40), torn=st.integers(0, 30))
@settings(max_examples=200, deadline=None)
def test_nsqd_dat_of_any_moment_with_the_journal_replays_to_the_last_state(ops, compacted_at, torn):
    """The journal's lines replayed over nsqd.dat as it was when any earlier compaction wrote it (before the
    journal was unlinked) give the state after the last whole line; a torn last line is dropped."""
    model: dict[str, dict[str, Any]] = {}
    lines, dat = [], None
    for i, (op, t, c) in enumerate(ops):
        if i == compacted_at:
            dat = json.loads(json.dumps(list(model.values())))
        topic, channel = f"t{t}", f"c{c}"
        entry = model.get(topic)
        if op == "topic" or entry is None:
            if entry is None:
                model[topic] = {"name": topic, "paused": False, "channels": None}
                lines.append(["T", topic, json.loads(json.dumps(model[topic]))])
            continue
        channels = {ch["name"]: ch for ch in entry["channels"] or ()}
        if op == "channel":
            channels.setdefault(channel, {"name": channel, "paused": False})
            line = ["C", topic, channel, channels[channel]]
        elif op == "pause" and channel in channels:
            channels[channel] = {"name": channel, "paused": not channels[channel]["paused"]}
            line = ["C", topic, channel, channels[channel]]
        elif op == "delete_channel":
            channels.pop(channel, None)
            line = ["C", topic, channel, None]
        elif op == "delete_topic":
            del model[topic]
            lines.append(["T", topic, None])
            continue
        else:
            continue
        entry["channels"] = list(channels.values()) or None
        lines.append(json.loads(json.dumps(line)))
    journal = b"".join(dumps(line) + b"\n" for line in lines)
    topics = {e["name"]: e for e in (dat or [])}
    assert replay(topics, journal) == len(journal)
    assert topics == model
    if journal and torn:
        cut = journal[: max(0, len(journal) - torn)]
        good = cut[: cut.rfind(b"\n") + 1]
        topics = {e["name"]: e for e in (dat or [])}
        assert replay(topics, cut) == len(good)


async def test_creations_are_journal_lines_and_nsqd_dat_is_written_again_rarely(tmp_path, monkeypatch):
    """Three hundred topics with two channels each: nsqd.dat is written again a few times (each time the
    journal is as large as it), not per creation; at every moment the files hold what was answered; a
    second without a change leaves nsqd.dat whole and no journal."""
    monkeypatch.setattr(metadata, "JOURNAL_MIN", 4096)
    compactions = []
    async with trio.open_nursery() as nursery:
        running = await nursery.start(lambda task_status: run_nsqd(data_path=str(tmp_path), task_status=task_status))
        nsqd = running.server
        real = nsqd.meta._compact_files

        def counted(lines: bytes, data: bytes) -> None:
            compactions.append(len(data))
            real(lines, data)
        monkeypatch.setattr(nsqd.meta, "_compact_files", counted)
        for i in range(300):
            topic = nsqd.get_topic(f"t{i:03d}")
            topic.get_channel("a")
            topic.get_channel("b")
            if i % 7 == 3:
                topic.delete_channel("a")
            if i % 11 == 5:
                nsqd.delete_topic(f"t{i - 1:03d}")
            await nsqd.metadata_persisted()
            if i % 50 == 49:
                async with nsqd.meta._lock:  # no write under way: the files as a crash now would leave them
                    snapshot = tmp_path.parent / "snapshot"
                    snapshot.mkdir()
                    for name in (METADATA_FILE, JOURNAL_FILE):
                        if (tmp_path / name).exists():
                            shutil.copy(tmp_path / name, snapshot / name)
                    assert read_metadata(str(snapshot))[0] == nsqd.metadata()["topics"]
                    shutil.rmtree(snapshot)
        assert 3 <= len(compactions) <= 20, compactions  # nsqd.dat grew to ~25 kB, the journal to each size
        await trio.sleep(metadata.COMPACT_AFTER + 0.5)
        assert not (tmp_path / JOURNAL_FILE).exists()
        assert json.loads((tmp_path / METADATA_FILE).read_bytes()) == nsqd.metadata()
        nursery.cancel_scope.cancel()


async def test_a_journal_torn_by_a_crash_loads_its_whole_lines_and_is_compacted(tmp_path, caplog):
    (tmp_path / METADATA_FILE).write_bytes(b'{"topics":[{"name":"old","paused":false,"channels":null}],"version":"1.3.0"}')
    lines = [["T", "new", {"name": "new", "paused": False, "channels": None}],
             ["C", "new", "c", {"name": "c", "paused": True}],
             ["C", "old", "d", {"name": "d", "paused": False}]]
    journal = b"".join(dumps(line) + b"\n" for line in lines)
    (tmp_path / JOURNAL_FILE).write_bytes(journal[:-12])  # the last append torn
    caplog.set_level(logging.WARNING)
    async with trio.open_nursery() as nursery:
        running = await nursery.start(lambda task_status: run_nsqd(data_path=str(tmp_path), task_status=task_status))
        nsqd = running.server
        await nsqd.loaded.wait()
        assert sorted(nsqd.topics) == ["new", "old"]
        assert nsqd.topics["new"].channels["c"].paused and not nsqd.topics["old"].channels
        for _ in range(50):  # the first write compacts
            await trio.sleep(0.05)
            if not (tmp_path / JOURNAL_FILE).exists():
                break
        assert not (tmp_path / JOURNAL_FILE).exists()
        written = json.loads((tmp_path / METADATA_FILE).read_bytes())["topics"]
        assert [t["name"] for t in written] == ["old", "new"]
        nursery.cancel_scope.cancel()
    assert any("past its last whole line dropped" in r.getMessage() for r in caplog.records)
