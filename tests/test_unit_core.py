"""Pure pieces of the broker: names, GUIDs, the in-flight/deferred queue, options, quantiles, streams."""

from __future__ import annotations

import re
import zlib

import pytest
import snappy
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.guid import GUIDFactory, NODE_ID_SHIFT, SEQUENCE_BITS
from broker.message import Message
from broker.options import parse_options
from broker.pqueue import MessagePQueue
from broker.quantile import result_from
from shared.names import is_ephemeral, is_valid_channel_name, is_valid_topic_name
from shared.options import parse_duration
from shared.streams import CompressionError, DeflateStream, PrefixedStream, SnappyStream

# --- names --------------------------------------------------------------------------------------

_REFERENCE = re.compile(r"^[.a-zA-Z0-9_-]+(#ephemeral)?$")


@given(st.text(alphabet="abcXYZ019._-#ephemral\n ", max_size=80))
def test_names_follow_nsqd(name):
    expected = 1 <= len(name) <= 64 and _REFERENCE.fullmatch(name) is not None and "\n" not in name
    assert is_valid_topic_name(name) == expected
    assert is_valid_channel_name(name) == expected


def test_name_edges():
    assert is_valid_topic_name("a" * 64) and not is_valid_topic_name("a" * 65)
    assert is_valid_topic_name("a" * 54 + "#ephemeral")  # the suffix counts toward 64
    assert not is_valid_topic_name("a" * 55 + "#ephemeral")
    assert not is_valid_topic_name("topic\n") and not is_valid_topic_name("")
    assert is_valid_topic_name(b"bytes.ok") and not is_valid_topic_name(b"\xff")
    assert is_ephemeral("x#ephemeral") and not is_ephemeral("x")


# --- GUIDs --------------------------------------------------------------------------------------


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


# --- in-flight / deferred queue ------------------------------------------------------------------


def _msg(i: int) -> Message:
    return Message(b"%016x" % i, b"body")


def test_pqueue_expiry_order_and_stale_entries():
    q = MessagePQueue()
    msgs = [_msg(i) for i in range(5)]
    for i, m in enumerate(msgs):
        q.push(m, 10.0 - i)
    q.pop(msgs[2].id)  # FIN
    q.push(msgs[4], 20.0)  # TOUCH moves the earliest one later
    assert [m.id for m in q.pop_expired(9.5)] == [msgs[3].id, msgs[1].id]
    assert [m.id for m in q.pop_expired(100)] == [msgs[0].id, msgs[4].id]
    assert len(q) == 0 and q.next_deadline() is None


def test_pqueue_memory_stays_bounded():
    q = MessagePQueue()
    for i in range(100_000):
        m = _msg(i)
        q.push(m, float(i))
        q.pop(m.id)
        assert len(q._heap) <= 2 * len(q) + 1024


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "pop", "expire"]), st.integers(0, 20), st.integers(0, 100))))
def test_pqueue_against_a_model(ops):
    q, model, msgs = MessagePQueue(), {}, {}
    for op, key, t in ops:
        m = msgs.setdefault(key, _msg(key))
        if op == "push":
            q.push(m, float(t))
            model[m.id] = float(t)
        elif op == "pop":
            assert (q.pop(m.id) is not None) == (m.id in model)
            model.pop(m.id, None)
        else:
            got = [x.id for x in q.pop_expired(float(t))]
            due = sorted((p, k) for k, p in model.items() if p <= t)
            assert sorted(got) == sorted(k for _, k in due)
            assert [model[k] for k in got] == sorted(model[k] for k in got)
            for k in got:
                del model[k]
        assert len(q) == len(model)


# --- options ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, seconds", [("1m30s", 90), ("250ms", 0.25), ("2h", 7200), ("1.5s", 1.5), ("10", 10)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "10x", "1m-"])
def test_parse_duration_refuses(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_defaults_are_nsqds():
    o = parse_options([])
    assert (o.mem_queue_size, o.msg_timeout, o.max_msg_size, o.max_body_size, o.max_rdy_count) == (
        10000, 60.0, 1048576, 5242880, 2500)
    assert (o.max_req_timeout, o.max_msg_timeout, o.sync_every, o.sync_timeout) == (3600.0, 900.0, 2500, 2.0)
    assert (o.tcp_address, o.http_address, o.output_buffer_timeout) == ("0.0.0.0:4150", "0.0.0.0:4151", 0.25)


def test_flags_win_over_config_which_wins_over_defaults(tmp_path):
    cfg = tmp_path / "nsqd.toml"
    cfg.write_text('id = 7\nmem_queue_size = 5\nmsg_timeout = "30s"\nnsqlookupd_tcp_addresses = ["a:4160", "b:4160"]\n')
    o = parse_options([f"--config={cfg}", "--mem-queue-size=9"])
    assert (o.node_id, o.mem_queue_size, o.msg_timeout, o.nsqlookupd_tcp_addresses) == (7, 9, 30.0, ["a:4160", "b:4160"])


def test_config_file_reads_like_go_options(tmp_path):
    cfg = tmp_path / "nsqd.toml"
    # an integer duration is milliseconds, and a key of no option is ignored, as go-options does
    cfg.write_text("msg_timeout = 30000\nno_such_key = 1\n")
    assert parse_options([f"--config={cfg}"]).msg_timeout == 30.0


# --- quantiles ----------------------------------------------------------------------------------


def test_quantile_result_shape():
    r = result_from([float(i) for i in range(1, 101)], 100, [0.5, 0.99, 1.0])
    assert r["count"] == 100
    assert [p["value"] for p in r["percentiles"]] == [50.0, 99.0, 100.0]


# --- compressed streams -------------------------------------------------------------------------


async def _pipe(wrap_a, wrap_b, chunks):
    left, right = trio.testing.memory_stream_pair()
    a, b = wrap_a(left), wrap_b(right)
    got = bytearray()
    expected = b"".join(chunks)
    async with trio.open_nursery() as nursery:
        async def send():
            for c in chunks:
                await a.send_all(c)
        nursery.start_soon(send)
        while len(got) < len(expected):
            got += await b.receive_some()
    return bytes(got) == expected


@pytest.mark.parametrize("wrap", [SnappyStream, lambda s: DeflateStream(s, 3)])
async def test_stream_round_trip(wrap):
    chunks = [b"x" * n + bytes(range(256)) for n in (0, 1, 70000, 5, 200000)]
    assert await _pipe(wrap, wrap, chunks)


async def test_snappy_interop_with_python_snappy():
    left, right = trio.testing.memory_stream_pair()
    ours = SnappyStream(right)
    theirs = snappy.StreamCompressor()
    await left.send_all(theirs.compress(b"hello " * 1000))
    got = bytearray()
    while len(got) < 6000:
        got += await ours.receive_some()
    assert bytes(got) == b"hello " * 1000
    await ours.send_all(b"back")
    data = await left.receive_some()
    assert snappy.StreamDecompressor().decompress(data) == b"back"


async def test_deflate_interop_with_zlib():
    left, right = trio.testing.memory_stream_pair()
    ours = DeflateStream(right, 6)
    c = zlib.compressobj(6, zlib.DEFLATED, -15)
    await left.send_all(c.compress(b"abc" * 100) + c.flush(zlib.Z_SYNC_FLUSH))
    assert await ours.receive_some() == b"abc" * 100


async def test_corrupt_snappy_is_an_error():
    left, right = trio.testing.memory_stream_pair()
    ours = SnappyStream(right)
    good = snappy.StreamCompressor().compress(b"payload" * 100)
    bad = good[:-3] + bytes(b ^ 0xFF for b in good[-3:])
    await left.send_all(bad)
    with pytest.raises(CompressionError):
        await ours.receive_some()


async def test_prefixed_stream_returns_prefix_first():
    left, right = trio.testing.memory_stream_pair()
    stream = PrefixedStream(right, b"early")
    await left.send_all(b"late")
    assert await stream.receive_some() == b"early"
    assert await stream.receive_some() == b"late"
