"""`python -m trio_nsq.lookupd` (== trio-nsqlookupd) as a process: real sockets, real HTTP, signals.

Each lookupd binds port 0 and the test reads the bound addresses from its log lines ("TCP: listening on
HOST:PORT", "HTTP: listening on HOST:PORT"), so nothing races for a port. One lookupd serves most tests
(each uses its own topic names); tests that need other flags or a signal start their own.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest
from processes import REPO_ROOT, LookupdProcess, wait_for

_LINE = re.compile(r"^\[nsqlookupd\] \d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d{6} (DEBUG|INFO|WARNING|ERROR|FATAL): ")


class V1Peer:
    """A raw protocol-V1 connection, as an nsqd's lookup loop would hold it."""

    def __init__(self, port: int, magic: bytes = b"  V1") -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.local_address = "%s:%d" % self.sock.getsockname()
        if magic:
            self.sock.sendall(magic)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _exactly(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError(f"closed after {buf!r}")
            buf += chunk
        return buf

    def response(self) -> bytes:
        (size,) = struct.unpack(">i", self._exactly(4))
        return self._exactly(size)

    def command(self, data: bytes) -> bytes:
        self.send(data)
        return self.response()

    def identify(self, **fields) -> dict:
        body = json.dumps({"broadcast_address": "127.0.0.1", "tcp_port": 4150, "http_port": 4151,
                           "version": "1.3.0", "hostname": "nsqd.test", **fields}).encode()
        return json.loads(self.command(b"IDENTIFY\n" + struct.pack(">i", len(body)) + body))

    def closed_by_peer(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def lookupd(tmp_path_factory):
    lk = LookupdProcess(tmp_path_factory.mktemp("lookupd"), tombstone_lifetime="1s",
                        broadcast_address="lookupd.test").start()
    yield lk
    assert lk.stop() == 0, lk.log_text()


@pytest.fixture
def start_lookupd(tmp_path):
    started: list[LookupdProcess] = []

    def start(*flags: str, broadcast_address: str | None = "lookupd.test") -> LookupdProcess:
        named = {"broadcast_address": broadcast_address} if broadcast_address else {}
        lk = LookupdProcess(tmp_path, *flags, **named)
        started.append(lk)
        return lk.start()

    yield start
    for lk in started:
        lk.kill()


def producers(lk: LookupdProcess, topic: str) -> list[dict]:
    r = lk.http.get("/lookup", params={"topic": topic})
    return r.json()["producers"] if r.status_code == 200 else []


def node(lk: LookupdProcess, remote_address: str) -> dict | None:
    return next((n for n in lk.http.get("/nodes").json()["producers"] if n["remote_address"] == remote_address), None)


# --- the protocol and the HTTP API together --------------------------------------------------------


def test_startup_log_is_nsq_style(lookupd):
    lines = lookupd.log_text().splitlines()
    assert any(f"TCP: listening on 127.0.0.1:{lookupd.tcp_port}" in line for line in lines)
    assert any(f"HTTP: listening on 127.0.0.1:{lookupd.http_port}" in line for line in lines)
    assert all(_LINE.match(line) for line in lines[:3]), lines[:3]


def test_identify_register_ping_unregister(lookupd):
    peer = V1Peer(lookupd.tcp_port)
    answer = peer.identify(http_port=5151, tcp_port=5150)
    assert answer["tcp_port"] == lookupd.tcp_port and answer["http_port"] == lookupd.http_port
    assert answer["broadcast_address"] == "lookupd.test" and answer["version"] and answer["hostname"]
    peer.send(b"REGISTER p_topic p_chan\nREGISTER p_topic2\nPING\n")
    assert [peer.response() for _ in range(3)] == [b"OK", b"OK", b"OK"]

    r = lookupd.http.get("/lookup", params={"topic": "p_topic"})
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json; charset=utf-8"
    assert r.headers["x-nsq-content-type"] == "nsq; version=1.0"
    assert r.json() == {"channels": ["p_chan"], "producers": [{
        "remote_address": peer.local_address, "hostname": "nsqd.test", "broadcast_address": "127.0.0.1",
        "tcp_port": 5150, "http_port": 5151, "version": "1.3.0"}]}  # nsqlookupd 1.3.0's fields, no more
    assert {"p_topic", "p_topic2"} <= set(lookupd.http.get("/topics").json()["topics"])
    assert lookupd.http.get("/channels", params={"topic": "p_topic"}).json() == {"channels": ["p_chan"]}
    assert lookupd.http.get("/channels", params={"topic": "p_none"}).json() == {"channels": []}
    me = node(lookupd, peer.local_address)
    assert sorted(zip(me["topics"], me["tombstones"])) == [("p_topic", False), ("p_topic2", False)]
    debug = lookupd.http.get("/debug").json()
    assert [e["id"] for e in debug["channel:p_topic:p_chan"]] == [peer.local_address]

    # UNREGISTER the channel, then the topic: the registrations stay listed, the producer goes
    assert peer.command(b"UNREGISTER p_topic p_chan\n") == b"OK"
    assert lookupd.http.get("/channels", params={"topic": "p_topic"}).json() == {"channels": ["p_chan"]}
    assert peer.command(b"UNREGISTER p_topic\n") == b"OK"
    assert producers(lookupd, "p_topic") == []
    assert len(producers(lookupd, "p_topic2")) == 1
    peer.close()


def test_http_answers_like_nsqlookupd(lookupd):
    http = lookupd.http
    r = http.get("/ping")
    assert (r.status_code, r.text, r.headers["content-type"]) == (200, "OK", "text/plain; charset=utf-8")
    assert "x-nsq-content-type" not in r.headers
    assert http.get("/info").json() == {"version": "1.3.0"}
    cases = [
        ("GET", "/lookup", 400, "MISSING_ARG_TOPIC"),
        ("GET", "/lookup?topic=h_missing", 404, "TOPIC_NOT_FOUND"),
        ("GET", "/lookup?topic=a;b", 400, "INVALID_REQUEST"),
        ("GET", "/channels", 400, "MISSING_ARG_TOPIC"),
        ("GET", "/nope", 404, "NOT_FOUND"),
        ("POST", "/topic/create", 400, "MISSING_ARG_TOPIC"),
        ("POST", "/topic/create?topic=bad*", 400, "INVALID_ARG_TOPIC"),
        ("POST", "/topic/tombstone?topic=t", 400, "MISSING_ARG_NODE"),
        ("POST", "/channel/create?topic=t", 400, "MISSING_ARG_CHANNEL"),
        ("POST", "/channel/delete?topic=t&channel=bad*", 400, "INVALID_ARG_CHANNEL"),
        ("POST", "/channel/delete?topic=h_t&channel=none", 404, "CHANNEL_NOT_FOUND"),
    ]
    for method, path, status, message in cases:
        r = http.request(method, path)
        assert (r.status_code, r.json()) == (status, {"message": message}), (method, path)
        assert r.headers["content-type"] == "application/json; charset=utf-8"
    r = http.get("/topic/create?topic=h_t")
    assert (r.status_code, r.json(), r.headers["allow"]) == (405, {"message": "METHOD_NOT_ALLOWED"}, "OPTIONS, POST")
    r = http.request("OPTIONS", "/lookup")
    assert (r.status_code, r.headers["allow"], r.content) == (200, "GET, OPTIONS", b"")
    r = http.get("/topics/?x=1")
    assert (r.status_code, r.headers["location"]) == (301, "/topics?x=1")
    assert http.get("/Topics/", follow_redirects=True).json()["topics"] is not None
    # admin: create, then delete
    r = http.post("/channel/create?topic=h_t&channel=h_c")
    assert (r.status_code, r.content, r.headers["x-nsq-content-type"]) == (200, b"", "nsq; version=1.0")
    assert http.get("/lookup?topic=h_t").json() == {"channels": ["h_c"], "producers": []}
    assert http.post("/channel/delete?topic=h_t&channel=h_c").status_code == 200
    assert http.post("/topic/delete?topic=h_t").status_code == 200
    assert http.get("/lookup?topic=h_t").status_code == 404


def test_a_third_party_client_reads_the_api(lookupd):
    """gnsq's LookupdClient (a client of Go nsqlookupd) against ours."""
    gnsq = pytest.importorskip("gnsq")
    client = gnsq.LookupdClient(host="127.0.0.1", port=lookupd.http_port)
    peer = V1Peer(lookupd.tcp_port)
    peer.identify()
    assert peer.command(b"REGISTER g_topic g_chan\n") == b"OK"
    assert client.ping() == b"OK"
    assert client.lookup("g_topic")["channels"] == ["g_chan"]
    assert "g_topic" in client.topics()["topics"]
    assert client.channels("g_topic") == {"channels": ["g_chan"]}
    client.create_channel("g_topic", "g_chan2")
    assert sorted(client.channels("g_topic")["channels"]) == ["g_chan", "g_chan2"]
    client.tombstone_topic("g_topic", "127.0.0.1:4151")
    assert client.lookup("g_topic")["producers"] == []
    with pytest.raises(gnsq.errors.NSQHttpError):
        client.lookup("g_missing")
    peer.close()


def test_tombstone_hides_a_producer_until_its_lifetime_ends(lookupd):
    peer = V1Peer(lookupd.tcp_port)
    peer.identify(broadcast_address="tomb.host", http_port=7151)
    peer.send(b"REGISTER tomb_a\nREGISTER tomb_b\n")
    assert [peer.response(), peer.response()] == [b"OK", b"OK"]
    assert len(producers(lookupd, "tomb_a")) == 1
    assert lookupd.http.post("/topic/tombstone", params={"topic": "tomb_a", "node": "tomb.host:7151"}).status_code == 200
    tombstoned_at = time.monotonic()
    assert producers(lookupd, "tomb_a") == []
    assert len(producers(lookupd, "tomb_b")) == 1  # a tombstone is per topic
    me = node(lookupd, peer.local_address)  # /nodes lists it, flagged
    assert dict(zip(me["topics"], me["tombstones"])) == {"tomb_a": True, "tomb_b": False}
    wait_for(lambda: producers(lookupd, "tomb_a"), timeout=5)  # --tombstone-lifetime=1s
    assert time.monotonic() - tombstoned_at >= 0.9
    me = node(lookupd, peer.local_address)
    assert dict(zip(me["topics"], me["tombstones"])) == {"tomb_a": False, "tomb_b": False}
    peer.close()


def test_a_disconnected_peer_is_removed(lookupd):
    stays, leaves = V1Peer(lookupd.tcp_port), V1Peer(lookupd.tcp_port)
    for peer in (stays, leaves):
        peer.identify()
        assert peer.command(b"REGISTER gone_topic gone_chan\n") == b"OK"
    assert len(producers(lookupd, "gone_topic")) == 2
    leaves.close()
    wait_for(lambda: len(producers(lookupd, "gone_topic")) == 1)
    assert [p["remote_address"] for p in producers(lookupd, "gone_topic")] == [stays.local_address]
    assert node(lookupd, leaves.local_address) is None
    assert not any(e["id"] == leaves.local_address for entries in lookupd.http.get("/debug").json().values()
                   for e in entries)
    assert f"PROTOCOL(V1): [{leaves.local_address}] exiting ioloop" in lookupd.log_text()
    # the registration itself stays listed, as in nsqlookupd
    assert lookupd.http.get("/channels?topic=gone_topic").json() == {"channels": ["gone_chan"]}
    stays.close()


def _identify_frame(body: bytes) -> bytes:
    return b"IDENTIFY\n" + struct.pack(">i", len(body)) + body


@pytest.mark.parametrize("data, answer", [
    (b"HTTP", b"E_BAD_PROTOCOL"),
    (b"XXXX", b"E_BAD_PROTOCOL"),
    (b"  V2", b"E_BAD_PROTOCOL"),
    (b"  V1BOGUS cmd\n", b"E_INVALID invalid command BOGUS"),
    (b"  V1BOGUS\n", b"E_INVALID invalid command BOGUS"),
    (b"  V1\n", b"E_INVALID invalid command "),
    (b"  V1REGISTER b_topic\n", b"E_INVALID client must IDENTIFY"),
    (b"  V1REGISTER\n", b"E_INVALID client must IDENTIFY"),
    (b"  V1IDENTIFY\n\x7f\xff\xff\xff", b"E_BAD_BODY IDENTIFY invalid body size 2147483647"),
    (b"  V1IDENTIFY\n\x00\x10\x00\x01", b"E_BAD_BODY IDENTIFY invalid body size 1048577"),
    (b"  V1IDENTIFY\n\xff\xff\xff\xff", b"E_BAD_BODY IDENTIFY invalid body size -1"),
    (b"  V1" + _identify_frame(b"{]"), b"E_BAD_BODY IDENTIFY failed to decode JSON body"),
    (b"  V1" + _identify_frame(b'{"tcp_port":"4150"}'), b"E_BAD_BODY IDENTIFY failed to decode JSON body"),
    (b"  V1" + _identify_frame(b'{"broadcast_address":"b"}'), b"E_BAD_BODY IDENTIFY missing fields"),
    (b"  V1" + b"A" * 10_000, b"E_INVALID failed to read command - line too long"),
])
def test_bad_input_gets_gos_error_and_the_connection_closes(lookupd, data, answer):
    witness = V1Peer(lookupd.tcp_port)
    witness.identify()
    assert witness.command(b"REGISTER bad_witness\n") == b"OK"
    peer = V1Peer(lookupd.tcp_port, magic=b"")
    peer.send(data)
    assert peer.response() == answer
    assert peer.closed_by_peer()
    # the server and its other peers carry on
    assert witness.command(b"PING\n") == b"OK"
    assert witness.local_address in [p["remote_address"] for p in producers(lookupd, "bad_witness")]
    assert lookupd.proc.poll() is None
    witness.close()


def test_errors_after_registering_remove_the_peer(lookupd):
    peer = V1Peer(lookupd.tcp_port)
    peer.identify()
    peer.send(b"REGISTER err_topic\nREGISTER bad*topic\nPING\n")
    assert peer.response() == b"OK"
    assert peer.response() == b"E_BAD_TOPIC REGISTER topic name 'bad*topic' is not valid"
    assert peer.closed_by_peer()  # the PING after the error is never answered
    wait_for(lambda: producers(lookupd, "err_topic") == [])
    second = V1Peer(lookupd.tcp_port)
    second.identify()
    assert second.command(b"REGISTER err_chan_topic bad*chan\n") == b"E_BAD_CHANNEL REGISTER channel name 'bad*chan' is not valid"
    third = V1Peer(lookupd.tcp_port)
    third.identify()
    body = b'{"broadcast_address":"b","tcp_port":1,"http_port":2,"version":"1"}'
    assert third.command(_identify_frame(body)) == b"E_INVALID cannot IDENTIFY again"
    for p in (second, third):
        assert p.closed_by_peer()


def test_random_bytes_never_hurt_the_server(lookupd):
    rng = random.Random(4160)
    witness = V1Peer(lookupd.tcp_port)
    witness.identify()
    assert witness.command(b"REGISTER fuzz_witness\n") == b"OK"
    for i in range(60):
        data = rng.randbytes(rng.randint(0, 300))
        if i % 2:
            data = b"  V1" + data
        peer = V1Peer(lookupd.tcp_port, magic=b"")
        try:
            peer.send(data)
            peer.sock.shutdown(socket.SHUT_WR)  # as a peer that hangs up: the server must answer or close
            while peer.sock.recv(65536):
                pass
        except OSError:
            pass  # reset or not connected: the server closed first, which is an answer too
        peer.close()
    assert witness.command(b"PING\n") == b"OK"
    assert lookupd.http.get("/ping").text == "OK"
    assert [p["remote_address"] for p in producers(lookupd, "fuzz_witness")] == [witness.local_address]
    witness.close()


def test_a_peer_hanging_up_inside_identify_hears_gos_read_error(lookupd):
    peer = V1Peer(lookupd.tcp_port)
    peer.send(b"IDENTIFY\n\x00\x00\x00\x20{")
    peer.sock.shutdown(socket.SHUT_WR)
    assert peer.response() == b"E_BAD_BODY IDENTIFY failed to read body"
    peer.close()


# --- flags, and the process's end ----------------------------------------------------------------


def test_inactive_producers_drop_out_until_they_ping(start_lookupd):
    lk = start_lookupd("--inactive-producer-timeout=500ms")
    peer = V1Peer(lk.tcp_port)
    peer.identify()
    assert peer.command(b"REGISTER idle_topic\n") == b"OK"
    assert len(producers(lk, "idle_topic")) == 1 and node(lk, peer.local_address)
    wait_for(lambda: producers(lk, "idle_topic") == [] and node(lk, peer.local_address) is None, timeout=3)
    assert lk.http.get("/topics").json() == {"topics": ["idle_topic"]}  # the registration stays
    assert peer.command(b"PING\n") == b"OK"
    assert len(producers(lk, "idle_topic")) == 1 and node(lk, peer.local_address)
    peer.close()


def test_config_file_with_flags_over_it(start_lookupd, tmp_path):
    config = tmp_path / "nsqlookupd.toml"
    config.write_text('broadcast_address = "from.config"\ntombstone_lifetime = "200ms"\nlog_prefix = "[cfg] "\n'
                      'http_address = "127.0.0.1:1"\n')
    # the flag wins over the file (port 1 could not be bound)
    lk = start_lookupd(f"--config={config}", "--http-address=127.0.0.1:0", broadcast_address=None)
    assert lk.log_text().startswith("[cfg] ")
    peer = V1Peer(lk.tcp_port)
    assert peer.identify(broadcast_address="cfg.host")["broadcast_address"] == "from.config"
    assert peer.command(b"REGISTER cfg_topic\n") == b"OK"
    lk.http.post("/topic/tombstone?topic=cfg_topic&node=cfg.host:4151")
    assert producers(lk, "cfg_topic") == []
    wait_for(lambda: producers(lk, "cfg_topic"), timeout=2)  # the file's 200ms lifetime
    peer.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_it_cleanly(start_lookupd, sig):
    lk = start_lookupd()
    peer = V1Peer(lk.tcp_port)
    peer.identify()
    assert peer.command(b"REGISTER sig_topic\n") == b"OK"
    assert lk.stop(sig) == 0
    log = lk.log_text()
    assert f"received signal {signal.Signals(sig).name}, exiting" in log
    assert "Traceback" not in log
    assert peer.closed_by_peer()
    peer.close()


def test_a_port_in_use_exits_1(start_lookupd, tmp_path):
    lk = start_lookupd()
    proc = subprocess.run([sys.executable, "-m", "trio_nsq.lookupd", f"--tcp-address=127.0.0.1:{lk.tcp_port}",
                           "--http-address=127.0.0.1:0"], cwd=str(REPO_ROOT), capture_output=True, timeout=20,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 1
    assert b"FATAL" in proc.stderr and b"Traceback" not in proc.stderr
