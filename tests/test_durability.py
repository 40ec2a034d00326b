"""Durability of the real broker process: kill -9, SIGTERM, corrupt files, a full disk, a lost data dir.

Every test counts message bodies: what got OK must come back after a restart; nothing accepted is lost.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path


from processes import BrokerProcess, REPO_ROOT
from trio_nsq.shared.protocol import (
    MAGIC_V2,
    DecodedMessage,
    FrameParser,
    decode_message,
    encode_dpub,
    encode_fin,
    encode_identify,
    encode_mpub,
    encode_pub,
    encode_rdy,
    encode_sub,
)

OK_FRAME = struct.pack(">ii", 6, 0) + b"OK"


def _connect(broker: BrokerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", broker.tcp_port), timeout=10)
    sock.sendall(MAGIC_V2)
    return sock


def _read_frame(sock: socket.socket, parser: FrameParser, timeout: float = 10) -> tuple[int, bytes] | None:
    sock.settimeout(timeout)
    while True:
        for frame in parser:
            return frame
        data = sock.recv(1 << 16)
        if not data:
            return None
        parser.feed(data)


def fin_each(sock: socket.socket, parser: FrameParser, keep_going: Callable[[], bool],
             read_timeout: float) -> Iterator[DecodedMessage]:
    """Each message delivered on `sock`, FIN'd once the caller has taken it (heartbeats answered), while
    keep_going() and the connection is open."""
    while keep_going():
        try:
            frame = _read_frame(sock, parser, timeout=read_timeout)
        except socket.timeout:
            continue
        if frame is None:
            return
        kind, data = frame
        if kind == 2:
            msg = decode_message(data)
            yield msg
            sock.sendall(encode_fin(msg.id))
        elif data == b"_heartbeat_":
            sock.sendall(b"NOP\n")


def _create_channel(broker: BrokerProcess, topic: str, channel: str) -> None:
    with _connect(broker) as sock:
        sock.sendall(encode_sub(topic, channel))
        assert _read_frame(sock, FrameParser()) == (0, b"OK")


def mpub_all(pub: socket.socket, topic: str, bodies: list[bytes], per_mpub: int) -> None:
    """Publish every body in MPUBs of `per_mpub`, each answered OK before the next."""
    parser = FrameParser()
    for start in range(0, len(bodies), per_mpub):
        pub.sendall(encode_mpub(topic, bodies[start : start + per_mpub]))
        assert _read_frame(pub, parser) == (0, b"OK")


def consume(broker: BrokerProcess, topic: str, channel: str, want: set[bytes], timeout: float = 60) -> dict[bytes, int]:
    """FIN everything; stop once every body in `want` was seen (or timeout). Returns body -> times seen."""
    seen: dict[bytes, int] = {}
    with _connect(broker) as sock:
        parser = FrameParser()
        sock.sendall(encode_identify({"heartbeat_interval": 5000}) + encode_sub(topic, channel) + encode_rdy(2500))
        deadline = time.monotonic() + timeout
        for msg in fin_each(sock, parser, lambda: not want <= seen.keys() and time.monotonic() < deadline, 1):
            seen[msg.body] = seen.get(msg.body, 0) + 1
    return seen


def test_kill_9_loses_no_acknowledged_message(broker_factory):
    """--mem-queue-size=0 --sync-every=1: an OK means fsynced; kill -9 mid-stream, restart, all come back."""
    broker = broker_factory(mem_queue_size=0, sync_every=1)
    _create_channel(broker, "dur", "ch")
    acked: list[bytes] = []
    lock = threading.Lock()
    stop = threading.Event()
    total, batch, writers = 100_000, 100, 4

    def writer(w: int) -> None:
        sock = _connect(broker)
        parser = FrameParser()
        i = 0
        try:
            while not stop.is_set() and i * batch * writers < total:
                bodies = [b"w%d-%d-%d" % (w, i, j) for j in range(batch)]
                sock.sendall(encode_mpub("dur", bodies))
                frame = _read_frame(sock, parser)
                if frame != (0, b"OK"):
                    return
                with lock:
                    acked.extend(bodies)
                i += 1
        except OSError:
            return
        finally:
            sock.close()

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(acked) < total // 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    broker.kill()
    stop.set()
    for t in threads:
        t.join(10)
    assert len(acked) >= total // 4, f"only {len(acked)} acknowledged before the kill"
    broker.start()
    want = set(acked)
    seen = consume(broker, "dur", "ch", want, timeout=90)
    missing = want - seen.keys()
    assert not missing, f"{len(missing)} of {len(want)} acknowledged messages lost, e.g. {sorted(missing)[:3]}"


def test_sigterm_keeps_memory_in_flight_and_deferred_messages(broker_factory):
    broker = broker_factory(mem_queue_size=100)
    _create_channel(broker, "term", "ch")
    bodies = [b"m%05d" % i for i in range(3000)]
    deferred = [b"d%03d" % i for i in range(20)]
    with _connect(broker) as pub:
        mpub_all(pub, "term", bodies, 500)
        parser = FrameParser()
        for body in deferred:
            pub.sendall(encode_dpub("term", 3_600_000, body))
            assert _read_frame(pub, parser) == (0, b"OK")
    # a consumer takes 50 and never finishes them: they are in flight at shutdown
    cons = _connect(broker)
    parser = FrameParser()
    cons.sendall(encode_identify({"heartbeat_interval": 30000}) + encode_sub("term", "ch") + encode_rdy(50))
    in_flight = set()
    while len(in_flight) < 50:
        kind, data = _read_frame(cons, parser)
        if kind == 2:
            in_flight.add(decode_message(data).body)
    assert broker.stop() == 0
    cons.close()
    broker.start()
    want = set(bodies)
    seen = consume(broker, "term", "ch", want, timeout=60)
    assert want <= seen.keys(), f"lost {len(want - seen.keys())}"
    assert in_flight <= seen.keys()
    # the deferred ones keep their hour's delay (nsqd's exit writes them plain: delivered at once)
    assert not set(deferred) & seen.keys()
    channel = broker.get("/stats?format=json&topic=term").json()["topics"][0]["channels"][0]
    assert channel["deferred_count"] == len(deferred)


def test_dpub_past_max_req_timeout_with_max_defer_time_survives_kill_9(broker_factory):
    """--max-defer-time caps DPUB apart from --max-req-timeout (nsqd's one cap for both): a delay past the
    latter is accepted over TCP and HTTP, one past the former refused with nsqd's error and maximum; the
    deferred messages survive a kill -9 and come at their deadline, not before."""
    broker = broker_factory(max_req_timeout="1s", max_defer_time="3s")
    assert broker.get("/config/max_defer_time").text == "3000000000"  # as nsqd shows a duration
    _create_channel(broker, "long", "ch")
    sent: dict[bytes, float] = {}
    with _connect(broker) as pub:
        parser = FrameParser()
        sent[b"tcp"] = time.monotonic()
        pub.sendall(encode_dpub("long", 2500, b"tcp"))
        assert _read_frame(pub, parser) == (0, b"OK")
        pub.sendall(encode_dpub("long", 3001, b"never"))
        assert _read_frame(pub, parser) == (1, b"E_INVALID DPUB timeout 3001 out of range 0-3000")
        assert _read_frame(pub, parser) is None  # fatal: closed
    sent[b"http"] = time.monotonic()
    assert broker.http.post("/pub?topic=long&defer=2500", content=b"http").text == "OK"
    refused = broker.http.post("/pub?topic=long&defer=3001", content=b"never")
    assert (refused.status_code, refused.json()) == (400, {"message": "INVALID_DEFER"})
    broker.kill()
    broker.start()
    came: dict[bytes, float] = {}
    with _connect(broker) as sock:
        sock.sendall(encode_identify({"heartbeat_interval": 5000}) + encode_sub("long", "ch") + encode_rdy(10))
        deadline = time.monotonic() + 30
        for msg in fin_each(sock, FrameParser(), lambda: len(came) < 2 and time.monotonic() < deadline, 1):
            assert msg.body not in came, msg.body
            came[msg.body] = time.monotonic()
    assert came.keys() == sent.keys()
    # each at its deadline, past --max-req-timeout, not before
    assert all(came[body] - sent[body] >= 2.5 for body in sent), {body: came[body] - sent[body] for body in sent}


def _diskqueue_files(data_path: Path, name: str) -> list[Path]:
    return sorted(data_path.glob(f"{name}.diskqueue.*.dat"))


def test_corrupt_and_truncated_files_are_survived(broker_factory):
    broker = broker_factory(mem_queue_size=0, max_bytes_per_file=4096)
    bodies = [b"c%04d" % i for i in range(400)]
    with _connect(broker) as pub:
        mpub_all(pub, "corrupt", bodies, 50)
    assert broker.stop() == 0
    files = [f for f in _diskqueue_files(broker.data_path, "corrupt") if "meta" not in f.name]
    assert len(files) >= 3, files
    # an impossible length at the start of the first file, and a truncated tail on the last
    with open(files[0], "r+b") as fh:
        fh.write(struct.pack(">i", 0x7FFFFFF0))
    with open(files[-1], "r+b") as fh:
        fh.truncate(os.path.getsize(files[-1]) - 3)
    broker.start()
    survivors = set(bodies)
    seen = consume(broker, "corrupt", "ch", survivors, timeout=8)
    assert broker.is_alive()
    assert len(seen) >= len(bodies) // 3, "the undamaged files must still be delivered"
    assert all(n == 1 for n in seen.values())
    assert "bad" in broker.log_text().lower() or list(broker.data_path.glob("*.bad"))
    # and it keeps serving
    with _connect(broker) as pub:
        pub.sendall(encode_pub("corrupt", b"after"))
        assert _read_frame(pub, FrameParser()) == (0, b"OK")


def test_full_disk_gives_pub_failed_and_loses_nothing_accepted(small_disk_broker):
    broker = small_disk_broker("2m", mem_queue_size=0)
    _create_channel(broker, "full", "ch")
    accepted: list[bytes] = []
    failed = None
    with _connect(broker) as pub:
        parser = FrameParser()
        for i in range(200):
            bodies = [b"f%04d-%03d" % (i, j) + b"x" * 200 for j in range(50)]
            pub.sendall(encode_mpub("full", bodies))
            frame = _read_frame(pub, parser)
            if frame != (0, b"OK"):
                failed = frame
                break
            accepted.extend(bodies)
    assert failed is not None and failed[0] == 1 and failed[1].startswith(b"E_MPUB_FAILED"), failed
    assert broker.is_alive()
    assert "failed to write" in broker.log_text()
    seen = consume(broker, "full", "ch", set(accepted), timeout=60)
    assert set(accepted) <= seen.keys(), f"lost {len(set(accepted) - seen.keys())} accepted messages"


def test_missing_data_directory(tmp_path):
    missing = tmp_path / "nope"
    proc = subprocess.run(
        [sys.executable, "-m", "trio_nsq.broker", "--tcp-address=127.0.0.1:0", "--http-address=127.0.0.1:0",
         f"--data-path={missing}"],
        cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=30,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert proc.returncode != 0
    assert f"--data-path={missing}" in proc.stderr and "Traceback" not in proc.stderr


def test_data_directory_removed_while_running(broker_factory):
    broker = broker_factory(mem_queue_size=0)
    with _connect(broker) as pub:
        parser = FrameParser()
        pub.sendall(encode_pub("gone", b"before"))
        assert _read_frame(pub, parser) == (0, b"OK")
    for f in broker.data_path.iterdir():
        f.unlink()
    broker.data_path.rmdir()
    time.sleep(0.3)  # the queue notices a vanished write file within 0.1 s
    with _connect(broker) as pub:
        parser = FrameParser()
        pub.sendall(encode_pub("gone", b"after"))
        kind, data = _read_frame(pub, parser)
        assert kind == 1 and data.startswith(b"E_PUB_FAILED"), data
    assert broker.is_alive()


def test_data_directory_is_locked(broker_factory, tmp_path):
    broker = broker_factory()
    proc = subprocess.run(
        [sys.executable, "-m", "trio_nsq.broker", "--tcp-address=127.0.0.1:0", "--http-address=127.0.0.1:0",
         f"--data-path={broker.data_path}"],
        cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=30,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert proc.returncode != 0 and "in use" in proc.stderr


def test_topics_and_channels_answered_survive_kill_9(broker_factory):
    """A creation is answered once its line is in nsqd.dat's journal (fsynced), not once nsqd.dat is written
    again: kill -9 while creations go on, and the restart has every topic and channel answered (and the
    deleted and paused ones as answered); the journal is compacted into nsqd.dat then."""
    import httpx
    broker = broker_factory()
    answered: list[int] = []
    done: list[str] = []

    def create() -> None:
        with httpx.Client(base_url=broker.http_url, timeout=10) as client:
            try:
                for i in range(100_000):
                    if i == 40:
                        assert client.post("/channel/delete?topic=k7&channel=a").status_code == 200
                        assert client.post("/topic/delete?topic=k8").status_code == 200
                        assert client.post("/channel/pause?topic=k9&channel=a").status_code == 200
                        done.append("changed")
                    assert client.post(f"/topic/create?topic=k{i}").status_code == 200
                    assert client.post(f"/channel/create?topic=k{i}&channel=a").status_code == 200
                    answered.append(i)
            except (httpx.HTTPError, AssertionError):
                return  # the broker is gone

    creator = threading.Thread(target=create)
    creator.start()
    deadline = time.monotonic() + 60
    while len(answered) < 80 and creator.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    broker.kill()  # creations still coming: nsqd.dat has not been compacted for their last second
    creator.join()
    assert done and len(answered) >= 80
    broker.start()
    stats = broker.get("/stats?format=json").json()
    channels = {t["topic_name"]: {c["channel_name"]: c["paused"] for c in t["channels"]} for t in stats["topics"]}
    for i in answered:
        assert channels.get(f"k{i}") == ({} if i == 7 else {"a": i == 9}) or i == 8, (i, channels.get(f"k{i}"))
    assert "k8" not in channels
    deadline = time.monotonic() + 10
    while (broker.data_path / "nsqd.dat.journal").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    meta = json.loads((broker.data_path / "nsqd.dat").read_text())
    assert len(meta["topics"]) == len(channels) and not (broker.data_path / "nsqd.dat.journal").exists()


def test_metadata_survives_restart(broker_factory):
    broker = broker_factory()
    _create_channel(broker, "meta", "ch1")
    _create_channel(broker, "meta", "ch2")
    _create_channel(broker, "meta", "tmp#ephemeral")
    deadline = time.monotonic() + 5
    path = broker.data_path / "nsqd.dat"
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert broker.stop() == 0
    meta = json.loads(path.read_text())
    topic = next(t for t in meta["topics"] if t["name"] == "meta")
    assert sorted(c["name"] for c in topic["channels"]) == ["ch1", "ch2"]
    broker.start()
    with _connect(broker) as pub:
        pub.sendall(encode_pub("meta", b"both"))
        assert _read_frame(pub, FrameParser()) == (0, b"OK")
    # both channels exist again after the restart, so each gets the message
    assert consume(broker, "meta", "ch1", {b"both"}, timeout=10) == {b"both": 1}
    assert consume(broker, "meta", "ch2", {b"both"}, timeout=10) == {b"both": 1}
