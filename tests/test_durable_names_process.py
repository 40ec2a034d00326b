"""What a broker process answered about its topics and channels survives a kill -9 that follows the answer at
once (issue 48, finding 6): a pause, an unpause, a deletion, a topic made by PUB, a channel made by SUB.
On main these were answered before their nsqd.dat journal line was written: 26 of 30 pauses were undone."""

from __future__ import annotations

from tests.nsq_raw import RawNSQ
from tests.processes import BrokerProcess


def _post(broker: BrokerProcess, path: str) -> None:
    reply = broker.http.post(path)
    assert reply.status_code == 200, (path, reply.status_code, reply.text)


def _queues(broker: BrokerProcess) -> dict[str, tuple[bool, dict[str, bool]]]:
    """Each topic: (paused, {channel: paused})."""
    stats = broker.get("/stats?format=json").json()
    return {t["topic_name"]: (t["paused"], {c["channel_name"]: c["paused"] for c in t["channels"]})
            for t in stats["topics"]}


def test_pauses_deletes_and_creations_answered_survive_a_kill_9_at_once(tmp_path):
    broker = BrokerProcess(tmp_path).start()
    try:
        for i in range(10):
            _post(broker, f"/topic/create?topic=p{i}")
            for j in range(2):
                _post(broker, f"/channel/create?topic=p{i}&channel=c{j}")
        for i in range(4):
            _post(broker, f"/topic/create?topic=d{i}")
            _post(broker, f"/channel/create?topic=d{i}&channel=c")
        # 30 pauses (20 channels, 10 topics), each answered then SIGKILLed at once
        pauses = [f"/channel/pause?topic=p{i}&channel=c{j}" for i in range(10) for j in range(2)]
        pauses += [f"/topic/pause?topic=p{i}" for i in range(10)]
        for path in pauses:
            _post(broker, path)
            broker.kill()
            broker.start()
        queues = _queues(broker)
        undone = [i for i in range(10) if not queues[f"p{i}"][0]]
        undone += [(i, j) for i in range(10) for j in range(2) if not queues[f"p{i}"][1][f"c{j}"]]
        print(f"pauses undone after a kill -9 at once: {len(undone)} of {len(pauses)}")
        assert undone == []

        # an unpause, deletions of topics and channels, each answered then SIGKILLed at once
        for path in ["/topic/unpause?topic=p0", "/topic/delete?topic=d0", "/topic/delete?topic=d1",
                     "/channel/delete?topic=d2&channel=c", "/channel/delete?topic=d3&channel=c"]:
            _post(broker, path)
            broker.kill()
            broker.start()
        queues = _queues(broker)
        assert not queues["p0"][0]
        assert "d0" not in queues and "d1" not in queues
        assert queues["d2"][1] == {} and queues["d3"][1] == {}

        # a topic made by PUB, a channel made by SUB over TCP: OK, then SIGKILL at once
        for i in range(3):
            with RawNSQ(broker.tcp_address) as conn:
                conn.command("PUB", f"made{i}", body=b"m")
                conn.expect_response(b"OK")
            broker.kill()
            broker.start()
            with RawNSQ(broker.tcp_address) as conn:
                conn.command("IDENTIFY", body=b'{"heartbeat_interval": 30000}')
                conn.expect_response()
                conn.command("SUB", f"made{i}", f"sub{i}")
                conn.expect_response(b"OK")
            broker.kill()
            broker.start()
        queues = _queues(broker)
        for i in range(3):
            assert f"made{i}" in queues and f"sub{i}" in queues[f"made{i}"][1], i
    finally:
        broker.stop()
