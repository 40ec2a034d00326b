"""The compressed streams (shared/streams.py) alone: round trips, interop with python-snappy and zlib, and
the errors a corrupt stream gives; and the e2e latency result shape (broker/quantile.py)."""

from __future__ import annotations

import zlib

import pytest
import snappy
import trio
import trio.testing

from trio_nsq.broker.quantile import result_from
from trio_nsq.shared.streams import CompressionError, DeflateStream, PrefixedStream, SnappyStream


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


def test_quantile_result_shape():
    r = result_from([float(i) for i in range(1, 101)], 100, [0.5, 0.99, 1.0])
    assert r["count"] == 100
    assert [p["value"] for p in r["percentiles"]] == [50.0, 99.0, 100.0]
