"""A trio-nsqd process for one benchmark scenario: fresh data directory, free loopback ports.

The broker binds HTTP before TCP, so once its TCP port accepts connections both are up.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from shared.protocol import MAGIC_V2, encode_sub


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Broker:
    """`command` is the nsqd to run: trio-nsqd by default, or a Go nsqd binary (same flags)."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None, command: list[str] | None = None) -> None:
        self.data = tempfile.mkdtemp(prefix="trio-nsq-bench-")
        self.tcp = ("127.0.0.1", free_port())
        self.http = ("127.0.0.1", free_port())
        self.log = open(os.path.join(self.data, "broker.log"), "wb")
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            [*(command or [sys.executable, "-m", "broker"]), f"--tcp-address={self.tcp[0]}:{self.tcp[1]}",
             f"--http-address={self.http[0]}:{self.http[1]}", f"--data-path={self.data}",
             "--log-level=warn", *flags],
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
        )
        self.url = f"http://{self.http[0]}:{self.http[1]}"
        self.startup = self._wait_ready(started)

    def _wait_ready(self, started: float) -> float:
        deadline = started + 15
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited: {open(self.log.name).read()[-2000:]}")
            try:
                socket.create_connection(self.tcp, timeout=0.2).close()
                return time.perf_counter() - started
            except OSError:
                time.sleep(0.005)
        raise RuntimeError("broker did not start")

    def create_channel(self, topic: str, channel: str) -> None:
        with socket.create_connection(self.tcp) as sock:
            sock.sendall(MAGIC_V2 + encode_sub(topic, channel))
            sock.recv(100)

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.data, ignore_errors=True)
