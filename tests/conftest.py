"""Shared fixtures: real broker processes on free loopback ports (started by tests/processes.py).

``broker`` starts ``python -m trio_nsq.broker`` (== ``trio-nsqd``) with a fresh data directory; ``broker_factory``
does the same with nsqd flags given as keyword arguments (``msg_timeout="1s"`` becomes
``--msg-timeout=1s``). Every broker started through them is stopped when the test ends, whatever
happened. A broker's output goes to a file under the test's tmp_path so a failing test can show it.

Set ``NSQD_REFERENCE_BIN=/path/to/nsqd`` to run the same process-level tests against Go nsqd (same
flag names) instead of ``python -m trio_nsq.broker``: that is how the expectations were checked against the
reference implementation.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from processes import REPO_ROOT, BrokerProcess


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compiled modules older than their sources would test yesterday's code: refuse to start."""
    from trio_nsq import compiled

    stale = compiled.stale_modules() if compiled.enabled() else []
    if stale:
        pytest.exit(f"compiled modules older than their .py files: {', '.join(stale)} "
                    f"(rebuild: `make test` or `pip install -e .`; or run the sources: {compiled.ENV}=0)", returncode=2)


@pytest.fixture
def broker_factory(tmp_path):
    """``broker_factory(**flags) -> Broker`` (started). All are stopped at teardown."""
    started: list[BrokerProcess] = []

    def factory(**flags: object) -> BrokerProcess:
        b = BrokerProcess(tmp_path, **flags)
        started.append(b)
        return b.start()

    yield factory
    for b in started:
        b.stop()


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Callable[[str], Path]]:
    """``small_disk("2m") -> Path``: a tmpfs of that size, mounted for the test (a disk that really
    fills up), unmounted at teardown. Needs root, as CI has."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"small{len(mounted)}"
        mnt.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True)
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def small_disk_broker(small_disk) -> Iterator[Callable[..., BrokerProcess]]:
    """``small_disk_broker("2m", **flags) -> BrokerProcess``: a broker started with its data directory
    on a small_disk of that size; killed at teardown (before the disk is unmounted)."""
    started: list[BrokerProcess] = []

    def start(size: str, **flags: object) -> BrokerProcess:
        broker = BrokerProcess(small_disk(size), **flags)
        started.append(broker)
        return broker.start()

    yield start
    for broker in started:
        broker.kill()


@pytest.fixture(scope="module")
def module_broker(tmp_path_factory) -> Iterator[BrokerProcess]:
    """One broker with default flags shared by the tests of a module (each uses its own topics)."""
    broker = BrokerProcess(tmp_path_factory.mktemp("module-broker")).start()
    yield broker
    broker.stop()


@pytest.fixture
def broker(broker_factory) -> BrokerProcess:
    """A broker with default flags, fresh data directory, free loopback ports."""
    return broker_factory()


# --- Spark: one local SparkSession for the whole run, shared by every tests/test_spark*.py file -------


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    """One local[2,2] SparkSession for the run (2 cores; a failed task is run again once, as
    spark.task.maxFailures=2 would on a cluster: local mode reads it from the master URL), on loopback,
    UI off, its JVM (and so its Python workers)
    started outside the repo and without the repo on PYTHONPATH: the workers import `trio_nsq.spark` from
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
    check = subprocess.run([sys.executable, "-c", "import trio_nsq.spark.datasource, pyspark_nsq"], cwd=workdir,
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
