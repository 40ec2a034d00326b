"""Idempotency-Key on /pub and /mpub against real broker processes: a key the topic accepted before
publishes nothing, also across kill -9 and restart; and kill -9 makes no copy of a message (issue 15)."""

from __future__ import annotations

import threading
import time

import httpx

from processes import BrokerProcess
from test_durability import _connect, _create_channel, _read_frame
from trio_nsq.shared.protocol import FrameParser, encode_pub


def _url(broker: BrokerProcess, path: str) -> str:
    return f"http://{broker.http_address}{path}"


def _pub(broker: BrokerProcess, topic: str, body: bytes, key: str | None = None, *, multi: bool = False) -> httpx.Response:
    headers = {} if key is None else {"Idempotency-Key": key}
    path = "/mpub" if multi else "/pub"
    return httpx.post(_url(broker, f"{path}?topic={topic}"), content=body, headers=headers, timeout=30)


def _topic(broker: BrokerProcess, topic: str) -> dict:
    doc = httpx.get(_url(broker, f"/stats?format=json&topic={topic}"), timeout=30).json()
    return next(t for t in doc["topics"] or [] if t["topic_name"] == topic)


def _publish_two_keys_kill_and_retry(broker: BrokerProcess) -> None:
    """An MPUB and a PUB with keys, a kill -9, then the same two again (as a Spark task retried would)."""
    def publish() -> None:
        assert _pub(broker, "t", b"a\nb", "spark-0-0", multi=True).status_code == 200
        assert _pub(broker, "t", b"c", "spark-0-1").status_code == 200
    publish()
    broker.kill()
    broker.start()
    publish()


def _wait(predicate, what: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_same_key_publishes_once_and_answers_the_same(broker_factory):
    broker = broker_factory()
    first = _pub(broker, "t", b"one", "k1")
    again = _pub(broker, "t", b"one", "k1")
    assert (first.status_code, first.content) == (200, b"OK")
    assert (again.status_code, again.content, again.headers.get("content-type")) == (
        first.status_code, first.content, first.headers.get("content-type"))
    m1 = _pub(broker, "t", b"a\nb\nc", "batch-1", multi=True)
    m2 = _pub(broker, "t", b"a\nb\nc", "batch-1", multi=True)
    assert (m1.status_code, m1.content) == (m2.status_code, m2.content) == (200, b"OK")
    t = _topic(broker, "t")
    assert (t["message_count"], t["depth"], t["idempotency_keys"]) == (4, 4, 2)


def test_different_keys_or_no_key_publish_each_time(broker_factory):
    broker = broker_factory()
    for key in ("a", "b", None, None):
        assert _pub(broker, "t", b"x", key).status_code == 200
    assert _pub(broker, "t", b"x\ny", "c", multi=True).status_code == 200
    assert _pub(broker, "t", b"x\ny", None, multi=True).status_code == 200
    t = _topic(broker, "t")
    assert (t["message_count"], t["idempotency_keys"]) == (8, 3)


def test_invalid_key_is_400(broker_factory):
    broker = broker_factory()
    for key in ("k" * 257, "tab\there", "caf\u00e9", ""):
        for multi in (False, True):
            headers = {"Idempotency-Key": key.encode("utf-8")}
            r = httpx.post(_url(broker, "/mpub?topic=t" if multi else "/pub?topic=t"), content=b"x",
                           headers=headers, timeout=30)
            assert r.status_code == 400, (key, r.text)
            assert r.json() == {"message": "INVALID_IDEMPOTENCY_KEY"}
    assert _pub(broker, "t", b"x", "k" * 256).status_code == 200
    assert _pub(broker, "t", b"x", "a b!~{}").status_code == 200
    assert _topic(broker, "t")["message_count"] == 2
    assert "Traceback" not in broker.log_text()


def test_concurrent_same_key_publishes_once(broker_factory):
    broker = broker_factory(mem_queue_size=0, sync_every=1)
    answers: list[tuple[int, bytes]] = []
    lock = threading.Lock()

    def send() -> None:
        r = _pub(broker, "t", b"\n".join(b"m%d" % i for i in range(200)), "same", multi=True)
        with lock:
            answers.append((r.status_code, r.content))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert answers == [(200, b"OK")] * 8
    t = _topic(broker, "t")
    assert (t["message_count"], t["idempotency_keys"]) == (200, 1)


def test_key_survives_kill_9(broker_factory):
    broker = broker_factory(mem_queue_size=0, sync_every=1)
    _publish_two_keys_kill_and_retry(broker)
    t = _topic(broker, "t")
    assert (t["depth"], t["idempotency_keys"]) == (3, 2)
    assert _pub(broker, "t", b"d", "spark-0-2").status_code == 200
    assert _topic(broker, "t")["depth"] == 4


def test_key_survives_clean_restart_with_default_flags(broker_factory):
    broker = broker_factory()
    assert _pub(broker, "t", b"a", "k").status_code == 200
    broker.restart()
    assert _pub(broker, "t", b"a", "k").status_code == 200
    assert _topic(broker, "t")["depth"] == 1


def test_memory_messages_key_not_kept_across_kill_9(broker_factory):
    """Default flags: the message lives in memory, so its key does too; after kill -9 both are gone and
    the retry publishes (at least once), never a key without its message."""
    broker = broker_factory(sync_every=1)
    assert _pub(broker, "t", b"a", "k").status_code == 200
    assert _pub(broker, "t", b"a", "k").status_code == 200
    assert _topic(broker, "t")["depth"] == 1  # held while the broker runs
    broker.kill()
    broker.start()
    assert _pub(broker, "t", b"a", "k").status_code == 200
    assert _topic(broker, "t")["depth"] == 1


def test_a_topic_read_by_position_keeps_its_keys_across_kill_9_at_default_flags(broker_factory):
    """Its messages go to the log (not fsynced before the answer at default flags): a kill -9 keeps them
    in the page cache, and their key with them, so a retry after the restart publishes nothing (an
    exactly-once Spark pipeline through a broker's kill -9)."""
    broker = broker_factory()
    assert httpx.post(_url(broker, "/topic/create?topic=t"), timeout=30).status_code == 200
    assert httpx.get(_url(broker, "/log/positions?topic=t"), timeout=30).status_code == 200  # read by position
    _publish_two_keys_kill_and_retry(broker)
    assert _topic(broker, "t")["message_count"] == 0  # none published again (counted since the restart)
    info = httpx.get(_url(broker, "/log/positions?topic=t"), timeout=30).json()
    assert info["end_index"] - info["first_index"] == 3


def test_a_key_journalled_for_messages_a_power_loss_cut_from_the_log_is_dropped(tmp_path):
    """A key written without an fsync carries the log position its messages end at: the journal may
    survive a power loss where the log's end did not, and then the key must go (a retry publishes again:
    a duplicate at worst, never a message lost behind a key)."""
    import trio

    from trio_nsq.broker.idempotency import IdempotencyKeys

    async def publish_in_log_to(end: int):
        async def publish():
            return False, end
        return publish

    async def main() -> None:
        keys = IdempotencyKeys("t", str(tmp_path), window=3600, max_keys=100)
        await keys.publish_once("k1", await publish_in_log_to(100))
        await keys.publish_once("k2", await publish_in_log_to(200))
        keys._close_fd()  # a crash: nothing more written
        kept = IdempotencyKeys("t", str(tmp_path), window=3600, max_keys=100, log_holds=lambda pos: pos <= 150)
        assert list(kept.keys) == ["k1"]
        # the file was compacted: k2 is gone from it for good, k1 keeps its position
        again = IdempotencyKeys("t", str(tmp_path), window=3600, max_keys=100, log_holds=lambda pos: pos <= 1000)
        assert list(again.keys) == ["k1"] and again._at == {"k1": 100}

    trio.run(main)


def test_window_expiry(broker_factory):
    broker = broker_factory(idempotency_window="1s")
    assert _pub(broker, "t", b"a", "k").status_code == 200
    assert _pub(broker, "t", b"a", "k").status_code == 200
    assert _topic(broker, "t")["message_count"] == 1
    time.sleep(1.2)
    assert _topic(broker, "t")["idempotency_keys"] == 0  # expired keys are not counted
    assert _pub(broker, "t", b"a", "k").status_code == 200
    assert _topic(broker, "t")["message_count"] == 2


def test_bound_forgets_the_oldest(broker_factory):
    broker = broker_factory(max_idempotency_keys=3, mem_queue_size=0, sync_every=1)
    for key in ("k1", "k2", "k3", "k4"):
        assert _pub(broker, "t", b"x", key).status_code == 200
    assert _topic(broker, "t")["idempotency_keys"] == 3
    assert _pub(broker, "t", b"x", "k4").status_code == 200  # held
    assert _topic(broker, "t")["message_count"] == 4
    assert _pub(broker, "t", b"x", "k1").status_code == 200  # forgotten: publishes again
    assert _topic(broker, "t")["message_count"] == 5
    assert broker.log_text().count("idempotency key table full") == 1
    # the journal stays bounded too: many keys, then a restart loads only the newest
    for i in range(20):
        assert _pub(broker, "t", b"x", f"n{i}").status_code == 200
    broker.kill()
    broker.start()
    assert _topic(broker, "t")["idempotency_keys"] == 3
    lines = (broker.data_path / "t.idempotency.dat").read_bytes().splitlines()
    assert len([line for line in lines if not line.startswith(b"#")]) <= 3
    assert _pub(broker, "t", b"x", "n19").status_code == 200
    assert _topic(broker, "t")["depth"] == 25


def test_info_and_stats_fields(broker_factory):
    broker = broker_factory()
    assert httpx.get(_url(broker, "/info"), timeout=30).json()["idempotent_publish"] is True
    assert _pub(broker, "t", b"a", "k").status_code == 200
    assert _topic(broker, "t")["idempotency_keys"] == 1
    text = httpx.get(_url(broker, "/stats?topic=t"), timeout=30).text
    assert "idempotency-keys: 1" in text


def test_topic_delete_forgets_keys(broker_factory):
    broker = broker_factory(mem_queue_size=0, sync_every=1)
    assert _pub(broker, "t", b"a", "k").status_code == 200
    journal = broker.data_path / "t.idempotency.dat"
    assert journal.exists()
    assert httpx.post(_url(broker, "/topic/delete?topic=t"), timeout=30).status_code == 200
    assert not journal.exists()
    assert _pub(broker, "t", b"a", "k").status_code == 200
    assert _topic(broker, "t")["depth"] == 1
    broker.kill()
    broker.start()
    assert _pub(broker, "t", b"b", "k2").status_code == 200
    assert _pub(broker, "t", b"a", "k").status_code == 200
    assert _topic(broker, "t")["depth"] == 2


def test_kill_9_makes_no_copy(broker_factory):
    """--mem-queue-size=0 --sync-every=1 with a channel: once the last published message has moved to
    the channel, kill -9 and restart must leave the channel with exactly what was published (the topic
    queue's read position was persisted with the move, as go-diskqueue's sync every reads+writes)."""
    broker = broker_factory(mem_queue_size=0, sync_every=1)
    _create_channel(broker, "t", "c")
    published = 0
    for run in range(12):
        with _connect(broker) as sock:
            parser = FrameParser()
            for i in range(5):
                sock.sendall(encode_pub("t", b"r%d-%d" % (run, i)))
                assert _read_frame(sock, parser) == (0, b"OK")
        published += 5

        def moved():
            t = _topic(broker, "t")
            return t["depth"] == 0 and t["channels"][0]["depth"] == published

        _wait(moved, "the messages to reach the channel")
        broker.kill()
        broker.start()
        _wait(lambda: _topic(broker, "t")["depth"] == 0, "the topic to drain after the restart")
        t = _topic(broker, "t")
        assert t["channels"][0]["depth"] == published, f"run {run}: a message came back twice"


def test_failed_publish_leaves_its_key_free(small_disk):
    """A publish the disk refused is not remembered: its retry, once there is room, publishes."""
    mnt = small_disk("2m")
    broker = BrokerProcess(mnt, mem_queue_size=0, sync_every=1)
    try:
        ballast = mnt / "ballast"
        ballast.write_bytes(b"\0" * 512 * 1024)
        broker.start()
        accepted = 0
        for i in range(400):
            body = b"\n".join(b"f%04d-%03d" % (i, j) + b"x" * 200 for j in range(50))
            r = _pub(broker, "t", body, f"k{i}", multi=True)
            if r.status_code != 200:
                break
            accepted += 1
        assert r.status_code in (500, 503), r.text
        failed_key = f"k{accepted}"
        t = _topic(broker, "t")
        assert t["idempotency_keys"] == accepted
        depth = t["depth"]
        ballast.unlink()
        assert _pub(broker, "t", body, failed_key, multi=True).status_code == 200
        assert _topic(broker, "t")["depth"] == depth + 50
        assert _pub(broker, "t", body, failed_key, multi=True).status_code == 200
        assert _pub(broker, "t", body, "k0", multi=True).status_code == 200
        t = _topic(broker, "t")
        assert (t["depth"], t["idempotency_keys"]) == (depth + 50, accepted + 1)
        assert broker.is_alive() and "Traceback" not in broker.log_text()
    finally:
        broker.kill()
