"""The Trio client's connections and producers as a go-nsq or pynsq user expects them (issue 50, items 6-10
and the producer's extras): IDENTIFY's settings, heartbeat_interval first; lookupd addresses with a path;
HTTPProducer's batches with one bad body; configuration and AUTH errors at once; TLS never silently plain;
Producer.ping() and an error at once after stop; lookupd's `Authorization: Bearer`.

Against real trio-nsqd / trio-nsqlookupd processes. With NSQ_REFERENCE=<folder with Go nsqd 1.3.0> the
heartbeat test also runs against Go nsqd (the param exists only then). The default heartbeat against a
long --client-timeout takes minutes of idling: it runs in-process under trio's MockClock.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import httpx
import pytest
import trio
import trustme
from auth_server import authd  # noqa: F401  (fixture)
from processes import BrokerProcess, LookupdProcess

from trio_nsq.client import Connection, Consumer, HTTPProducer, NSQConnectionError, NSQError, Producer, tls_context
from trio_nsq.client.lookupd import lookup_producers
from trio_nsq.testing.embed import run_nsqd

REFERENCE = os.environ.get("NSQ_REFERENCE")  # the folder of Go's nsqd 1.3.0, for the "go" params


class GoNsqd(BrokerProcess):
    """Go nsqd 1.3.0 from NSQ_REFERENCE, with the same flags and ports as ours."""

    def command(self) -> list[str]:
        assert REFERENCE
        return [os.path.join(REFERENCE, "nsqd")]


BROKER_KINDS = ["trio-nsqd"] + (["go-nsqd"] if REFERENCE else [])


@pytest.fixture
def started(tmp_path):
    """``started(kind, **flags) -> BrokerProcess``: trio-nsqd or Go nsqd, stopped at teardown."""
    procs: list[BrokerProcess] = []

    def start(kind: str, **flags: object) -> BrokerProcess:
        proc = (GoNsqd if kind == "go-nsqd" else BrokerProcess)(tmp_path, **flags)
        procs.append(proc)
        return proc.start()

    yield start
    for proc in procs:
        proc.stop()


@pytest.fixture
def lookupd(tmp_path):
    proc = LookupdProcess(tmp_path).start()
    yield proc
    proc.stop()


async def topic_depth(broker: BrokerProcess, topic: str) -> int:
    async with httpx.AsyncClient() as client:
        stats = (await client.get(f"{broker.http_url}/stats", params={"format": "json", "topic": topic})).json()
    return sum(t["depth"] for t in stats["topics"] or [] if t["topic_name"] == topic)


async def nothing(message) -> None:
    pass


# --- item 7: lookupd addresses ------------------------------------------------------------------------


@pytest.mark.parametrize(("address", "url"), [
    ("127.0.0.1:4161", "http://127.0.0.1:4161/lookup?topic=t"),
    ("http://127.0.0.1:4161", "http://127.0.0.1:4161/lookup?topic=t"),
    ("http://127.0.0.1:4161/", "http://127.0.0.1:4161/lookup?topic=t"),
    ("http://127.0.0.1:4161/lookup", "http://127.0.0.1:4161/lookup?topic=t"),
    ("https://lookupd.example:8443/nsq/lookup?env=prod", "https://lookupd.example:8443/nsq/lookup?env=prod&topic=t"),
    ("https://lookupd.example/nsq/lookup", "https://lookupd.example/nsq/lookup?topic=t"),
    ("[::1]:4161", "http://[::1]:4161/lookup?topic=t"),
])
def test_a_lookupd_address_keeps_the_path_and_query_the_user_gave(address, url):
    from trio_nsq.client.lookupd import lookup_url

    assert lookup_url(address, "t") == url


def test_a_lookupd_address_without_scheme_or_port_is_refused():
    from trio_nsq.client.lookupd import lookup_url

    with pytest.raises(ValueError, match="port"):
        lookup_url("lookupd.example", "t")  # go-nsq: "missing port"; 4161 is not guessed


async def test_lookup_through_a_path_finds_the_brokers_and_a_wrong_path_is_no_answer(broker_factory, lookupd,
                                                                                    caplog):
    broker = broker_factory(lookupd_tcp_address=lookupd.tcp_address, broadcast_address="127.0.0.1")
    async with Producer(broker.tcp_address) as producer:
        await producer.pub("found", b"x")
    async with httpx.AsyncClient(timeout=5) as client:
        with trio.fail_after(10):
            while not await lookup_producers(client, lookupd.http_address, "found"):
                await trio.sleep(0.05)  # the broker registers the topic
        assert await lookup_producers(client, f"{lookupd.http_url}/lookup", "found") == [broker.tcp_address]
        # lookupd does not know the topic: none (the caller may forget brokers it had from lookupd)
        assert await lookup_producers(client, f"{lookupd.http_url}/lookup", "unknown") == []
        # a 404 that is not lookupd's TOPIC_NOT_FOUND is no answer at all: the caller keeps what it has
        assert await lookup_producers(client, f"{lookupd.http_url}/nowhere", "found") is None
        assert await lookup_producers(client, "lookupd.example", "found") is None
    assert "answered 404" in caplog.text and "missing port" in caplog.text


async def test_a_consumer_finds_brokers_through_a_lookupd_address_with_a_path(broker_factory, lookupd):
    broker = broker_factory(lookupd_tcp_address=lookupd.tcp_address, broadcast_address="127.0.0.1")
    got: list[bytes] = []

    async def handler(message) -> None:
        got.append(message.body)

    async with Producer(broker.tcp_address) as producer:
        await producer.pub("pathed", b"hello")
    async with Consumer("pathed", "c", handler, lookupd_http_addresses=[f"{lookupd.http_url}/lookup"],
                        lookupd_poll_interval=0.5) as consumer:
        with trio.fail_after(20):
            await consumer.wait_connected()
            while not got:
                await trio.sleep(0.02)
    assert got == [b"hello"]


async def test_lookupd_queries_carry_the_auth_secret_as_a_bearer_token():
    """go-nsq's LookupdAuthorization (default on): `Authorization: Bearer <auth_secret>` to lookupd."""
    seen: list[httpx.Request] = []

    def lookupd_stub(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"producers": [{"broadcast_address": "127.0.0.1", "tcp_port": 4150}]})

    async with httpx.AsyncClient(transport=httpx.MockTransport(lookupd_stub)) as client:
        assert await lookup_producers(client, "127.0.0.1:4161", "t", auth_secret="s3cret") == ["127.0.0.1:4150"]
        assert await lookup_producers(client, "127.0.0.1:4161", "t") == ["127.0.0.1:4150"]
    assert seen[0].headers["authorization"] == "Bearer s3cret"
    assert "authorization" not in seen[1].headers
