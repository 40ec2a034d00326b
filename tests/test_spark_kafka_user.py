"""The positional Spark source (trio_nsq/spark/positional.py) as a Kafka user runs it (issue 49): a query
started at `latest` while a publisher runs reads every message after its first offset; a query with
Kafka's options only, in its own process, killed with SIGKILL and started again on its checkpoint,
writes each message once; a task's read of a broker that restarts behind, or lost records, waits a
bounded time and then reports data loss as failOnDataLoss says. (The connector's first example runs as
written by tests/test_docs_snippets.py, with every other block of the docs.)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from processes import REPO_ROOT, BrokerProcess
from test_spark_log import by_position, positions, publish_durably
from test_spark_log_crash import kill_group
from test_spark_source import eventually

from trio_nsq.spark import positional
from trio_nsq.spark.log_client import LogClient
from trio_nsq.spark.options import log_settings
from trio_nsq.spark.positional import DataLossError, LogRange, read_range

pytestmark = pytest.mark.spark_log


# --- item 1: no gap at the start --------------------------------------------------------------------


class CommitDelayingProxy:
    """A TCP relay to a broker's HTTP port that holds each `POST /log/commit` for `delay` seconds before
    passing it on. The positional reader commits its cursor inside initialOffset: with the relay the log's
    end has moved (a publisher runs) by the time Spark asks latestOffset, so micro-batch 0 is planned with
    records, whatever the machine's speed. Used as a context manager; `address` is where to reach it."""

    def __init__(self, target: str, delay: float) -> None:
        self.target, self.delay = target, delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = [self.listener]

    def __enter__(self) -> CommitDelayingProxy:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sock in self.sockets:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            host, port = self.target.rsplit(":", 1)
            server = socket.create_connection((host, int(port)))
            self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, requests: bool) -> None:
        try:
            while data := source.recv(65536):
                if requests and data.startswith(b"POST /log/commit"):
                    time.sleep(self.delay)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


class SteadyPublisher(threading.Thread):
    """Publishes numbered messages ("0", "1", ...) to a topic, `per_tick` every `tick` seconds, until
    stopped; `sent` is how many it has published."""

    def __init__(self, broker: BrokerProcess, topic: str, per_tick: int = 30, tick: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.broker, self.topic, self.per_tick, self.tick = broker, topic, per_tick, tick
        self.sent = 0
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.broker.http_url, timeout=10.0) as http:
                while not self.halt.is_set():
                    bodies = b"\n".join(b"%d" % n for n in range(self.sent, self.sent + self.per_tick))
                    http.post(f"/mpub?topic={self.topic}", content=bodies).raise_for_status()
                    self.sent += self.per_tick
                    self.halt.wait(self.tick)
        except BaseException as exc:  # (seen by the test: a publisher that stopped early fails it)
            self.error = exc

    def stop(self) -> int:
        self.halt.set()
        self.join(30)
        assert self.error is None, self.error
        return self.sent


def test_a_query_started_at_latest_while_a_publisher_runs_reads_every_message_after_its_first_offset(
        spark, broker_factory, tmp_path):
    """startingOffsets latest (the default): Spark asks initialOffset when it plans micro-batch 0 and again
    when it runs it. Every message from the query's first offset on is read once, with no gap: micro-batch
    0 reads from where the query started, not from where the second call found the log's end."""
    # The durable tail moves with every message (--sync-every=1, ~300 a second), and Spark reaches the broker
    # through a relay that holds the cursor's commits 0.5 s: the log's end moves between Spark's
    # initialOffset and its first latestOffset, so micro-batch 0 is planned with records, [T1, E) with E > T1.
    broker = broker_factory(sync_every=1)
    topic = "steady"
    by_position(broker, topic)
    publisher = SteadyPublisher(broker, topic, per_tick=1, tick=0.003)
    publisher.start()
    batches: list[tuple[int, list[tuple[int, int]]]] = []  # (batch id, [(position, number)])

    def sink(df, batch_id):
        rows = df.selectExpr("position", "CAST(value AS STRING) AS value").collect()
        batches.append((batch_id, sorted((r.position, int(r.value)) for r in rows)))

    checkpoint = tmp_path / "checkpoint"
    query = None
    relay = CommitDelayingProxy(broker.http_address, 0.5).__enter__()
    try:
        eventually(lambda: positions(broker, topic)["end_index"] >= 300, "the publisher under way")
        df = spark.readStream.format("nsq").option("topic", topic) \
            .option("nsqd_http_address", relay.address).option("channel", "steady-query").load()
        query = df.writeStream.foreachBatch(sink).option("checkpointLocation", str(checkpoint)).start()
        eventually(lambda: sum(bool(rows) for _, rows in batches) >= 3, "three micro-batches with rows", query=query)
        sent = publisher.stop()
        eventually(lambda: positions(broker, topic)["end_index"] == sent, "every message durable")
        eventually(lambda: any(rows and rows[-1][1] == sent - 1 for _, rows in batches),
                   "the last message read", query=query)
    finally:
        publisher.stop()
        if query is not None:
            query.stop()
        relay.__exit__(None, None, None)

    assert [b for b, _ in batches] == list(range(len(batches)))
    numbers = [n for _, rows in batches for _, n in rows]
    assert numbers and numbers == list(range(numbers[0], sent)), "a message after the query's first was not read"
    # micro-batch 0 ran the range it was planned with: from the query's first offset to the end Spark wrote
    # in the checkpoint for it (planned [T1, E), it read nothing when run from a second initialOffset >= E)
    end_of_first = json.loads((checkpoint / "offsets" / "0").read_text().splitlines()[2])
    end_of_first = end_of_first[topic][relay.address]["position"]
    first_rows = batches[0][1]
    assert first_rows, f"micro-batch 0 read nothing: every message before {end_of_first} was skipped"
    later = [rows for _, rows in batches[1:] if rows]
    assert first_rows[-1][0] < end_of_first <= later[0][0][0]
    # and the first row is the first record at or after the query's start: none is missing before it
    # (the query started at latest after 300 were durable)
    assert numbers[0] >= 300


# --- item 2: a Kafka user's query, killed and started again -----------------------------------------

KAFKA_USER_QUERY = '''
import sys

from pyspark.sql import SparkSession

from trio_nsq.spark import NSQDataSource

address, topic, output, checkpoint = sys.argv[1:5]
spark = (SparkSession.builder.master("local[2]").appName("a Kafka user's query")
         .config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.host", "127.0.0.1")
         .config("spark.ui.enabled", "false").getOrCreate())
spark.dataSource.register(NSQDataSource)
# Kafka's option names, and no channel: the checkpoint is the query's state
events = (spark.readStream.format("nsq").option("topic", topic).option("nsqd_http_address", address)
          .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", "100")
          .option("failOnDataLoss", "true").load())
query = (events.selectExpr("CAST(value AS STRING) AS value").writeStream.format("text")
         .option("path", output).option("checkpointLocation", checkpoint).start())
query.awaitTermination()
'''


def start_child(tmp_path: Path, script: Path, run: str, *args: str) -> subprocess.Popen:
    """`script` with the venv's python in a process group of its own, run outside the repo, every scratch
    file under tmp_path (as a SIGKILL leaves them)."""
    scratch = {name: tmp_path / name for name in ("cwd", "spark-local", "java-tmp", "python-tmp")}
    for folder in scratch.values():
        folder.mkdir(exist_ok=True)
    environ = dict(os.environ)
    # the package from this checkout (the one installed, in a clone installed with pip install -e .)
    environ.update(PYTHONPATH=str(REPO_ROOT), SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable,
                   PYSPARK_DRIVER_PYTHON=sys.executable, SPARK_LOCAL_DIRS=str(scratch["spark-local"]),
                   TMPDIR=str(scratch["python-tmp"]), JAVA_TOOL_OPTIONS=f"-Djava.io.tmpdir={scratch['java-tmp']}",
                   PYTHONUNBUFFERED="1")
    with open(tmp_path / f"child-{run}.log", "wb") as output:
        return subprocess.Popen([sys.executable, str(script), *args], cwd=scratch["cwd"], env=environ,
                                stdout=output, stderr=subprocess.STDOUT, start_new_session=True)


def file_sink_lines(output: Path) -> list[str]:
    """The lines of Spark's file sink output, as Spark reads it back: only the files its log
    (_spark_metadata, with its .compact files) lists, none a killed micro-batch left behind."""
    files: set[str] = set()
    metadata = output / "_spark_metadata"
    if metadata.is_dir():
        for entry in sorted(metadata.iterdir()):
            if entry.name.split(".")[0].isdigit():
                for line in entry.read_text().splitlines()[1:]:
                    if line.strip():
                        record = json.loads(line)
                        if record.get("action", "add") == "add":
                            files.add(record["path"])
    lines: list[str] = []
    for name in sorted(files):
        lines += Path(name.removeprefix("file://")).read_text().splitlines()
    return lines


def test_a_kafka_users_query_killed_and_started_again_on_its_checkpoint_writes_each_message_once(
        broker_factory, tmp_path):
    broker = broker_factory()
    topic = "kafka-user"
    by_position(broker, topic)
    sent = [f"event {n}" for n in range(3000)]
    publish_durably(broker, topic, [s.encode() for s in sent])
    script = tmp_path / "kafka_user_query.py"
    script.write_text(KAFKA_USER_QUERY)
    output, checkpoint = tmp_path / "output", tmp_path / "checkpoint"
    args = (broker.http_address, topic, str(output), str(checkpoint))

    proc = start_child(tmp_path, script, "1", *args)
    try:
        def some_written():
            assert proc.poll() is None, (tmp_path / "child-1.log").read_text()[-3000:]
            return len(file_sink_lines(output)) >= 300

        eventually(some_written, "a few micro-batches in the output", timeout=180)
    finally:
        kill_group(proc)
    written = len(file_sink_lines(output))
    assert 300 <= written < len(sent)  # killed mid-stream

    proc = start_child(tmp_path, script, "2", *args)
    try:
        def all_written():
            assert proc.poll() is None, (tmp_path / "child-2.log").read_text()[-3000:]
            return len(file_sink_lines(output)) >= len(sent)

        eventually(all_written, "every message in the output", timeout=180)
    finally:
        kill_group(proc)
    assert Counter(file_sink_lines(output)) == Counter(sent)


# --- item 9: a task's read when the broker restarts behind, or lost records -------------------------


def range_of(broker: BrokerProcess, topic: str, **options: str) -> tuple:
    """The settings of a spark.read of the topic and its whole log as one task's range."""
    settings = log_settings({"topic": topic, "nsqd_http_address": broker.http_address,
                             "read_max_bytes": "4096", **{k.lower(): v for k, v in options.items()}}, batch=True)
    now = positions(broker, topic)
    return settings, LogRange(broker.http_address, topic, now["log_id"], now["first"], now["end"])


def numbers_of(batches: list) -> list[int]:
    return [int(bytes(v)) for batch in batches for v in batch.column("value").to_pylist()]


def broker_with_a_copy_of_its_first_half(broker_factory, tmp_path: Path, topic: str) -> tuple[BrokerProcess, Path]:
    """A broker whose topic holds 2,000 numbered records, and a copy of its data directory when it
    held the first 1,000 only (the same log, fewer records: a broker restored from it lost the rest)."""
    broker = broker_factory()
    by_position(broker, topic)
    publish_durably(broker, topic, [b"%d" % n for n in range(1000)])
    broker.stop()
    half = tmp_path / "first-half"
    shutil.copytree(broker.data_path, half)
    broker.start()
    publish_durably(broker, topic, [b"%d" % n for n in range(1000, 2000)])
    return broker, half


def on_data(broker: BrokerProcess, data: Path) -> None:
    """Restart the broker (same ports) on another data directory."""
    broker.stop()
    broker.data_path = data
    broker.start()


def test_a_task_whose_broker_restarts_behind_waits_for_it_and_reads_its_range_once(
        broker_factory, tmp_path, monkeypatch):
    broker, half = broker_with_a_copy_of_its_first_half(broker_factory, tmp_path, "restart")
    whole = broker.data_path
    settings, part = range_of(broker, "restart")
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 2:  # the broker is back with every record
            on_data(broker, whole)

    monkeypatch.setattr(positional, "sleep", sleep, raising=False)
    rows = read_range(settings, part)
    got = [next(rows)]
    on_data(broker, half)  # restarted, and answering behind the range's end for a while
    got += list(rows)
    assert numbers_of(got) == list(range(2000))
    assert len(pauses) == 2 and all(0 < p <= 5 for p in pauses)


@pytest.mark.parametrize("fail_on_data_loss", ["true", "false"])
def test_a_task_whose_broker_lost_synced_records_waits_a_bounded_time_then_reports_data_loss(
        broker_factory, tmp_path, monkeypatch, caplog, fail_on_data_loss):
    broker, half = broker_with_a_copy_of_its_first_half(broker_factory, tmp_path, "lost")
    settings, part = range_of(broker, "lost", failOnDataLoss=fail_on_data_loss)
    pauses: list[float] = []
    monkeypatch.setattr(positional, "sleep", pauses.append, raising=False)  # (no real wait)
    rows = read_range(settings, part)
    got = [next(rows)]
    on_data(broker, half)  # the same log, the second half gone for good
    end_now = positions(broker, "lost")["end"]
    with caplog.at_level(logging.WARNING, logger="trio_nsq.spark"):
        if fail_on_data_loss == "true":
            with pytest.raises(DataLossError, match=rf"(?s)records from position {end_now} to {part.end}.*"
                                                    r"failOnDataLoss', 'false'"):
                got += list(rows)
        else:
            got += list(rows)
            assert numbers_of(got) == list(range(1000))  # what is left, then the range ends
            assert re.search(rf"records from position {end_now} to {part.end}.*failOnDataLoss=false", caplog.text)
    # it asked again after pauses that grow, within a bound
    assert len(pauses) > 3 and all(p > 0 for p in pauses) and pauses == sorted(pauses)
    assert sum(pauses) <= 60


def test_a_topic_gone_while_a_task_goes_on_after_lost_records_is_data_loss_not_a_raw_error(
        broker_factory, tmp_path, monkeypatch, caplog):
    """failOnDataLoss=false: the range's start is gone (POSITION_GONE), and the topic is deleted before
    the task asks where its log starts now: a warning, and the range ends."""
    broker = broker_factory(max_bytes_per_file=4096, retention_bytes=8192)  # (segments of ~120 records)
    topic = "gone"
    by_position(broker, topic)
    publish_durably(broker, topic, [b"%04d" % n for n in range(600)])
    settings, part = range_of(broker, topic, failOnDataLoss="false")
    # a cursor at the end: the next sync round removes what it is past, but for the last 8 KiB
    assert broker.http.post(f"/log/commit?topic={topic}&channel=done&position={part.end}").status_code == 200
    publish_durably(broker, topic, [b"more"])
    eventually(lambda: positions(broker, topic)["first"] > part.start, "the first segments removed")

    class DeletedFirst(LogClient):
        def positions(self, topic_name):
            assert broker.http.post(f"/topic/delete?topic={topic_name}").status_code == 200
            return super().positions(topic_name)

    monkeypatch.setattr(positional, "LogClient", DeletedFirst)
    with caplog.at_level(logging.WARNING, logger="trio_nsq.spark"):
        assert list(read_range(settings, part)) == []
    assert "the topic is gone (deleted)" in caplog.text
