"""The installed package: one import name, trio_nsq (plus Spark's pyspark_nsq discovery module), whatever
the repository's folders are called, so an application's or a Spark job's own `broker` or `shared` module
is never shadowed. Built as `pip install .` builds it, run from the built files alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from trio_nsq import compiled

REPO_ROOT = Path(__file__).resolve().parent.parent


def build_wheel(out: Path) -> Path:
    """Built from a copy of the sources, as from a fresh clone: an earlier build/ here must not leak in."""
    source = out.parent / "source"
    shutil.copytree(REPO_ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", "data"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(source)],
                   check=True, capture_output=True)
    (wheel,) = out.glob("trio_nsq-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """One build for the module's tests (a compiled build takes a minute)."""
    return build_wheel(tmp_path_factory.mktemp("wheel") / "dist")


@pytest.fixture(scope="module")
def site(wheel, tmp_path_factory) -> Path:
    """The wheel's files extracted: what `pip install` of it puts in site-packages."""
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site


def test_the_wheel_installs_only_trio_nsq_and_pyspark_nsq(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        top_level = archive.read(next(n for n in names if n.endswith(".dist-info/top_level.txt"))).decode().split()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    # compiled, mypyc's runtime library is trio_nsq/hot_path__mypyc.*.so, not a top-level module
    assert tops == {"trio_nsq", "pyspark_nsq.py"}, tops
    assert sorted(top_level) == ["pyspark_nsq", "trio_nsq"]
    for part in ("broker/nsqd.py", "lookupd/nsqlookupd.py", "shared/protocol.py", "client/consumer.py",
                 "spark/datasource.py", "lookupd/admin/api.py", "lookupd/admin/static/app.js", "client/__init__.py",
                 "spark/__init__.py", "apps/nsq_tail.py", "testing/pytest_plugin.py", "testing/embed.py"):
        assert f"trio_nsq/{part}" in names, part


def test_the_wheel_holds_the_compiled_modules_where_they_can_be_built(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    shipped = {n.split(".", 1)[0].replace("/", ".") for n in names if n.endswith(".so")}
    if compiled.why_not_compiled() is None:
        assert shipped == {*compiled.MODULES, compiled.GROUP + "__mypyc"}, shipped
        assert all(f"{m.replace('.', '/')}.py" in names for m in compiled.MODULES)  # the sources ship too
    else:
        assert not shipped


def test_the_built_package_runs_from_its_own_files(site, tmp_path):
    """The wheel's files alone, first on the path and run away from the checkout: the commands start and
    every public name resolves inside the built package."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    for module, name in (("trio_nsq.broker", "nsqd"), ("trio_nsq.lookupd", "nsqlookupd")):
        done = subprocess.run([sys.executable, "-m", module, "--version"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stdout.startswith(f"{name} v1.3.0"), (done.stdout, done.stderr)
    script = (
        "import trio_nsq, trio_nsq.client, trio_nsq.spark, pyspark_nsq, sys\n"
        "from trio_nsq import Producer, Consumer, run_nsqd, nsqd_in_thread\n"
        "assert trio_nsq.client.Producer is Producer\n"
        "assert pyspark_nsq.DefaultSource is trio_nsq.spark.NSQDataSource\n"
        "assert not {'broker', 'lookupd', 'shared'} & set(sys.modules), sorted(sys.modules)\n"
        "print(trio_nsq.__file__, trio_nsq.broker.__file__ if hasattr(trio_nsq, 'broker') else '')\n"
        "import trio_nsq.broker.nsqd\n"
        "print(trio_nsq.broker.nsqd.__file__)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert all(line.startswith(str(site)) for line in done.stdout.split()), done.stdout


def test_the_daemon_from_the_wheels_files_listens(site, tmp_path):
    """Not just --version: nsqd started from the built files alone (compiled modules and all) serves.
    Its stderr goes to a file read until a deadline, so a daemon that never gets there fails the test
    instead of hanging it on a pipe."""
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONUNBUFFERED": "1"}
    env.pop(compiled.ENV, None)
    log = tmp_path / "nsqd.log"
    script = "import trio_nsq.compiled as c, runpy; print('compiled:', len(c.compiled_modules()), flush=True); " \
             "runpy.run_module('trio_nsq.broker', run_name='__main__')"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", script, "--tcp-address=127.0.0.1:0",
                                 "--http-address=127.0.0.1:0", f"--data-path={tmp_path}"],
                                cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "TCP: listening on" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        text = log.read_text()
        assert "TCP: listening on" in text, text
        expected = len(compiled.MODULES) if compiled.why_not_compiled() is None else 0
        assert f"compiled: {expected}\n" in text, text
    finally:
        proc.terminate()
        proc.wait(timeout=20)
