"""The streaming source `spark.readStream.format("nsq")` (trio_nsq/spark/source.py) on the shared local
SparkSession (tests/conftest.py `spark`), reading from a real broker process: every message arrives
with its columns, is FIN'd only once its micro-batch committed, and a query that fails before the commit
leaves its messages to nsqd.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import threading
import time
import urllib.request

import pytest
from processes import BrokerProcess, LookupdProcess

from trio_nsq.spark.publisher import MPubClient


def publish(broker: BrokerProcess, topic: str, bodies: list[bytes]) -> None:
    with MPubClient([broker.http_address]) as client:
        for i in range(0, len(bodies), 5000):
            client.publish(topic, bodies[i:i + 5000])


def channel_stats(broker: BrokerProcess, topic: str, channel: str) -> dict:
    url = f"http://{broker.http_address}/stats?format=json&topic={topic}&channel={channel}"
    with urllib.request.urlopen(url, timeout=10) as response:
        stats = json.load(response)
    for t in stats["topics"]:
        for c in t["channels"]:
            if t["topic_name"] == topic and c["channel_name"] == channel:
                return c
    return {}


def eventually(check, what: str, timeout: float = 120.0, query=None):
    deadline = time.monotonic() + timeout
    while True:
        if query is not None:
            assert query.isActive, query.exception()
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"still not {what}"
        time.sleep(0.2)


def read_stream(spark, broker: BrokerProcess, topic: str, channel: str, **options):
    reader = spark.readStream.format("nsq").option("topic", topic).option("channel", channel) \
        .option("nsqd_tcp_address", broker.tcp_address)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def bodies_for(prefix: str, n: int) -> list[bytes]:
    # binary bodies: a newline, a NUL and a high byte in each, so nothing is decoded as text on the way
    return [b"%s-%05d\n\x00\xff" % (prefix.encode(), i) for i in range(n)]


def test_a_stream_reads_every_message_and_fins_each_after_its_batch_commits(spark, module_broker, tmp_path):
    sent = bodies_for("s", 20_000)
    before = datetime.datetime.now(datetime.timezone.utc)
    publish(module_broker, "src", sent)
    after = datetime.datetime.now(datetime.timezone.utc)
    assert channel_stats(module_broker, "src", "spark") == {}  # the query makes the channel

    stream = read_stream(spark, module_broker, "src", "spark", max_messages_per_batch=3000)
    query = (stream.writeStream.format("memory").queryName("nsq_source_rows")
             .option("checkpointLocation", str(tmp_path / "checkpoint"))
             .trigger(processingTime="200 milliseconds").start())
    try:
        eventually(lambda: spark.table("nsq_source_rows").count() >= 20_000, "20k rows", query=query)
        # the last batch is FIN'd once Spark has committed it (the source then plans one empty batch)
        eventually(lambda: (s := channel_stats(module_broker, "src", "spark"))
                   and s["in_flight_count"] == 0 and s["depth"] == 0, "all FIN'd", query=query)
        progress = [p for p in query.recentProgress if p["numInputRows"]]
    finally:
        query.stop()
    rows = spark.table("nsq_source_rows").collect()
    assert len(rows) == 20_000  # nothing twice
    assert sorted(bytes(r.value) for r in rows) == sorted(sent)
    assert {(r.topic, r.channel, r.nsqd_address, r.attempts) for r in rows} == \
        {("src", "spark", module_broker.tcp_address, 1)}
    ids = {r.id for r in rows}
    assert len(ids) == 20_000 and {len(i) for i in ids} == {16}
    slack = datetime.timedelta(seconds=1)
    stamps = [r.timestamp.astimezone(datetime.timezone.utc) if r.timestamp.tzinfo else
              r.timestamp.replace(tzinfo=datetime.datetime.now().astimezone().tzinfo) for r in rows[:100]]
    assert all(before - slack <= t <= after + slack for t in stamps), (before, stamps[:3], after)
    assert max(p["numInputRows"] for p in progress) <= 3000  # max_messages_per_batch
    stats = channel_stats(module_broker, "src", "spark")
    assert (stats["message_count"], stats["requeue_count"], stats["timeout_count"]) == (20_000, 0, 0)


def test_a_query_failing_before_its_commit_leaves_the_messages_to_the_next_run(spark, module_broker, tmp_path):
    sent = bodies_for("f", 2000)
    publish(module_broker, "src-fail", sent)
    checkpoint = str(tmp_path / "checkpoint")
    seen_in_flight = []

    def fail(df, batch_id):
        n = df.count()
        if n:
            seen_in_flight.append((n, channel_stats(module_broker, "src-fail", "spark")["in_flight_count"]))
            raise RuntimeError("the sink fails before the batch commits")

    # a short msg_timeout: nsqd gives the messages of a closed connection back when it has passed
    stream = read_stream(spark, module_broker, "src-fail", "spark", msg_timeout=2000)
    query = stream.writeStream.foreachBatch(fail).option("checkpointLocation", checkpoint) \
        .trigger(processingTime="200 milliseconds").start()
    with pytest.raises(Exception, match="before the batch commits"):
        query.awaitTermination(120)
    assert seen_in_flight and seen_in_flight[0][0] == seen_in_flight[0][1] > 0  # held, not FIN'd
    # the query's Python process is gone with its connections: their messages time out back to the queue
    eventually(lambda: channel_stats(module_broker, "src-fail", "spark")["depth"] == 2000, "requeued")

    got = []

    def collect(df, batch_id):
        got.extend((bytes(r.value), r.attempts) for r in df.collect())

    # the same checkpoint: Spark replays the planned, uncommitted batch (empty), then reads on
    query = read_stream(spark, module_broker, "src-fail", "spark").writeStream.foreachBatch(collect) \
        .option("checkpointLocation", checkpoint).trigger(processingTime="200 milliseconds").start()
    try:
        eventually(lambda: len(got) >= 2000 and channel_stats(module_broker, "src-fail", "spark")["in_flight_count"]
                   == 0, "2000 rows", query=query)
    finally:
        query.stop()
    assert sorted(body for body, _ in got) == sorted(sent)
    failed = seen_in_flight[0][0]
    assert sorted(attempts for _, attempts in got).count(2) == failed  # the failed batch, delivered again


def test_reader_options_are_checked(spark, module_broker, tmp_path):
    def fails(pattern, **options):
        reader = spark.readStream.format("nsq")
        for key, value in options.items():
            reader = reader.option(key, value)
        query = reader.load().writeStream.format("memory").queryName("never") \
            .option("checkpointLocation", str(tmp_path / pattern[:8])).start()
        try:
            with pytest.raises(Exception, match=pattern):  # the reader is made when the query starts
                query.awaitTermination(60)
        finally:
            query.stop()

    fails(r"set \.option\('channel'", topic="t", nsqd_tcp_address=module_broker.tcp_address)
    fails("did you mean 'max_in_flight'", topic="t", channel="c", max_inflight="5",
          nsqd_tcp_address=module_broker.tcp_address)
    fails(r"no broker", topic="t", channel="c")
    fails("max_messages_per_batch='0' must be an integer >= 1", topic="t", channel="c", max_messages_per_batch="0",
          nsqd_tcp_address=module_broker.tcp_address)


# --- at least once, at scale and under failures --------------------------------------------------------


def source_runner_pids(spark) -> list[int]:
    """The Python processes this session's JVM runs streaming sources in (one per query)."""
    jvm = spark.sparkContext._gateway.proc.pid
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
            status = open(f"/proc/{entry}/status").read()
        except OSError:
            continue
        ppid = int(status.split("PPid:")[1].split()[0])
        if b"python_streaming_source_runner" in cmdline and ppid == jvm:
            pids.append(int(entry))
    return pids


def test_three_brokers_through_lookupd_200k_messages_all_read_and_none_left_in_flight(spark, tmp_path):
    from test_lookupd_discovery import eventually as soon

    lookupd = LookupdProcess(tmp_path).start()
    brokers: list[BrokerProcess] = []
    try:
        for _ in range(3):
            brokers.append(BrokerProcess(tmp_path, lookupd_tcp_address=lookupd.tcp_address,
                                         broadcast_address="127.0.0.1").start())
        sent = [b"m-%06d" % i for i in range(200_000)]
        for n, broker in enumerate(brokers):
            publish(broker, "wide", sent[n::3])
        soon(lambda: len(lookupd.get("/lookup?topic=wide").json()["producers"]) == 3)

        stream = spark.readStream.format("nsq").option("topic", "wide").option("channel", "spark") \
            .option("lookupd_http_address", lookupd.http_address).load()  # every other option by default
        query = stream.writeStream.format("memory").queryName("nsq_wide") \
            .option("checkpointLocation", str(tmp_path / "checkpoint")).start()
        try:
            def drained():
                stats = [channel_stats(b, "wide", "spark") for b in brokers]
                return all(s and s["message_count"] == len(sent[n::3]) and s["depth"] == 0
                           and s["in_flight_count"] == 0 for n, s in enumerate(stats))

            eventually(drained, "every broker drained and every message FIN'd", query=query)
        finally:
            query.stop()
        rows = spark.sql("SELECT count(*) AS n, count(DISTINCT value) AS distinct_values, "
                         "count(DISTINCT nsqd_address) AS brokers, max(attempts) AS attempts FROM nsq_wide").first()
        assert (rows.n, rows.distinct_values, rows.brokers, rows.attempts) == (200_000, 200_000, 3, 1)
        assert {s["requeue_count"] + s["timeout_count"] for s in (channel_stats(b, "wide", "spark")
                                                                  for b in brokers)} == {0}
    finally:
        for b in brokers:
            b.stop()
        lookupd.stop()


def test_a_query_killed_between_its_batch_and_its_commit_loses_nothing(spark, broker_factory, tmp_path):
    broker = broker_factory()
    sent = bodies_for("k", 3000)
    publish(broker, "kill", sent)
    checkpoint = str(tmp_path / "checkpoint")
    first: list[tuple[bytes, int]] = []
    held_at_kill = []

    def record_then_kill(df, batch_id):
        rows = [(bytes(r.value), r.attempts) for r in df.collect()]
        if rows and not first:
            first.extend(rows)
            # the sink has the batch; Spark commits it when it plans the next one: kill the source's
            # process now, so that commit never comes
            held_at_kill.append(channel_stats(broker, "kill", "spark")["in_flight_count"])
            for pid in source_runner_pids(spark):
                os.kill(pid, signal.SIGKILL)

    stream = read_stream(spark, broker, "kill", "spark", msg_timeout=2000, max_messages_per_batch=1000)
    query = stream.writeStream.foreachBatch(record_then_kill).option("checkpointLocation", checkpoint).start()
    with pytest.raises(Exception):
        query.awaitTermination(120)  # the source's process is gone: the query fails
    assert len(first) == 1000 and held_at_kill[0] >= 1000  # the batch reached the sink and was not FIN'd

    again: list[tuple[bytes, int]] = []
    query = read_stream(spark, broker, "kill", "spark").writeStream \
        .foreachBatch(lambda df, _: again.extend((bytes(r.value), r.attempts) for r in df.collect())) \
        .option("checkpointLocation", checkpoint).start()
    try:
        eventually(lambda: (s := channel_stats(broker, "kill", "spark"))["depth"] == 0
                   and s["in_flight_count"] == 0 and len({b for b, _ in again}) == 3000, "3000 rows", query=query)
    finally:
        query.stop()
    assert sorted({body for body, _ in first + again}) == sorted(sent)  # nothing lost
    redelivered = {body for body, attempts in again if attempts > 1}
    assert {body for body, _ in first} <= redelivered  # the uncommitted batch came again


def test_a_broker_killed_and_restarted_mid_query_costs_no_message(spark, broker_factory, tmp_path):
    broker = broker_factory(mem_queue_size=0, sync_every=1)
    sent = bodies_for("b", 10_000)
    publish(broker, "durable", sent)
    got: list[bytes] = []
    batches = []
    blocked, release = threading.Event(), threading.Event()

    def sink(df, batch_id):
        rows = [bytes(r.value) for r in df.collect()]
        got.extend(rows)
        if rows:
            batches.append(len(rows))
        if len(batches) == 2 and not release.is_set():
            blocked.set()
            release.wait(60)  # the broker is killed and restarted while this batch waits for its commit

    stream = read_stream(spark, broker, "durable", "spark", max_in_flight=2000, max_messages_per_batch=1000)
    query = stream.writeStream.foreachBatch(sink).option("checkpointLocation", str(tmp_path / "ck")).start()
    try:
        eventually(blocked.is_set, "the second batch in the sink", query=query)
        # the window is full: 1000 in the waiting batch, 1000 received since; all of them delivered to us
        eventually(lambda: channel_stats(broker, "durable", "spark")["in_flight_count"] == 2000, "a full window")
        broker.kill()
        broker.start()
        release.set()
        eventually(lambda: set(got) >= set(sent), "every message", query=query)
        eventually(lambda: (s := channel_stats(broker, "durable", "spark"))["depth"] == 0
                   and s["in_flight_count"] == 0, "all FIN'd", query=query)
    finally:
        release.set()
        query.stop()
    assert set(got) == set(sent)
    assert max(batches) <= 1000


# --- the batch read ------------------------------------------------------------------------------------


def batch_read(spark, broker: BrokerProcess, topic: str, **options):
    # a task that sees no message for idle_timeout takes its broker as drained: generous, for a loaded machine
    reader = spark.read.format("nsq").option("topic", topic).option("channel", "spark") \
        .option("nsqd_tcp_address", broker.tcp_address)
    for key, value in {"idle_timeout": 5000, **options}.items():
        reader = reader.option(key, value)
    return reader.load()


def test_a_batch_read_takes_what_the_channel_holds_up_to_max_messages_and_fins_it(spark, module_broker):
    sent = bodies_for("r", 12_000)
    publish(module_broker, "batch", sent[:10])
    assert batch_read(spark, module_broker, "batch").count() == 10  # makes the channel, reads what it holds
    publish(module_broker, "batch", sent[10:])
    # 3500 for each of the two tasks: two connections each (nsqd's --max-rdy-count is 2500)
    df = batch_read(spark, module_broker, "batch", max_messages=7000)
    assert df.schema == batch_read(spark, module_broker, "batch").schema == read_stream(
        spark, module_broker, "batch", "spark").schema
    rows = df.collect()
    assert len(rows) == 7000 and len({r.id for r in rows}) == 7000
    stats = channel_stats(module_broker, "batch", "spark")
    assert (stats["depth"], stats["in_flight_count"]) == (4990, 0)
    rows += batch_read(spark, module_broker, "batch", max_messages=7000).collect()
    assert sorted(bytes(r.value) for r in rows) == sorted(sent[10:])  # each once over the two reads
    assert {(r.topic, r.channel, r.nsqd_address) for r in rows} == {("batch", "spark", module_broker.tcp_address)}
    assert batch_read(spark, module_broker, "batch").count() == 0
    stats = channel_stats(module_broker, "batch", "spark")
    assert (stats["depth"], stats["in_flight_count"], stats["message_count"]) == (0, 0, 12_000)
    # each delivered once: no task took more than its share, none failed and was run again
    assert {r.attempts for r in rows} == {1} and (stats["requeue_count"], stats["timeout_count"]) == (0, 0)


def test_a_failing_batch_read_job_leaves_its_messages_to_come_back(spark, module_broker):
    sent = bodies_for("x", 1000)
    publish(module_broker, "batch-fail", sent)
    channel = "spark"
    # the tasks hold every message and wait for more (idle_timeout): the job is cancelled meanwhile
    df = batch_read(spark, module_broker, "batch-fail", max_messages=5000, msg_timeout=2000, idle_timeout=120_000)
    failure = []

    def run():
        try:
            spark.sparkContext.setJobGroup("nsq-batch-fail", "a batch read that fails")
            df.collect()
        except Exception as exc:  # noqa: BLE001 - the test checks that it failed
            failure.append(exc)

    job = threading.Thread(target=run)
    job.start()
    eventually(lambda: channel_stats(module_broker, "batch-fail", channel).get("in_flight_count") == 1000, "all held")
    spark.sparkContext.cancelJobGroup("nsq-batch-fail")
    job.join(60)
    assert failure and not job.is_alive()
    eventually(lambda: (s := channel_stats(module_broker, "batch-fail", channel))["depth"] == 1000
               and s["in_flight_count"] == 0, "all back on the channel")
    rows = batch_read(spark, module_broker, "batch-fail").collect()
    assert sorted(bytes(r.value) for r in rows) == sorted(sent)
    # every one delivered again (not FIN'd by the failed job); twice again when the other task of the cancelled
    # job was still subscribed as the first one's messages came back
    assert min(r.attempts for r in rows) >= 2


# --- the source's parts, without Spark ------------------------------------------------------------------


class FakeConnection:
    """What the Fetcher's chunks and the record batch use of a connection; records the FINs."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.is_closed = False
        self.fin_writes: list[list[bytes]] = []

    def fin_many(self, ids: list[bytes]) -> None:
        self.fin_writes.append(ids)


def frames_for(bodies: list[bytes], attempts: int = 1) -> list[bytes]:
    from trio_nsq.shared.protocol import encode_message

    # a timestamp and attempts whose bytes differ from their reverse: a wrong byte order shows
    return [encode_message(b"%016x" % i, 1_795_000_000_123_456_789 + i * 1000, attempts + i % 300, body)
            for i, body in enumerate(bodies)]


def test_the_record_batch_is_cut_column_wise_out_of_the_frames():
    from trio_nsq.spark.fetcher import Chunk
    from trio_nsq.spark.source import SCHEMA, ReadSettings, to_record_batch

    settings = ReadSettings("t", "c", ("a:1",), (), 10, 1 << 20, 10, None)
    bodies = [b"", b"x", b"\x00\xff\n" * 100] + [b"b-%d" % i for i in range(997)]
    frames = frames_for(bodies)
    chunks = [Chunk(FakeConnection("a:1"), frames[:3], 0.0), Chunk(FakeConnection("b:2"), frames[3:], 0.0)]
    assert (chunks[0].body_bytes, chunks[1].body_bytes) == (301, sum(map(len, bodies[3:])))
    rows = to_record_batch(settings, chunks).to_pylist()
    assert [r["value"] for r in rows] == bodies
    assert [r["id"] for r in rows] == ["%016x" % i for i in range(1000)]
    assert [r["attempts"] for r in rows] == [1 + i % 300 for i in range(1000)]
    second = datetime.datetime.fromtimestamp(1_795_000_000, datetime.timezone.utc)
    assert [r["timestamp"] for r in rows[:2]] == [second + datetime.timedelta(microseconds=123456 + i) for i in (0, 1)]
    assert [r["nsqd_address"] for r in rows] == ["a:1"] * 3 + ["b:2"] * 997
    assert {(r["topic"], r["channel"]) for r in rows} == {("t", "c")}
    assert [f.name for f in SCHEMA.fields] == list(rows[0])


def test_a_micro_batch_is_cut_into_partitions_of_frames_that_keep_order_and_brokers():
    import pickle

    from trio_nsq.spark.fetcher import Chunk
    from trio_nsq.spark.source import Frames, ReadSettings

    settings = ReadSettings("t", "c", (), (), 10, 1 << 20, 10, None)
    bodies = [b"m-%d" % i for i in range(11)]
    frames = frames_for(bodies)
    a, b = FakeConnection("a:1"), FakeConnection("b:2")
    # two chunks of one broker in a row make one run; a partition boundary falls inside a run
    chunks = [Chunk(a, frames[:3], 0.0), Chunk(a, frames[3:4], 0.0), Chunk(b, frames[4:10], 0.0),
              Chunk(a, frames[10:], 0.0)]
    parts = [pickle.loads(pickle.dumps(p)) for p in Frames.split(chunks, 3)]  # as Spark ships them
    assert [len(p) for p in parts] == [4, 4, 3]
    assert [p.addresses for p in parts] == [[("a:1", 4)], [("b:2", 4)], [("b:2", 2), ("a:1", 1)]]
    rows = [r for p in parts for r in p.record_batch(settings).to_pylist()]
    assert [r["value"] for r in rows] == bodies
    assert [r["nsqd_address"] for r in rows] == ["a:1"] * 4 + ["b:2"] * 6 + ["a:1"]
    # nothing planned (a batch replayed empty): one empty partition, no rows
    assert [len(p) for p in Frames.split([], 2)] == [0]


def test_wait_settled_ends_at_the_count_or_once_no_message_came_for_the_quiet_time():
    import threading

    from trio_nsq.spark.fetcher import Fetcher
    from trio_nsq.spark.source import ReadSettings

    # no broker: fed by hand; msg_timeout 60 s: nothing held long enough to be TOUCHed
    fetcher = Fetcher(ReadSettings("t", "c", (), (), 250, 1000, 1000, 60_000))
    try:
        conn = FakeConnection("a:1")
        fetcher.call(fetcher._on_messages, conn, frames_for([b"x"] * 3))
        fetcher.wait_settled(3, quiet=60.0)  # the count is there: no wait for the quiet time
        # messages keep coming for a while: the wait lasts until they stop, not until the first
        feeding = threading.Event()

        def feed() -> None:
            for _ in range(5):
                fetcher.call(fetcher._on_messages, conn, frames_for([b"y"]))
                feeding.wait(0.02)

        feeder = threading.Thread(target=feed)
        feeder.start()
        fetcher.wait_settled(100, quiet=1.0)  # (far above the gaps: a loaded machine stays within it)
        settled = fetcher.call(fetcher.arrived_count)
        feeder.join()
        assert settled == 8
        assert sum(len(chunk.frames) for chunk in fetcher.call(fetcher.take, 1)) == 8
        fetcher.call(fetcher.commit, 1)
    finally:
        fetcher.close()


def test_a_micro_batch_is_cut_at_max_messages_and_max_bytes_and_holds_at_least_one_message():
    from trio_nsq.spark.fetcher import Fetcher
    from trio_nsq.spark.source import ReadSettings

    fetcher = Fetcher(ReadSettings("t", "c", (), (), 250, 1000, 1000, None))  # no broker: fed by hand
    try:
        conn = FakeConnection("a:1")
        # two reads of 200 ten-byte bodies, then one body larger than max_bytes_per_batch
        fetcher.call(fetcher._on_messages, conn, frames_for([b"0123456789"] * 200))
        fetcher.call(fetcher._on_messages, conn, frames_for([b"0123456789"] * 200))
        fetcher.call(fetcher._on_messages, conn, frames_for([b"z" * 5000]))
        assert fetcher.call(fetcher.arrived_count) == 401 and fetcher.held_bytes == 9000
        sizes = []
        for batch in range(1, 6):
            taken = fetcher.call(fetcher.take, batch)
            sizes.append((sum(len(c.frames) for c in taken), sum(c.body_bytes for c in taken)))
        # max_bytes_per_batch 1000: 100 bodies; the large one alone; then nothing
        assert sizes == [(100, 1000), (100, 1000), (100, 1000), (100, 1000), (1, 5000)]
        assert fetcher.call(fetcher.take, 6) == [] and fetcher.call(fetcher.arrived_count) == 0
        assert fetcher.call(fetcher.holding, 6) and fetcher.call(fetcher.commit, 5) == 401
        assert fetcher.held_bytes == 0 and not fetcher.call(fetcher.holding, 6)
        # one write for the connection, every id in it once
        assert len(conn.fin_writes) == 1 and sorted(conn.fin_writes[0]) == sorted(
            [b"%016x" % i for i in range(200)] * 2 + [b"%016x" % 0])
    finally:
        fetcher.close()
