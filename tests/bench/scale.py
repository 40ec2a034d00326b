"""Many topics, channels and consumers, beside Go nsqd (issue 43): `make bench [NSQ_REFERENCE=<dir>]`.

    python -m tests.bench.scale [--reference DIR] [--baseline CHECKOUT] [--topics 2000 10000]
        [--channels 1000 5000] [--consumers 2000 10000] [--admin-topics 10000] [--rounds N]
        [--only topics channels consumers admin] [--cap SECONDS] [--output FILE]

NSQ deployments keep many topics and channels; what a broker costs per topic must stay flat as they grow.
The sides: Go's nsqd 1.3.0 (`go`, with --reference), trio-nsqd as installed (`trio`) and, with --baseline
CHECKOUT (another checkout of trio-nsq with its own .venv, e.g. a `git worktree` of an earlier commit after
`make .venv/.installed`), that checkout's trio-nsqd (`base`, started as tests/bench/versus.py's side_broker
does: its .venv's python, `-P -m trio_nsq.broker`, PYTHONPATH that checkout). The sides are interleaved
(go, trio, base, go, trio, base...) and every measurement is a fresh broker (and lookupd) on free loopback
ports with a fresh data directory and the same flags for every side: `--mem-queue-size=0`, so Go nsqd keeps
its queues on disk as trio-nsqd keeps its logs, and the files per topic are what they are in production.

1. **topics** (N of --topics; the growth x(large/small) is the point): N topics made through the HTTP API,
   each `/topic/create`, two `/channel/create` (`a`, `b`) and one `/pub`, in that order per topic, the
   topics split over PARALLEL threads each on one keep-alive HTTP/1.1 connection (http.client), so the
   broker always has PARALLEL requests in hand and the client is not what is measured: the creation time
   (the broker has no lookupd then, as issue 43 measured it; --lookupd-from-start gives it its lookupd
   from its start instead). Checked through /stats: every topic there with its two channels, each of
   depth 1. Then the median of 5 `/stats?format=json` (right after the creations, the broker still
   syncing what they wrote), the broker's CPU % over 20 s after 5 s of rest (tests/bench/idle_topics.py),
   its RSS and its open files (/proc/PID/fd), and the median of 5 `/stats?format=json` again, at rest. Then a real nsqlookupd of the
   side's own kind (Go's nsqlookupd beside Go nsqd, `python -m trio_nsq.lookupd` of the same checkout
   beside trio-nsqd) is given to the running broker (`PUT /config/nsqlookupd_tcp_addresses`): the time
   until the lookupd's `/topics` lists all N, then the median of 5 `/lookup?topic=<one>` and of 5
   `/topics` at the lookupd, and (scenario 4, where N is --admin-topics) the nsqadmin pages. Then the
   broker stopped by SIGTERM (the time to its exit), the lookupd started afresh on its ports (what it
   lists next is the restarted broker's registration) and the broker spawned again with
   `--lookupd-tcp-address`: the time from spawn to listening (its TCP and HTTP ports accept), to every
   topic with its channels and depths in /stats (polled every max(50 ms, 4 x the last answer): the
   polling takes at most a fifth of a broker that answers on its only thread), and to the lookupd's
   `/topics` listing all N (registration). Last a kill -9 and a spawn again: to listening and to
   everything in /stats. A wait longer than --cap seconds is given up: the figure is shown as `>cap` and
   what comes after it is not measured.
2. **channels** (C of --channels): one topic with C channels made by `/channel/create` (same client),
   10,000 messages published by `/mpub` of 1,000, the time until /stats shows every channel holding all
   10,000 (from the first /mpub; given --fill-cap seconds), RSS and open files; then SIGTERM and spawn
   again: to listening and to every channel in /stats with its 10,000.
3. **consumers** (K of --consumers): K TCP connections, each `SUB` to its own ephemeral channel of one
   topic (`c<i>#ephemeral`) and `RDY 1`, opened in runs of 200 (each run's OKs read before the next), and
   kept by a thread that answers heartbeats: the time to connect them all, /stats checked (K channels,
   one client each, before and after), then the broker's CPU % after 5 s of rest over 30 s, not 20: nsqd's
   heartbeat interval, so that every connection's first heartbeat falls in the window once, however long
   the connecting took (the heartbeats answered in it are counted), and its RSS and open files.
   The bench process raises its open-files limit to the hard limit (the brokers inherit it); a run that
   needs more than that is reported as failed, not measured.
4. **admin**: with N = --admin-topics topics on one broker (made as in 1, registered with its lookupd),
   the JSON answers nsqadmin's pages read (static/app.js: the topic list `/api/topics`, a topic's page
   `/api/topics/<topic>`), median of 5 each, from our trio-nsqadmin (`python -m trio_nsq.lookupd.admin` of
   this checkout, whichever the broker) and Go's nsqadmin over the same broker and lookupd, alternately,
   each answer checked (N topics; the topic's two channels with their depth). It runs inside scenario 1
   where N is one of --topics, over every side's broker and lookupd, or on its own otherwise.

Every figure comes from a checked run: a run that lost a topic, a channel, a message or a consumer prints
what it lost and gives no figure. The figures go to bench-results.json under "scale" (medians over
--rounds; every round's in "samples"). The machine's load at the start is printed and saved: on a shared
machine the times say less than the growth.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import selectors
import shutil
import signal
import socket
import statistics
import struct
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.bench import versus
from tests.bench.broker import Broker
from tests.bench.machine import describe, machine, merge_report, process_stat
from tests.processes import Daemon
from trio_nsq.shared.protocol import MAGIC_V2, encode_rdy, encode_sub

FLAGS = ("--mem-queue-size=0",)
PARALLEL = 4  # keep-alive HTTP connections creating at once
MEDIAN_OF = 5
PROGRESS = 60.0  # seconds between progress lines of a long creation
REST, IDLE = 5.0, 20.0  # seconds left alone, then seconds of CPU measured
HEARTBEAT = 30.0  # nsqd's heartbeat interval for a client that does not IDENTIFY: the consumers' CPU window
MESSAGES = 10_000  # published to the topic of many channels
MPUB_BATCH = 1000
CONNECT_RUN = 200  # consumers connected before their OKs are read
CHANNELS = ("a", "b")  # each topic's, scenario 1
SCENARIOS = ("topics", "channels", "consumers", "admin")

_OK_FRAME = struct.pack(">ii", 6, 0) + b"OK"
_HEARTBEAT = b"_heartbeat_"


class Capped(Exception):
    """A wait given up after --cap seconds."""


class Invalid(Exception):
    """The run lost something (or the broker failed): no figure from it."""


# --- HTTP --------------------------------------------------------------------------------------------


class Http:
    """One keep-alive HTTP/1.1 connection (http.client), opened again when the server closed it."""

    def __init__(self, address: str, timeout: float = 120.0) -> None:
        self.host, _, port = address.rpartition(":")
        self.port = int(port)
        self.timeout = timeout
        self.conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: bytes = b"", retry: bool = True) -> tuple[int, bytes]:
        """(status, body). A request that finds the kept connection closed is sent once more on a new one
        when `retry` (not a publish: it could be there twice)."""
        for attempt in (0, 1):
            reused = self.conn is not None
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                self.conn.request(method, path, body=body)
                resp = self.conn.getresponse()
                data = resp.read()
            except (http.client.HTTPException, OSError):
                self.close()
                if attempt or not reused or not retry:
                    raise
                continue
            if resp.will_close:
                self.close()
            return resp.status, data
        raise AssertionError("unreachable")

    def json(self, path: str) -> Any:
        status, data = self.request("GET", path)
        if status != 200:
            raise Invalid(f"GET {path}: {status} {data[:200]!r}")
        return json.loads(data)

    def timed(self, path: str, times: int = MEDIAN_OF) -> tuple[float, Any]:
        """The median milliseconds of `times` GETs of `path`, and the last answer (JSON)."""
        samples = []
        doc = None
        for _ in range(times):
            started = time.perf_counter()
            doc = self.json(path)
            samples.append(time.perf_counter() - started)
        return statistics.median(samples) * 1000, doc

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _get_json(address: str, path: str, timeout: float) -> Any:
    """One GET on a connection of its own (polls of a broker that is starting)."""
    client = Http(address, timeout=max(timeout, 1.0))
    try:
        return client.json(path)
    finally:
        client.close()


def in_parallel(address: str, jobs: list[list[tuple[str, str, bytes]]],
                progress: Callable[[int, float], None] | None = None) -> float:
    """Run `jobs` (each a list of requests done in order) over PARALLEL keep-alive connections, job i on
    connection i % PARALLEL: the seconds it took. Invalid when any request failed. `progress(jobs done,
    seconds)` is called every PROGRESS seconds of a long run."""
    failures: list[str] = []
    done = [0] * PARALLEL

    def work(slot: int, share: list[list[tuple[str, str, bytes]]]) -> None:
        client = Http(address)
        try:
            for job in share:
                done[slot] += 1
                for method, path, body in job:
                    try:
                        status, data = client.request(method, path, body, retry="/pub" not in path)
                    except (http.client.HTTPException, OSError) as exc:
                        status, data = -1, repr(exc).encode()
                    if status != 200:
                        failures.append(f"{method} {path}: {status} {data[:120]!r}")
        finally:
            client.close()

    threads = [threading.Thread(target=work, args=(i, jobs[i::PARALLEL])) for i in range(PARALLEL)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(PROGRESS)
            if thread.is_alive() and progress is not None:
                progress(sum(done), time.perf_counter() - started)
    seconds = time.perf_counter() - started
    if failures:
        raise Invalid(f"{len(failures)} requests failed, the first: {failures[0]}")
    return seconds


# --- processes ---------------------------------------------------------------------------------------


class Lookupd(Daemon):
    """An nsqlookupd of a side's kind: Go's, or `python -m trio_nsq.lookupd` of this or the baseline's
    checkout."""

    module = "trio_nsq.lookupd"

    def __init__(self, base_dir: Path, command: list[str] | None, env: dict[str, str] | None = None) -> None:
        super().__init__(base_dir, env=env)
        self._command = command

    def command(self) -> list[str]:
        return self._command or super().command()


class Admin(Daemon):
    """nsqadmin: Go's, or trio-nsqadmin (`python -m trio_nsq.lookupd.admin`); HTTP only."""

    module = "trio_nsq.lookupd.admin"
    listeners = ("HTTP",)

    def __init__(self, base_dir: Path, command: list[str] | None, lookupd_http: str) -> None:
        super().__init__(base_dir, f"--lookupd-http-address={lookupd_http}")
        self._command = command

    def command(self) -> list[str]:
        return self._command or super().command()

    def argv(self) -> list[str]:
        return [*self.command(), f"--http-address={self.http_address}", *self.args]


REFERENCE: list[str] = []  # the --reference folder, when given
LOOKUPD_FROM_START = False  # --lookupd-from-start: the topics are made with the lookupd there
FILL_CAP = [600.0]  # --fill-cap: seconds the channels are given to hold every message


def new_broker(side: str, *flags: str) -> Broker:
    return versus.side_broker(REFERENCE[0] if REFERENCE else "", side, *flags)


def new_lookupd(side: str, base_dir: Path) -> Lookupd:
    if side == "go":
        return Lookupd(base_dir, [os.path.join(REFERENCE[0], "nsqlookupd")])
    if side == "base":
        python = os.path.join(versus.BASELINE[0], ".venv", "bin", "python")
        return Lookupd(base_dir, [python, "-P", "-m", "trio_nsq.lookupd"], env={"PYTHONPATH": versus.BASELINE[0]})
    return Lookupd(base_dir, None)


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def idle_cpu(broker: Broker, seconds: float = IDLE, during: Callable[[], Any] | None = None) -> float:
    """The broker's CPU % over `seconds`, after REST seconds of rest; `during` is called as the window opens
    and as it closes."""
    time.sleep(REST)
    cpu = broker.cpu_seconds()
    if during:
        during()
    time.sleep(seconds)
    cpu = broker.cpu_seconds() - cpu
    if during:
        during()
    return cpu / seconds * 100


def _log_hint(broker: Broker) -> str:
    """What the broker's log says went wrong, if it says (too many open files, above all)."""
    text = broker.log_text()
    for needle in ("too many open files", "Too many open files", "EMFILE"):
        if needle in text:
            count = text.count(needle)
            return f"; its log says {needle!r} {count:,} times"
    lines = [line for line in text.splitlines() if "ERROR" in line or "FATAL" in line]
    return f"; its log: {lines[-1][:200]}" if lines else ""


def stop(broker: Broker, sig: int, timeout: float) -> float:
    """Signal the broker and wait for its exit (SIGKILL after `timeout`): the seconds it took."""
    started = time.perf_counter()
    assert broker.proc is not None
    if broker.proc.poll() is None:
        broker.proc.send_signal(sig)
        try:
            broker.proc.wait(timeout)
        except Exception:
            broker.proc.kill()
            broker.proc.wait()
            raise Invalid(f"did not exit within {timeout:.0f} s of signal {sig}")
    seconds = time.perf_counter() - started
    broker.stop()  # closes its log
    return seconds


def spawn(broker: Broker, cap: float) -> tuple[float, float]:
    """Start the broker again (same ports, data directory, flags): (perf_counter at spawn, seconds until its
    TCP and HTTP ports accept). Capped when that takes longer than `cap`."""
    started = time.perf_counter()
    try:
        broker.start(timeout=cap)
    except AssertionError as exc:
        if time.perf_counter() - started >= cap:
            raise Capped(f"not listening after {cap:.0f} s") from None
        raise Invalid(f"did not start again: {str(exc)[-600:]}") from None
    return started, time.perf_counter() - started


def poll_until(check: Callable[[float], bool], started: float, cap: float, adaptive: bool) -> float:
    """Call check(remaining seconds) until it is true: the seconds since `started` (perf_counter) when it
    was. Capped after `cap` seconds from `started`. `adaptive`: wait 4 x the last call between calls (at
    least 50 ms), so polling a broker takes at most a fifth of it."""
    while True:
        remaining = cap - (time.perf_counter() - started)
        if remaining <= 0:
            raise Capped(f"not there after {cap:.0f} s")
        before = time.perf_counter()
        try:
            done = check(remaining)
        except (http.client.HTTPException, OSError, ValueError, Invalid):
            done = False  # not answering yet
        now = time.perf_counter()
        if done:
            return now - started
        time.sleep(max(0.05, 4 * (now - before)) if adaptive else 0.05)


# --- checks ------------------------------------------------------------------------------------------


def topic_name(i: int) -> str:
    return f"t{i:05d}"


def topics_held(doc: dict[str, Any], n: int) -> tuple[int, list[str]]:
    """How many of the N topics /stats shows with channels a and b of depth 1 each; what is wrong (the first
    few)."""
    expected = {topic_name(i) for i in range(n)}
    good = 0
    wrong: list[str] = []
    for topic in doc.get("topics") or []:
        name = topic["topic_name"]
        depths = {c["channel_name"]: c["depth"] for c in topic.get("channels") or []}
        if name in expected and depths == {c: 1 for c in CHANNELS}:
            good += 1
        elif len(wrong) < 3:
            wrong.append(f"{name}: {depths}")
    return good, wrong


def check_topics(doc: dict[str, Any], n: int) -> None:
    good, wrong = topics_held(doc, n)
    if good != n:
        raise Invalid(f"/stats shows {good:,} of {n:,} topics with channels a and b of depth 1 (wrong: {wrong})")


# --- 1. many topics ----------------------------------------------------------------------------------


def create_topics(broker: Broker, n: int, report: Callable[[str], None]) -> float:
    jobs = [[("POST", f"/topic/create?topic={topic_name(i)}", b""),
             *[("POST", f"/channel/create?topic={topic_name(i)}&channel={c}", b"") for c in CHANNELS],
             ("POST", f"/pub?topic={topic_name(i)}", b"m")] for i in range(n)]
    return in_parallel(broker.http_address, jobs, lambda done, s: report(f"... {done:,} of {n:,} topics made in {s:.0f} s"))


def wait_all(broker: Broker, started: float, cap: float, check: Callable[[dict[str, Any]], bool]) -> float:
    """Seconds from `started` until the broker's /stats passes `check`."""
    return poll_until(lambda remaining: check(_get_json(broker.http_address, "/stats?format=json", remaining)),
                      started, cap, adaptive=True)


def admin_pages(base_dir: Path, lookupd: Lookupd, n: int) -> dict[str, float]:
    """Our trio-nsqadmin and (with --reference) Go's nsqadmin over this lookupd (and its broker): the
    median milliseconds of /api/topics and /api/topics/<one>, alternately, each answer checked."""
    kinds = (["go"] if REFERENCE else []) + ["trio"]
    admins = {k: Admin(base_dir, [os.path.join(REFERENCE[0], "nsqadmin")] if k == "go" else None,
                       lookupd.http_address) for k in kinds}
    figures: dict[str, float] = {}
    samples: dict[str, list[float]] = {}
    one = topic_name(n // 2)
    try:
        for admin in admins.values():
            admin.start(timeout=30)
        clients = {k: Http(a.http_address) for k, a in admins.items()}
        for _ in range(MEDIAN_OF):
            for kind, client in clients.items():  # alternately
                for page, path in (("topics", "/api/topics"), ("topic", f"/api/topics/{one}")):
                    started = time.perf_counter()
                    doc = client.json(path)
                    samples.setdefault(f"admin_{kind}_{page}_ms", []).append((time.perf_counter() - started) * 1000)
                    if doc.get("message"):
                        raise Invalid(f"{kind} nsqadmin {path}: message {doc['message']!r}")
                    if page == "topics" and len(set(doc["topics"])) != n:
                        raise Invalid(f"{kind} nsqadmin {path}: {len(doc['topics']):,} topics, not {n:,}")
                    if page == "topic":
                        depths = {c["channel_name"]: c["depth"] for c in doc.get("channels") or []}
                        if depths != {c: 1 for c in CHANNELS}:
                            raise Invalid(f"{kind} nsqadmin {path}: channels {depths}")
        for client in clients.values():
            client.close()
    finally:
        for admin in admins.values():
            admin.stop()
    for key, values in samples.items():
        figures[key] = statistics.median(values)
    return figures


def registered(lookupd: Lookupd, n: int, started: float, cap: float) -> float:
    """Seconds from `started` until the lookupd's /topics lists all N topics."""
    expected = {topic_name(i) for i in range(n)}
    return poll_until(lambda remaining: expected <= set(_get_json(lookupd.http_address, "/topics", remaining)["topics"]),
                      started, cap, adaptive=False)


def many_topics(side: str, n: int, cap: float, with_admin: bool, report: Callable[[str], None],
                figures: dict[str, Any], admin_only: bool = False) -> dict[str, Any]:
    """Scenario 1 (and 4 with `with_admin`; only 4 with `admin_only`), into `figures`."""
    tmp = Path(tempfile.mkdtemp(prefix="trio-nsq-scale-"))
    lookupd = new_lookupd(side, tmp)
    broker: Broker | None = None
    expected = {topic_name(i) for i in range(n)}
    try:
        lookupd.start(timeout=30)
        at_start = (f"--lookupd-tcp-address={lookupd.tcp_address}",) if LOOKUPD_FROM_START else ()
        broker = new_broker(side, *FLAGS, *at_start)
        assert broker.proc is not None
        try:
            figures["create_s"] = create_topics(broker, n, report)
        except Invalid as exc:
            files = open_files(broker.proc.pid) if broker.is_alive() else "gone"
            raise Invalid(f"{exc} (the broker's open files now {files}){_log_hint(broker)}") from None
        report("created " + _shown(figures))
        stats = Http(broker.http_address)
        # right after the creations (the broker still syncing what they wrote), then once it is at rest
        figures["stats_busy_ms"], doc = stats.timed("/stats?format=json")
        check_topics(doc, n)
        if not admin_only:
            figures["idle_cpu_pct"] = idle_cpu(broker)
            figures["rss_mb"] = broker.rss_mb()
            figures["open_files"] = open_files(broker.proc.pid)
        figures["stats_ms"], doc = stats.timed("/stats?format=json")
        stats.close()
        check_topics(doc, n)
        report("made " + _shown(figures, after="create_s"))

        # the running broker told of its lookupd (PUT /config/nsqlookupd_tcp_addresses): it registers all
        started = time.perf_counter()
        if not LOOKUPD_FROM_START:
            client = Http(broker.http_address)
            status, data = client.request("PUT", "/config/nsqlookupd_tcp_addresses",
                                          json.dumps([lookupd.tcp_address]).encode())
            client.close()
            if status != 200:
                raise Invalid(f"PUT /config/nsqlookupd_tcp_addresses: {status} {data[:200]!r}")
        figures["join_s"] = registered(lookupd, n, started, cap)
        at_lookupd = Http(lookupd.http_address)
        figures["lookup_ms"], doc = at_lookupd.timed(f"/lookup?topic={topic_name(n // 2)}")
        if len(doc.get("producers") or []) != 1 or sorted(doc.get("channels") or []) != list(CHANNELS):
            raise Invalid(f"lookupd /lookup: {str(doc)[:300]}")
        figures["lookupd_topics_ms"], doc = at_lookupd.timed("/topics")
        if set(doc["topics"]) != expected:
            raise Invalid(f"lookupd /topics: {len(doc['topics']):,} topics, not {n:,}")
        at_lookupd.close()
        report("registered " + _shown(figures, after="open_files" if not admin_only else "stats_ms"))
        if with_admin:
            figures.update(admin_pages(tmp, lookupd, n))
            report("nsqadmin " + _shown(figures, after="lookupd_topics_ms"))
        if admin_only:
            return figures

        # SIGTERM; a fresh lookupd on the same ports (what it lists is the restarted broker's); spawn again
        figures["shutdown_s"] = stop(broker, signal.SIGTERM, timeout=max(cap, 60))
        lookupd.stop()
        lookupd.start(timeout=30)
        if not LOOKUPD_FROM_START:
            broker.args.append(f"--lookupd-tcp-address={lookupd.tcp_address}")
        started, figures["restart_listening_s"] = spawn(broker, cap)
        registration: dict[str, Any] = {}

        def watch() -> None:
            try:
                registration["s"] = registered(lookupd, n, started, cap)
            except Capped:
                pass

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            figures["restart_stats_s"] = wait_all(broker, started, cap, lambda d: topics_held(d, n)[0] == n)
        except Capped:
            figures["restart_stats_s"] = f">{cap:.0f}"
            raise
        finally:
            watcher.join()
            figures["registration_s"] = registration.get("s", f">{cap:.0f}")
        report("restarted " + _shown(figures, after=_last_before("shutdown_s", figures)))

        # kill -9 and spawn again
        stop(broker, signal.SIGKILL, timeout=60)
        started, figures["kill_listening_s"] = spawn(broker, cap)
        figures["kill_stats_s"] = wait_all(broker, started, cap, lambda d: topics_held(d, n)[0] == n)
        check_topics(_get_json(broker.http_address, "/stats?format=json", 120), n)
        report("killed " + _shown(figures, after="registration_s"))
        return figures
    except Capped as exc:
        if not any(isinstance(v, str) for v in figures.values()):  # not marked where it was given up
            figures[_next_missing(figures, TOPIC_KEYS)] = f">{cap:.0f}"
        figures["capped"] = str(exc)
        return figures
    finally:
        if broker is not None:
            broker.close()
        lookupd.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _last_before(key: str, figures: dict[str, Any]) -> str | None:
    keys = list(figures)
    return keys[keys.index(key) - 1] if key in keys and keys.index(key) else None


# --- 2. many channels --------------------------------------------------------------------------------


def channels_held(doc: dict[str, Any], c: int) -> int:
    """How many of the C channels of topic `ch` /stats shows holding all MESSAGES."""
    for topic in doc.get("topics") or []:
        if topic["topic_name"] == "ch":
            return sum(1 for ch in topic.get("channels") or [] if ch["depth"] == MESSAGES)
    return 0


def many_channels(side: str, c: int, cap: float, report: Callable[[str], None], figures: dict[str, Any]) -> dict[str, Any]:
    broker = new_broker(side, *FLAGS)
    stats_path = "/stats?format=json&topic=ch&include_clients=false"
    try:
        client = Http(broker.http_address)
        status, data = client.request("POST", "/topic/create?topic=ch")
        if status != 200:
            raise Invalid(f"/topic/create: {status} {data!r}")
        try:
            figures["create_s"] = in_parallel(broker.http_address, [
                [("POST", f"/channel/create?topic=ch&channel=c{i:05d}", b"")] for i in range(c)])
        except Invalid as exc:
            raise Invalid(f"{exc}{_log_hint(broker)}") from None
        started = time.perf_counter()
        for first in range(0, MESSAGES, MPUB_BATCH):
            body = b"\n".join(b"message-%08d" % i for i in range(first, first + MPUB_BATCH))
            status, data = client.request("POST", "/mpub?topic=ch", body, retry=False)
            if status != 200:
                raise Invalid(f"/mpub: {status} {data[:200]!r}{_log_hint(broker)}")
        figures["publish_s"] = time.perf_counter() - started
        client.close()
        try:
            figures["fill_s"] = poll_until(
                lambda remaining: channels_held(_get_json(broker.http_address, stats_path, remaining), c) == c,
                started, FILL_CAP[0], adaptive=True)
        except Capped:
            figures["fill_s"] = f">{FILL_CAP[0]:.0f}"
            raise
        figures["rss_mb"] = broker.rss_mb()
        figures["open_files"] = open_files(broker.proc.pid)
        report("made " + _shown(figures))
        figures["shutdown_s"] = stop(broker, signal.SIGTERM, timeout=max(cap, 60))
        started, figures["restart_listening_s"] = spawn(broker, cap)
        figures["restart_stats_s"] = poll_until(
            lambda remaining: channels_held(_get_json(broker.http_address, stats_path, remaining), c) == c,
            started, cap, adaptive=True)
        report("restarted " + _shown(figures, after="open_files"))
        return figures
    except Capped as exc:
        held = "?"
        if broker.is_alive():
            doc = _get_json(broker.http_address, stats_path, 60)
            depths = sum(ch["depth"] for t in doc.get("topics") or [] for ch in t.get("channels") or [])
            held = f"{channels_held(doc, c):,} of {c:,}; {depths:,} of {c * MESSAGES:,} messages in them"
        if not any(isinstance(v, str) for v in figures.values()):  # not marked where it was given up
            figures[_next_missing(figures, CHANNEL_KEYS)] = f">{cap:.0f}"
        figures["capped"] = f"{exc} (channels holding all {MESSAGES:,}: {held})"
        return figures
    finally:
        broker.close()


# --- 3. many consumers -------------------------------------------------------------------------------


class Consumers:
    """K consumer connections, each SUBscribed to its own ephemeral channel of `topic` with RDY 1; a thread
    answers their heartbeats and counts the ones the broker closed."""

    def __init__(self, address: tuple[str, int], topic: str, count: int) -> None:
        self.socks: list[socket.socket] = []
        self.closed = 0
        self.heartbeats = 0  # answered with NOP
        self.unexpected: list[bytes] = []
        self._stop = threading.Event()
        try:
            for first in range(0, count, CONNECT_RUN):
                run = []
                for i in range(first, min(count, first + CONNECT_RUN)):
                    sock = socket.create_connection(address, timeout=60)
                    sock.sendall(MAGIC_V2 + encode_sub(topic, f"c{i:05d}#ephemeral") + encode_rdy(1))
                    run.append(sock)
                    self.socks.append(sock)
                for sock in run:
                    answer = b""
                    while len(answer) < len(_OK_FRAME):
                        data = sock.recv(len(_OK_FRAME) - len(answer))
                        if not data:
                            raise Invalid(f"the broker closed consumer {len(self.socks)} before its SUB's OK")
                        answer += data
                    if answer != _OK_FRAME:
                        raise Invalid(f"SUB answered {answer!r}")
        except OSError as exc:
            self.close()
            raise Invalid(f"consumer {len(self.socks):,} of {count:,} could not connect: {exc!r}") from None
        except Invalid:
            self.close()
            raise
        self._thread = threading.Thread(target=self._keep, daemon=True)
        self._thread.start()

    def _keep(self) -> None:
        selector = selectors.DefaultSelector()
        for sock in self.socks:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        while not self._stop.is_set():
            for key, _ in selector.select(0.5):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    self.closed += 1
                    selector.unregister(sock)
                elif _HEARTBEAT in data:
                    sock.sendall(b"NOP\n")
                    self.heartbeats += 1
                elif len(self.unexpected) < 5:
                    self.unexpected.append(data[:100])
        selector.close()

    def close(self) -> None:
        self._stop.set()
        if getattr(self, "_thread", None) is not None:
            self._thread.join()
        for sock in self.socks:
            # a reset, not a FIN: no TIME_WAIT left behind for the next side's 10,000
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()


def check_consumers(broker: Broker, k: int, consumers: Consumers) -> None:
    doc = _get_json(broker.http_address, "/stats?format=json&topic=many&include_clients=false", 120)
    channels = [ch for t in doc.get("topics") or [] if t["topic_name"] == "many" for ch in t.get("channels") or []]
    one_each = sum(1 for ch in channels if ch.get("client_count", len(ch.get("clients") or [])) == 1)
    if len(channels) != k or one_each != k or consumers.closed:
        raise Invalid(f"/stats shows {len(channels):,} channels, {one_each:,} with one client, of {k:,}; "
                      f"{consumers.closed} consumers closed by the broker")


def many_consumers(side: str, k: int, cap: float, report: Callable[[str], None], figures: dict[str, Any]) -> dict[str, Any]:
    broker = new_broker(side, *FLAGS)
    consumers: Consumers | None = None
    try:
        client = Http(broker.http_address)
        status, data = client.request("POST", "/topic/create?topic=many")
        client.close()
        if status != 200:
            raise Invalid(f"/topic/create: {status} {data!r}")
        started = time.perf_counter()
        try:
            consumers = Consumers(broker.tcp, "many", k)
        except Invalid as exc:
            raise Invalid(f"{exc} (broker's open files {open_files(broker.proc.pid):,}){_log_hint(broker)}") from None
        figures["connect_s"] = time.perf_counter() - started
        check_consumers(broker, k, consumers)
        if figures["connect_s"] + REST > HEARTBEAT:
            raise Invalid(f"connecting took {figures['connect_s']:.0f} s: the CPU window would not hold one "
                          f"heartbeat per consumer")
        heartbeats: list[int] = []
        figures["idle_cpu_pct"] = idle_cpu(broker, HEARTBEAT, lambda: heartbeats.append(consumers.heartbeats))
        figures["rss_mb"] = broker.rss_mb()
        figures["open_files"] = open_files(broker.proc.pid)
        check_consumers(broker, k, consumers)
        if consumers.unexpected:
            raise Invalid(f"consumers were sent {consumers.unexpected}")
        figures["heartbeats_in_window"] = heartbeats[1] - heartbeats[0]
        report(_shown(figures) + f" (heartbeats answered in the CPU window: {figures['heartbeats_in_window']:,})")
        return figures
    finally:
        if consumers is not None:
            consumers.close()
        broker.close()


# --- figures -----------------------------------------------------------------------------------------

# scenario -> [(figure key, label, unit)]
FIGURES: dict[str, list[tuple[str, str, str]]] = {
    "topics": [
        ("create_s", "create (topic, 2 channels, 1 PUB each)", "s"),
        ("stats_busy_ms", "/stats?format=json right after the creations", "ms"),
        ("stats_ms", "/stats?format=json at rest (after the idle CPU window)", "ms"),
        ("idle_cpu_pct", "idle CPU", "%"),
        ("rss_mb", "RSS", "MB"),
        ("open_files", "open files", ""),
        ("join_s", "lookupd added: until its /topics lists all", "s"),
        ("lookup_ms", "lookupd /lookup?topic=", "ms"),
        ("lookupd_topics_ms", "lookupd /topics", "ms"),
        ("admin_go_topics_ms", "Go nsqadmin /api/topics", "ms"),
        ("admin_go_topic_ms", "Go nsqadmin /api/topics/<topic>", "ms"),
        ("admin_trio_topics_ms", "trio-nsqadmin /api/topics", "ms"),
        ("admin_trio_topic_ms", "trio-nsqadmin /api/topics/<topic>", "ms"),
        ("shutdown_s", "SIGTERM to exit", "s"),
        ("restart_listening_s", "restart: spawn to listening", "s"),
        ("restart_stats_s", "restart: spawn to all in /stats", "s"),
        ("registration_s", "restart: spawn to all in lookupd /topics", "s"),
        ("kill_listening_s", "kill -9, restart: spawn to listening", "s"),
        ("kill_stats_s", "kill -9, restart: spawn to all in /stats", "s"),
    ],
    "channels": [
        ("create_s", "create (/channel/create each)", "s"),
        ("publish_s", f"publish {MESSAGES:,} (/mpub of {MPUB_BATCH:,})", "s"),
        ("fill_s", f"until every channel holds {MESSAGES:,}", "s"),
        ("rss_mb", "RSS", "MB"),
        ("open_files", "open files", ""),
        ("shutdown_s", "SIGTERM to exit", "s"),
        ("restart_listening_s", "restart: spawn to listening", "s"),
        ("restart_stats_s", "restart: spawn to all channels full in /stats", "s"),
    ],
    "consumers": [
        ("connect_s", "connect, SUB, RDY 1 (runs of 200)", "s"),
        ("idle_cpu_pct", "idle CPU over 30 s (one heartbeat each)", "%"),
        ("rss_mb", "RSS", "MB"),
        ("open_files", "open files", ""),
    ],
}
FIGURES["admin"] = [f for f in FIGURES["topics"]
                    if f[0] in ("create_s", "stats_busy_ms", "stats_ms", "join_s", "lookup_ms", "lookupd_topics_ms") or f[0].startswith("admin_")]
TOPIC_KEYS = [k for k, _, _ in FIGURES["topics"] if not k.startswith("admin_")]
CHANNEL_KEYS = [k for k, _, _ in FIGURES["channels"]]
UNITS = {key: unit for figures in FIGURES.values() for key, _, unit in figures}


def _next_missing(figures: dict[str, Any], keys: list[str]) -> str:
    """The first of `keys` not measured yet: the one a Capped wait was measuring."""
    return next((k for k in keys if k not in figures), keys[-1])


def _fmt(key: str, value: Any) -> str:
    unit = UNITS.get(key, "")
    if isinstance(value, str):  # ">cap"
        return f"{value} {unit}".strip()
    if unit == "s":
        return f"{value:,.2f} s" if value < 100 else f"{value:,.0f} s"
    if unit == "ms":
        return f"{value:,.1f} ms" if value < 100 else f"{value:,.0f} ms"
    if unit == "%":
        return f"{value:.2f} %"
    if unit == "MB":
        return f"{value:,.0f} MB"
    return f"{value:,.0f}"


def _shown(figures: dict[str, Any], after: str | None = None) -> str:
    keys = list(figures)
    if after in keys:
        keys = keys[keys.index(after) + 1:]
    return ", ".join(f"{k} {_fmt(k, figures[k])}" for k in keys if k in UNITS)


def _median(values: list[Any]) -> Any:
    """The median of the rounds' values; a capped one (">cap") counts as the cap, and the median is shown
    capped when it is one of them."""
    if not values:
        return None
    numbers = sorted((float(v.lstrip(">")) if isinstance(v, str) else v, isinstance(v, str)) for v in values)
    value, capped = numbers[(len(numbers) - 1) // 2] if len(numbers) % 2 else numbers[len(numbers) // 2]
    if len(numbers) % 2 == 0:
        low, low_capped = numbers[len(numbers) // 2 - 1]
        value, capped = (low + value) / 2, capped or low_capped
    return f">{value:.0f}" if capped else value


def _number(value: Any) -> float | None:
    if value is None:
        return None
    return float(value.lstrip(">")) if isinstance(value, str) else float(value)


def summarize(samples: dict[str, dict[int, dict[str, list[dict[str, Any]]]]], sides: list[str],
              sizes: dict[str, list[int]]) -> dict[str, Any]:
    """Medians per scenario, size, side and figure; ratios to Go; growth from the smallest size to the largest
    per side. Printed as a table, returned for the JSON."""
    summary: dict[str, Any] = {}
    rounds_of = lambda runs: [r for r in runs if "invalid" not in r]  # noqa: E731
    for scenario, by_size in samples.items():
        summary[scenario] = {}
        ordered = sorted(by_size)
        print(f"\n{scenario} ({', '.join(f'{s:,}' for s in ordered)})")
        header = f"  {'figure':<44} {'size':>7}" + "".join(f" {side:>13}" for side in sides)
        header += "".join(f" {side + '/go':>8}" for side in sides if side != "go" and "go" in sides)
        print(header)
        for key, label, _ in FIGURES[scenario]:
            rows: dict[int, dict[str, Any]] = {}
            for size in ordered:
                medians: dict[str, Any] = {}
                for side in sides:
                    runs = by_size[size].get(side, [])
                    good = rounds_of(runs)
                    if not runs:
                        continue
                    if not good:
                        medians[side] = "lost"
                    elif any(key in r for r in good):
                        medians[side] = _median([r[key] for r in good if key in r])
                if not medians:
                    continue
                rows[size] = medians
                line = f"  {label:<44} {size:>7,}"
                line += "".join(f" {(medians[s] if medians.get(s) == 'lost' else _fmt(key, medians[s]) if s in medians else '-'):>13}"
                                for s in sides)
                ratios = {}
                for side in sides:
                    if side == "go" or "go" not in sides:
                        continue
                    go, ours = _number_or_none(medians.get("go")), _number_or_none(medians.get(side))
                    ratio = ours / go if go and ours is not None else None
                    ratios[side] = ratio
                    shown = "-" if ratio is None else f"{ratio:.2f}"
                    if ratio is not None and (isinstance(medians.get(side), str) or isinstance(medians.get("go"), str)):
                        shown = ">" + shown if isinstance(medians.get(side), str) else "<" + shown
                    line += f" {shown:>8}"
                print(line)
                summary[scenario].setdefault(key, {})[str(size)] = {"median": medians, "ratio_to_go": ratios}
            if len(ordered) > 1 and len(rows) > 1:
                small, large = ordered[0], ordered[-1]
                growth = {}
                for side in sides:
                    a, b = _number_or_none(rows.get(small, {}).get(side)), _number_or_none(rows.get(large, {}).get(side))
                    growth[side] = b / a if a and b is not None else None
                capped = {s: isinstance(rows.get(large, {}).get(s), str) and rows[large][s] != "lost" for s in sides}
                print(f"  {'  growth x(' + f'{large:,}/{small:,}' + ')':<44} {'':>7}"
                      + "".join(f" {('-' if growth[s] is None else ('>' if capped[s] else '') + f'{growth[s]:.1f}'):>13}"
                                for s in sides))
                summary[scenario][key]["growth"] = growth
    admin_table(summary, sides)
    return summary


def admin_table(summary: dict[str, Any], sides: list[str]) -> None:
    """nsqadmin's pages: Go's nsqadmin beside trio-nsqadmin over each side's broker and lookupd (the columns
    above are the broker's side, not the admin's)."""
    for scenario in ("topics", "admin"):
        figures = summary.get(scenario, {})
        sizes = sorted({size for key in figures if key.startswith("admin_") for size in figures[key] if size != "growth"},
                       key=int)
        for size in sizes:
            print(f"\n  nsqadmin pages with {int(size):,} topics, medians of {MEDIAN_OF} (the same broker and lookupd for both)")
            print(f"    {'broker and lookupd':<20} {'page':<22} {'Go nsqadmin':>12} {'trio-nsqadmin':>14} {'trio/Go':>8}")
            for side in sides:
                for page, label in (("topics", "/api/topics"), ("topic", "/api/topics/<topic>")):
                    go = figures.get(f"admin_go_{page}_ms", {}).get(size, {}).get("median", {}).get(side)
                    ours = figures.get(f"admin_trio_{page}_ms", {}).get(size, {}).get("median", {}).get(side)
                    if ours is None:
                        continue
                    go_n, ours_n = _number_or_none(go), _number_or_none(ours)
                    ratio = ours_n / go_n if go_n and ours_n is not None else None
                    figures.setdefault(f"admin_{page}_trio_over_go", {})[f"{size} {side}"] = ratio
                    shown = {k: "-" if v is None else v if v == "lost" else _fmt("admin_go_topics_ms", v)
                             for k, v in (("go", go), ("ours", ours))}
                    print(f"    {side:<20} {label:<22} {shown['go']:>12} {shown['ours']:>14}"
                          f" {'-' if ratio is None else f'{ratio:.2f}':>8}")


def _number_or_none(value: Any) -> float | None:
    return None if value in (None, "lost") else _number(value)


# --- main --------------------------------------------------------------------------------------------


# Go nsqd holds 6 files a topic with two channels: 10,000 topics need 60,000
WANTED_OPEN_FILES = 200_000


def _raise_open_files() -> dict[str, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < WANTED_OPEN_FILES:
        try:  # a raised hard limit needs privilege (root here); without it the hard limit is what there is
            resource.setrlimit(resource.RLIMIT_NOFILE, (WANTED_OPEN_FILES, WANTED_OPEN_FILES))
            hard = WANTED_OPEN_FILES
        except (ValueError, OSError):
            pass
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return {"soft_before": soft, "hard": hard, "now": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", help="folder with Go's nsqd, nsqlookupd and nsqadmin 1.3.0")
    parser.add_argument("--baseline", help="another trio-nsq checkout (with its .venv) to run beside this one")
    parser.add_argument("--topics", type=int, nargs="+", default=[2000, 10000])
    parser.add_argument("--channels", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument("--consumers", type=int, nargs="+", default=[2000, 10000])
    parser.add_argument("--admin-topics", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", nargs="*", choices=SCENARIOS, default=None)
    parser.add_argument("--sides", nargs="*", default=None, help="only these of go, trio, base")
    parser.add_argument("--lookupd-from-start", action="store_true",
                        help="start the brokers of scenarios 1 and 4 with --lookupd-tcp-address: topics made with it")
    parser.add_argument("--cap", type=float, default=900.0, help="seconds a wait (start, load, fill) is given")
    parser.add_argument("--fill-cap", type=float, default=600.0,
                        help="seconds the many channels are given to hold every message")
    parser.add_argument("--mem-queue-size", type=int, default=0,
                        help="every side's --mem-queue-size (0: Go nsqd keeps each queue in files, 6 open files a "
                             "topic with two channels; where the open-files limit cannot hold 10,000 of those, the "
                             "default 10000 keeps Go's messages in memory, and its files closed)")
    parser.add_argument("--output", default="bench-results.json", help="merged into this JSON file")
    args = parser.parse_args(argv)
    global LOOKUPD_FROM_START, FLAGS
    FLAGS = (f"--mem-queue-size={args.mem_queue_size}",)
    LOOKUPD_FROM_START = args.lookupd_from_start
    FILL_CAP[0] = args.fill_cap
    if args.reference:
        REFERENCE.append(os.path.abspath(args.reference))
    sides = (["go"] if args.reference else []) + ["trio"]
    if args.baseline:
        versus.BASELINE.append(os.path.abspath(args.baseline))
        sides.append("base")
    if args.sides:
        sides = [s for s in sides if s in args.sides]
    scenarios = args.only or list(SCENARIOS)
    info = machine()
    limits = _raise_open_files()
    load = os.getloadavg()
    print(f"machine: {describe(info)}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"open files: soft limit {limits['soft_before']:,}, hard {limits['hard']:,} (raised to {limits['now']:,}; "
          f"the brokers inherit it); flags {' '.join(FLAGS)}; sides {', '.join(sides)}; cap {args.cap:.0f} s")
    admin_inline = "admin" in scenarios and "topics" in scenarios and args.admin_topics in args.topics
    sizes = {"topics": args.topics, "channels": args.channels, "consumers": args.consumers,
             "admin": [args.admin_topics]}
    plan = [s for s in ("topics", "channels", "consumers") if s in scenarios]
    if "admin" in scenarios and not admin_inline:
        plan.append("admin")
    samples: dict[str, dict[int, dict[str, list[dict[str, Any]]]]] = {
        s: {size: {side: [] for side in sides} for size in sizes[s]} for s in plan}
    started = time.time()
    for round_no in range(1, args.rounds + 1):
        for scenario in plan:
            for size in sizes[scenario]:
                for side in sides:  # interleaved
                    def report(text: str, scenario: str = scenario, size: int = size, side: str = side) -> None:
                        print(f"round {round_no} {scenario} {size:>6,} {side:<4} {text}", flush=True)

                    figures: dict[str, Any] = {}
                    try:
                        if scenario == "topics":
                            many_topics(side, size, args.cap, admin_inline and size == args.admin_topics, report,
                                        figures)
                        elif scenario == "channels":
                            many_channels(side, size, args.cap, report, figures)
                        elif scenario == "consumers":
                            many_consumers(side, size, args.cap, report, figures)
                        else:
                            many_topics(side, size, args.cap, True, report, figures, admin_only=True)
                        if "capped" in figures:
                            report(f"gave up: {figures['capped']}")
                    except Invalid as exc:
                        # what was measured before is kept apart: not a figure of the table
                        figures = {"invalid": str(exc), "measured_before": figures}
                        report(f"LOST, no figure: {exc}")
                    except Exception as exc:  # a broken run is reported, the others still run
                        figures = {"invalid": f"{exc!r}", "measured_before": figures}
                        report(f"FAILED: {exc!r}\n{traceback.format_exc()}")
                    samples[scenario][size][side].append(figures)
    print(f"\nmedians of {args.rounds} round(s); {(time.time() - started) / 60:.1f} minutes")
    summary = summarize(samples, sides, sizes)
    merge_report(args.output, {
        "reference": REFERENCE[0] if REFERENCE else None, "baseline": args.baseline, "sides": sides,
        "rounds": args.rounds, "cap_s": args.cap, "fill_cap_s": args.fill_cap, "flags": list(FLAGS), "lookupd_from_start": LOOKUPD_FROM_START, "parallel_http_connections": PARALLEL,
        "sizes": {s: sizes[s] for s in plan}, "open_files_limit": limits, "load_average_at_start": load,
        "machine": info, "summary": summary,
        "samples": {s: {str(size): by_side for size, by_side in by_size.items()} for s, by_size in samples.items()},
    }, "scale")
    print(f"written {args.output}")
    return summary


if __name__ == "__main__":
    main()
