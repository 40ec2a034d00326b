"""NSQ's utilities (trio_nsq/apps/) as processes against real brokers: nsq_tail, nsq_stat, to_nsq,
nsq_to_file, nsq_to_nsq, nsq_to_http; their command lines; and to_nsq's throttle under a MockClock."""

from __future__ import annotations

import gzip
import ast
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import trio.testing
from processes import REPO_ROOT, free_port, repo_env, wait_for

from trio_nsq.apps import app, nsq_stat, nsq_to_nsq, relay, to_nsq
from trio_nsq.client import Consumer

APPS = ["nsq_tail", "nsq_stat", "to_nsq", "nsq_to_file", "nsq_to_nsq", "nsq_to_http"]
FAST_RETRY = ["--consumer-opt=default_requeue_delay,100ms", "--consumer-opt=max_backoff_duration,200ms",
              "--consumer-opt=backoff_multiplier,50ms"]


def command(name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", f"trio_nsq.apps.{name}", *args]


def run(name: str, *args: str, stdin: bytes = b"", timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(command(name, *args), input=stdin, capture_output=True, timeout=timeout, cwd=REPO_ROOT,
                          env=repo_env())


def start(name: str, *args: str, log: Path) -> subprocess.Popen:
    """The tool in the background: stdout to `log`, stderr to `log` + ".err"."""
    return subprocess.Popen(command(name, *args), stdout=log.open("ab"), stderr=errors(log).open("ab"),
                            cwd=REPO_ROOT, env=repo_env())


def errors(log: Path) -> Path:
    return log.with_name(log.name + ".err")


def stop(proc: subprocess.Popen, log: Path) -> None:
    """SIGTERM: the tool closes cleanly and exits 0."""
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(30) == 0, errors(log).read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def mpub(broker, topic: str, bodies: list[bytes]) -> None:
    for i in range(0, len(bodies), 1000):
        body = b"".join(len(b).to_bytes(4, "big") + b for b in bodies[i:i + 1000])
        chunk = len(bodies[i:i + 1000]).to_bytes(4, "big") + body
        assert broker.http.post(f"/mpub?topic={topic}&binary=true", content=chunk).status_code == 200


def channel_stats(broker, topic: str, channel: str) -> dict:
    stats = broker.get(f"/stats?format=json&topic={topic}").json()
    for t in stats["topics"] or []:
        for c in t["channels"]:
            if c["channel_name"] == channel:
                return c
    return {}


def topic_count(broker, topic: str) -> int:
    stats = broker.get(f"/stats?format=json&topic={topic}").json()
    return sum(t["message_count"] for t in stats["topics"] or [] if t["topic_name"] == topic)


def drain(address: str, topic: str, wanted: set[bytes], timeout: float = 30) -> set[bytes]:
    """Every distinct body read from topic until all of `wanted` came (or the timeout)."""
    got: set[bytes] = set()

    async def main() -> None:
        done = trio.Event()

        async def handler(message) -> None:
            got.add(message.body)
            if wanted <= got:
                done.set()

        async with Consumer(topic, "check", handler, nsqd_tcp_addresses=[address], max_in_flight=500):
            with trio.move_on_after(timeout):
                await done.wait()

    trio.run(main)
    return got


# --- command lines ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", APPS)
def test_version_and_bad_flags_as_go(name):
    proc = run(name, "--version")
    assert (proc.returncode, proc.stdout) == (0, f"{name} v1.3.0\n".encode())
    proc = run(name, "-bogus")
    assert proc.returncode == 2
    assert proc.stderr.startswith(b"flag provided but not defined: -bogus\nUsage of ")
    proc = run(name, "-h")
    assert proc.returncode == 0 and b"  -topic " in proc.stderr and b"-config" not in proc.stderr


def test_required_flags_fail_with_go_messages():
    proc = run("nsq_tail")
    assert proc.returncode == 1
    assert proc.stderr.decode().endswith(" --nsqd-tcp-address or --lookupd-http-address required\n")
    proc = run("nsq_stat", "--topic=t", "--channel=c", "--nsqd-http-address=http://x:1")
    assert proc.returncode == 1 and b"--nsqd-http-address error - address should not contain scheme" in proc.stderr
    proc = run("to_nsq", "--topic=t", "--delimiter=ab", "--nsqd-tcp-address=127.0.0.1:1")
    assert proc.returncode == 1 and b"--delimiter must be a single byte" in proc.stderr
    proc = run("nsq_tail", "--topic=t", "--nsqd-tcp-address=127.0.0.1:1", "--consumer-opt=bogus,1")
    assert proc.returncode == 2
    assert proc.stderr.startswith(b'invalid value "bogus,1" for flag -consumer-opt: invalid option bogus\n')


def test_consumer_and_producer_opts_become_client_keywords():
    kwargs = app.parse_config_opts(["max_attempts,7", "default_requeue_delay,250ms", "max_backoff_duration,2s",
                                    "heartbeat_interval,5s", "snappy", "dial_timeout,1s", "read_timeout,9s"],
                                   consumer=True)
    assert kwargs == {"max_attempts": 7, "requeue_delay_ms": 250, "max_backoff": 2.0, "snappy": True,
                      "connect_timeout": 1.0, "identify": {"heartbeat_interval": 5000}}
    with pytest.raises(app.ConfigError):
        app.parse_config_opts(["max_attempts,7"], consumer=False)  # a producer has no attempts
    with pytest.raises(app.ConfigError):
        app.parse_config_opts(["max_in_flight,many"], consumer=True)


# --- nsq_tail ------------------------------------------------------------------------------------------


def test_nsq_tail_prints_n_messages_then_exits(module_broker):
    mpub(module_broker, "tail1", [b"hello", b"new\nline", b"world", b"not printed"])
    mpub(module_broker, "tail2", [b"other"])
    proc = run("nsq_tail", f"--nsqd-tcp-address={module_broker.tcp_address}", "--topic=tail1", "-n", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == b"hello\nnew\nline\nworld\n"
    proc = run("nsq_tail", f"--nsqd-tcp-address={module_broker.tcp_address}", "--topic=tail2", "--topic=tail1",
               "--channel=named", "--print-topic", "-n", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout in (b"tail2 | other\n", b"tail1 | hello\n")


def test_nsq_tail_stops_cleanly_on_sigterm(module_broker, tmp_path):
    mpub(module_broker, "tail3", [b"a", b"b"])
    log = tmp_path / "tail.log"
    proc = start("nsq_tail", f"--nsqd-tcp-address={module_broker.tcp_address}", "--topic=tail3", "--channel=c",
                 log=log)
    # delivered and FIN'd: nothing queued nor in flight (the channel has its 2 messages before the SUB that
    # made it is answered, once the channel's name is on disk, and nothing is in flight before that)
    wait_for(lambda: (stats := channel_stats(module_broker, "tail3", "c")).get("message_count") == 2 and
             stats["depth"] == 0 and stats["in_flight_count"] == 0, timeout=15)
    stop(proc, log)
    assert log.read_bytes() == b"a\nb\n"
    assert channel_stats(module_broker, "tail3", "c")["depth"] == 0


def test_nsq_tail_into_a_closed_pipe_ends_as_go_s(module_broker):
    # more than a pipe holds (64 KiB): the tool is still writing when the pipe closes, however far
    # ahead of this test it runs on a loaded machine
    mpub(module_broker, "tail4", [b"%05d" % i + b"x" * 95 for i in range(2000)])
    proc = subprocess.Popen(command("nsq_tail", f"--nsqd-tcp-address={module_broker.tcp_address}", "--topic=tail4",
                                    "--channel=c"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO_ROOT,
                            env=repo_env())
    try:
        assert proc.stdout.readline() == b"00000" + b"x" * 95 + b"\n"
        proc.stdout.close()  # `| head -1`: the next write fails
        assert proc.wait(30) == 141  # what a shell shows for Go's nsq_tail, killed by SIGPIPE
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert b"Traceback" not in proc.stderr.read()
    proc.stderr.close()
    # what it did not print went back to the channel, untouched
    wait_for(lambda: channel_stats(module_broker, "tail4", "c")["in_flight_count"] == 0, timeout=10)
    assert channel_stats(module_broker, "tail4", "c")["depth"] >= 1


# --- nsq_stat ------------------------------------------------------------------------------------------


def test_nsq_stat_prints_the_channel_table(module_broker):
    mpub(module_broker, "stat1", [b"x"] * 5)  # held by the topic, then given to its first channel
    module_broker.http.post("/channel/create?topic=stat1&channel=c")
    mpub(module_broker, "stat1", [b"y"] * 7)
    proc = run("nsq_stat", f"--nsqd-http-address={module_broker.http_address}", "--topic=stat1", "--channel=c",
               "--count=2", "--interval=100ms")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.decode().splitlines()
    assert lines[:2] == [
        "------rate------+----------------depth----------------+--------------metadata---------------",
        "ingress  egress |   total     mem    disk inflt   def |     req     t-o         msgs clients"]
    assert lines[2:] == ["      0       0 |      12      12       0     0     0 |       0       0           12       0"] * 2
    proc = run("nsq_stat", f"--nsqd-http-address={module_broker.http_address}", "--topic=stat1", "--channel=nope")
    assert proc.returncode == 1
    assert b"ERROR: failed to find channel(nope) in stats metadata for topic(stat1)" in proc.stderr


def test_nsq_stat_rates():
    old = dict.fromkeys(nsq_stat.FIELDS, 0)
    new = {**old, "message_count": 100, "depth": 40, "backend_depth": 10}
    # 100 in over 2 s; 60 of them left (depth grew by 40)
    assert nsq_stat.row(new, old, 2.0) == ("     50      30 |      40      30      10     0     0 |"
                                           "       0       0          100       0\n")


# --- to_nsq --------------------------------------------------------------------------------------------


def test_to_nsq_publishes_lines_at_a_rate(module_broker):
    lines = b"".join(b"line %d\n" % i for i in range(30)) + b"\n\nlast without newline"
    proc = run("to_nsq", f"--nsqd-tcp-address={module_broker.tcp_address}", "--topic=tonsq", "--rate=200",
               stdin=lines)
    assert proc.returncode == 0, proc.stderr
    assert b"Throttling messages rate to max:200/second" in proc.stderr
    got = drain(module_broker.tcp_address, "tonsq", {b"last without newline"})
    assert got == {b"line %d" % i for i in range(30)} | {b"last without newline"}
    proc = run("to_nsq", f"--nsqd-tcp-address={module_broker.tcp_address}", "--topic=tonsq2", "--delimiter=,",
               stdin=b"a,b,,c")
    assert proc.returncode == 0, proc.stderr
    assert topic_count(module_broker, "tonsq2") == 3
    proc = run("to_nsq", f"--nsqd-tcp-address={module_broker.tcp_address}", "--topic=bad!", stdin=b"x\n")
    assert proc.returncode == 1 and b'E_BAD_TOPIC PUB topic name "bad!" is not valid' in proc.stderr


async def test_to_nsq_throttle_keeps_the_rate(autojump_clock):
    throttle = to_nsq.Throttle(10)
    start_time = trio.current_time()
    for _ in range(31):
        await throttle.take()
    assert trio.current_time() - start_time == pytest.approx(3.0, abs=0.01)  # the first is free
    await trio.sleep(5)  # idle: at most one second's worth is saved up
    before = trio.current_time()
    for _ in range(20):
        await throttle.take()
    assert trio.current_time() - before == pytest.approx(1.0, abs=0.01)


# --- nsq_to_file ---------------------------------------------------------------------------------------


def test_nsq_to_file_rotates_gzips_and_loses_nothing_across_sigterm(module_broker, tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    bodies = [b"message %05d" % i for i in range(3000)]
    mpub(module_broker, "tofile", bodies)
    args = [f"--nsqd-tcp-address={module_broker.tcp_address}", "--topic=tofile", f"--output-dir={out}",
            f"--work-dir={work}", "--gzip", "--rotate-size=4000", "--max-in-flight=50", "--sync-interval=200ms"]
    log = tmp_path / "tofile.log"
    proc = start("nsq_to_file", *args, log=log)
    wait_for(lambda: out.exists() and len(list(out.iterdir())) >= 3, timeout=20)
    stop(proc, log)  # mid-stream: what it holds is synced and FIN'd, the file closed and moved
    assert list(work.iterdir()) == []
    proc = start("nsq_to_file", *args, log=log)  # the rest
    wait_for(lambda: channel_stats(module_broker, "tofile", "nsq_to_file").get("depth") == 0 and
             channel_stats(module_broker, "tofile", "nsq_to_file")["in_flight_count"] == 0, timeout=30)
    stop(proc, log)
    files = sorted(out.iterdir())
    assert len(files) > 5 and all(f.name.startswith("tofile.") and f.name.endswith(".log.gz") for f in files)
    lines = [line for f in files for line in gzip.decompress(f.read_bytes()).splitlines()]
    assert sorted(set(lines)) == bodies  # nothing lost (a duplicate would be at-least-once, allowed)
    assert len(lines) == len(bodies)  # and here, with a clean stop, nothing twice either


def test_nsq_to_file_filename_format():
    from trio_nsq.apps.nsq_to_file import Options, filename_format, strftime

    opts = Options(output_dir="/o", work_dir="/o", host_identifier="h", gzip=True)
    assert filename_format(opts, "t") == "t.h<REV>.<DATETIME>.log.gz"
    with pytest.raises(ValueError):
        filename_format(Options(output_dir="/o", work_dir="/o", filename_format="<TOPIC>.log", gzip=True), "t")
    assert filename_format(Options(output_dir="/o", work_dir="/o", host_identifier="h"), "t") == "t.h.<DATETIME>.log"
    assert strftime("%Y-%q%%", 0.0)[-3:] == "%q%"  # Go's strftime passes what it does not know


# --- nsq_to_nsq and nsq_to_http ------------------------------------------------------------------------

RELAYED = [b'{"n": %d, "pad": "%s"}' % (i, b"x" * 50) for i in range(10_000)]


def publish_through_an_outage(broker, topic: str, channel: str, destination, started: Callable[[], bool], *,
                              started_within: float, drained_within: float) -> None:
    """Publish RELAYED to `topic`; once `started()` (the tool delivers), take its `destination` away for
    a while (stop(), then start() again: deliveries fail, messages are REQ'd, the consumer backs off),
    then wait until the tool's `channel` has nothing queued or in flight."""
    mpub(broker, topic, RELAYED)
    wait_for(started, timeout=started_within)
    destination.stop()
    time.sleep(2)
    destination.start()
    wait_for(lambda: channel_stats(broker, topic, channel).get("depth") == 0 and
             channel_stats(broker, topic, channel)["in_flight_count"] == 0, timeout=drained_within,
             message="the source drained")


def test_nsq_to_nsq_relays_everything_while_the_destination_goes_away(module_broker, broker_factory, tmp_path):
    destination = broker_factory()
    log = tmp_path / "relay.log"
    proc = start("nsq_to_nsq", f"--nsqd-tcp-address={module_broker.tcp_address}", "--topic=relay",
                 f"--destination-nsqd-tcp-address={destination.tcp_address}", "--destination-topic=relayed",
                 *FAST_RETRY, "--producer-opt=dial_timeout,500ms", log=log)
    try:
        publish_through_an_outage(module_broker, "relay", "nsq_to_nsq", destination,
                                  lambda: topic_count(destination, "relayed") > 1000,
                                  started_within=20, drained_within=60)
    finally:
        stop(proc, log)
    assert drain(destination.tcp_address, "relayed", set(RELAYED)) == set(RELAYED)


def test_nsq_to_nsq_json_filters():
    opts = nsq_to_nsq.Options(topic=["t"], require_json_field="kind", require_json_value="7",
                              whitelist_json_field=["kind", "keep"])
    assert nsq_to_nsq.json_filter(opts, b'{"kind": 7.0, "keep": 1.5, "drop": 2}') == b'{"keep":1.5,"kind":7}'
    assert nsq_to_nsq.json_filter(opts, b'{"kind": "8"}') is None
    assert nsq_to_nsq.json_filter(opts, b"not json") is None
    with pytest.raises(nsq_to_nsq.Backoff):
        nsq_to_nsq.json_filter(opts, b'{"other": 1}')


def test_hostpool_skips_a_failed_destination_until_its_retry():
    pool = relay.HostPool(["a", "b"], "hostpool")
    pool.mark("a", False)
    assert {pool.pick() for _ in range(10)} == {"b"}
    pool.mark("b", False)
    assert {pool.pick() for _ in range(10)} == {"a", "b"}  # all failed: all are tried again
    round_robin = relay.HostPool(["a", "b"], "round-robin")
    assert [round_robin.pick() for _ in range(4)] == ["b", "a", "b", "a"]


ENDPOINT = r"""
import http.server, sys
out = open(sys.argv[2], "ab", buffering=0)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        out.write(repr((body, dict(self.headers))).encode() + b"\n")
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
print("listening", flush=True)
server.serve_forever()
"""


class Endpoint:
    """A small HTTP endpoint of the test's own, in a process (so it has a core of its own): records each
    POST's body and headers; stop() and start() again on the same port."""

    def __init__(self, tmp_path: Path) -> None:
        self.record = tmp_path / "posts"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", ENDPOINT, str(self.port), str(self.record)],
                                     stdout=subprocess.PIPE)
        assert self.proc.stdout is not None and self.proc.stdout.readline() == b"listening\n"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc.stdout.close()  # type: ignore[union-attr]
            self.proc = None

    def posts(self) -> list[tuple[bytes, dict]]:
        if not self.record.exists():
            return []
        return [ast.literal_eval(line) for line in self.record.read_text().splitlines() if line.endswith(")")]


def test_nsq_to_http_delivers_everything_while_the_endpoint_goes_away(module_broker, tmp_path):
    endpoint = Endpoint(tmp_path)
    endpoint.start()
    log = tmp_path / "http.log"
    proc = start("nsq_to_http", f"--nsqd-tcp-address={module_broker.tcp_address}", "--topic=tohttp",
                 f"--post=http://127.0.0.1:{endpoint.port}/in", "--content-type=application/json",
                 "--header=X-Test: yes", "--http-client-connect-timeout=200ms", *FAST_RETRY, log=log)
    try:  # while the endpoint is away, connections are refused
        publish_through_an_outage(module_broker, "tohttp", "nsq_to_http", endpoint, lambda: len(endpoint.posts()) > 500,
                                  started_within=30, drained_within=90)
    finally:
        stop(proc, log)
        endpoint.stop()
    posts = endpoint.posts()
    assert {body for body, _ in posts} == set(RELAYED)
    headers = posts[0][1]
    assert headers["Content-Type"] == "application/json" and headers["X-Test"] == "yes"
    assert headers["User-Agent"] == "nsq_to_http v1.3.0"
    assert "backing off" in errors(log).read_text()


def test_scripts_are_declared():
    import tomllib

    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name in APPS:
        assert scripts[name] == f"trio_nsq.apps.{name}:main"
        assert os.path.exists(REPO_ROOT / "trio_nsq" / "apps" / f"{name}.py")
