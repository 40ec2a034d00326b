"""The positional Spark source (trio_nsq/spark/positional.py) reading a replicated topic (issue 52): etcd,
a lookupd and three trio-nsqd in cluster mode (tests/test_replication_broker.py's `cluster`), the reader
classes called as Spark's driver and tasks call them (no SparkSession: the tasks' code is the worktree's).

- The replicas answer with one log id, so they are one log to the reader, read once: a stream reads every
  record published (each answered OK) exactly once; after kill -9 of the leader and a new one elected,
  its next micro-batch, from the previous end offset, reads exactly the records published since, under
  another address of the same log. Brokers named by nsqd_http_address (all three) or found through
  lookupd (which lists only the leader). A batch read over the three reads each record once.
- A log reached at several addresses has its ranges read at all of them, round-robin (each through a
  proxy of its own here, counting the bytes): every record once; a replica killed under a planned read
  is left for the next one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from etcd_server import EtcdServer, etcd  # noqa: F401 - the fixture
from net_proxy import Proxy
from processes import BrokerProcess, LookupdProcess, wait_for
from test_replication_broker import cluster, pub_http, replication, wait_roles  # noqa: F401 - the fixture

from pyspark.sql.streaming.datasource import ReadAllAvailable

from trio_nsq.spark.options import log_settings
from trio_nsq.spark.positional import LogRange, NSQLogBatchReader, NSQLogStreamReader, parse_offsets

pytestmark = pytest.mark.spark_log

TOPIC = "orders"  # (wait_roles of test_replication_broker.py looks at this topic)


def bodies_for(prefix: str, n: int, size: int = 0) -> list[bytes]:
    return [(b"%s-%05d" % (prefix.encode(), i)).ljust(size, b".") for i in range(n)]


def read(reader_: NSQLogStreamReader | NSQLogBatchReader, parts) -> list[bytes]:
    """Every record of `parts`, read as Spark's tasks read them (one after the other)."""
    return [bytes(v) for part in parts for batch in reader_.read(part) for v in batch.column("value").to_pylist()]


def publish_acked(broker: BrokerProcess, bodies: list[bytes]) -> None:
    for body in bodies:
        resp = pub_http(broker, body, TOPIC)
        assert resp.status_code == 200, resp.text  # OK: fsynced on min_isr replicas


def mpub_acked(broker: BrokerProcess, bodies: list[bytes], per_request: int = 30) -> None:
    for i in range(0, len(bodies), per_request):
        resp = broker.http.post(f"/mpub?topic={TOPIC}", content=b"\n".join(bodies[i:i + per_request]), timeout=10)
        assert resp.status_code == 200, resp.text


def placed(brokers: list[BrokerProcess]) -> tuple[BrokerProcess, list[BrokerProcess]]:
    """The topic made on the first broker (which leads it), all three in sync."""
    assert brokers[0].http.post(f"/topic/create?topic={TOPIC}").status_code == 200
    leader, followers = wait_roles(brokers)
    assert leader is brokers[0]
    return leader, followers


def hwm_everywhere(brokers: list[BrokerProcess], leader: BrokerProcess) -> int:
    """Wait until every broker serves the leader's high watermark (a follower learns it with its next
    fetch); return it."""
    end = replication(leader, TOPIC)["high_watermark"]  # type: ignore[index]
    wait_for(lambda: all((replication(b, TOPIC) or {}).get("high_watermark", 0) >= end for b in brokers),
             timeout=10, message="every replica serves the high watermark")
    return end


def lookup_ports(lookupd: LookupdProcess) -> list[int]:
    resp = lookupd.get(f"/lookup?topic={TOPIC}")
    return sorted(p["http_port"] for p in resp.json().get("producers", [])) if resp.status_code == 200 else []


@pytest.mark.parametrize("discovery", ["nsqd_http_address", "lookupd_http_address"])
def test_a_stream_reads_each_record_once_through_a_failover(cluster, discovery: str) -> None:  # noqa: F811
    lookupd, brokers = cluster
    leader, followers = placed(brokers)
    sent = bodies_for("before", 30)
    publish_acked(leader, sent)
    hwm_everywhere(brokers, leader)
    if discovery == "nsqd_http_address":
        where = {"nsqd_http_address": ",".join(b.http_address for b in brokers)}
    else:  # (lookupd lists the leader only)
        where = {"lookupd_http_address": lookupd.http_address}
        assert wait_for(lambda: lookup_ports(lookupd), timeout=10, message="the leader in lookupd") \
            == [leader.http_port]

    # a batch read over the replicas: one log, each record once
    batch = NSQLogBatchReader(log_settings({"topic": TOPIC, **where, "minpartitions": "3"}, batch=True))
    assert read(batch, batch.partitions()) == sent

    r = NSQLogStreamReader(log_settings({"topic": TOPIC, **where, "startingoffsets": "earliest"}, batch=False))
    try:
        start = r.initialOffset()
        end = r.latestOffset(start, ReadAllAvailable())
        assert read(r, r.partitions(start, end)) == sent
        ((named, (log_id, at)),) = parse_offsets(TOPIC, end).items()  # one log, under one address

        leader.kill()
        new_leader, _ = wait_roles(followers, timeout=15)
        more = bodies_for("after", 10)
        publish_acked(new_leader, more)
        hwm_everywhere(followers, new_leader)
        if discovery == "lookupd_http_address":
            wait_for(lambda: lookup_ports(lookupd) == [new_leader.http_port], timeout=10,
                     message="lookupd lists the new leader only")

        later = r.latestOffset(end, ReadAllAvailable())
        assert read(r, r.partitions(end, later)) == more  # no loss, no repeat
        ((renamed, (same_log, upto)),) = parse_offsets(TOPIC, later).items()
        assert same_log == log_id and renamed != named == leader.http_address
        assert upto > at
        assert r.latestOffset(later, ReadAllAvailable()) == later  # nothing more
    finally:
        r.stop()


@pytest.fixture
def proxies(cluster) -> Iterator[list[Proxy]]:  # noqa: F811
    """A relay in front of each broker's HTTP port, counting the bytes it carries: the reader names the
    brokers by them."""
    _, brokers = cluster
    relays = [Proxy(("127.0.0.1", b.http_port), name=f"->{b.name}.http").start() for b in brokers]
    try:
        yield relays
    finally:
        for relay in relays:
            relay.close()


def test_the_ranges_of_a_replicated_log_are_read_at_every_replica(cluster, proxies, caplog) -> None:  # noqa: F811
    _, brokers = cluster
    leader, _ = placed(brokers)
    # (~700 KiB: the log is cut at its index's marks, every 64 KiB, so six parts need a few hundred KiB)
    sent = bodies_for("spread", 90, size=8000)
    mpub_acked(leader, sent)
    hwm_everywhere(brokers, leader)
    where = {"topic": TOPIC, "nsqd_http_address": ",".join(p.address for p in proxies), "minpartitions": "6"}

    batch = NSQLogBatchReader(log_settings(where, batch=True))
    parts = batch.partitions()
    assert len(parts) == 6 and all(isinstance(p, LogRange) for p in parts)
    # the log's one name (the rows' nsqd_address): the batch reader asks the addresses in sorted order
    assert {p.address for p in parts} == {min(p.address for p in proxies)}
    assert {p.replicas[0] for p in parts} == {p.address for p in proxies}  # each replica reads first twice
    before = [p.relayed for p in proxies]
    assert read(batch, parts) == sent  # each record once, in order
    carried = [p.relayed - b for p, b in zip(proxies, before)]
    assert all(n > 2 * 8000 for n in carried), carried  # (records went through every relay)

    # a replica killed under a planned read: its ranges are read at the next one
    victim = brokers.index(next(b for b in brokers if b is not leader))
    brokers[victim].kill()
    with caplog.at_level(logging.WARNING, logger="trio_nsq.spark"):
        assert read(batch, parts) == sent
    turned = [rec.message for rec in caplog.records if "reading the range at" in rec.message]
    assert len(turned) == 2 and all(m.startswith(f"nsq: {proxies[victim].address} does not answer") for m in turned)

    # a stream's micro-batches spread too, the offsets naming the log by one address
    r = NSQLogStreamReader(log_settings({**where, "startingoffsets": "earliest"}, batch=False))
    try:
        start = r.initialOffset()
        end = r.latestOffset(start, ReadAllAvailable())
        stream_parts = r.partitions(start, end)
        firsts = {p.replicas[0] for p in stream_parts if isinstance(p, LogRange)}
        assert len(firsts) == 2 and proxies[victim].address not in firsts  # (the two that answer)
        assert read(r, stream_parts) == sent
        assert list(parse_offsets(TOPIC, end)) == [proxies[0].address]
    finally:
        r.stop()


def channel_depth(broker: BrokerProcess, channel: str) -> int | None:
    """The channel's depth on `broker` (None: no such channel there)."""
    stats = broker.get(f"/stats?format=json&topic={TOPIC}&channel={channel}").json()
    for t in stats.get("topics") or []:
        for c in t.get("channels") or []:
            if c["channel_name"] == channel:
                return int(c["depth"])
    return None


def cursor_reader(brokers: list[BrokerProcess]) -> NSQLogStreamReader:
    addresses = ",".join(b.http_address for b in brokers)
    return NSQLogStreamReader(log_settings({"topic": TOPIC, "nsqd_http_address": addresses,
                                            "startingoffsets": "earliest", "channel": "spark-q"}, batch=False))


def test_a_stream_s_cursor_is_committed_on_the_leader(cluster) -> None:  # noqa: F811
    """With `channel`, the query's cursor (pinning the log, its depth the query's lag) is committed on the
    log's leader, whichever address names the log in the offsets: a follower mirrors its leader's channels
    and deletes any other, so a cursor committed on a follower would not last."""
    _, brokers = cluster
    leader, followers = placed(brokers)
    sent = bodies_for("c", 20)
    publish_acked(leader, sent)
    hwm_everywhere(brokers, leader)
    r = cursor_reader([followers[0], leader, followers[1]])  # a follower first: the offsets name the log by it
    try:
        start = r.initialOffset()
        assert list(parse_offsets(TOPIC, start)) == [followers[0].http_address]
        assert channel_depth(leader, "spark-q") == 20  # (committed at the start: all 20 to read)
        end = r.latestOffset(start, ReadAllAvailable())
        assert read(r, r.partitions(start, end)) == sent
        r.commit(end)
        assert channel_depth(leader, "spark-q") == 0
        wait_for(lambda: all(channel_depth(f, "spark-q") == 0 for f in followers), timeout=10,
                 message="the followers mirror the cursor")
    finally:
        r.stop()


def test_a_stream_s_cursor_is_committed_on_the_new_leader_after_a_failover(cluster) -> None:  # noqa: F811
    """Followers mirror the leader's cursors with their flag (the fetch answer's `cursors`): the new leader
    takes the query's commit (it refused it with CHANNEL_NOT_A_CURSOR when the flag was not mirrored)."""
    _, brokers = cluster
    leader, followers = placed(brokers)
    sent = bodies_for("c", 20)
    publish_acked(leader, sent)
    hwm_everywhere(brokers, leader)
    r = cursor_reader(brokers)
    try:
        start = r.initialOffset()
        end = r.latestOffset(start, ReadAllAvailable())
        assert read(r, r.partitions(start, end)) == sent
        r.commit(end)
        wait_for(lambda: all(channel_depth(f, "spark-q") == 0 for f in followers), timeout=10,
                 message="the followers mirror the cursor")
        leader.kill()
        new_leader, _ = wait_roles(followers, timeout=15)
        more = bodies_for("d", 5)
        publish_acked(new_leader, more)
        hwm_everywhere(followers, new_leader)
        later = r.latestOffset(end, ReadAllAvailable())
        assert read(r, r.partitions(end, later)) == more
        r.commit(later)
        assert channel_depth(new_leader, "spark-q") == 0
    finally:
        r.stop()
