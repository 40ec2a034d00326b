"""The docs' code blocks as tests (tests/test_docs_snippets.py runs them): README.md and every page under
docs/ are read, each fenced block taken with the directive written on the line before it, and each page's
blocks are run in order, in one session of their own:

- a working directory of its own that looks like the repository's folder (a temporary one, with `.venv`
  linking to this interpreter's venv and the Makefile and sources linked, so `make run` and
  `.venv/bin/nsq_tail` work as written; `make run` keeps its data there: the DATA variable);
- free ports in place of NSQ's well-known ones (4150, 4151, 4160, 4161, 4171; and 4250/4251 for a second
  broker), replaced in the block's text wherever they stand as numbers;
- unless the page starts its own on those ports (a `daemon` block naming one of them), nsqlookupd, a
  broker registered with it and trio-nsqadmin, started for the page on those ports and stopped after it.

A block's language says what it is: `python` runs as a script with this interpreter, `sh`/`bash` with
bash -e; every other language (`text`, `json`, `toml`...) is shown, not run. A fence with no language is
refused (so no command hides as text). The directive `<!-- snippet: KIND reason -->` on the line before a
fence changes how it runs:

- `daemon`: started, not waited for; the page's next blocks run while it serves (it must open the ports
  it names); stopped (SIGINT, as Ctrl-C) when the page ends;
- `pytest`: a test file, run by pytest (with trio-nsq's plugin and its fixtures, as a user's tests run);
- `spark`: needs a SparkSession (a JVM): run by the `spark_log` tests (`make test-spark`);
- `continues`: the rest of the page's previous Python block, run with it as one program (a long example
  explained in parts);
- `not-run` followed by why: kept out, and tests/test_docs_snippets.py lists every such block it
  allows, so one cannot be added without a test seeing it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

from processes import REPO_ROOT, AdminProcess, BrokerProcess, Daemon, LookupdProcess, accepts, free_port

ROOT = REPO_ROOT
RUN_LANGUAGES = {"python": "python", "py": "python", "sh": "shell", "bash": "shell", "shell": "shell"}
KINDS = {"run", "daemon", "pytest", "spark", "continues", "not-run"}
WELL_KNOWN_PORTS = (4150, 4151, 4160, 4161, 4171, 4250, 4251,
                    4152, 4153, 4154, 4155, 2379, 2380)  # (`make run-cluster`'s other brokers and etcd)
CLUSTER_PORTS = (4150, 4151, 4160, 4161, 4171)  # nsqd, nsqlookupd and trio-nsqadmin, as `make run` starts them
CHECKOUT = ("Makefile", "pyproject.toml", "setup.py", "trio_nsq", "broker", "lookupd", "shared", "examples")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>.*)$")
DIRECTIVE = re.compile(r"^\s*<!--\s*snippet:\s*(?P<kind>[\w-]+)\s*(?P<reason>.*?)\s*-->\s*$")


class Snippet(NamedTuple):
    path: Path
    line: int  # of the opening fence, from 1
    language: str
    text: str
    kind: str  # run, daemon, spark, continues, not-run
    reason: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.language in RUN_LANGUAGES


def pages() -> list[Path]:
    """README.md and the docs' Markdown pages, in a stable order."""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def snippets(path: Path) -> list[Snippet]:
    """The fenced blocks of one Markdown page, with their directives. Raises ValueError for a fence with
    no language, an unknown directive, or a directive before no fence."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Snippet] = []
    i = 0
    pending: tuple[str, str, int] | None = None
    while i < len(lines):
        directive = DIRECTIVE.match(lines[i])
        if directive:
            kind = directive["kind"]
            if kind not in KINDS:
                raise ValueError(f"{path}:{i + 1}: unknown snippet directive {kind!r} (one of {sorted(KINDS)})")
            if kind == "not-run" and not directive["reason"]:
                raise ValueError(f"{path}:{i + 1}: a not-run snippet says why")
            pending = (kind, directive["reason"], i + 1)
            i += 1
            continue
        fence = FENCE.match(lines[i])
        if not fence:
            if pending is not None and lines[i].strip():
                raise ValueError(f"{path}:{pending[2]}: a snippet directive stands before no code block")
            i += 1
            continue
        language = fence["info"].strip().split(" ")[0].lstrip("{.").rstrip("}")
        if not language:
            raise ValueError(f"{path}:{i + 1}: a code block without a language (text, json, python, sh...)")
        close, indent = fence["fence"], len(fence["indent"])
        body: list[str] = []
        start = i + 1
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(close):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        kind, reason = (pending[0], pending[1]) if pending else ("run", "")
        found.append(Snippet(path, start, language, "\n".join(body) + "\n", kind, reason))
        pending = None
        i += 1
    return found


def _ping(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


def _lists_a_broker(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/nodes", timeout=1) as resp:
            return bool(json.loads(resp.read()).get("producers"))
    except (OSError, ValueError):
        return False


class Session:
    """One page's blocks, run in order in a directory of their own against processes on free ports.
    The test that owns it calls `close` (every process it started is stopped)."""

    def __init__(self, workdir: Path, *, timeout: float = 120.0) -> None:
        self.workdir = workdir
        self.timeout = timeout
        self.ports = {port: free_port() for port in WELL_KNOWN_PORTS}
        self.processes: list[tuple[subprocess.Popen, str]] = []  # the daemon blocks'
        self.daemons: list[Daemon] = []  # the page's cluster, when it needs one
        venv = Path(sys.prefix)
        # `.venv` holds links to this venv's folders and a stamp of its own, newer than every source, so
        # `make run` here uses the venv as it is (never installs into it from this folder)
        (workdir / ".venv").mkdir()
        for entry in venv.iterdir():
            if not entry.name.startswith("."):
                (workdir / ".venv" / entry.name).symlink_to(entry)
        (workdir / ".venv" / ".installed").touch()
        # the commands are written to run from the repository's folder: what they name of it is linked
        for name in CHECKOUT:
            (workdir / name).symlink_to(ROOT / name)
        self.env = dict(os.environ)
        self.env["PATH"] = f"{venv / 'bin'}{os.pathsep}{self.env.get('PATH', '')}"
        self.env["PYTHONUNBUFFERED"] = "1"
        # what Spark and the JVM would leave in /tmp goes to the session's folder (removed with it)
        scratch = {name: workdir / "scratch" / name for name in ("spark-local", "java-tmp", "python-tmp")}
        for folder in scratch.values():
            folder.mkdir(parents=True)
        self.env.update(SPARK_LOCAL_IP="127.0.0.1", SPARK_LOCAL_DIRS=str(scratch["spark-local"]),
                        TMPDIR=str(scratch["python-tmp"]), JAVA_TOOL_OPTIONS=f"-Djava.io.tmpdir={scratch['java-tmp']}")
        for name in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "VIRTUAL_ENV"):  # as a user's shell: not set
            self.env.pop(name, None)
        # `make run` and `make run-cluster` take their ports and data directory from these (Makefile); other
        # commands ignore them
        self.env.update({"NSQD_TCP_PORT": str(self.ports[4150]), "NSQD_HTTP_PORT": str(self.ports[4151]),
                         "LOOKUPD_TCP_PORT": str(self.ports[4160]), "LOOKUPD_HTTP_PORT": str(self.ports[4161]),
                         "ADMIN_HTTP_PORT": str(self.ports[4171]), "DATA": str(workdir / "data"),
                         "NSQD2_TCP_PORT": str(self.ports[4152]), "NSQD2_HTTP_PORT": str(self.ports[4153]),
                         "NSQD3_TCP_PORT": str(self.ports[4154]), "NSQD3_HTTP_PORT": str(self.ports[4155]),
                         "ETCD_CLIENT_PORT": str(self.ports[2379]), "ETCD_PEER_PORT": str(self.ports[2380])})

    def substitute(self, text: str) -> str:
        for port, free in self.ports.items():
            text = re.sub(rf"(?<![\d.]){port}(?!\d)", str(free), text)
        return text

    # --- the processes a page needs -----------------------------------------------------------------

    def start_cluster(self) -> None:
        """nsqlookupd, a broker registered with it and trio-nsqadmin, as `make run` starts them: the suite's
        daemons (tests/processes.py), on the session's ports."""
        p = self.ports
        lookupd = LookupdProcess(self.workdir / "cluster")
        lookupd.tcp_port, lookupd.http_port = p[4160], p[4161]
        broker = BrokerProcess(self.workdir / "cluster", lookupd_tcp_address=f"127.0.0.1:{p[4160]}",
                               broadcast_address="127.0.0.1")
        broker.tcp_port, broker.http_port = p[4150], p[4151]
        admin = AdminProcess(self.workdir / "cluster", lookupd_http_address=f"127.0.0.1:{p[4161]}")
        admin.http_port = p[4171]
        for daemon in (lookupd, broker, admin):
            self.daemons.append(daemon)
            daemon.start()
        self.wait_registered()

    def wait_registered(self) -> None:
        """When nsqlookupd and a broker both serve on the well-known ports: until the broker has connected
        to lookupd (as it has by the time someone types into another terminal), so a block's /lookup
        finds the topics it made."""
        p = self.ports
        if _ping(p[4161]) and _ping(p[4151]):
            self.wait_for(lambda: _lists_a_broker(p[4161]), "the broker's registration with nsqlookupd")

    def _env_for(self, language: str) -> dict[str, str]:
        """A shell block runs with the venv's bin/ first on PATH (an activated venv: `trio-nsqd` is found);
        a Python block as `.venv/bin/python script.py` runs, the venv not activated (so Spark's workers,
        started as `python3` from PATH, are not this interpreter unless the code sees to it)."""
        if language == "shell":
            return self.env
        return {**self.env, "PATH": self.env["PATH"].split(os.pathsep, 1)[1]}

    def _spawn(self, argv: list[str], name: str, *, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")
        try:
            proc = subprocess.Popen(argv, cwd=self.workdir, env=env or self.env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        self.processes.append((proc, name))
        return proc

    def wait_for(self, ready, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for proc, name in self.processes:
                if proc.poll() is not None:
                    raise AssertionError(f"{name} exited ({proc.returncode}) before {what} was ready:\n"
                                         + self.log(name))
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not ready in {timeout} s")
            time.sleep(0.1)

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def close(self) -> None:
        for proc, _ in reversed(self.processes):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        for proc, _ in reversed(self.processes):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.processes.clear()
        for daemon in reversed(self.daemons):  # (after the blocks' own processes: they may be its clients)
            daemon.stop()
        self.daemons.clear()

    # --- the blocks -----------------------------------------------------------------------------------

    def run(self, snippet: Snippet, text: str | None = None) -> None:
        """Run one block as written (its ports replaced): a script to its end (exit 0), or a daemon until
        the ports it names answer."""
        code = self.substitute(text if text is not None else snippet.text)
        language = RUN_LANGUAGES[snippet.language]
        name = f"snippet-{snippet.line}"
        if snippet.kind == "pytest":
            script = self.workdir / f"test_{name.replace('-', '_')}.py"
            script.write_text(code)
            argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(script)]
        elif language == "python":
            script = self.workdir / f"{name}.py"
            script.write_text(code)
            argv = [sys.executable, str(script)]
        else:
            script = self.workdir / f"{name}.sh"
            script.write_text(code)
            argv = ["bash", "-e", str(script)]
        if snippet.kind == "daemon":
            self._spawn(argv, name, env=self._env_for(language))
            ports = [free for port, free in self.ports.items() if str(free) in code]
            self.wait_for(lambda: all(accepts(port) for port in ports), f"{snippet.where}'s ports",
                          timeout=self.timeout)
            self.wait_registered()
            return
        try:
            done = subprocess.run(argv, cwd=self.workdir, env=self._env_for(language), capture_output=True, timeout=self.timeout,
                                  start_new_session=True)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{snippet.where}: not done in {self.timeout} s\n{_text(exc.stdout)}"
                                 f"{_text(exc.stderr)}") from None
        if done.returncode != 0:
            raise AssertionError(f"{snippet.where}: exit status {done.returncode}\n--- code\n{code}--- stdout\n"
                                 f"{_text(done.stdout)}--- stderr\n{_text(done.stderr)}")


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")[-6000:]


def programs(page: list[Snippet]) -> list[tuple[Snippet, str]]:
    """A page's runnable blocks as the programs they make: a `continues` block joined to the Python block
    before it (run once, as the whole)."""
    out: list[tuple[Snippet, str]] = []
    for snippet in page:
        if not snippet.runs or snippet.kind == "not-run":
            continue
        if snippet.kind == "continues":
            if not out or RUN_LANGUAGES[out[-1][0].language] != "python" or snippet.language not in ("python", "py"):
                raise ValueError(f"{snippet.where}: `continues` follows no Python block")
            first, text = out.pop()
            out.append((first, text + snippet.text))
            continue
        out.append((snippet, snippet.text))
    return out
