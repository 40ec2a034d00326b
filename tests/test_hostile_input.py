"""A broker that bad clients cannot break: fuzzed TCP input, malformed HTTP, floods and slow peers.

Fuzz cases are seeded (repeatable) mutations of valid command streams plus random bytes; each case is one
connection that must end (answered or closed) within a timeout, and afterwards the broker must still
publish and consume normally.
"""

from __future__ import annotations

import random
import resource
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from nsq_raw import RawNSQ
from processes import LookupdProcess
from wire_fuzz import mutate, random_mutations

from trio_nsq.shared.protocol import (
    MAGIC_V2,
    encode_dpub,
    encode_fin,
    encode_identify,
    encode_mpub,
    encode_mpub_body,
    encode_pub,
    encode_rdy,
    encode_req,
    encode_sub,
    encode_touch,
)

FUZZ_CASES = 10_000  # on the broker; 5,000 more on lookupd below

SEEDS = [
    MAGIC_V2 + encode_identify({"feature_negotiation": True, "heartbeat_interval": 1000}),
    MAGIC_V2 + encode_pub("fuzz", b"hello"),
    MAGIC_V2 + encode_mpub("fuzz", [b"a", b"bb", b"ccc"]),
    MAGIC_V2 + encode_dpub("fuzz", 100, b"later"),
    MAGIC_V2 + encode_sub("fuzz", "ch") + encode_rdy(5) + encode_fin(b"0" * 16) + encode_req(b"1" * 16, 10)
    + encode_touch(b"2" * 16) + b"CLS\n",
    MAGIC_V2 + b"NOP\nNOP\r\nAUTH\n\x00\x00\x00\x03abc",
    MAGIC_V2 + encode_identify({"snappy": True, "deflate": True, "feature_negotiation": True}) + b"\xff\x06\x00\x00sNaPpY",
]


# what a random edit may put into a stream besides random bytes: commands and their pieces
PIECES = [b"\n", b" ", b"PUB ", b"MPUB t\n", b"SUB a b\n", b"RDY 99999999\n", b"IDENTIFY\n"]


def mutate_randomly(rng: random.Random, data: bytes) -> bytes:
    return mutate(data, random_mutations(rng, PIECES))


def fuzz_case(address: tuple[str, int], seed: int) -> str:
    rng = random.Random(seed)
    if rng.random() < 0.2:
        data = (MAGIC_V2 if rng.random() < 0.5 else b"") + rng.randbytes(rng.randint(0, 300))
    else:
        data = mutate_randomly(rng, rng.choice(SEEDS))
    return send_to_eof(address, data, seed)


def send_to_eof(address: tuple[str, int], data: bytes, seed: int) -> str:
    """Send one case and read until the daemon closes; "" if it did, a line saying so if it hung."""
    with socket.create_connection(address, timeout=10) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            # the daemon must answer and/or close: read until EOF
            while sock.recv(65536):
                pass
        except socket.timeout:
            return f"hang on case {seed}: {data[:80]!r}"
        except OSError:
            pass  # the daemon closed first (reset, not connected): that is an answer too
    return ""


def assert_serving(broker) -> None:
    assert broker.is_alive(), broker.log_text()[-3000:]
    with RawNSQ(broker.tcp_address) as consumer, RawNSQ(broker.tcp_address) as producer:
        consumer.identify(heartbeat_interval=5000)
        consumer.sub("alive", "ch")
        consumer.rdy(1)
        producer.command("PUB", "alive", body=b"still here")
        producer.expect_response(b"OK")
        msg = consumer.expect_message()
        assert msg.body == b"still here"
        consumer.fin(msg.id)


def test_fuzzed_tcp_streams(broker):
    address = ("127.0.0.1", broker.tcp_port)
    with ThreadPoolExecutor(16) as pool:
        failures = [f for f in pool.map(lambda s: fuzz_case(address, s), range(FUZZ_CASES)) if f]
    assert not failures, failures[:5]
    assert "internal error" not in broker.log_text()
    assert_serving(broker)


MALFORMED_HTTP = [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/9.9\r\n\r\n",
    b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZZ\r\nxx\r\n",
    b"POST /mpub?topic=t&binary=true HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\n\r\n\xff\xff\xff\xff\x00\x00\x00\x01",
    b"GET /stats?format=json&topic=%ff%fe HTTP/1.1\r\nHost: x\r\n\r\n",
    b"PUT /config/nsqlookupd_tcp_addresses HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{bad}",
    b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\n" + b"X-Big: " + b"b" * 200_000 + b"\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello on the plain port
]


def test_malformed_http_requests(broker):
    for request in MALFORMED_HTTP:
        with socket.create_connection(("127.0.0.1", broker.http_port), timeout=10) as sock:
            try:
                sock.sendall(request)
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(65536):
                    pass
            except OSError:
                pass
    response = httpx.get(f"http://{broker.http_address}/ping", timeout=5)
    assert response.status_code == 200 and response.text == "OK"
    assert_serving(broker)


def test_a_thousand_connections(broker):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    socks = []
    try:
        for _ in range(1000):
            sock = socket.create_connection(("127.0.0.1", broker.tcp_port), timeout=20)
            sock.sendall(MAGIC_V2)
            socks.append(sock)
        for i, sock in enumerate(socks):
            sock.sendall(encode_pub("flood", b"%d" % i))
        ok = 0
        for sock in socks:
            data = b""
            while len(data) < 10:
                data += sock.recv(10 - len(data))
            ok += data[8:] == b"OK"
        assert ok == 1000
        assert_serving(broker)
    finally:
        for sock in socks:
            sock.close()


def test_a_consumer_that_never_reads_does_not_stall_others(broker):
    body = b"z" * 200_000
    with socket.create_connection(("127.0.0.1", broker.tcp_port)) as stuck:
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.sendall(MAGIC_V2 + encode_identify({"heartbeat_interval": 1000}) + encode_sub("slow", "stuck") + encode_rdy(2500))
        time.sleep(0.2)
        with RawNSQ(broker.tcp_address) as good, RawNSQ(broker.tcp_address) as producer:
            good.identify(heartbeat_interval=5000)
            good.sub("slow", "good")
            good.rdy(100)
            time.sleep(0.2)
            start = time.monotonic()
            for _ in range(100):
                producer.command("PUB", "slow", body=body)
                producer.expect_response(b"OK")
            for _ in range(100):
                good.fin(good.expect_message(timeout=10).id)
            elapsed = time.monotonic() - start
        # the stuck consumer is cut off once a write to it takes longer than its heartbeat interval
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and "write timeout" not in broker.log_text():
            time.sleep(0.1)
    assert elapsed < 10, f"other consumers were stalled: {elapsed:.1f}s for 100 messages"
    assert "write timeout after 1s" in broker.log_text()
    assert_serving(broker)


@pytest.mark.parametrize("junk", [b"  V1", b"GET ", b"\x00\x00\x00\x00"])
def test_bad_magic(broker, junk):
    with socket.create_connection(("127.0.0.1", broker.tcp_port), timeout=5) as sock:
        sock.sendall(junk)
        data = b""
        while chunk := sock.recv(100):
            data += chunk
    assert data.endswith(b"E_BAD_PROTOCOL")
    assert_serving(broker)


def test_a_publisher_faster_than_consumers_spills_to_disk_with_bounded_memory(broker_factory):
    broker = broker_factory(mem_queue_size=1000)
    body = b"p" * 1000
    total = 200_000  # 200 MB of bodies: far more than the broker may hold in memory
    with RawNSQ(broker.tcp_address) as consumer, RawNSQ(broker.tcp_address) as producer:
        consumer.identify(heartbeat_interval=10000)
        consumer.sub("spill", "slow")
        consumer.rdy(1)  # a consumer far slower than the publisher
        peak = 0.0
        for i in range(total // 500):
            producer.command("MPUB", "spill", body=encode_mpub_body([body] * 500))
            producer.expect_response(b"OK")
            if i % 40 == 0:
                peak = max(peak, broker.memory()["VmRSS"] / 2**20)
        peak = max(peak, broker.memory()["VmRSS"] / 2**20)
        consumer.fin(consumer.expect_message().id)
    on_disk = sum(f.stat().st_size for f in broker.data_path.glob("*.dat"))
    assert on_disk > 150_000_000, on_disk
    print(f"\npeak broker RSS {peak:.0f} MB while 200 MB were published, {on_disk / 1e6:.0f} MB on disk")
    assert peak < 150, f"peak RSS {peak:.0f} MB while 200 MB were published"
    assert_serving(broker)


V1_SEEDS = [
    b"  V1IDENTIFY\n" + len(b'{"broadcast_address":"b","tcp_port":1,"http_port":2,"version":"1"}').to_bytes(4, "big")
    + b'{"broadcast_address":"b","tcp_port":1,"http_port":2,"version":"1"}' + b"REGISTER t c\nPING\nUNREGISTER t c\n",
    b"  V1PING\nREGISTER t\n",
    b"  V1IDENTIFY\n\x00\x00\x00\x02{}",
]


def test_fuzzed_lookupd_streams(tmp_path):
    lk = LookupdProcess(tmp_path).start()
    try:
        address = ("127.0.0.1", lk.tcp_port)

        def case(seed: int) -> str:
            rng = random.Random(seed)
            data = mutate_randomly(rng, rng.choice(V1_SEEDS)) if rng.random() < 0.8 else rng.randbytes(rng.randint(0, 200))
            return send_to_eof(address, data, seed)

        with ThreadPoolExecutor(16) as pool:
            failures = [f for f in pool.map(case, range(5_000)) if f]
        assert not failures, failures[:5]
        assert lk.proc.poll() is None
        assert "internal error" not in lk.log_text()
        assert lk.get("/ping").text == "OK"
        assert lk.get("/nodes").json() == {"producers": []}  # every fuzzing peer was removed again
    finally:
        lk.stop()
