"""pytest fixtures that give each test a real nsqd / nsqlookupd (registered via ``pytest11``).

Installing trio-nsq is enough; a test file only names the fixture::

    def test_roundtrip(nsqd):
        nsqd.publish("orders", b"hello")          # HTTP /pub
        assert nsqd.depth("orders") == 1          # from /stats
        # any client: pynsq, gnsq, ansq, ours -> connect to nsqd.tcp_address ("127.0.0.1:NNNNN")

Fixtures: ``nsqd`` and ``nsqlookupd`` (a fresh broker per test, data in the test's tmp_path) and
``nsqd_session`` / ``nsqlookupd_session`` (one for the whole session). ``--nsq-mode=subprocess``
(the default: a ``python -m trio_nsq.broker`` process, so any client library and any event loop works) or
``--nsq-mode=inprocess`` (on a thread of this process: faster to start). Nothing runs unless a test
asks for one of these fixtures.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

START_TIMEOUT = 20.0
STOP_TIMEOUT = 10.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--nsq-mode", choices=("subprocess", "inprocess"), default="subprocess",
                     help="trio-nsq fixtures: run nsqd/nsqlookupd as a subprocess (default) or in-process")


class NSQServer:
    """A running nsqd or nsqlookupd: ``tcp_address`` and ``http_address`` are "host:port" strings."""

    def __init__(self, tcp_address: str, http_address: str, data_path: str = "") -> None:
        self.tcp_address = tcp_address
        self.http_address = http_address
        self.data_path = data_path

    def publish(self, topic: str, *bodies: bytes) -> None:
        """Publish each body to ``topic`` over HTTP (``/pub``; ``/mpub`` for more than one).
        Raises ``httpx.HTTPStatusError`` when nsqd refuses it."""
        if len(bodies) == 1:
            r = httpx.post(f"http://{self.http_address}/pub", params={"topic": topic}, content=bodies[0])
        else:
            r = httpx.post(f"http://{self.http_address}/mpub", params={"topic": topic, "binary": "true"},
                           content=len(bodies).to_bytes(4, "big") + b"".join(
                               len(b).to_bytes(4, "big") + b for b in bodies))
        r.raise_for_status()

    def stats(self) -> dict[str, Any]:
        """nsqd's ``/stats?format=json`` as a dict."""
        r = httpx.get(f"http://{self.http_address}/stats", params={"format": "json"})
        r.raise_for_status()
        return r.json()

    def depth(self, topic: str, channel: str | None = None) -> int:
        """The depth of ``topic`` (or of ``channel`` on it) from ``/stats``; 0 when it does not exist."""
        for t in self.stats().get("topics", []):
            if t["topic_name"] == topic:
                if channel is None:
                    return t["depth"]
                for c in t["channels"]:
                    if c["channel_name"] == channel:
                        return c["depth"]
        return 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} tcp={self.tcp_address} http={self.http_address}>"


_LISTENING = re.compile(r"(TCP|HTTP): listening on (\S+)")


@contextlib.contextmanager
def _subprocess(module: str, base: Path, data: bool) -> Iterator[NSQServer]:
    """Start on port 0 and read the bound addresses from the start-up lines, as nsqd prints them: no
    port can be taken by someone else between choosing it and binding it."""
    argv = [sys.executable, "-m", f"trio_nsq.{module}", "--tcp-address=127.0.0.1:0", "--http-address=127.0.0.1:0"]
    if data:
        argv += [f"--data-path={base}", "--https-address=127.0.0.1:0", "--broadcast-address=127.0.0.1"]
    log_path = base / f"{module}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            found = dict(_LISTENING.findall(log_path.read_text(errors="replace")))
            if "TCP" in found and "HTTP" in found:
                tcp, http = found["TCP"], found["HTTP"]
                break
            if proc.poll() is not None:
                pytest.fail(f"{module} exited with {proc.returncode}: {log_path.read_text(errors='replace')}")
            if time.monotonic() > deadline:
                pytest.fail(f"{module} did not start listening in {START_TIMEOUT}s")
            time.sleep(0.05)
        yield NSQServer(tcp, http, str(base) if data else "")
    finally:
        proc.terminate()  # SIGTERM: nsqd's clean exit
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def _server(config: pytest.Config, module: str, base: Path) -> Iterator[NSQServer]:
    if config.getoption("--nsq-mode") == "inprocess":
        from trio_nsq.testing.embed import nsqd_in_thread, nsqlookupd_in_thread

        if module == "broker":
            with nsqd_in_thread(data_path=str(base)) as r:
                yield NSQServer(r.tcp_address, r.http_address, r.data_path)
        else:
            with nsqlookupd_in_thread() as r:
                yield NSQServer(r.tcp_address, r.http_address)
    else:
        with _subprocess(module, base, data=module == "broker") as server:
            yield server


@pytest.fixture
def nsqd(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NSQServer]:
    """A fresh nsqd for this test (data in a temporary directory)."""
    with _server(request.config, "broker", tmp_path_factory.mktemp("nsqd")) as server:
        yield server


@pytest.fixture
def nsqlookupd(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NSQServer]:
    """A fresh nsqlookupd for this test."""
    with _server(request.config, "lookupd", tmp_path_factory.mktemp("nsqlookupd")) as server:
        yield server


@pytest.fixture(scope="session")
def nsqd_session(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NSQServer]:
    """One nsqd shared by the whole session: use topic names unique to each test."""
    with _server(request.config, "broker", tmp_path_factory.mktemp("nsqd_session")) as server:
        yield server


@pytest.fixture(scope="session")
def nsqlookupd_session(request: pytest.FixtureRequest,
                       tmp_path_factory: pytest.TempPathFactory) -> Iterator[NSQServer]:
    """One nsqlookupd shared by the whole session."""
    with _server(request.config, "lookupd", tmp_path_factory.mktemp("nsqlookupd_session")) as server:
        yield server
