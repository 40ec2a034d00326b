"""RDY where the messages are, beside go-nsq (issue 50 item 3): `python -m tests.bench.client_rdy`.

    python -m tests.bench.client_rdy [--go-nsq DIR] [--reference DIR] [--rounds N] [--seconds S]
                                     [--backlog N] [--rotations S ...] [--output FILE]

Three brokers on free ports, --backlog messages on one of them (the last, then the one before, one a
round), none on the other two; a consumer of the topic over the three TCP addresses, with max_in_flight 1
and then 2 (fewer than the connections: the case where RDY has to find the broker with the messages),
reads for --seconds with a handler that does nothing (FIN), and the messages its handler was given are
counted. The figure is messages per second over the read (connecting included), and the count. 20 s by
default: go-nsq hands RDY 1 to the first max_in_flight connections it makes and takes it back from one
only after low_rdy_idle_timeout (10 s) without a message, so a shorter read shows go-nsq at 0 whenever
the backlog is not on one of those.

The sides, interleaved in each round on the same brokers: trio_nsq.client.Consumer with its defaults but
max_in_flight, run as a process of its own (`python -m tests.bench.client_rdy consume ...`); and go-nsq's
Consumer with its defaults but MaxInFlight (tests/bench/go/rdy_consumer). Each reads once with the
clients' own rdy_redistribute_interval (`default`: go-nsq's is 5 s) and once per --rotations value
(0.5 s by default, issue 50's first figure), given to both. go-nsq is built here from its source in
--go-nsq DIR or $GO_NSQ (GOPATH mode, no module proxy: golang/snappy from $GOPATH or Debian's
/usr/share/gocode, `apt-get install golang-go golang-github-golang-snappy-dev`). Without a go-nsq source,
or without `go`, it says go-nsq was not measured and runs ours alone. Brokers are trio-nsqd, and with
--reference DIR (Go's nsqd 1.3.0) also Go nsqd, in the same rounds. A read stops early once the whole
backlog has come (then seconds is shorter).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.bench.broker import Broker, post, publish
from tests.bench.machine import describe, machine, merge_report
from tests.processes import REPO_ROOT, repo_env

GO_PROGRAM = Path(__file__).parent / "go" / "rdy_consumer"
CHANNEL = "rdy"
BROKERS = 3
CLIENTS = {"trio": "trio_nsq Consumer", "go-nsq": "go-nsq Consumer"}
KINDS = {"go": "Go nsqd", "trio": "trio-nsqd"}


def consume(addresses: list[str], topic: str, max_in_flight: int, rotation: float, seconds: float,
            expect: int) -> dict[str, Any]:
    """Our side, in this process: a Consumer with its defaults but max_in_flight (and
    rdy_redistribute_interval when `rotation` is not 0), a no-op handler."""
    import trio

    from trio_nsq.client import Consumer

    delivered = 0
    done = trio.Event()

    async def handler(message: Any) -> None:
        nonlocal delivered
        delivered += 1
        if delivered == expect:
            done.set()

    async def run() -> dict[str, Any]:
        started = time.perf_counter()
        options: dict[str, Any] = {"rdy_redistribute_interval": rotation} if rotation else {}
        async with Consumer(topic, CHANNEL, handler, nsqd_tcp_addresses=addresses, max_in_flight=max_in_flight,
                            **options):
            with trio.move_on_after(seconds):
                await done.wait()
            elapsed = time.perf_counter() - started
            count = delivered
        return {"delivered": count, "seconds": elapsed, "per_second": count / elapsed}

    return trio.run(run)


def build_go_consumer(go_nsq: str, into: Path) -> Path:
    """tests/bench/go/rdy_consumer built against the go-nsq source at `go_nsq`, in GOPATH mode (no module
    proxy needed): a GOPATH in `into` with go-nsq linked in, then $GOPATH or Debian's for golang/snappy."""
    source = into / "src" / "github.com" / "nsqio"
    source.mkdir(parents=True)
    (source / "go-nsq").symlink_to(Path(go_nsq).resolve())
    gopath = os.pathsep.join([str(into), os.environ.get("GOPATH") or "/usr/share/gocode"])
    env = {**os.environ, "GO111MODULE": "off", "GOPATH": gopath, "GOCACHE": str(into / "cache"), "GOFLAGS": ""}
    binary = into / "rdy_consumer"
    out = subprocess.run(["go", "build", "-o", str(binary), "."], cwd=GO_PROGRAM, env=env, capture_output=True,
                         text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"building {GO_PROGRAM} against {go_nsq} failed:\n{out.stdout}{out.stderr}")
    return binary



def read_once(client: str, go_binary: Path | None, brokers: list[Broker], loaded: int, topic: str,
              max_in_flight: int, rotation: float, seconds: float, backlog: int) -> dict[str, Any]:
    """The backlog on brokers[loaded] (its channel made first, so the messages wait there), then one read
    by `client` (`rotation`: its rdy_redistribute_interval, 0 for its default); the topic is deleted
    everywhere after."""
    post(f"{brokers[loaded].http_url}/topic/create?topic={topic}", timeout=30)
    post(f"{brokers[loaded].http_url}/channel/create?topic={topic}&channel={CHANNEL}", timeout=30)
    publish(brokers[loaded].http_address, topic, backlog)
    addresses = [f"{host}:{port}" for host, port in (b.tcp for b in brokers)]
    if client == "go-nsq":
        assert go_binary is not None
        argv = [str(go_binary), f"--nsqd-tcp-addresses={','.join(addresses)}", f"--topic={topic}",
                f"--channel={CHANNEL}", f"--max-in-flight={max_in_flight}", f"--duration={seconds}s",
                f"--rdy-redistribute-interval={rotation}s",
                f"--expect={backlog}"]
    else:
        argv = [sys.executable, "-m", "tests.bench.client_rdy", "consume", ",".join(addresses), topic,
                str(max_in_flight), str(rotation), str(seconds), str(backlog)]
    # the consumer's CPU: the brokers are children too, but not reaped until they stop
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(argv, cwd=REPO_ROOT, env=repo_env(), capture_output=True, text=True, timeout=seconds + 120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise RuntimeError(f"{client} consumer failed: {(out.stdout + out.stderr)[-1000:]}")
    figures: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    figures["cpu_s"] = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
    for broker in brokers:
        post(f"{broker.http_url}/topic/delete?topic={topic}", timeout=30)
    return figures


def _rotation(seconds: float) -> str:
    return f"{seconds:g}s" if seconds else "default"


def _title(key: str) -> str:
    """trio_mif1_rotation_0.5s -> `trio-nsqd x3, max_in_flight 1, rotation 0.5s`"""
    kind, rest = key.split("_mif")
    mif, rotation = rest.split("_rotation_")
    return f"{KINDS[kind]} x3, max_in_flight {mif}, rotation {rotation}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--go-nsq", default=os.environ.get("GO_NSQ"), help="go-nsq's source (default: $GO_NSQ)")
    parser.add_argument("--reference", help="folder with Go's nsqd 1.3.0: Go nsqd brokers too")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long each read lasts")
    parser.add_argument("--backlog", type=int, default=200_000, help="messages waiting on the loaded broker")
    parser.add_argument("--max-in-flight", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rotations", type=float, nargs="*", default=[0.5],
                        help="rdy_redistribute_interval values given to both clients, beside their defaults")
    parser.add_argument("--output", default="bench-results.json", help="merged into this JSON file")
    args = parser.parse_args(argv)
    info = machine()
    print(f"machine: {describe(info)}")
    kinds = {"trio": None} if not args.reference else {"go": [os.path.join(args.reference, "nsqd")], "trio": None}
    workdir = Path(tempfile.mkdtemp(prefix="trio-nsq-rdy-"))
    try:
        go_binary = None
        if not args.go_nsq:
            print("go-nsq was not measured: give its source with --go-nsq DIR or GO_NSQ=DIR")
        elif not shutil.which("go"):
            print("go-nsq was not measured: no `go` on PATH "
                  "(apt-get install golang-go golang-github-golang-snappy-dev)")
        else:
            go_binary = build_go_consumer(args.go_nsq, workdir)
        clients = ["trio", "go-nsq"] if go_binary else ["trio"]
        samples: dict[str, dict[str, list[dict[str, Any]]]] = {}
        run_no = 0
        rotations = [0.0, *args.rotations]
        for round_no in range(1, args.rounds + 1):
            loaded = BROKERS - 1 - (round_no - 1) % BROKERS
            for kind, command in kinds.items():
                brokers: list[Broker] = []
                try:
                    for _ in range(BROKERS):
                        brokers.append(Broker(command=command))
                    for mif in args.max_in_flight:
                        for rotation in rotations:
                            key = f"{kind}_mif{mif}_rotation_{_rotation(rotation)}"
                            for client in clients:  # interleaved: ours, go-nsq, ours, go-nsq...
                                run_no += 1
                                figures = read_once(client, go_binary, brokers, loaded, f"rdy{run_no}", mif,
                                                    rotation, args.seconds, args.backlog)
                                samples.setdefault(key, {}).setdefault(client, []).append(figures)
                                print(f"round {round_no} {_title(key)}, backlog on #{loaded + 1}, "
                                      f"{CLIENTS[client]:<17} {figures['delivered']:>8,} in {figures['seconds']:.1f} s "
                                      f"({figures['per_second']:,.0f}/s, consumer CPU {figures['cpu_s']:.2f} s)",
                                      flush=True)
                finally:
                    for broker in brokers:
                        broker.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results: dict[str, Any] = {}
    print(f"\n{'brokers, max_in_flight, rotation':<50} " + " ".join(f"{CLIENTS[c] + ' msg/s':>24}" for c in clients)
          + (f" {'ratio':>7}" if len(clients) > 1 else "") + f"   (medians of {args.rounds})")
    for key, by_client in samples.items():
        medians = {c: statistics.median(s["per_second"] for s in by_client[c]) for c in clients}
        results[key] = {"medians_msg_s": medians, "samples": by_client}
        line = f"{_title(key):<50} " + " ".join(
            f"{medians[c]:>24,.0f}" for c in clients)
        if len(clients) > 1:
            ratio = medians["trio"] / medians["go-nsq"] if medians["go-nsq"] else None
            results[key]["trio_over_go_nsq"] = ratio
            line += f" {ratio:>7.2f}" if ratio is not None else f" {'-':>7}"
        print(line)
    merge_report(args.output, {"go_nsq": args.go_nsq if go_binary else None, "reference": args.reference,
                               "rounds": args.rounds, "seconds": args.seconds, "backlog": args.backlog,
                               "rotations_s": args.rotations,
                               "machine": info, "results": results}, "client_rdy")
    print(f"written {args.output}")
    return results


if __name__ == "__main__":
    if sys.argv[1:2] == ["consume"]:
        addresses, topic, mif, rotation, seconds, expect = sys.argv[2:8]
        print(json.dumps(consume(addresses.split(","), topic, int(mif), float(rotation), float(seconds), int(expect))))
    else:
        main()
