"""The Trio client (trio_nsq.client) against real `python -m trio_nsq.broker` / `python -m trio_nsq.lookupd` processes.

The processes are started by a small fixture of this file (`cluster`) on free loopback ports; every
process is killed when the test ends. What the client does is checked from the broker's side where
it can be: /stats shows the RDY nsqd holds for each client, and the channel's depth and in-flight
count show that FINs arrived.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
import trio
from processes import (
    BrokerProcess,
    Daemon,
    LookupdProcess,
    free_port,
)

from trio_nsq.client import (
    Connection,
    Consumer,
    HTTPProducer,
    NSQConnectionError,
    NSQError,
    Producer,
)
from trio_nsq.shared.protocol import (
    FRAME_TYPE_RESPONSE,
    HEARTBEAT,
    MAGIC_V2,
    CommandParser,
    decode_message,
    encode_cls,
    encode_frame,
    encode_pub,
    encode_sub,
)

D = TypeVar("D", bound=Daemon)


# --- processes --------------------------------------------------------------------------------------


class Cluster:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.procs: list[Daemon] = []

    def broker(self, **flags: object) -> BrokerProcess:
        return self._start(BrokerProcess(self.base, **flags))

    def lookupd(self, **flags: object) -> LookupdProcess:
        return self._start(LookupdProcess(self.base, **flags))

    def _start(self, proc: D) -> D:
        self.procs.append(proc)
        return proc.start()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        for proc in c.procs:
            proc.kill()


# --- helpers ----------------------------------------------------------------------------------------


async def wait_for(predicate, timeout: float = 10.0, interval: float = 0.01) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(interval)


async def channel_stats(broker: BrokerProcess, topic: str, channel: str) -> dict:
    async with httpx.AsyncClient() as client:
        r = await client.get(f"http://{broker.http_address}/stats", params={"format": "json", "topic": topic})
    for t in r.json()["topics"]:
        for c in t["channels"]:
            if t["topic_name"] == topic and c["channel_name"] == channel:
                return c
    return {}


async def broker_rdy(broker: BrokerProcess, topic: str, channel: str) -> list[int]:
    """The RDY counts nsqd holds for the channel's clients."""
    return [c["ready_count"] for c in (await channel_stats(broker, topic, channel)).get("clients", [])]


class Collector:
    """A handler that records bodies (and arrival times)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.times: list[float] = []

    async def __call__(self, message) -> None:
        self.bodies.append(message.body)
        self.times.append(trio.current_time())


# --- Connection ---------------------------------------------------------------------------------------


async def test_connection_matches_pipelined_answers_in_order_and_answers_heartbeats(nursery):
    """A fake nsqd that answers each PUB with its own body: every one of 500 concurrent commands must
    get its own body back. It also sends a heartbeat, which must be answered with NOP."""
    seen: list[bytes] = []
    reads = 0

    async def fake_nsqd(stream):
        nonlocal reads
        parser = CommandParser(lambda *args: None)
        buf = b""
        while len(buf) < 4:
            buf += await stream.receive_some(4096)
        assert buf[:4] == MAGIC_V2
        parser.feed(buf[4:])
        while True:
            while (cmd := parser.next_command()) is not None:
                seen.append(cmd.name)
                if cmd.name == b"IDENTIFY":
                    features = b'{"max_rdy_count": 123, "msg_timeout": 4567, "heartbeat_interval": 30000}'
                    await stream.send_all(encode_frame(FRAME_TYPE_RESPONSE, features)
                                          + encode_frame(FRAME_TYPE_RESPONSE, HEARTBEAT))
                elif cmd.name == b"PUB":
                    await stream.send_all(encode_frame(FRAME_TYPE_RESPONSE, cmd.body))
            data = await stream.receive_some(65536)
            if not data:
                return
            reads += 1
            parser.feed(data)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, fake_nsqd, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    async with Connection(f"127.0.0.1:{port}") as conn:
        assert (conn.max_rdy_count, conn.msg_timeout) == (123, 4567)
        answers: dict[int, bytes] = {}

        async def one(i: int) -> None:
            answers[i] = await conn.command(encode_pub("t", b"body-%d" % i))

        async with trio.open_nursery() as inner:
            for i in range(500):
                inner.start_soon(one, i)
        assert answers == {i: b"body-%d" % i for i in range(500)}
        await wait_for(lambda: b"NOP" in seen)
    assert seen.count(b"PUB") == 500
    assert reads < 250  # the writer task coalesces pipelined commands into few writes


async def test_connection_alone_keeps_alive_on_heartbeats_and_delivers_through_its_channel(cluster):
    broker = cluster.broker()
    async with Connection(broker.tcp_address, identify={"heartbeat_interval": 1000}) as conn:
        assert conn.heartbeat_interval == 1000 and conn.features["max_rdy_count"] == conn.max_rdy_count
        assert await conn.command(encode_sub("solo", "ch")) == b"OK"
        conn.send_rdy(5)
        await trio.sleep(2.5)  # nsqd closes a client silent for two heartbeat intervals: NOPs keep it
        assert not conn.is_closed
        async with Producer(broker.tcp_address) as producer:
            await producer.mpub("solo", [b"a", b"b", b"c"])
        got = []
        with trio.fail_after(5):
            async for msg in conn.messages:
                got.append(msg.body)
                conn.fin(msg.id)
                if len(got) == 3:
                    break
        await conn.close_gracefully()
        assert conn.is_closed and conn.in_flight == 0
    assert sorted(got) == [b"a", b"b", b"c"]
    stats = await channel_stats(broker, "solo", "ch")
    assert stats["depth"] == 0 and stats["in_flight_count"] == 0 and stats["clients"] == []


async def test_connection_hands_over_raw_frames_per_read_and_answers_many_ids_in_one_write(cluster):
    """on_messages gets the undecoded message frames of each read; touch_many keeps them past msg_timeout,
    fin_many and req_many answer them: nsqd counts no timeout, 400 requeued, nothing in flight."""
    broker = cluster.broker()
    sent = [b"raw-%04d" % i for i in range(1000)]
    async with Producer(broker.tcp_address) as producer:
        await producer.mpub("raw", sent)
    frames: list[bytes] = []
    async with Connection(broker.tcp_address, identify={"msg_timeout": 1000},
                          on_messages=lambda conn, got: frames.extend(got)) as conn:
        await conn.command(encode_sub("raw", "ch"))
        conn.send_rdy(1000)
        await wait_for(lambda: len(frames) == 1000)
        assert conn.in_flight == 1000 and conn.messages_received == 1000
        messages = [decode_message(frame) for frame in frames]
        assert sorted(m.body for m in messages) == sorted(sent) and {m.attempts for m in messages} == {1}
        ids = [m.id for m in messages]
        for _ in range(5):  # 1.5 s held, over msg_timeout: TOUCHed every 0.3 s
            await trio.sleep(0.3)
            conn.touch_many(ids)
        conn.fin_many(ids[:600])
        conn.req_many(ids[600:])
        assert conn.in_flight == 0
        conn.send_rdy(0)
        assert await conn.command(encode_cls()) == b"CLOSE_WAIT"
    stats = await channel_stats(broker, "raw", "ch")
    assert (stats["timeout_count"], stats["requeue_count"], stats["depth"], stats["in_flight_count"]) == \
        (0, 400, 400, 0)


# --- Producer -----------------------------------------------------------------------------------------


async def test_pipelined_pubs_mpub_dpub_then_consumed_exactly_once(cluster):
    broker = cluster.broker()
    async with Producer(broker.tcp_address) as producer:
        async with trio.open_nursery() as nursery:
            for i in range(1000):
                nursery.start_soon(producer.pub, "pipe", b"%d" % i)
        await producer.mpub("pipe", [b"m1", b"m2"])
        published_at = trio.current_time()
        await producer.dpub("pipe", 300, b"deferred")
        assert producer.connects == 1
    got = Collector()
    async with Consumer("pipe", "ch", got, nsqd_tcp_addresses=[broker.tcp_address], max_in_flight=200) as c:
        await wait_for(lambda: len(got.bodies) >= 1003)
        await trio.sleep(0.2)  # anything more would be a duplicate
    assert sorted(got.bodies) == sorted([b"%d" % i for i in range(1000)] + [b"m1", b"m2", b"deferred"])
    assert got.times[got.bodies.index(b"deferred")] - published_at >= 0.29
    assert c.stats["finished"] == 1003 and c.stats["received"] == 1003
    stats = await channel_stats(broker, "pipe", "ch")
    assert stats["depth"] == 0 and stats["in_flight_count"] == 0 and stats["deferred_count"] == 0


async def test_a_refused_pub_fails_alone_and_the_pipeline_behind_it_is_resent(cluster):
    """nsqd closes the connection after E_BAD_TOPIC and executes nothing after it: the producer raises
    NSQError for that one PUB and sends the PUBs queued behind it again on a new connection."""
    broker = cluster.broker()
    results: dict[int, object] = {}

    async with Producer(broker.tcp_address) as producer:
        async def one(i: int) -> None:
            try:
                await producer.pub("bad*topic" if i == 100 else "refused", b"%d" % i)
                results[i] = "ok"
            except NSQError as exc:
                results[i] = exc

        async with trio.open_nursery() as nursery:
            for i in range(300):
                nursery.start_soon(one, i)
        assert producer.connects >= 2
    error = results.pop(100)
    assert isinstance(error, NSQError) and error.code == "E_BAD_TOPIC" and error.fatal
    assert set(results.values()) == {"ok"}
    got = Collector()
    async with Consumer("refused", "ch", got, nsqd_tcp_addresses=[broker.tcp_address], max_in_flight=100):
        await wait_for(lambda: len(got.bodies) >= 299)
        await trio.sleep(0.2)
    assert sorted(got.bodies) == sorted(b"%d" % i for i in range(300) if i != 100)  # none lost, none twice


async def test_producer_gives_up_after_reconnect_timeout_without_a_broker():
    start = trio.current_time()
    async with Producer(f"127.0.0.1:{free_port()}", reconnect_timeout=0.5) as producer:
        with pytest.raises(NSQConnectionError) as err:
            await producer.pub("t", b"x")
    assert not err.value.maybe_processed
    assert "not connected" in str(err.value) and trio.current_time() - start < 3


# --- Consumer -----------------------------------------------------------------------------------------


async def test_requeue_on_exception_then_give_up_after_max_attempts(cluster):
    broker = cluster.broker()
    async with Producer(broker.tcp_address) as producer:
        await producer.mpub("fail", [b"poison", b"fine"])
    calls: list[tuple[bytes, int]] = []
    given_up = []

    async def handler(msg):
        calls.append((msg.body, msg.attempts))
        if msg.body == b"poison":
            raise RuntimeError("cannot handle")

    async def give_up(msg):
        given_up.append((msg.body, msg.attempts))

    async with Consumer("fail", "ch", handler, nsqd_tcp_addresses=[broker.tcp_address], max_in_flight=5,
                        max_attempts=3, requeue_delay_ms=20, backoff_base=0.05, on_give_up=give_up) as c:
        await wait_for(lambda: given_up)
    assert given_up == [(b"poison", 3)]
    assert [a for b, a in calls if b == b"poison"] == [1, 2, 3]  # the handler ran max_attempts times
    assert (b"fine", 1) in calls
    assert c.stats["requeued"] == 2 and c.stats["given_up"] == 1 and c.stats["failed"] == 3
    stats = await channel_stats(broker, "fail", "ch")
    assert stats["requeue_count"] == 2 and stats["depth"] == 0 and stats["in_flight_count"] == 0

    # a message that arrives with more attempts than max_attempts is given up without calling the handler
    async with Producer(broker.tcp_address) as producer:
        await producer.pub("fail", b"old")

    async def requeue_it(msg):
        await msg.requeue(delay_ms=300, backoff=False)  # back after this consumer has gone

    async with Consumer("fail", "ch", requeue_it, nsqd_tcp_addresses=[broker.tcp_address]) as first:
        await wait_for(lambda: first.stats["requeued"] == 1)
    calls.clear()
    given_up.clear()
    async with Consumer("fail", "ch", handler, nsqd_tcp_addresses=[broker.tcp_address], max_attempts=1,
                        on_give_up=give_up):
        await wait_for(lambda: given_up)
    assert given_up == [(b"old", 2)] and calls == []


async def test_backoff_sets_rdy_0_then_tests_with_rdy_1_and_backs_off_longer_on_failure(cluster):
    broker = cluster.broker()
    async with Producer(broker.tcp_address) as producer:
        await producer.mpub("bo", [b"msg%02d" % i for i in range(40)])
    failures: list[float] = []
    tests: list[float] = []
    broker_rdy_seen: set[int] = set()
    consumer: Consumer | None = None

    async def handler(msg):
        now = trio.current_time()
        if not failures:
            failures.append(now)
            raise RuntimeError("downstream is down")
        if consumer.testing:
            tests.append(now)
            if len(tests) == 1:
                failures.append(now)
                raise RuntimeError("still down")

    async def watch_broker():
        while True:
            broker_rdy_seen.update(await broker_rdy(broker, "bo", "ch"))
            await trio.sleep(0.05)

    async with Consumer("bo", "ch", handler, nsqd_tcp_addresses=[broker.tcp_address], max_in_flight=10,
                        requeue_delay_ms=0, backoff_base=0.4, max_backoff=5) as consumer:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_broker)
            await wait_for(lambda: consumer.stats["finished"] == 40 and not consumer.testing)
            nursery.cancel_scope.cancel()
        assert await broker_rdy(broker, "bo", "ch") == [10]
        conn = next(iter(consumer.connections.values()))
        history = [n for i, n in enumerate(conn.rdy_history) if i == 0 or n != conn.rdy_history[i - 1]]
    # two failures (level 2), then each good test steps down one level and backs off again: full RDY
    # only at level 0, as go-nsq (consumer.go 815-854) and pynsq (10 may be refilled: the 25 % rule)
    assert history == [10, 0, 1, 0, 1, 0, 1, 10], list(conn.rdy_history)
    assert len(tests) == 3 and consumer.stats["backoffs"] == 2
    # the intervals: 0.4 s after the first failure, 0.8 s after the failed test, 0.4 s after the good one
    assert tests[0] - failures[0] >= 0.4
    assert tests[1] - failures[1] >= 0.8
    assert tests[2] - tests[1] >= 0.4
    assert consumer.backoff_counter == 0
    assert 0 in broker_rdy_seen  # nsqd saw RDY 0 while we backed off


async def test_producer_and_consumer_resume_after_the_broker_is_killed_and_restarted(cluster):
    broker = cluster.broker()
    got = Collector()
    async with Producer(broker.tcp_address, reconnect_timeout=20) as producer:
        async with Consumer("re", "ch", got, nsqd_tcp_addresses=[broker.tcp_address], max_in_flight=10) as c:
            await producer.pub("re", b"before")
            await wait_for(lambda: b"before" in got.bodies)
            first_conn = c.connections[broker.tcp_address]
            broker.kill()
            await wait_for(lambda: first_conn.is_closed)

            async def restart_later():
                await trio.sleep(0.3)
                await trio.to_thread.run_sync(broker.start)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(restart_later)
                await producer.pub("re", b"after")  # made during the outage: waits for the reconnect
            await wait_for(lambda: b"after" in got.bodies, timeout=20)
            assert c.connections[broker.tcp_address] is not first_conn
        assert producer.connects == 2
    assert got.bodies == [b"before", b"after"]


async def test_clean_close_mid_stream_loses_nothing_and_redelivers_nothing(cluster):
    broker = cluster.broker()
    bodies = [b"c%04d" % i for i in range(2000)]
    async with Producer(broker.tcp_address) as producer:
        for start in range(0, len(bodies), 250):
            await producer.mpub("close", bodies[start : start + 250])
    first = Collector()

    async def slow(msg):
        await trio.sleep(0.002)
        await first(msg)

    async with Consumer("close", "ch", slow, nsqd_tcp_addresses=[broker.tcp_address], max_in_flight=50) as c:
        await wait_for(lambda: len(first.bodies) >= 300)
    # everything received before CLOSE_WAIT was handled and FIN'd; nsqd holds nothing in flight for us
    assert c.stats["received"] == c.stats["finished"] == len(first.bodies)
    stats = await channel_stats(broker, "close", "ch")
    assert stats["in_flight_count"] == 0 and stats["clients"] == []
    assert stats["depth"] == len(bodies) - len(first.bodies)

    rest = Collector()
    async with Consumer("close", "ch", rest, nsqd_tcp_addresses=[broker.tcp_address], max_in_flight=200):
        await wait_for(lambda: len(first.bodies) + len(rest.bodies) >= len(bodies))
        await trio.sleep(0.3)
    assert sorted(first.bodies + rest.bodies) == bodies  # no loss, no duplicate


async def test_rdy_is_spread_over_three_brokers_found_through_lookupd(cluster):
    lookupd = cluster.lookupd()
    brokers = [cluster.broker(lookupd_tcp_address=lookupd.tcp_address, broadcast_address="127.0.0.1")
               for _ in range(3)]
    async with httpx.AsyncClient() as client:
        for b in brokers:
            assert (await client.post(f"http://{b.http_address}/topic/create?topic=spread")).status_code == 200

        async def lookupd_knows_all() -> bool:
            r = await client.get(f"http://{lookupd.http_address}/lookup", params={"topic": "spread"})
            return r.status_code == 200 and len(r.json()["producers"]) == 3

        with trio.fail_after(10):
            while not await lookupd_knows_all():
                await trio.sleep(0.05)

    got = Collector()
    async with Consumer("spread", "ch", got, lookupd_http_addresses=[lookupd.http_address],
                        max_in_flight=31, lookupd_poll_interval=0.5) as c:
        with trio.fail_after(10):
            await c.wait_connected(3)
        # nsqd's view: 31 split as 11 + 10 + 10
        with trio.fail_after(5):
            while sorted([r for b in brokers for r in await broker_rdy(b, "spread", "ch")]) != [10, 10, 11]:
                await trio.sleep(0.05)
        for i, b in enumerate(brokers):
            async with Producer(b.tcp_address) as p:
                await p.mpub("spread", [b"b%d-%d" % (i, j) for j in range(10)])
        await wait_for(lambda: len(got.bodies) == 30)
    assert {body.split(b"-")[0] for body in got.bodies} == {b"b0", b"b1", b"b2"}

    # more connections than max_in_flight: RDY 1 rotates, the total never passes max_in_flight
    async with httpx.AsyncClient() as client:
        for b in brokers:  # the channel must exist before the publish, or only "ch" gets the messages
            r = await client.post(f"http://{b.http_address}/channel/create?topic=spread&channel=rot")
            assert r.status_code == 200
    for i, b in enumerate(brokers):
        async with Producer(b.tcp_address) as p:
            await p.mpub("spread", [b"r%d-%d" % (i, j) for j in range(5)])
    rotated = Collector()
    client_totals: list[int] = []
    broker_seen: list[set[int]] = [set(), set(), set()]
    async with Consumer("spread", "rot", rotated, lookupd_http_addresses=[lookupd.http_address],
                        max_in_flight=2, rdy_redistribute_interval=0.2, lookupd_poll_interval=0.5) as c:

        async def watch_client():
            while True:
                client_totals.append(sum(conn.rdy for conn in c.connections.values()))
                await trio.sleep(0.005)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_client)
            with trio.fail_after(10):
                await c.wait_connected(3)
            await trio.sleep(0.1)  # RDY sent while connections were still arriving has landed
            with trio.fail_after(15):
                while len(rotated.bodies) < 15 or not all(1 in seen for seen in broker_seen):
                    for b, seen in zip(brokers, broker_seen):
                        seen.update(await broker_rdy(b, "spread", "rot"))
                    await trio.sleep(0.02)
            nursery.cancel_scope.cancel()
    assert max(client_totals) <= 2
    assert all(seen <= {0, 1} for seen in broker_seen), broker_seen  # each broker holds RDY 0 or 1 ...
    assert all(1 in seen for seen in broker_seen)  # ... and each had its turn
    assert sorted(rotated.bodies) == sorted(b"r%d-%d" % (i, j) for i in range(3) for j in range(5))


# --- HTTP ---------------------------------------------------------------------------------------------


async def test_http_producer_batches_into_mpub_and_surfaces_errors(cluster):
    broker = cluster.broker()
    async with HTTPProducer(broker.http_address, batch_size=50, flush_interval=10) as hp:
        for i in range(120):
            await hp.pub("http", b"line\n%d" % i)  # newlines are safe: binary /mpub
        await hp.flush()
        assert hp.published == 120 and hp.posts <= 5  # batches of at most 50 (what is queued goes)
        await hp.pub("http", b"single")
        await hp.flush()  # a batch of one goes to /pub
        await hp.dpub("http", 200, b"deferred")
        await hp.pub("http", b"x" * (1024 * 1024 + 1))
        with pytest.raises(NSQError) as err:
            await hp.flush()
        assert err.value.code == "MSG_TOO_BIG" and err.value.status == 413
        assert hp.failed == 1
        with pytest.raises(NSQError) as err:
            await hp.pub("bad*topic", b"x")
            await hp.flush()
        assert err.value.code == "INVALID_TOPIC"
    got = Collector()
    async with Consumer("http", "ch", got, nsqd_tcp_addresses=[broker.tcp_address], max_in_flight=100):
        await wait_for(lambda: len(got.bodies) >= 122)
        await trio.sleep(0.1)
    assert sorted(got.bodies) == sorted([b"line\n%d" % i for i in range(120)] + [b"single", b"deferred"])
