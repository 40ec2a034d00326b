"""The installed package: one import name, trio_nsq (plus Spark's pyspark_nsq discovery module), whatever
the repository's folders are called, so an application's or a Spark job's own `broker` or `shared` module
is never shadowed. Built as `pip install .` builds it, run from the built files alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
import tomllib
import zipfile
from pathlib import Path

import pytest
from processes import BrokerProcess
from test_pytest_plugin import USER_TEST

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


STALE_WARNING = "compiled modules older than their .py files"


def test_file_times_are_a_checkouts_question_never_an_installed_wheels(site, tmp_path):
    """Every .py newer than its compiled module: the wheel's files with their RECORD (installed) stay
    quiet; the same files without it (a checkout: an editable install, the repository on PYTHONPATH)
    warn, naming each module, so an edit that did not reach the compiled code is still said."""
    copy = tmp_path / "site"
    shutil.copytree(site, copy)
    now = time.time()
    for path in (copy / "trio_nsq").rglob("*"):
        os.utime(path, (now, now - 60 if path.suffix == ".so" else now))
    env = {**os.environ, "PYTHONPATH": str(copy)}
    env.pop(compiled.ENV, None)
    check = [sys.executable, "-c", "import trio_nsq.compiled as c; print(len(c.compiled_modules()))"]

    installed = subprocess.run(check, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    expected = len(compiled.MODULES) if compiled.why_not_compiled() is None else 0
    assert (installed.returncode, installed.stdout, installed.stderr) == (0, f"{expected}\n", ""), installed.stderr

    (record,) = copy.glob("trio_nsq-*.dist-info/RECORD")
    record.unlink()
    checkout = subprocess.run(check, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert checkout.returncode == 0, checkout.stderr
    if expected:
        assert STALE_WARNING in checkout.stderr and all(m in checkout.stderr for m in compiled.MODULES), checkout.stderr
    else:
        assert checkout.stderr == ""  # pure Python: nothing compiled to be stale


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """The wheel, `spark` extra and all, installed by pip into a fresh venv, as a user installs it: pip
    writes the files with its own times and the RECORD. Nothing is downloaded (--no-index): the
    dependencies (trio, pyspark...) come from this test's own environment through a .pth line, so pip
    finds them installed. That environment holds no pyspark_nsq (an editable install has none), so Spark
    can only find the venv's."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    Path(purelib, "_test_dependencies.pth").write_text("".join(f"{path}\n" for path in ours))
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-index",
                           "--no-warn-conflicts", f"{wheel}[spark]"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return venv


def venv_env(venv: Path) -> dict[str, str]:
    """As in an activated venv, away from the checkout: its bin first on PATH, no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", compiled.ENV)}
    return {**env, "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", "VIRTUAL_ENV": str(venv)}


def test_a_users_pytest_run_gets_the_plugin_from_the_installed_wheel(venv, tmp_path):
    """A user's pynsq test naming `nsqd` and `nsqlookupd`, run by pytest in the venv the wheel went into:
    the installed package's pytest11 entry point starts the daemons from the venv's files. (It was a
    `pip install trio-nsq[test]` of its own into another fresh venv: a minute of the suite for the same
    plugin; the dependencies come here through the venv's .pth line.)"""
    work = tmp_path / "user"
    work.mkdir()
    (work / "test_user.py").write_text(USER_TEST)
    # (--basetemp: the user's run keeps its brokers' data dirs under ours, removed with it, not in /tmp)
    done = subprocess.run([venv / "bin" / "python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--basetemp={tmp_path / 'basetemp'}", "test_user.py"], cwd=work, env=venv_env(venv),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout


def test_every_command_of_the_installed_wheel_answers_its_version_without_a_warning(venv, tmp_path):
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"trio-nsqd", "nsqd", "nsq_tail"} <= scripts.keys()
    for script in scripts:
        done = subprocess.run([venv / "bin" / script, "--version"], cwd=tmp_path, env=venv_env(venv),
                              capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stderr) == (0, ""), (script, done.stderr)
        assert done.stdout.startswith(f"{script.removeprefix('trio-')} v1.3.0"), (script, done.stdout)
    check = "import trio_nsq, pyspark_nsq, trio_nsq.compiled as c; print(trio_nsq.__file__, pyspark_nsq.__file__, " \
            "len(c.compiled_modules()))"
    done = subprocess.run([venv / "bin" / "python", "-c", check], cwd=tmp_path, env=venv_env(venv),
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    package, hook, count = done.stdout.split()
    assert package.startswith(str(venv)) and hook.startswith(str(venv)), done.stdout
    assert int(count) == (len(compiled.MODULES) if compiled.why_not_compiled() is None else 0)


SPARK_JOB = """
import sys
from pyspark.sql import SparkSession

http_address, tcp_address = sys.argv[1:]
spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
         .config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.host", "127.0.0.1").getOrCreate())
# no spark.dataSource.register(): "nsq" must be found as Spark finds any installed pyspark_* module
rows = spark.createDataFrame([("one",), ("two",), ("three",)], "value string")
rows.write.format("nsq").option("topic", "installed").option("nsqd_http_address", http_address).mode("append").save()
read = (spark.read.format("nsq").option("topic", "installed").option("channel", "c")
        .option("nsqd_tcp_address", tcp_address).option("partitions_per_broker", 1).option("max_messages", 3)
        .option("idle_timeout", 5000).load())  # one task, done once it has the three
print("read:", ",".join(sorted(bytes(row.value).decode() for row in read.collect())))
spark.stop()
"""


class InstalledBroker(BrokerProcess):
    """The venv's trio-nsqd (its console script: the checkout is neither its cwd's package nor on its path)."""

    def __init__(self, venv: Path, base_dir: Path) -> None:
        super().__init__(base_dir, env={"PYTHONPATH": ""})
        self.script = venv / "bin" / "trio-nsqd"

    def command(self) -> list[str]:
        return [str(self.script)]


def test_spark_finds_the_installed_format_by_itself_and_reads_and_writes(venv, tmp_path):
    broker = InstalledBroker(venv, tmp_path / "broker").start()
    try:
        (tmp_path / "job.py").write_text(SPARK_JOB)
        env = {**venv_env(venv), "SPARK_LOCAL_IP": "127.0.0.1"}
        done = subprocess.run([venv / "bin" / "python", "job.py", broker.http_address, broker.tcp_address],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-6000:]
        assert "read: one,three,two\n" in done.stdout, (done.stdout, done.stderr[-6000:])
        assert STALE_WARNING not in done.stderr, done.stderr[-6000:]  # Spark's Python workers import trio_nsq
        assert STALE_WARNING not in broker.log_text(), broker.log_text()
    finally:
        broker.stop()
