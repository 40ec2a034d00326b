"""Every crash state of a few workloads, checked (tests/crash_states.py, issue 48): the model of a power loss
on plain file operations, each workload's states (0 violations expected), and mutations of nsqd.dat's
writer that each make the harness report violations. The whole file runs in about 20-30 s (the bounds are
in tests/crash_states.py's docstring)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trio_nsq.broker import metadata
from trio_nsq.broker.nsqd import NSQD
from trio_nsq.broker.storage import files
from tests.crash_states import Mark, Recorder, Workload, check_workload, crash_states, read_log
from tests.power_loss import write

STRICT = {"mem_queue_size": 0, "sync_every": 1}


# --- the model of a power loss, on plain file operations ----------------------------------------------


def states_at_end(disk: Recorder) -> set[frozenset[tuple[str, bytes]]]:
    """The states a power loss may leave after the last recorded call (marked "end" by the caller)."""
    disk.mark("end")
    last = len([c for c in disk.calls if isinstance(c, Mark)])
    return {state for state, by_marks in crash_states(disk).states.items() if last in by_marks}


def test_each_subset_of_new_names_is_a_state(tmp_path: Path) -> None:
    """Two files made and fsynced, their directory not: either name, both or neither survive."""
    with Recorder(tmp_path) as disk:
        files.write_synced(str(tmp_path / "a"), b"a")
        disk.mark("between")
        files.write_synced(str(tmp_path / "b"), b"b")
    assert states_at_end(disk) == {frozenset(), frozenset({("a", b"a")}), frozenset({("b", b"b")}),
                                   frozenset({("a", b"a"), ("b", b"b")})}
    enumeration = crash_states(disk)
    assert enumeration.boundaries == len(disk.calls) + 1  # every call boundary
    # on the way: "a" created empty, written, fsynced (its tail kept, zeroed...), then "b" the same
    assert frozenset({("a", b"")}) in enumeration.states and frozenset({("a", b"\0")}) in enumeration.states


def test_a_rename_is_durable_only_with_what_it_renames(tmp_path: Path) -> None:
    """A temp file renamed over a file, no directory fsync: the old file, the old file and the temp file,
    or the new file; never the rename without the temp file's creation."""
    (tmp_path / "meta").write_bytes(b"v1")
    with Recorder(tmp_path) as disk:
        files.write_synced(str(tmp_path / "meta.tmp"), b"v2")
        os.replace(tmp_path / "meta.tmp", tmp_path / "meta")
    assert states_at_end(disk) == {frozenset({("meta", b"v1")}), frozenset({("meta", b"v1"), ("meta.tmp", b"v2")}),
                                   frozenset({("meta", b"v2")})}


def test_unsynced_appends_are_kept_cut_torn_or_zeroed(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"head:")
    with Recorder(tmp_path) as disk:
        write(tmp_path / "f", b"one-", fsync=False)
        write(tmp_path / "f", b"two-", fsync=False)
    found = {dict(state)["f"] for state in states_at_end(disk)}
    assert found == {b"head:", b"head:one-two-", b"head:one-", b"head:on", b"head:" + bytes(8)}


def test_a_failed_fsync_may_have_dropped_its_pages_and_the_next_one_succeeds(tmp_path: Path) -> None:
    """Linux: after fsync returns EIO the dirty pages may be gone; the next fsync succeeds without them."""
    (tmp_path / "f").write_bytes(b"AAAA")
    with Recorder(tmp_path) as disk:
        write(tmp_path / "f", b"BBBB", fsync=False)
        disk.fail_fsync(lambda path: path.endswith("/f"))
        with pytest.raises(OSError):
            write(tmp_path / "f", b"", fsync=True)
        disk.fail_fsync(None)
        write(tmp_path / "f", b"CCCC", fsync=True)
    found = {dict(state)["f"] for state in states_at_end(disk)}
    assert found == {b"AAAABBBBCCCC", b"AAAA" + bytes(4) + b"CCCC"}


async def topics_and_channels(w: Workload) -> None:
    """Create, pause, delete and make again topics and channels (nsqd.dat's journal, topic files)."""
    await w.create_topic("t")
    await w.create_channel("t", "c")
    await w.publish("t", [b"t-1", b"t-2"])
    await w.create_topic("x")
    await w.pause("t", "c")
    await w.pause("x")
    await w.delete_topic("t")
    await w.create_topic("other")
    await w.create_topic("t")
    await w.create_channel("t", "d")
    await w.pause("x", paused=False)
    await w.create_channel("x", "e")
    await w.delete_channel("x", "e")


def test_topics_and_channels(tmp_path: Path) -> None:
    """On main: pauses and unpauses undone (finding 6); a deleted topic and channel back, with the old log id
    and messages under the topic made again (findings 1, 6)."""
    report = check_workload(str(tmp_path), "topics-and-channels", topics_and_channels, STRICT)
    assert report.states > 0
    assert not report.violations, report.summary()


async def keyed_publishes(w: Workload) -> None:
    """Idempotency-Keys across segment rolls (small --max-bytes-per-file): every kept key has its messages."""
    await w.create_topic("k")
    await w.create_channel("k", "audit")
    await w.publish("k", [b"k-plain-%d" % i for i in range(3)])
    await w.publish("k", [b"k-A-%d" % i for i in range(3)], key="KA")
    await w.publish("k", [b"k-B-%d" % i for i in range(16)], key="KB")
    await w.publish("k", [b"k-C-%d" % i for i in range(2)], key="KC")


def test_keyed_publishes_across_a_roll(tmp_path: Path) -> None:
    """On main: a key answered (--sync-every=1) is lost: its journal's name never made durable (finding 4)."""
    report = check_workload(str(tmp_path), "keyed-publishes", keyed_publishes,
                            {**STRICT, "max_bytes_per_file": 400})
    assert not report.violations, report.summary()


def test_keyed_publishes_answered_before_their_fsync(tmp_path: Path) -> None:
    """--sync-every > 1: a publish is answered before its fsync and promises nothing across a power loss,
    but a key kept must still have its messages (its journal line names where they end). Found with issue
    48's first fixes (~180 violations): a later segment's name durable while an earlier one's is not (POSIX
    orders no two names without a directory fsync) kept KA or KB without their messages: with no metadata
    yet, segment 1 was renumbered to start at 0 (KA's position then fell inside KB's records); with the
    metadata naming both, KB's records that began in the missing segment 0 were not checked; and when a
    round ran mid-workload, the metadata ("dispatched all") could be durable without the channel's first
    cursor file, so `audit` started past every message. Now a segment starts where its side file's header
    recorded, a missing one is a gap readers skip, no key is kept for records ending past a gap found at
    open, and a round makes new names durable before it replaces the metadata (tests/test_segment_starts.py)."""
    report = check_workload(str(tmp_path), "keyed-publishes-unsynced", keyed_publishes,
                            {"mem_queue_size": 0, "max_bytes_per_file": 400})
    assert not report.violations, report.summary()


async def keys_across_a_roll_then_a_directory_fsync(w: Workload) -> None:
    """Issue 48's recipe of finding 2: a round, KA's 3 messages and KB's 16 (rolling the segment) answered
    before their fsync, then the directory fsynced (another topic's round does that in life)."""
    await w.create_topic("k")
    await w.create_channel("k", "audit")
    await w.publish("k", [b"k-plain-%d" % i for i in range(3)])
    await w.nsqd.topics["k"].group.sync_round()
    await w.publish("k", [b"k-A-%d" % i for i in range(3)], key="KA")
    await w.publish("k", [b"k-B-%d" % i for i in range(16)], key="KB")
    files.fsync_dir(w.disk.data_dir)


def test_keys_across_a_roll_then_a_directory_fsync(tmp_path: Path) -> None:
    """On main: KA kept, its messages gone: segment 0 cut at its fsynced end, segment 1 renumbered (finding 2)."""
    report = check_workload(str(tmp_path), "keys-roll-directory-fsync", keys_across_a_roll_then_a_directory_fsync,
                            {"mem_queue_size": 0, "max_bytes_per_file": 400})
    assert not report.violations, report.summary()


async def log_positions(w: Workload) -> None:
    """A topic read by position: its id and tail shown, records served, a /log/commit and a seek."""
    await w.create_topic("p")
    await w.create_channel("p", "c")
    await w.publish("p", [b"p-%d" % i for i in range(4)])
    shown = await w.positions("p")
    served = await read_log(w, "p", shown["first"])
    assert [body for _, body in served] == [b"p-%d" % i for i in range(4)]
    answer = await w.post(f"/log/commit?topic=p&channel=r&position={shown['end']}&log_id={shown['log_id']}")
    assert answer.json()["position"] == shown["end"]
    w.disk.mark("channel", topic="p", channel="r")
    w.disk.mark("consumed", topic="p", channel="r", bodies=[b"p-%d" % i for i in range(4)])
    await w.publish("p", [b"p-%d" % i for i in range(4, 7)])
    w.disk.mark("consuming", topic="p", channel="c")
    await w.post("/channel/seek?topic=p&channel=c&to=latest")
    w.disk.mark("consumed", topic="p", channel="c")
    await w.publish("p", [b"p-7"])
    await w.positions("p")


def test_log_positions_commit_and_seek(tmp_path: Path) -> None:
    """On main: the positional flag given out is lost (finding 8); the durable tail shown goes back (finding 7)."""
    report = check_workload(str(tmp_path), "log-positions", log_positions, STRICT)
    assert not report.violations, report.summary()


async def dead_letter_move(w: Workload) -> None:
    """A message past its attempts moved to the dead-letter topic: in the channel or there, never neither."""
    await w.create_topic("d")
    await w.create_channel("d", "c")
    await w.post("/channel/config?topic=d&channel=c&max_attempts=1")
    w.disk.mark("topic", topic="d-c-dlq")
    await w.publish("d", [b"d-0", b"d-1"])
    topic = w.nsqd.topics["d"]
    channel = topic.channels["c"]
    topic.dispatch()
    msgs = channel.take(1)
    for msg in msgs:
        msg.attempts += 1
    channel.start_in_flight_many(msgs, 1, 0.0, 60.0)
    channel.requeue_message(1, msgs[0].id, 0.0)  # past max_attempts: moved
    w.disk.mark("moved", topic="d", channel="c", body=msgs[0].body, dead="d-c-dlq")
    await w.nsqd.topics["d-c-dlq"].group.sync_round()
    await topic.group.sync_round()
    await w.publish("d", [b"d-2"])


def test_a_dead_letter_move(tmp_path: Path) -> None:
    """Clean on main (issue 41's fix)."""
    report = check_workload(str(tmp_path), "dead-letter-move", dead_letter_move, STRICT)
    assert not report.violations, report.summary()


def small_journal(monkeypatch: pytest.MonkeyPatch) -> None:
    """nsqd.dat written again once its journal passes 256 bytes: compactions within a few creations."""
    monkeypatch.setattr(metadata, "JOURNAL_MIN", 256)


async def many_creations(w: Workload) -> None:
    for i in range(8):
        await w.create_topic(f"m{i}")
        await w.create_channel(f"m{i}", "c")
    await w.publish("m0", [b"m0-0"])


async def compactions(w: Workload) -> None:
    """nsqd.dat's journal compacted into nsqd.dat (temp file, rename, directory fsync, journal unlinked)
    between creations, deletions and pauses."""
    await many_creations(w)
    await w.delete_topic("m3")
    await w.pause("m4", "c")
    await w.delete_channel("m5", "c")
    await w.create_topic("m3")


def test_nsqd_dat_compactions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On main: a deleted topic and channel back, a pause undone (findings 1, 6)."""
    small_journal(monkeypatch)
    report = check_workload(str(tmp_path), "compactions", compactions, STRICT)
    assert not report.violations, report.summary()


async def failed_fsyncs(w: Workload) -> None:
    """The data directory's fsync fails as nsqd.dat's journal is made, later the journal's own fsync: the
    creations asked then are answered 500 (or 200 if nothing they waited for failed); those after are
    answered 200 and must survive, whatever the failed fsync dropped."""
    data = w.disk.data_dir
    for i, failing in enumerate((lambda path: path == data, lambda path: path.endswith("nsqd.dat.journal"))):
        w.disk.fail_fsync(failing)
        answer = await w.client.post(f"/topic/create?topic=failed{i}")
        w.disk.fail_fsync(None)
        if answer.status_code == 200:
            w.disk.mark("topic", topic=f"failed{i}")
        await w.create_topic(f"f{i}")
    await w.create_channel("f0", "c")
    await w.publish("f0", [b"f0-0"])


def test_failed_fsyncs(tmp_path: Path) -> None:
    """On main: after the failed directory fsync the journal's name never becomes durable (finding 5)."""
    report = check_workload(str(tmp_path), "failed-fsyncs", failed_fsyncs, STRICT)
    assert not report.violations, report.summary()


# --- the checker proved by mutation: each takes a step of durability out of a clean workload -----------


def test_creations_and_compactions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The workload the mutations below break: clean as the broker is."""
    small_journal(monkeypatch)
    report = check_workload(str(tmp_path), "creations", many_creations, STRICT)
    assert not report.violations, report.summary()


def test_mutation_no_directory_fsync_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nsqd.dat's journal made and renamed without its directory fsynced: a creation answered is lost."""
    small_journal(monkeypatch)
    monkeypatch.setattr(metadata, "fsync_dir", lambda path: None)
    report = check_workload(str(tmp_path), "mutation-no-directory-fsync", many_creations, STRICT)
    assert any("answered and is missing" in v for v in report.violations), report.violations


def test_mutation_rename_before_fsync_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nsqd.dat's new content renamed into place before it is fsynced (the two steps swapped)."""
    small_journal(monkeypatch)

    def compact_swapped(self: metadata.Metadata, lines: bytes, data: bytes) -> None:
        if self._journal_size:
            self._append(lines)
        tmp = f"{self.path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, data)
        os.rename(tmp, self.path)  # before the fsync
        metadata.fsync_dir(self.nsqd.data_path)
        os.fsync(fd)
        os.close(fd)
        self._dat_size = len(data)
        os.unlink(self.journal_path)
        metadata.fsync_dir(self.nsqd.data_path)
        self._journal_size = 0
    monkeypatch.setattr(metadata.Metadata, "_compact_files", compact_swapped)
    report = check_workload(str(tmp_path), "mutation-rename-before-fsync", many_creations, STRICT)
    assert report.violations, "a state with nsqd.dat renamed and empty was not caught"


def test_mutation_answer_before_fsync_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A creation answered before the write that names it is on disk."""
    small_journal(monkeypatch)

    async def not_waiting(self: NSQD) -> None:
        return None
    monkeypatch.setattr(NSQD, "metadata_persisted", not_waiting)
    report = check_workload(str(tmp_path), "mutation-answer-before-fsync", many_creations, STRICT)
    assert any("answered and is missing" in v for v in report.violations), report.violations


async def keys_then_a_failing_disk(w: Workload) -> None:
    """A keyed publish at default flags (in memory, answered), then the disk refuses every write to the
    topic's and channel's queues: the clean exit cannot flush the message."""
    await w.create_topic("e")
    await w.create_channel("e", "c")
    await w.publish("e", [b"e-0"], key="K1")
    w.disk.fail_writes(lambda path: ".diskqueue.0" in os.path.basename(path))


def test_a_clean_exit_that_cannot_flush(tmp_path: Path) -> None:
    """Every state of a clean exit whose flush fails (issue 48's finding 3): a key kept has its message."""
    report = check_workload(str(tmp_path), "exit-flush-fails", keys_then_a_failing_disk, {}, clean_exit=True)
    assert not report.violations, report.summary()
