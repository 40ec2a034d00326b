"""Settings per topic and channel through a broker process, with real clients: a poison message that
pynsq always requeues reaches the dead-letter topic after its attempts and nowhere else, and a re-drive
brings it back; kill -9 right after the move; the maximum depth refusing PUB over TCP and /pub over HTTP
with nothing accepted lost; TTL; settings surviving a restart; bad values refused, changing nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx

from nsq_raw import Error, RawNSQ
from processes import BrokerProcess, repo_env, wait_for

# pynsq (tornado) consumes: it REQs (delay 0, no backoff) every "poison" body and FINs the others, and
# prints each delivery's body and attempts; it stops once it has seen `seconds` pass.
PYNSQ_POISON = r'''
import json, sys, time
import tornado.ioloop
import nsq

address, topic, channel, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
seen = []

def handler(message):
    seen.append([message.body.decode(), message.attempts])
    message.enable_async()
    if message.body == b"poison":
        message.requeue(delay=0, backoff=False)
    else:
        message.finish()

# max_tries=0: the broker, not the client, counts the attempts
reader = nsq.Reader(topic, channel, message_handler=handler, nsqd_tcp_addresses=[address],
                    max_in_flight=5, max_tries=0)
loop = tornado.ioloop.IOLoop.current()
loop.call_later(seconds, loop.stop)
loop.start()
print(json.dumps(seen))
'''


def post(broker: BrokerProcess, path: str, content: bytes = b"", **params: object) -> httpx.Response:
    return broker.http.post(path, params=params, content=content)


def channel_stats(broker: BrokerProcess, topic: str, channel: str) -> dict:
    stats = broker.get(f"/stats?format=json&topic={topic}").json()
    for t in stats["topics"] or []:
        if t["topic_name"] == topic:
            for c in t["channels"]:
                if c["channel_name"] == channel:
                    return c
    raise AssertionError(f"no channel {topic}:{channel} in /stats")


def test_a_poison_message_goes_to_the_dead_letter_topic_and_is_redriven(broker):
    post(broker, "/topic/create", topic="orders").raise_for_status()
    post(broker, "/channel/create", topic="orders", channel="billing").raise_for_status()
    reply = post(broker, "/channel/config", topic="orders", channel="billing", max_attempts=3)
    assert reply.status_code == 200, reply.text
    assert reply.json()["config"] == {"max_attempts": 3}
    assert reply.json()["effective"]["dead_letter_topic"] == "orders-billing-dlq"
    post(broker, "/mpub", topic="orders", content=b"good-1\npoison\ngood-2").raise_for_status()
    run = subprocess.run([sys.executable, "-c", PYNSQ_POISON, broker.tcp_address, "orders", "billing", "3"],
                         capture_output=True, text=True, timeout=60, env=repo_env())
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout)
    assert [a for body, a in seen if body == "poison"] == [1, 2, 3]  # three deliveries, then moved
    assert sorted(body for body, _ in seen if body != "poison") == ["good-1", "good-2"]
    billing = channel_stats(broker, "orders", "billing")
    assert (billing["dead_lettered_count"], billing["depth"], billing["in_flight_count"]) == (1, 0, 0)
    dead = channel_stats(broker, "orders-billing-dlq", "dead-letters")
    assert dead["depth"] == 1
    with RawNSQ(broker.tcp_address) as conn:  # what the dead-letter topic holds: the body, attempts 0
        conn.identify()
        conn.sub("orders-billing-dlq", "dead-letters")
        conn.rdy(10)
        [msg] = conn.expect_messages(1)
        assert (msg.body, msg.attempts) == (b"poison", 1)
        conn.req(msg.id, 0)
        conn.cls()
    reply = post(broker, "/channel/redrive", topic="orders", channel="billing")
    assert reply.json() == {"topic": "orders", "channel": "billing", "dead_letter_topic": "orders-billing-dlq",
                            "moved": 1}
    assert channel_stats(broker, "orders-billing-dlq", "dead-letters")["depth"] == 0
    with RawNSQ(broker.tcp_address) as conn:
        conn.identify()
        conn.sub("orders", "billing")
        conn.rdy(10)
        [msg] = conn.expect_messages(1)
        assert (msg.body, msg.attempts) == (b"poison", 1)  # attempts reset
        conn.fin(msg.id)
    assert post(broker, "/channel/redrive", topic="orders", channel="billing", limit="x").status_code == 400


def test_kill_9_right_after_the_move_keeps_the_message_in_one_of_the_two(broker_factory):
    broker = broker_factory(mem_queue_size=0)
    post(broker, "/topic/create", topic="jobs").raise_for_status()
    post(broker, "/channel/create", topic="jobs", channel="w").raise_for_status()
    post(broker, "/channel/config", topic="jobs", channel="w", max_attempts=1).raise_for_status()
    bodies = [b"poison-%d" % i for i in range(20)]
    post(broker, "/mpub", topic="jobs", content=b"\n".join(bodies)).raise_for_status()
    with RawNSQ(broker.tcp_address) as conn:
        conn.identify()
        conn.sub("jobs", "w")
        conn.rdy(20)
        msgs = conn.expect_messages(20)
        for msg in msgs:
            conn.req(msg.id, 0)
        conn.nop()
        wait_for(lambda: channel_stats(broker, "jobs", "w")["dead_lettered_count"] == 20)
        broker.kill()
    broker.start()
    found: dict[str, list[bytes]] = {}
    for topic, channel in (("jobs", "w"), ("jobs-w-dlq", "dead-letters")):
        with RawNSQ(broker.tcp_address) as conn:
            conn.identify()
            conn.sub(topic, channel)
            conn.rdy(100)
            got = [m.body for m in conn.frames_for(1.0) if hasattr(m, "body")]
            found[channel] = got
    assert sorted(found["dead-letters"]) == sorted(bodies)  # none lost
    assert set(found["w"]) <= set(bodies)


def test_the_maximum_depth_refuses_over_tcp_and_http_and_loses_nothing_accepted(broker_factory):
    broker = broker_factory()
    post(broker, "/topic/create", topic="t").raise_for_status()
    post(broker, "/channel/create", topic="t", channel="c").raise_for_status()
    reply = post(broker, "/channel/config", topic="t", channel="c", max_depth=3)
    assert reply.json()["effective"]["depth_policy"] == "refuse"
    for i in range(3):
        post(broker, "/pub", topic="t", content=b"m%d" % i).raise_for_status()
    reply = broker.http.post("/pub", params={"topic": "t"}, content=b"m3")
    assert (reply.status_code, reply.json()) == (503, {"message": "TOPIC_FULL"})
    with RawNSQ(broker.tcp_address) as conn:
        conn.command("PUB", "t", body=b"m4")
        error = conn.expect_error()
        assert isinstance(error, Error) and error.code == "E_PUB_FAILED"
        assert "channel c is at its maximum depth 3" in error.text
    c = channel_stats(broker, "t", "c")
    assert (c["depth"], c["refused_count"]) == (3, 2)
    with RawNSQ(broker.tcp_address) as conn:
        conn.identify()
        conn.sub("t", "c")
        conn.rdy(10)
        assert sorted(m.body for m in conn.expect_messages(3)) == [b"m0", b"m1", b"m2"]


def test_settings_survive_a_restart_and_bad_values_change_nothing(broker_factory):
    broker = broker_factory()
    post(broker, "/topic/create", topic="t").raise_for_status()
    post(broker, "/channel/create", topic="t", channel="c").raise_for_status()
    post(broker, "/topic/config", topic="t", message_ttl="1h", mem_queue_size=10).raise_for_status()
    post(broker, "/channel/config", topic="t", channel="c", max_depth=100, depth_policy="drop-oldest").raise_for_status()
    reply = post(broker, "/channel/config", topic="t", channel="c", max_depth=5, depth_policy="sometimes")
    assert (reply.status_code, reply.json()) == (400, {"message": "INVALID_ARG_DEPTH_POLICY"})
    assert post(broker, "/channel/config", topic="nope", channel="c").status_code == 404
    broker.stop()
    meta = broker.metadata()
    assert meta is not None
    [topic] = meta["topics"]
    assert topic["config"] == {"mem_queue_size": 10, "message_ttl": "1h0m0s"}
    assert topic["channels"] == [{"name": "c", "paused": False,
                                  "config": {"max_depth": 100, "depth_policy": "drop-oldest"}}]
    broker.start()
    reply = broker.get("/channel/config?topic=t&channel=c").json()
    assert reply["config"] == {"max_depth": 100, "depth_policy": "drop-oldest"}
    assert reply["effective"]["message_ttl"] == "1h0m0s" and reply["effective"]["mem_queue_size"] == 10
    reply = post(broker, "/topic/config", topic="t", message_ttl="").json()  # unset
    assert reply["config"] == {"mem_queue_size": 10} and reply["effective"]["message_ttl"] == "0s"


def test_an_expired_message_is_not_delivered(broker_factory):
    broker = broker_factory()
    post(broker, "/topic/create", topic="t").raise_for_status()
    post(broker, "/channel/create", topic="t", channel="c").raise_for_status()
    post(broker, "/channel/config", topic="t", channel="c", message_ttl="200ms").raise_for_status()
    post(broker, "/pub", topic="t", content=b"stale").raise_for_status()
    time.sleep(0.4)
    post(broker, "/pub", topic="t", content=b"fresh").raise_for_status()
    with RawNSQ(broker.tcp_address) as conn:
        conn.identify()
        conn.sub("t", "c")
        conn.rdy(10)
        [msg] = conn.expect_messages(1)
        assert msg.body == b"fresh"
    assert channel_stats(broker, "t", "c")["expired_count"] == 1


def test_the_flags_give_every_channel_its_limit_and_dead_letter_topic(broker_factory):
    """--max-attempts with no setting: a channel made by SUB gets its dead-letter topic with it."""
    broker = broker_factory(max_attempts=2)
    post(broker, "/pub", topic="t", content=b"poison").raise_for_status()
    with RawNSQ(broker.tcp_address) as conn:
        conn.identify()
        conn.sub("t", "c")
        conn.rdy(1)
        for attempt in (1, 2):
            [msg] = conn.expect_messages(1)
            assert msg.attempts == attempt
            conn.req(msg.id, 0)
        conn.expect_no_frame(0.3)  # not delivered a third time
    # moved at once, or a second later if its dead-letter channel's first round had not ended yet
    wait_for(lambda: channel_stats(broker, "t", "c")["dead_lettered_count"] == 1)
    assert channel_stats(broker, "t-c-dlq", "dead-letters")["depth"] == 1
    reply = broker.get("/channel/config?topic=t&channel=c").json()
    assert reply["config"] == {} and reply["effective"]["max_attempts"] == 2


def test_our_client_requeueing_a_poison_message_hands_it_to_the_broker_limit(broker_factory):
    """trio_nsq.client with its own limit off (max_attempts=0): the broker's attempt limit moves the
    message, and the consumer then sees the good messages only."""
    import trio

    from trio_nsq.client import Consumer

    broker = broker_factory()
    post(broker, "/topic/create", topic="jobs").raise_for_status()
    post(broker, "/channel/create", topic="jobs", channel="w").raise_for_status()
    post(broker, "/channel/config", topic="jobs", channel="w", max_attempts=4).raise_for_status()
    post(broker, "/mpub", topic="jobs", content=b"ok-1\npoison\nok-2").raise_for_status()
    seen: list[tuple[bytes, int]] = []

    async def consume() -> None:
        done = trio.Event()

        async def handler(message) -> None:
            seen.append((message.body, message.attempts))
            if message.body == b"poison":
                await message.requeue(delay_ms=0, backoff=False)
            if len(seen) == 6:
                done.set()

        async with Consumer("jobs", "w", handler, nsqd_tcp_addresses=[broker.tcp_address], max_attempts=0):
            with trio.fail_after(15):
                await done.wait()
            await trio.sleep(0.3)  # nothing more comes

    trio.run(consume)
    assert [a for body, a in seen if body == b"poison"] == [1, 2, 3, 4]
    assert sorted(body for body, _ in seen if body != b"poison") == [b"ok-1", b"ok-2"]
    wait_for(lambda: channel_stats(broker, "jobs-w-dlq", "dead-letters")["depth"] == 1)
    assert channel_stats(broker, "jobs", "w")["dead_lettered_count"] == 1
