"""The Cursor, a pure object: what is finished or held after what is read, against a model, and what its
file says after any sequence of rounds (a delta per round, a snapshot now and then, a torn last block);
what it keeps in memory (one entry per unfinished record, whatever is finished behind it); and the cost
of reading its file back, counted in lines run (linear in the file)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_nsq.broker.storage.cursor import FINISHED_LIMIT, HEADER, Cursor, CursorFileError

EPOCH = 0x1234


def positions(n: int, start: int = 0, step: int = 40) -> list[int]:
    """Positions of n records of `step` bytes, a segment starting every 1,000 (some old logs' segments
    start at file << 40, so positions need not be dense)."""
    return [((i // 1000) << 40) | (i % 1000) * step for i in range(start, start + n)]


def read(cursor: Cursor, pos: list[int], all_pos: list[int]) -> list[int]:
    """What a reader does: hands the records on (skipping those finished before a restart)."""
    skipped = [i for i, p in enumerate(pos) if cursor.hidden() and cursor.skip(p)]
    last = all_pos.index(pos[-1]) + 1
    nxt = all_pos[last] if last < len(all_pos) else pos[-1] + 40
    first = all_pos.index(pos[0])
    cursor.handed(pos, first, nxt, first + len(pos), skipped or None)
    gone = set(skipped)
    return [p for i, p in enumerate(pos) if i not in gone]


def kept(cursor: Cursor) -> int:
    """The entries the cursor keeps in memory for what it has read (unfinished ones, and finished ones
    not dropped yet)."""
    return len(cursor._pos) - cursor._head + len(cursor._done) + len(cursor._fins)


def persist(cursor: Cursor, file: bytearray, snapshot: bool = False) -> None:
    if snapshot or not file:
        file[:] = cursor.snapshot()
    else:
        file += cursor.take_delta()


def reload(file: bytes) -> Cursor:
    cursor, sound = Cursor.load(bytes(file), EPOCH)
    assert sound == len(file)
    return cursor


def test_in_order_fins_move_the_mark_and_need_no_set():
    all_pos = positions(5000)
    cursor = Cursor(0, 0, EPOCH)
    read(cursor, all_pos[:3000], all_pos)
    assert cursor.mark_delete() == all_pos[0] and cursor.unfinished() == 3000
    cursor.finish_many(all_pos[:1000])
    assert cursor.mark_delete() == all_pos[1000] and cursor.mark_index() == 1000
    assert not cursor._done  # retired by moving the front, not kept in a set
    cursor.finish_many(all_pos[1500:2000])  # past the front: kept until the front reaches them
    assert cursor.mark_delete() == all_pos[1000] and len(cursor._done) == 500
    cursor.finish_many(all_pos[1000:1500])
    assert cursor.mark_delete() == all_pos[2000] and not cursor._done
    cursor.finish_many(all_pos[2000:3000])
    assert cursor.mark_delete() == cursor.read_pos == all_pos[3000]
    assert cursor.unfinished() == 0


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_order_of_fins_and_holds_matches_a_model_across_rounds_and_reloads(data):
    """Read in batches, FIN in any order, REQ (hold) some, persist by delta or snapshot at random moments,
    reload from the file: the reloaded cursor skips exactly what was finished and gives the held ones
    their attempts and deadlines."""
    n = data.draw(st.integers(1, 300))
    all_pos = positions(n, step=data.draw(st.sampled_from([30, 400])))
    cursor = Cursor(all_pos[0], 0, EPOCH)
    file = bytearray()
    finished: set[int] = set()
    held: dict[int, tuple[int, float]] = {}
    taken: list[int] = []
    at = 0
    persisted_finished: set[int] = set()
    persisted_held: dict[int, tuple[int, float]] = {}
    for _ in range(data.draw(st.integers(1, 40))):
        action = data.draw(st.sampled_from(["read", "fin", "hold", "round", "snapshot"]))
        if action == "read" and at < n:
            k = data.draw(st.integers(1, n - at))
            taken += read(cursor, all_pos[at:at + k], all_pos)
            at += k
        elif action == "fin":
            live = [p for p in taken if p not in finished]
            if live:
                batch = data.draw(st.lists(st.sampled_from(live), unique=True, max_size=20))
                cursor.finish_many(batch)
                finished.update(batch)
                for p in batch:
                    held.pop(p, None)
        elif action == "hold":
            live = [p for p in taken if p not in finished]
            if live:
                p = data.draw(st.sampled_from(live))
                state = (data.draw(st.integers(1, 9)), data.draw(st.sampled_from([0.0, 1e9 + 5])))
                cursor.hold(p, *state)
                held[p] = state
        elif action in ("round", "snapshot"):
            persist(cursor, file, snapshot=action == "snapshot")
            persisted_finished = set(finished)
            persisted_held = dict(held)
        assert cursor.unfinished() == len([p for p in taken if p not in finished])
        mark = cursor.mark_delete()
        assert mark == min([p for p in taken if p not in finished], default=cursor.read_pos)
    persist(cursor, file)
    persisted_finished, persisted_held = set(finished), dict(held)
    again = reload(file)
    assert again.read_pos == cursor.mark_delete()
    assert again.read_index == cursor.mark_index()
    # the restart reads from the mark: finished records are skipped, the rest come with their state
    start = all_pos.index(again.read_pos) if again.read_pos in all_pos else n
    rest = all_pos[start:at] if start < n else []
    assert again.hidden() == len([p for p in rest if p in persisted_finished])
    got = read(again, rest, all_pos) if rest else []
    assert got == [p for p in rest if p not in persisted_finished]
    assert {p: again.held[p] for p in got if p in again.held} == {p: s for p, s in persisted_held.items() if p in got}


def test_a_round_writes_what_changed_not_what_is_held():
    """1,000,000 records held (deferred), then rounds of a few FINs: each delta is a few bytes per
    change, never the held set (the cost that made 1M DPUB quadratic)."""
    all_pos = positions(1_000_000, step=130)
    cursor = Cursor(0, 0, EPOCH)
    file = bytearray()
    persist(cursor, file)
    read(cursor, all_pos, all_pos)
    for p in all_pos[::10]:
        cursor.hold(p, 1, 1e9 + 3600)
    first = len(file)
    file += cursor.take_delta()  # the holds are new: written once
    assert len(file) - first < 2_500_000
    for r in range(100):
        before = len(file)
        cursor.finish_many([all_pos[r * 7 + 1]])
        file += cursor.take_delta()
        assert len(file) - before < 100, "a round with one FIN writes one FIN"
    assert len(cursor.take_delta()) == 0  # nothing changed: nothing written


def test_a_torn_last_block_and_a_foreign_file():
    all_pos = positions(100)
    cursor = Cursor(0, 0, EPOCH)
    file = bytearray()
    persist(cursor, file)
    read(cursor, all_pos[:50], all_pos)
    cursor.finish_many(all_pos[:10])
    persist(cursor, file)
    good = len(file)
    cursor.finish_many(all_pos[10:20])
    file += cursor.take_delta()
    torn = bytes(file[:-3])  # a kill -9 in the middle of the round's append
    again, sound = Cursor.load(torn, EPOCH)
    assert sound == good and again.read_pos == all_pos[10]
    flipped = bytearray(file)
    flipped[-1] ^= 0xFF  # a block whose checksum does not match ends the file there too
    assert Cursor.load(bytes(flipped), EPOCH)[1] == good
    with pytest.raises(CursorFileError):
        Cursor.load(bytes(file), EPOCH + 1)  # another log's cursor (Go nsqd rewrote the log)
    with pytest.raises(CursorFileError):
        Cursor.load(b"0\n0,0\n0,0\n", EPOCH)
    assert bytes(file).startswith(HEADER)


def test_finished_ranges_keep_a_snapshot_small():
    """One record held at the front while 100,000 behind it are finished: the snapshot writes them as one
    range, and a reload skips them all."""
    all_pos = positions(100_001)
    cursor = Cursor(0, 0, EPOCH)
    read(cursor, all_pos, all_pos)
    cursor.hold(all_pos[0], 2, 0.0)
    rest = all_pos[1:]
    random.Random(1).shuffle(rest)
    cursor.finish_many(rest)
    assert cursor.unfinished() == 1 and kept(cursor) < 2 * FINISHED_LIMIT
    snap = cursor.snapshot()
    assert len(snap) < 200
    again = reload(snap)
    assert again.hidden() == 100_000
    assert read(again, all_pos, all_pos) == [all_pos[0]]
    assert again.held[all_pos[0]] == (2, 0.0)


def test_reset_forgets_everything_and_persists_whole():
    all_pos = positions(100)
    cursor = Cursor(0, 0, EPOCH)
    read(cursor, all_pos[:60], all_pos)
    cursor.finish_many(all_pos[5:30])
    cursor.hold(all_pos[2], 3, 0.0)
    cursor.reset(all_pos[40], 40)
    assert (cursor.mark_delete(), cursor.unfinished(), cursor.held) == (all_pos[40], 0, {})
    again = reload(cursor.snapshot())
    assert (again.read_pos, again.read_index, again.hidden(), again.held) == (all_pos[40], 40, 0, {})
