"""Cluster mode end to end (issue 52): a real etcd, a real nsqlookupd and three trio-nsqd processes
(`--etcd-lease-ttl=2s --replica-lag-time=2s --replicas=3 --min-isr=2`).

- a publish answered OK is on all three logs (`/log/read` on each: the same positions, the same log id);
- `/lookup` lists only the leader; PUB and SUB to a follower are refused (NOT_LEADER, with the leader's
  address), over TCP, HTTP and from pynsq/gnsq;
- kill -9 of the leader: another leads within a few seconds and delivers every OK'd message to a
  consumer of a channel made before; the old leader restarts as a follower and catches up (same logs);
- with two of the three brokers gone, a publish is refused before it is appended (NOT_ENOUGH_REPLICAS);
- a leader paused (SIGSTOP) past its lease never answers OK, closes its consumers, rejoins as a follower;
- /topic/config's min_isr and replicas (raised: the new replicas catch up and join the isr; lowered);
  /topic/delete on the leader deletes it everywhere.
The last tests need no process: the cluster options' checks, the fetch answer's format.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from etcd_server import EtcdServer, etcd  # noqa: F401 - the fixture
from trio_nsq.broker.http.replica_api import decode, encode
from trio_nsq.broker.options import Options, parse_options
from nsq_raw import Error, RawNSQ
from processes import BrokerProcess, LookupdProcess, wait_for
from test_broker_clients import ClientProcess

# (make test-cluster: three brokers and etcd per test, a minute in all)
pytestmark = pytest.mark.cluster

TOPIC = "orders"


def cluster_flags(etcd_endpoint: str, lookupd: LookupdProcess) -> dict[str, object]:
    return dict(etcd_endpoints=etcd_endpoint, etcd_lease_ttl="2s", replica_lag_time="2s", replicas=3, min_isr=2,
                replica_ack_timeout="3s", broadcast_address="127.0.0.1",
                lookupd_tcp_address=lookupd.tcp_address, sync_timeout="200ms")


@pytest.fixture
def cluster(request: pytest.FixtureRequest, tmp_path: Path,
            etcd: EtcdServer) -> Iterator[tuple[LookupdProcess, list[BrokerProcess]]]:  # noqa: F811
    """A lookupd and three brokers; `@pytest.mark.parametrize("cluster", [{flag: value}], indirect=True)`
    changes their flags."""
    lookupd = LookupdProcess(tmp_path / "lookupd", broadcast_address="127.0.0.1").start()
    flags = {**cluster_flags(etcd.endpoint, lookupd), **getattr(request, "param", {})}
    brokers = [BrokerProcess(tmp_path / f"b{i}", **flags) for i in range(3)]
    try:
        for broker in brokers:
            broker.start()
        for broker in brokers:  # (a broker says it listens once it is in etcd: placement sees all three)
            wait_for(lambda: "CLUSTER: registered" in broker.log_text(), timeout=10, message="registration")
        yield lookupd, brokers
    finally:
        for broker in brokers:
            broker.stop()
        lookupd.stop()


def replication(broker: BrokerProcess, topic: str = TOPIC) -> dict | None:
    """The topic's "replication" key in the broker's /stats (None: not there yet, or the broker is down)."""
    try:
        stats = broker.get(f"/stats?format=json&topic={topic}").json()
    except (httpx.HTTPError, ValueError):
        return None
    for t in stats.get("topics") or []:
        if t["topic_name"] == topic:
            return t.get("replication")
    return None


def wait_roles(brokers: list[BrokerProcess], timeout: float = 10.0) -> tuple[BrokerProcess, list[BrokerProcess]]:
    """The leader and its followers, once every broker given agrees on the epoch, with all in the isr."""

    def settled() -> tuple[BrokerProcess, list[BrokerProcess]] | None:
        reps = [replication(b) for b in brokers]
        if any(r is None for r in reps):
            return None
        roles = [r["role"] for r in reps]  # type: ignore[index]
        epochs = {r["epoch"] for r in reps}  # type: ignore[index]
        if roles.count("leader") != 1 or roles.count("follower") != len(brokers) - 1 or len(epochs) != 1:
            return None
        if any(len(r["isr"]) != len(brokers) for r in reps):  # type: ignore[index]
            return None
        leader = brokers[roles.index("leader")]
        return leader, [b for b in brokers if b is not leader]

    return wait_for(settled, timeout=timeout, interval=0.1, message="a leader and its followers")


def pub_http(broker: BrokerProcess, body: bytes, topic: str = TOPIC) -> httpx.Response:
    return broker.http.post(f"/pub?topic={topic}", content=body, timeout=10)


def log_records(broker: BrokerProcess, end: int, topic: str = TOPIC) -> tuple[str, list[tuple[int, bytes]]]:
    """(log id, [(position, body)]) of the broker's /log/read up to `end`."""
    out: list[tuple[int, bytes]] = []
    position = broker.get(f"/log/positions?topic={topic}").json()["first"]
    log_id = ""
    while position < end:
        resp = broker.get(f"/log/read?topic={topic}&position={position}&end={end}")
        assert resp.status_code == 200, resp.text
        log_id = resp.headers["X-NSQ-Log-Id"]
        count = int(resp.headers["X-NSQ-Records"])
        size = int(resp.headers["X-NSQ-Records-Bytes"])
        data = resp.content[:size]
        starts = struct.unpack(f"<{count + 1}i", resp.content[size:size + 4 * (count + 1)])
        first = int(resp.headers["X-NSQ-Position"])
        for i in range(count):
            record = data[starts[i]:starts[i + 1]]
            out.append((first + starts[i], record[30:]))  # (the body after the size and the message header)
        position = int(resp.headers["X-NSQ-Next-Position"])
        if count == 0:
            break
    return log_id, out


def test_publish_is_on_every_replica_and_only_the_leader_serves(cluster, tmp_path: Path) -> None:
    lookupd, brokers = cluster
    first = brokers[0]
    assert first.http.post(f"/topic/create?topic={TOPIC}").status_code == 200
    leader, followers = wait_roles(brokers)
    assert leader is first, "the broker where the topic was first needed leads it"

    bodies = [f"m{i}".encode() for i in range(5)]
    for body in bodies[:3]:
        resp = pub_http(leader, body)
        assert resp.status_code == 200, resp.text
    with RawNSQ(leader.tcp_address) as conn:
        conn.mpub(TOPIC, bodies[3:])  # (answered OK)

    # OK'd: on all three logs, the same positions and log id
    end = replication(leader)["high_watermark"]  # type: ignore[index]
    assert end > 0
    # (a follower learns the HWM with its next fetch: it serves /log/read up to what it was told)
    wait_for(lambda: all((replication(b) or {}).get("high_watermark", 0) >= end for b in brokers), timeout=5,
             message="the followers know the high watermark")
    views = [log_records(b, end) for b in brokers]
    log_ids = {log_id for log_id, _ in views}
    assert len(log_ids) == 1, views
    assert [body for _, body in views[0][1]] == bodies
    assert views[0][1] == views[1][1] == views[2][1]

    # only the leader is registered with the lookupd
    def producers() -> list[int] | None:
        resp = lookupd.get(f"/lookup?topic={TOPIC}")
        ports = sorted(p["tcp_port"] for p in resp.json().get("producers", [])) if resp.status_code == 200 else []
        return ports or None

    assert wait_for(producers, timeout=5, message="the lookupd knows the topic") == [leader.tcp_port]
    time.sleep(0.3)
    assert producers() == [leader.tcp_port]

    # a follower refuses PUB (with the leader's address) and SUB, over TCP and HTTP
    follower = followers[0]
    with RawNSQ(follower.tcp_address) as conn:
        conn.command("PUB", TOPIC, body=b"refused")
        error = conn.expect_error()
        assert isinstance(error, Error) and error.code == "E_PUB_FAILED"
        assert f"NOT_LEADER (leader {leader.tcp_address})" in error.text, error.text
    with RawNSQ(follower.tcp_address) as conn:
        conn.identify(heartbeat_interval=10000)
        conn.command("SUB", TOPIC, "c")
        error = conn.expect_error()
        assert error.code == "E_SUB_FAILED" and "NOT_LEADER" in error.text, error.text
    resp = pub_http(follower, b"refused")
    assert resp.status_code == 503 and resp.json() == {"message": "NOT_LEADER"}

    # third-party producers get a clear error against a follower
    op = {"cmd": "pub", "topic": TOPIC, "body": base64.b64encode(b"refused").decode()}
    for lib in ("pynsq", "gnsq"):
        result = ClientProcess(tmp_path, lib, {"mode": "publish", "address": follower.tcp_address, "ops": [op]},
                               timeout=30).result()
        (response,) = result["responses"]
        # (pynsq: "E_PUB_FAILED PUB failed: ..."; gnsq names the code by its class, NSQPubFailed)
        assert "E_PUB_FAILED" in response or "NSQPubFailed" in response, (lib, response)
        assert f"NOT_LEADER (leader {leader.tcp_address})" in response, (lib, response)
    # nothing refused went into any log
    end = replication(leader)["log_end"]  # type: ignore[index]
    assert [body for _, body in log_records(leader, end)[1]] == bodies

    # /topic/config's min_isr: changed by the leader (a CAS in etcd), refused by a follower
    resp = follower.http.post(f"/topic/config?topic={TOPIC}&min_isr=3")
    assert resp.status_code == 503 and resp.json() == {"message": "NOT_LEADER"}
    resp = leader.http.post(f"/topic/config?topic={TOPIC}&min_isr=3")
    assert resp.status_code == 200, resp.text
    assert resp.json()["replication"]["min_isr"] == 3
    wait_for(lambda: all((replication(b) or {}).get("min_isr") == 3 for b in brokers), timeout=5,
             message="min_isr 3 everywhere")
    assert pub_http(leader, b"m5").status_code == 200  # (three in the isr: still enough)

    # deleted on the leader: gone from etcd, and from the followers
    assert leader.http.post(f"/topic/delete?topic={TOPIC}").status_code == 200
    wait_for(lambda: all(not f.get(f"/stats?format=json&topic={TOPIC}").json()["topics"] for f in followers),
             timeout=5, message="the followers delete the topic")


def test_failover_delivers_every_acknowledged_message(cluster) -> None:
    _, brokers = cluster
    first = brokers[0]
    assert first.http.post(f"/topic/create?topic={TOPIC}").status_code == 200
    assert first.http.post(f"/channel/create?topic={TOPIC}&channel=c").status_code == 200
    leader, followers = wait_roles(brokers)
    # the channel is on the followers too (the leader's channels are mirrored) before the kill
    wait_for(lambda: all(_has_channel(f, "c") for f in followers), timeout=5, message="channel mirrored")

    acked = []
    for i in range(20):
        body = f"acked-{i}".encode()
        resp = pub_http(leader, body)
        assert resp.status_code == 200, resp.text
        acked.append(body)

    leader.kill()
    killed_at = time.monotonic()
    new_leader, rest = wait_roles(followers, timeout=15)
    took = time.monotonic() - killed_at
    assert took < 10, f"a new leader after {took:.1f}s"
    assert replication(new_leader)["epoch"] == 2  # type: ignore[index]

    got: set[bytes] = set()
    with RawNSQ(new_leader.tcp_address) as conn:
        conn.identify(heartbeat_interval=10000)
        conn.sub(TOPIC, "c")  # (answered OK)
        conn.rdy(100)
        deadline = time.monotonic() + 10
        while not set(acked) <= got and time.monotonic() < deadline:
            msg = conn.expect_message(timeout=max(0.1, deadline - time.monotonic()))
            got.add(msg.body)
            conn.fin(msg.id)
    assert set(acked) <= got, sorted(set(acked) - got)

    # the new leader and the last follower still make min_isr=2: publishes go on
    assert pub_http(new_leader, b"after-failover").status_code == 200

    # the old leader comes back as a follower (truncated by the epochs, not by a high watermark) and
    # catches up: the three logs are the same again
    leader.start()
    assert wait_roles(brokers, timeout=15)[0] is new_leader
    end = replication(new_leader)["high_watermark"]  # type: ignore[index]
    wait_for(lambda: all((replication(b) or {}).get("high_watermark", 0) >= end for b in brokers), timeout=5,
             message="every replica knows the high watermark")
    views = [log_records(b, end) for b in brokers]
    assert len({log_id for log_id, _ in views}) == 1
    assert views[0][1] == views[1][1] == views[2][1]
    assert [body for _, body in views[0][1]] == [*acked, b"after-failover"]

    # with two of the three gone, the isr shrinks to the leader: refused before the append (definite)
    leader.stop()
    rest[0].stop()
    wait_for(lambda: len((replication(new_leader) or {}).get("isr", [])) == 1, timeout=10, message="isr shrinks")
    end_before = replication(new_leader)["log_end"]  # type: ignore[index]
    resp = pub_http(new_leader, b"refused")
    assert resp.status_code == 503 and resp.json() == {"message": "NOT_ENOUGH_REPLICAS"}, resp.text
    with RawNSQ(new_leader.tcp_address) as conn:
        conn.command("PUB", TOPIC, body=b"refused")
        error = conn.expect_error()
        assert error.code == "E_PUB_FAILED" and "NOT_ENOUGH_REPLICAS" in error.text, error.text
    assert replication(new_leader)["log_end"] == end_before  # type: ignore[index]


def test_a_paused_leader_never_answers_ok_and_rejoins_as_a_follower(cluster) -> None:
    """Lease fencing: a leader stopped (SIGSTOP) past its lease wakes up with a publish waiting on its
    socket; whatever it does with it, it never answers OK; it follows the new leader, its log cut to
    the new leader's."""
    _, brokers = cluster
    first = brokers[0]
    assert first.http.post(f"/topic/create?topic={TOPIC}").status_code == 200
    leader, followers = wait_roles(brokers)
    acked = [b"a0", b"a1", b"a2"]
    for body in acked:
        assert pub_http(leader, body).status_code == 200
    consumer = RawNSQ(leader.tcp_address, timeout=10)
    consumer.identify(heartbeat_interval=60000)
    consumer.sub(TOPIC, "c")  # (answered OK: the leader delivers)
    assert leader.proc is not None
    os.kill(leader.proc.pid, signal.SIGSTOP)
    try:
        conn = RawNSQ(leader.tcp_address, timeout=10)  # (the kernel accepts it meanwhile)
        conn.command("PUB", TOPIC, body=b"while-paused")
        new_leader, _ = wait_roles(followers, timeout=15)
        assert replication(new_leader)["epoch"] == 2  # type: ignore[index]
        assert pub_http(new_leader, b"a3").status_code == 200
        acked.append(b"a3")
    finally:
        os.kill(leader.proc.pid, signal.SIGCONT)
    with conn:
        frame = conn.next_frame(timeout=10)
        assert isinstance(frame, Error) and frame.code == "E_PUB_FAILED", frame
    with consumer:  # stepping down, it closed its consumers' connections: they look up the new leader
        consumer.expect_closed(timeout=10)
    assert wait_roles(brokers, timeout=15)[0] is new_leader
    end = replication(new_leader)["high_watermark"]  # type: ignore[index]
    wait_for(lambda: all((replication(b) or {}).get("high_watermark", 0) >= end for b in brokers), timeout=5,
             message="every replica knows the high watermark")
    views = [log_records(b, end) for b in brokers]
    assert views[0][1] == views[1][1] == views[2][1]
    assert [body for _, body in views[0][1]] == acked


def test_a_topic_deleted_while_a_replica_was_down_stays_deleted_when_it_comes_back(cluster, etcd) -> None:  # noqa: F811
    """/topic/delete on a follower deletes the topic from the cluster (as nsqd's does from its broker); a
    replica down meanwhile finds the topic's tombstone in etcd when it restarts and deletes its copy,
    instead of placing the topic again from its nsqd.dat."""
    _, brokers = cluster
    first = brokers[0]
    assert first.http.post(f"/topic/create?topic={TOPIC}").status_code == 200
    leader, followers = wait_roles(brokers)
    for body in (b"d0", b"d1"):
        assert pub_http(leader, body).status_code == 200
    down, other = followers
    wait_for(lambda: (replication(down) or {}).get("high_watermark", 0) > 0, timeout=5, message="replicated")
    down.kill()
    resp = other.http.post(f"/topic/delete?topic={TOPIC}")
    assert resp.status_code == 200, resp.text

    def topics(broker: BrokerProcess) -> list[str]:
        return [t["topic_name"] for t in broker.get("/stats?format=json").json().get("topics") or []]

    wait_for(lambda: TOPIC not in topics(leader) and TOPIC not in topics(other), timeout=10,
             message="deleted on the leader and the other follower")
    down.start()
    wait_for(lambda: "CLUSTER: registered" in down.log_text(), timeout=10, message="registration")
    wait_for(lambda: "deleted from the cluster while this broker was down" in down.log_text(), timeout=10,
             message="the tombstone seen")
    assert TOPIC not in topics(down)
    time.sleep(1.5)  # (a listing or two later: nothing placed it again)
    assert all(TOPIC not in topics(b) for b in brokers)
    keys = httpx.post(f"{etcd.endpoint}/v3/kv/range", json={
        "key": base64.b64encode(f"/trio-nsq/topics/{TOPIC}".encode()).decode()}).json()
    assert not keys.get("kvs"), keys


@pytest.mark.parametrize("cluster", [{"replicas": 1, "min_isr": 1}], indirect=True)
def test_replicas_raised_and_lowered_by_topic_config(cluster) -> None:
    _, brokers = cluster
    first = brokers[0]
    for body in (b"r0", b"r1"):
        assert pub_http(first, body).status_code == 200
    assert replication(first)["replicas"] == [_id(first)]  # type: ignore[index]
    assert all(replication(b) is None for b in brokers[1:])  # (not replicas: they have no copy)
    resp = first.http.post(f"/topic/config?topic={TOPIC}&replicas=3")
    assert resp.status_code == 200, resp.text
    # the new replicas are in `replicas` at once, in the isr once they caught up
    assert len(resp.json()["replication"]["replicas"]) == 3
    assert wait_roles(brokers)[0] is first
    end = replication(first)["high_watermark"]  # type: ignore[index]
    wait_for(lambda: all((replication(b) or {}).get("high_watermark", 0) >= end for b in brokers), timeout=5,
             message="every replica knows the high watermark")
    assert [body for _, body in log_records(brokers[2], end)[1]] == [b"r0", b"r1"]
    resp = first.http.post(f"/topic/config?topic={TOPIC}&replicas=2")
    assert resp.status_code == 200, resp.text
    kept = resp.json()["replication"]["replicas"]
    assert len(kept) == 2 and _id(first) in kept
    dropped = next(b for b in brokers if _id(b) not in kept)
    wait_for(lambda: (replication(dropped) or {}).get("role") == "none", timeout=5, message="the dropped one stops")
    assert first.http.post(f"/topic/config?topic={TOPIC}&replicas=0").status_code == 400


def test_pauses_and_settings_made_on_the_leader_hold_after_a_failover(cluster) -> None:
    """/topic/pause, /channel/pause and /topic/config, /channel/config (issue 35's settings) on the leader
    reach the followers with their fetches; a follower refuses them (503 NOT_LEADER: nsqadmin calls the
    leader, the only broker nsqlookupd lists); after the leader's kill -9 the new leader has them."""
    _, brokers = cluster
    first = brokers[0]
    assert first.http.post(f"/topic/create?topic={TOPIC}").status_code == 200
    leader, followers = wait_roles(brokers)
    for path in (f"/channel/create?topic={TOPIC}&channel=c", f"/channel/pause?topic={TOPIC}&channel=c",
                 f"/topic/pause?topic={TOPIC}", f"/topic/config?topic={TOPIC}&max_depth=1000",
                 f"/channel/config?topic={TOPIC}&channel=c&message_ttl=1h"):
        resp = leader.http.post(path)
        assert resp.status_code == 200, (path, resp.text)

    def state(broker: BrokerProcess) -> tuple | None:
        try:
            stats = broker.get(f"/stats?format=json&topic={TOPIC}").json()
            topic = next(t for t in stats.get("topics") or [] if t["topic_name"] == TOPIC)
            channel = next(c for c in topic["channels"] if c["channel_name"] == "c")
            topic_config = broker.get(f"/topic/config?topic={TOPIC}").json()["config"]
            channel_config = broker.get(f"/channel/config?topic={TOPIC}&channel=c").json()["config"]
        except (httpx.HTTPError, ValueError, KeyError, StopIteration):
            return None
        return topic["paused"], channel["paused"], topic_config, channel_config

    paused = (True, True, {"max_depth": 1000}, {"message_ttl": "1h0m0s"})
    assert state(leader) == paused
    wait_for(lambda: all(state(f) == paused for f in followers), timeout=5, message="mirrored on the followers")
    for path in (f"/channel/unpause?topic={TOPIC}&channel=c", f"/topic/unpause?topic={TOPIC}",
                 f"/topic/config?topic={TOPIC}&max_depth=5", f"/channel/config?topic={TOPIC}&channel=c&max_depth=5",
                 f"/channel/create?topic={TOPIC}&channel=other", f"/channel/delete?topic={TOPIC}&channel=c",
                 f"/channel/empty?topic={TOPIC}&channel=c", f"/channel/seek?topic={TOPIC}&channel=c&to=earliest",
                 f"/topic/empty?topic={TOPIC}"):
        resp = followers[0].http.post(path)
        assert resp.status_code == 503 and resp.json() == {"message": "NOT_LEADER"}, (path, resp.text)
    assert leader.http.post(f"/topic/unpause?topic={TOPIC}").status_code == 200
    unpaused = (False, *paused[1:])
    wait_for(lambda: all(state(f) == unpaused for f in followers), timeout=5, message="unpause mirrored")

    leader.kill()
    new_leader, _ = wait_roles(followers, timeout=15)
    assert state(new_leader) == unpaused
    new_leader.stop()  # (nsqd.dat holds them: the restarted broker too)
    new_leader.start()
    assert state(new_leader) == unpaused


def test_a_refusal_after_the_append_says_so(cluster) -> None:
    """A publish appended by the leader, which then loses its lease before its replicas confirm it, is
    refused as may-still-be-delivered: NOT_LEADER_AFTER_APPEND, never the definite NOT_LEADER."""
    _, brokers = cluster
    first = brokers[0]
    assert first.http.post(f"/topic/create?topic={TOPIC}").status_code == 200
    leader, followers = wait_roles(brokers)
    stopped = [b for b in followers if b.proc is not None]
    for f in stopped:  # (no replica confirms it, and none is elected meanwhile)
        os.kill(f.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
    assert leader.proc is not None
    try:
        with RawNSQ(leader.tcp_address, timeout=15) as conn:
            conn.command("PUB", TOPIC, body=b"appended")
            wait_for(lambda: (replication(leader) or {}).get("log_end", 0) > 0, timeout=5, message="appended")
            os.kill(leader.proc.pid, signal.SIGSTOP)  # past its lease (2 s) and --replica-ack-timeout (3 s)
            time.sleep(3.5)
            os.kill(leader.proc.pid, signal.SIGCONT)
            error = conn.expect_error()
        assert error.code == "E_PUB_FAILED" and "PUB failed: NOT_LEADER_AFTER_APPEND" in error.text, error.text
    finally:
        os.kill(leader.proc.pid, signal.SIGCONT)
        for f in stopped:
            os.kill(f.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]


def test_a_replica_without_its_epoch_cache_never_leads(cluster) -> None:
    """An in-sync follower whose `<topic>.replica.dat` is unreadable would cut its log to the first listed
    epoch's start as a candidate (an empty log leading: every acknowledged message lost). With the leader
    dead and the other follower paused past its lease, it proposes nothing (one ERROR); the other one,
    woken, leads, and it follows: every log holds what was acknowledged."""
    _, brokers = cluster
    first = brokers[0]
    assert first.http.post(f"/topic/create?topic={TOPIC}").status_code == 200
    leader, (damaged, other) = wait_roles(brokers)
    acked = [b"e0", b"e1", b"e2"]
    for body in acked:
        assert pub_http(leader, body).status_code == 200
    (damaged.data_path / f"{TOPIC}.replica.dat").write_bytes(b"not json")
    assert other.proc is not None
    leader.kill()
    os.kill(other.proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: "not a candidate for leader" in damaged.log_text(), timeout=10, message="the refusal")
        time.sleep(1.5)  # (a listing or two later: still no leader)
        assert (replication(damaged) or {}).get("role") != "leader"
    finally:
        os.kill(other.proc.pid, signal.SIGCONT)
    assert damaged.log_text().count("not a candidate for leader") == 1
    new_leader, _ = wait_roles([damaged, other], timeout=15)
    assert new_leader is other
    leader.start()
    wait_roles(brokers, timeout=15)
    end = replication(other)["high_watermark"]  # type: ignore[index]
    wait_for(lambda: all((replication(b) or {}).get("high_watermark", 0) >= end for b in brokers), timeout=5,
             message="every replica knows the high watermark")
    views = [log_records(b, end) for b in brokers]
    assert [body for _, body in views[0][1]] == acked
    assert views[0][1] == views[1][1] == views[2][1]


def test_a_leader_restarted_without_its_epoch_cache_hands_the_lead_back(cluster) -> None:
    """etcd still names it leader when it comes back (its followers paused meanwhile): it does not propose
    itself (that would cut its log to nothing), it clears the leader and leaves the isr, and once the
    followers wake one of them leads; the acknowledged messages are on every log."""
    _, brokers = cluster
    first = brokers[0]
    assert first.http.post(f"/topic/create?topic={TOPIC}").status_code == 200
    leader, followers = wait_roles(brokers)
    acked = [b"g0", b"g1"]
    for body in acked:
        assert pub_http(leader, body).status_code == 200
    leader.kill()
    for f in followers:
        os.kill(f.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
    try:
        (leader.data_path / f"{TOPIC}.replica.dat").unlink()
        offset = leader.log_path.stat().st_size
        leader.start()
        wait_for(lambda: "CLUSTER: registered" in leader.log_text(offset), timeout=10, message="registration")
        time.sleep(1.5)  # (a listing or two: it would have proposed itself by now)
    finally:
        for f in followers:
            os.kill(f.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
    new_leader, _ = wait_roles(brokers, timeout=15)
    assert new_leader is not leader and replication(new_leader)["epoch"] == 2  # type: ignore[index]
    assert "gave up leading epoch 1" in leader.log_text(offset)
    end = replication(new_leader)["high_watermark"]  # type: ignore[index]
    wait_for(lambda: all((replication(b) or {}).get("high_watermark", 0) >= end for b in brokers), timeout=5,
             message="every replica knows the high watermark")
    views = [log_records(b, end) for b in brokers]
    assert [body for _, body in views[0][1]] == acked
    assert views[0][1] == views[1][1] == views[2][1]


@pytest.mark.parametrize("cluster", [{"replicas": 1, "min_isr": 1}], indirect=True)
def test_a_broker_that_is_not_a_replica_refuses_the_topic_and_keeps_no_copy(cluster) -> None:
    """PUB, SUB, /pub, /topic/create on a broker the topic is not placed on: NOT_LEADER naming the leader
    (as a follower answers), and no local topic (no files, nothing in nsqd.dat, nothing in /stats)."""
    _, brokers = cluster
    first, other = brokers[0], brokers[1]
    assert pub_http(first, b"p0").status_code == 200
    assert replication(first)["replicas"] == [_id(first)]  # type: ignore[index]
    time.sleep(2.0)  # (the others list etcd every second, and on its watch's word)
    with RawNSQ(other.tcp_address) as conn:
        conn.command("PUB", TOPIC, body=b"refused")
        error = conn.expect_error()
        assert error.code == "E_PUB_FAILED" and f"NOT_LEADER (leader {first.tcp_address})" in error.text, error.text
    with RawNSQ(other.tcp_address) as conn:
        conn.identify(heartbeat_interval=10000)
        conn.command("SUB", TOPIC, "c")
        error = conn.expect_error()
        assert error.code == "E_SUB_FAILED" and f"NOT_LEADER (leader {first.tcp_address})" in error.text, error.text
    for resp in (pub_http(other, b"refused"), other.http.post(f"/topic/create?topic={TOPIC}"),
                 other.http.post(f"/mpub?topic={TOPIC}", content=b"a\nb")):
        assert resp.status_code == 503 and resp.json() == {"message": "NOT_LEADER"}, resp.text
    assert not other.get(f"/stats?format=json&topic={TOPIC}").json()["topics"]
    assert not [p.name for p in other.data_path.iterdir() if p.name.startswith(TOPIC)]
    assert TOPIC not in json.dumps(other.metadata())
    # the leader took one message, no other
    end = replication(first)["log_end"]  # type: ignore[index]
    assert [body for _, body in log_records(first, end)[1]] == [b"p0"]


def _id(broker: BrokerProcess) -> str:
    return f"127.0.0.1:{broker.http_port}"


def _has_channel(broker: BrokerProcess, channel: str) -> bool:
    stats = broker.get(f"/stats?format=json&topic={TOPIC}").json()
    return any(c["channel_name"] == channel for t in stats.get("topics") or [] for c in t["channels"])


# --- without processes -------------------------------------------------------------------------------


def test_cluster_options_are_checked() -> None:
    opts = parse_options(["--etcd-endpoints=http://127.0.0.1:1,http://127.0.0.1:2", "--etcd-endpoints=http://h:3",
                          "--etcd-lease-ttl=2s", "--replica-ack-timeout=1500ms", "--replicas=3", "--min-isr=2"])
    assert opts.etcd_endpoint_list == ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://h:3"]
    assert (opts.etcd_lease_ttl, opts.replica_ack_timeout, opts.replicas, opts.min_isr) == (2.0, 1.5, 3, 2)
    opts.check()
    for bad, message in [({"min_isr": 0}, "--min-isr must be >= 1"), ({"replicas": 0}, "--replicas must be >= 1"),
                         ({"etcd_endpoints": ["127.0.0.1:2379"]}, "is not an http:// or https:// URL"),
                         ({"etcd_endpoints": ["http://e"], "etcd_lease_ttl": 0.5}, "--etcd-lease-ttl must be >= 1s")]:
        with pytest.raises(ValueError, match=message):
            Options(**bad).check()  # type: ignore[arg-type]


def test_fetch_answer_round_trips_and_garbage_is_refused() -> None:
    header = {"epoch": 3, "hwm": 10, "log_start": 0, "log_end": 40, "log_id": "00000000000000ab",
              "positions": [0, 20], "sizes": [16, 16], "deadlines": [[20, 1.5]], "channels": [["c", 20, True]]}
    records = [b"a" * 16, b"b" * 16]
    answer = decode(encode(header, records))
    assert (answer.epoch, answer.hwm, answer.log_end, answer.log_id) == (3, 10, 40, "00000000000000ab")
    assert answer.positions == [0, 20] and answer.records == records
    assert answer.deadlines == [(20, 1.5)] and answer.channels == [("c", 20, True)]
    assert not answer.paused and answer.settings == {} and answer.channel_settings == {}  # (an older leader's)
    settings = {"paused": True, "settings": {"max_depth": 5}, "channel_settings": {"c": {"message_ttl": "1h0m0s"}}}
    answer = decode(encode({**header, **settings}, records))
    assert (answer.paused, answer.settings, answer.channel_settings) == tuple(settings.values())
    whole = encode(header, records)
    for garbage in (b"", b"\x00\x00\x00\x05{}", whole[:-1], encode({**header, "sizes": [16]}, records),
                    encode({k: v for k, v in header.items() if k != "hwm"}, records)):
        with pytest.raises(ValueError):
            decode(garbage)
