"""The Trio client's Consumer as go-nsq's and pynsq's users expect it (issue 50): requeue delays, backoff
that steps down one success at a time, RDY where the messages are, a bounded inbox, plain handlers,
errors at construction and from every broker, max_in_flight changed at run time.

Timing rules run against a real NSQD in the test's nursery under trio's MockClock (exact times, no 90 s
waits): the consumer connects to it over loopback TCP as to any nsqd. What is the broker's behaviour
(msg_timeout, RDY across brokers, auth) runs against real `python -m trio_nsq.broker` processes.
"""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing
from processes import BrokerProcess

from trio_nsq.broker.nsqd import NSQD
from trio_nsq.broker.options import Options
from trio_nsq.client import Consumer, NSQError, Producer

# --- an NSQD in the test's nursery ------------------------------------------------------------------


@pytest.fixture
def clock():
    # the clock jumps only once every task has waited 1 ms of real time: loopback I/O between the
    # consumer and the broker (one process, one thread) lands well within that, so no timeout fires early
    return trio.testing.MockClock(autojump_threshold=0.001)


async def inline(fn, *args):
    return fn(*args)


@pytest.fixture
async def nsqd(nursery, tmp_path):
    """A started NSQD (HTTP off) on a free loopback port; its address is nsqd.address."""
    opts = Options(tcp_address="127.0.0.1:0", http_address="", https_address="",
                   broadcast_address="127.0.0.1", data_path=str(tmp_path))
    broker = NSQD(opts)
    broker.meta.run_sync = inline  # nsqd.dat written in place, not in a thread the mock clock cannot see
    await nursery.start(broker.run)
    host, port = broker.tcp_address
    broker.address = f"{host}:{port}"
    return broker


async def wait_for(predicate, timeout: float = 10.0, interval: float = 0.1) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(interval)


def changes(history) -> list[int]:
    """The RDY counts a connection sent, repeats (refills of the same count) left out."""
    return [n for i, n in enumerate(history) if i == 0 or n != history[i - 1]]


# --- 1. requeue delays ------------------------------------------------------------------------------


async def test_default_requeue_delays_are_go_nsqs_and_the_given_up_message_is_logged(nsqd, clock, caplog):
    """All defaults and a handler that always fails: attempts 90 s x attempts apart (go-nsq's
    DefaultRequeueDelay 90 s, MaxAttempts 5), then one WARNING naming the message, and it is FIN'd."""
    async with Producer(nsqd.address) as producer:
        await producer.pub("req", b"poison")
    attempts: list[tuple[int, float]] = []
    ids: set[str] = set()

    async def handler(msg):
        attempts.append((msg.attempts, trio.current_time()))
        ids.add(msg.id.decode())
        raise RuntimeError("downstream is down")

    caplog.set_level(logging.WARNING, "trio_nsq.client")
    async with Consumer("req", "ch", handler, nsqd_tcp_addresses=[nsqd.address]) as consumer:
        await wait_for(lambda: consumer.stats["given_up"] == 1, timeout=1200, interval=1)
    assert [a for a, _ in attempts] == [1, 2, 3, 4, 5]
    gaps = [round(b - a) for (_, a), (_, b) in zip(attempts, attempts[1:])]
    assert gaps == [90, 180, 270, 360], gaps
    given_up = [r.getMessage() for r in caplog.records if "giving up" in r.getMessage()]
    (msg_id,) = ids
    assert len(given_up) == 1 and msg_id in given_up[0] and given_up[0].endswith("after 5 attempts")
    assert nsqd.topics["req"].channels["ch"].depth() == 0


async def test_requeue_delay_is_capped_at_max_requeue_delay():
    from trio_nsq.client.backoff import requeue_delay_ms

    c = Consumer("t", "c", noop, nsqd_tcp_addresses=["127.0.0.1:4150"])
    assert (c.requeue_delay_ms, c.max_requeue_delay_ms, c.max_attempts) == (90_000, 900_000, 5)
    assert [requeue_delay_ms(n, c.requeue_delay_ms, c.max_requeue_delay_ms) for n in (1, 2, 10, 11, 50)] == \
        [90_000, 180_000, 900_000, 900_000, 900_000]


async def noop(msg):
    pass


# --- 2. backoff -------------------------------------------------------------------------------------


async def test_backoff_steps_down_one_success_at_a_time(nsqd, clock):
    """Two failures (counter 2), then successes: each success while backing off lowers the counter by
    one and backs off again (shorter), RDY 1 tests again; full RDY only at counter 0 (go-nsq 815-854)."""
    async with Producer(nsqd.address) as producer:
        await producer.mpub("bo", [b"m%02d" % i for i in range(40)])
    failures = 0
    consumer: Consumer | None = None
    counters: list[int] = []

    async def handler(msg):
        nonlocal failures
        assert consumer is not None
        if failures == 0 or (consumer.testing and failures == 1):
            failures += 1
            raise RuntimeError("down")
        if consumer.testing:
            counters.append(consumer.backoff_counter)

    async with Consumer("bo", "ch", handler, nsqd_tcp_addresses=[nsqd.address], max_in_flight=10,
                        requeue_delay_ms=0, backoff_base=1.0, max_backoff=60) as consumer:
        await wait_for(lambda: consumer.stats["finished"] == 40 and not consumer.testing, timeout=120)
        conn = next(iter(consumer.connections.values()))
        history = changes(conn.rdy_history)
    assert history == [10, 0, 1, 0, 1, 0, 1, 10], list(conn.rdy_history)
    assert counters == [2, 1] and consumer.backoff_counter == 0


async def test_backoff_counter_is_capped_so_the_interval_stays_within_max_backoff(nsqd, clock):
    """A handler that always fails for a long outage: the counter stops where the next interval
    would pass max_backoff (1, 2, 4 s: 3 levels under 5 s), so one success later is a short way back."""
    async with Producer(nsqd.address) as producer:
        await producer.pub("cap", b"x")
    async with Consumer("cap", "ch", always_fails, nsqd_tcp_addresses=[nsqd.address], max_attempts=0,
                        requeue_delay_ms=0, backoff_base=1.0, max_backoff=5) as consumer:
        await wait_for(lambda: consumer.stats["backoffs"] >= 30, timeout=600, interval=1)
        assert consumer.backoff_counter == 3


async def always_fails(msg):
    raise RuntimeError("down")


def test_full_jitter_backoff_is_uniform_up_to_the_exponential_interval():
    from trio_nsq.client.backoff import FullJitterBackoff

    backoff = FullJitterBackoff(base=1.0)
    draws = [backoff(4) for _ in range(2000)]
    assert 0 <= min(draws) < 0.5 and 7.5 < max(draws) <= 8.0  # [0, 1 x 2**3)


# --- 3. RDY where the messages are -------------------------------------------------------------------


async def test_max_in_flight_below_connections_gives_rdy_to_the_loaded_broker(tmp_path):
    """3 brokers, a backlog on one, max_in_flight=1: RDY that finds nothing on a broker moves on, and
    stays where messages flow. Sampled while the backlog drains, once the loaded broker's connection
    has the RDY it keeps it (blind rotation gives it about a third of the time)."""
    brokers = [BrokerProcess(tmp_path).start() for _ in range(3)]
    try:
        loaded = brokers[1]
        for b in brokers:
            assert b.http.post("/topic/create", params={"topic": "hot"}).status_code == 200
            assert b.http.post("/channel/create", params={"topic": "hot", "channel": "ch"}).status_code == 200
        async with Producer(loaded.tcp_address) as producer:
            for start in range(0, 3000, 500):
                await producer.mpub("hot", [b"%d" % i for i in range(start, start + 500)])
        got = 0

        async def handler(msg):
            nonlocal got
            got += 1

        held: list[bool] = []
        async with Consumer("hot", "ch", handler, nsqd_tcp_addresses=[b.tcp_address for b in brokers],
                            max_in_flight=1, rdy_redistribute_interval=0.1) as consumer:
            with trio.fail_after(10):
                await consumer.wait_connected(3)
            with trio.fail_after(120):
                while got < 3000:
                    conn = consumer.connections.get(loaded.tcp_address)
                    held.append(conn is not None and conn.rdy > 0)
                    await trio.sleep(0.02)
            others = [changes(c.rdy_history) for a, c in consumer.connections.items() if a != loaded.tcp_address]
        # each idle broker had the RDY at most once: it moved on to the loaded one and stayed there ...
        assert all(history.count(1) <= 1 for history in others), others
        first = held.index(True)
        share = sum(held[first:]) / len(held[first:])
        assert share >= 0.9, (share, len(held))  # ... which had it whenever sampled from then on
    finally:
        for b in brokers:
            b.kill()


# --- 4. a bounded inbox -----------------------------------------------------------------------------


async def test_a_handler_slower_than_msg_timeout_does_not_grow_the_inbox(tmp_path, caplog):
    """--msg-timeout=1s, max_in_flight=2, a 2.5 s handler: nsqd times the messages out and sends others;
    the ones that expired waiting are dropped (nsqd requeued them) and the waiting count stays bounded."""
    broker = BrokerProcess(tmp_path, msg_timeout="1s").start()
    try:
        async with Producer(broker.tcp_address) as producer:
            await producer.mpub("slow", [b"%d" % i for i in range(200)])
        started = 0

        async def slow(msg):
            nonlocal started
            started += 1
            await trio.sleep(2.5)

        waiting: list[int] = []
        caplog.set_level(logging.WARNING, "trio_nsq.client")
        async with Consumer("slow", "ch", slow, nsqd_tcp_addresses=[broker.tcp_address], max_in_flight=2,
                            max_attempts=0) as consumer:
            for _ in range(80):  # 8 s: three rounds of handlers, eight of nsqd's timeouts
                waiting.append(consumer.stats["received"] - started - consumer.stats.get("expired", 0))
                await trio.sleep(0.1)
        assert max(waiting) <= 4, waiting
        assert consumer.stats["expired"] > 0
        assert any("msg_timeout" in r.getMessage() for r in caplog.records)
    finally:
        broker.kill()


# --- 5. plain handlers, return False, tracebacks ------------------------------------------------------


async def test_a_plain_handler_runs_in_a_thread_and_false_requeues(nsqd, clock, caplog):
    async with Producer(nsqd.address) as producer:
        await producer.mpub("plain", [b"a", b"b"])
    calls: list[tuple[bytes, int, bool]] = []

    def handler(msg):  # pynsq style: True finishes, False requeues
        calls.append((msg.body, msg.attempts, trio.lowlevel.in_trio_run()))
        return msg.attempts > 1

    async with Consumer("plain", "ch", handler, nsqd_tcp_addresses=[nsqd.address], max_in_flight=2,
                        requeue_delay_ms=100, backoff_base=0.1) as consumer:
        await wait_for(lambda: consumer.stats["finished"] == 2, timeout=60)
    assert sorted((b, a) for b, a, _ in calls) == [(b"a", 1), (b"a", 2), (b"b", 1), (b"b", 2)]
    assert not any(in_trio for _, _, in_trio in calls)  # in a worker thread
    assert consumer.stats["requeued"] == 2 and consumer.stats["failed"] == 2

    # an async handler returning False requeues too; an exception is logged with its traceback
    async with Producer(nsqd.address) as producer:
        await producer.mpub("async", [b"x", b"y"])

    async def async_handler(msg):
        if msg.body == b"x" and msg.attempts == 1:
            return False
        if msg.body == b"y" and msg.attempts == 1:
            raise KeyError("boom")
        return None

    caplog.set_level(logging.WARNING, "trio_nsq.client")
    async with Consumer("async", "ch", async_handler, nsqd_tcp_addresses=[nsqd.address], max_in_flight=2,
                        requeue_delay_ms=100, backoff_base=0.1) as consumer:
        await wait_for(lambda: consumer.stats["finished"] == 2, timeout=60)
    assert consumer.stats["requeued"] == 2
    failed = [r for r in caplog.records if "boom" in r.getMessage() or (r.exc_info and "boom" in str(r.exc_info[1]))]
    assert failed and failed[0].exc_info is not None and failed[0].exc_info[0] is KeyError


# --- 9. errors at construction and from every broker ------------------------------------------------


@pytest.mark.parametrize("topic, channel", [("bad topic", "ch"), ("t", "bad/channel"), ("x" * 65, "ch"), ("t", "")])
def test_invalid_names_fail_at_construction(topic, channel):
    with pytest.raises(ValueError, match="invalid (topic|channel) name"):
        Consumer(topic, channel, noop, nsqd_tcp_addresses=["127.0.0.1:4150"])


def test_a_handler_that_is_not_callable_fails_at_construction():
    with pytest.raises(TypeError, match="handler"):
        Consumer("t", "c", "not a function", nsqd_tcp_addresses=["127.0.0.1:4150"])  # type: ignore[arg-type]


async def test_wait_connected_raises_when_every_broker_refuses(tmp_path):
    """Brokers whose auth server is down answer AUTH with E_AUTH_FAILED: wait_connected raises it
    instead of waiting for ever (the consumer keeps retrying: the auth server may come back)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed
    brokers = [BrokerProcess(tmp_path, auth_http_address=dead).start() for _ in range(2)]
    try:
        async with Consumer("t", "c", noop, nsqd_tcp_addresses=[b.tcp_address for b in brokers],
                            auth_secret="secret") as consumer:
            with trio.fail_after(20):
                with pytest.raises(NSQError) as err:
                    await consumer.wait_connected()
        assert err.value.code == "E_AUTH_FAILED"
    finally:
        for b in brokers:
            b.kill()


# --- 11. change_max_in_flight ------------------------------------------------------------------------


async def test_change_max_in_flight_pauses_at_0_and_resumes(nsqd, clock):
    got: list[bytes] = []

    async def handler(msg):
        got.append(msg.body)

    async with Consumer("mif", "ch", handler, nsqd_tcp_addresses=[nsqd.address], max_in_flight=5) as consumer:
        await consumer.wait_connected()
        conn = next(iter(consumer.connections.values()))
        await wait_for(lambda: broker_rdy(nsqd) == [5])
        consumer.change_max_in_flight(0)
        await wait_for(lambda: broker_rdy(nsqd) == [0])
        async with Producer(nsqd.address) as producer:
            await producer.mpub("mif", [b"%d" % i for i in range(20)])
        await trio.sleep(30)
        assert got == [] and conn.rdy == 0  # paused: nothing delivered
        consumer.change_max_in_flight(20)
        await wait_for(lambda: len(got) == 20)
        assert broker_rdy(nsqd) == [20] and consumer.concurrency == 20
        with pytest.raises(ValueError):
            consumer.change_max_in_flight(-1)
    assert changes(conn.rdy_history)[:3] == [5, 0, 20]


def broker_rdy(broker: NSQD) -> list[int]:
    return [c.ready_count for c in broker.clients.values() if getattr(c, "ready_count", None) is not None
            and c.channel is not None]


# --- extras -----------------------------------------------------------------------------------------


async def test_manual_responses_and_is_starved(nsqd, clock):
    """disable_auto_response(): the handler returns, the message stays in flight until the user
    answers it (go-nsq's DisableAutoResponse); is_starved() says when in-flight reaches 85 % of RDY."""
    async with Producer(nsqd.address) as producer:
        await producer.mpub("manual", [b"%d" % i for i in range(4)])
    held = []

    async def handler(msg):
        msg.disable_auto_response()
        held.append(msg)

    async with Consumer("manual", "ch", handler, nsqd_tcp_addresses=[nsqd.address], max_in_flight=4) as consumer:
        await wait_for(lambda: len(held) == 4)
        await trio.sleep(1)
        assert consumer.stats["finished"] == 0 and consumer.is_starved()
        for msg in held:
            await msg.finish()
        assert consumer.stats["finished"] == 4 and not consumer.is_starved()
    assert nsqd.topics["manual"].channels["ch"].depth() == 0
    with pytest.raises(trio.ClosedResourceError):
        await consumer.wait_connected()  # an immediate error after close, not a wait for ever
