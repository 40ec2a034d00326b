"""The Trio client's connections and producers as a go-nsq or pynsq user expects them (issue 50, items 6-10
and the producer's extras): IDENTIFY's settings, heartbeat_interval first; lookupd addresses with a path;
HTTPProducer's batches with one bad body; configuration and AUTH errors at once; TLS never silently plain;
Producer.ping() and an error at once after stop; lookupd's `Authorization: Bearer`.

Against real trio-nsqd / trio-nsqlookupd processes. With NSQD_REFERENCE_BIN=<Go nsqd 1.3.0's binary> the
broker processes are Go nsqd's, as in every process-level test (tests/processes.py); the heartbeat test
then starts Go nsqd without --client-timeout, a flag Go's 1.3.0 does not have. The default heartbeat against a
long --client-timeout takes minutes of idling: it runs in-process under trio's MockClock.
"""

from __future__ import annotations

import functools
from pathlib import Path

import httpx
import pytest
import trio
import trustme
from auth_server import authd  # noqa: F401  (fixture)
from processes import REFERENCE_BIN, BrokerProcess, LookupdProcess

from trio_nsq.client import Connection, Consumer, HTTPProducer, NSQConnectionError, NSQError, Producer, tls_context
from trio_nsq.client.lookupd import lookup_producers
from trio_nsq.testing.embed import run_nsqd

@pytest.fixture
def slow_heartbeat_nsqd(tmp_path):
    """An nsqd whose own heartbeat is every 15 s or more: trio-nsqd with --client-timeout=30s, or Go nsqd
    1.3.0 under NSQD_REFERENCE_BIN (every 30 s: its ClientTimeout has no flag)."""
    proc = BrokerProcess(tmp_path) if REFERENCE_BIN else BrokerProcess(tmp_path, client_timeout="30s")
    yield proc.start()
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


# --- item 6: IDENTIFY's settings ----------------------------------------------------------------------


async def test_an_idle_connection_lives_on_the_heartbeat_it_asked_for(slow_heartbeat_nsqd):
    """The client reads with a timeout of twice its heartbeat_interval (4 s here); the broker's own
    heartbeat is every 15 s or more, so an idle connection lives only if IDENTIFY asked for 2 s."""
    broker = slow_heartbeat_nsqd
    async with Producer(broker.tcp_address, heartbeat_interval=2.0) as producer:
        await producer.pub("idle", b"x")
        first = producer.conn
        async with Consumer("idle", "c", nothing, nsqd_tcp_addresses=[broker.tcp_address],
                            heartbeat_interval=2.0) as consumer:
            await consumer.wait_connected()
            subscribed = consumer.connections[broker.tcp_address]
            await trio.sleep(7)  # idle: the broker heartbeats 3 times, the client answers NOP
            assert consumer.connections.get(broker.tcp_address) is subscribed and not subscribed.is_closed
        assert producer.conn is first and producer.connects == 1
        await producer.pub("idle", b"y")


async def test_the_default_heartbeat_keeps_a_connection_to_a_broker_with_a_long_client_timeout(autojump_clock,
                                                                                               tmp_path):
    """nsqd --client-timeout=150s heartbeats every 75 s to a client that asks for nothing; the client
    reads with a timeout of twice the heartbeat it asks for (30 s by default, as go-nsq and pynsq), so it
    must ask. 200 s of idling under MockClock, with an nsqd in-process."""
    async with trio.open_nursery() as nursery:
        nsqd = await nursery.start(functools.partial(run_nsqd, client_timeout=150.0, data_path=str(tmp_path)))
        async with Producer(nsqd.tcp_address) as producer:
            await producer.pub("t", b"x")
            await trio.sleep(200)
            await producer.pub("t", b"y")
        nursery.cancel_scope.cancel()
    assert producer.connects == 1


async def test_identify_settings_reach_nsqd_as_connect_options(broker_factory):
    broker = broker_factory()
    settings = dict(heartbeat_interval=5.0, output_buffer_size=32768, output_buffer_timeout=0.1, sample_rate=50,
                    msg_timeout=5.0)
    async with Producer(broker.tcp_address, **settings) as producer:
        await producer.pub("s", b"x")
        assert producer.conn is not None
        identify, features = producer.conn.identify_data, producer.conn.features
        assert (identify["heartbeat_interval"], identify["output_buffer_timeout"], identify["msg_timeout"]) \
            == (5000, 100, 5000)  # IDENTIFY's unit: ms
        assert (features["output_buffer_size"], features["output_buffer_timeout"], features["sample_rate"],
                features["msg_timeout"]) == (32768, 100, 50, 5000)
        assert producer.conn.read_timeout == 10.0
    async with Consumer("s", "c", nothing, nsqd_tcp_addresses=[broker.tcp_address], **settings) as consumer:
        await consumer.wait_connected()
        assert consumer.connections[broker.tcp_address].msg_timeout == 5000


def test_identify_settings_out_of_range_fail_at_construction():
    for bad in ({"sample_rate": 100}, {"sample_rate": -1}, {"heartbeat_interval": 0.5}, {"msg_timeout": -1.0},
                {"output_buffer_size": 10}):
        with pytest.raises(ValueError):
            Producer("127.0.0.1:4150", **bad)
    # -1 turns heartbeats off (nsqd's and go-nsq's value): no read timeout then
    assert Producer("127.0.0.1:4150", heartbeat_interval=-1).connect("127.0.0.1:4150").read_timeout is None


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


# --- item 8: HTTPProducer with one message too big --------------------------------------------------


async def test_http_producer_one_body_too_big_fails_alone(broker_factory):
    broker = broker_factory(max_msg_size=100)
    async with HTTPProducer(broker.http_address, batch_size=500, flush_interval=60) as hp:
        good = [await hp.pub("t", b"good %d" % i) for i in range(100)]
        bad = await hp.pub("t", b"x" * 101)
        good += [await hp.pub("t", b"good %d" % i) for i in range(100, 200)]
        with pytest.raises(NSQError) as err:
            await hp.flush()  # one batch of 201: nsqd refuses it whole, the producer splits it
        assert err.value.code == "MSG_TOO_BIG" and err.value.status == 413
        assert await topic_depth(broker, "t") == 200
        assert (hp.published, hp.failed) == (200, 1)
        with pytest.raises(NSQError) as own:
            await bad.wait()  # the caller that sent the bad body gets its error ...
        assert own.value.code == "MSG_TOO_BIG" and isinstance(bad.error, NSQError) and bad.error.code == "MSG_TOO_BIG"
        for receipt in good:
            await receipt.wait()  # ... the others none
        later = await hp.pub("t", b"later")  # an unrelated pub after the failure does not raise it
        await hp.flush()
        await later.wait()
    assert await topic_depth(broker, "t") == 201


# --- item 9: configuration, IDENTIFY and AUTH errors at once ----------------------------------------


def test_snappy_and_deflate_together_fail_at_construction():
    with pytest.raises(ValueError, match="snappy"):
        Producer("127.0.0.1:4150", snappy=True, deflate=True)
    with pytest.raises(ValueError, match="snappy"):
        Consumer("t", "c", nothing, nsqd_tcp_addresses=["127.0.0.1:4150"], snappy=True, deflate=True)
    with pytest.raises(ValueError, match="snappy"):
        Connection("127.0.0.1:4150", snappy=True, deflate=True)
    # the tools' --producer-opt/--consumer-opt (go-nsq's ConfigFlag) refuse the pair as a bad flag
    from trio_nsq.apps.app import ConfigError, parse_config_opts

    with pytest.raises(ConfigError, match="snappy"):
        parse_config_opts(["snappy", "deflate"], consumer=False)


async def test_a_refused_identify_raises_at_once(broker_factory):
    """nsqd refuses a heartbeat over its --max-heartbeat-interval (E_BAD_BODY): the publish gets that
    error, not a wrapped one after reconnect_timeout."""
    broker = broker_factory(max_heartbeat_interval="10s")
    async with Producer(broker.tcp_address, identify={"heartbeat_interval": 20_000}, reconnect_timeout=10) as producer:
        with pytest.raises(NSQError) as err:
            await producer.pub("t", b"x")
        assert err.value.code == "E_BAD_BODY" and "heartbeat" in err.value.description
        with pytest.raises(NSQError):
            await producer.ping()
    assert producer.connects == 0


async def test_a_refused_auth_raises_at_once(broker_factory, authd):
    broker = broker_factory(auth_http_address=authd.address)
    authd.answer("wrong", 403, b'{"message": "no"}')
    async with Producer(broker.tcp_address, auth_secret="wrong", reconnect_timeout=10) as producer:
        with pytest.raises(NSQError) as err:
            await producer.pub("t", b"x")
        assert err.value.code == "E_AUTH_FAILED"
    async with Producer(broker.tcp_address, reconnect_timeout=10) as producer:  # no secret at all
        with pytest.raises(NSQError) as err:
            await producer.pub("t", b"x")
        assert err.value.code == "E_AUTH_REQUIRED"


# --- item 10: TLS asked for, broker without TLS -------------------------------------------------------


async def test_tls_against_a_broker_without_tls_is_refused(broker_factory):
    broker = broker_factory()
    tls = tls_context(verify=False)
    with pytest.raises(NSQError, match="does not offer TLS"):
        async with Connection(broker.tcp_address, tls=tls):
            pass
    async with Producer(broker.tcp_address, tls=tls, reconnect_timeout=10) as producer:
        with pytest.raises(NSQError, match="does not offer TLS"):
            await producer.pub("plain", b"secret")
    assert await topic_depth(broker, "plain") == 0


async def test_a_certificate_refused_raises_at_once(broker_factory, tmp_path):
    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(tmp_path / "server.pem")
    broker = broker_factory(tls_cert=tmp_path / "server.pem", tls_key=tmp_path / "server.pem")
    async with Producer(broker.tcp_address, tls=tls_context(), reconnect_timeout=10) as producer:  # system CAs
        with pytest.raises(NSQConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            await producer.pub("t", b"x")


# --- extras: ping, stopped ----------------------------------------------------------------------------


async def test_ping_connects_or_raises(broker_factory, tmp_path: Path):
    broker = broker_factory()
    async with Producer(broker.tcp_address) as producer:
        await producer.ping()
        assert producer.connects == 1
    async with Producer(BrokerProcess(tmp_path).tcp_address, reconnect_timeout=0.5) as producer:  # nobody there
        with pytest.raises(NSQConnectionError):
            await producer.ping()


async def test_a_stopped_producer_raises_at_once(broker_factory):
    broker = broker_factory()
    producer = Producer(broker.tcp_address, reconnect_timeout=3)
    with pytest.raises(RuntimeError, match="not open"):
        await producer.pub("t", b"x")  # never started
    async with producer:
        await producer.pub("t", b"x")
    with pytest.raises(RuntimeError, match="not open"):
        await producer.pub("t", b"y")
    with pytest.raises(RuntimeError, match="not open"):
        await producer.ping()


async def test_a_consumer_whose_certificate_is_refused_keeps_running_and_wait_connected_says_why(
        broker_factory, tmp_path):
    """A failed TLS handshake (trio's BrokenResourceError) costs the connection attempt, not the consumer,
    and wait_connected raises it as it raises a broker's refusal."""
    from trio_nsq.client import Consumer

    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(tmp_path / "server.pem")
    broker = broker_factory(tls_cert=tmp_path / "server.pem", tls_key=tmp_path / "server.pem")

    async def handler(message):
        pass

    async with Consumer("t", "c", handler, nsqd_tcp_addresses=[broker.tcp_address], tls=tls_context()) as consumer:
        with trio.fail_after(20):
            with pytest.raises(NSQConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
                await consumer.wait_connected()
        assert not consumer.closing  # still trying, as with any refusal
