"""Helpers for the HTTP API tests: a real ``python -m broker`` on free loopback ports, its memory, and
third-party consumers (gnsq, pynsq) run in a subprocess with a hard timeout.

Kept apart from conftest.py on purpose: these tests need nothing but a process, two ports, a data
directory and the broker's RSS, and should not move when the shared fixtures do.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def repo_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


class BrokerProcess:
    """``python -m broker`` with a fresh data directory; ``start()`` returns once /ping answers."""

    def __init__(self, base_dir: Path, *flags: str, env: dict[str, str] | None = None) -> None:
        self.data_path = Path(base_dir) / "data"
        self.data_path.mkdir(parents=True, exist_ok=True)
        self.log_path = Path(base_dir) / "broker.log"
        self.tcp_port = free_port()
        self.http_port = free_port()
        while self.http_port == self.tcp_port:
            self.http_port = free_port()
        self.flags = list(flags)
        self.env = env or {}
        self.proc: subprocess.Popen | None = None

    @property
    def tcp_address(self) -> str:
        return f"127.0.0.1:{self.tcp_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "broker", f"--tcp-address={self.tcp_address}",
                f"--http-address=127.0.0.1:{self.http_port}", f"--data-path={self.data_path}", *self.flags]

    def start(self, timeout: float = 15.0, ready_url: str | None = None) -> BrokerProcess:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv(), cwd=str(REPO_ROOT), env=repo_env(**self.env),
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        url = ready_url or f"{self.http_url}/ping"
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"broker exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(url, timeout=0.5, verify=False).status_code in (200, 403):
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"broker did not answer {url} within {timeout}s:\n{self.log_text()}")
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except FileNotFoundError:
            return ""

    def memory(self) -> dict[str, int]:
        """VmRSS and VmHWM (peak RSS) of the broker process, in bytes."""
        assert self.proc is not None
        out = {}
        with open(f"/proc/{self.proc.pid}/status") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0]) * 1024
        return out

    def metadata(self) -> dict | None:
        try:
            return json.loads((self.data_path / "nsqd.dat").read_text())
        except (FileNotFoundError, ValueError):
            return None


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.05, message: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{message} not met within {timeout}s (last value {value!r})")
        time.sleep(interval)


# --- third-party consumers ----------------------------------------------------------------------

_CONSUMER_COMMON = r"""
import base64, json, sys, time
spec = json.loads(sys.argv[1])
received = []
start = time.monotonic()
def record(body, attempts):
    received.append({"body": base64.b64encode(bytes(body)).decode(), "attempts": attempts,
                     "at": time.monotonic() - start})
def done():
    return len(received) >= spec["expect"] or time.monotonic() - start > spec["max_seconds"]
def report():
    sys.stdout.write("RESULT " + json.dumps({"messages": received}) + "\n")
    sys.stdout.flush()
"""

CONSUMER_SCRIPTS = {
    "gnsq": _CONSUMER_COMMON + r"""
import logging
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
import gevent, gnsq
consumer = gnsq.Consumer(spec["topic"], spec["channel"], nsqd_tcp_addresses=[spec["address"]],
                         max_in_flight=100)
@consumer.on_message.connect
def handler(consumer, message):
    record(message.body, message.attempts)
consumer.start(block=False)
while not done():
    gevent.sleep(0.02)
gevent.sleep(spec.get("quiet", 0.3))  # duplicates would show up here
consumer.close()
report()
""",
    "pynsq": _CONSUMER_COMMON + r"""
import logging
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
import tornado.ioloop, nsq
loop = tornado.ioloop.IOLoop.current()
def handler(message):
    record(message.body, message.attempts)
    return True
reader = nsq.Reader(topic=spec["topic"], channel=spec["channel"], message_handler=handler,
                    nsqd_tcp_addresses=[spec["address"]], max_in_flight=100)
def check():
    if done():
        loop.call_later(spec.get("quiet", 0.3), finish)
    else:
        loop.call_later(0.02, check)
def finish():
    reader.close()
    report()
    loop.stop()
loop.call_later(0.02, check)
loop.start()
""",
}


def consume(lib: str, address: str, topic: str, channel: str, expect: int, max_seconds: float = 15.0) -> list[dict]:
    """Run a third-party consumer until it got `expect` messages (or max_seconds); its records."""
    spec = {"address": address, "topic": topic, "channel": channel, "expect": expect, "max_seconds": max_seconds}
    proc = subprocess.run([sys.executable, "-c", CONSUMER_SCRIPTS[lib], json.dumps(spec)],
                          capture_output=True, timeout=max_seconds + 20, stdin=subprocess.DEVNULL)
    lines = [line for line in proc.stdout.decode(errors="replace").splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"{lib} consumer failed ({proc.returncode}):\n{proc.stdout.decode(errors='replace')[-3000:]}\n"
        f"{proc.stderr.decode(errors='replace')[-3000:]}"
    )
    return json.loads(lines[-1][len("RESULT "):])["messages"]
