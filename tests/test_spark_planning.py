"""The positional reader's planning (trio_nsq/spark/positional.py) as a Kafka user expects it: the reader
classes called as Spark's driver calls them, against real trio-nsqd processes (issue 49). One test runs a
query on the shared SparkSession: a Kafka user's options, no `channel`.
"""

from __future__ import annotations

import logging

import pytest
from processes import BrokerProcess, LookupdProcess, free_port
from test_spark_log import bodies_for, by_position, positions, publish_durably, run_available_now, stream
from test_spark_source import channel_stats, eventually

from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMinRows

from trio_nsq.spark.options import choose_source, log_settings
from trio_nsq.spark.positional import (
    DataLossError,
    NSQLogBatchReader,
    NSQLogStreamReader,
    offsets_dict,
    parse_offsets,
    share,
)

pytestmark = pytest.mark.spark_log


def reader(topic: str, *addresses: str, channel: str | None = "plan-q", **options: str) -> NSQLogStreamReader:
    """A stream reader as Spark's driver makes it; with a cursor unless channel=None."""
    cursor = {} if channel is None else {"channel": channel}
    return NSQLogStreamReader(log_settings({"topic": topic, "nsqd_http_address": ",".join(addresses), **cursor,
                                            **{k.lower(): v for k, v in options.items()}}, batch=False))


def bodies(reader_: NSQLogStreamReader | NSQLogBatchReader, parts) -> list[bytes]:
    """Every record of `parts`, read as Spark's tasks read them."""
    return [bytes(v) for part in parts for batch in reader_.read(part) for v in batch.column("value").to_pylist()]


def planned(r: NSQLogStreamReader, start: dict, end: dict) -> list[bytes]:
    return bodies(r, r.partitions(start, end))


class Clock:
    """A driver clock the test moves (the reader's `clock`)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- 1. initialOffset: the same answer every call ----------------------------------------------------


def test_initial_offset_answers_the_same_every_call_so_batch_0_loses_nothing(module_broker):
    """Spark asks initialOffset when it plans batch 0 and again when it runs it."""
    topic = "plan-initial"
    by_position(module_broker, topic)
    publish_durably(module_broker, topic, bodies_for("old", 5))
    r = reader(topic, module_broker.http_address, channel="plan-initial-q")  # default: latest
    try:
        s1 = r.initialOffset()
        sent = bodies_for("new", 10)
        publish_durably(module_broker, topic, sent)
        e = r.latestOffset(s1, r.getDefaultReadLimit())
        s2 = r.initialOffset()
        assert planned(r, s2, e) == sent
        assert s2 == s1
        # the cursor was committed once, at the query's start: the 10 are its lag
        assert channel_stats(module_broker, topic, "plan-initial-q")["depth"] == 10
    finally:
        r.stop()


# --- 2. a broker is its log ---------------------------------------------------------------------------


def test_one_broker_under_two_addresses_is_read_once_and_resumes_under_either_name(spark, tmp_path):
    lookupd = LookupdProcess(tmp_path).start()
    broker = BrokerProcess(tmp_path, lookupd_tcp_address=lookupd.tcp_address, broadcast_address="localhost").start()
    topic = "plan-alias"
    try:
        by_position(broker, topic)
        sent = bodies_for("a", 50)
        publish_durably(broker, topic, sent)
        eventually(lambda: lookupd.get(f"/lookup?topic={topic}").json().get("producers"), "the broker in lookupd")
        numeric, named = broker.http_address, f"localhost:{broker.http_port}"

        both = {"topic": topic, "nsqd_http_address": numeric, "lookupd_http_address": lookupd.http_address,
                "startingoffsets": "earliest"}
        r = NSQLogStreamReader(log_settings({**both, "channel": "plan-q"}, batch=False))
        try:
            start = r.initialOffset()
            end = r.latestOffset(start, r.getDefaultReadLimit())
            assert sorted(planned(r, start, end)) == sorted(sent)
            assert len(end[topic]) == 1
        finally:
            r.stop()
        batch = NSQLogBatchReader(log_settings(both, batch=True))
        assert sorted(bodies(batch, batch.partitions())) == sorted(sent)
        df = spark.read.format("nsq").options(**both).load()
        assert df.count() == 50

        # offsets written under one name resume under the other without reading the log again
        first = reader(topic, named, startingOffsets="earliest")
        try:
            start = first.initialOffset()
            end = first.latestOffset(start, first.getDefaultReadLimit())
            assert list(end[topic]) == [named]
        finally:
            first.stop()
        more = bodies_for("b", 7)
        publish_durably(broker, topic, more)
        second = reader(topic, numeric)  # a restart from the checkpoint, the broker named otherwise
        try:
            e2 = second.latestOffset(end, second.getDefaultReadLimit())
            e3 = second.latestOffset(e2, second.getDefaultReadLimit())
            assert planned(second, end, e2) + planned(second, e2, e3) == more
        finally:
            second.stop()
        # a checkpoint written before: the log under both names (read twice then) resumes reading it once
        log_id, at = parse_offsets(topic, end)[named]
        twice = offsets_dict(topic, {named: (log_id, at), numeric: (log_id, at)})
        third = reader(topic, numeric)
        try:
            e4 = third.latestOffset(twice, third.getDefaultReadLimit())
            assert planned(third, twice, e4) == more
        finally:
            third.stop()
    finally:
        broker.stop()
        lookupd.stop()


# --- 3. a broker down at the start keeps its requested start; JSON names every broker -----------------


def test_a_broker_down_at_the_start_joins_at_the_requested_start(module_broker, tmp_path):
    topic = "plan-late"
    by_position(module_broker, topic)
    late = BrokerProcess(tmp_path)  # its ports chosen, not started yet
    r = reader(topic, module_broker.http_address, late.http_address)  # startingOffsets: latest
    try:
        start = r.initialOffset()
        late.start()
        by_position(late, topic)
        publish_durably(late, topic, bodies_for("before", 5))  # before it joins: not for a query at latest
        e1 = r.latestOffset(start, r.getDefaultReadLimit())
        after = bodies_for("after", 3)
        publish_durably(late, topic, after)
        e2 = r.latestOffset(e1, r.getDefaultReadLimit())
        assert planned(r, start, e1) + planned(r, e1, e2) == after
        assert start[topic][late.http_address] == {"log_id": None, "position": None}  # (it waited)
    finally:
        r.stop()
        late.stop()


def test_json_offsets_that_do_not_name_every_broker_are_refused_naming_them(module_broker, broker):
    topic = "plan-json"
    for b in (module_broker, broker):
        by_position(b, topic)
        publish_durably(b, topic, bodies_for("j", 3))
    json_one = '{"%s": {"%s": -2}}' % (topic, module_broker.http_address)
    addresses = f"{module_broker.http_address},{broker.http_address}"
    r = reader(topic, module_broker.http_address, broker.http_address, startingOffsets=json_one)
    try:
        with pytest.raises(ValueError, match=f"startingOffsets gives no position for broker {broker.http_address}"):
            r.initialOffset()
    finally:
        r.stop()
    batch = NSQLogBatchReader(log_settings({"topic": topic, "nsqd_http_address": addresses,
                                            "startingoffsets": json_one}, batch=True))
    with pytest.raises(ValueError, match=f"gives no position for broker {broker.http_address}"):
        batch.partitions()
    # naming both (one by the other name of the same broker) is enough
    both = '{"%s": {"%s": -2, "localhost:%d": -2}}' % (topic, module_broker.http_address, broker.http_port)
    batch = NSQLogBatchReader(log_settings({"topic": topic, "nsqd_http_address": addresses,
                                            "startingoffsets": both}, batch=True))
    assert len(bodies(batch, batch.partitions())) == 6


# --- 4. a limit shared over the brokers starves none --------------------------------------------------


def test_a_share_below_one_is_rounded_up():
    shares = share(10, {"a": 19, "b": 1})
    assert shares["b"] >= 1
    assert shares == {"a": 9, "b": 1}
    assert share(2, {"a": 1, "b": 1, "c": 1}) == {"a": 1, "b": 1, "c": 1}  # (a little above the limit)


def test_a_small_broker_is_read_while_a_large_one_stays_above_the_limit(module_broker, broker):
    topic = "plan-share"
    for b in (module_broker, broker):
        by_position(b, topic)
    publish_durably(module_broker, topic, bodies_for("big", 19))
    publish_durably(broker, topic, [b"small"])
    r = reader(topic, module_broker.http_address, broker.http_address, startingOffsets="earliest",
               maxOffsetsPerTrigger="10")
    small: list[int] = []
    try:
        start = r.initialOffset()
        for trigger in range(3):
            end = r.latestOffset(start, r.getDefaultReadLimit())
            if b"small" in planned(r, start, end):
                small.append(trigger)
            r.commit(end)
            start = end
            publish_durably(module_broker, topic, bodies_for(f"more{trigger}", 10))  # its backlog stays above 10
        assert small == [0]
    finally:
        r.stop()


# --- 6, 7. no channel; the latest offset reported ----------------------------------------------------


def test_the_latest_offset_is_reported_beside_the_micro_batch_s_end(module_broker):
    topic = "plan-latest"
    by_position(module_broker, topic)
    now = publish_durably(module_broker, topic, bodies_for("l", 30))
    r = reader(topic, module_broker.http_address, startingOffsets="earliest", maxOffsetsPerTrigger="10")
    try:
        start = r.initialOffset()
        end = r.latestOffset(start, r.getDefaultReadLimit())
        assert r.reportLatestOffset() == offsets_dict(topic, {module_broker.http_address: (now["log_id"], now["end"])})
        assert end != r.reportLatestOffset()  # (the micro-batch took 10 of the 30)
    finally:
        r.stop()


def test_a_stream_without_a_channel_pins_nothing(module_broker):
    topic = "plan-nochannel"
    by_position(module_broker, topic)
    publish_durably(module_broker, topic, bodies_for("n", 30))
    r = reader(topic, module_broker.http_address, channel=None, startingOffsets="earliest",
               maxOffsetsPerTrigger="10")
    try:
        start = r.initialOffset()
        end = r.latestOffset(start, r.getDefaultReadLimit())
        assert len(planned(r, start, end)) == 10
        r.commit(end)
    finally:
        r.stop()
    stats = module_broker.get(f"/stats?format=json&topic={topic}").json()
    assert [t["channels"] for t in stats["topics"] if t["topic_name"] == topic] == [[]]  # no cursor made


def test_a_kafka_user_s_query_runs_without_a_channel(spark, module_broker, tmp_path):
    topic = "plan-kafka"
    by_position(module_broker, topic)
    sent = bodies_for("k", 250)
    publish_durably(module_broker, topic, sent)
    df = stream(spark, module_broker, topic, startingOffsets="earliest", maxOffsetsPerTrigger=100,
                failOnDataLoss="true")
    rows, progress = run_available_now(df, tmp_path / "checkpoint")
    assert [bytes(r.value) for r in rows] == sent
    assert [p["numInputRows"] for p in progress] == [100, 100, 50]
    assert all(p["sources"][0]["latestOffset"] is not None for p in progress)
    assert channel_stats(module_broker, topic, "plan-kafka") == {}


# --- 8. minOffsetsPerTrigger, maxTriggerDelay; Kafka's options named -----------------------------------


def test_min_offsets_per_trigger_waits_for_records_until_max_trigger_delay(module_broker):
    topic = "plan-min"
    by_position(module_broker, topic)
    publish_durably(module_broker, topic, bodies_for("m", 3))
    r = reader(topic, module_broker.http_address, startingOffsets="earliest", minOffsetsPerTrigger="5",
               maxTriggerDelay="1m", maxOffsetsPerTrigger="8")
    r.clock = clock = Clock()
    try:
        limit = r.getDefaultReadLimit()
        assert limit == ReadMinRows(5)
        start = r.initialOffset()
        end = r.latestOffset(start, limit)  # the first micro-batch goes at once (as Kafka's)
        assert len(planned(r, start, end)) == 3
        start = end
        publish_durably(module_broker, topic, bodies_for("m2", 2))
        clock.now += 30
        assert r.latestOffset(start, limit) == start  # 2 < 5, and 30 s < 1 min: no micro-batch
        clock.now += 31
        end = r.latestOffset(start, limit)  # the delay has passed: what there is goes
        assert len(planned(r, start, end)) == 2
        start = end
        publish_durably(module_broker, topic, bodies_for("m3", 12))
        clock.now += 1
        end = r.latestOffset(start, limit)  # enough records: they go, at most maxOffsetsPerTrigger
        assert len(planned(r, start, end)) == 8
        assert r.latestOffset(end, ReadAllAvailable()) != end  # (Trigger.AvailableNow: no minimum)
    finally:
        r.stop()


def test_a_kafka_user_s_options_without_a_channel_choose_the_positional_reader():
    nowhere = f"127.0.0.1:{free_port()}"  # (a lookupd that does not answer: no broker known yet)
    assert choose_source({"topic": "t", "lookupd_http_address": nowhere})[0] == "log"
    assert choose_source({"topic": "t", "lookupd_http_address": nowhere, "channel": "c"})[0] == "channel"


def test_a_kafka_option_trio_nsq_does_not_support_is_named_as_such():
    base = {"topic": "t", "nsqd_http_address": "127.0.0.1:4151"}
    with pytest.raises(ValueError, match=r"'subscribe' \(a Kafka option trio-nsq does not support; see topic\)"):
        log_settings({**base, "subscribe": "t"}, batch=False)
    with pytest.raises(ValueError, match=r"'kafka.bootstrap.servers' \(a Kafka option trio-nsq does not support"):
        log_settings({**base, "kafka.bootstrap.servers": "h:9092"}, batch=True)
    with pytest.raises(ValueError, match="maxTriggerDelay='soon' must be a duration"):
        log_settings({**base, "maxtriggerdelay": "soon"}, batch=False)
    with pytest.raises(ValueError, match="minOffsetsPerTrigger is for streams"):
        log_settings({**base, "minoffsetspertrigger": "5"}, batch=True)
    s = log_settings({**base, "minoffsetspertrigger": "5", "maxtriggerdelay": "90s"}, batch=False)
    assert (s.min_records, s.max_trigger_delay_ms, s.channel) == (5, 90_000, None)


# --- 9. a broker gone for good leaves the query -------------------------------------------------------


@pytest.mark.parametrize("fail", ["true", "false"])
def test_a_broker_gone_for_longer_than_broker_gone_timeout_leaves_the_query(module_broker, caplog, fail):
    topic = f"plan-gone-{fail}"
    by_position(module_broker, topic)
    now = publish_durably(module_broker, topic, bodies_for("g", 4))
    down = f"127.0.0.1:{free_port()}"  # nothing listens there
    r = reader(topic, module_broker.http_address, down, startingOffsets="earliest", broker_gone_timeout="5s",
               failOnDataLoss=fail)
    r.clock = clock = Clock()
    try:
        start = offsets_dict(topic, {**parse_offsets(topic, r.initialOffset()), down: ("00000000000000aa", 42)})
        end = r.latestOffset(start, r.getDefaultReadLimit())
        assert parse_offsets(topic, end)[down] == ("00000000000000aa", 42)  # down a while: it keeps its place
        clock.now += 6
        if fail == "true":
            with pytest.raises(DataLossError, match="has not answered for 5 s .broker_gone_timeout."):
                r.latestOffset(end, r.getDefaultReadLimit())
            return
        with caplog.at_level(logging.WARNING, logger="trio_nsq.spark"):
            later = r.latestOffset(end, r.getDefaultReadLimit())
        assert parse_offsets(topic, later) == {module_broker.http_address: (now["log_id"], now["end"])}
        assert any("broker_gone_timeout" in rec.message and rec.levelno == logging.WARNING for rec in caplog.records)
        # not asked again before another period: its client is not even made anew
        r.planner.close()
        r.latestOffset(later, r.getDefaultReadLimit())
        assert down not in r.planner.clients
    finally:
        r.stop()


def test_a_broker_back_after_broker_gone_timeout_joins_again_where_it_left(module_broker, broker):
    topic = "plan-back"
    for b in (module_broker, broker):
        by_position(b, topic)
    first = bodies_for("first", 4)
    publish_durably(broker, topic, first)
    r = reader(topic, module_broker.http_address, broker.http_address, startingOffsets="earliest",
               broker_gone_timeout="5s", failOnDataLoss="false")
    r.clock = clock = Clock()
    try:
        start = r.initialOffset()
        end = r.latestOffset(start, r.getDefaultReadLimit())
        assert planned(r, start, end) == first
        broker.stop()
        start = end
        end = r.latestOffset(start, r.getDefaultReadLimit())  # down: it keeps its place
        clock.now += 6
        end = r.latestOffset(end, r.getDefaultReadLimit())  # gone: it leaves the query
        assert list(end[topic]) == [module_broker.http_address]
        broker.restart()
        later = bodies_for("later", 3)
        publish_durably(broker, topic, later)
        clock.now += 6  # (asked again once per broker_gone_timeout)
        back = r.latestOffset(end, r.getDefaultReadLimit())
        after = r.latestOffset(back, r.getDefaultReadLimit())
        assert planned(r, end, back) + planned(r, back, after) == later  # the first four are not read again
    finally:
        r.stop()


# --- 5. a query's cursor is never a consumer's channel (the broker refuses; the query says why) --------


def test_a_channel_option_naming_a_consumers_channel_fails_the_query_with_what_to_do(module_broker):
    """The broker refuses /log/commit to a channel SUB or /channel/create made (CHANNEL_NOT_A_CURSOR):
    the query fails at its start, naming the channel and the way out, instead of reading on with a
    cursor that never moves."""
    import httpx

    topic = "plan-consumers"
    by_position(module_broker, topic)
    httpx.post(f"http://{module_broker.http_address}/channel/create?topic={topic}&channel=billing",
               timeout=30).raise_for_status()
    r = reader(topic, module_broker.http_address, channel="billing")
    try:
        with pytest.raises(RuntimeError, match=r"billing.*not a cursor.*adopt=true"):
            r.initialOffset()
    finally:
        r.stop()
