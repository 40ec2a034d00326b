"""TLS, snappy, deflate and AUTH against the real broker, with pynsq (a third-party client) and a raw client.

Certificates are made by the test with trustme; the auth server is a small HTTP server on loopback.
"""

from __future__ import annotations

import http.server
import json
import socket
import ssl
import subprocess
import sys
import threading
import urllib.parse

import pytest
import trustme

from nsq_raw import RawNSQ
from shared.protocol import MAGIC_V2, FrameParser, encode_identify, encode_pub

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
    stderr = broker.stderr_text()
    for feature in compression:
        if feature in ("snappy", "deflate"):
            assert f"upgrading connection to {feature}" in stderr


def test_pynsq_over_tls_with_snappy(broker_factory, certs):
    broker = broker_factory(tls_cert=certs / "server.pem", tls_key=certs / "server.pem")
    result = pynsq_round_trip(broker, ca=str(certs / "ca.pem"), opts={"snappy": True})
    assert result.get("count") == 200 and result.get("match"), result
    assert "upgrading connection to TLS" in broker.stderr_text()


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
