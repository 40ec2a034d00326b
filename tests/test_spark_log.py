"""The positional reader (trio_nsq/spark/positional.py): `spark.readStream` / `spark.read` of a topic's log by
position on trio-nsqd's /log API, as Spark reads Kafka. On the shared local SparkSession (tests/conftest.py
`spark`) and real broker processes; the pure parts (offsets, limits, options, rows) without Spark first.
"""

from __future__ import annotations

import datetime
import json
import time

import pytest
from processes import BrokerProcess, LookupdProcess
from test_spark_source import channel_stats, eventually, publish

from trio_nsq.spark.log_client import LogClient, ReadResult
from trio_nsq.spark.options import choose_source, log_settings
from trio_nsq.spark.positional import (
    LOG_SCHEMA,
    LogRange,
    NSQLogStreamReader,
    offsets_dict,
    offsets_json,
    parse_offsets,
    record_batch,
    share,
)

pytestmark = pytest.mark.spark_log


# --- the pure parts ---------------------------------------------------------------------------------


def test_offsets_are_json_with_sorted_keys_and_read_back_the_same():
    cursors = {"b:4151": ("00000000000000bb", 7), "a:4151": ("00000000000000aa", 123), "[::1]:4151": ("cc", 0)}
    offsets = offsets_dict("t", cursors)
    text = offsets_json(offsets)
    assert text == ('{"t": {"[::1]:4151": {"log_id": "cc", "position": 0}, "a:4151": {"log_id": "00000000000000aa", '
                    '"position": 123}, "b:4151": {"log_id": "00000000000000bb", "position": 7}}}')
    # as Spark hands it back: parsed from that string, and written again byte for byte the same
    assert parse_offsets("t", json.loads(text)) == cursors
    assert offsets_json(json.loads(text)) == text
    assert offsets_json(offsets_dict("t", dict(reversed(list(cursors.items()))))) == text  # any order in
    with pytest.raises(ValueError, match="another query"):
        parse_offsets("other", json.loads(text))


def test_a_limit_is_shared_over_the_brokers_by_their_backlog():
    # in proportion, by largest remainder: exactly the limit, never above a backlog
    assert share(100, {"a": 300, "b": 100}) == {"a": 75, "b": 25}
    assert share(10, {"a": 1, "b": 1, "c": 1}) == {"a": 1, "b": 1, "c": 1}  # all of it fits
    assert share(3, {"a": 5, "b": 5, "c": 5}) == {"a": 1, "b": 1, "c": 1}
    assert share(4, {"a": 5, "b": 5, "c": 5}) == {"a": 2, "b": 1, "c": 1}  # ties: sorted order
    shares = share(10, {f"b{i:02d}": 1 for i in range(11)})
    assert set(shares.values()) == {1}  # a share below 1 is rounded up, as Kafka's (none starves)
    assert share(7, {"a": 0, "b": 1000}) == {"a": 0, "b": 7}
    for limit in (1, 3, 999, 1000, 5000):
        backlogs = {"x": 17, "y": 900, "z": 83}
        shares = share(limit, backlogs)
        assert min(limit, 1000) <= sum(shares.values()) <= min(limit, 1000) + len(backlogs)
        assert all(1 <= shares[b] <= backlogs[b] for b in backlogs)
        assert shares == share(limit, dict(reversed(list(backlogs.items()))))  # the same whatever the order


def test_options_are_checked_with_messages_that_say_what_to_change():
    base = {"topic": "t", "nsqd_http_address": "127.0.0.1:4151"}
    assert log_settings(base, batch=False).channel is None  # (a stream needs no cursor, as with Kafka)
    with pytest.raises(ValueError, match="takes no channel"):
        log_settings({**base, "channel": "c"}, batch=True)
    with pytest.raises(ValueError, match="did you mean 'maxOffsetsPerTrigger'"):
        log_settings({**base, "channel": "c", "maxoffsetpertrigger": "5"}, batch=False)
    with pytest.raises(ValueError, match="'max_in_flight' .the channel source's: set mode=channel"):
        log_settings({**base, "channel": "c", "max_in_flight": "5"}, batch=False)
    with pytest.raises(ValueError, match="endingOffsets is for spark.read only"):
        log_settings({**base, "channel": "c", "endingoffsets": "latest"}, batch=False)
    with pytest.raises(ValueError, match="maxOffsetsPerTrigger is for streams"):
        log_settings({**base, "maxoffsetspertrigger": "5"}, batch=True)
    with pytest.raises(ValueError, match="startingOffsets=latest is refused"):
        log_settings({**base, "startingoffsets": "latest"}, batch=True)
    with pytest.raises(ValueError, match="maxOffsetsPerTrigger='0' must be an integer >= 1"):
        log_settings({**base, "channel": "c", "maxoffsetspertrigger": "0"}, batch=False)
    with pytest.raises(ValueError, match="failOnDataLoss='maybe' must be true or false"):
        log_settings({**base, "channel": "c", "failondataloss": "maybe"}, batch=False)
    with pytest.raises(ValueError, match="must name the topic 't' alone"):
        log_settings({**base, "startingoffsets": '{"u": {"127.0.0.1:4151": 0}}'}, batch=True)
    with pytest.raises(ValueError, match="needs a position"):
        log_settings({**base, "startingoffsets": '{"t": {"127.0.0.1:4151": "zero"}}'}, batch=True)
    with pytest.raises(ValueError, match="no broker"):
        log_settings({"topic": "t", "channel": "c"}, batch=False)
    with pytest.raises(ValueError, match="#ephemeral"):
        log_settings({**base, "topic": "t#ephemeral"}, batch=True)

    # Spark hands the keys lower-cased; addresses come out normalised (the offsets' broker keys)
    s = log_settings({**base, "nsqd_http_address": "http://127.0.0.1:4151/, localhost", "channel": "q1",
                      "startingoffsets": '{"t": {"127.0.0.1:4151": {"log_id": "ab", "position": 30}, '
                                         '"localhost:4151": -2}}',
                      "maxoffsetspertrigger": "100", "failondataloss": "false"}, batch=False)
    assert (s.addresses, s.channel, s.starting, s.max_records, s.fail_on_data_loss) == (
        ("127.0.0.1:4151", "localhost:4151"), "q1", "json", 100, False)
    assert s.starting_positions == {"127.0.0.1:4151": ("ab", 30), "localhost:4151": (None, -2)}
    assert log_settings(base, batch=True).starting == "earliest"
    assert log_settings({**base, "channel": "c"}, batch=False).starting == "latest"  # as Kafka's defaults


def test_the_source_is_chosen_by_the_options_before_any_broker_is_asked():
    # the channel source's options keep their meaning (a query written for it reads as it did)
    assert choose_source({"topic": "t", "channel": "c", "nsqd_tcp_address": "h:4150"})[0] == "channel"
    assert choose_source({"topic": "t", "channel": "c", "lookupd_http_address": "h:4161"})[0] == "channel"
    assert choose_source({"topic": "t", "channel": "c", "max_in_flight": "9", "nsqd_http_address": "h"})[0] == "channel"
    assert choose_source({"topic": "t#ephemeral", "nsqd_http_address": "h"}) == (
        "channel", "topic 't#ephemeral' is #ephemeral: it keeps no log")
    assert choose_source({"topic": "t", "mode": "LOG", "nsqd_tcp_address": "h:4150"})[0] == "log"
    with pytest.raises(ValueError, match="mode='kafka' must be auto, log or channel"):
        choose_source({"topic": "t", "mode": "kafka"})


def log_body(bodies: list[bytes], stamps: list[int], deadlines: dict[int, int]) -> tuple[bytes, int]:
    """A /log/read body as the broker sends it (the records, their starts, the deferred ones' position and
    deadline), and the records' size."""
    import struct

    records, starts = b"", [0]
    for i, (body, stamp) in enumerate(zip(bodies, stamps)):
        records += struct.pack(">iqH16s", 26 + len(body), stamp, 1, b"%016x" % i) + body
        starts.append(len(records))
    trailer = struct.pack(f"<{len(starts)}i", *starts)
    for position, ms in sorted(deadlines.items()):
        trailer += struct.pack("<qq", position, ms)
    return records + trailer, len(records)


def test_a_read_becomes_one_record_batch_cut_column_wise_with_positions_and_deadlines():
    bodies = [b"", b"x", b"\x00\xff\n" * 100] + [b"b-%d" % i for i in range(997)]
    stamps = [1_795_000_000_123_456_789 + i * 1000 for i in range(1000)]
    starts = [0]
    for body in bodies:
        starts.append(starts[-1] + 30 + len(body))
    base = 1 << 40  # a position past 32 bits
    # the second and the last record were deferred (the trailer names them by position)
    deadlines = {base + starts[1]: 1_795_000_060_000, base + starts[999]: 1_795_000_099_999}
    data, size = log_body(bodies, stamps, deadlines)
    result = ReadResult("ab", base, base + size, 5, 1000, size, 2, base + size, data)
    result.check("here")
    batch = record_batch("t", "127.0.0.1:4151", result)
    rows = batch.to_pylist()
    assert [r["value"] for r in rows] == bodies
    assert [r["position"] for r in rows] == [base + s for s in starts[:-1]]
    assert [r["id"] for r in rows] == ["%016x" % i for i in range(1000)]
    second = datetime.datetime.fromtimestamp(1_795_000_000, datetime.timezone.utc)
    assert [r["timestamp"] for r in rows[:2]] == [second + datetime.timedelta(microseconds=123456 + i) for i in (0, 1)]
    assert {(r["topic"], r["nsqd_address"]) for r in rows} == {("t", "127.0.0.1:4151")}
    assert rows[1]["deadline"] == second + datetime.timedelta(seconds=60)
    assert rows[999]["deadline"] == second + datetime.timedelta(seconds=99, milliseconds=999)
    assert [r["deadline"] for i, r in enumerate(rows) if i not in (1, 999)] == [None] * 998
    assert [f.name for f in LOG_SCHEMA.fields] == list(rows[0]) == batch.schema.names
    with pytest.raises(ConnectionError, match="a body of"):  # a cut answer never becomes rows
        ReadResult("ab", 0, 0, 0, 1000, size, 2, 0, data[:-1]).check("here")


# --- with brokers and Spark -------------------------------------------------------------------------


def by_position(broker: BrokerProcess, topic: str) -> None:
    """Make the topic and have it read by position: from then on every message is written to its log (one
    that went through memory before the first /log request is not in it)."""
    assert broker.http.post(f"/topic/create?topic={topic}").status_code == 200
    assert broker.http.get(f"/log/positions?topic={topic}").status_code == 200


def positions(broker: BrokerProcess, topic: str) -> dict:
    return broker.http.get(f"/log/positions?topic={topic}").json()


def publish_durably(broker: BrokerProcess, topic: str, bodies: list[bytes]) -> dict:
    """Publish, and wait until the log's durable tail holds them (nothing past it is ever read)."""
    before = positions(broker, topic)["end_index"]
    publish(broker, topic, bodies)
    return eventually(lambda: (p := positions(broker, topic))["end_index"] >= before + len(bodies) and p,
                      f"{len(bodies)} records durable in {topic}")


def stream(spark, broker: BrokerProcess | None, topic: str, **options):
    reader = spark.readStream.format("nsq").option("topic", topic)
    if broker is not None:
        reader = reader.option("nsqd_http_address", broker.http_address)
    for key, value in options.items():
        reader = reader.option(key, str(value))
    return reader.load()


def run_available_now(df, checkpoint, sink=None) -> tuple[list, list[dict]]:
    """Run the stream with Trigger.AvailableNow to its end: (the rows of every micro-batch, in order; the
    progress of the micro-batches that had rows). `sink(rows, batch_id)` sees each micro-batch too."""
    got: list = []

    def collect(batch, batch_id):
        rows = batch.collect()
        got.extend(rows)
        if sink is not None:
            sink(rows, batch_id)

    query = df.writeStream.foreachBatch(collect).option("checkpointLocation", str(checkpoint)) \
        .trigger(availableNow=True).start()
    query.awaitTermination(180)
    assert not query.isActive and query.exception() is None, query.exception()
    return got, [p for p in query.recentProgress if p["numInputRows"]]


def bodies_for(prefix: str, n: int, size: int = 0) -> list[bytes]:
    return [(b"%s-%05d\n\x00\xff" % (prefix.encode(), i)).ljust(size, b".") for i in range(n)]


def test_a_stream_starts_at_earliest_latest_a_timestamp_or_json_offsets(spark, module_broker, tmp_path):
    topic = "log-start"
    by_position(module_broker, topic)
    first = bodies_for("a", 1000)
    publish_durably(module_broker, topic, first)
    time.sleep(0.002)  # (a millisecond between the two publishes: the timestamp falls between them)
    since = int(time.time() * 1000)
    time.sleep(0.002)
    second = bodies_for("b", 500)
    publish_durably(module_broker, topic, second)

    df = stream(spark, module_broker, topic, channel="q-earliest", startingOffsets="earliest")
    rows, _ = run_available_now(df, tmp_path / "earliest")
    assert [bytes(r.value) for r in rows] == first + second  # one broker: in the log's order
    assert {(r.topic, r.nsqd_address, r.deadline) for r in rows} == {(topic, module_broker.http_address, None)}
    assert len({r.id for r in rows}) == 1500 and sorted(r.position for r in rows) == [r.position for r in rows]

    df = stream(spark, module_broker, topic, channel="q-time", startingTimestamp=since, startingOffsets="earliest")
    rows, _ = run_available_now(df, tmp_path / "time")  # the timestamp wins
    assert [bytes(r.value) for r in rows] == second

    # JSON offsets: from the 300th record on (positions come from the `position` column)
    p300 = module_broker.http.get(f"/log/position?topic={topic}&from={positions(module_broker, topic)['first']}"
                                  f"&records=300").json()
    start = {topic: {module_broker.http_address: {"log_id": p300["log_id"], "position": p300["position"]}}}
    df = stream(spark, module_broker, topic, channel="q-json", startingOffsets=json.dumps(start))
    rows, _ = run_available_now(df, tmp_path / "json")
    assert [bytes(r.value) for r in rows] == first[300:] + second and rows[0].position == p300["position"]

    # latest: what is published once the query has started, and nothing from before
    got: list = []
    query = stream(spark, module_broker, topic, channel="q-latest").writeStream \
        .foreachBatch(lambda df, _: got.extend(bytes(r.value) for r in df.collect())) \
        .option("checkpointLocation", str(tmp_path / "latest")).trigger(processingTime="100 milliseconds").start()
    try:
        eventually(lambda: query.lastProgress is not None, "the query's first trigger", query=query)
        third = bodies_for("c", 200)
        publish_durably(module_broker, topic, third)
        query.processAllAvailable()
        assert got == third
    finally:
        query.stop()


def test_a_batch_read_between_two_offsets_gives_exactly_those_records_every_time(spark, module_broker):
    topic = "log-range"
    by_position(module_broker, topic)
    sent = bodies_for("r", 2000)
    publish_durably(module_broker, topic, sent)

    def read(**options):
        reader = spark.read.format("nsq").option("topic", topic).option("nsqd_http_address", module_broker.http_address)
        for key, value in options.items():
            reader = reader.option(key, str(value))
        return reader.load()

    everything = read().collect()  # earliest to latest by default
    assert [bytes(r.value) for r in everything] == sent
    log_id = positions(module_broker, topic)["log_id"]
    start, end = everything[500].position, everything[1500].position

    def at(position):
        return json.dumps({topic: {module_broker.http_address: {"log_id": log_id, "position": position}}})

    df = read(startingOffsets=at(start), endingOffsets=at(end))
    once, twice = df.collect(), df.collect()
    assert [bytes(r.value) for r in once] == sent[500:1500]
    assert once == twice  # the same rows, ids, positions and timestamps
    assert [r.position for r in once] == [r.position for r in everything[500:1500]]


def test_micro_batches_keep_to_max_offsets_and_max_bytes_per_trigger_and_the_cursor_follows_commits(
        spark, module_broker, tmp_path):
    topic = "log-limits"
    by_position(module_broker, topic)
    sent = bodies_for("m", 3000, size=70)  # 100 bytes a record in the log: [size][ts][attempts][id] + 70
    publish_durably(module_broker, topic, sent)

    df = stream(spark, module_broker, topic, channel="q-rows", startingOffsets="earliest", maxOffsetsPerTrigger=700)
    rows, progress = run_available_now(df, tmp_path / "rows")
    counts = [p["numInputRows"] for p in progress]
    assert [bytes(r.value) for r in rows] == sent and max(counts) == 700 and sum(counts) == 3000
    # Spark commits a micro-batch to its source when it plans the next one: the cursor is at the end of the
    # second-to-last batch, and the channel's depth is what lies after it
    depth = channel_stats(module_broker, topic, "q-rows")["depth"]
    assert depth == counts[-1] == 3000 - sum(counts[:-1])
    committed = json.loads(progress[-2]["sources"][0]["endOffset"])
    cursor = committed[topic][module_broker.http_address]["position"]
    assert rows[sum(counts[:-1])].position == cursor

    df = stream(spark, module_broker, topic, channel="q-bytes", startingOffsets="earliest", maxBytesPerTrigger=25_000)
    rows, progress = run_available_now(df, tmp_path / "bytes")
    counts = [p["numInputRows"] for p in progress]
    assert [bytes(r.value) for r in rows] == sent and max(counts) == 250 and sum(counts) == 3000


def test_trigger_available_now_stops_at_what_was_there_when_it_started(spark, module_broker, tmp_path):
    topic = "log-now"
    by_position(module_broker, topic)
    sent = bodies_for("n", 2000)
    publish_durably(module_broker, topic, sent)
    late = bodies_for("late", 1000)

    def publish_more(rows, batch_id):
        if batch_id == 0:  # the target is fixed by now: these come after it
            publish_durably(module_broker, topic, late)

    df = stream(spark, module_broker, topic, channel="q-now", startingOffsets="earliest", maxOffsetsPerTrigger=500)
    rows, _ = run_available_now(df, tmp_path / "now", sink=publish_more)
    assert [bytes(r.value) for r in rows] == sent
    assert positions(module_broker, topic)["end_index"] - positions(module_broker, topic)["first_index"] == 3000
    # the same query again reads on from there
    rows, _ = run_available_now(stream(spark, module_broker, topic, channel="q-now"), tmp_path / "now")
    assert [bytes(r.value) for r in rows] == late


def test_min_partitions_cuts_one_broker_s_range_into_that_many_tasks_with_the_same_rows(spark, module_broker):
    topic = "log-parts"
    by_position(module_broker, topic)
    sent = bodies_for("p", 4000, size=100)  # 520 KB of records: cuts fall every ~64 KiB at best
    publish_durably(module_broker, topic, sent)
    reader = spark.read.format("nsq").option("topic", topic).option("nsqd_http_address", module_broker.http_address)
    whole = reader.load()
    cut = reader.option("minPartitions", "4").load()
    assert (whole.rdd.getNumPartitions(), cut.rdd.getNumPartitions()) == (1, 4)
    assert cut.collect() == whole.collect()
    assert [bytes(r.value) for r in whole.collect()] == sent


def test_a_replaced_log_fails_the_query_unless_fail_on_data_loss_is_false(spark, module_broker, tmp_path):
    topic = "log-replaced"
    by_position(module_broker, topic)
    publish_durably(module_broker, topic, bodies_for("old", 500))
    checkpoint = tmp_path / "checkpoint"
    df = stream(spark, module_broker, topic, channel="q-loss", startingOffsets="earliest")
    rows, _ = run_available_now(df, checkpoint)
    assert len(rows) == 500
    old_id = positions(module_broker, topic)["log_id"]
    assert module_broker.http.post(f"/topic/delete?topic={topic}").status_code == 200
    by_position(module_broker, topic)
    new = bodies_for("new", 300)
    publish_durably(module_broker, topic, new)
    new_id = positions(module_broker, topic)["log_id"]
    assert new_id != old_id

    query = stream(spark, module_broker, topic, channel="q-loss").writeStream.foreachBatch(lambda df, _: None) \
        .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start()
    with pytest.raises(Exception, match=f"(?s)expected log {old_id}.*now {new_id}.*failOnDataLoss', 'false'"):
        query.awaitTermination(180)

    df = stream(spark, module_broker, topic, channel="q-loss", failOnDataLoss="false")
    rows, _ = run_available_now(df, checkpoint)
    assert [bytes(r.value) for r in rows] == new  # from the new log's earliest record


def test_two_brokers_found_through_lookupd_are_read_each_from_its_own_log(spark, tmp_path):
    from test_lookupd_discovery import eventually as soon

    lookupd = LookupdProcess(tmp_path).start()
    brokers: list[BrokerProcess] = []
    try:
        for _ in range(2):
            brokers.append(BrokerProcess(tmp_path, lookupd_tcp_address=lookupd.tcp_address,
                                         broadcast_address="127.0.0.1").start())
        sent = bodies_for("w", 3000)
        for n, broker in enumerate(brokers):
            by_position(broker, "log-wide")
            publish_durably(broker, "log-wide", sent[n::2])
        soon(lambda: len(lookupd.get("/lookup?topic=log-wide").json()["producers"]) == 2)

        df = stream(spark, None, "log-wide", lookupd_http_address=lookupd.http_address, channel="q-wide",
                    startingOffsets="earliest", maxOffsetsPerTrigger=1000)
        rows, progress = run_available_now(df, tmp_path / "checkpoint")
        assert sorted(bytes(r.value) for r in rows) == sorted(sent)
        for n, broker in enumerate(brokers):  # each broker's records in its log's order
            assert [bytes(r.value) for r in rows if r.nsqd_address == broker.http_address] == sent[n::2]
        # the limit was shared over the two by their backlog (1500 each): 500 + 500 per micro-batch
        assert [p["numInputRows"] for p in progress] == [1000, 1000, 1000]
        end = json.loads(progress[-1]["sources"][0]["endOffset"])
        assert list(end["log-wide"]) == sorted(b.http_address for b in brokers)

        batch = spark.read.format("nsq").option("topic", "log-wide") \
            .option("lookupd_http_address", lookupd.http_address).option("mode", "log").load()
        assert batch.rdd.getNumPartitions() == 2 and batch.count() == 3000
    finally:
        for b in brokers:
            b.stop()
        lookupd.stop()


def test_a_deferred_record_is_delivered_at_once_with_its_deadline(spark, module_broker):
    topic = "log-deferred"
    by_position(module_broker, topic)
    publish_durably(module_broker, topic, [b"before"])  # (the deferred record is not the log's first)
    before = datetime.datetime.now(datetime.timezone.utc)
    assert module_broker.http.post(f"/pub?topic={topic}&defer=60000", content=b"later").status_code == 200
    publish_durably(module_broker, topic, [b"now"])
    rows = spark.read.format("nsq").option("topic", topic).option("nsqd_http_address", module_broker.http_address) \
        .load().collect()
    assert [bytes(r.value) for r in rows] == [b"before", b"later", b"now"]
    deadline = rows[1].deadline.astimezone(datetime.timezone.utc) if rows[1].deadline.tzinfo else \
        rows[1].deadline.replace(tzinfo=datetime.datetime.now().astimezone().tzinfo)
    due = before + datetime.timedelta(seconds=60)
    assert due - datetime.timedelta(seconds=5) <= deadline <= due + datetime.timedelta(seconds=5)
    assert (rows[0].deadline, rows[2].deadline) == (None, None)


def test_mode_auto_reads_by_position_when_the_options_and_the_broker_say_so(spark, module_broker, tmp_path):
    def columns(**options):
        reader = spark.readStream.format("nsq").option("topic", "log-auto")
        for key, value in options.items():
            reader = reader.option(key, value)
        return reader.load().columns

    # trio-nsqd with the /log API (the topic need not exist yet)
    assert "position" in columns(channel="c", nsqd_http_address=module_broker.http_address)
    # the channel source's options keep their meaning
    assert "position" not in columns(channel="c", nsqd_tcp_address=module_broker.tcp_address)
    assert "attempts" in columns(channel="c", nsqd_http_address=module_broker.http_address, mode="channel")


def test_the_reader_moves_its_cursor_back_to_the_checkpoint_when_a_query_restarts(module_broker):
    """Without Spark: a reader handed a start it did not make (a restart from a checkpoint) sets the cursor
    there before anything else."""
    topic = "log-cursor"
    by_position(module_broker, topic)
    publish_durably(module_broker, topic, bodies_for("c", 100))
    now = positions(module_broker, topic)
    settings = log_settings({"topic": topic, "channel": "q", "nsqd_http_address": module_broker.http_address,
                             "startingoffsets": "earliest"}, batch=False)
    reader = NSQLogStreamReader(settings)
    try:
        start = reader.initialOffset()
        assert start == offsets_dict(topic, {module_broker.http_address: (now["log_id"], now["first"])})
        assert channel_stats(module_broker, topic, "q")["depth"] == 100
        end = reader.latestOffset(start, reader.getDefaultReadLimit())
        assert end == offsets_dict(topic, {module_broker.http_address: (now["log_id"], now["end"])})
        reader.commit(end)
        assert channel_stats(module_broker, topic, "q")["depth"] == 0
        parts = reader.partitions(start, end)
        assert parts == [LogRange(module_broker.http_address, topic, now["log_id"], now["first"], now["end"])]
        assert sum(b.num_rows for b in reader.read(parts[0])) == 100
    finally:
        reader.stop()
    again = NSQLogStreamReader(settings)  # a new run, from the checkpoint's start
    try:
        assert again.partitions(start, end) == parts
        assert channel_stats(module_broker, topic, "q")["depth"] == 100
    finally:
        again.stop()
    with LogClient(module_broker.http_address) as client:  # (the cursor is a channel of the topic)
        assert client.positions(topic).end == now["end"]


def test_a_broker_that_does_not_answer_keeps_its_offset_and_is_no_loss_of_data(module_broker, caplog):
    """Without Spark: a broker down (for a restart, say) holds its place; the others go on."""
    from processes import free_port

    topic = "log-down"
    by_position(module_broker, topic)
    now = publish_durably(module_broker, topic, bodies_for("d", 10))
    down = f"127.0.0.1:{free_port()}"  # nothing listens there
    reader = NSQLogStreamReader(log_settings({"topic": topic, "channel": "q", "startingoffsets": "earliest",
                                              "nsqd_http_address": f"{module_broker.http_address},{down}"},
                                             batch=False))
    try:
        start = reader.initialOffset()
        assert start[topic][down] == {"log_id": None, "position": None}  # (it joins at the start asked for)
        start = offsets_dict(topic, {**parse_offsets(topic, start), down: ("00000000000000aa", 4242)})
        for _ in range(2):
            end = reader.latestOffset(start, reader.getDefaultReadLimit())
            assert parse_offsets(topic, end) == {module_broker.http_address: (now["log_id"], now["end"]),
                                                 down: ("00000000000000aa", 4242)}
        assert [r.message for r in caplog.records].count(
            next(r.message for r in caplog.records if "does not answer" in r.message)) == 1  # once
        parts = reader.partitions(start, end)
        assert [p.address for p in parts] == [module_broker.http_address]
    finally:
        reader.stop()


def test_the_reader_and_the_writer_keep_their_connection_alike_and_reopen_one_the_server_closed():
    """Without Spark: LogClient (the reader's) and MPubClient (the writer's) keep one HTTP/1.1 connection
    through the same class; a kept connection the server closed after its answer (no `Connection: close`
    said) is opened again at no cost: no retry, no backoff, every request answered once."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from trio_nsq.spark.publisher import KeptConnection, MPubClient

    seen: list[tuple[str, str]] = []

    class ClosesAfterEachAnswer(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, payload) -> None:
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True  # closed without saying so: the client finds out on its next request

        def do_GET(self):
            seen.append(("GET", self.path))
            self._answer(5_000_000 if self.path.startswith("/config/") else {"log_id": "a", "position": 0,
                                                                               "index": 0})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(("POST", self.path))
            self._answer("OK")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), ClosesAfterEachAnswer)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    sleeps: list[float] = []
    try:
        with LogClient(address, max_retries=0, sleep=sleeps.append) as reader:
            assert isinstance(reader, KeptConnection)
            for _ in range(3):
                assert reader.position_after("t", 0).position == 0
        with MPubClient([address], max_retries=0, sleep=sleeps.append) as writer:
            assert isinstance(writer, KeptConnection)
            for _ in range(3):
                writer.publish("t", [b"x"])
            assert (writer.requests, writer.retries, writer.messages) == (3, 0, 3)
    finally:
        server.shutdown()
        server.server_close()
    assert sleeps == []
    assert seen[:3] == [("GET", "/log/position?topic=t&from=0")] * 3
    assert [path for method, path in seen if method == "POST"] == ["/mpub?topic=t&binary=true"] * 3


def test_mode_auto_falls_back_to_the_channel_source_on_a_broker_without_the_log_api():
    """Without Spark: a broker answering as Go nsqd does (404 NOT_FOUND for /log/*, its TCP port in /info)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from trio_nsq.spark.options import channel_options

    class GoNsqd(BaseHTTPRequestHandler):
        def do_GET(self):
            found = self.path.startswith("/info")
            body = json.dumps({"version": "1.3.0", "tcp_port": 4150} if found else {"message": "NOT_FOUND"})
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), GoNsqd)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        options = {"topic": "t", "channel": "c", "nsqd_http_address": address}
        assert choose_source(options) == ("channel", f"broker {address} has no /log API (GET /log/positions "
                                                     "answered 404 NOT_FOUND): Go nsqd, or a trio-nsqd without it")
        # the channel source is given the broker's TCP address, from its /info
        assert channel_options({**options, "mode": "auto"}) == {"topic": "t", "channel": "c",
                                                                "nsqd_tcp_address": "127.0.0.1:4150"}
        with pytest.raises(ValueError, match="startingOffsets is the positional reader's, and this read consumes"):
            channel_options({**options, "startingOffsets": "earliest"})
    finally:
        server.shutdown()
        server.server_close()
