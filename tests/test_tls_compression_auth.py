"""TLS, snappy, deflate, AUTH and statsd on the real broker process (issue 8, "Must show" 1).

- Certificates are made here with trustme: a CA, a server certificate for 127.0.0.1, a client
  certificate from the same CA, and a rogue CA with a client certificate of its own.
- Whole conversations (publish and consume, messages up to 200 KB, random and compressible) go through
  third-party clients from PyPI — pynsq (tornado) and gnsq (gevent) — in subprocesses
  (tests/thirdparty_conversation.py); the raw client (tests/nsq_raw.py) is used where the exact frames
  matter.
- The auth server is a small HTTP server on loopback in a thread, answering per secret and recording
  every request it gets.
- The statsd daemon is a UDP socket in the test.

Expected texts and behaviour are nsqd's (nsqd/protocol_v2.go, internal/auth, nsqd/statsd.go, nsqd/http.go).
"""

from __future__ import annotations

import http.server
import json
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import httpx
import pytest
import trustme
from auth_server import AuthServer, authd  # noqa: F401  (authd is a fixture)
from nsq_raw import ConnectionClosed, RawNSQ, encode_mpub_body
from thirdparty_conversation import bodies, digest

from trio_nsq.shared.protocol import MAGIC_V2, FrameParser, encode_identify, encode_pub

HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------------------------
# certificates
# ---------------------------------------------------------------------------------------------


class PKI:
    def __init__(self, directory: Path):
        self.dir = directory
        ca = trustme.CA()
        rogue = trustme.CA()
        ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(directory / "server.pem")
        client = ca.issue_cert("client.example", common_name="client.example")
        client.private_key_and_cert_chain_pem.write_to_path(directory / "client.pem")
        client.private_key_pem.write_to_path(directory / "client.key")
        client.cert_chain_pems[0].write_to_path(directory / "client.crt")
        rogue.issue_cert("client.example", common_name="client.example").private_key_and_cert_chain_pem.write_to_path(
            directory / "rogue-client.pem")
        ca.cert_pem.write_to_path(directory / "ca.pem")
        rogue.cert_pem.write_to_path(directory / "rogue-ca.pem")

    def __getattr__(self, name: str) -> str:
        path = self.dir / (name.replace("_", "-") + ".pem")
        if not path.exists():
            raise AttributeError(name)
        return str(path)

    def client_context(self, *, ca: str | None = None, cert: str | None = None,
                       maximum: ssl.TLSVersion | None = None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=ca or self.ca)
        if cert:
            ctx.load_cert_chain(cert)
        if maximum:
            ctx.maximum_version = maximum
        return ctx


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    return PKI(tmp_path_factory.mktemp("pki"))


def tls_broker(broker_factory, pki: PKI, **flags):
    return broker_factory(tls_cert=pki.server, tls_key=pki.server, **flags)


def https_address(broker) -> str:
    return broker.flags["https_address"]


def tls_conn(broker, context: ssl.SSLContext, **identify) -> RawNSQ:
    """IDENTIFY with tls_v1, the handshake, then nsqd's OK, which comes inside TLS."""
    conn = RawNSQ(broker.tcp_address)
    try:
        info = conn.identify(feature_negotiation=True, tls_v1=True, **identify)
        assert info["tls_v1"] is True, info
        conn.sock = context.wrap_socket(conn.sock, server_hostname="127.0.0.1")
        conn.expect_response(b"OK")
    except BaseException:
        conn.close()
        raise
    return conn


REFUSED = (ssl.SSLError, ConnectionClosed, ConnectionError, OSError)


def assert_refused(broker, context: ssl.SSLContext) -> None:
    """The handshake fails, or the server's alert arrives on the first read (TLS 1.3): either way no OK
    and the connection ends."""
    with pytest.raises(REFUSED):
        conn = tls_conn(broker, context)
        try:
            conn.pub("never", b"x")
        finally:
            conn.close()


def stats(broker, *, topic: str | None = None, https: ssl.SSLContext | None = None) -> dict:
    query = "format=json" + (f"&topic={topic}" if topic else "")
    if https is not None:
        return httpx.get(f"https://{https_address(broker)}/stats?{query}", verify=https, timeout=5).json()
    return httpx.get(f"http://{broker.http_address}/stats?{query}", timeout=5).json()


def channel_clients(data: dict, topic: str, channel: str) -> list[dict]:
    for t in data["topics"]:
        if t["topic_name"] == topic:
            for c in t["channels"]:
                if c["channel_name"] == channel:
                    return c["clients"]
    return []


# ---------------------------------------------------------------------------------------------
# third-party conversations
# ---------------------------------------------------------------------------------------------


def converse(broker, client: str, *, topic: str, count: int = 25, seed: int = 1, scale: float = 1.0,
             conn: dict | None = None, stats_url: str | None = None, ca: str | None = None) -> dict:
    spec = {"client": client, "address": broker.tcp_address, "topic": topic, "channel": "ch", "seed": seed,
            "count": count, "scale": scale, "conn": conn or {}, "stats_url": stats_url, "ca": ca, "timeout": 30}
    proc = subprocess.run([sys.executable, str(HERE / "thirdparty_conversation.py"), json.dumps(spec)],
                          capture_output=True, text=True, timeout=60, cwd=str(HERE))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"{client} printed no result\n--- stderr:\n{proc.stderr[-4000:]}\n--- broker:\n{broker.log_text()[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def expected_digests(seed: int, count: int, scale: float = 1.0) -> list[str]:
    return sorted(digest(b) for b in bodies(seed, count, scale))


def publish_raw(conn: RawNSQ, topic: str, msgs: list[bytes]) -> None:
    small = [m for m in msgs if len(m) < 10_000]
    if small:
        conn.mpub(topic, small)
    for m in msgs:
        if len(m) >= 10_000:
            conn.pub(topic, m)


def assert_conversation(result: dict, seed: int, count: int, scale: float = 1.0) -> None:
    summary = {k: v for k, v in result.items() if k != "digests"}
    assert not result.get("timeout") and result["received"] == count, summary
    # every message arrived intact and exactly once (nothing duplicated, nothing corrupted)
    assert result["digests"] == expected_digests(seed, count, scale), summary


# ---------------------------------------------------------------------------------------------
# TLS
# ---------------------------------------------------------------------------------------------


def test_pynsq_over_tls_verifies_the_broker_certificate_and_round_trips(broker_factory, pki):
    broker = tls_broker(broker_factory, pki)
    result = converse(broker, "pynsq", topic="tls", seed=11,
                      conn={"tls_v1": True, "tls_options": {"ca_certs": pki.ca}},
                      stats_url=f"http://{broker.http_address}/stats?format=json")
    assert result["published"] and set(result["published"]) == {"OK"}, result["published"]
    assert_conversation(result, 11, 25)
    [client] = result["stats_clients"]
    assert client["tls"] is True and client["snappy"] is False and client["deflate"] is False
    assert client["tls_version"] in ("TLS1.2", "TLS1.3"), client
    assert client["tls_cipher_suite"], client
    assert broker.log_text().count("upgrading connection to TLS") >= 2


def test_gnsq_consumer_over_tls(broker_factory, pki):
    broker = tls_broker(broker_factory, pki)
    with RawNSQ(broker.tcp_address) as producer:  # TLS is offered, not required: plain still works
        publish_raw(producer, "tls-gnsq", bodies(12, 20))
    result = converse(broker, "gnsq", topic="tls-gnsq", seed=12, count=20,
                      conn={"tls_v1": True, "tls_options": {"ca_certs": pki.ca}},
                      stats_url=f"http://{broker.http_address}/stats?format=json")
    assert_conversation(result, 12, 20)
    [client] = result["stats_clients"]
    assert client["tls"] is True and client["user_agent"].startswith("gnsq/")


def test_tls_handshake_against_an_unknown_ca_fails_and_the_broker_carries_on(broker_factory, pki):
    broker = tls_broker(broker_factory, pki)
    # the client does not trust the server's certificate: the certificate really is checked
    with pytest.raises(ssl.SSLCertVerificationError):
        tls_conn(broker, pki.client_context(ca=pki.rogue_ca))
    # and a client that does trust it publishes and consumes over TLS
    with tls_conn(broker, pki.client_context()) as consumer, tls_conn(broker, pki.client_context()) as producer:
        consumer.sub("tls-raw", "ch")
        consumer.rdy(10)
        producer.pub("tls-raw", b"secret payload")
        producer.mpub("tls-raw", [b"a", b"b"])
        got = sorted(m.body for m in consumer.expect_messages(3))
        assert got == [b"a", b"b", b"secret payload"]
        assert isinstance(consumer.sock, ssl.SSLSocket) and consumer.sock.version() in ("TLSv1.2", "TLSv1.3")


def test_tls_min_version(broker_factory, pki):
    broker = tls_broker(broker_factory, pki, tls_min_version="tls1.3")
    assert_refused(broker, pki.client_context(maximum=ssl.TLSVersion.TLSv1_2))
    with tls_conn(broker, pki.client_context()) as conn:
        assert conn.sock.version() == "TLSv1.3"
        conn.pub("tls13", b"x")


def test_tls_client_certificates_require_verify(broker_factory, pki):
    broker = tls_broker(broker_factory, pki, tls_client_auth_policy="require-verify", tls_root_ca_file=pki.ca)
    # a certificate from the CA: a whole conversation works
    with tls_conn(broker, pki.client_context(cert=pki.client)) as consumer, \
            tls_conn(broker, pki.client_context(cert=pki.client)) as producer:
        consumer.sub("mtls", "ch")
        consumer.rdy(5)
        producer.pub("mtls", b"with a client certificate")
        msg = consumer.expect_message()
        assert msg.body == b"with a client certificate"
        consumer.fin(msg.id)
        https = pki.client_context(cert=pki.client)
        [client] = channel_clients(stats(broker, topic="mtls", https=https), "mtls", "ch")
        assert client["tls"] is True
    # no certificate, or one from another CA: refused
    assert_refused(broker, pki.client_context())
    assert_refused(broker, pki.client_context(cert=pki.rogue_client))
    # a client auth policy implies TLS is required (nsqd): plain commands are refused
    with RawNSQ(broker.tcp_address) as plain:
        plain.command("PUB", "mtls", body=b"x")
        assert plain.expect_error().text == "E_INVALID cannot PUB in current state (TLS required)"
        plain.expect_closed()
    # pynsq with its client certificate does a whole conversation too
    result = converse(broker, "pynsq", topic="mtls-pynsq", seed=13, count=15,
                      conn={"tls_v1": True, "tls_options": {"ca_certs": pki.ca, "certfile": str(pki.dir / "client.crt"),
                                                            "keyfile": str(pki.dir / "client.key")}})
    assert_conversation(result, 13, 15)
    assert broker.is_alive()


def test_tls_required(broker_factory, pki):
    broker = tls_broker(broker_factory, pki, tls_required=True)
    for command, params, body in [("PUB", ("req",), b"x"), ("SUB", ("req", "ch"), None), ("NOP", (), None),
                                  ("MPUB", ("req",), encode_mpub_body([b"x"])), ("RDY", ("1",), None)]:
        with RawNSQ(broker.tcp_address) as plain:
            plain.command(command, *params, body=body)
            err = plain.expect_error()
            assert err.text == f"E_INVALID cannot {command} in current state (TLS required)"
            plain.expect_closed()
    # IDENTIFY itself is allowed without TLS (it is how TLS is asked for), then PUB is still refused
    with RawNSQ(broker.tcp_address) as plain:
        info = plain.identify(feature_negotiation=True)
        assert info["tls_v1"] is False
        plain.command("PUB", "req", body=b"x")
        assert plain.expect_error().text == "E_INVALID cannot PUB in current state (TLS required)"
        plain.expect_closed()
    # plain HTTP is refused with nsqd's 403 and the HTTPS port; HTTPS serves
    port = int(https_address(broker).rsplit(":", 1)[1])
    response = httpx.post(f"http://{broker.http_address}/pub?topic=req", content=b"x", timeout=5)
    assert response.status_code == 403
    assert response.json() == {"message": "TLS_REQUIRED", "https_port": port}
    ctx = pki.client_context()
    response = httpx.post(f"https://{https_address(broker)}/pub?topic=req", content=b"over https", verify=ctx, timeout=5)
    assert (response.status_code, response.text) == (200, "OK")
    # over TLS everything works, including the message published over HTTPS
    with tls_conn(broker, pki.client_context()) as conn:
        conn.pub("req", b"over tls")
        conn.sub("req", "ch")
        conn.rdy(5)
        assert sorted(m.body for m in conn.expect_messages(2)) == [b"over https", b"over tls"]


# ---------------------------------------------------------------------------------------------
# compression
# ---------------------------------------------------------------------------------------------


# pynsq's SnappySocket keeps decompressed bytes beyond what tornado asked for in a buffer the IOLoop does
# not know about, so with big, very compressible messages a Reader stalls until more bytes arrive (the
# same with Go nsqd 1.3.0); its snappy conversation therefore uses messages up to 20 KB. The big
# multi-chunk frames are covered by test_snappy_and_deflate_streams_with_independent_codecs below.
PYNSQ_SCALE = {"snappy": 0.1, "deflate": 1.0}


@pytest.mark.parametrize("feature", [{"snappy": True}, {"deflate": True, "deflate_level": 1},
                                     {"deflate": True, "deflate_level": 6}])
def test_pynsq_compressed_conversation(broker, feature):
    """Publish (one MPUB of the small messages, a PUB each for the big ones) and consume through pynsq,
    with the connection upgraded to snappy or deflate both ways."""
    name = "snappy" if "snappy" in feature else "deflate"
    scale = PYNSQ_SCALE[name]
    result = converse(broker, "pynsq", topic="compressed", seed=21, count=30, scale=scale, conn=feature,
                      stats_url=f"http://{broker.http_address}/stats?format=json")
    assert set(result["published"]) == {"OK"}, result["published"]
    assert_conversation(result, 21, 30, scale)
    [client] = result["stats_clients"]
    assert client[name] is True and client["snappy" if name == "deflate" else "deflate"] is False, client
    assert client["message_count"] == 30 and client["finish_count"] == 30
    if name == "deflate":
        assert f"upgrading connection to deflate (level {feature['deflate_level']})" in broker.log_text()


def _snappy_codec():
    import snappy  # python-snappy: the codec pynsq and gnsq use, independent of the broker's cramjam

    return snappy.StreamCompressor(), snappy.StreamDecompressor()


class _Deflate:
    """Raw deflate as go-nsq and pynsq speak it: wbits -15, a sync flush after every write."""

    def __init__(self, level: int) -> None:
        import zlib

        self._c = zlib.compressobj(level, zlib.DEFLATED, -15)
        self._d = zlib.decompressobj(-15)
        self._flush = zlib.Z_SYNC_FLUSH

    def compress(self, data: bytes) -> bytes:
        return self._c.compress(data) + self._c.flush(self._flush)

    def decompress(self, data: bytes) -> bytes:
        return self._d.decompress(data)


@pytest.mark.parametrize("feature", ["snappy", "deflate"])
def test_snappy_and_deflate_streams_with_independent_codecs(broker, feature):
    """Messages up to 1 MB (max-msg-size), many snappy chunks each, decoded by python-snappy / zlib from a
    raw socket: the broker's framing is the standard one, whatever the reader's buffer sizes."""
    msgs = bodies(41, 20) + [b"max:" + b"m" * (1024 * 1024 - 4), b"rnd:" + bytes(range(256)) * 3000]
    with RawNSQ(broker.tcp_address) as producer:
        publish_raw(producer, "codec", msgs)
    sock = socket.create_connection(("127.0.0.1", broker.tcp_port), timeout=10)
    with sock:
        body = json.dumps({"feature_negotiation": True, feature: True, "heartbeat_interval": 5000}).encode()
        sock.sendall(b"  V2IDENTIFY\n" + len(body).to_bytes(4, "big") + body)
        raw = bytearray()
        while len(raw) < 4 or len(raw) < 4 + int.from_bytes(raw[:4], "big"):
            raw += sock.recv(65536)
        size = int.from_bytes(raw[:4], "big")
        assert json.loads(bytes(raw[8:4 + size]))[feature] is True
        raw = raw[4 + size:]  # the rest is already in the new encoding
        if feature == "snappy":
            encoder, decoder = _snappy_codec()
        else:
            encoder = decoder = _Deflate(6)
        sock.sendall(encoder.compress(b"SUB codec ch\nRDY 100\n"))
        plain = bytearray(decoder.decompress(bytes(raw)))
        frames, finished = [], 0
        deadline = time.monotonic() + 20
        while finished < len(msgs) and time.monotonic() < deadline:
            while len(plain) >= 4 and len(plain) >= 4 + int.from_bytes(plain[:4], "big"):
                size = int.from_bytes(plain[:4], "big")
                kind, data = int.from_bytes(plain[4:8], "big"), bytes(plain[8:4 + size])
                del plain[:4 + size]
                frames.append((kind, data))
                if kind == 2:
                    sock.sendall(encoder.compress(b"FIN " + data[10:26] + b"\n"))
                    finished += 1
            if finished < len(msgs):
                plain += decoder.decompress(sock.recv(1 << 20))
    assert [d for k, d in frames if k != 2] == [b"OK", b"OK"]  # the upgrade's OK, then SUB's
    got = sorted(digest(d[26:]) for k, d in frames if k == 2)
    assert got == sorted(digest(m) for m in msgs)
    [client] = channel_clients(stats(broker, topic="codec"), "codec", "ch") or [{}]  # gone once closed
    assert broker.is_alive()


@pytest.mark.parametrize("feature", [{"snappy": True}, {"deflate": True}])
def test_gnsq_compressed_consumer(broker, feature):
    with RawNSQ(broker.tcp_address) as producer:
        publish_raw(producer, "gz", bodies(22, 20))
    result = converse(broker, "gnsq", topic="gz", seed=22, count=20, conn=feature,
                      stats_url=f"http://{broker.http_address}/stats?format=json")
    assert_conversation(result, 22, 20)
    [client] = result["stats_clients"]
    assert client["snappy" if "snappy" in feature else "deflate"] is True


def test_pynsq_tls_and_snappy_together(broker_factory, pki):
    broker = tls_broker(broker_factory, pki)
    # pynsq's SnappySocket over its SSL socket stalls on anything but small messages (and does not work
    # against Go nsqd 1.3.0 at all): messages up to 2 KB here
    result = converse(broker, "pynsq", topic="tls-snappy", seed=23, count=20, scale=0.01,
                      conn={"tls_v1": True, "tls_options": {"ca_certs": pki.ca}, "snappy": True},
                      stats_url=f"http://{broker.http_address}/stats?format=json")
    assert_conversation(result, 23, 20, 0.01)
    [client] = result["stats_clients"]
    assert client["tls"] is True and client["snappy"] is True
    # nsqd reports the TLS version and cipher of every TLS connection, compressed or not
    assert client["tls_version"] in ("TLS1.2", "TLS1.3"), client
    assert client["tls_cipher_suite"], client


def test_compression_negotiation_rules(broker_factory):
    broker = broker_factory(max_deflate_level=3)
    with RawNSQ(broker.tcp_address) as conn:
        conn.command("IDENTIFY", body=json.dumps({"feature_negotiation": True, "snappy": True, "deflate": True}).encode())
        err = conn.expect_error()
        assert err.text == "E_IDENTIFY_FAILED cannot enable both deflate and snappy compression"
        conn.expect_closed()
    with RawNSQ(broker.tcp_address) as conn:
        # a level above --max-deflate-level is lowered to it; the OK then comes deflated
        conn.command("IDENTIFY", body=json.dumps({"feature_negotiation": True, "deflate": True, "deflate_level": 9}).encode())
        info = json.loads(conn.expect_response())
        assert (info["deflate"], info["deflate_level"], info["max_deflate_level"]) == (True, 3, 3)
    off = broker_factory(snappy="false", deflate="false")
    with RawNSQ(off.tcp_address) as conn:
        info = conn.identify(feature_negotiation=True, snappy=True)
        assert info["snappy"] is False and info["deflate"] is False
        conn.pub("plain", b"still plain")  # nothing was upgraded
    with RawNSQ(off.tcp_address) as conn:
        info = conn.identify(feature_negotiation=True, deflate=True)
        assert info["deflate"] is False
        conn.pub("plain", b"still plain")


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything the broker sends until it closes the connection; fails if it is still open after timeout."""
    data = bytearray()
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"connection still open after {timeout}s ({len(data)} bytes read)"
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return bytes(data)
        if not chunk:
            return bytes(data)
        data += chunk


@pytest.mark.parametrize("feature, garbage", [
    ("snappy", b"\xff\x06\x00\x00sNaPpY\x00\x10\x00\x00" + b"\x00" * 16),  # a chunk whose CRC is wrong
    ("snappy", b"\x00\x00\x00\x00"),  # data before the stream identifier
    ("snappy", b"\xff\x06\x00\x00sNaPpY\x01\xff\xff\xff" + b"x" * 100),  # a chunk longer than allowed
    ("deflate", b"\xff" * 64),  # not a deflate stream
])
def test_garbage_after_a_compression_upgrade_ends_only_that_connection(broker, feature, garbage):
    with socket.create_connection(("127.0.0.1", broker.tcp_port), timeout=5) as sock:
        body = json.dumps({"feature_negotiation": True, feature: True}).encode()
        sock.sendall(b"  V2IDENTIFY\n" + len(body).to_bytes(4, "big") + body + garbage)
        read_until_closed(sock, timeout=5)
    with RawNSQ(broker.tcp_address) as conn:
        conn.pub("after-garbage", b"fine")
    assert broker.is_alive()
    assert "internal error" not in broker.log_text()


# ---------------------------------------------------------------------------------------------
# AUTH
# ---------------------------------------------------------------------------------------------


def authed(broker, secret: str) -> RawNSQ:
    conn = RawNSQ(broker.tcp_address)
    conn.command("AUTH", body=secret.encode())
    answer = json.loads(conn.expect_response())
    assert answer["identity"] == secret, answer
    return conn


def test_auth_required_before_anything(broker_factory, authd):
    broker = broker_factory(auth_http_address=authd.address)
    with RawNSQ(broker.tcp_address) as conn:
        assert conn.identify(feature_negotiation=True)["auth_required"] is True
    for command, params, body in [("PUB", ("orders",), b"x"), ("MPUB", ("orders",), encode_mpub_body([b"x"])),
                                  ("DPUB", ("orders", "10"), b"x"), ("SUB", ("orders", "ch"), None)]:
        with RawNSQ(broker.tcp_address) as conn:
            conn.command(command, *params, body=body)
            assert conn.expect_error().text == f"E_AUTH_FIRST AUTH required before {command}"
            conn.expect_closed()
    assert authd.requests == []  # nothing to ask before AUTH


def test_auth_allows_and_denies(broker_factory, authd):
    broker = broker_factory(auth_http_address=authd.address)
    with authed(broker, "rw") as consumer, authed(broker, "rw") as producer:
        # the answer to AUTH: identity, identity_url, how many authorizations
        consumer.sub("orders", "any-channel")
        consumer.rdy(10)
        producer.pub("orders", b"one")
        producer.mpub("orders", [b"two", b"three"])
        producer.dpub("orders.eu", 10, b"four")  # another topic the regex allows
        assert sorted(m.body for m in consumer.expect_messages(3)) == [b"one", b"three", b"two"]
        client = channel_clients(stats(broker, topic="orders"), "orders", "any-channel")[0]
        assert client["authed"] is True and client["auth_identity"] == "rw"
        assert client["auth_identity_url"] == "http://id.example/rw"
        # a topic outside the authorization: fatal E_UNAUTHORIZED with nsqd's text
        producer.command("PUB", "payments", body=b"x")
        assert producer.expect_error().text == 'E_UNAUTHORIZED AUTH failed for PUB on "payments" ""'
        producer.expect_closed()
    first = authd.last("rw")
    assert first["method"] == "GET" and first["path"] == "/auth"
    assert first["params"] == {"remote_ip": "127.0.0.1", "tls": "false", "secret": "rw", "common_name": ""}
    assert first["accept"] == "application/vnd.nsq; version=1.0"
    assert authd.count("rw") == 2  # one AUTH per connection, no more within the TTL

    with authed(broker, "pub-only") as conn:  # publish permission does not let a client SUB
        conn.command("SUB", "orders", "ch")
        assert conn.expect_error().text == 'E_UNAUTHORIZED AUTH failed for SUB on "orders" "ch"'
        conn.expect_closed()
    with authed(broker, "sub-only") as conn:  # a channel outside the regexes
        conn.command("SUB", "orders", "shipping")
        assert conn.expect_error().text == 'E_UNAUTHORIZED AUTH failed for SUB on "orders" "shipping"'
    with authed(broker, "sub-only") as conn:  # subscribe permission does not let a client PUB
        conn.command("PUB", "orders", body=b"x")
        assert conn.expect_error().text == 'E_UNAUTHORIZED AUTH failed for PUB on "orders" ""'
    with authed(broker, "sub-only") as conn:
        conn.sub("orders", "billing")
    with RawNSQ(broker.tcp_address) as conn:
        conn.command("AUTH", body=b"none")
        assert conn.expect_error().text == "E_UNAUTHORIZED AUTH no authorizations found"
        conn.expect_closed()
    with authed(broker, "rw") as conn:  # AUTH twice
        conn.command("AUTH", body=b"rw")
        assert conn.expect_error().text == "E_INVALID AUTH already set"
    assert broker.is_alive()


def test_auth_server_failures_give_auth_failed(broker_factory, authd):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed
    down = broker_factory(auth_http_address=dead)
    with RawNSQ(down.tcp_address) as conn:
        conn.command("AUTH", body=b"rw")
        assert conn.expect_error(timeout=10).text == "E_AUTH_FAILED AUTH failed"
        conn.expect_closed()
    broker = broker_factory(auth_http_address=authd.address)
    authd.answer("500", 500, b"oops")
    authd.answer("junk", 200, b"{not json")
    authd.answer("ttl0", 200, json.dumps({"ttl": 0, "authorizations": [
        {"topic": ".*", "channels": [".*"], "permissions": ["publish"]}]}).encode())
    authd.answer("perm", 200, json.dumps({"ttl": 60, "authorizations": [
        {"topic": ".*", "channels": [".*"], "permissions": ["admin"]}]}).encode())
    for secret in ("500", "junk", "ttl0", "perm"):
        with RawNSQ(broker.tcp_address) as conn:
            conn.command("AUTH", body=secret.encode())
            assert conn.expect_error().text == "E_AUTH_FAILED AUTH failed", secret  # no detail leaks
            conn.expect_closed()
    assert down.is_alive() and broker.is_alive()
    assert "AUTH failed" in broker.log_text()  # the detail goes to the log instead


def test_auth_ttl_expiry_asks_the_server_again(broker_factory, authd):
    broker = broker_factory(auth_http_address=authd.address)
    authd.allow("short", [{"topic": ".*", "channels": [".*"], "permissions": ["publish"]}], ttl=1)
    with authed(broker, "short") as conn:
        assert authd.count("short") == 1
        for i in range(20):  # within the TTL: the cached answer is used
            conn.pub("ttl", b"%d" % i)
        assert authd.count("short") == 1
        time.sleep(1.3)
        conn.pub("ttl", b"after expiry")  # expired: asked again, still allowed
        assert authd.count("short") == 2
        conn.pub("ttl", b"cached again")
        assert authd.count("short") == 2
        # the server now denies: after the next expiry the client is refused
        authd.allow("short", [{"topic": "^other$", "channels": [".*"], "permissions": ["publish"]}], ttl=1)
        time.sleep(1.3)
        conn.command("PUB", "ttl", body=b"denied now")
        assert conn.expect_error().text == 'E_UNAUTHORIZED AUTH failed for PUB on "ttl" ""'
        assert authd.count("short") == 3
    # the server is gone when the TTL ends: E_AUTH_FAILED
    authd.allow("short", [{"topic": ".*", "channels": [".*"], "permissions": ["publish"]}], ttl=1)
    with authed(broker, "short") as conn:
        authd.httpd.shutdown()
        authd.httpd.server_close()
        time.sleep(1.3)
        conn.command("PUB", "ttl", body=b"x")
        assert conn.expect_error(timeout=10).text == "E_AUTH_FAILED AUTH failed"


def test_auth_post_method(broker_factory, authd):
    broker = broker_factory(auth_http_address=authd.address, auth_http_request_method="post")
    with authed(broker, "rw") as conn:
        conn.pub("orders", b"x")
    request = authd.last("rw")
    assert request["method"] == "POST" and request["path"] == "/auth"
    assert request["content_type"] == "application/json"
    assert request["params"] == {"remote_ip": "127.0.0.1", "tls": "false", "secret": "rw", "common_name": ""}


def test_auth_over_tls_sends_the_client_certificate_common_name(broker_factory, pki, authd):
    broker = tls_broker(broker_factory, pki, tls_client_auth_policy="require-verify", tls_root_ca_file=pki.ca,
                        auth_http_address=authd.address)
    with tls_conn(broker, pki.client_context(cert=pki.client)) as conn:
        conn.command("AUTH", body=b"rw")
        assert json.loads(conn.expect_response())["permission_count"] == 1
        conn.pub("orders", b"x")
    assert authd.last("rw")["params"] == {"remote_ip": "127.0.0.1", "tls": "true", "secret": "rw",
                                          "common_name": "client.example"}


def test_pynsq_with_auth_secret(broker_factory, authd):
    broker = broker_factory(auth_http_address=authd.address)
    result = converse(broker, "pynsq", topic="orders-pynsq", seed=31, count=15, conn={"auth_secret": "rw"},
                      stats_url=f"http://{broker.http_address}/stats?format=json")
    assert_conversation(result, 31, 15)
    [client] = result["stats_clients"]
    assert client["authed"] is True and client["auth_identity"] == "rw"
    assert authd.count("rw") >= 2  # the Writer's connection and the Reader's


# ---------------------------------------------------------------------------------------------
# statsd and end-to-end latency percentiles
# ---------------------------------------------------------------------------------------------

STATSD_LINE = re.compile(r"^(?P<name>[A-Za-z0-9_.#:-]+):(?P<value>-?\d+)\|(?P<kind>c|g)$")


class StatsdListener:
    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.packets: list[bytes] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def collect_until(self, predicate, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not predicate(self):
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                self.packets.append(self.sock.recv(65536))
            except socket.timeout:
                break

    def lines(self) -> list[str]:
        return [ln for p in self.packets for ln in p.decode().split("\n") if ln]

    def values(self, name: str) -> list[tuple[int, str]]:
        out = []
        for line in self.lines():
            m = STATSD_LINE.match(line)
            assert m, f"not a statsd line: {line!r}"
            if m["name"] == name:
                out.append((int(m["value"]), m["kind"]))
        return out

    def counter_total(self, name: str) -> int:
        values = self.values(name)
        assert all(kind == "c" for _, kind in values), values
        return sum(v for v, _ in values)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def statsd():
    listener = StatsdListener()
    yield listener
    listener.close()


def test_statsd_lines(broker_factory, statsd):
    broker = broker_factory(statsd_address=statsd.address, statsd_interval="1s", broadcast_address="127.0.0.1",
                            statsd_udp_packet_size=200)
    prefix = f"nsq.127_0_0_1_{broker.http_port}."
    t, c = prefix + "topic.st", prefix + "topic.st.channel.ch"
    with RawNSQ(broker.tcp_address) as consumer, RawNSQ(broker.tcp_address) as producer:
        consumer.identify(heartbeat_interval=5000)
        consumer.sub("st", "ch")
        consumer.rdy(10)
        for i in range(7):
            producer.pub("st", b"12345")
        msgs = consumer.expect_messages(7)
        for m in msgs[:4]:
            consumer.fin(m.id)
        consumer.req(msgs[4].id, 0)
        # three stay in flight: the gauges show it while the counters add up to what happened
        statsd.collect_until(lambda s: (3, "g") in s.values(c + ".in_flight_count")
                             and (1, "g") in s.values(c + ".clients")
                             and s.counter_total(t + ".message_count") == 7
                             and s.counter_total(c + ".requeue_count") == 1, timeout=8)
        assert (3, "g") in statsd.values(c + ".in_flight_count")
        assert statsd.counter_total(t + ".message_count") == 7
        assert statsd.counter_total(t + ".message_bytes") == 35
        assert statsd.counter_total(c + ".requeue_count") == 1
        assert (1, "g") in statsd.values(c + ".clients")
        for gauge in (t + ".depth", t + ".backend_depth", c + ".depth", c + ".backend_depth", c + ".deferred_count"):
            assert statsd.values(gauge) and all(kind == "g" for _, kind in statsd.values(gauge)), gauge
    # counters are sent as differences: once nothing happens they push 0 again
    statsd.packets.clear()
    statsd.collect_until(lambda s: len(s.values(t + ".message_count")) >= 1, timeout=4)
    assert statsd.values(t + ".message_count") == [(0, "c")]
    # every line is well-formed and every datagram respects --statsd-udp-packet-size
    assert all(len(p) <= 200 for p in statsd.packets), [len(p) for p in statsd.packets]
    assert all(ln.startswith(prefix) and STATSD_LINE.match(ln) for ln in statsd.lines())


def test_statsd_packets_are_newline_terminated_lines_as_nsqd_sends(broker_factory, statsd):
    """nsqd's statsd client writes "prefix.stat:value|type\\n" for every line, so every datagram ends
    with a newline (checked against Go nsqd 1.3.0)."""
    broker_factory(statsd_address=statsd.address, statsd_interval="1s", broadcast_address="127.0.0.1")
    statsd.collect_until(lambda s: len(s.packets) >= 1, timeout=4)
    assert statsd.packets
    assert all(p.endswith(b"\n") for p in statsd.packets), statsd.packets[:2]


def test_statsd_prefix_and_ephemeral_exclusion(broker_factory, statsd):
    broker = broker_factory(statsd_address=statsd.address, statsd_interval="1s", broadcast_address="127.0.0.1",
                            statsd_prefix="app.%s.nsqd", statsd_exclude_ephemeral=True)
    with RawNSQ(broker.tcp_address) as consumer, RawNSQ(broker.tcp_address) as producer:
        consumer.sub("eph#ephemeral", "ch")
        producer.pub("eph#ephemeral", b"x")
        producer.pub("kept", b"x")
        statsd.collect_until(lambda s: any(".topic.kept.message_count:" in ln for ln in s.lines()), timeout=4)
    lines = statsd.lines()
    assert any(ln.startswith(f"app.127_0_0_1_{broker.http_port}.nsqd.topic.kept.message_count:") for ln in lines), lines
    assert not any("ephemeral" in ln for ln in lines), [ln for ln in lines if "ephemeral" in ln]


def test_e2e_processing_latency_percentiles(broker_factory, statsd):
    broker = broker_factory(statsd_address=statsd.address, statsd_interval="1s", broadcast_address="127.0.0.1",
                            e2e_processing_latency_percentile="0.99,0.5")
    prefix = f"nsq.127_0_0_1_{broker.http_port}."
    with RawNSQ(broker.tcp_address) as producer:
        producer.mpub("e2e", [b"%d" % i for i in range(20)])
    held = 0.4
    time.sleep(held)  # the messages wait 0.4 s before anyone consumes them
    with RawNSQ(broker.tcp_address) as consumer:
        consumer.identify(heartbeat_interval=5000)
        consumer.sub("e2e", "ch")
        consumer.rdy(20)
        for m in consumer.expect_messages(20):
            consumer.fin(m.id)
        consumer.nop()

        def latency(s, name):
            return [v for v, kind in s.values(prefix + name) if kind == "g" and v > 0]

        statsd.collect_until(lambda s: latency(s, "topic.e2e.channel.ch.e2e_processing_latency_99")
                             and latency(s, "topic.e2e.e2e_processing_latency_50"), timeout=8)
        # nanoseconds from publish to FIN: at least the time they were held, and not absurd
        for name in ("topic.e2e.channel.ch.e2e_processing_latency_99", "topic.e2e.channel.ch.e2e_processing_latency_50",
                     "topic.e2e.e2e_processing_latency_99", "topic.e2e.e2e_processing_latency_50"):
            values = latency(statsd, name)
            assert values, (name, statsd.lines())
            assert held * 1e9 <= values[-1] < 30e9, (name, values)
        data = stats(broker, topic="e2e")
    [topic] = data["topics"]
    [channel] = topic["channels"]
    e2e = channel["e2e_processing_latency"]
    assert e2e["count"] == 20
    assert [p["quantile"] for p in e2e["percentiles"]] == [0.99, 0.5]
    assert all(held * 1e9 <= p["value"] < 30e9 for p in e2e["percentiles"]), e2e
    assert topic["e2e_processing_latency"]["count"] == 20


# --- more cases (merged from the first generation of these tests) ----------------------------------

PYNSQ_ROUND_TRIP = r'''
import json, sys, ssl
import tornado.ioloop, nsq
spec = json.loads(sys.argv[1])
loop = tornado.ioloop.IOLoop.current()
opts = dict(spec["opts"])
if "ca" in spec:
    tls = {"cert_reqs": ssl.CERT_REQUIRED, "ca_certs": spec["ca"]}
    if "cert" in spec:
        tls.update(certfile=spec["cert"], keyfile=spec["cert"])
    opts.update(tls_v1=True, tls_options=tls)
bodies = [b"m%03d " % i + b"payload" * 20 for i in range(spec["n"])]
got = []
result = {}
def done(**extra):
    result.update(extra)
    print("RESULT " + json.dumps(result), flush=True)
    loop.stop()
writer = nsq.Writer([spec["address"]], **opts)
def publish():
    if not any(c.connected() for c in writer.conns.values()):
        return loop.call_later(0.05, publish)
    def cb(conn, data):
        if isinstance(data, Exception):
            return done(error=repr(data))
        result["pub"] = data.decode()
        start_reader()
    writer.mpub(spec["topic"], bodies, callback=cb)
def start_reader():
    def handler(msg):
        got.append(bytes(msg.body))
        if len(got) == len(bodies):
            result["match"] = sorted(got) == sorted(bodies)
            done(count=len(got))
        return True
    nsq.Reader(spec["topic"], "ch", message_handler=handler, nsqd_tcp_addresses=[spec["address"]],
               max_in_flight=50, **opts)
loop.call_later(0.05, publish)
loop.call_later(20, lambda: done(error="timeout", count=len(got)))
loop.start()
'''


def pynsq_round_trip(broker, n: int = 200, **spec) -> dict:
    spec = {"address": broker.tcp_address, "topic": "secure", "n": n, "opts": {}, **spec}
    proc = subprocess.run([sys.executable, "-c", PYNSQ_ROUND_TRIP, json.dumps(spec)],
                          capture_output=True, text=True, timeout=40)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[-1][7:])


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client.example", common_name="client.example")
    server.private_key_and_cert_chain_pem.write_to_path(d / "server.pem")
    client.private_key_and_cert_chain_pem.write_to_path(d / "client.pem")
    ca.cert_pem.write_to_path(d / "ca.pem")
    return d


@pytest.mark.parametrize("compression", [{}, {"snappy": True}, {"deflate": True, "deflate_level": 3}])
def test_pynsq_round_trip_over_compression(broker, compression):
    result = pynsq_round_trip(broker, opts=compression)
    assert result.get("pub") == "OK" and result.get("count") == 200 and result.get("match"), result
    stderr = broker.log_text()
    for feature in compression:
        if feature in ("snappy", "deflate"):
            assert f"upgrading connection to {feature}" in stderr


def test_pynsq_over_tls_with_snappy(broker_factory, certs):
    broker = broker_factory(tls_cert=certs / "server.pem", tls_key=certs / "server.pem")
    result = pynsq_round_trip(broker, ca=str(certs / "ca.pem"), opts={"snappy": True})
    assert result.get("count") == 200 and result.get("match"), result
    assert "upgrading connection to TLS" in broker.log_text()


def _tls_identify(broker, certs, client_cert: bool) -> tuple[int, bytes]:
    sock = socket.create_connection(("127.0.0.1", broker.tcp_port), timeout=5)
    sock.sendall(MAGIC_V2 + encode_identify({"feature_negotiation": True, "tls_v1": True}))
    parser = FrameParser()
    while True:
        frames = list(parser)
        if frames:
            break
        parser.feed(sock.recv(4096))
    assert json.loads(frames[0][1])["tls_v1"] is True
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    if client_cert:
        ctx.load_cert_chain(str(certs / "client.pem"))
    tls = ctx.wrap_socket(sock, server_hostname="127.0.0.1")
    tls.sendall(encode_pub("tls", b"x"))
    parser = FrameParser()
    out = []
    while len(out) < 2:
        data = tls.recv(4096)
        if not data:
            break
        parser.feed(data)
        out.extend(parser)
    tls.close()
    return out


def test_tls_client_certificates_required(broker_factory, certs):
    broker = broker_factory(tls_cert=certs / "server.pem", tls_key=certs / "server.pem",
                            tls_client_auth_policy="require-verify", tls_root_ca_file=certs / "ca.pem")
    assert _tls_identify(broker, certs, client_cert=True) == [(0, b"OK"), (0, b"OK")]
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        result = _tls_identify(broker, certs, client_cert=False)
        assert result[:1] != [(0, b"OK")]
        raise ConnectionError(result)
    assert broker.is_alive()


def test_tls_required_refuses_plain_commands(broker_factory, certs):
    broker = broker_factory(tls_cert=certs / "server.pem", tls_key=certs / "server.pem", tls_required=True)
    with RawNSQ(broker.tcp_address) as plain:
        plain.command("PUB", "t", body=b"x")
        err = plain.expect_error()
        assert err.text == "E_INVALID cannot PUB in current state (TLS required)"
        plain.expect_closed()


class _AuthServer(http.server.ThreadingHTTPServer):
    requests: list[dict]


def _auth_handler(answers):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            query = {k: v[0] for k, v in urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query).items()}
            self.server.requests.append(query)
            body = json.dumps(answers.get(query.get("secret"), {"ttl": 60, "authorizations": []})).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    return Handler


@pytest.fixture
def auth_server():
    answers = {
        "good": {"ttl": 1, "identity": "alice", "identity_url": "http://id/alice",
                 "authorizations": [{"topic": "^allowed", "channels": [".*"], "permissions": ["publish", "subscribe"]}]},
    }
    server = _AuthServer(("127.0.0.1", 0), _auth_handler(answers))
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


def test_auth(broker_factory, auth_server):
    broker = broker_factory(auth_http_address=f"127.0.0.1:{auth_server.server_address[1]}")
    with RawNSQ(broker.tcp_address) as c:
        info = c.identify(feature_negotiation=True)
        assert info["auth_required"] is True
        c.command("PUB", "allowed", body=b"x")
        assert c.expect_error().text == "E_AUTH_FIRST AUTH required before PUB"
    with RawNSQ(broker.tcp_address) as c:
        c.command("AUTH", body=b"good")
        answer = json.loads(c.expect_response())
        assert answer == {"identity": "alice", "identity_url": "http://id/alice", "permission_count": 1}
        c.command("PUB", "allowed", body=b"x")
        c.expect_response(b"OK")
        import time

        time.sleep(1.2)  # ttl 1 s: the next check asks the server again
        c.command("PUB", "allowed_too", body=b"y")
        c.expect_response(b"OK")
        c.command("PUB", "other", body=b"x")
        assert c.expect_error().text == 'E_UNAUTHORIZED AUTH failed for PUB on "other" ""'
    assert [r["secret"] for r in auth_server.requests] == ["good", "good"]
    assert auth_server.requests[0]["tls"] == "false" and auth_server.requests[0]["remote_ip"] == "127.0.0.1"
    with RawNSQ(broker.tcp_address) as c:
        c.command("AUTH", body=b"nobody")
        assert c.expect_error().text == "E_UNAUTHORIZED AUTH no authorizations found"


def test_auth_server_down(broker_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    broker = broker_factory(auth_http_address=f"127.0.0.1:{port}")
    with RawNSQ(broker.tcp_address) as c:
        c.command("AUTH", body=b"good")
        assert c.expect_error(timeout=10).text == "E_AUTH_FAILED AUTH failed"
    assert broker.is_alive()


def test_statsd_and_e2e_percentiles(broker_factory):
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(5)
    broker = broker_factory(statsd_address=f"127.0.0.1:{udp.getsockname()[1]}", statsd_interval="1s",
                            e2e_processing_latency_percentile=0.99)
    with RawNSQ(broker.tcp_address) as c:
        c.sub("stats", "ch")
        c.rdy(10)
        with RawNSQ(broker.tcp_address) as p:
            for _ in range(5):
                p.command("PUB", "stats", body=b"x")
                p.expect_response(b"OK")
        for _ in range(5):
            c.fin(c.expect_message().id)
        c.command("NOP")
        import time

        def counted(ls):
            return any(ln.endswith(".topic.stats.message_count:5|c") for ln in ls)

        def latency(ls):
            # a positive 99th percentile once the FINs are in the window
            return any(".topic.stats.channel.ch.e2e_processing_latency_99:" in ln and not ln.endswith(":0|g") for ln in ls)

        lines: list[str] = []
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline and not (counted(lines) and latency(lines)):
            lines += udp.recv(65536).decode().splitlines()
    assert counted(lines) and latency(lines), lines
    udp.close()
