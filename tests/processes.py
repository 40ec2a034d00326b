"""Real broker and lookupd processes for the tests and the bench, started in one way.

    from processes import BrokerProcess, LookupdProcess, free_port, wait_for

    broker = BrokerProcess(tmp_path, mem_queue_size=0, msg_timeout="1s").start()   # --mem-queue-size=0 ...
    lookupd = LookupdProcess(tmp_path, "--tombstone-lifetime=1s").start()         # flags as strings work too
    broker.tcp_address, broker.http_url, broker.http.get("/stats")                # addresses, an httpx client
    broker.restart(); broker.kill(); broker.stop()                                # same ports and data dir
    broker.log_text()                                                             # stdout and stderr

Ports are free loopback ports chosen at creation and kept across restarts (durability tests restart a
broker where its clients expect it). start() returns once the process has logged `TCP: listening on`
and `HTTP: listening on` (the ports are read from those lines, so `--http-address=127.0.0.1:0` works),
or fails the test with the process's log. Keyword flags are nsqd's names (`msg_timeout="1s"` becomes
`--msg-timeout=1s`, True a bare flag). The commands are `python -m trio_nsq.broker` and `python -m trio_nsq.lookupd`
(BROKER_MODULE, LOOKUPD_MODULE); NSQD_REFERENCE_BIN=/path/to/nsqd runs Go nsqd in place of the broker,
to check a test's expectations against the real thing. The fixtures built on these are in conftest.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
BROKER_MODULE = "trio_nsq.broker"
LOOKUPD_MODULE = "trio_nsq.lookupd"
ADMIN_MODULE = "trio_nsq.lookupd.admin"
REFERENCE_BIN = os.environ.get("NSQD_REFERENCE_BIN")

START_TIMEOUT = 15.0
_LISTENING = re.compile(r"\b(TCP|HTTP): listening on \S+:(\d+)")
STOP_TIMEOUT = 10.0


def _ephemeral_low() -> int:
    """Where the kernel's range for outgoing connections' local ports starts."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


_handed_out: set[int] = set()
_pick = random.Random()  # its own: a test seeding the global generator must not replay our picks


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, below the kernel's ephemeral range.

    Not a port from bind(("127.0.0.1", 0)): that comes from the ephemeral range, where every outgoing
    connection takes its own port too, so a broker restarted after kill -9 on "its" port could find a
    client's connection holding it ("Address already in use", seen once in CI). Ports are picked at
    random from [10000, low end of that range), each at most once per test process, and bind-checked."""
    low = _ephemeral_low()
    floor = 10000 if low > 12000 else 1024
    for _ in range(1000):
        port = _pick.randrange(floor, low)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise AssertionError(f"no free port found in [{floor}, {low})")


def repo_env(**extra: str) -> dict[str, str]:
    """The environment a daemon runs in: this checkout first on the path, output unbuffered."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def flag(name: str, value: object) -> str:
    name = name.replace("_", "-")
    return f"--{name}" if value is True else f"--{name}={value}"


def accepts(port: int) -> bool:
    """Whether a TCP connection to 127.0.0.1:port is accepted now."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_for(predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.02, message: str = "condition",
             ignore: tuple[type[BaseException], ...] = ()) -> Any:
    """Poll until predicate() is truthy and return it; AssertionError after `timeout` seconds. Exceptions
    in `ignore` count as "not yet" until the deadline, then propagate."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except ignore:
            if time.monotonic() > deadline:
                raise
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT) -> int | None:
    """Send `sig` to a child still running and wait; SIGKILL if it does not exit in time. Its exit code."""
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class Daemon:
    """One daemon process on two free loopback ports kept for its life (see the module docstring)."""

    module = ""
    counter = 0
    ready_by_log = True
    listeners = ("TCP", "HTTP")  # the `<kind>: listening on` lines start() waits for
    poll_interval = 0.03

    def __init__(self, base_dir: Path, *args: str, env: dict[str, str] | None = None, **flags: object) -> None:
        Daemon.counter += 1
        self.name = f"{self.module.rsplit('.', 1)[-1]}{Daemon.counter}"
        self.base_dir = Path(base_dir)
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.base_dir / f"{self.name}.log"
        self.tcp_port = free_port()
        self.http_port = free_port()
        while self.http_port == self.tcp_port:
            self.http_port = free_port()
        self.args = list(args)
        self.flags: dict[str, object] = dict(flags)
        self.env = dict(env or {})  # extra environment (e.g. LD_PRELOAD)
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self._log_file: Any = None
        self._http: httpx.Client | None = None

    # -- addresses ----------------------------------------------------------------------------------

    host = "127.0.0.1"

    @property
    def tcp_address(self) -> str:
        return f"127.0.0.1:{self.tcp_port}"

    @property
    def http_address(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def http(self) -> httpx.Client:
        """An httpx client on this daemon's HTTP address (closed with the daemon)."""
        if self._http is None:
            self._http = httpx.Client(base_url=self.http_url, timeout=5.0)
        return self._http

    def get(self, path: str) -> httpx.Response:
        return self.http.get(path)

    # -- life ---------------------------------------------------------------------------------------

    def command(self) -> list[str]:
        return [sys.executable, "-m", self.module]

    def argv(self) -> list[str]:
        return [*self.command(), f"--tcp-address={self.tcp_address}", f"--http-address={self.http_address}",
                *(flag(k, v) for k, v in self.flags.items()), *self.args]

    def start(self, timeout: float = START_TIMEOUT, ready_url: str | None = None) -> Daemon:
        """Start and wait until both ports accept connections (and ready_url answers, if given)."""
        assert not self.is_alive(), f"{self.name} already running"
        self._close_log()
        self.starts += 1
        argv = self.argv()
        self._log_file = open(self.log_path, "ab")  # appended: a restart keeps the earlier log above
        if self.starts > 1:
            self._log_file.write(f"==== start #{self.starts}: {' '.join(argv)}\n".encode())
            self._log_file.flush()
        offset = self._log_file.tell()
        self.proc = subprocess.Popen(argv, cwd=str(REPO_ROOT), env=repo_env(**self.env), stdin=subprocess.DEVNULL,
                                     stdout=self._log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self._ready(offset, ready_url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"{self.name} did not start (exit code {self.proc.returncode})\n"
                                     f"--- argv: {argv}\n--- log:\n{self.log_text()[-6000:]}")
            time.sleep(self.poll_interval)
        return self

    def _ready(self, offset: int, ready_url: str | None) -> bool:
        """Both `TCP: listening on` and `HTTP: listening on` logged by this start (as nsqd and nsqlookupd
        log them; the ports are read from them, so a flag of port 0 works too), then ready_url answers.
        With `ready_by_log` off (a --log-level above info hides those lines) both ports must accept."""
        if self.ready_by_log:
            found = {kind: int(port) for kind, port in _LISTENING.findall(self.log_text(offset))}
            if any(kind not in found for kind in self.listeners):
                return False
            self.tcp_port, self.http_port = found.get("TCP", self.tcp_port), found["HTTP"]
        elif not (accepts(self.tcp_port) and accepts(self.http_port)):
            return False
        if ready_url is None:
            return True
        try:
            return httpx.get(ready_url, timeout=0.5, verify=False).status_code in (200, 403)
        except httpx.HTTPError:
            return False

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT) -> int | None:
        """Send `sig` (SIGTERM) and wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.proc is None:
            return None
        code = stop_process(self.proc, sig, timeout)
        self._close_log()
        return code

    def kill(self) -> int | None:
        """SIGKILL (no shutdown path at all) and reap."""
        return self.stop(signal.SIGKILL)

    def restart(self, timeout: float = START_TIMEOUT) -> Daemon:
        self.stop()
        return self.start(timeout)

    def _close_log(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def log_text(self, offset: int = 0) -> str:
        """The log from byte `offset` on (a start's offset is the file's size then: in bytes, not in
        characters, which differ once a line holds a character of more than one byte, as Go's `µs`)."""
        if self._log_file is not None:
            self._log_file.flush()
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(offset)
                return fh.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def __repr__(self) -> str:
        state = "alive" if self.is_alive() else "stopped"
        return f"<{self.name} tcp={self.tcp_address} http={self.http_address} {state}>"


class BrokerProcess(Daemon):
    """`python -m trio_nsq.broker` (or Go nsqd, see REFERENCE_BIN) with its own data directory."""

    module = BROKER_MODULE

    def __init__(self, base_dir: Path, *args: str, env: dict[str, str] | None = None, **flags: object) -> None:
        super().__init__(base_dir, *args, env=env, **flags)
        self.data_path = self.base_dir / f"{self.name}-data"
        self.data_path.mkdir(parents=True, exist_ok=True)

    def command(self) -> list[str]:
        return [REFERENCE_BIN] if REFERENCE_BIN else super().command()

    def argv(self) -> list[str]:
        if "tls_cert" in self.flags and "https_address" not in self.flags and not REFERENCE_BIN:
            # nsqd's default HTTPS address is 0.0.0.0:4152: tests keep to loopback and free ports
            self.flags["https_address"] = f"127.0.0.1:{free_port()}"
        return [*super().argv(), f"--data-path={self.data_path}"]

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


class LookupdProcess(Daemon):
    """`python -m trio_nsq.lookupd`."""

    module = LOOKUPD_MODULE


class AdminProcess(Daemon):
    """`python -m trio_nsq.lookupd.admin` (trio-nsqadmin): HTTP only."""

    module = ADMIN_MODULE
    listeners = ("HTTP",)

    def argv(self) -> list[str]:
        return [*self.command(), f"--http-address={self.http_address}",
                *(flag(k, v) for k, v in self.flags.items()), *self.args]
