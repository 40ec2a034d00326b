"""NSQ -> Spark -> NSQ exactly once under crashes: the positional reader (trio_nsq/spark/positional.py) and
the writer keyed by its rows' positions (idempotency_key_column), with real kill -9s of Spark's driver,
of the source's Python process and of the broker, and the broker's retention against the query's cursor.

Each test reads the output topic back by position and compares multisets: every input message once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
from processes import REPO_ROOT, BrokerProcess
from test_spark_log import by_position, positions, publish_durably
from test_spark_source import channel_stats, eventually, source_runner_pids

from trio_nsq.spark.log_client import LogClient

pytestmark = pytest.mark.spark_log

EXAMPLE = REPO_ROOT / "examples" / "spark_exactly_once.py"


def message_count(broker: BrokerProcess, topic: str) -> int:
    """Messages the topic took since the broker started."""
    stats = broker.http.get(f"/stats?format=json&topic={topic}").json()
    return sum(t["message_count"] for t in stats["topics"] if t["topic_name"] == topic)


def topic_stats(broker: BrokerProcess, topic: str) -> dict:
    stats = broker.http.get(f"/stats?format=json&topic={topic}").json()
    return next(t for t in stats["topics"] if t["topic_name"] == topic)


def read_log(broker: BrokerProcess, topic: str) -> list[tuple[int, bytes]]:
    """Every record of the topic's log, (position, body), once the durable tail holds every record written
    (so a duplicate published last is read too)."""
    eventually(lambda: (s := topic_stats(broker, topic))["log_durable_position"] == s["log_end_position"],
               f"every record of {topic} durable in its log")
    out = []
    with LogClient(broker.http_address) as client:
        now = client.positions(topic)
        at = now.first
        while at < now.end:
            result = client.read(topic, at, now.end)
            body, size = result.body, result.records_bytes
            starts = [int.from_bytes(body[size + 4 * i:size + 4 * i + 4], "little") for i in range(result.records + 1)]
            out += [(result.position + a, body[a + 30:b]) for a, b in zip(starts, starts[1:])]
            at = result.next_position
    return out


def upper(bodies: list[bytes]) -> Counter:
    return Counter(b.decode().upper().encode() for b in bodies)


def batch_log(path: Path) -> dict[int, dict[int, set[tuple[str, int]]]]:
    """The example's test log: micro-batch id -> partition -> the (broker, position) of every row its task
    read (every attempt's)."""
    found: dict[int, dict[int, set[tuple[str, int]]]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            rows = found.setdefault(entry["batch"], {}).setdefault(entry["partition"], set())
            rows.add((entry["nsqd_address"], entry["position"]))
    return found


def planned_offsets(checkpoint: Path, batch: int) -> dict[str, int]:
    """The end offset Spark wrote for a micro-batch before running it: broker -> position."""
    source = json.loads((checkpoint / "offsets" / str(batch)).read_text().splitlines()[2])
    return {broker: cursor["position"] for broker, cursor in source["crash-in"].items()}


def batch_files(checkpoint: Path, kind: str) -> set[int]:
    """The micro-batches in the checkpoint's offsets/ (planned) or commits/ (done) log."""
    folder = checkpoint / kind
    return {int(name) for name in os.listdir(folder) if name.isdigit()} if folder.is_dir() else set()


# --- the driver killed: examples/spark_exactly_once.py in its own JVM ------------------------------------


def start_example(tmp_path: Path, brokers: list[BrokerProcess], run: str, *args: str, **env: str) -> subprocess.Popen:
    """The example as a user runs it, in a process group of its own (its JVM and Python workers with it),
    outside the repo. Every scratch file goes under tmp_path: Spark's (SPARK_LOCAL_DIRS), the JVM's (its
    native libraries, artifacts: java.io.tmpdir) and Python's, as a kill -9 leaves them behind."""
    scratch = {name: tmp_path / name for name in ("cwd", "spark-local", "java-tmp", "python-tmp")}
    for folder in scratch.values():
        folder.mkdir(exist_ok=True)
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    environ.update(SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
                   SPARK_LOCAL_DIRS=str(scratch["spark-local"]), TMPDIR=str(scratch["python-tmp"]),
                   JAVA_TOOL_OPTIONS=f"-Djava.io.tmpdir={scratch['java-tmp']}", PYTHONUNBUFFERED="1", **env)
    output = open(tmp_path / f"example-{run}.log", "wb")
    try:
        return subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--nsqd-http", ",".join(b.http_address for b in brokers),
             "--input", "crash-in", "--output", "crash-out", "--checkpoint", str(tmp_path / "checkpoint"),
             "--cursor", "crash-query", *args],
            cwd=scratch["cwd"], env=environ, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        output.close()


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


def test_the_driver_killed_mid_batch_and_restarted_from_its_checkpoint_publishes_each_message_once(
        broker_factory, tmp_path):
    brokers = [broker_factory(), broker_factory()]
    sent = [b"message %d" % i for i in range(600)]
    for n, broker in enumerate(brokers):
        by_position(broker, "crash-in")
        by_position(broker, "crash-out")  # (so that the output is in its log, to be read back by position)
        publish_durably(broker, "crash-in", sent[n::2])
    checkpoint = tmp_path / "checkpoint"
    first_log, second_log = tmp_path / "batches-1.jsonl", tmp_path / "batches-2.jsonl"

    def published() -> int:
        return sum(message_count(b, "crash-out") for b in brokers)

    # micro-batches of 100 records, 50 from each broker, two tasks; micro-batch 2's second task is held at
    # its first row (the example's test hook) long after the first task has published its 50, so the
    # micro-batch cannot commit: the driver is killed then
    options = ("--available-now", "--max-offsets-per-trigger", "100")
    proc = start_example(tmp_path, brokers, "1", *options, SPARK_EXACTLY_ONCE_BATCH_LOG=str(first_log),
                         SPARK_EXACTLY_ONCE_HOLD="2:120")
    try:
        def half_published():
            assert proc.poll() is None, (tmp_path / "example-1.log").read_text()[-3000:]
            return 2 in batch_log(first_log) and published() == 250

        eventually(half_published, "micro-batch 2 published in part", timeout=90)
    finally:
        kill_group(proc)
    uncommitted = 2
    assert uncommitted in batch_files(checkpoint, "offsets") and uncommitted not in batch_files(checkpoint, "commits")
    assert published() == 250

    # the same checkpoint, without the hold, to the end: Spark replays the uncommitted micro-batch first
    proc = start_example(tmp_path, brokers, "2", *options, SPARK_EXACTLY_ONCE_BATCH_LOG=str(second_log))
    try:
        assert proc.wait(120) == 0, (tmp_path / "example-2.log").read_text()[-3000:]
    finally:
        kill_group(proc)

    # the replayed micro-batch read what was planned for it before the kill: its range in the checkpoint
    first, second = batch_log(first_log), batch_log(second_log)
    assert min(second) == uncommitted
    start, end = planned_offsets(checkpoint, uncommitted - 1), planned_offsets(checkpoint, uncommitted)
    planned = {(b.http_address, p) for b in brokers for p, _ in read_log(b, "crash-in")
               if start[b.http_address] <= p < end[b.http_address]}
    replayed = set().union(*second[uncommitted].values())
    assert replayed == planned and len(planned) == 100
    # and the same rows in the same tasks as before the kill: the task that had finished (its 50 rows
    # published) and the first row the held task had read
    assert first[uncommitted][0] == second[uncommitted][0] and len(first[uncommitted][0]) == 50
    assert first[uncommitted][1] <= second[uncommitted][1] and len(first[uncommitted][1]) == 1
    assert set(first) == {0, 1, 2} and set(second) == {2, 3, 4, 5}
    # every record read: micro-batches 0 and 1 in the first run, 2 to 5 in the second
    runs = [first[0], first[1], *second.values()]
    read = set().union(*(rows for tasks in runs for rows in tasks.values()))
    assert read == {(b.http_address, p) for b in brokers for p, _ in read_log(b, "crash-in")}

    # every input message once in the output: what the replayed batch had published before the kill was
    # refused as duplicates (the same rows, the same request keys), the rest published
    out = [body for b in brokers for _, body in read_log(b, "crash-out")]
    assert Counter(out) == upper(sent)


# --- the source's Python process killed, in the shared session -------------------------------------------


def upper_stream(spark, broker: BrokerProcess, topic: str, channel: str, **options):
    """The example's transformation on the positional reader: the body upper-cased, its position kept."""
    reader = spark.readStream.format("nsq").option("mode", "log").option("topic", topic) \
        .option("nsqd_http_address", broker.http_address).option("channel", channel) \
        .option("startingOffsets", "earliest")
    for key, value in options.items():
        reader = reader.option(key, str(value))
    return reader.load().selectExpr("upper(CAST(value AS STRING)) AS value", "position")


@pytest.mark.parametrize("key_column, duplicates", [("position", 0), (None, 100)])
def test_the_source_killed_after_a_batch_reached_the_sink_replays_the_same_rows_and_loses_nothing(
        spark, broker_factory, tmp_path, key_column, duplicates):
    """foreachBatch publishes each micro-batch with a batch write (a new write id each time: only the rows'
    keys are the same on a replay). Micro-batch 2 reaches the sink and is published; then the source's
    Python process is killed and the sink fails, as when the driver dies there: Spark has not committed
    the micro-batch (its offsets are in the checkpoint, its commit is not), and replays it on restart."""
    broker = broker_factory()
    by_position(broker, "kill-in")
    by_position(broker, "kill-out")
    sent = [b"kill %d" % i for i in range(500)]
    publish_durably(broker, "kill-in", sent)
    checkpoint = tmp_path / "checkpoint"
    runs: list[list[tuple[int, list[int]]]] = [[], []]  # per run: (batch id, positions) of each micro-batch
    killed: list[int] = []

    def sink(df, batch_id):
        df.persist()  # (the positions and the write see the same rows; a read again would give them anyway)
        try:
            runs[len(killed)].append((batch_id, sorted(r.position for r in df.select("position").collect())))
            writer = df.write.format("nsq").option("topic", "kill-out").option("nsqd_http_address", broker.http_address)
            if key_column:
                writer = writer.option("idempotency_key_column", key_column)
            writer.mode("append").save()
        finally:
            df.unpersist()
        if batch_id == 2 and not killed:
            killed.extend(source_runner_pids(spark))
            for pid in killed:
                os.kill(pid, signal.SIGKILL)
            raise RuntimeError("killed between the sink and the commit")

    df = upper_stream(spark, broker, "kill-in", "kill-query", maxOffsetsPerTrigger=100)
    query = df.writeStream.foreachBatch(sink).option("checkpointLocation", str(checkpoint)).start()
    with pytest.raises(Exception, match="killed between the sink and the commit"):
        query.awaitTermination(120)
    assert len(killed) == 1 and [b for b, _ in runs[0]] == [0, 1, 2]
    assert (2 in batch_files(checkpoint, "offsets"), 2 in batch_files(checkpoint, "commits")) == (True, False)
    assert message_count(broker, "kill-out") == 300  # batch 2 was published

    query = df.writeStream.foreachBatch(sink).option("checkpointLocation", str(checkpoint)) \
        .trigger(availableNow=True).start()
    query.awaitTermination(120)
    assert query.exception() is None, query.exception()
    # the replay is micro-batch 2 with the same rows; every record was read, none twice
    assert runs[1][0] == runs[0][2] and len(runs[1][0][1]) == 100
    read = [p for _, positions in runs[0][:2] + runs[1] for p in positions]
    assert sorted(read) == [p for p, _ in read_log(broker, "kill-in")]
    # the output: every message once when the writer keys requests by position; with the default keys
    # (a new write id per batch write) the replayed micro-batch is published twice
    out = Counter(body for _, body in read_log(broker, "kill-out"))
    assert sum(out.values()) == 500 + duplicates and set(out) == set(upper(sent))
    assert sum(1 for n in out.values() if n > 1) == duplicates


def test_a_new_query_from_explicit_offsets_publishes_nothing_the_old_one_published(spark, broker_factory, tmp_path):
    """The same input rows in a new query (new checkpoint, new query id, batch ids from 0) send the same
    requests with the same keys: the broker refuses them all."""
    broker = broker_factory()
    by_position(broker, "again-in")
    by_position(broker, "again-out")
    sent = [b"again %d" % i for i in range(300)]
    publish_durably(broker, "again-in", sent)

    def run(name: str, **options):
        df = upper_stream(spark, broker, "again-in", f"again-{name}", maxOffsetsPerTrigger=100, **options)
        query = df.writeStream.format("nsq").option("topic", "again-out") \
            .option("nsqd_http_address", broker.http_address).option("idempotency_key_column", "position") \
            .option("checkpointLocation", str(tmp_path / name)).trigger(availableNow=True).start()
        query.awaitTermination(120)
        assert query.exception() is None, query.exception()
        return [p for p in query.recentProgress if p["numInputRows"]]

    progress = run("first")
    assert [p["numInputRows"] for p in progress] == [100, 100, 100]
    assert message_count(broker, "again-out") == 300
    # from the start again, and from the end of its first micro-batch (the offsets Spark reported)
    assert sum(p["numInputRows"] for p in run("second")) == 300
    after_first = progress[0]["sources"][0]["endOffset"]
    assert sum(p["numInputRows"] for p in run("third", startingOffsets=after_first)) == 200
    assert Counter(body for _, body in read_log(broker, "again-out")) == upper(sent)


# --- the broker killed under a running query -------------------------------------------------------------


def gate(folder: str):
    """A UDF (the position, unchanged) that holds micro-batch 1's second task while the file `armed` is in
    `folder`: it makes `held-<attempt>`, waits for `released`, then fails, on every attempt, so that the
    query fails with that micro-batch published in part (its first task's rows) and not committed."""

    def hold(position):
        import os
        import time

        from pyspark import TaskContext

        context = TaskContext.get()
        if context.partitionId() == 1 and context.getLocalProperty("streaming.sql.batchId") == "1" \
                and os.path.exists(os.path.join(folder, "armed")):
            open(os.path.join(folder, f"held-{context.attemptNumber()}"), "w").close()
            deadline = time.monotonic() + 90
            while not os.path.exists(os.path.join(folder, "released")) and time.monotonic() < deadline:
                time.sleep(0.05)
            raise RuntimeError("the held task fails after the broker's restart")
        return position

    return hold


def test_a_broker_killed_and_restarted_under_a_query_costs_no_message_and_publishes_none_twice(
        spark, broker_factory, tmp_path):
    from pyspark.sql.functions import col, udf

    # default flags: the output topic is read by position, so every message goes to its log, and the key
    # of each request is journalled with the log position its messages end at: a kill -9 keeps both
    broker = broker_factory()
    by_position(broker, "bk-in")
    by_position(broker, "bk-out")
    sent = [b"broker-kill %05d " % i + b"." * 1000 for i in range(600)]  # ~200 KiB per micro-batch of 200
    publish_durably(broker, "bk-in", sent)
    folder = tmp_path / "gate"
    folder.mkdir()
    (folder / "armed").touch()
    hold = udf(gate(str(folder)), "long", useArrow=False).asNondeterministic()

    def start():
        # two tasks per micro-batch (minPartitions cuts the broker's range in two at a record boundary)
        df = upper_stream(spark, broker, "bk-in", "bk-query", maxOffsetsPerTrigger=200, minPartitions=2) \
            .withColumn("position", hold(col("position")))
        return df.writeStream.format("nsq").option("topic", "bk-out").option("nsqd_http_address", broker.http_address) \
            .option("idempotency_key_column", "position").option("max_retries", "20") \
            .option("checkpointLocation", str(tmp_path / "checkpoint")).trigger(processingTime="200 milliseconds") \
            .start()

    # 1. micro-batch 1's first task has published its part, its second task is held: kill -9, restart
    query = start()
    try:
        eventually(lambda: (folder / "held-0").exists() and message_count(broker, "bk-out") > 200,
                   "micro-batch 1 published in part", query=query)
        published = message_count(broker, "bk-out")
        assert 200 < published < 400
        broker.kill()
        broker.start()
        (folder / "released").touch()
        with pytest.raises(Exception, match="the held task fails after the broker's restart"):
            query.awaitTermination(120)
    finally:
        query.stop()
    assert [(p["batchId"], p["numInputRows"]) for p in query.recentProgress if p["numInputRows"]][:1] == [(0, 200)]
    kept = read_log(broker, "bk-out")
    assert len(kept) == published  # every record the broker had answered for, kept across the kill -9

    # 2. the query restarted from its checkpoint replays micro-batch 1: its first task's rows again, the
    # same requests, refused (their keys were journalled before the kill); then reads on
    (folder / "armed").unlink()
    query = start()
    try:
        query.processAllAvailable()
        assert Counter(body for _, body in read_log(broker, "bk-out")) == upper(sent)
        # 3. killed again while the query polls it: its offsets stay until the broker answers, then on
        broker.kill()
        broker.start()
        more = [b"after the restart %d" % i for i in range(300)]
        publish_durably(broker, "bk-in", more)
        query.processAllAvailable()  # (the broker answers again by now: the next trigger finds them)
    finally:
        query.stop()
    assert query.exception() is None
    out = Counter(body for _, body in read_log(broker, "bk-out"))
    assert out == upper(sent + more)
    assert channel_stats(broker, "bk-in", "bk-query")["depth"] <= 200  # the cursor followed the commits


# --- retention against the query's cursor ------------------------------------------------------------------


def test_retention_keeps_what_the_query_has_not_committed_until_its_cursor_is_deleted(spark, broker_factory, tmp_path):
    from test_spark import consume

    # segments of 4 KiB (31 records of 100 bytes), and a log kept to 8 KiB beyond what channels need
    broker = broker_factory(max_bytes_per_file=4096, retention_bytes=8192)
    by_position(broker, "ret")
    assert broker.http.post("/channel/create?topic=ret&channel=count").status_code == 200  # the other consumer
    checkpoint = tmp_path / "checkpoint"
    got: list[bytes] = []
    release = threading.Event()

    def sink(df, _):
        got.extend(bytes(r.value) for r in df.collect())
        if got:
            release.wait(60)  # the first micro-batch waits in the sink (uncommitted) until the checks are done

    def reader(**options):
        df = spark.readStream.format("nsq").option("mode", "log").option("topic", "ret") \
            .option("nsqd_http_address", broker.http_address).option("channel", "ret-query") \
            .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", "50")
        for key, value in options.items():
            df = df.option(key, value)
        return df.load().writeStream.foreachBatch(sink).option("checkpointLocation", str(checkpoint))

    # 1. the query holds its first micro-batch in the sink while the other channel finishes everything
    first = [b"first %04d " % i + b"." * 89 for i in range(1000)]
    query = reader().trigger(processingTime="200 milliseconds").start()
    try:
        eventually(lambda: channel_stats(broker, "ret", "ret-query"), "the query's cursor", query=query)
        publish_durably(broker, "ret", first[:-1])
        eventually(lambda: got, "the first micro-batch in the sink", query=query)
        assert len(consume(broker, "ret", 999)) == 999
        eventually(lambda: (c := channel_stats(broker, "ret", "count"))["depth"] + c["in_flight_count"] == 0,
                   "the other channel done")
        # one record more, made durable by a sync round that comes after the other channel finished: that
        # round applied retention (8 KiB: ~63 records and the segment being written) with the cursor
        # still at the start
        publish_durably(broker, "ret", first[-1:])
        assert 0 < len(got) <= 50 and channel_stats(broker, "ret", "ret-query")["depth"] == 1000
        assert positions(broker, "ret")["first"] == 0 and topic_stats(broker, "ret")["log_messages"] == 1000
        assert len(consume(broker, "ret", 1)) == 1
        release.set()
        eventually(lambda: len(got) >= 1000, "every record in the query", query=query)
        query.processAllAvailable()
    finally:
        release.set()
        query.stop()
    assert got == first  # every record, in the log's order, none lost: failOnDataLoss=true did not fail it
    # what the query has committed goes: retention is at work
    eventually(lambda: positions(broker, "ret")["first"] > 0, "the first segments removed")

    # 2. the cursor deleted while the query is stopped; the other channel finishes what comes: retention
    # removes records the query never read
    committed = json.loads(query.lastProgress["sources"][0]["endOffset"])["ret"][broker.http_address]["position"]
    assert broker.http.post("/channel/delete?topic=ret&channel=ret-query").status_code == 200
    second = [b"second %04d " % i + b"." * 88 for i in range(1000)]
    publish_durably(broker, "ret", second)
    assert len(consume(broker, "ret", 1000)) == 1000
    kept = eventually(lambda: (p := positions(broker, "ret"))["first"] > committed and p, "records lost")
    lost = kept["first"]

    got.clear()
    query = reader().trigger(availableNow=True).start()
    with pytest.raises(Exception, match=rf"(?s)expected position {committed} to be kept, but the first record kept "
                                        rf"is at {lost}.*\.option\('failOnDataLoss', 'false'\)"):
        query.awaitTermination(120)
    assert got == []

    query = reader(failOnDataLoss="false").trigger(availableNow=True).start()
    query.awaitTermination(120)
    assert query.exception() is None, query.exception()
    # on from the first record kept: the end of the second thousand
    survivors = [body for _, body in read_log(broker, "ret")]
    assert got == survivors == second[-len(survivors):] and 0 < len(survivors) < 1000
