"""nsqlookupd and the broker's lookup loop: real lookupd and broker processes on free loopback ports."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys

import httpx
import pytest
from processes import LookupdProcess, wait_for

from trio_nsq.lookupd.protocol_v1 import ClientV1, LookupProtocolV1
from trio_nsq.lookupd.registration_db import (
    PeerInfo,
    Producer,
    Registration,
    RegistrationDB,
    filter_active,
)
from trio_nsq.shared.protocol import Command, FatalClientError


@pytest.fixture
def lookupd_factory(tmp_path):
    started = []

    def make(**flags) -> LookupdProcess:
        lk = LookupdProcess(tmp_path, **flags).start()
        started.append(lk)
        return lk

    yield make
    for lk in started:
        lk.kill()


def eventually(fn, timeout: float = 5.0):
    """wait_for, counting a request that fails or an assertion not yet true as "not yet"."""
    return wait_for(fn, timeout, ignore=(AssertionError, httpx.HTTPError, KeyError))


# --- pure parts ---------------------------------------------------------------------------------


class _FakeLookupd:
    def __init__(self):
        self.db = RegistrationDB()
        self.tcp_address = ("127.0.0.1", 4160)
        self.http_address = ("127.0.0.1", 4161)

        class O:
            broadcast_address = "lk"

        self.options = O()


IDENTIFY_BODY = json.dumps({"broadcast_address": "b1", "tcp_port": 4150, "http_port": 4151, "version": "1.3.0",
                            "hostname": "h"}).encode()


def test_protocol_v1_exec_and_errors():
    lk = _FakeLookupd()
    proto = LookupProtocolV1(lk)
    client = ClientV1("127.0.0.1:5000")
    with pytest.raises(FatalClientError) as err:
        proto.exec(client, Command(b"REGISTER", (b"t",)))
    assert err.value.frame_data() == b"E_INVALID client must IDENTIFY"
    answer = json.loads(proto.exec(client, Command(b"IDENTIFY", (), IDENTIFY_BODY)))
    assert answer["tcp_port"] == 4160 and answer["http_port"] == 4161 and answer["broadcast_address"] == "lk"
    assert proto.exec(client, Command(b"REGISTER", (b"t", b"c"))) == b"OK"
    assert lk.db.find_registrations("channel", "t", "*") == [Registration("channel", "t", "c")]
    cases = [
        (Command(b"REGISTER", (b"bad*topic",)), b"E_BAD_TOPIC REGISTER topic name 'bad*topic' is not valid"),
        (Command(b"REGISTER", (b"t", b"bad*ch")), b"E_BAD_CHANNEL REGISTER channel name 'bad*ch' is not valid"),
        (Command(b"UNREGISTER", ()), b"E_INVALID UNREGISTER insufficient number of params"),
        (Command(b"IDENTIFY", (), IDENTIFY_BODY), b"E_INVALID cannot IDENTIFY again"),
        (Command(b"WHAT", ()), b"E_INVALID invalid command WHAT"),
    ]
    for cmd, text in cases:
        with pytest.raises(FatalClientError) as err:
            proto.exec(client, cmd)
        assert err.value.frame_data() == text
    with pytest.raises(FatalClientError) as err:
        proto.exec(ClientV1("x:1"), Command(b"IDENTIFY", (), b'{"broadcast_address": "b"}'))
    assert err.value.frame_data() == b"E_BAD_BODY IDENTIFY missing fields"
    assert proto.exec(client, Command(b"UNREGISTER", (b"t",))) == b"OK"
    assert lk.db.find_producers("channel", "t", "c") == []


def test_registration_db_inactivity_and_tombstones():
    db = RegistrationDB()
    fresh, stale = PeerInfo(id="a"), PeerInfo(id="b")
    stale.last_update -= 400
    for peer in (fresh, stale):
        db.add_producer(Registration("topic", "t", ""), Producer(peer))
    producers = db.find_producers("topic", "t", "")
    assert [p.peer.id for p in filter_active(producers, 300, 45)] == ["a"]
    producers[0].tombstone()
    assert filter_active(producers, 300, 45) == []
    assert [p.peer.id for p in filter_active(producers, 300, 0)] == ["a"]  # lifetime over
    assert db.remove_producer(Registration("topic", "t", ""), "a") == (True, 1)


# --- processes ----------------------------------------------------------------------------------


def _v1(lk: LookupdProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", lk.tcp_port), timeout=5)
    sock.sendall(b"  V1")
    return sock


def _response(sock: socket.socket) -> bytes:
    def exactly(n):
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf

    (size,) = struct.unpack(">i", exactly(4))
    return exactly(size)


def test_v1_over_a_socket_and_http(lookupd_factory):
    lk = lookupd_factory(tombstone_lifetime="1s")
    sock = _v1(lk)
    sock.sendall(b"IDENTIFY\n" + struct.pack(">i", len(IDENTIFY_BODY)) + IDENTIFY_BODY)
    assert json.loads(_response(sock))["http_port"] == lk.http_port
    sock.sendall(b"REGISTER t1 c1\nREGISTER t2\nPING\n")
    assert [_response(sock) for _ in range(3)] == [b"OK", b"OK", b"OK"]
    lookup = lk.get("/lookup?topic=t1").json()
    assert lookup["channels"] == ["c1"]
    assert [(p["broadcast_address"], p["tcp_port"], p["http_port"]) for p in lookup["producers"]] == [("b1", 4150, 4151)]
    assert sorted(lk.get("/topics").json()["topics"]) == ["t1", "t2"]
    assert lk.get("/channels?topic=t1").json() == {"channels": ["c1"]}
    nodes = lk.get("/nodes").json()["producers"]
    assert sorted(nodes[0]["topics"]) == ["t1", "t2"] and nodes[0]["tombstones"] == [False, False]
    assert lk.get("/lookup?topic=nope").status_code == 404
    assert lk.get("/lookup?topic=nope").json() == {"message": "TOPIC_NOT_FOUND"}
    assert lk.get("/lookup").json() == {"message": "MISSING_ARG_TOPIC"}
    assert lk.get("/ping").text == "OK"
    assert lk.get("/info").json()["version"]
    assert lk.get("/nope").json() == {"message": "NOT_FOUND"}
    assert httpx.get(lk.http_url + "/topic/create?topic=x", timeout=5).status_code == 405
    # tombstone hides the producer of t1, and it comes back after the lifetime
    r = httpx.post(lk.http_url + "/topic/tombstone?topic=t1&node=b1:4151", timeout=5)
    assert r.status_code == 200
    assert lk.get("/lookup?topic=t1").json()["producers"] == []
    assert lk.get("/nodes").json()["producers"][0]["tombstones"][sorted(nodes[0]["topics"]).index("t1")] is True
    eventually(lambda: lk.get("/lookup?topic=t1").json()["producers"], timeout=3)
    # admin endpoints
    assert httpx.post(lk.http_url + "/channel/create?topic=t3&channel=c3", timeout=5).status_code == 200
    assert lk.get("/channels?topic=t3").json() == {"channels": ["c3"]}
    assert httpx.post(lk.http_url + "/channel/delete?topic=t3&channel=zz", timeout=5).json() == {"message": "CHANNEL_NOT_FOUND"}
    assert httpx.post(lk.http_url + "/topic/create?topic=bad*", timeout=5).json() == {"message": "INVALID_ARG_TOPIC"}
    assert httpx.post(lk.http_url + "/topic/delete?topic=t3", timeout=5).status_code == 200
    assert "t3" not in lk.get("/topics").json()["topics"]
    # a peer that disconnects takes its registrations with it
    sock.close()
    eventually(lambda: lk.get("/lookup?topic=t1").json()["producers"] == [])
    assert lk.get("/nodes").json()["producers"] == []
    assert lk.stop() == 0


def _post(broker, path):
    if path.startswith("/channel/create"):
        # nsqd creates a channel only in an existing topic
        topic = path.split("topic=")[1].split("&")[0]
        _post(broker, f"/topic/create?topic={topic}")
    r = httpx.post(f"http://{broker.http_address}{path}", timeout=5)
    assert r.status_code == 200, r.text


def test_brokers_register_and_go_away(lookupd_factory, broker_factory):
    lk = lookupd_factory()
    b1 = broker_factory(lookupd_tcp_address=lk.tcp_address, broadcast_address="127.0.0.1")
    b2 = broker_factory(lookupd_tcp_address=lk.tcp_address, broadcast_address="127.0.0.1")
    _post(b1, "/channel/create?topic=shared&channel=c1")
    _post(b2, "/channel/create?topic=shared&channel=c2")
    _post(b2, "/topic/create?topic=only2")

    def both_registered():
        lookup = lk.get("/lookup?topic=shared").json()
        ports = sorted(p["tcp_port"] for p in lookup["producers"])
        return ports == sorted([b1.tcp_port, b2.tcp_port]) and sorted(lookup["channels"]) == ["c1", "c2"]

    eventually(both_registered, timeout=2)
    assert len(lk.get("/nodes").json()["producers"]) == 2
    # deleting removes
    _post(b2, "/channel/delete?topic=shared&channel=c2")
    # as nsqlookupd: the registration stays listed (until deleted in lookupd); its producer is gone
    eventually(lambda: "channel:shared:c2" not in lk.get("/debug").json(), timeout=2)
    assert "channel:shared:c1" in lk.get("/debug").json()
    _post(b2, "/topic/delete?topic=only2")
    eventually(lambda: lk.get("/lookup?topic=only2").json()["producers"] == [], timeout=2)
    # killing a broker removes it
    b2.kill()
    eventually(lambda: [p["tcp_port"] for p in lk.get("/nodes").json()["producers"]] == [b1.tcp_port], timeout=3)
    # restarting lookupd gets everything re-registered
    lk.kill()
    lk.start()  # the same ports: the brokers find it where it was
    eventually(lambda: [p["tcp_port"] for p in lk.get("/lookup?topic=shared").json()["producers"]] == [b1.tcp_port],
               timeout=8)
    assert lk.get("/channels?topic=shared").json()["channels"] == ["c1"]


def test_put_config_changes_lookupd_peers(lookupd_factory, broker_factory):
    lk1, lk2 = lookupd_factory(), lookupd_factory()
    b = broker_factory(lookupd_tcp_address=lk1.tcp_address, broadcast_address="127.0.0.1")
    _post(b, "/topic/create?topic=moving")
    eventually(lambda: lk1.get("/lookup?topic=moving").json()["producers"], timeout=2)
    r = httpx.put(f"http://{b.http_address}/config/nsqlookupd_tcp_addresses", content=json.dumps([lk2.tcp_address]),
                  timeout=5)
    assert r.status_code == 200, r.text
    eventually(lambda: lk2.get("/lookup?topic=moving").json()["producers"], timeout=3)
    eventually(lambda: lk1.get("/nodes").json()["producers"] == [], timeout=3)


def test_third_party_consumer_finds_every_broker_through_lookupd(lookupd_factory, broker_factory):
    """pynsq's Reader given only lookupd's HTTP address consumes what was published to both brokers."""
    lk = lookupd_factory()
    brokers = [broker_factory(lookupd_tcp_address=lk.tcp_address, broadcast_address="127.0.0.1") for _ in range(2)]
    for b in brokers:
        _post(b, "/channel/create?topic=found&channel=ch")
    eventually(lambda: len(lk.get("/lookup?topic=found").json()["producers"]) == 2, timeout=3)
    bodies = {}
    for i, b in enumerate(brokers):
        for j in range(20):
            body = b"broker%d-%d" % (i, j)
            r = httpx.post(f"http://{b.http_address}/pub?topic=found", content=body, timeout=5)
            assert r.status_code == 200
            bodies[body] = i
    script = r'''
import json, sys, tornado.ioloop, nsq
spec = json.loads(sys.argv[1]); got = []
loop = tornado.ioloop.IOLoop.current()
def handler(m):
    got.append(bytes(m.body).decode())
    if len(got) >= spec["expect"]:
        loop.call_later(0.5, lambda: (print("RESULT " + json.dumps(sorted(got)), flush=True), loop.stop()))
    return True
nsq.Reader(spec["topic"], "ch", message_handler=handler, lookupd_http_addresses=[spec["lookupd"]],
           lookupd_poll_interval=1, max_in_flight=10)
loop.call_later(30, loop.stop)
loop.start()
'''
    proc = subprocess.run([sys.executable, "-c", script, json.dumps({"topic": "found", "lookupd": lk.http_url, "expect": 40})],
                          capture_output=True, text=True, timeout=45)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][7:])
    assert sorted(got) == sorted(b.decode() for b in bodies), got
