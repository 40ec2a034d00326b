"""The disk queue's cursor (a channel's queue): records stay until finished, survive a crash with their
deadlines, and one record never finished does not pin the files written after it."""

from __future__ import annotations

import random
from pathlib import Path

import trio
from test_diskqueue import crash_copy

from trio_nsq.broker import diskqueue
from trio_nsq.broker.diskqueue import DiskQueue


def cursor_queue(d: Path, max_bytes: int = 4096, clock=None) -> DiskQueue:
    return DiskQueue("q", str(d), max_bytes_per_file=max_bytes, min_msg_size=1, max_msg_size=200,
                     cursor=True, clock=clock or (lambda: 1000.0))


def data_files(d: Path) -> list[Path]:
    return sorted(p for p in d.glob("q.diskqueue.*.dat") if "meta" not in p.name)


def read_all(dq: DiskQueue) -> list[tuple[int, bytes]]:
    positions: list[int] = []
    records = dq.read_many(1 << 20, positions)
    return list(zip(positions, records))


def test_one_record_held_forever_does_not_pin_the_files_after_it(tmp_path):
    """100k records flow through (read and finished) while one is held and one is deferred for ever:
    the files stay bounded, the finished set stays small, and a crash still finds both."""
    dq = cursor_queue(tmp_path, max_bytes=64 * 1024)
    dq.put(b"held")
    dq.hold(b"deferred", 3600.0)
    [(held_pos, data)] = read_all(dq)
    assert data == b"held"
    most_files = 0
    for round_ in range(100):
        dq.put_many([b"r%d-%04d" % (round_, i) + b"x" * 40 for i in range(1000)])
        for pos, _ in read_all(dq):
            dq.finish(pos)
        trio.run(dq.sync)
        most_files = max(most_files, len(data_files(tmp_path)))
        assert len(dq._finished) <= diskqueue.FINISHED_LIMIT + 1
    # 100k records of ~50 bytes are ~80 files of 64 KiB: a pinned queue would keep every one
    assert most_files <= 6, most_files
    after = cursor_queue(crash_copy(tmp_path, tmp_path.parent / "after"))
    got = read_all(after)
    assert [data for _, data in got] == [b"held", b"deferred"]
    assert after.delay_of(got[1][0]) == 3600.0 - 0.0  # the clock did not move: the whole hour is left
    dq.finish(held_pos)  # finishing by its first position reaches the copy
    trio.run(dq.close)  # a FIN is persisted by the next round (here the closing one), not by sync()
    again = cursor_queue(crash_copy(tmp_path, tmp_path.parent / "again"))
    assert [data for _, data in read_all(again)] == [b"deferred"]
    trio.run(after.close)
    trio.run(again.close)


def test_records_written_after_the_last_round_keep_their_deadline_and_replace_once(tmp_path):
    """A crash right after a REQ's rewrite and a deferral (no round since): the journal gives the
    recovered records their deadline and finishes the records they replaced; a round empties it."""
    dq = cursor_queue(tmp_path)
    dq.put_many([b"a" * 30, b"b" * 30, b"c" * 30])
    trio.run(dq.sync)
    (a_pos, _), (b_pos, _), (c_pos, _) = read_all(dq)
    dq.rewrite(b"A" * 30, a_pos)  # REQ without a delay: the message again, with its attempts
    dq.hold(b"B" * 30, 60.0, b_pos)  # REQ with a delay
    after = cursor_queue(crash_copy(tmp_path, tmp_path.parent / f"{tmp_path.name}-after"))
    got = read_all(after)
    assert [data for _, data in got] == [b"c" * 30, b"A" * 30, b"B" * 30]
    assert [after.delay_of(pos) for pos, _ in got] == [0.0, 0.0, 60.0]
    trio.run(dq.close)
    assert (tmp_path / "q.diskqueue.journal.dat").stat().st_size == 0
    trio.run(after.close)


def test_a_journal_still_needed_is_rewritten_smaller(tmp_path):
    """Rounds that always leave some entries needed (REQs keep coming while they run) must not let the
    journal grow: past 64 KiB it is rewritten with only the entries past the persisted write position."""
    dq = cursor_queue(tmp_path, max_bytes=1 << 20)
    dq.put_many([b"%029d" % i for i in range(2000)])
    trio.run(dq.sync)
    news = [dq.rewrite(b"R%028d" % i, pos) for i, (pos, _) in enumerate(read_all(dq))]
    journal = tmp_path / "q.diskqueue.journal.dat"
    assert journal.stat().st_size == 2000 * 40
    dq._trim_journal(news[1500])  # as a round whose metadata covered the first 1,500 rewrites
    assert journal.stat().st_size == 500 * 40
    # a crash now: the metadata does not cover the rewrites at all, the journal only the last 500, so
    # those replace their old records and the first 1,500 rewrites come back beside theirs (duplicates)
    after = cursor_queue(crash_copy(tmp_path, tmp_path.parent / f"{tmp_path.name}-after"), max_bytes=1 << 20)
    got = [data for _, data in read_all(after)]
    assert len(got) == 2000 + 2000 - 500
    assert got[-500:] == [b"R%028d" % i for i in range(1500, 2000)]
    trio.run(dq.close)
    trio.run(after.close)


def test_runs_of_fins_finish_exactly_the_records_named(tmp_path):
    """finish_many (a run of FIN commands): two consumers' FINs interleaved, a position named twice, one
    finished before, and a run while a record is held (the general path); after a round and a crash
    exactly the unfinished records come back, in order."""
    dq = cursor_queue(tmp_path, max_bytes=1 << 20)
    dq.put_many([b"m%04d" % i for i in range(40)])
    got = read_all(dq)
    a, b = got[:20], got[20:]  # two consumers' batches
    dq.finish(a[0][0])
    run = [pos for pair in zip(a[:10], b[:10]) for pos, _ in pair]  # A's first ten, B's first ten
    dq.finish_many(run + [a[0][0], b[3][0], -1])  # finished before, named twice, none
    assert dq.mark_delete() == a[10][0]  # A's first ten finished: the mark moved; B's wait behind A's rest
    dq.hold(b"h0000", 60.0)
    dq.finish_many([pos for pos, _ in a[10:15]] + [b[15][0]])
    trio.run(dq.sync)
    trio.run(dq.close)
    after = cursor_queue(crash_copy(tmp_path, tmp_path.parent / f"{tmp_path.name}-after"), max_bytes=1 << 20)
    want = [data for _, data in a[15:] + b[10:15] + b[16:]] + [b"h0000"]
    assert [data for _, data in read_all(after)] == want
    trio.run(after.close)


def test_fins_in_any_order_move_the_mark_to_the_oldest_unfinished_record(tmp_path):
    """Runs of FINs as consumers send them (mostly in order, some late, a few named twice or not at all,
    runs split anywhere), over enough records that the handed positions are dropped in bulk several
    times: after every run the mark-delete position is the oldest record not finished, and after a
    round and a crash exactly the unfinished records come back."""
    rng = random.Random(7)
    dq = cursor_queue(tmp_path, max_bytes=1 << 20)
    dq.put_many([b"r%05d" % i for i in range(12000)])
    got = read_all(dq)
    order = [pos for pos, _ in got]
    for i in range(0, len(order) - 50, 50):  # a consumer answers its batch out of order now and then
        if rng.random() < 0.3:
            chunk = order[i:i + 50]
            rng.shuffle(chunk)
            order[i:i + 50] = chunk
    kept = set(rng.sample(range(len(got)), 5))  # held forever
    unfinished = {pos for pos, _ in got}
    finished: set[int] = set()
    todo = [pos for pos in order if pos not in {got[i][0] for i in kept}]
    late = todo[100:400]  # answered long after the rest
    todo = todo[:100] + todo[400:]
    while todo or late:
        n = rng.randint(1, 300)
        run, todo = todo[:n], todo[n:]
        if not todo and late:
            run, late = run + late, []
        if rng.random() < 0.1 and finished:
            run.append(rng.choice(sorted(finished)))  # named again
        if rng.random() < 0.1:
            run.append(-1)
        dq.finish_many(run)
        finished.update(pos for pos in run if pos >= 0)
        unfinished -= finished
        if rng.random() < 0.3:
            assert dq.mark_delete() == min(unfinished)
    assert dq.mark_delete() == min(unfinished)
    assert len(unfinished) == 5
    trio.run(dq.sync)
    trio.run(dq.close)
    after = cursor_queue(crash_copy(tmp_path, tmp_path.parent / f"{tmp_path.name}-after"), max_bytes=1 << 20)
    assert [data for _, data in read_all(after)] == [got[i][1] for i in sorted(kept)]
    trio.run(after.close)


def test_finished_positions_persist_and_a_version_1_metadata_still_loads(tmp_path):
    """The finished positions past the mark-delete position go into the metadata (version 2: hex of
    int64s); a metadata written by version 1 (decimal) reads the same."""
    dq = cursor_queue(tmp_path)
    dq.put_many([b"a" * 30, b"b" * 30, b"c" * 30])
    (_, _), (b_pos, _), (_, _) = read_all(dq)
    dq.finish(b_pos)  # behind the unfinished first record: kept in the finished set
    trio.run(dq.close)
    meta = tmp_path / "q.diskqueue.meta.dat"
    lines = meta.read_text().split("\n")
    assert lines[3] == "trio-nsq-cursor 2" and lines[5] == "finished %016x" % b_pos
    reopened = cursor_queue(crash_copy(tmp_path, tmp_path.parent / f"{tmp_path.name}-v2"))
    assert [data for _, data in read_all(reopened)] == [b"a" * 30, b"c" * 30]
    trio.run(reopened.close)
    lines[3], lines[5] = "trio-nsq-cursor 1", f"finished {b_pos}"
    meta.write_text("\n".join(lines))
    v1 = cursor_queue(tmp_path)
    assert [data for _, data in read_all(v1)] == [b"a" * 30, b"c" * 30]
    trio.run(v1.close)
