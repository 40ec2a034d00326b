"""One log per topic, through a broker process with raw TCP and HTTP: fan-out to 8 channels written
once (the broker's bytes written, from /proc), seek with retention (earliest replays every message in
publish order, a time between two halves only the second), a seek that survives kill -9, seek's errors,
and what /stats says of the log."""

from __future__ import annotations

import time

from nsq_raw import RawNSQ, encode_mpub_body
from processes import BrokerProcess

PAYLOAD = 200


def io_written(broker: BrokerProcess) -> int:
    """Bytes the broker process sent to storage (/proc/PID/io write_bytes: counted as pages are dirtied,
    so what the page cache holds counts too; sockets do not)."""
    assert broker.proc is not None
    with open(f"/proc/{broker.proc.pid}/io") as fh:
        fields = dict(line.split(": ") for line in fh.read().splitlines())
    return int(fields["write_bytes"])


def create(broker: BrokerProcess, name: str, channel: str) -> None:
    assert broker.http.post("/topic/create", params={"topic": name}).status_code == 200
    assert broker.http.post("/channel/create", params={"topic": name, "channel": channel}).status_code == 200


def topic(broker: BrokerProcess, name: str) -> dict:
    doc = broker.get(f"/stats?format=json&topic={name}").json()
    return next(t for t in doc["topics"] if t["topic_name"] == name)


def wait_depths(broker: BrokerProcess, name: str, depth: int, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        t = topic(broker, name)
        if t["channels"] and all(c["depth"] == depth for c in t["channels"]):
            return t
        assert time.monotonic() < deadline, t
        time.sleep(0.05)


def test_fan_out_to_8_channels_is_written_once(broker_factory):
    """--mem-queue-size=0, 100,000 x 200-byte messages to a topic whose 8 channels were created first:
    until every channel holds them all, the broker writes at most 1.5x the payload (Go nsqd 1.3.0 and
    the copy-per-channel design: 10.5x)."""
    broker = broker_factory(mem_queue_size=0)
    for i in range(8):
        create(broker, "fan", f"c{i}")
    time.sleep(0.3)  # the channels' first round (their cursor files) is not the publish's cost
    before = io_written(broker)
    bodies = [b"%08d" % i + b"x" * (PAYLOAD - 8) for i in range(100_000)]
    with RawNSQ(broker.tcp_address, timeout=30) as pub:
        for at in range(0, len(bodies), 500):
            pub.command("MPUB", "fan", body=encode_mpub_body(bodies[at:at + 500]))
        for _ in range(0, len(bodies), 500):
            pub.expect_response(b"OK")
    wait_depths(broker, "fan", len(bodies))
    time.sleep(2.5)  # a sync round (--sync-timeout 2s): the cursors' and the log's metadata included
    written = io_written(broker) - before
    on_disk = sum(p.stat().st_size for p in broker.data_path.glob("fan*"))
    payload = len(bodies) * PAYLOAD
    # write_bytes is 0 on file systems the kernel does not account (tmpfs): then the files say it
    measured = written if written > 0 else on_disk
    print(f"fan-out to 8 channels: {written / payload:.3f} x the payload written, {on_disk / payload:.3f} x on disk")
    assert measured <= 1.5 * payload, (measured / payload, written, on_disk)
    assert on_disk <= 1.5 * payload
    t = topic(broker, "fan")
    assert t["log_messages"] == len(bodies) and t["log_bytes"] >= payload
    assert t["log_durable_position"] == t["log_end_position"]  # the round fsynced it all
    for c in t["channels"]:
        assert c["lag_messages"] == len(bodies) and c["oldest_unfinished_age_ms"] > 0


def drain(broker: BrokerProcess, name: str, channel: str, count: int) -> list[bytes]:
    """SUB, take `count` messages (FIN each) and check nothing more comes."""
    with RawNSQ(broker.tcp_address, timeout=10) as conn:
        conn.sub(name, channel)
        conn.rdy(min(count, 2500) or 1)
        got = []
        while len(got) < count:
            msg = conn.expect_message(timeout=10)
            conn.fin(msg.id)
            got.append(msg.body)
            if len(got) % 2500 == 0:
                conn.rdy(min(count - len(got), 2500) or 1)
        # RDY bounds what is in flight, not how many come: what is sent next (a seek's replay before the
        # broker sees this connection close) must not go to a connection that takes no more
        conn.rdy(0)
        conn.expect_no_frame(0.3)
    return got


def seek(broker: BrokerProcess, name: str, channel: str, to: str) -> dict:
    r = broker.http.post("/channel/seek", params={"topic": name, "channel": channel, "to": to})
    assert r.status_code == 200, r.text
    return r.json()


def test_seek_with_retention_replays_in_publish_order_and_survives_kill_9(broker_factory):
    broker = broker_factory(retention_time="1h", max_bytes_per_file=64 * 1024)
    create(broker, "replay", "c")
    first = [b"first-%05d" % i for i in range(3000)]
    second = [b"second-%05d" % i for i in range(3000)]
    with RawNSQ(broker.tcp_address) as pub:
        for at in range(0, len(first), 500):
            pub.mpub("replay", first[at:at + 500])
        time.sleep(0.05)
        between = int(time.time() * 1000)
        time.sleep(0.05)
        for at in range(0, len(second), 500):
            pub.mpub("replay", second[at:at + 500])
    assert drain(broker, "replay", "c", 6000) == first + second  # drained
    t = topic(broker, "replay")
    assert t["channels"][0]["lag_messages"] == 0 and t["log_messages"] == 6000  # retained, not lost

    answer = seek(broker, "replay", "c", "earliest")
    assert answer["depth"] == 6000 and answer["position"] == t["log_first_position"]
    assert drain(broker, "replay", "c", 6000) == first + second  # every message, in publish order
    assert seek(broker, "replay", "c", str(between))["depth"] == 3000
    assert drain(broker, "replay", "c", 3000) == second
    rfc3339 = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(between // 1000)) + ".%03dZ" % (between % 1000)
    assert seek(broker, "replay", "c", rfc3339)["depth"] == 3000
    assert seek(broker, "replay", "c", "latest")["depth"] == 0

    # kill -9 right after a seek: the cursor's new position survives
    assert seek(broker, "replay", "c", str(between))["depth"] == 3000
    broker.kill()
    broker.start()
    assert topic(broker, "replay")["channels"][0]["depth"] == 3000
    assert drain(broker, "replay", "c", 3000) == second


def test_seek_errors_are_nsq_style(broker_factory):
    broker = broker_factory(max_bytes_per_file=4096, retention_bytes=8192)
    create(broker, "s", "c")
    create(broker, "e#ephemeral", "c")
    cases = [
        ({"topic": "s", "channel": "c"}, 400, "MISSING_ARG_TO"),
        ({"topic": "s", "channel": "c", "to": "yesterday"}, 400, "INVALID_ARG_TO"),
        ({"topic": "s", "channel": "c", "to": "2026-01-01T00:00:00"}, 400, "INVALID_ARG_TO"),  # no offset
        ({"topic": "nope", "channel": "c", "to": "earliest"}, 404, "TOPIC_NOT_FOUND"),
        ({"topic": "s", "channel": "nope", "to": "earliest"}, 404, "CHANNEL_NOT_FOUND"),
        ({"topic": "s!", "channel": "c", "to": "earliest"}, 400, "INVALID_ARG_TOPIC"),
        ({"topic": "e#ephemeral", "channel": "c", "to": "earliest"}, 400, "TOPIC_HAS_NO_LOG"),
    ]
    for params, status, message in cases:
        r = broker.http.post("/channel/seek", params=params)
        assert (r.status_code, r.json()) == (status, {"message": message}), params
    # a time before what the log keeps: its first segments went (beyond --retention-bytes)
    with RawNSQ(broker.tcp_address) as pub:
        for i in range(20):
            pub.mpub("s", [b"m%03d-%02d" % (i, j) + b"x" * 100 for j in range(20)])
    drain(broker, "s", "c", 400)
    deadline = time.monotonic() + 10
    while topic(broker, "s")["log_first_position"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    r = broker.http.post("/channel/seek", params={"topic": "s", "channel": "c", "to": "1000"})
    assert (r.status_code, r.json()) == (400, {"message": "TIME_BEFORE_RETENTION"})
    log = broker.log_text()
    assert "Traceback" not in log and "ERROR" not in log


def test_repeated_kill_9_logs_no_loss_and_leaves_no_temp_files(broker_factory):
    """15 kill -9 under load with small segments: every message not finished comes, no ERROR line (one
    means something was lost), no temp file left behind."""
    broker = broker_factory(mem_queue_size=0, max_bytes_per_file=4096)
    create(broker, "k", "c")
    published: list[bytes] = []
    finished: set[bytes] = set()
    for run in range(15):
        with RawNSQ(broker.tcp_address) as pub:
            for at in range(0, 200, 20):
                batch = [b"k%02d-%03d" % (run, at + i) + b"x" * 60 for i in range(20)]
                pub.mpub("k", batch)
                published.extend(batch)
        with RawNSQ(broker.tcp_address) as conn:
            conn.sub("k", "c")
            conn.rdy(150)
            for i, msg in enumerate(conn.expect_messages(150, timeout=10)):
                if i % 2:
                    conn.fin(msg.id)
                    finished.add(msg.body)
            conn.nop()
            time.sleep(0.05)
            broker.kill()
        broker.start()
    left = set(published) - finished
    with RawNSQ(broker.tcp_address, timeout=10) as conn:
        conn.sub("k", "c")
        conn.rdy(2500)
        seen: set[bytes] = set()
        while not left <= seen:
            msg = conn.expect_message(timeout=10)
            conn.fin(msg.id)
            seen.add(msg.body)
    log = broker.log_text()
    errors = [line for line in log.splitlines() if "ERROR" in line]
    assert not errors, errors[:5]
    assert "Traceback" not in log
    assert not list(broker.data_path.glob("*.tmp"))
