"""Shared fixtures: real broker processes on free loopback ports.

``broker`` starts ``python -m broker`` (== ``trio-nsqd``) with a fresh data directory; ``broker_factory``
does the same with nsqd flags given as keyword arguments (``msg_timeout="1s"`` becomes
``--msg-timeout=1s``). Every broker started through them is stopped when the test ends, whatever
happened. A broker's stderr goes to a file under the test's tmp_path so a failing test can show it.

Set ``NSQD_REFERENCE_BIN=/path/to/nsqd`` to run the same process-level tests against Go nsqd (same
flag names) instead of ``python -m broker``: that is how the expectations were checked against the
reference implementation.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

REFERENCE_BIN = os.environ.get("NSQD_REFERENCE_BIN")

START_TIMEOUT = 10.0
STOP_TIMEOUT = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flag(name: str, value: object) -> str:
    name = name.replace("_", "-")
    if value is True:
        return f"--{name}"
    return f"--{name}={value}"


class Broker:
    """One ``python -m broker`` process.

    ``start()`` waits until the TCP port accepts connections; ``stop()`` sends SIGTERM and waits
    (SIGKILL after STOP_TIMEOUT); ``kill()`` sends SIGKILL. ``restart()`` starts it again on the
    same ports and data directory (for durability tests).
    """

    _counter = 0

    def __init__(self, base_dir: Path, **flags: object):
        Broker._counter += 1
        self.name = f"broker{Broker._counter}"
        self.base_dir = Path(base_dir)
        self.data_path = self.base_dir / f"{self.name}-data"
        self.data_path.mkdir(parents=True, exist_ok=True)
        self.stderr_path = self.base_dir / f"{self.name}.stderr.log"
        self.stdout_path = self.base_dir / f"{self.name}.stdout.log"
        self.tcp_port = free_port()
        self.http_port = free_port()
        while self.http_port == self.tcp_port:
            self.http_port = free_port()
        self.flags = dict(flags)
        self.env: dict[str, str] = {}  # extra environment for the process (e.g. LD_PRELOAD)
        self.proc: subprocess.Popen | None = None
        self._stderr_file = None
        self._stdout_file = None
        self.starts = 0

    # -- addresses ------------------------------------------------------------------------

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def tcp_address(self) -> str:
        return f"127.0.0.1:{self.tcp_port}"

    @property
    def http_address(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    # -- lifecycle ------------------------------------------------------------------------

    def argv(self) -> list[str]:
        command = [REFERENCE_BIN] if REFERENCE_BIN else [sys.executable, "-m", "broker"]
        args = command + [
            f"--tcp-address={self.tcp_address}",
            f"--http-address={self.http_address}",
            f"--data-path={self.data_path}",
        ]
        if "tls_cert" in self.flags and "https_address" not in self.flags and not REFERENCE_BIN:
            # nsqd's default HTTPS address is 0.0.0.0:4152: tests keep to loopback and free ports
            self.flags["https_address"] = f"127.0.0.1:{free_port()}"
        args += [_flag(k, v) for k, v in self.flags.items()]
        return args

    def start(self, timeout: float = START_TIMEOUT) -> Broker:
        assert self.proc is None or self.proc.poll() is not None, "broker already running"
        self._close_files()
        self.starts += 1
        # append, so a restarted broker keeps the earlier log above a marker line
        self._stderr_file = open(self.stderr_path, "ab")
        self._stdout_file = open(self.stdout_path, "ab")
        marker = f"==== start #{self.starts}: {' '.join(self.argv())}\n".encode()
        self._stderr_file.write(marker)
        self._stderr_file.flush()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.env)
        self.proc = subprocess.Popen(
            self.argv(),
            cwd=str(REPO_ROOT),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._stdout_file,
            stderr=self._stderr_file,
        )
        self._wait_listening(timeout)
        return self

    def _wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"{self.name} exited with code {self.proc.returncode} before listening on "
                    f"{self.tcp_address}\n--- argv: {self.argv()}\n--- stderr:\n{self.stderr_text()}",
                    pytrace=False,
                )
            try:
                with socket.create_connection(("127.0.0.1", self.tcp_port), timeout=0.5):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(
                    f"{self.name} did not accept TCP connections on {self.tcp_address} within "
                    f"{timeout}s\n--- argv: {self.argv()}\n--- stderr:\n{self.stderr_text()}",
                    pytrace=False,
                )
            time.sleep(0.05)

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_files()
        return self.proc.returncode

    def kill(self) -> int | None:
        """SIGKILL (no shutdown path at all) and reap."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._close_files()
        return self.proc.returncode

    def restart(self, timeout: float = START_TIMEOUT) -> Broker:
        self.stop()
        return self.start(timeout)

    def _close_files(self) -> None:
        for f in (self._stderr_file, self._stdout_file):
            if f is not None:
                f.close()
        self._stderr_file = self._stdout_file = None

    # -- inspection -----------------------------------------------------------------------

    def stderr_text(self) -> str:
        if self._stderr_file is not None:
            self._stderr_file.flush()
        try:
            return self.stderr_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def __repr__(self) -> str:
        state = "alive" if self.is_alive() else "stopped"
        return f"<Broker {self.name} tcp={self.tcp_address} http={self.http_address} {state}>"


@pytest.fixture
def broker_factory(tmp_path):
    """``broker_factory(**flags) -> Broker`` (started). All are stopped at teardown."""
    started: list[Broker] = []

    def factory(**flags: object) -> Broker:
        b = Broker(tmp_path, **flags)
        started.append(b)
        return b.start()

    yield factory
    for b in started:
        b.stop()


@pytest.fixture
def broker(broker_factory) -> Broker:
    """A broker with default flags, fresh data directory, free loopback ports."""
    return broker_factory()


# --- Spark: one local SparkSession for the whole run, shared by every tests/test_spark*.py file -------


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    """One local[2,2] SparkSession for the run (2 cores; a failed task is run again once, as
    spark.task.maxFailures=2 would on a cluster: local mode reads it from the master URL), on loopback,
    UI off, its JVM (and so its Python workers)
    started outside the repo and without the repo on PYTHONPATH: the workers import `shared.spark` from
    the installed package.

    The format "nsq" is not registered here: Spark finds it by itself, as it finds any top-level
    `pyspark_*` module exporting DefaultSource. An editable install (`pip install -e`) hides top-level
    modules from that scan (pkgutil cannot list what setuptools' editable finder serves), so pyspark_nsq.py
    is put on the workers' path from a directory of its own, where a regular install would put it."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        pytest.fail("the Spark tests need the spark extra: pip install -e '.[test,spark]'", pytrace=False)

    workdir = tmp_path_factory.mktemp("spark-cwd")
    discovery = tmp_path_factory.mktemp("spark-discovery")
    shutil.copy(REPO_ROOT / "pyspark_nsq.py", discovery / "pyspark_nsq.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(discovery), SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable,
               PYSPARK_DRIVER_PYTHON=sys.executable)
    check = subprocess.run([sys.executable, "-c", "import shared.spark.datasource, pyspark_nsq"], cwd=workdir,
                           env=env, capture_output=True, text=True)
    if check.returncode:
        pytest.fail(f"Spark's workers could not import the connector outside the repo; install the package "
                    f"(pip install -e '.[test,spark]'):\n{check.stderr[-2000:]}", pytrace=False)
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        session = (
            SparkSession.builder.master("local[2,2]").appName("trio-nsq-tests")
            .config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.host", "127.0.0.1")
            .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
            .getOrCreate()
        )
    finally:
        os.chdir(cwd)  # the JVM keeps workdir; the other test files keep theirs
        os.environ.clear()
        os.environ.update(saved)
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
