"""The command lines that scripts, init files and client libraries' test harnesses give Go's nsqd and
nsqlookupd, given to ours as processes: Go's flag syntax, deprecated flags, --version, the start-up
lines they parse, unix sockets, HTTP turned off, and every start-up failure as one line and an exit
status, never a traceback."""

from __future__ import annotations

import http.client
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from processes import REPO_ROOT, free_port
from trio_nsq.shared.protocol import MAGIC_V2, FrameParser, encode_pub

VERSION_LINE = re.compile(r"^(nsqd|nsqlookupd) v1\.3\.0 \(built w/\S+\)$")
LISTENING = re.compile(r"(TCP|HTTP): listening on (\S+)")


def run(module: str, *argv: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"trio_nsq.{module}", *argv], cwd=str(REPO_ROOT), capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


class Daemon:
    """A daemon started with a raw argv; waits until its log says both listeners (or TCP only) are up."""

    def __init__(self, module: str, *argv: str, want: tuple[str, ...] = ("TCP", "HTTP")) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", f"trio_nsq.{module}", *argv], cwd=str(REPO_ROOT), text=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        self.lines: list[str] = []
        self.listening: dict[str, str] = {}
        deadline = time.monotonic() + 15
        while set(want) - set(self.listening):
            assert time.monotonic() < deadline, self.lines
            line = self.proc.stderr.readline()
            assert line, f"exited: {self.lines}"
            self.lines.append(line.rstrip("\n"))
            match = LISTENING.search(line)
            if match:
                self.listening[match.group(1)] = match.group(2)

    def stop(self) -> str:
        self.proc.terminate()
        rest = self.proc.communicate(timeout=15)[1]
        self.lines += rest.splitlines()
        return "\n".join(self.lines)


def http_get(address: str, path: str) -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", path)
    resp = conn.getresponse()
    return resp.status, resp.read()


def test_go_style_flags_and_deprecated_ones_start_nsqd(tmp_path):
    daemon = Daemon("broker", "-tcp-address=127.0.0.1:0", "-http-address", "127.0.0.1:0", "--verbose",
                    "-data-path", str(tmp_path), "--worker-id", "-mem-queue-size=5")
    try:
        assert http_get(daemon.listening["HTTP"], "/ping") == (200, b"OK")
    finally:
        log = daemon.stop()
    assert daemon.proc.returncode == 0
    # nsqd's start-up lines, in its order: version, ID, TCP, HTTP
    messages = [line.split(": ", 1)[1] for line in log.splitlines() if "INFO: " in line]
    assert VERSION_LINE.match(messages[0]), messages[0]
    assert re.fullmatch(r"ID: \d+", messages[1]), messages[1]
    tcp = next(i for i, m in enumerate(messages) if m.startswith("TCP: listening on 127.0.0.1:"))
    assert messages[tcp + 1].startswith("HTTP: listening on 127.0.0.1:")
    assert "-verbose is deprecated" in log and "-worker-id is deprecated" in log
    assert "Traceback" not in log


def test_version_prints_nsqds_line():
    for module, daemon in (("broker", "nsqd"), ("lookupd", "nsqlookupd")):
        done = run(module, "--version")
        assert done.returncode == 0, done.stderr
        assert VERSION_LINE.match(done.stdout.strip()) and done.stdout.startswith(daemon + " "), done.stdout


def test_nsqlookupd_takes_go_flags_and_logs_in_its_order():
    daemon = Daemon("lookupd", "-tcp-address", "127.0.0.1:0", "-http-address=127.0.0.1:0", "-verbose")
    try:
        assert http_get(daemon.listening["HTTP"], "/ping") == (200, b"OK")
    finally:
        log = daemon.stop()
    messages = [line.split(": ", 1)[1] for line in log.splitlines() if "INFO: " in line]
    assert VERSION_LINE.match(messages[0])
    assert messages[1].startswith("HTTP: listening on") and messages[2].startswith("TCP: listening on")
    assert "-verbose is deprecated" in log and "Traceback" not in log


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "flag provided but not defined: -bogus"),
    (["-mem-queue-size=lots"], 'invalid value "lots" for flag -mem-queue-size: parse error'),
    (["-msg-timeout=soon"], 'invalid value "soon" for flag -msg-timeout: parse error'),
    (["-snappy=maybe"], 'invalid boolean value "maybe" for -snappy: parse error'),
    (["-worker-id=5"], 'invalid boolean value "5" for -worker-id: parse error'),
    (["-tcp-address"], "flag needs an argument: -tcp-address"),
    (["-log-level=loud"], 'invalid value "loud" for flag -log-level: invalid log level'),
])
def test_a_command_line_go_refuses_exits_2_with_gos_message(argv, message):
    done = run("broker", *argv)
    assert done.returncode == 2
    assert done.stderr.splitlines()[0].startswith(message), done.stderr[:300]
    assert "Usage of nsqd:" in done.stderr and "Traceback" not in done.stderr


def test_help_exits_0_with_the_flag_list():
    done = run("broker", "-h")
    assert done.returncode == 0 and "Usage of nsqd:" in done.stderr and "  -mem-queue-size int" in done.stderr
    # defaults shown as Go's flag.PrintDefaults shows them: durations as time.Duration, strings quoted
    assert "auto-requeing a message (default 1m0s)" in done.stderr
    assert "(default 1h0m0s)" in done.stderr and "fsync (default 2s)" in done.stderr
    heads = [line.split()[0] for line in done.stderr.splitlines() if line.startswith("  -")]
    assert heads == sorted(heads) and "-config" in heads and "-version" in heads


def fatal_start(tmp_path: Path, *argv: str) -> str:
    """Start a broker that must refuse to start: exit 1, one FATAL line naming the problem, no traceback."""
    data = tmp_path / "data"
    data.mkdir(parents=True, exist_ok=True)
    done = run("broker", f"--tcp-address=127.0.0.1:{free_port()}", f"--http-address=127.0.0.1:{free_port()}",
               f"--data-path={data}", *argv)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    fatal = [line for line in done.stderr.splitlines() if " FATAL: " in line]
    assert len(fatal) == 1, done.stderr
    return fatal[0].split(" FATAL: ", 1)[1]


@pytest.mark.parametrize("argv, message", [
    (["--node-id=1024"], "failed to instantiate nsqd - --node-id must be [0,1024)"),
    (["--node-id=-1"], "failed to instantiate nsqd - --node-id must be [0,1024)"),
    (["--max-deflate-level=10"], "failed to instantiate nsqd - --max-deflate-level must be [1,9]"),
    (["--max-deflate-level=0"], "failed to instantiate nsqd - --max-deflate-level must be [1,9]"),
    (["--e2e-processing-latency-percentile=1.5"], "failed to instantiate nsqd - invalid E2E processing latency percentile: 1.5"),
    (["--tls-required=tcp-https"], "cannot require TLS client connections without TLS key and cert"),
])
def test_what_nsqd_refuses_at_start_is_refused_at_start(tmp_path, argv, message):
    assert fatal_start(tmp_path, *argv) == message


@pytest.mark.parametrize("content", [b"not json", b'{"topics": 7}', b'{"topics":[{"name":"a","channels":{"x":1}}]}', b"[]"])
def test_a_bad_nsqd_dat_is_one_line(tmp_path, content):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "nsqd.dat").write_bytes(content)
    assert fatal_start(tmp_path).startswith("failed to parse metadata in ")


def test_a_data_dir_in_use_and_a_port_in_use_are_one_line(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    first = Daemon("broker", "--tcp-address=127.0.0.1:0", "--http-address=127.0.0.1:0", f"--data-path={data}")
    try:
        assert "in use" in fatal_start(tmp_path)
        taken = first.listening["TCP"]
        other = tmp_path / "other"
        message = fatal_start(other, f"--tcp-address={taken}")
        assert message == f"listen ({taken}) failed - Address already in use", message
    finally:
        first.stop()


def test_unix_sockets_for_tcp_and_http(tmp_path):
    tcp_path, http_path = tmp_path / "nsqd.sock", tmp_path / "http.sock"
    daemon = Daemon("broker", f"-tcp-address={tcp_path}", f"-http-address={http_path}", f"-data-path={tmp_path}")
    try:
        assert daemon.listening == {"TCP": str(tcp_path), "HTTP": str(http_path)}
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(10)
            sock.connect(str(tcp_path))
            sock.sendall(MAGIC_V2 + encode_pub("unix", b"over a unix socket"))
            parser = FrameParser()
            parser.feed(sock.recv(100))
            assert next(iter(parser)) == (0, b"OK")
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(10)
            sock.connect(str(http_path))
            sock.sendall(b"GET /stats?format=json&topic=unix HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200") and b'"depth":1' in answer.replace(b" ", b"")
    finally:
        daemon.stop()
    assert daemon.proc.returncode == 0
    assert not tcp_path.exists() and not http_path.exists()  # removed at exit, as Go's listeners do


def test_an_empty_http_address_turns_http_off(tmp_path):
    daemon = Daemon("broker", "-tcp-address=127.0.0.1:0", "-http-address=", f"-data-path={tmp_path}", want=("TCP",))
    try:
        host, port = daemon.listening["TCP"].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(MAGIC_V2 + encode_pub("nohttp", b"x"))
            parser = FrameParser()
            parser.feed(sock.recv(100))
            assert next(iter(parser)) == (0, b"OK")
    finally:
        log = daemon.stop()
    assert "HTTP: listening" not in log and "Traceback" not in log


def test_nsqlookupd_port_in_use_is_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = "127.0.0.1:%d" % taken.getsockname()[1]
        done = run("lookupd", f"--tcp-address={address}", "--http-address=127.0.0.1:0")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    fatal = [line for line in done.stderr.splitlines() if " FATAL: " in line]
    assert len(fatal) == 1 and fatal[0].endswith(f"listen ({address}) failed - Address already in use"), done.stderr


def test_tls_required_tcp_https_requires_tls_of_tcp_clients_only(tmp_path):
    """nsqd's --tls-required=tcp-https (TLSRequiredExceptHTTP): plain HTTP is served, a TCP client must
    upgrade with IDENTIFY tls_v1 before anything else."""
    import trustme

    ca = trustme.CA()
    cert = tmp_path / "server.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(cert))
    daemon = Daemon("broker", "-tcp-address=127.0.0.1:0", "-http-address=127.0.0.1:0",
                    f"-https-address=127.0.0.1:{free_port()}", f"-data-path={tmp_path}",
                    f"-tls-cert={cert}", f"-tls-key={cert}", "-tls-required=tcp-https")
    try:
        assert http_get(daemon.listening["HTTP"], "/ping") == (200, b"OK")
        host, port = daemon.listening["TCP"].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(MAGIC_V2 + encode_pub("plain", b"x"))
            parser = FrameParser()
            parser.feed(sock.recv(200))
            kind, data = next(iter(parser))
        assert kind == 1 and data == b"E_INVALID cannot PUB in current state (TLS required)", data
    finally:
        daemon.stop()
