"""The cost of replication (issue 52, docs/cluster.md): `make bench` (QUICK: one round, shorter runs).

    python -m tests.bench.replication [--reference DIR] [--rounds N] [--seconds S] [--failovers N]
                                      [--lease-ttls 2s 10s] [--only pub mpub] [--sides r3 r1 ...] [--output FILE]

The same publisher against each side, interleaved round by round (fresh brokers and data directories per run,
one etcd for the whole bench, a fresh --etcd-prefix per run):

- `r3`: three trio-nsqd with `--replicas=3 --min-isr=2`, publishing to the topic's leader (an OK: fsynced on two);
- `r1`: one trio-nsqd in cluster mode with `--replicas=1` (an OK: fsynced on it, its lease live);
- `sync`: trio-nsqd without etcd, `--mem-queue-size=0 --sync-every=1` (an OK: fsynced, no replica: the local
  cost of the same promise);
- `plain`: trio-nsqd without etcd, default flags (an OK: in memory);
- `go`: Go nsqd 1.3.0 at default flags (with --reference DIR: its `nsqd`; it has no replication).

The publisher: CONNECTIONS processes, one connection each, every command waiting for its answer (as
`bench_writer --batch-size=1` does), `pub` one 200-byte message per PUB, `mpub` MPUBs of MPUB_BATCH; the rate
is messages per second over all connections, the latency each command's, from send to OK (p50 and p99).

Failover (r3 only, `--failovers` times per lease TTL): a publisher publishes continuously to the leader, the
leader gets kill -9, and the time is from the kill to the first publish answered OK by another broker (the
publisher tries each survivor in turn, as a client that looks the leader up again would). It is mostly the
lease's TTL: the dead leader's lease must expire before anyone may lead.
"""

from __future__ import annotations

import argparse
import base64
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tests.bench.broker import Broker, post
from tests.bench.machine import describe, machine, merge_report
from trio_nsq.shared.protocol import MAGIC_V2, encode_mpub, encode_nop, encode_pub

# tests/etcd_server.py is written for the tests (it imports `processes`, tests/ on the path)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from etcd_server import EtcdServer  # noqa: E402

TOPIC = "bench"
SIZE = 200
MPUB_BATCH = 100
CONNECTIONS = 4
READY_TIMEOUT = 30.0  # a replicated topic placed and its replicas in sync
# a broker places a topic on the brokers it knows of, which it re-reads from etcd at least every second: the
# brokers' keys in etcd and then this, so the first broker knows all of them
PLACEMENT_SETTLE = 1.5
SCENARIOS = {"pub": ("PUB, 1 message a command", 1), "mpub": (f"MPUB, {MPUB_BATCH} messages a command", MPUB_BATCH)}
SIDES = ("r3", "r1", "sync", "plain", "go")
TITLES = {"r3": "replicas 3, min-isr 2", "r1": "replicas 1", "sync": "no etcd, sync-every=1",
          "plain": "no etcd, default", "go": "Go nsqd 1.3.0"}
_FRAME = struct.Struct(">ii")


# --- the publisher --------------------------------------------------------------------------------------------

def _read_frame(sock: socket.socket) -> tuple[int, bytes]:
    header = _recv_exactly(sock, 8)
    size, frame_type = _FRAME.unpack(header)
    return frame_type, _recv_exactly(sock, size - 4)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the broker closed the connection")
        data += chunk
    return bytes(data)


def _connect(address: tuple[str, int], timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection(address, timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(MAGIC_V2)
    return sock


def publish_once(sock: socket.socket, command: bytes) -> bytes:
    """Send one command and return its answer (b"OK", or the error frame's text); heartbeats answered."""
    sock.sendall(command)
    while True:
        frame_type, data = _read_frame(sock)
        if frame_type == 0 and data == b"_heartbeat_":
            sock.sendall(encode_nop())
            continue
        return data if frame_type == 0 else b"ERROR " + data


def _publisher(address: tuple[str, int], batch: int, seconds: float, result: Any) -> None:
    """One connection publishing for `seconds`, each command waiting for its answer: (messages answered OK,
    errors, elapsed s, each OK'd command's latency in s). An error frame closes the connection (nsqd's
    E_PUB_FAILED is fatal): it reconnects."""
    body = b"x" * SIZE
    command = encode_pub(TOPIC, body) if batch == 1 else encode_mpub(TOPIC, [body] * batch)
    latencies: list[float] = []
    errors = 0
    sock = _connect(address)
    started = time.perf_counter()
    deadline = started + seconds
    while (now := time.perf_counter()) < deadline:
        try:
            answer = publish_once(sock, command)
        except OSError:
            answer = b"ERROR connection lost"
        if answer == b"OK":
            latencies.append(time.perf_counter() - now)
        else:
            errors += 1
            sock.close()
            time.sleep(0.01)
            sock = _connect(address)
    sock.close()
    result.put((len(latencies) * batch, errors, time.perf_counter() - started, latencies))


def measure(address: tuple[str, int], batch: int, seconds: float) -> dict[str, float]:
    ctx = mp.get_context("fork")
    result = ctx.Queue()
    procs = [ctx.Process(target=_publisher, args=(address, batch, seconds, result)) for _ in range(CONNECTIONS)]
    for proc in procs:
        proc.start()
    answers = [result.get(timeout=seconds + 120) for _ in procs]
    for proc in procs:
        proc.join()
    latencies = sorted(x for a in answers for x in a[3])
    messages = sum(a[0] for a in answers)
    elapsed = max(a[2] for a in answers)

    def quantile(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e3 if latencies else float("nan")

    return {"rate": messages / elapsed, "p50_ms": quantile(0.5), "p99_ms": quantile(0.99),
            "errors": sum(a[1] for a in answers), "commands": len(latencies)}


# --- the sides ------------------------------------------------------------------------------------------------

def replication_of(broker: Broker, topic: str = TOPIC) -> dict[str, Any] | None:
    try:
        answer = httpx.get(f"{broker.http_url}/stats?format=json&topic={topic}", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return None
    return next((t.get("replication") for t in answer.get("topics") or [] if t["topic_name"] == topic), None)


def brokers_in_etcd(endpoint: str, prefix: str) -> int:
    """How many brokers have their key under `prefix`/brokers/ (they are alive to the others)."""
    key = f"{prefix}/brokers/".encode()
    end = key[:-1] + bytes([key[-1] + 1])
    answer = httpx.post(f"{endpoint}/v3/kv/range", timeout=5, json={
        "key": base64.b64encode(key).decode(), "range_end": base64.b64encode(end).decode(), "count_only": True})
    return int(answer.json().get("count", 0))


class Cluster:
    """`replicas` trio-nsqd in cluster mode on one etcd (a prefix of their own), the topic placed by the first,
    which leads it; ready once every replica is in sync."""

    runs = 0

    def __init__(self, etcd: EtcdServer, replicas: int, min_isr: int, *extra: str) -> None:
        Cluster.runs += 1
        prefix = f"/trio-nsq-bench/{os.getpid()}-{Cluster.runs}"
        flags = (f"--etcd-endpoints={etcd.endpoint}", f"--etcd-prefix={prefix}", f"--replicas={replicas}",
                 f"--min-isr={min_isr}", "--broadcast-address=127.0.0.1", *extra)
        self.brokers: list[Broker] = []
        try:
            for _ in range(replicas):
                self.brokers.append(Broker(*flags))
            deadline = time.monotonic() + READY_TIMEOUT
            while brokers_in_etcd(etcd.endpoint, prefix) < replicas:  # all alive: the topic is placed on all
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the {replicas} brokers not in etcd in {READY_TIMEOUT} s")
                time.sleep(0.05)
            time.sleep(PLACEMENT_SETTLE)
            post(f"{self.leader.http_url}/topic/create?topic={TOPIC}")
            while not ((r := replication_of(self.leader)) and r.get("role") == "leader"
                       and len(r.get("isr") or []) == replicas):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the topic's {replicas} replicas not in sync in {READY_TIMEOUT} s: {r}")
                time.sleep(0.1)
        except BaseException:
            self.close()
            raise

    @property
    def leader(self) -> Broker:
        return self.brokers[0]

    def close(self) -> None:
        for broker in self.brokers:
            broker.close()


def run_once(side: str, key: str, seconds: float, etcd: EtcdServer, reference: str | None) -> dict[str, float]:
    batch = SCENARIOS[key][1]
    if side in ("r3", "r1"):
        cluster = Cluster(etcd, 3, 2) if side == "r3" else Cluster(etcd, 1, 1)
        try:
            return measure(cluster.leader.tcp, batch, seconds)
        finally:
            cluster.close()
    flags = {"sync": ("--mem-queue-size=0", "--sync-every=1"), "plain": (), "go": ()}[side]
    broker = Broker(*flags, command=[os.path.join(reference, "nsqd")] if side == "go" and reference else None)
    try:
        post(f"{broker.http_url}/topic/create?topic={TOPIC}")
        return measure(broker.tcp, batch, seconds)
    finally:
        broker.close()


def failover_once(etcd: EtcdServer, lease_ttl: str) -> float:
    """Seconds from the leader's kill -9 to the first publish answered OK by a survivor."""
    cluster = Cluster(etcd, 3, 2, f"--etcd-lease-ttl={lease_ttl}")
    try:
        command = encode_pub(TOPIC, b"x" * SIZE)
        sock = _connect(cluster.leader.tcp)
        until = time.monotonic() + 1.0
        while time.monotonic() < until:  # publishing, answered OK
            answer = publish_once(sock, command)
            if answer != b"OK":
                raise RuntimeError(f"the leader refused a publish before the kill: {answer!r}")
        cluster.leader.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        sock.close()
        survivors = cluster.brokers[1:]
        socks: dict[int, socket.socket] = {}
        deadline = killed + 120
        while time.monotonic() < deadline:
            for i, broker in enumerate(survivors):
                try:
                    if i not in socks:
                        socks[i] = _connect(broker.tcp, timeout=2)
                    answer = publish_once(socks[i], command)
                except OSError:
                    answer = b"ERROR connection lost"
                if answer == b"OK":
                    elapsed = time.monotonic() - killed
                    for s in socks.values():
                        s.close()
                    return elapsed
                if i in socks:  # E_PUB_FAILED closes the connection: a new one next time
                    socks.pop(i).close()
            time.sleep(0.02)
        raise RuntimeError("no survivor answered a publish OK within 120 s of the leader's kill")
    finally:
        cluster.close()


# --- main -----------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", default=None, help="folder with Go nsqd 1.3.0 (optional: adds the `go` side)")
    parser.add_argument("--rounds", type=int, default=3, help="of the publish runs (0: the failover alone)")
    parser.add_argument("--seconds", type=float, default=5.0, help="publishing time per run")
    parser.add_argument("--only", nargs="*", default=None, help="scenario keys: " + " ".join(SCENARIOS))
    parser.add_argument("--sides", nargs="*", default=None, help="sides to run: " + " ".join(SIDES))
    parser.add_argument("--failovers", type=int, default=3, help="leader kills per lease TTL (0: none)")
    parser.add_argument("--lease-ttls", nargs="*", default=["2s", "10s"], help="--etcd-lease-ttl values to fail over with")
    parser.add_argument("--quick", action="store_true", help="1 round of 2 s, 2 failovers at a 2 s lease TTL")
    parser.add_argument("--output", default="bench-results.json", help="merged into this JSON file")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.failovers, args.lease_ttls = 1, 2.0, 2, ["2s"]
    keys = args.only or list(SCENARIOS)
    sides = [s for s in (args.sides or SIDES) if s != "go" or args.reference]
    info = machine()
    print(f"machine: {describe(info)}")
    base = Path(tempfile.mkdtemp(prefix="trio-nsq-bench-etcd-"))
    samples: dict[str, dict[str, list[dict[str, float]]]] = {k: {s: [] for s in sides} for k in keys}
    failovers: dict[str, list[float]] = {ttl: [] for ttl in args.lease_ttls}
    failed: dict[str, list[str]] = {ttl: [] for ttl in args.lease_ttls}
    report: dict[str, Any] = {"reference": os.path.abspath(args.reference) if args.reference else None,
                              "rounds": args.rounds, "seconds": args.seconds, "connections": CONNECTIONS, "size": SIZE,
                              "mpub_batch": MPUB_BATCH, "machine": info}
    try:
        with EtcdServer(base) as etcd:
            for round_no in range(1, args.rounds + 1):
                for key in keys:
                    for side in sides:  # interleaved: r3, r1, sync, plain, Go, r3, ...
                        figures = run_once(side, key, args.seconds, etcd, args.reference)
                        samples[key][side].append(figures)
                        print(f"round {round_no} {SCENARIOS[key][0]:<28} {TITLES[side]:<24} {figures['rate']:>9,.0f} msg/s"
                              f"  p50 {figures['p50_ms']:6.2f} ms  p99 {figures['p99_ms']:6.2f} ms"
                              f"  errors {figures['errors']}", flush=True)
            report["publish"] = publish_table(keys, sides, samples, args.rounds)
            merge_report(args.output, report, "replication_cost")  # (kept if a failover run goes wrong)
            for ttl in args.lease_ttls:
                for n in range(args.failovers):
                    try:
                        seconds = failover_once(etcd, ttl)
                    except (RuntimeError, OSError) as exc:  # one run's failure is reported, the others run
                        failed[ttl].append(str(exc))
                        print(f"failover {n + 1} (--etcd-lease-ttl={ttl}) FAILED: {exc}", flush=True)
                        continue
                    failovers[ttl].append(seconds)
                    print(f"failover {n + 1} (--etcd-lease-ttl={ttl}): {seconds:.2f} s from the leader's kill -9 "
                          f"to the first OK from the new leader", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    publish_table(keys, sides, samples, args.rounds, show=True)
    if args.failovers:
        print(f"\n{'failover, s (kill -9 to OK)':<28} {'median':>8} {'max':>8}   runs")
        for ttl, values in failovers.items():
            figures = f"{statistics.median(values):>8.2f} {max(values):>8.2f}" if values else f"{'-':>8} {'-':>8}"
            print(f"{'--etcd-lease-ttl=' + ttl:<28} {figures}   " + " ".join(f"{v:.2f}" for v in values)
                  + (f"   ({len(failed[ttl])} failed)" if failed[ttl] else ""))
    report["failover"] = {ttl: {"median_s": statistics.median(v) if v else None, "max_s": max(v) if v else None,
                                "runs_s": v, "failed": failed[ttl]} for ttl, v in failovers.items()}
    merge_report(args.output, report, "replication_cost")
    print(f"written {args.output}")
    return report


def publish_table(keys: list[str], sides: list[str], samples: dict[str, dict[str, list[dict[str, float]]]],
                  rounds: int, show: bool = False) -> dict[str, Any]:
    """The medians over the rounds, by scenario and side (printed as a table with `show`)."""
    results: dict[str, Any] = {}
    if rounds < 1:  # (--rounds 0: the failover alone)
        return results
    if show:
        header = "".join(f" {TITLES[s]:>24}" for s in sides)
        print(f"\n{'publish rate, msg/s (p99 ms)':<28}{header}   (medians of {rounds}; {CONNECTIONS} connections, "
              f"{SIZE}-byte messages, each command waiting for its answer)")
    for key in keys:
        medians = {side: {f: statistics.median(s[f] for s in samples[key][side]) for f in samples[key][side][0]}
                   for side in sides}
        results[key] = {"title": SCENARIOS[key][0], "medians": medians, "samples": samples[key]}
        if show:
            cells = "".join(f" {medians[s]['rate']:>16,.0f} ({medians[s]['p99_ms']:5.1f})" for s in sides)
            print(f"{SCENARIOS[key][0]:<28}{cells}")
    return results


if __name__ == "__main__":
    main()
