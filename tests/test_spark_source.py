"""The streaming source `spark.readStream.format("nsq")` (shared/spark/source.py) on the shared local
SparkSession (tests/conftest.py `spark`), reading from a real broker process: every message arrives
with its columns, is FIN'd only once its micro-batch committed, and a query that fails before the commit
leaves its messages to nsqd.
"""

from __future__ import annotations

import datetime
import json
import time
import urllib.request

import pytest
from processes import BrokerProcess

from trio_nsq.shared.spark.publisher import MPubClient


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
