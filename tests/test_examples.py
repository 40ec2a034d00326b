"""Every example runs as written against real processes; the compose file is consistent."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

import trustme
import yaml
from auth_server import AuthServer
from processes import REPO_ROOT, LookupdProcess


def run(argv, env, timeout=60):
    return subprocess.run(argv, cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **env})


def test_publish_consume_example(broker):
    proc = run([sys.executable, "examples/publish_consume.py"], {"NSQD_TCP": broker.tcp_address, "TOPIC": "ex1"})
    assert proc.returncode == 0, proc.stderr
    assert "done: from, hello, trio-nsq" in proc.stdout


def test_curl_then_pynsq_examples(broker):
    proc = run(["bash", "examples/publish_curl.sh"], {"NSQD_HTTP": broker.http_address, "TOPIC": "ex2"})
    assert proc.returncode == 0, proc.stderr
    assert "topic ex2 message_count 4" in proc.stdout
    proc = run([sys.executable, "examples/consume_pynsq.py", "4"], {"NSQD_TCP": broker.tcp_address, "TOPIC": "ex2"})
    assert proc.returncode == 0, proc.stderr
    assert re.findall(r"pynsq received: (.*)", proc.stdout) == ["hello from curl", "one", "two", "three"]


def test_multi_broker_example(tmp_path, broker_factory):
    lk = LookupdProcess(tmp_path).start()
    try:
        brokers = [broker_factory(lookupd_tcp_address=lk.tcp_address, broadcast_address="127.0.0.1") for _ in range(2)]
        proc = run([sys.executable, "examples/multi_broker.py"],
                   {"NSQD_TCPS": ",".join(b.tcp_address for b in brokers),
                    "LOOKUPD_HTTP": f"127.0.0.1:{lk.http_port}", "TOPIC": "ex3"})
        assert proc.returncode == 0, proc.stderr
        assert "received 10 messages from 2 brokers found through lookupd" in proc.stdout
    finally:
        lk.stop()


def test_tls_compression_auth_example(tmp_path, broker_factory):
    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(tmp_path / "server.pem")
    ca.issue_cert("client.example", common_name="client.example").private_key_and_cert_chain_pem.write_to_path(
        tmp_path / "client.pem")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    authd = AuthServer()
    authd.thread.start()
    authd.allow("s3cret", [{"topic": "^secure", "channels": [".*"], "permissions": ["publish", "subscribe"]}],
                identity="example-user")
    try:
        broker = broker_factory(tls_cert=tmp_path / "server.pem", tls_key=tmp_path / "server.pem",
                                tls_root_ca_file=tmp_path / "ca.pem", tls_client_auth_policy="require",
                                tls_required="true", auth_http_address=authd.address)
        env = {"NSQD_TCP": broker.tcp_address, "TLS_CA": str(tmp_path / "ca.pem"),
               "TLS_CERT": str(tmp_path / "client.pem"), "TLS_KEY": str(tmp_path / "client.pem"),
               "AUTH_SECRET": "s3cret"}
        for compression in ("snappy", "deflate"):
            proc = run([sys.executable, "examples/tls_compression_auth.py"],
                       {**env, "COMPRESSION": compression, "TOPIC": f"secure-{compression}"})
            assert proc.returncode == 0, proc.stderr
            assert "done: over, tls" in proc.stdout
            assert f"tls=True, snappy={compression == 'snappy'}, deflate={compression == 'deflate'}, " \
                   "identity=example-user" in proc.stdout
        proc = run([sys.executable, "examples/tls_compression_auth.py"], {**env, "AUTH_SECRET": "wrong"})
        assert proc.returncode != 0
        assert "refused: " in proc.stderr and "E_UNAUTHORIZED AUTH no authorizations found" in proc.stderr
        assert authd.last("s3cret")["params"]["common_name"] == "client.example"
    finally:
        authd.httpd.shutdown()
        authd.httpd.server_close()


def test_tls_example(tmp_path, broker_factory):
    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(tmp_path / "server.pem")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    broker = broker_factory(tls_cert=tmp_path / "server.pem", tls_key=tmp_path / "server.pem", tls_required="true")
    proc = run([sys.executable, "examples/tls.py"],
               {"NSQD_TCP": broker.tcp_address, "TLS_CA": str(tmp_path / "ca.pem")})
    assert proc.returncode == 0, proc.stderr
    assert "received 'order 17 paid' over TLS: True" in proc.stdout
    # the certificate is checked: without our CA the system's refuse it
    proc = run([sys.executable, "examples/tls.py"], {"NSQD_TCP": broker.tcp_address}, timeout=90)
    assert proc.returncode != 0 and "CERTIFICATE_VERIFY_FAILED" in proc.stderr, proc.stderr[-3000:]


def test_compression_example(broker):
    proc = run([sys.executable, "examples/compression.py"], {"NSQD_TCP": broker.tcp_address})
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["received 1000 bytes, snappy=False, deflate=True",
                                                "received 850 bytes, snappy=False, deflate=True"]
    log = broker.log_text()  # the Producer's connection too
    assert "upgrading connection to snappy" in log and "upgrading connection to deflate" in log


def test_backoff_max_attempts_example(broker):
    proc = run([sys.executable, "examples/backoff_max_attempts.py"], {"NSQD_TCP": broker.tcp_address})
    assert proc.returncode == 0, proc.stderr
    assert "handled: one, two" in proc.stdout
    assert "given up: poison after 3 attempts" in proc.stdout
    backoffs = int(re.search(r"backoffs: (\d+)", proc.stdout).group(1))
    assert backoffs >= 1


def test_compose_file_is_consistent():
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"nsqlookupd", "nsqd1", "nsqd2"} <= services.keys()
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    for name, svc in services.items():
        assert svc.get("build") == ".", name
        command = svc["command"]
        if command[0] == "python":
            assert (REPO_ROOT / command[1]).exists(), command  # the example exists...
            assert command[1].split("/")[0] + " " in dockerfile.replace("COPY ", "")  # ...and is in the image
        else:
            assert command[0] in scripts, command
            module = scripts[command[0]].split(":")[0]
            # flags the command really accepts
            proc = subprocess.run([sys.executable, "-m", module.rsplit(".", 1)[0], "--help"], cwd=str(REPO_ROOT),
                                  capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
            for flag in command[1:]:
                # Go's flag package lists `-flag` on stderr; either dash form is accepted
                assert "  -" + flag.split("=")[0].lstrip("-") + " " in proc.stderr, (name, flag)
        for dep in svc.get("depends_on", {}):
            assert dep in services
        for volume in svc.get("volumes", []):
            assert volume.split(":")[0] in compose["volumes"]
    # brokers register with the lookupd service and answer on distinct host ports
    host_ports = [p.split(":")[0] for s in services.values() for p in s.get("ports", [])]
    assert len(host_ports) == len(set(host_ports))
    for broker in ("nsqd1", "nsqd2"):
        assert "--lookupd-tcp-address=nsqlookupd:4160" in services[broker]["command"]
        assert "/ping" in " ".join(services[broker]["healthcheck"]["test"])
