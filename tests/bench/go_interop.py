"""Data directories across the two brokers, with the real Go nsqd 1.3.0 (`make bench NSQ_REFERENCE=<dir>`):

    python -m tests.bench.go_interop --reference DIR [--output FILE]

1. Ours read by Go: trio-nsqd gets a topic with 8 channels and 20,000 messages plus 500 deferred for an
   hour; channels c0-c1 finish everything, c2-c4 half, c5-c7 take 5,000, finish 2,000 and requeue 1,000
   for a minute. It stops (SIGTERM, then again with kill -9 in a second run); Go nsqd starts on the same
   directory and every channel is drained: every message a channel had not finished must come (Go reads
   the topic's log from the oldest message any channel has not finished, so it delivers again some a
   channel had finished, and the deferred ones early: counted, allowed). SIGTERM runs with default
   flags, kill -9 with --mem-queue-size=0 --sync-every=1 (default flags lose to a kill -9 what they keep
   in memory, in Go nsqd as in ours).
2. Go's read by ours: Go nsqd with --mem-queue-size=0 gets a topic with 4 channels and 10,000 messages;
   c0 finishes 3,000, c1 takes 2,000 and leaves them in flight. It stops; trio-nsqd starts on the same
   directory and every channel is drained: every message Go had not finished must come.

It prints one line per case (lost, duplicates) and fails (exit 1) if any message was lost.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from tests.bench.machine import merge_report
from tests.nsq_raw import FrameTimeout, Message, RawNSQ
from tests.processes import BrokerProcess

TOPIC = "interop"


class Nsqd(BrokerProcess):
    """A broker on a given data directory: trio-nsqd, or the Go binary at `binary`."""

    def __init__(self, base: Path, data: Path, binary: str | None = None, **flags: object) -> None:
        super().__init__(base, **flags)
        self.data_path = data
        self._binary = binary

    def command(self) -> list[str]:
        return [self._binary] if self._binary else super().command()


def publish(broker: Nsqd, bodies: list[bytes]) -> None:
    with RawNSQ(broker.tcp_address, timeout=30) as conn:
        for at in range(0, len(bodies), 500):
            conn.mpub(TOPIC, bodies[at:at + 500])


def dpub(broker: Nsqd, bodies: list[bytes], delay_ms: int) -> None:
    with RawNSQ(broker.tcp_address, timeout=30) as conn:
        for body in bodies:
            conn.dpub(TOPIC, delay_ms, body)


def create(broker: Nsqd, channels: list[str]) -> None:
    broker.http.post("/topic/create", params={"topic": TOPIC}).raise_for_status()
    for channel in channels:
        broker.http.post("/channel/create", params={"topic": TOPIC, "channel": channel}).raise_for_status()


def take(conn: RawNSQ, n: int, fin: bool) -> list:
    """n messages (RDY up to 2,500), each FIN'd as it comes when `fin`."""
    got = []
    conn.rdy(min(n, 2500))
    while len(got) < n:
        msg = conn.expect_message(timeout=10)
        got.append(msg)
        if fin:
            conn.fin(msg.id)
    conn.rdy(0)
    return got


def drain(broker: Nsqd, channel: str, quiet: float = 1.5, limit: float = 60.0) -> list[tuple[bytes, float]]:
    """Every message the channel delivers (FIN'd) until `quiet` seconds pass without one."""
    out: list[tuple[bytes, float]] = []
    with RawNSQ(broker.tcp_address, timeout=10) as conn:
        conn.sub(TOPIC, channel)
        conn.rdy(2500)
        end = time.monotonic() + limit
        while time.monotonic() < end:
            try:
                frame = conn.next_frame(quiet)
            except FrameTimeout:
                break
            if isinstance(frame, Message):
                conn.fin(frame.id)
                out.append((frame.body, time.monotonic()))
    return out


def check(name: str, want: dict[str, set[bytes]], got: dict[str, list[tuple[bytes, float]]],
          done: dict[str, set[bytes]]) -> dict:
    """Per channel: what it had not finished must come (lost otherwise); what comes twice, or comes
    though it was finished, is a duplicate (at least once allows them)."""
    lost = twice = again = 0
    for channel, bodies in want.items():
        seen: dict[bytes, int] = {}
        for body, _ in got.get(channel, []):
            seen[body] = seen.get(body, 0) + 1
        lost += len(bodies - seen.keys())
        twice += sum(n - 1 for n in seen.values() if n > 1)
        again += len(done.get(channel, set()) & seen.keys())
    result = {"unfinished": sum(len(b) for b in want.values()), "channels": len(want), "lost": lost,
              "delivered_twice": twice, "finished_delivered_again": again}
    print(f"{name}: {result['unfinished']:,} unfinished messages in {len(want)} channels: lost {lost}; "
          f"duplicates: {twice} delivered twice, {again} finished ones delivered again", flush=True)
    return result


def ours_read_by_go(reference: str, stop: int) -> dict:
    """SIGTERM with default flags (what was in memory is written at exit), kill -9 with the durable
    flags (a kill -9 loses what default flags keep in memory, in Go nsqd as in ours)."""
    base = Path(tempfile.mkdtemp(prefix="trio-nsq-interop-"))
    data = base / "data"
    data.mkdir()
    channels = [f"c{i}" for i in range(8)]
    flags: dict[str, object] = {} if stop == signal.SIGTERM else {"mem_queue_size": 0, "sync_every": 1}
    ours = Nsqd(base, data, **flags).start()
    want: dict[str, set[bytes]] = {}
    done: dict[str, set[bytes]] = {}
    try:
        create(ours, channels)
        bodies = [b"m-%06d" % i for i in range(20_000)]
        publish(ours, bodies)
        deferred = [b"d-%04d" % i for i in range(500)]
        dpub(ours, deferred, 3_600_000)
        held: list[RawNSQ] = []
        for i, channel in enumerate(channels):
            conn = RawNSQ(ours.tcp_address, timeout=20)
            conn.sub(TOPIC, channel)
            if i < 2:
                finish = take(conn, 20_000, fin=True)
            elif i < 5:
                finish = take(conn, 10_000, fin=True)
            else:
                msgs = take(conn, 2_500, fin=False)  # 1,000 FIN'd, 1,000 requeued, 500 left in flight
                finish = msgs[:1_000]
                for msg in finish:
                    conn.fin(msg.id)
                for msg in msgs[1_000:2_000]:
                    conn.req(msg.id, 60_000)
            conn.nop()
            held.append(conn)
            want[channel] = (set(bodies) | set(deferred)) - {m.body for m in finish}
            done[channel] = {m.body for m in finish}
        time.sleep(2.5)  # a sync round: the FINs are persisted
        ours.stop(stop)
        for conn in held:
            conn.close()
        go = Nsqd(base, data, reference).start()
        try:
            got = {channel: drain(go, channel) for channel in channels}
        finally:
            go.stop()
        how = "default flags, SIGTERM" if stop == signal.SIGTERM else "--mem-queue-size=0 --sync-every=1, kill -9"
        return check(f"trio-nsqd's directory ({how}) read by Go nsqd 1.3.0", want, got, done)
    finally:
        ours.stop()


def go_read_by_ours(reference: str) -> dict:
    base = Path(tempfile.mkdtemp(prefix="trio-nsq-interop-"))
    data = base / "data"
    data.mkdir()
    channels = [f"c{i}" for i in range(4)]
    go = Nsqd(base, data, reference, mem_queue_size=0).start()
    want: dict[str, set[bytes]] = {}
    try:
        create(go, channels)
        bodies = [b"g-%06d" % i for i in range(10_000)]
        publish(go, bodies)
        time.sleep(0.5)
        with RawNSQ(go.tcp_address, timeout=20) as c0:
            c0.sub(TOPIC, "c0")
            take(c0, 3_000, fin=True)
            c0.nop()
            time.sleep(0.5)
        with RawNSQ(go.tcp_address, timeout=20) as c1:
            c1.sub(TOPIC, "c1")
            take(c1, 2_000, fin=False)  # in flight when Go stops: Go writes them back to the channel's queue
            go.stop()
        finished = {"c0": set(bodies[:3_000])}
        for channel in channels:
            want[channel] = set(bodies) - finished.get(channel, set())
    finally:
        go.stop()
    ours = Nsqd(base, data).start()
    try:
        got = {channel: drain(ours, channel) for channel in channels}
    finally:
        ours.stop()
    return check("Go nsqd 1.3.0's directory read by trio-nsqd", want, got, finished)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, help="folder with Go's nsqd 1.3.0")
    parser.add_argument("--output", default="bench-results.json")
    args = parser.parse_args(argv)
    reference = os.path.join(args.reference, "nsqd")
    results = {
        "ours_read_by_go_sigterm": ours_read_by_go(reference, signal.SIGTERM),
        "ours_read_by_go_kill9": ours_read_by_go(reference, signal.SIGKILL),
        "go_read_by_ours": go_read_by_ours(reference),
    }
    merge_report(args.output, results, "go_interop")
    return 1 if any(r["lost"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
