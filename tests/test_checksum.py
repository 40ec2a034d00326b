"""The CRC side files (broker/storage/checksums.py): what Go's format cannot tell, a record whose length
and message id were written back before a power loss and whose body was not, is cut at open; what a kill
-9 left is all kept; a directory Go nsqd (or an older trio-nsq) wrote last is not cut; side files go with
their segments. That Go nsqd 1.3.0 loads a directory with side files, and we what it appended, is checked
by tests/bench/go_side_files.py under `make bench NSQ_REFERENCE=<dir>` (the suite needs no Go binary)."""

from __future__ import annotations

import logging
import os
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import trio.testing

from trio_nsq.broker.topic import Topic
from tests.power_loss import PowerLoss, power_loss  # noqa: F401 (the fixture)
from tests.topic_owner import Owner, drain, kill

def open_topic(d: Path | str, **options: Any) -> Topic:
    """Topic `t` with its channel `c`, every message through the log (--mem-queue-size=0)."""
    options.setdefault("mem_queue_size", 0)
    topic = Topic(Owner(d, trio.testing.MockClock(), strict=True, **options), "t")  # type: ignore[arg-type]
    topic.get_channel("c")
    return topic


def segment(d: Path | str, num: int = 0) -> str:
    return os.path.join(d, f"t.diskqueue.{num:06d}.dat")


def side(d: Path | str, num: int = 0) -> str:
    return os.path.join(d, f"t.diskqueue.{num:06d}.crc")


def write_back(path: str, data: bytes | None = None, *, at: int = 0, length: int | None = None) -> None:
    """What the kernel wrote back before the power went: the page cache's bytes of `path` (with `data`
    at `at` in place of what is there, or cut to `length`) made durable, as an fsync does."""
    fd = os.open(path, os.O_WRONLY)
    try:
        if data is not None:
            os.pwrite(fd, data, at)
        if length is not None:
            os.ftruncate(fd, length)
        os.fsync(fd)
    finally:
        os.close(fd)


def log_bodies(topic: Topic) -> list[bytes]:
    """The bodies of every record in the topic's log, first to last (what a reader by position reads)."""
    assert topic.log is not None
    segments = topic.log.segments
    reader = segments.reader(segments.start, segments.start_index())
    try:
        return [record[26:] for record in reader.read(100_000, segments.tail, [])]
    finally:
        reader.close()


def cut_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "cutting" in r.getMessage() and r.levelname == "WARNING"]


# --- a power loss ----------------------------------------------------------------------------------


@pytest.mark.parametrize("entry_written_back", [True, False])
async def test_a_record_zeroed_inside_its_body_after_a_power_loss_is_cut(power_loss, caplog, entry_written_back):  # noqa: F811
    """Three publishes after the last round (three batches); the kernel wrote back the segment's pages,
    but the second record's body reads as zeros (its page never made it: a record longer than what is
    left of a page). Its length and its id are whole, so Go's format takes it for a message. Its batch's
    CRC does not match (or, when the side file's entries were not written back, none covers it): the log
    is cut at its batch, with one WARNING, and it is never delivered."""
    caplog.set_level(logging.INFO, logger="nsqd")
    d = power_loss.data_dir
    answered = [b"answered-%d" % i for i in range(5)]
    late = [b"late-%d-" % i + b"x" * 200 for i in range(3)]
    topic = open_topic(d)
    topic.publish(answered)
    await topic.group.sync_round()
    for body in late:
        topic.publish([body])
    kill(topic)
    blob = Path(segment(d)).read_bytes()
    write_back(segment(d), bytes(len(late[1])), at=blob.index(late[1]))  # length and id kept, body zeros
    if entry_written_back and os.path.exists(side(d)):  # (on a main without side files: none)
        write_back(side(d))
    power_loss.crash("strict")
    assert Path(segment(d)).read_bytes().count(b"late-") == 2  # the first and the third are whole

    topic = open_topic(d)
    got = drain(topic.get_channel("c"))
    kill(topic)
    assert got == answered + (late[:1] if entry_written_back else [])
    assert not any(b"\0" * 16 in body for body in got)
    lines = cut_lines(caplog)
    assert len(lines) == 1 and ("checksum" in lines[0]), lines


async def test_a_log_without_metadata_yet_is_checked_where_it_has_side_files(power_loss, caplog):  # noqa: F811
    """A power loss before the topic's first round: no metadata on disk. Another topic's round fsynced
    the directory (the names are durable), the kernel wrote back the segment (a body as zeros) and not
    the side file: nothing is covered, nothing is in the log (the zeroed body was, before)."""
    caplog.set_level(logging.INFO, logger="nsqd")
    d = power_loss.data_dir
    late = [b"late-%d-" % i + b"x" * 200 for i in range(3)]
    topic = open_topic(d)
    for body in late:
        topic.publish([body])
    kill(topic)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)  # what another topic's round does
    os.close(fd)
    blob = Path(segment(d)).read_bytes()
    write_back(segment(d), bytes(len(late[1])), at=blob.index(late[1]))
    power_loss.crash("strict")
    assert not os.path.exists(os.path.join(d, "t.diskqueue.meta.dat"))
    assert Path(segment(d)).read_bytes().count(b"late-") == 2

    topic = open_topic(d)
    got = log_bodies(topic)
    kill(topic)
    assert got == []
    assert len(cut_lines(caplog)) == 1


async def test_a_torn_side_file_cuts_at_the_first_record_it_no_longer_covers(power_loss, caplog):  # noqa: F811
    """Three batches after the last round, all of the segment written back, the side file only up to
    the first batch's entry and 7 bytes of the second's: the second and third batches are cut, the first
    kept. Appends go on after the torn entry (trimmed off first), and a kill -9 then keeps them all."""
    caplog.set_level(logging.INFO, logger="nsqd")
    d = power_loss.data_dir
    answered = [b"answered-%d" % i for i in range(4)]
    batches = [[b"batch-%d-%d" % (n, i) for i in range(2)] for n in range(3)]
    topic = open_topic(d)
    topic.publish(answered)
    await topic.group.sync_round()
    for batch in batches:
        topic.publish(batch)
    kill(topic)
    write_back(segment(d))
    durable = power_loss.durable(side(d))
    assert durable is not None
    write_back(side(d), length=len(durable) + 16 + 7)
    power_loss.crash("strict")
    assert all(body in Path(segment(d)).read_bytes() for batch in batches for body in batch)

    topic = open_topic(d)
    assert drain(topic.get_channel("c")) == answered + batches[0]
    assert len(cut_lines(caplog)) == 1
    await topic.group.sync_round()  # the FINs
    topic.publish([b"after-0"])
    topic.publish([b"after-1"])
    kill(topic)  # kill -9: the page cache keeps both files as they are
    topic = open_topic(d)
    assert drain(topic.get_channel("c")) == [b"after-0", b"after-1"]
    kill(topic)
    assert len(cut_lines(caplog)) == 1


# --- a kill -9 -------------------------------------------------------------------------------------


async def test_a_kill_9_keeps_every_record_across_rolls_and_restarts(tmp_path, caplog):
    """No power loss: whatever was written is in the page cache, both files whole. Batches of every
    size across rolls, rounds now and then, three kill -9s: every record comes, in order, none cut."""
    caplog.set_level(logging.INFO, logger="nsqd")
    published: list[bytes] = []
    for life in range(3):
        topic = open_topic(tmp_path, max_bytes_per_file=1024)
        for n in range(40):
            batch = [b"life-%d-batch-%02d-%d-" % (life, n, i) + b"y" * (n * 7 % 90) for i in range(n % 6 + 1)]
            topic.publish(batch)
            published.extend(batch)
            if n % 13 == 5:
                await topic.group.sync_round()
        kill(topic)
    topic = open_topic(tmp_path, max_bytes_per_file=1024)
    assert drain(topic.get_channel("c")) == published
    kill(topic)
    assert cut_lines(caplog) == []
    assert len(list(tmp_path.glob("t.diskqueue.*.crc"))) > 3  # rolled: a side file per segment


# --- a directory someone else wrote last -----------------------------------------------------------


def go_record(i: int, body: bytes) -> bytes:
    message = struct.pack(">qH", time.time_ns(), 0) + b"%016x" % (0x18a685037a269000 + i) + body
    return struct.pack(">i", len(message)) + message


@pytest.mark.parametrize("writer", ["go", "older trio-nsq"])
async def test_a_directory_written_last_by_go_or_an_older_trio_nsq_is_not_cut(tmp_path, caplog, writer):
    """Our topic exits cleanly; then Go nsqd (its metadata: three lines) or a trio-nsq without side files
    (its metadata: no `checksums` line) appends records, some before its metadata's write position and
    some past it: no entry covers them and none is cut. Then we append (kill -9, so the metadata is still
    theirs) and nothing is cut; once our metadata is written, what we append after it is checked again."""
    caplog.set_level(logging.INFO, logger="nsqd")
    ours = [b"ours-%d" % i for i in range(3)]
    topic = open_topic(tmp_path)
    topic.publish(ours)
    await topic.close()
    meta = Path(tmp_path / "t.diskqueue.meta.dat")
    lines = meta.read_text().split("\n")
    assert "checksums crc32" in lines
    theirs = [b"theirs-%d" % i for i in range(4)]
    if writer == "go":
        # Go nsqd wrote two, synced its metadata (three lines), wrote two more and was killed
        with open(segment(tmp_path), "ab") as fh:
            fh.write(b"".join(go_record(i, body) for i, body in enumerate(theirs[:2])))
        size = os.path.getsize(segment(tmp_path))
        meta.write_text(f"{int(lines[0]) + 2}\n{lines[1]}\n0,{size}\n")
        past = theirs[2:]
    else:
        # a trio-nsq before side files: the same metadata without the line; it wrote four, was killed
        meta.write_text("\n".join(x for x in lines if not x.startswith("checksums")))
        past = theirs
    with open(segment(tmp_path), "ab") as fh:  # past their write position: written, not synced
        fh.write(b"".join(go_record(i + 2, body) for i, body in enumerate(past)))

    topic = open_topic(tmp_path)
    assert log_bodies(topic) == ours + theirs
    topic.publish([b"more-0"])
    kill(topic)  # no round: the metadata is still theirs
    assert "checksums crc32" not in meta.read_text().split("\n")
    topic = open_topic(tmp_path)
    assert log_bodies(topic) == ours + theirs + [b"more-0"]
    await topic.close()
    assert "checksums crc32" in meta.read_text().split("\n")
    assert cut_lines(caplog) == []
    # ours again: bytes past our metadata that no entry covers are cut
    with open(segment(tmp_path), "ab") as fh:
        fh.write(go_record(9, b"no-entry"))
    topic = open_topic(tmp_path)
    assert log_bodies(topic) == ours + theirs + [b"more-0"]
    kill(topic)
    assert len(cut_lines(caplog)) == 1


# --- side files go with their segments -----------------------------------------------------------


async def test_side_files_go_with_their_segments(tmp_path):
    """Segments every channel finished are dropped by a round: their side files with them. A side file
    left below the first segment (a crash between the removals, or Go nsqd removing what it read) goes
    at open. A deleted topic leaves none."""
    topic = open_topic(tmp_path, max_bytes_per_file=256)
    topic.publish([b"m-%02d-" % i + b"z" * 60 for i in range(30)])
    assert len(list(tmp_path.glob("t.diskqueue.*.crc"))) > 4
    channel = topic.get_channel("c")
    assert len(drain(channel)) == 30
    await topic.group.sync_round()
    segments = sorted(p.name for p in tmp_path.glob("t.diskqueue.0*.dat"))
    assert sorted(p.name for p in tmp_path.glob("t.diskqueue.0*.crc")) == [s[:-4] + ".crc" for s in segments]
    assert len(segments) == 1
    await topic.close()
    stale = Path(side(tmp_path, 1))
    stale.write_bytes(b"")  # below the first segment kept
    topic = open_topic(tmp_path, max_bytes_per_file=256)
    assert not stale.exists()
    topic.publish([b"x"])
    assert list(tmp_path.glob("t.diskqueue.*.crc"))
    topic.delete()
    assert not list(tmp_path.glob("t.diskqueue.*"))
