"""A trio-nsqd (or Go nsqd) process for one benchmark scenario: fresh data directory, free loopback ports,
started by tests/processes.py as the tests start theirs; `startup` is how long it took to accept."""

from __future__ import annotations

import shutil
import socket
import tempfile
import time
import urllib.request
from pathlib import Path

from trio_nsq.shared.protocol import MAGIC_V2, encode_sub
from trio_nsq.spark.publisher import MPubClient
from tests.bench.machine import process_stat
from tests.processes import BrokerProcess


class Broker(BrokerProcess):
    """`command` is the nsqd to run: trio-nsqd by default, or a Go nsqd binary (same flags)."""

    ready_by_log = False  # --log-level=warn hides the listening lines
    poll_interval = 0.005  # `startup` is a figure of the bench

    def __init__(self, *flags: str, env: dict[str, str] | None = None, command: list[str] | None = None) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="trio-nsq-bench-"))
        super().__init__(self.tmp, "--log-level=warn", *flags, env=env)
        self._command = command
        started = time.perf_counter()
        self.start()
        self.startup = time.perf_counter() - started

    def command(self) -> list[str]:
        return self._command or super().command()

    @property
    def tcp(self) -> tuple[str, int]:
        return ("127.0.0.1", self.tcp_port)

    def create_channel(self, topic: str, channel: str) -> None:
        with socket.create_connection(self.tcp) as sock:
            sock.sendall(MAGIC_V2 + encode_sub(topic, channel))
            sock.recv(100)

    def cpu_seconds(self) -> float:
        """User + system CPU time of the broker process (every thread), from /proc."""
        return process_stat(self.proc.pid)[1]

    def rss_mb(self) -> float:
        return self.memory()["VmRSS"] / (1024 * 1024)

    def close(self) -> None:
        self.stop(timeout=20)
        shutil.rmtree(self.tmp, ignore_errors=True)


def publish(http: str, topic: str, count: int) -> None:
    """`count` messages (b"message-00000000", ...) published to `topic` through HTTP /mpub, 5,000 a request:
    a backlog for the read benches."""
    with MPubClient([http]) as client:
        bodies = [b"message-%08d" % i for i in range(count)]
        for i in range(0, len(bodies), 5000):
            client.publish(topic, bodies[i:i + 5000])


def post(url: str, timeout: float = 10.0) -> None:
    """An empty POST (/topic/create, /channel/create, ...) whose answer is read and dropped; raises on an
    HTTP error."""
    urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=timeout).read()
