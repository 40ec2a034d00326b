"""broker/guid.py against nsqd/guid.go.

Go's layout of a 64-bit id: (ts - twepoch) << 22 | nodeID << 12 | sequence, with ts = UnixNano >> 20,
written as 16 lowercase hex ASCII bytes (hex.Encode of the big-endian bytes). Go fails when the clock
goes backwards or the 12-bit sequence runs out within one tick; ours borrows the next tick instead, so
every property here is "unique and strictly increasing", under a real or a frozen clock.
"""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_nsq.broker.guid import (
    NODE_ID_BITS,
    NODE_ID_SHIFT,
    SEQUENCE_BITS,
    SEQUENCE_MASK,
    TIMESTAMP_SHIFT,
    TWEPOCH,
    GUIDFactory,
)

HEX16 = re.compile(rb"[0-9a-f]{16}")


class FakeClock:
    """The clock a GUIDFactory reads (its `clock` argument); time_ns returns what the test sets."""

    def __init__(self, ns: int) -> None:
        self.ns = ns

    def time_ns(self) -> int:
        return self.ns


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(time.time_ns())


def _strictly_increasing(ids: list[int]) -> bool:
    return all(a < b for a, b in zip(ids, ids[1:]))


def factory_ids(factory: GUIDFactory, n: int) -> list[int]:
    return [int(x, 16) for x in factory.new_ids(n)]


def _node(guid: int) -> int:
    return (guid >> NODE_ID_SHIFT) & ((1 << NODE_ID_BITS) - 1)


def test_layout_constants_are_gos():
    assert (NODE_ID_BITS, SEQUENCE_BITS, NODE_ID_SHIFT, TIMESTAMP_SHIFT) == (10, 12, 12, 22)
    assert SEQUENCE_MASK == 0xFFF
    assert TWEPOCH == 1288834974288


def test_100k_ids_in_a_tight_loop_are_unique_and_increasing():
    factory = GUIDFactory(77)
    new_guid = factory.new_guid
    ids = [new_guid() for _ in range(100_000)]
    assert _strictly_increasing(ids)
    assert len(set(ids)) == len(ids)
    assert all(_node(i) == 77 for i in ids)


def test_100k_hex_ids_in_a_tight_loop_are_unique_and_increasing():
    factory = GUIDFactory(5)
    new_id = factory.new_id
    ids = [new_id() for _ in range(100_000)]
    # fixed-width lowercase hex: byte order is numeric order
    assert all(a < b for a, b in zip(ids, ids[1:]))
    assert len(set(ids)) == len(ids)


def test_sequence_exhaustion_within_one_tick_stays_unique_and_increasing(clock):
    factory = GUIDFactory(1, clock.time_ns)
    tick = clock.ns >> 20
    ids = [factory.new_guid() for _ in range(100_000)]  # the clock never moves: 24+ ticks borrowed
    assert _strictly_increasing(ids)
    # the first tick holds exactly 4096 ids: sequence 0..4095, then the next tick starts at 0
    assert [i & SEQUENCE_MASK for i in ids[:4096]] == list(range(4096))
    assert ids[4095] >> TIMESTAMP_SHIFT == tick - TWEPOCH
    assert ids[4096] >> TIMESTAMP_SHIFT == tick - TWEPOCH + 1 and ids[4096] & SEQUENCE_MASK == 0
    assert ids[-1] >> TIMESTAMP_SHIFT == tick - TWEPOCH + (100_000 - 1) // 4096
    assert all(_node(i) == 1 for i in ids)


def test_borrowed_ticks_are_not_reused_when_the_clock_catches_up(clock):
    factory = GUIDFactory(9, clock.time_ns)
    ids = [factory.new_guid() for _ in range(3 * 4096)]  # borrows two ticks ahead
    clock.ns += 1 << 20  # the real clock reaches the first borrowed tick
    ids += [factory.new_guid() for _ in range(100)]
    clock.ns += 5 << 20  # and passes every borrowed tick
    ids.append(factory.new_guid())
    assert _strictly_increasing(ids)
    assert ids[-1] & SEQUENCE_MASK == 0 and ids[-1] >> TIMESTAMP_SHIFT == (clock.ns >> 20) - TWEPOCH


def test_clock_going_backwards_never_gives_a_smaller_id(clock):
    factory = GUIDFactory(2, clock.time_ns)
    ids = [factory.new_guid() for _ in range(10)]
    clock.ns -= 10**9  # one second back (NTP step): Go returns ErrTimeBackwards, we keep counting
    ids += [factory.new_guid() for _ in range(5000)]
    ids += factory_ids(factory, 5000)
    assert _strictly_increasing(ids)


def test_new_ids_batches_continue_the_single_id_sequence(clock):
    factory = GUIDFactory(1023, clock.time_ns)
    ids = [factory.new_guid()]
    for n in (0, 1, 4095, 1, 4096, 7, 10_000):
        batch = factory_ids(factory, n)
        assert len(batch) == n
        ids += batch
        ids.append(factory.new_guid())
    clock.ns += 100 << 20
    ids += factory_ids(factory, 3)
    assert ids[-3] & SEQUENCE_MASK == 0  # a fresh tick starts its sequence at zero, as new_guid does
    assert _strictly_increasing(ids)
    assert all(_node(i) == 1023 for i in ids)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(-3, 3)), min_size=1, max_size=12))
def test_any_mix_of_single_and_batched_ids_under_any_clock_is_increasing(steps):
    fake = FakeClock(1_700_000_000 * 10**9)
    factory = GUIDFactory(300, fake.time_ns)
    ids: list[int] = []
    for n, tick_move in steps:
        fake.ns += tick_move << 20
        if n % 2:
            ids += factory_ids(factory, n)
        else:
            ids += [factory.new_guid() for _ in range(n)]
    assert _strictly_increasing(ids)
    assert all(_node(i) == 300 for i in ids)


@pytest.mark.parametrize("node_id", [0, 1, 2, 341, 512, 1022, 1023])
def test_node_id_lands_in_bits_12_to_21(clock, node_id):
    factory = GUIDFactory(node_id, clock.time_ns)
    guid = factory.new_guid()
    # Go: ((ts - twepoch) << 22) | (nodeID << 12) | sequence
    expected = (((clock.ns >> 20) - TWEPOCH) << 22) | (node_id << 12) | 0
    assert guid == expected
    assert _node(guid) == node_id
    assert guid & SEQUENCE_MASK == 0
    assert guid >> 22 == (clock.ns >> 20) - TWEPOCH


def test_node_id_never_leaks_into_the_other_fields(clock):
    a, b = GUIDFactory(0, clock.time_ns), GUIDFactory(1023, clock.time_ns)
    for _ in range(5000):
        x, y = a.new_guid(), b.new_guid()
        assert y - x == 1023 << NODE_ID_SHIFT  # same tick and sequence, only the node bits differ


def test_hex_id_is_16_lowercase_ascii_hex_bytes_of_the_guid(clock):
    factory = GUIDFactory(1023, clock.time_ns)
    for _ in range(2000):
        raw = factory.new_id()
        assert isinstance(raw, bytes) and len(raw) == 16
        assert HEX16.fullmatch(raw)
        raw.decode("ascii")
    guid = factory.new_guid()
    # Go's Hex(): hex.Encode of the 8 big-endian bytes
    assert b"%016x" % guid == guid.to_bytes(8, "big").hex().encode()


def test_real_clock_timestamp_bits_are_now():
    before = time.time_ns() >> 20
    guid = GUIDFactory(0).new_guid()
    after = time.time_ns() >> 20
    assert 0 < guid < 2**63  # fits Go's int64, so always 16 hex digits
    assert before - TWEPOCH <= guid >> TIMESTAMP_SHIFT <= after - TWEPOCH


def test_batched_hex_ids_are_well_formed():
    for raw in GUIDFactory(17).new_ids(5000):
        assert len(raw) == 16 and HEX16.fullmatch(raw)


@pytest.mark.parametrize("node_id", [-1, -1024, 1024, 1025, 2**40])
def test_invalid_node_id_raises(node_id):
    with pytest.raises(ValueError):
        GUIDFactory(node_id)


@pytest.mark.parametrize("node_id", [0, 1023])
def test_node_id_range_edges_are_valid(node_id):
    assert GUIDFactory(node_id).node_id == node_id


# --- merged from test_unit_core.py -----------------------------------------------------------


def test_guids_unique_increasing_even_when_the_sequence_runs_out():
    factory = GUIDFactory(513)
    ids = [factory.new_guid() for _ in range(100_000)]
    assert all(a < b for a, b in zip(ids, ids[1:]))
    assert all((i >> NODE_ID_SHIFT) & 0x3FF == 513 for i in ids[:1000])
    assert all(i & ((1 << SEQUENCE_BITS) - 1) < 4096 for i in ids[:1000])
    text = factory.new_id()
    assert len(text) == 16 and re.fullmatch(rb"[0-9a-f]{16}", text)


def test_batched_ids_continue_the_same_sequence():
    factory = GUIDFactory(3)
    ids = [factory.new_guid()]
    for n in (1, 5000, 3, 10000):
        ids += [int(x, 16) for x in factory.new_ids(n)]
        ids.append(factory.new_guid())
    assert all(a < b for a, b in zip(ids, ids[1:]))
    assert all((i >> NODE_ID_SHIFT) & 0x3FF == 3 for i in ids)


@pytest.mark.parametrize("node", [-1, 1024])
def test_guid_node_id_range(node):
    with pytest.raises(ValueError):
        GUIDFactory(node)
