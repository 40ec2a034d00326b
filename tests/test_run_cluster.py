"""`make run-cluster` as a newcomer runs it (docs/cluster.md): etcd, nsqlookupd, three brokers replicating every
topic on three replicas (an OK once fsynced on two) and trio-nsqadmin, started by the Makefile on free ports in a
folder that looks like the repository's (tests/docs_snippets.py's Session). A publish through the leader nsqlookupd
names is on every replica; the leader's process killed (-9), another broker leads and answers publishes OK; Ctrl-C
(SIGINT to the terminal's process group) stops everything, and no process of the session is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from processes import accepts, wait_for
from tests.docs_snippets import Session

FAILOVER_TIMEOUT = 30.0  # lease TTL (10 s by default) + an election + a catch-up, with room on a busy machine


def session_processes(sid: int) -> dict[int, str]:
    """The processes of session `sid` (make and everything it started), pid -> command line."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            out[int(entry.name)] = cmdline
    return out


def replication(http_port: int, topic: str) -> dict | None:
    """The broker's `replication` of `topic` (its /stats), or None while it has none or does not answer."""
    try:
        answer = httpx.get(f"http://127.0.0.1:{http_port}/stats?format=json&topic={topic}", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return None
    return next((t.get("replication") for t in answer.get("topics") or [] if t["topic_name"] == topic), None)


def leader_in_lookupd(lookupd_http: int, topic: str) -> int | None:
    """The HTTP port of the one broker nsqlookupd lists for `topic` (only a leader registers it)."""
    try:
        producers = httpx.get(f"http://127.0.0.1:{lookupd_http}/lookup?topic={topic}", timeout=2).json()["producers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return producers[0]["http_port"] if len(producers) == 1 else None


def test_make_run_cluster_fails_over_and_stops_cleanly(tmp_path: Path):
    session = Session(tmp_path)  # its environment gives `make run-cluster` free ports for all it starts
    ports = session.ports
    tcp, http = [ports[4150], ports[4152], ports[4154]], [ports[4151], ports[4153], ports[4155]]
    etcd_client, lookupd_http, admin_http = ports[2379], ports[4161], ports[4171]
    log_path = tmp_path / "make.log"
    with open(log_path, "wb") as log:
        # -o: the venv is this one, linked (never rebuilt from here, even if a source changed meanwhile)
        make = subprocess.Popen(["make", "--no-print-directory", "-o", ".venv/.installed", "run-cluster"],
                                cwd=session.workdir, env=session.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    log_text = lambda: log_path.read_text(errors="replace")[-6000:]  # noqa: E731
    try:
        listening = [*tcp, *http, etcd_client, lookupd_http, admin_http]
        try:
            wait_for(lambda: make.poll() is not None or all(accepts(port) for port in listening), timeout=60,
                     message="the cluster's ports")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{log_text()}") from None
        assert make.poll() is None, "make run-cluster ended:\n" + log_text()
        out = log_path.read_text(errors="replace")  # what it tells a newcomer: how to publish, find the leader...
        assert "nsq_tail --lookupd-http-address" in out and "/lookup?topic=test" in out

        # the first broker to see the topic places it and leads it
        assert httpx.post(f"http://127.0.0.1:{http[0]}/topic/create?topic=test", timeout=10).status_code == 200
        wait_for(lambda: leader_in_lookupd(lookupd_http, "test"), timeout=20, message="a leader in nsqlookupd")
        leader = leader_in_lookupd(lookupd_http, "test")
        state = wait_for(lambda: (r := replication(leader, "test")) and len(r["isr"]) == 3 and r,
                         timeout=20, message="all three replicas in sync")
        assert state["role"] == "leader" and len(state["replicas"]) == 3 and state["min_isr"] == 2
        for i in range(5):
            answer = httpx.post(f"http://127.0.0.1:{leader}/pub?topic=test", content=b"m%d" % i, timeout=10)
            assert (answer.status_code, answer.text) == (200, "OK")
        follower = next(port for port in http if port != leader)
        answer = httpx.post(f"http://127.0.0.1:{follower}/pub?topic=test", content=b"no", timeout=10)
        assert (answer.status_code, answer.json()) == (503, {"message": "NOT_LEADER"})
        # each OK was fsynced on two replicas; with all three in sync every one has the five, up to its HWM
        end = replication(leader, "test")["log_end"]
        wait_for(lambda: all((r := replication(port, "test")) and r["high_watermark"] == end for port in http), timeout=10,
                 message="the leader's log end as the high watermark on every replica")
        # trio-nsqadmin shows the replicas, the leader, the epoch, the isr and the HWM
        page = httpx.get(f"http://127.0.0.1:{admin_http}/api/topics/test", timeout=10).json()
        assert page["replication"]["leader"] == f"127.0.0.1:{leader}"
        assert sorted(r["id"] for r in page["replication"]["replicas"]) == sorted(f"127.0.0.1:{port}" for port in http)

        # kill -9 the leader's process: another broker leads, with a higher epoch, and answers OK
        # (through the pid file the Makefile writes, as docs/cluster.md tells a newcomer to try a failover)
        pid = int((session.workdir / "data" / f"nsqd{http.index(leader) + 1}.pid").read_text())
        assert "trio_nsq.broker" in session_processes(make.pid)[pid]
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()

        def new_leader() -> int | None:
            port = leader_in_lookupd(lookupd_http, "test")
            if port is None or port == leader:
                return None
            r = replication(port, "test")
            return port if r and r["role"] == "leader" and r["epoch"] > state["epoch"] else None

        successor = wait_for(new_leader, timeout=FAILOVER_TIMEOUT, interval=0.2, message="a new leader")

        def published() -> bool:
            try:
                answer = httpx.post(f"http://127.0.0.1:{successor}/pub?topic=test", content=b"after", timeout=10)
            except httpx.HTTPError:
                return False
            return answer.status_code == 200 and answer.text == "OK"

        wait_for(published, timeout=FAILOVER_TIMEOUT, interval=0.2, message="a publish answered OK by the new leader")
        print(f"failover: {time.monotonic() - killed_at:.1f} s to the first OK from the new leader")
        assert make.poll() is None, "make run-cluster ended with one broker killed\n" + log_text()
    finally:
        # Ctrl-C: SIGINT to the terminal's foreground process group (make and all it started)
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGINT)
        try:
            make.wait(timeout=40)
        except subprocess.TimeoutExpired:
            left = session_processes(make.pid)
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()
            pytest.fail(f"make run-cluster did not stop on Ctrl-C in 40 s; left: {left}\n{log_text()}")
    deadline = time.monotonic() + 20
    while session_processes(make.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = session_processes(make.pid)
    if left:
        os.killpg(make.pid, signal.SIGKILL)
    assert left == {}, f"processes left behind: {left}\n{log_text()}"
