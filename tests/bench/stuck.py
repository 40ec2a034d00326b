"""A channel's memory behind unfinished messages, beside Go nsqd (issue 41, item 6):

    python -m tests.bench.stuck [--reference DIR] [--counts 1000000 10000000] [--windows 1000 10000]
                                [--window-count 1000000] [--rounds N]

trio-nsqd keeps a topic once, as a log, with a cursor per channel; what the cursor keeps for the records
read past its oldest unfinished one is what this measures. Each measurement is a fresh broker process,
the same flags for both (`--mem-queue-size=0`, so Go nsqd keeps its queues on disk too; --max-msg-timeout
twice the held message's timeout; --max-rdy-count=10000 for the largest window), Go nsqd and trio-nsqd
alternately with --reference, trio-nsqd alone without:

1. **held**: a consumer IDENTIFYs with msg_timeout --held-timeout (10 minutes), SUBs to `t`/`c` with RDY 1,
   takes the first message and never FINs it (it answers heartbeats, nothing else). Then N messages are
   MPUB'd over TCP (a process of their own, batches of 200, 8 in flight) while a second consumer on the
   same channel, RDY 2500 (NSQ's bench_reader), FINs every one as it comes, one write per read: the
   broker's RSS before publishing, once /stats shows all N finished, and after --settle seconds; the growth
   (settled - before) in MB and per million messages; the seconds from the first MPUB until /stats shows
   them all finished; the broker's peak RSS, CPU (and the clients', to show they are not the bottleneck)
   and data directory (its size; each file's in the JSON: trio-nsqd keeps the log behind the held message,
   Go nsqd 1.3.0 leaves a `.diskqueue.*.dat.bad` file where its reader caught up with its writer at a file
   boundary: an EOF taken for corruption, logged as an error, no message lost).
2. **window**: no held message; the consumer, RDY W, takes W messages, FINs them in a random order (one
   write), takes the next W... for --window-count messages: the same figures. Bounded by the window, not by
   the count, is the aim.

Every figure comes from a checked run: the body of each message carries its sequence number, and each
consumer must have had every message exactly once (a bitmap; out-of-order deliveries are counted and
shown), the held consumer nothing but its one; at the end /stats must show the channel with depth 0, no
requeue or timeout, and in flight exactly the held message (held) or nothing (window). Otherwise the run
fails rather than print a figure.

The figures go to bench-results.json under "stuck" (medians over --rounds; the data files of the last).
On a shared machine the times say little: the load average at the start is printed and saved with them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import struct
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.bench.broker import Broker
from tests.bench.machine import describe, machine, merge_report
from trio_nsq.shared.protocol import MAGIC_V2, encode_identify, encode_mpub_body, encode_pub, encode_rdy, encode_sub

TOPIC = "t"
CHANNEL = "c"
BODY_SIZE = 100  # an 8-byte big-endian sequence number, then padding
BATCH = 200  # messages per MPUB (NSQ's bench_writer)
DEPTH = 8  # MPUBs in flight
READER_RDY = 2500  # NSQ's bench_reader
MAX_RDY = 10_000  # Go nsqd's default --max-rdy-count is 2500: the largest window must be allowed
STALL = 60.0  # seconds without a delivery that fail a run

_FRAME = struct.Struct(">ii")
_SEQ = struct.Struct(">Q")
_OK = struct.pack(">ii", 6, 0) + b"OK"
_HEARTBEAT = b"_heartbeat_"
_HEARTBEAT_FRAME = struct.pack(">ii", 4 + len(_HEARTBEAT), 0) + _HEARTBEAT


def _flags(held_timeout_s: float) -> tuple[str, ...]:
    return ("--mem-queue-size=0", f"--max-msg-timeout={int(held_timeout_s * 2)}s", f"--max-rdy-count={MAX_RDY}")


def _connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(MAGIC_V2)
    return sock


def _expect_ok(sock: socket.socket, what: str) -> None:
    """The next frame must be OK (heartbeats answered): the answer to an IDENTIFY, SUB or PUB."""
    buf = b""
    while True:
        while len(buf) < 8 or len(buf) < 4 + _FRAME.unpack_from(buf)[0]:
            data = sock.recv(4096)
            if not data:
                raise RuntimeError(f"{what}: the broker closed the connection")
            buf += data
        size, frame_type = _FRAME.unpack_from(buf)
        payload, buf = buf[8:4 + size], buf[4 + size:]
        if frame_type == 0 and payload == _HEARTBEAT:
            sock.sendall(b"NOP\n")
            continue
        if (frame_type, payload) != (0, b"OK") or buf:
            raise RuntimeError(f"{what}: expected OK, got {(frame_type, payload, buf)!r}")
        return


def _consumer(broker: Broker, client_id: str, msg_timeout_ms: int | None = None) -> socket.socket:
    sock = _connect(broker.tcp)
    identify: dict[str, Any] = {"client_id": client_id, "hostname": "bench", "user_agent": "tests.bench.stuck"}
    if msg_timeout_ms is not None:
        identify["msg_timeout"] = msg_timeout_ms
    sock.sendall(encode_identify(identify))
    _expect_ok(sock, f"IDENTIFY {client_id}")
    sock.sendall(encode_sub(TOPIC, CHANNEL))
    _expect_ok(sock, f"SUB {client_id}")
    return sock


def _body(seq: int) -> bytes:
    return _SEQ.pack(seq) + b"p" * (BODY_SIZE - _SEQ.size)


# --- the publisher: a process of its own ---------------------------------------------------------------


def publisher(address: tuple[str, int], first: int, count: int, result: Any) -> None:
    """MPUB messages `first` .. `first + count - 1` (BATCH a command, DEPTH commands in flight), each
    answer checked to be OK; puts ("published", count, seconds, cpu seconds) on `result`."""
    try:
        sock = _connect(address)
        started = time.perf_counter()
        # one MPUB whose sequence numbers are patched in place: the client must not be the bottleneck
        bodies = [_body(0)] * BATCH
        head = b"MPUB " + TOPIC.encode() + b"\n"
        payload = encode_mpub_body(bodies)
        command = bytearray(head + struct.pack(">i", len(payload)) + payload)
        offsets = [len(head) + 4 + 4 + i * (4 + BODY_SIZE) + 4 for i in range(BATCH)]
        pack_into = _SEQ.pack_into
        seq = first
        end = first + count
        buf = bytearray()
        while seq < end:
            burst = []
            for _ in range(DEPTH):
                if seq >= end:
                    break
                n = min(BATCH, end - seq)
                if n < BATCH:  # the last, short batch
                    burst.append(head + struct.pack(">i", len(p := encode_mpub_body([_body(s) for s in range(seq, seq + n)]))) + p)
                else:
                    for i, offset in enumerate(offsets):
                        pack_into(command, offset, seq + i)
                    burst.append(bytes(command))
                seq += n
            sock.sendall(b"".join(burst))
            answered = 0
            while answered < len(burst):  # each MPUB answered OK; heartbeats (every 30 s) answered NOP
                while len(buf) < 8 or len(buf) < 4 + _FRAME.unpack_from(buf)[0]:
                    data = sock.recv(65536)
                    if not data:
                        raise RuntimeError("publisher: the broker closed the connection")
                    buf += data
                size = _FRAME.unpack_from(buf)[0]
                if buf[:4 + size] == _OK:
                    answered += 1
                elif buf[:4 + size] == _HEARTBEAT_FRAME:
                    sock.sendall(b"NOP\n")
                else:
                    raise RuntimeError(f"publisher: MPUB not answered OK: {bytes(buf[:200])!r}")
                del buf[:4 + size]
        elapsed = time.perf_counter() - started
        sock.close()
        result.put(("published", count, elapsed, time.process_time()))
    except Exception as exc:  # reported, so the runner does not wait for a count that never comes
        result.put(("error", repr(exc)))


# --- the consumers ------------------------------------------------------------------------------------


class HeldConsumer:
    """RDY 1: takes one message and holds it (never FIN'd); a thread answers heartbeats and counts
    whatever else comes (nothing must)."""

    def __init__(self, broker: Broker, msg_timeout_ms: int) -> None:
        self.sock = _consumer(broker, "held", msg_timeout_ms)
        self.held: int | None = None
        self.extra: list[Any] = []
        self.closed = False
        self._got = threading.Event()
        self.sock.sendall(encode_rdy(1))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        buf = bytearray()
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    self.closed = True
                    return
                buf += data
                while len(buf) >= 8 and len(buf) >= 4 + (size := _FRAME.unpack_from(buf)[0]):
                    frame_type = _FRAME.unpack_from(buf)[1]
                    if frame_type == 0 and buf[8:4 + size] == _HEARTBEAT:
                        self.sock.sendall(b"NOP\n")
                    elif frame_type == 2 and self.held is None:
                        self.held = _SEQ.unpack_from(buf, 34)[0]
                        self._got.set()
                    else:
                        self.extra.append((frame_type, bytes(buf[8:min(4 + size, 60)])))
                    del buf[:4 + size]
        except OSError:
            self.closed = True

    def wait(self, timeout: float) -> int:
        if not self._got.wait(timeout):
            raise RuntimeError("the held consumer got no message")
        assert self.held is not None
        return self.held

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._thread.join(5)


def consume(sock: socket.socket, first: int, count: int, window: int, deadline: float,
            idle: Callable[[int], None]) -> dict[str, int]:
    """Take messages `first` .. `first + count - 1`: window 0 FINs each read's messages at once, in the
    order they came (one write per read); window W holds W, then FINs them in a random order. Raises
    on a duplicate, a message outside the range, an error frame, or time running out (`deadline`, a
    perf_counter: the held message's timeout); `idle(messages so far)` is called after each second
    without data, to raise if the run has failed elsewhere."""
    seen = bytearray(count)
    got = 0
    out_of_order = 0
    expected = first
    buf = bytearray()
    unpack_frame = _FRAME.unpack_from
    unpack_seq = _SEQ.unpack_from
    held: list[bytes] = []
    shuffle = random.Random(1).shuffle
    sock.settimeout(1.0)
    while got < count:
        try:
            data = sock.recv(1 << 20)
        except socket.timeout:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"consumer: {got:,} of {count:,} after the deadline") from None
            idle(got)
            continue
        if not data:
            raise RuntimeError(f"consumer: the broker closed the connection after {got:,} of {count:,}")
        buf += data
        pos = 0
        end = len(buf)
        out = []
        while end - pos >= 8:
            size, frame_type = unpack_frame(buf, pos)
            if end - pos < 4 + size:
                break
            if frame_type == 2:
                seq = unpack_seq(buf, pos + 34)[0]
                index = seq - first
                if not 0 <= index < count or seen[index]:
                    raise RuntimeError(f"consumer: message {seq} {'again' if 0 <= index < count else 'unexpected'}"
                                       f" (after {got:,})")
                seen[index] = 1
                if seq != expected:
                    out_of_order += 1
                expected = seq + 1
                got += 1
                line = b"FIN " + buf[pos + 18:pos + 34] + b"\n"
                if window:
                    held.append(line)
                else:
                    out.append(line)
            elif frame_type == 0 and buf[pos + 8:pos + 4 + size] == _HEARTBEAT:
                out.append(b"NOP\n")
            else:
                raise RuntimeError(f"consumer: unexpected frame {frame_type} {bytes(buf[pos + 8:pos + 4 + size])[:200]!r}")
            pos += 4 + size
        del buf[:pos]
        if window and (len(held) >= window or got == count):
            shuffle(held)
            out.extend(held)
            held = []
        if out:
            sock.sendall(b"".join(out))
    if seen.count(0):
        raise RuntimeError(f"consumer: {seen.count(0):,} messages never came")
    return {"received": got, "out_of_order": out_of_order}


# --- the broker's side ----------------------------------------------------------------------------------


def _stats(broker: Broker) -> dict[str, Any]:
    """The channel's stats (Go's and ours: the same JSON)."""
    url = f"{broker.http_url}/stats?format=json&topic={TOPIC}&channel={CHANNEL}"
    with urllib.request.urlopen(url, timeout=30) as resp:
        doc = json.loads(resp.read())
    for topic in doc.get("topics") or []:
        for channel in topic.get("channels") or []:
            if topic["topic_name"] == TOPIC and channel["channel_name"] == CHANNEL:
                return channel
    raise RuntimeError(f"no {TOPIC}/{CHANNEL} in /stats: {doc!r}"[:500])


def _finished(broker: Broker, total: int, held: int) -> bool:
    c = _stats(broker)
    finished = sum(client["finish_count"] for client in c.get("clients") or [])
    return c["in_flight_count"] == held and finished == total - held and c["depth"] == 0


def _check_stats(broker: Broker, total: int, held: int) -> dict[str, Any]:
    """The channel once every message is FIN'd: nothing waiting, nothing requeued or timed out, exactly
    the held message in flight (in the held consumer's hands), every other FIN'd."""
    c = _stats(broker)
    clients = {client["client_id"]: client for client in c.get("clients") or []}
    problems = []
    for field, want in (("depth", 0), ("in_flight_count", held), ("deferred_count", 0), ("requeue_count", 0),
                        ("timeout_count", 0), ("message_count", total)):
        if c.get(field) != want:
            problems.append(f"{field} {c.get(field)} (expected {want})")
    if held:
        h = clients.get("held") or {}
        if (h.get("in_flight_count"), h.get("finish_count"), h.get("message_count")) != (1, 0, 1):
            problems.append(f"the held consumer: {h!r}"[:300])
    r = clients.get("reader") or {}
    if (r.get("in_flight_count"), r.get("finish_count"), r.get("message_count")) != (0, total - held, total - held):
        problems.append(f"the reader: in flight {r.get('in_flight_count')}, finished {r.get('finish_count')}, "
                        f"sent {r.get('message_count')} (expected 0, {total - held:,}, {total - held:,})")
    if problems:
        raise RuntimeError("/stats after the run: " + "; ".join(problems))
    return c


def _data_files(path: Path) -> dict[str, int]:
    """The broker's data directory: each file's name and the bytes it takes on disk."""
    files = {}
    for root, _dirs, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            try:
                files[os.path.relpath(full, path)] = os.stat(full).st_blocks * 512
            except FileNotFoundError:
                pass
    return files


def run_once(side: str, reference: str | None, count: int, window: int, held_timeout_s: float,
             settle: float) -> dict[str, Any]:
    """One measurement on a fresh broker: window 0 is the held-message run, else the window run."""
    command = [os.path.join(reference, "nsqd")] if side == "go" and reference else None
    broker = Broker(*_flags(held_timeout_s), command=command)
    ctx = mp.get_context("fork")
    result = ctx.Queue()
    pub = None
    held_consumer = None
    reader = None
    try:
        deadline = time.perf_counter() + held_timeout_s * 0.95
        first = 0
        if not window:
            held_consumer = HeldConsumer(broker, int(held_timeout_s * 1000))
            with _connect(broker.tcp) as sock:
                sock.sendall(encode_pub(TOPIC, _body(0)))
                _expect_ok(sock, "PUB")
            if held_consumer.wait(10) != 0:
                raise RuntimeError(f"the held consumer got message {held_consumer.held}, not 0")
            first = 1
        reader = _consumer(broker, "reader")
        reader.sendall(encode_rdy(window or READER_RDY))
        time.sleep(0.5)
        rss_before = broker.rss_mb()
        cpu_before = broker.cpu_seconds()
        client_cpu = time.process_time()
        started = time.perf_counter()
        pub = ctx.Process(target=publisher, args=(broker.tcp, first, count, result))
        pub.start()
        published: list[tuple] = []
        progress = [time.perf_counter(), 0]

        def idle(got: int) -> None:
            """A failed publisher, or nothing delivered for STALL seconds: the run has failed."""
            if not published and not result.empty():
                published.append(result.get())
            if published and published[0][0] == "error":
                raise RuntimeError(f"the publisher: {published[0][1]}")
            now = time.perf_counter()
            if got != progress[1]:
                progress[:] = [now, got]
            elif now - progress[0] > STALL:
                c = _stats(broker)
                raise RuntimeError(f"consumer: nothing for {STALL} s after {got:,} of {count:,}; the channel: "
                                   + ", ".join(f"{k} {c[k]}" for k in ("depth", "in_flight_count", "message_count")))

        got = consume(reader, first, count, window, deadline, idle)
        client_cpu = time.process_time() - client_cpu
        while not _finished(broker, count + first, first):
            if time.perf_counter() > deadline:
                raise RuntimeError(f"/stats never showed every message finished: {_stats(broker)!r}"[:600])
            time.sleep(0.02)
        elapsed = time.perf_counter() - started
        rss_after = broker.rss_mb()
        item = published[0] if published else result.get(timeout=60)
        if item[0] == "error":
            raise RuntimeError(item[1])
        pub.join(10)
        time.sleep(settle)
        rss_settled = broker.rss_mb()
        stats = _check_stats(broker, count + first, first)
        if held_consumer is not None:
            if held_consumer.extra or held_consumer.closed:
                raise RuntimeError(f"the held consumer: closed {held_consumer.closed}, "
                                   f"more frames {held_consumer.extra[:5]!r}")
        growth = rss_settled - rss_before
        files = _data_files(broker.data_path)
        return {"count": count, "window": window, "rss_before_mb": rss_before, "rss_after_mb": rss_after,
                "rss_settled_mb": rss_settled, "growth_mb": growth, "mb_per_million": growth / count * 1e6,
                "peak_rss_mb": broker.memory()["VmHWM"] / (1024 * 1024), "seconds": elapsed,
                "msg_per_s": count / elapsed, "broker_cpu_s": broker.cpu_seconds() - cpu_before,
                "publish_s": item[2], "publisher_cpu_s": item[3], "consumer_cpu_s": client_cpu,
                "data_dir_mb": sum(files.values()) / (1024 * 1024), "data_files": files, "out_of_order": got["out_of_order"],
                "in_flight": stats["in_flight_count"]}
    except Exception as exc:
        raise RuntimeError(f"{side}, {count:,} messages{f', window {window:,}' if window else ''}: {exc}\n"
                           f"--- the broker's log, last lines:\n{broker.log_text()[-3000:]}") from exc
    finally:
        if reader is not None:
            reader.close()
        if held_consumer is not None:
            held_consumer.close()
        if pub is not None and pub.is_alive():
            pub.terminate()
            pub.join(5)
        broker.close()


def _line(side: str, title: str, f: dict[str, Any]) -> str:
    return (f"{title:<34} {side:<5} RSS {f['rss_before_mb']:6.1f} -> {f['rss_after_mb']:6.1f} MB "
            f"(settled {f['rss_settled_mb']:6.1f}): +{f['growth_mb']:6.1f} MB, {f['mb_per_million']:6.2f} MB per "
            f"million; peak {f['peak_rss_mb']:6.1f} MB; {f['seconds']:6.1f} s ({f['msg_per_s']:8,.0f} msg/s, "
            f"CPU s: broker {f['broker_cpu_s']:5.1f}, publisher {f['publisher_cpu_s']:4.1f}, consumer "
            f"{f['consumer_cpu_s']:4.1f}); data dir {f['data_dir_mb']:7.1f} MB in {len(f['data_files'])} files; "
            f"in flight {f['in_flight']:.0f}, {f['out_of_order']:.0f} out of order")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", help="folder with Go's nsqd 1.3.0 (else ours only)")
    parser.add_argument("--counts", type=int, nargs="*", default=[1_000_000, 10_000_000],
                        help="messages FIN'd behind the held one")
    parser.add_argument("--windows", type=int, nargs="*", default=[1_000, 10_000],
                        help="window sizes of the random-FIN-order runs (none: skip them)")
    parser.add_argument("--window-count", type=int, default=1_000_000, help="messages in each window run")
    parser.add_argument("--held-timeout", type=float, default=600.0,
                        help="the held message's msg_timeout, seconds (a run must finish within it)")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds between the end and the settled RSS")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--output", default="bench-results.json")
    args = parser.parse_args(argv)
    if any(w > MAX_RDY for w in args.windows):
        parser.error(f"a window is at most {MAX_RDY} (the brokers' --max-rdy-count here)")
    load = os.getloadavg()
    print(f"machine: {describe(machine())}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start")
    print(f"flags: {' '.join(_flags(args.held_timeout))}; {BODY_SIZE}-byte bodies, MPUB by {BATCH}")
    sides = ("go", "trio") if args.reference else ("trio",)
    runs = [(f"held|{n}", n, 0) for n in args.counts] + [(f"window|{w}|{args.window_count}", args.window_count, w)
                                                         for w in args.windows]
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for _ in range(args.rounds):
        for key, count, window in runs:
            title = (f"{count:>10,} FIN'd behind 1 held" if not window
                     else f"{count:>10,} FIN'd in windows of {window:,}")
            for side in sides:
                figures = run_once(side, args.reference, count, window, args.held_timeout, args.settle)
                samples.setdefault(key, {}).setdefault(side, []).append(figures)
                print(_line(side, title, figures), flush=True)
    results: dict[str, Any] = {"flags": list(_flags(args.held_timeout)), "load_average_at_start": list(load),
                               "rounds": args.rounds}
    print(f"\n{'RSS growth, MB (per million)':<40} {'Go nsqd':>16} {'trio-nsqd':>16}")
    for key, count, window in runs:
        entry: dict[str, Any] = {"count": count, "window": window}
        for name in ("rss_before_mb", "rss_after_mb", "rss_settled_mb", "growth_mb", "mb_per_million",
                     "peak_rss_mb", "seconds", "msg_per_s", "broker_cpu_s", "publisher_cpu_s", "consumer_cpu_s",
                     "data_dir_mb"):
            entry[name] = {side: statistics.median(s[name] for s in samples[key][side]) for side in sides}
        entry["data_files"] = {side: samples[key][side][-1]["data_files"] for side in sides}  # the last round's
        results[key.replace("|", "_")] = entry
        shown = {side: f"{entry['growth_mb'][side]:6.1f} ({entry['mb_per_million'][side]:5.2f})" for side in sides}
        label = f"{count:,} behind 1 held" if not window else f"{count:,} in windows of {window:,}"
        print(f"{label:<40} {shown.get('go', '-'):>16} {shown['trio']:>16}")
    merge_report(args.output, results, "stuck")
    return results


if __name__ == "__main__":
    main()
