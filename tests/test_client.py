"""Our Trio client against real broker (and lookupd) processes."""

from __future__ import annotations

import time

import httpx
import pytest
import trio

from shared.client import Consumer, HTTPProducer, NSQError, Producer
from test_lookupd_discovery import Lookupd, eventually  # noqa: F401  (process helper)


async def wait_for(predicate, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.02)


async def test_pipelined_publishes_are_answered_in_order(broker):
    async with Producer(broker.tcp_address) as producer:
        async with trio.open_nursery() as nursery:
            for i in range(1000):
                nursery.start_soon(producer.pub, "pipe", b"%d" % i)
        await producer.mpub("pipe", [b"m1", b"m2"])
        await producer.dpub("pipe", 50, b"d")
        with pytest.raises(NSQError) as err:
            await producer.pub("bad*topic", b"x")
        assert err.value.code == "E_BAD_TOPIC"
    got = []

    async def handler(msg):
        got.append(msg.body)

    async with Consumer("pipe", "ch", handler, nsqd_tcp_addresses=[broker.tcp_address], max_in_flight=200) as c:
        await wait_for(lambda: len(got) >= 1003)
        await trio.sleep(0.2)
    assert sorted(got) == sorted([b"%d" % i for i in range(1000)] + [b"m1", b"m2", b"d"])
    assert c.stats["finished"] == 1003


async def test_requeue_on_exception_max_attempts_and_give_up(broker):
    async with Producer(broker.tcp_address) as producer:
        await producer.pub("fail", b"poison")
        await producer.pub("fail", b"fine")
    seen: list[tuple[bytes, int]] = []
    given_up = []

    async def handler(msg):
        seen.append((msg.body, msg.attempts))
        if msg.body == b"poison":
            raise RuntimeError("cannot handle")

    async with Consumer("fail", "ch", handler, nsqd_tcp_addresses=[broker.tcp_address], max_in_flight=5,
                        max_attempts=3, requeue_delay_ms=10, backoff_base=0.05,
                        on_give_up=given_up.append) as c:
        await wait_for(lambda: given_up, timeout=20)
    assert [m.body for m in given_up] == [b"poison"] and given_up[0].attempts == 4
    assert [a for b, a in seen if b == b"poison"] == [1, 2, 3]
    assert (b"fine", 1) in seen
    assert c.stats["requeued"] == 3 and c.stats["given_up"] == 1


async def test_backoff_drops_rdy_to_zero_then_tests_with_one(broker):
    async with Producer(broker.tcp_address) as producer:
        await producer.mpub("bo", [b"bad"] + [b"ok%d" % i for i in range(20)])

    async def handler(msg):
        if msg.body == b"bad" and msg.attempts == 1:
            raise RuntimeError("transient")

    async with Consumer("bo", "ch", handler, nsqd_tcp_addresses=[broker.tcp_address], max_in_flight=10,
                        requeue_delay_ms=0, backoff_base=0.3) as c:
        await wait_for(lambda: c.in_backoff)
        conn = next(iter(c.connections.values()))
        await wait_for(lambda: c.stats["finished"] == 21 and c.backoff_level == 0 and conn.rdy == 10)
    history = list(conn.rdy_history)
    # full RDY, then 0 while backing off, then 1 to test, then full again
    assert history[0] == 10
    i0 = history.index(0)
    i1 = history.index(1, i0)
    assert 10 in history[i1:], history


async def test_producer_and_consumer_reconnect_after_broker_restart(broker):
    got = []

    async def handler(msg):
        got.append(msg.body)

    async with Producer(broker.tcp_address, reconnect_timeout=15) as producer:
        async with Consumer("re", "ch", handler, nsqd_tcp_addresses=[broker.tcp_address], max_in_flight=10):
            await producer.pub("re", b"before")
            await wait_for(lambda: b"before" in got)
            await trio.to_thread.run_sync(broker.restart)
            await producer.pub("re", b"after")  # waits for the reconnect
            await wait_for(lambda: b"after" in got, timeout=20)


async def test_clean_close_loses_nothing(broker):
    bodies = [b"c%04d" % i for i in range(2000)]
    async with Producer(broker.tcp_address) as producer:
        for start in range(0, len(bodies), 200):
            await producer.mpub("close", bodies[start : start + 200])
    first: list[bytes] = []

    async def slow(msg):
        await trio.sleep(0.001)
        first.append(msg.body)

    async with Consumer("close", "ch", slow, nsqd_tcp_addresses=[broker.tcp_address], max_in_flight=50):
        await wait_for(lambda: len(first) >= 300)
    # every message a handler finished was FIN'd; the rest are still there for the next consumer
    rest: list[bytes] = []

    async def handler(msg):
        rest.append(msg.body)

    async with Consumer("close", "ch", handler, nsqd_tcp_addresses=[broker.tcp_address], max_in_flight=200):
        await wait_for(lambda: len(first) + len(rest) >= len(bodies))
        await trio.sleep(0.3)
    assert sorted(first + rest) == bodies  # no loss, no duplicate


async def test_rdy_is_spread_over_brokers_found_through_lookupd(tmp_path, broker_factory):
    lk = Lookupd(tmp_path).start()
    try:
        brokers = [broker_factory(lookupd_tcp_address=lk.tcp_address, broadcast_address="127.0.0.1") for _ in range(3)]
        for b in brokers:
            r = httpx.post(f"http://{b.http_address}/topic/create?topic=spread", timeout=5)
            assert r.status_code == 200
        await trio.to_thread.run_sync(
            lambda: eventually(lambda: len(lk.get("/lookup?topic=spread").json()["producers"]) == 3))
        got = []

        async def handler(msg):
            got.append(msg.body)

        async with Consumer("spread", "ch", handler, lookupd_http_addresses=[lk.http], max_in_flight=30,
                            lookupd_poll_interval=0.5) as c:
            await wait_for(lambda: len(c._live()) == 3)
            await wait_for(lambda: sorted(conn.rdy for conn in c._live()) == [10, 10, 10])
            for i, b in enumerate(brokers):
                async with Producer(b.tcp_address) as p:
                    await p.mpub("spread", [b"b%d-%d" % (i, j) for j in range(10)])
            await wait_for(lambda: len(got) == 30)
        assert {m.split(b"-")[0] for m in got} == {b"b0", b"b1", b"b2"}
    finally:
        lk.stop()


async def test_http_producer_batches_and_surfaces_errors(broker):
    async with HTTPProducer(f"http://{broker.http_address}", batch_size=50) as hp:
        for i in range(120):
            await hp.pub("http", b"line\n%d" % i)  # newlines are safe: binary /mpub
        await hp.flush()
        await hp.pub("http", b"x" * (1024 * 1024 + 1))
        with pytest.raises(NSQError) as err:
            await hp.flush()
        assert "MSG_TOO_BIG" in str(err.value) or "BAD_MESSAGE" in str(err.value)
    got = []

    async def handler(msg):
        got.append(msg.body)

    async with Consumer("http", "ch", handler, nsqd_tcp_addresses=[broker.tcp_address], max_in_flight=100):
        await wait_for(lambda: len(got) >= 120)
    assert sorted(got) == sorted(b"line\n%d" % i for i in range(120))


def test_producer_times_out_without_a_broker():
    async def main():
        async with Producer("127.0.0.1:1", reconnect_timeout=0.5) as p:
            with pytest.raises(ConnectionError):
                await p.pub("t", b"x")

    start = time.monotonic()
    trio.run(main)
    assert time.monotonic() - start < 5
