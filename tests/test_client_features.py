"""The Trio client's upgrades against trio-nsqd processes, as nsqd does them: TLS (tls_v1, then the
handshake on the same stream), snappy, deflate, AUTH with a secret, and IDENTIFY's per-client settings."""

import functools
import json

import pytest
import trio
import trustme

from auth_server import authd  # noqa: F401  (fixture)
from trio_nsq import Connection, Consumer, Producer, tls_context

EXPECTED = sorted([b"x" * 5000, b"second"])


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(d / "server.pem")
    client = ca.issue_cert("client.example", common_name="client.example")
    client.private_key_pem.write_to_path(d / "client.key")
    client.cert_chain_pems[0].write_to_path(d / "client.crt")
    ca.cert_pem.write_to_path(d / "ca.pem")
    return d


async def round_trip(address: str, topic: str, **upgrades) -> list[bytes]:
    got: list[bytes] = []
    done = trio.Event()

    async def handler(message):
        got.append(message.body)
        if len(got) == 2:
            done.set()

    async with Producer(address, **upgrades) as producer:
        await producer.pub(topic, b"x" * 5000)  # compressible, several snappy/deflate blocks' worth
        await producer.mpub(topic, [b"second"])
        async with Consumer(topic, "c", handler, nsqd_tcp_addresses=[address], max_in_flight=2, **upgrades):
            with trio.fail_after(20):
                await done.wait()
    return sorted(got)  # handlers run concurrently: arrival order is not theirs


async def test_tls_round_trip_without_client_cert(broker_factory, pki):
    broker = broker_factory(tls_cert=pki / "server.pem", tls_key=pki / "server.pem")
    assert await round_trip(broker.tcp_address, "t", tls=tls_context(ca_file=str(pki / "ca.pem"))) == EXPECTED


async def test_tls_with_client_cert_required(broker_factory, pki):
    broker = broker_factory(tls_cert=pki / "server.pem", tls_key=pki / "server.pem",
                            tls_client_auth_policy="require-verify", tls_root_ca_file=pki / "ca.pem")
    ctx = tls_context(ca_file=str(pki / "ca.pem"), cert_file=str(pki / "client.crt"),
                      key_file=str(pki / "client.key"))
    assert await round_trip(broker.tcp_address, "t", tls=ctx) == EXPECTED
    # without the certificate the same broker refuses the handshake
    with pytest.raises(trio.BrokenResourceError):  # the handshake fails: nsqd demands a certificate
        async with Connection(broker.tcp_address, tls=tls_context(ca_file=str(pki / "ca.pem"))) as conn:
            await conn.command(b"PUB t\n\x00\x00\x00\x01x")


async def test_tls_verification_off(broker_factory, pki):
    broker = broker_factory(tls_cert=pki / "server.pem", tls_key=pki / "server.pem")
    with pytest.raises(trio.BrokenResourceError):  # trio wraps the SSLCertVerificationError
        async with Connection(broker.tcp_address, tls=tls_context()):
            pass
    async with Connection(broker.tcp_address, tls=tls_context(verify=False)) as conn:
        assert conn.features["tls_v1"] is True


@pytest.mark.parametrize("codec", ["snappy", "deflate"])
async def test_compression_round_trip(broker, codec):
    assert await round_trip(broker.tcp_address, codec, **{codec: True}) == EXPECTED


async def test_tls_and_snappy_together(broker_factory, pki):
    broker = broker_factory(tls_cert=pki / "server.pem", tls_key=pki / "server.pem")
    ctx = tls_context(ca_file=str(pki / "ca.pem"))
    assert await round_trip(broker.tcp_address, "t", tls=ctx, snappy=True) == EXPECTED


async def test_auth_round_trip(broker_factory, authd):
    broker = broker_factory(auth_http_address=authd.address)
    assert await round_trip(broker.tcp_address, "orders", auth_secret="rw") == EXPECTED
    assert authd.count("rw") >= 1


async def test_identify_settings_reach_nsqd(broker):
    identify = {"sample_rate": 50, "msg_timeout": 5000, "output_buffer_size": 32768,
                "output_buffer_timeout": 100}
    async with Connection(broker.tcp_address, identify=identify) as conn:
        assert conn.features["sample_rate"] == 50
        assert conn.features["msg_timeout"] == 5000
        assert conn.msg_timeout == 5000


@pytest.mark.parametrize("codec", ["snappy", "deflate"])
async def test_the_compressed_ok_may_arrive_with_the_identify_answer(codec):
    """Go nsqd often sends its compressed OK in the same segment as the plain IDENTIFY answer (it did in
    2 of 4 runs of this file against Go nsqd): the client must hand those bytes to the new layer. A
    stand-in nsqd sends exactly that, in one write."""
    import zlib

    import cramjam

    from trio_nsq.shared.protocol import FRAME_TYPE_RESPONSE, encode_frame

    ok = encode_frame(FRAME_TYPE_RESPONSE, b"OK")
    if codec == "snappy":
        compressed_ok = bytes(cramjam.snappy.compress(ok))  # stream identifier + one framed chunk
    else:
        deflate = zlib.compressobj(6, zlib.DEFLATED, -15)
        compressed_ok = deflate.compress(ok) + deflate.flush(zlib.Z_SYNC_FLUSH)
    features = {"max_rdy_count": 2500, "msg_timeout": 60000, codec: True, "deflate_level": 6}

    async def stand_in(stream: trio.SocketStream) -> None:
        data = b""
        while len(data) < 4 + len(b"IDENTIFY\n") + 4 or len(data) < 17 + int.from_bytes(data[13:17], "big"):
            data += await stream.receive_some(65536)
        await stream.send_all(encode_frame(FRAME_TYPE_RESPONSE, json.dumps(features).encode()) + compressed_ok)
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, stand_in, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        with trio.fail_after(5):
            async with Connection(f"127.0.0.1:{port}", **{codec: True}) as conn:
                assert conn.features[codec] is True and not conn.is_closed
        nursery.cancel_scope.cancel()
