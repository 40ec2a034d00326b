"""Every answer of the three daemons' HTTP ports, byte for byte, against the record taken before our own
HTTP/1.1 loop replaced hypercorn in front (tests/http_wire.py has the cases and how to re-record).

The few answers that differ on purpose are listed in CHANGED with the reason."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from http_wire import BROKER_FLAGS, CASES, RECORD, SETUP, exchange, req
from processes import AdminProcess, BrokerProcess, LookupdProcess

RECORDED = json.loads(RECORD.read_text())

# (daemon, case) -> why the answer is not the recorded one
CHANGED = {
    **{(daemon, "ping pipelined then close"): "hypercorn answered a request with `Connection: close` 400 when "
       "another was pipelined behind it; it is answered, then the connection closes (as Go's net/http)"
       for daemon in CASES},
}


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    base = tmp_path_factory.mktemp("wire")
    broker = BrokerProcess(base, **BROKER_FLAGS).start()
    lookupd = LookupdProcess(base).start()
    admin = AdminProcess(base, lookupd_http_address=lookupd.http_address).start()
    for daemon in (broker, lookupd, admin):
        for line in SETUP:
            method, target = line.split(" ")
            exchange(daemon.http_port, req(method, target), idle=0.3)
    yield {"nsqd": broker, "nsqlookupd": lookupd, "nsqadmin": admin}
    for daemon in (admin, lookupd, broker):
        daemon.stop()


def _answers(port: int, daemon: str) -> dict[str, tuple[bytes, bool]]:
    cases = CASES[daemon]()
    record = RECORDED[daemon]

    def one(case: tuple[str, bytes]) -> tuple[bytes, bool]:
        want = record[case[0]]["answer"].encode("latin-1")
        return exchange(port, case[1], want=len(want), idle=0.2)

    with ThreadPoolExecutor(8) as pool:
        return dict(zip((name for name, _ in cases), pool.map(one, cases)))


@pytest.mark.parametrize("daemon", list(CASES))
def test_answers_are_the_recorded_bytes(daemons, daemon):
    answers = _answers(daemons[daemon].http_port, daemon)
    wrong = []
    for name, (answer, closed) in answers.items():
        if (daemon, name) in CHANGED:
            continue
        want = RECORDED[daemon][name]
        if answer != want["answer"].encode("latin-1"):
            wrong.append(f"{name}: got {answer[:400]!r}\n    want {want['answer'][:400]!r}")
        elif want["closed"] and not closed:
            wrong.append(f"{name}: the connection stayed open")
    assert not wrong, "\n".join(wrong)
    assert "Traceback" not in daemons[daemon].log_text()


def _both(port: int, method: str, target: str, body: bytes = b"") -> tuple[httpx.Response, httpx.Response]:
    """The same request over HTTP/1.1 (our own loop) and HTTP/2 with prior knowledge (handed to hypercorn,
    answered by the QuartTrio app over the same Site)."""
    url = f"http://127.0.0.1:{port}{target}"
    with httpx.Client() as h1, httpx.Client(http1=False, http2=True) as h2:
        one = h1.request(method, url, content=body)
        two = h2.request(method, url, content=body)
    assert (one.http_version, two.http_version) == ("HTTP/1.1", "HTTP/2")
    return one, two


@pytest.mark.parametrize("daemon, method, target, body", [
    ("nsqd", "GET", "/ping", b""),
    ("nsqd", "POST", "/pub?topic=wire_h2", b"over either"),
    ("nsqd", "POST", "/pub", b"no topic"),
    ("nsqd", "POST", "/pub?topic=wire_h2", b"x" * 500),  # over --max-msg-size: 413
    ("nsqd", "GET", "/ping/", b""),
    ("nsqd", "GET", "/nowhere", b""),
    ("nsqlookupd", "GET", "/ping", b""),
    ("nsqlookupd", "GET", "/topics", b""),
    ("nsqlookupd", "GET", "/lookup?topic=none", b""),
    ("nsqadmin", "GET", "/ping", b""),
])
def test_http2_answers_as_http1(daemons, daemon, method, target, body):
    one, two = _both(daemons[daemon].http_port, method, target, body)
    assert (two.status_code, two.content) == (one.status_code, one.content)
    assert two.headers.get("content-type") == one.headers.get("content-type")
