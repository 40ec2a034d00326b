"""The positional reader's figures (not a test; issue 42, "Speed and scale"): `readStream`/`read` of a topic's
log by position (mode=log: trio_nsq/spark/positional.py) beside the channel source (mode=channel) and
Spark's ceiling for the positional source, in one run.

    .venv/bin/python -m tests.bench.spark_log [--messages 1000000] [--runs 3] [--cold-messages 10000]
                                              [--brokers 4] [--log-option NAME=VALUE ...]
                                              [--only stream batch cold growth] [--output FILE] [--quick]

One local[2] SparkSession (as tests/bench/spark.py makes it) and trio-nsqd processes with default flags on
loopback; messages of 200 bytes; each figure is the median of --runs, after a warm-up of every reader.
A topic read by position is published once (made and marked by a /log request first, then waited for
until durable) and read again by every run, each with its own cursor (`channel`, deleted after the run);
a cursor left at the log's start (`bench-pin`) keeps its segments, which the runs' cursors would
otherwise finish and so free. The channel source consumes a fresh topic each run.

1. Streaming --messages waiting into a `noop` sink: the positional reader (startingOffsets=earliest,
   counted by the query's progress until every row is in), the channel source (tests/bench/spark.py
   stream_read: until every message is FIN'd), and the ceiling: the same source reading the same records
   from local files instead of a broker (ceiling_source: the stream reader's own ranges and partitions,
   planned once from the broker by NSQLogStreamReader itself, every /log/read answer captured into a file,
   decoded in the task by the same positional.record_batch). Messages/s sustained (rows of the
   micro-batches with rows over their triggerExecution) and end to end (from start(), the query's start
   included); positional/channel (target >= 2) and positional/ceiling (target >= 0.85).
2. `spark.read` of the same --messages range with minPartitions=4 into a `noop` write: positional, the
   channel source's batch read (tests/bench/spark.py batch_read, with max_bytes raised to hold them all;
   2 tasks per broker, its default), and the ceiling's batch reader (NSQLogBatchReader's 4 partitions,
   from captured files).
3. A cold first micro-batch: seconds from start() until a foreachBatch sink has the first micro-batch's
   rows (counted in it), on a fresh query each time, --cold-messages waiting; positional vs channel.
4. The broker's cost: broker CPU-seconds per million messages served over each read of 1 and 2
   (process_cpu, before and after: the stream's start and end included).
5. Growth x10: positional streaming of --messages/10 and --messages (rate and broker CPU per message should
   stay flat), and 1 broker against 4 (the same --messages, a quarter on each of 4 broker processes on
   this machine, nsqd_http_address naming the four; broker CPU is the four's sum).

6. /log/read alone (`--only serve`, no Spark: run first, on a broker of its own): --messages records read
   from the log's start to its end by one LogClient, as a task reads its range (4 MiB a read, the reader's
   read_max_bytes and the broker's default), --runs times after one warm-up read; the broker's CPU-seconds
   per million records served, user and system (the part of 4 that is serving the records).

--quick: 100,000 messages, 1 run. --output merges the figures into a JSON file (results.spark_log).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request

from tests.bench.broker import Broker
from tests.bench.machine import describe, machine, merge_report
from tests.bench.spark import PHASES, ROLES, channel_stats, process_cpu, stream_read
from trio_nsq.spark.log_client import LogClient
from trio_nsq.spark.publisher import MPubClient

MSG_SIZE = 200
PIN = "bench-pin"


# --- brokers and topics ----------------------------------------------------------------------------


def http_json(method: str, url: str) -> dict:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(request, timeout=30) as r:
        body = r.read()
    return json.loads(body) if body.strip() else {}


def log_positions(broker: Broker, topic: str) -> dict:
    return http_json("GET", f"{broker.http_url}/log/positions?topic={topic}")


def publish_bodies(broker: Broker, topic: str, count: int, first: int = 0) -> None:
    """`count` bodies of MSG_SIZE bytes (b"message-00000000......") through /mpub, 5,000 a request."""
    with MPubClient([broker.http_address]) as client:
        for start in range(first, first + count, 5000):
            client.publish(topic, [(b"message-%08d" % i).ljust(MSG_SIZE, b".")
                                   for i in range(start, min(first + count, start + 5000))])


def log_topic(broker: Broker, topic: str, count: int, timeout: float = 300) -> dict:
    """A topic read by position holding `count` messages in its log, durable (nothing past the durable
    tail is served): made and marked by a /log request before the publish, as the README says."""
    http_json("POST", f"{broker.http_url}/topic/create?topic={topic}")
    first = log_positions(broker, topic)
    # a cursor that stays at the start: a segment every channel has finished goes, and the runs' cursors
    # (deleted after each run) finish the whole log; this keeps it for the next run to read again
    http_json("POST", f"{broker.http_url}/log/commit?topic={topic}&channel={PIN}&position={first['first']}")
    publish_bodies(broker, topic, count)
    deadline = time.monotonic() + timeout
    while True:
        p = log_positions(broker, topic)
        if p["end_index"] - p["first_index"] >= count:
            return p
        if time.monotonic() > deadline:
            raise RuntimeError(f"{topic}: {p['end_index'] - p['first_index']} of {count} records durable after "
                               f"{timeout} s")
        time.sleep(0.05)


def delete(broker: Broker, topic: str, channel: str | None = None) -> None:
    """Drop a topic (or a channel: a stream's cursor) once measured: the disk and the broker's state stay
    the same from one run to the next."""
    what = f"channel/delete?topic={topic}&channel={channel}" if channel else f"topic/delete?topic={topic}"
    try:
        http_json("POST", f"{broker.http_url}/{what}")
    except OSError:
        pass


def read_whole_log(broker: Broker, topic: str, positions: dict) -> int:
    """The log from `positions`' first record to its end through /log/read, as a task reads its range;
    the records read."""
    records = 0
    with LogClient(broker.http_address) as client:
        position = positions["first"]
        while position < positions["end"]:
            result = client.read(topic, position, positions["end"], log_id=positions["log_id"])
            records += result.records
            position = result.next_position
    return records


def serve_figures(n: int, runs: int) -> dict[str, list[float]]:
    """6. The broker's CPU-seconds (user, system) per million records served by /log/read, per run."""
    print(f"6. /log/read alone: {n:,} records read from start to end by one LogClient, no Spark", flush=True)
    broker = Broker()
    out: dict[str, list[float]] = {"serve broker CPU-s per 1M records": [], "serve broker user CPU-s per 1M records":
                                   [], "serve broker system CPU-s per 1M records": []}
    try:
        positions = log_topic(broker, "serve", n)
        read_whole_log(broker, "serve", positions)  # warm-up: the index's marks, the page cache
        for _ in range(runs):
            before = process_times(broker.proc.pid)
            records = read_whole_log(broker, "serve", positions)
            user, system = (after - b for after, b in zip(process_times(broker.proc.pid), before))
            assert records == n, f"{records} records read of {n}"
            for key, cpu in zip(out, (user + system, user, system)):
                out[key].append(per_million(cpu, n))
            print(f"  broker CPU-s per 1M records served: {per_million(user + system, n):.3f} (user "
                  f"{per_million(user, n):.3f}, system {per_million(system, n):.3f})", flush=True)
    finally:
        broker.close()
    return out


def process_times(pid: int) -> tuple[float, float]:
    """A process's user and system CPU-seconds so far, from /proc."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rpartition(")")[2].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_by_role(brokers: list[Broker]) -> dict[int, tuple[str, float]]:
    """process_cpu() with every one of `brokers` in the role "broker"."""
    pids = [b.proc.pid for b in brokers if b.proc is not None]
    return {pid: ("broker" if pid in pids else role, seconds)
            for pid, (role, seconds) in process_cpu(pids[0]).items()}


def cpu_spent(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """As tests/bench/spark.py cpu_between: a process started in between counts from zero."""
    out = dict.fromkeys(ROLES, 0.0)
    for pid, (role, seconds) in after.items():
        out[role] += seconds - before.get(pid, (role, 0.0))[1]
    return out


# --- the ceiling: the positional source reading captured answers from local files -----------------------


def ceiling_source():
    """Spark's ceiling for the positional source: a DataSource ("nsq-log-ceiling", option `plan`: a JSON file
    written by capture()) whose stream reader plans the positional reader's micro-batches (one offset per
    micro-batch of the plan) and partitions, and whose tasks read each block from a local file holding the
    exact /log/read answer the broker gave, decoded by positional.record_batch, as read_range decodes the
    broker's. Its batch reader serves the plan's one batch. No broker, no HTTP: what Spark and the decoding
    cost. (Defined in a function: pyspark is imported by main(), and Spark pickles the classes by value.)"""
    from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition

    from trio_nsq.spark.positional import LOG_SCHEMA

    class Blocks(InputPartition):
        def __init__(self, topic: str, address: str, reads: list[dict]) -> None:
            self.topic, self.address, self.reads = topic, address, reads

    def blocks(plan: dict, parts: list[dict]) -> list[Blocks]:
        return [Blocks(plan["topic"], p["address"], p["reads"]) for p in parts]

    def read(part: Blocks):
        from trio_nsq.spark.log_client import ReadResult
        from trio_nsq.spark.positional import record_batch

        for r in part.reads:
            with open(r["file"], "rb") as fh:
                body = fh.read()
            yield record_batch(part.topic, part.address, ReadResult(
                log_id=r["log_id"], position=r["position"], next_position=r["next_position"],
                first_index=r["first_index"], records=r["records"], records_bytes=r["records_bytes"],
                deadlines=r["deadlines"], end=r["end"], body=body))

    class StreamReader(DataSourceStreamReader):
        def __init__(self, plan: dict) -> None:
            self.plan = plan

        def initialOffset(self) -> dict:
            return {"batch": 0}

        def latestOffset(self, start: dict, limit=None) -> dict:
            return {"batch": min(len(self.plan["batches"]), int(start["batch"]) + 1)}

        def partitions(self, start: dict, end: dict) -> list:
            return [part for parts in self.plan["batches"][int(start["batch"]):int(end["batch"])]
                    for part in blocks(self.plan, parts)]

        def read(self, partition):
            return read(partition)

        def commit(self, end: dict) -> None:
            pass

    class BatchReader(DataSourceReader):
        def __init__(self, plan: dict) -> None:
            self.plan = plan

        def partitions(self) -> list:
            return blocks(self.plan, self.plan["batches"][0])

        def read(self, partition):
            return read(partition)

    class Ceiling(DataSource):
        @classmethod
        def name(cls) -> str:
            return "nsq-log-ceiling"

        def schema(self):
            return LOG_SCHEMA

        def _plan(self) -> dict:
            with open(self.options["plan"]) as fh:
                return json.load(fh)

        def streamReader(self, schema):
            return StreamReader(self._plan())

        def reader(self, schema):
            return BatchReader(self._plan())

    return Ceiling


def capture(options: dict[str, str], folder: str, stream: bool, expected: int | None = None) -> tuple[str, dict]:
    """Plan the read the positional reader would make with `options` (the stream reader's initialOffset,
    then latestOffset with its default read limit and partitions until it has nothing more; or the batch
    reader's partitions), read every range from its broker as read_range does and keep each /log/read
    answer in a file of `folder`: (the plan file for ceiling_source, the plan), which must hold `expected`
    records when given. The stream reader's cursor, made by initialOffset, is deleted."""
    from trio_nsq.spark.log_client import LogClient
    from trio_nsq.spark.options import log_settings
    from trio_nsq.spark.positional import LogRange, NSQLogBatchReader, NSQLogStreamReader

    settings = log_settings({k.lower(): v for k, v in options.items()}, batch=not stream)
    if stream:
        reader = NSQLogStreamReader(settings)
        start = reader.initialOffset()
        limit = reader.getDefaultReadLimit()
        batches = []
        try:
            while True:
                end = reader.latestOffset(start, limit)
                if end == start:
                    break
                batches.append(list(reader.partitions(start, end)))
                start = end
        finally:
            reader.stop()
            for broker in settings.addresses:
                delete_url = f"http://{broker}/channel/delete?topic={settings.topic}&channel={settings.channel}"
                try:
                    http_json("POST", delete_url)
                except OSError:
                    pass
    else:
        batches = [list(NSQLogBatchReader(settings).partitions())]
    os.makedirs(folder, exist_ok=True)
    plan: dict = {"topic": settings.topic, "batches": []}
    n = 0
    for parts in batches:
        planned = []
        for part in parts:
            assert isinstance(part, LogRange)
            reads = []
            position = part.start
            with LogClient(part.address) as client:
                while position < part.end:
                    r = client.read(part.topic, position, part.end, settings.read_max_bytes, part.log_id)
                    if not r.records and r.next_position <= position:
                        raise RuntimeError(f"capture: nothing at {position} of {part.topic} on {part.address}")
                    if r.records:
                        name = os.path.join(folder, f"read-{n:06d}")
                        n += 1
                        with open(name, "wb") as fh:
                            fh.write(r.body)
                        reads.append({"file": name, "log_id": r.log_id, "position": r.position,
                                      "next_position": r.next_position, "first_index": r.first_index,
                                      "records": r.records, "records_bytes": r.records_bytes,
                                      "deadlines": r.deadlines, "end": r.end})
                    position = max(position, r.next_position)
            planned.append({"address": part.address, "reads": reads})
        plan["batches"].append(planned)
    records = sum(r["records"] for b in plan["batches"] for p in b for r in p["reads"])
    if expected is not None and records != expected:
        raise RuntimeError(f"capture: the reader planned {records} records of {settings.topic}, {expected} expected")
    path = os.path.join(folder, "plan.json")
    with open(path, "w") as fh:
        json.dump(plan, fh)
    return path, plan


def plan_shape(plan: dict) -> str:
    parts = [len(b) for b in plan["batches"]]
    reads = sum(len(p["reads"]) for b in plan["batches"] for p in b)
    records = sum(r["records"] for b in plan["batches"] for p in b for r in p["reads"])
    return f"{len(parts)} micro-batch(es) of {'/'.join(map(str, sorted(set(parts))))} partition(s), {reads} reads, " \
           f"{records:,} records"


# --- the measured reads ------------------------------------------------------------------------------


def progress_figures(progress: list[dict], started_at: float, cpu: dict[str, float]) -> tuple[float, dict]:
    """(the sustained rows/s of the micro-batches with rows; where the time went, as stream_read says it)."""
    busy = [p for p in progress if p["numInputRows"]]
    sustained = sum(p["numInputRows"] for p in busy) / (sum(p["durationMs"]["triggerExecution"] for p in busy) / 1000)
    first = datetime.datetime.fromisoformat(progress[0]["timestamp"].replace("Z", "+00:00"))
    phases = {"start to first micro-batch": first.timestamp() - started_at, "micro-batches": float(len(busy))}
    for phase in PHASES:
        phases[phase] = sum(p["durationMs"].get(phase, 0) for p in progress) / 1000
    phases.update({f"CPU-s {role}": seconds for role, seconds in cpu.items()})
    return sustained, phases


def counted_stream(spark, reader, count: int, brokers: list[Broker], checkpoint: str) -> tuple[float, float, dict]:
    """Seconds from start() until `count` rows went into a noop sink (by the query's progress), the sustained
    rows/s, and where the time went (with the CPU-seconds of each role over the query)."""
    processes = cpu_by_role(brokers)
    start, started_at = time.perf_counter(), time.time()
    query = reader.load().writeStream.format("noop").option("checkpointLocation", checkpoint).start()
    try:
        while sum(p["numInputRows"] for p in query.recentProgress) < count:
            assert query.isActive, query.exception()
            time.sleep(0.01)
        elapsed = time.perf_counter() - start
        cpu = cpu_spent(processes, cpu_by_role(brokers))
        rows = sum(p["numInputRows"] for p in query.recentProgress)
        assert rows == count, f"{rows} rows read, {count} expected"
        sustained, phases = progress_figures(query.recentProgress, started_at, cpu)
        return elapsed, sustained, phases
    finally:
        query.stop()


def log_options(brokers: list[Broker], topic: str, extra: dict[str, str], channel: str | None = None) -> dict[str, str]:
    options = {"mode": "log", "topic": topic, "nsqd_http_address": ",".join(b.http_address for b in brokers),
               "startingOffsets": "earliest"}
    if channel is not None:
        options["channel"] = channel
    options.update(extra)
    return options


def positional_stream(spark, brokers: list[Broker], topic: str, count: int, scratch: str, name: str,
                      extra: dict[str, str]) -> tuple[float, float, dict]:
    reader = spark.readStream.format("nsq")
    for key, value in log_options(brokers, topic, extra, channel=name).items():
        reader = reader.option(key, value)
    try:
        return counted_stream(spark, reader, count, brokers, f"{scratch}/{name}")
    finally:
        for b in brokers:
            delete(b, topic, channel=name)


def ceiling_stream(spark, plan: str, count: int, brokers: list[Broker], scratch: str, name: str):
    reader = spark.readStream.format("nsq-log-ceiling").option("plan", plan)
    return counted_stream(spark, reader, count, brokers, f"{scratch}/{name}")


def channel_batch(spark, broker: Broker, topic: str, count: int) -> None:
    """tests/bench/spark.py batch_read with max_bytes to match: its default (64 MiB of bodies) stops a read of
    200-byte messages at 335,544."""
    spark.read.format("nsq").option("mode", "channel").option("topic", topic).option("channel", "bench") \
        .option("nsqd_tcp_address", broker.tcp_address).option("max_messages", count) \
        .option("max_bytes", count * MSG_SIZE).load().write.format("noop").mode("append").save()
    s = channel_stats(broker.http_url, topic, "bench")
    assert (s["message_count"], s["depth"], s["in_flight_count"]) == (count, 0, 0), s


def timed_batch(fn, brokers: list[Broker]) -> tuple[float, dict[str, float]]:
    processes = cpu_by_role(brokers)
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    return elapsed, cpu_spent(processes, cpu_by_role(brokers))


def positional_batch(spark, brokers: list[Broker], topic: str, count: int, extra: dict[str, str]) -> None:
    reader = spark.read.format("nsq")
    for key, value in log_options(brokers, topic, {"minPartitions": "4", **extra}).items():
        reader = reader.option(key, value)
    df = reader.load()
    df.write.format("noop").mode("append").save()


def ceiling_batch(spark, plan: str) -> None:
    spark.read.format("nsq-log-ceiling").option("plan", plan).load().write.format("noop").mode("append").save()


def first_rows(spark, reader, checkpoint: str, timeout: float = 120) -> tuple[float, float, int]:
    """Seconds from start() until a foreachBatch sink had the first micro-batch with rows (counted there),
    on a fresh query; seconds until the sink was called with it (the micro-batch planned: the rest is its
    tasks reading the rows); and its rows."""
    seen: list[tuple[float, float, int]] = []

    def sink(df, _batch_id) -> None:
        if not seen:
            called = time.perf_counter()
            n = df.count()
            if n:
                seen.append((time.perf_counter(), called, n))

    start = time.perf_counter()
    query = reader.load().writeStream.foreachBatch(sink).option("checkpointLocation", checkpoint).start()
    try:
        deadline = time.monotonic() + timeout
        while not seen:
            assert query.isActive, query.exception()
            assert time.monotonic() < deadline, "no rows"
            time.sleep(0.005)
        return seen[0][0] - start, seen[0][1] - start, seen[0][2]
    finally:
        query.stop()


def print_phases(phases: dict[str, float]) -> None:
    print("      where the time went (s, summed over the micro-batches): " + ", ".join(
        f"{k} {v:.2f}" for k, v in phases.items() if k in PHASES), flush=True)


# --- the report --------------------------------------------------------------------------------------


def med(samples: list[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


def per_million(cpu: float, count: int) -> float:
    return cpu / count * 1_000_000


SECTIONS = ("stream", "batch", "cold", "growth", "serve")


def stream_line(label: str, count: int, elapsed: float, rate: float, phases: dict[str, float]) -> None:
    print(f"  {label:<11} {count / elapsed:>12,.0f} msg/s end to end ({elapsed:.2f} s), {rate:>12,.0f} sustained "
          f"({phases['micro-batches']:.0f} micro-batches with rows, the first after "
          f"{phases['start to first micro-batch']:.2f} s); CPU-s: "
          + ", ".join(f"{r} {phases[f'CPU-s {r}']:.2f}" for r in ROLES), flush=True)
    print_phases(phases)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cold-messages", type=int, default=10_000,
                        help="messages waiting for the cold first micro-batch")
    parser.add_argument("--brokers", type=int, default=4, help="brokers of the scale-out figure (1: skip it)")
    parser.add_argument("--log-option", action="append", default=[], metavar="NAME=VALUE",
                        help="an option of the positional reader (to measure a variant; the ceiling follows it)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="these parts only (the broker's cost comes with stream and batch)")
    parser.add_argument("--quick", action="store_true", help="100,000 messages, 1 run")
    parser.add_argument("--output", default="", help="merge the figures into this JSON file (bench-results.json)")
    args = parser.parse_args()
    if args.quick:
        args.messages, args.runs = 100_000, 1
    extra = dict(o.split("=", 1) for o in args.log_option)
    n, runs, only = args.messages, args.runs, set(args.only)
    small = max(1, n // 10)
    info = machine()
    print(f"machine: {describe(info)}")
    print(f"{n:,} messages of {MSG_SIZE} B, median of {runs} run(s) after a warm-up; positional options: "
          f"{', '.join(f'{k}={v}' for k, v in extra.items()) or 'defaults'}", flush=True)
    samples: dict[str, list[float]] = serve_figures(n, runs) if "serve" in only else {}
    if only == {"serve"}:
        finish(args, info, samples, extra)
        return

    from pyspark.sql import SparkSession

    # Spark's Python workers run this interpreter (the venv with pyarrow and the package)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

    from trio_nsq.spark import NSQDataSource

    scratch = tempfile.mkdtemp(prefix="trio-nsq-spark-log-bench-")
    broker = Broker()
    others: list[Broker] = []
    spark = None

    def keep(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    def kept_stream(name: str, count: int, elapsed: float, rate: float, phases: dict[str, float]) -> None:
        keep(f"stream {name}", count / elapsed)
        keep(f"stream {name} sustained", rate)
        keep(f"stream {name} broker CPU-s", phases["CPU-s broker"])
        for role in ROLES:
            keep(f"stream {name} CPU-s {role}", phases[f"CPU-s {role}"])

    try:
        spark = (SparkSession.builder.master("local[2]").appName("trio-nsq-bench-log")
                 .config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.host", "127.0.0.1")
                 .config("spark.ui.enabled", "false").config("spark.local.dir", scratch)
                 .config("spark.sql.streaming.numRecentProgressUpdates", "10000").getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        spark.dataSource.register(NSQDataSource)
        spark.dataSource.register(ceiling_source())

        # --- warm-up: each reader once (the first query of a session starts the Python workers) ---
        log_topic(broker, "warm-up-log", 1000)
        positional_stream(spark, [broker], "warm-up-log", 1000, scratch, "warm-up-cursor", extra)
        positional_batch(spark, [broker], "warm-up-log", 1000, extra)
        plan, _ = capture(log_options([broker], "warm-up-log", extra, channel="warm-up-capture"),
                          f"{scratch}/capture-warm-up", stream=True)
        ceiling_stream(spark, plan, 1000, [broker], scratch, "warm-up-ceiling")
        plan, _ = capture(log_options([broker], "warm-up-log", {"minPartitions": "4", **extra}),
                          f"{scratch}/capture-warm-up-batch", stream=False)
        ceiling_batch(spark, plan)
        publish_bodies(broker, "warm-up-channel", 1000)
        stream_read(spark, broker, "warm-up-channel", 1000, scratch, {"mode": "channel"})
        publish_bodies(broker, "warm-up-channel-batch", 1000)
        channel_batch(spark, broker, "warm-up-channel-batch", 1000)
        for topic in ("warm-up-log", "warm-up-channel", "warm-up-channel-batch"):
            delete(broker, topic)
        shutil.rmtree(f"{scratch}/capture-warm-up", ignore_errors=True)
        shutil.rmtree(f"{scratch}/capture-warm-up-batch", ignore_errors=True)

        if only & {"stream", "batch", "growth"}:
            started = time.perf_counter()
            log_topic(broker, "log", n)
            print(f"published {n:,} messages to topic 'log' (read by position) and waited for them to be durable: "
                  f"{time.perf_counter() - started:.1f} s", flush=True)

        # --- 1. streaming (and 4: the broker's CPU over each read) -------------------------------
        if "stream" in only:
            capture_dir = f"{scratch}/capture-stream"
            plan, shape = capture(log_options([broker], "log", extra, channel="capture"), capture_dir, stream=True,
                                  expected=n)
            print(f"1. readStream -> noop, {n:,} messages waiting (the ceiling: {plan_shape(shape)}, from local "
                  f"files)", flush=True)
            for run in range(runs):
                result = positional_stream(spark, [broker], "log", n, scratch, f"cursor-{run}", extra)
                kept_stream("positional", n, *result)
                stream_line("positional", n, *result)
                topic = f"channel-{run}"
                publish_bodies(broker, topic, n)
                result = stream_read(spark, broker, topic, n, scratch, {"mode": "channel"})
                delete(broker, topic)
                kept_stream("channel", n, *result)
                stream_line("channel", n, *result)
                result = ceiling_stream(spark, plan, n, [broker], scratch, f"ceiling-{run}")
                kept_stream("ceiling", n, *result)
                stream_line("ceiling", n, *result)
            shutil.rmtree(capture_dir, ignore_errors=True)

        # --- 2. batch read (and 4) ----------------------------------------------------------------
        if "batch" in only:
            capture_dir = f"{scratch}/capture-batch"
            plan, shape = capture(log_options([broker], "log", {"minPartitions": "4", **extra}), capture_dir,
                                  stream=False, expected=n)
            print(f"2. spark.read -> noop, a range of {n:,} messages, minPartitions=4 (the ceiling: "
                  f"{plan_shape(shape)}; the channel source: its default 2 tasks per broker, max_bytes to match)",
                  flush=True)
            for run in range(runs):
                topic = f"channel-batch-{run}"
                publish_bodies(broker, topic, n)
                for name, fn in (("positional", lambda: positional_batch(spark, [broker], "log", n, extra)),
                                 ("channel", lambda: channel_batch(spark, broker, topic, n)),
                                 ("ceiling", lambda: ceiling_batch(spark, plan))):
                    elapsed, cpu = timed_batch(fn, [broker])
                    keep(f"batch {name}", n / elapsed)
                    keep(f"batch {name} broker CPU-s", cpu["broker"])
                    for role in ROLES:
                        keep(f"batch {name} CPU-s {role}", cpu[role])
                    print(f"  {name:<11} {n / elapsed:>12,.0f} msg/s ({elapsed:.2f} s); CPU-s: "
                          + ", ".join(f"{r} {cpu[r]:.2f}" for r in ROLES), flush=True)
                delete(broker, topic)
            shutil.rmtree(capture_dir, ignore_errors=True)

        # --- 3. a cold first micro-batch ----------------------------------------------------------
        if "cold" in only:
            cold = args.cold_messages
            print(f"3. start() -> first rows in a foreachBatch sink, a fresh query each, {cold:,} messages waiting",
                  flush=True)
            log_topic(broker, "cold-log", cold)
            for run in range(runs):
                reader = spark.readStream.format("nsq")
                for key, value in log_options([broker], "cold-log", extra, channel=f"cold-{run}").items():
                    reader = reader.option(key, value)
                seconds, called, rows = first_rows(spark, reader, f"{scratch}/cold-log-{run}")
                delete(broker, "cold-log", channel=f"cold-{run}")
                keep("cold positional s", seconds)
                keep("cold positional sink called s", called)
                print(f"  positional  {seconds:.2f} s ({rows:,} rows in the first micro-batch; the sink called after "
                      f"{called:.2f} s)", flush=True)
                topic = f"cold-channel-{run}"
                publish_bodies(broker, topic, cold)
                reader = spark.readStream.format("nsq").option("mode", "channel").option("topic", topic) \
                    .option("channel", "bench").option("nsqd_tcp_address", broker.tcp_address)
                seconds, called, rows = first_rows(spark, reader, f"{scratch}/cold-channel-{run}")
                delete(broker, topic)
                keep("cold channel s", seconds)
                keep("cold channel sink called s", called)
                print(f"  channel     {seconds:.2f} s ({rows:,} rows in the first micro-batch; the sink called after "
                      f"{called:.2f} s)", flush=True)
            delete(broker, "cold-log")

        # --- 5. growth: x10 messages, x4 brokers ---------------------------------------------------
        if "growth" in only:
            print(f"5. growth: positional readStream of {small:,} and {n:,} messages; {n:,} messages on 1 broker and "
                  f"on {args.brokers} (split evenly, nsqd_http_address naming them all)", flush=True)
            log_topic(broker, "log-small", small)
            for run in range(runs):
                result = positional_stream(spark, [broker], "log-small", small, scratch, f"small-{run}", extra)
                kept_stream("positional small", small, *result)
                stream_line(f"{small:,}", small, *result)
                if "stream" not in only:  # (else section 1 measured it)
                    result = positional_stream(spark, [broker], "log", n, scratch, f"cursor-{run}", extra)
                    kept_stream("positional", n, *result)
                    stream_line(f"{n:,}", n, *result)
            delete(broker, "log-small")
            if args.brokers > 1:
                others = [Broker() for _ in range(args.brokers - 1)]
                spread = [broker, *others]
                for i, b in enumerate(spread):
                    log_topic(b, "log-spread", n // len(spread) + (i < n % len(spread)))
                for run in range(runs):
                    result = positional_stream(spark, spread, "log-spread", n, scratch, f"spread-{run}", extra)
                    kept_stream("positional spread", n, *result)
                    stream_line(f"{len(spread)} brokers", n, *result)
        delete(broker, "log")
    finally:
        if spark is not None:
            spark.stop()
        for b in [broker, *others]:
            b.close()
        shutil.rmtree(scratch, ignore_errors=True)

    finish(args, info, samples, extra)


def finish(args: argparse.Namespace, info: dict, samples: dict[str, list[float]], extra: dict[str, str]) -> None:
    """The table, and the figures merged into --output."""
    n, runs = args.messages, args.runs
    figures = report(samples, n, max(1, n // 10), runs, args.brokers)
    if args.output:
        merge_report(args.output, {"title": "PySpark positional reader vs channel source vs ceiling, local[2] "
                                            "(messages/s, seconds, CPU-seconds)",
                                   "machine": info, "messages": n, "message_size": MSG_SIZE, "runs": runs,
                                   "cold_messages": args.cold_messages, "brokers": args.brokers,
                                   "positional_options": extra, "figures": figures, "samples": samples},
                     "results", "spark_log")
        print(f"merged into {args.output} (results.spark_log)")


def report(samples: dict[str, list[float]], n: int, small: int, runs: int, brokers: int) -> dict[str, float]:
    """The medians, the ratios, and the table."""
    f = {name: med(values) for name, values in samples.items()}
    for kind in ("stream positional", "stream channel", "batch positional", "batch channel",
                 "stream positional small", "stream positional spread"):
        if f"{kind} broker CPU-s" in f:
            f[f"{kind} broker CPU-s per 1M messages"] = per_million(f[f"{kind} broker CPU-s"],
                                                                    small if kind.endswith("small") else n)
    cpu = "broker CPU-s per 1M messages"
    ratios = {  # name: (numerator, denominator, target)
        "stream sustained positional/channel": ("stream positional sustained", "stream channel sustained", 2.0),
        "stream end to end positional/channel": ("stream positional", "stream channel", 2.0),
        "stream sustained positional/ceiling": ("stream positional sustained", "stream ceiling sustained", 0.85),
        "stream end to end positional/ceiling": ("stream positional", "stream ceiling", 0.85),
        "read positional/channel": ("batch positional", "batch channel", 2.0),
        "read positional/ceiling": ("batch positional", "batch ceiling", 0.85),
        "cold first micro-batch positional/channel (s)": ("cold positional s", "cold channel s", None),
        "broker CPU per message, stream, positional/channel": (f"stream positional {cpu}", f"stream channel {cpu}",
                                                               None),
        "broker CPU per message, read, positional/channel": (f"batch positional {cpu}", f"batch channel {cpu}", None),
        f"stream sustained {n} / {small} messages": ("stream positional sustained",
                                                     "stream positional small sustained", None),
        f"stream end to end {n} / {small} messages": ("stream positional", "stream positional small", None),
        f"broker CPU per message {n} / {small} messages": (f"stream positional {cpu}",
                                                           f"stream positional small {cpu}", None),
        f"stream sustained {brokers} brokers / 1": ("stream positional spread sustained",
                                                    "stream positional sustained", None),
        f"stream end to end {brokers} brokers / 1": ("stream positional spread", "stream positional", None),
        f"broker CPU per message {brokers} brokers / 1": (f"stream positional spread {cpu}", f"stream positional {cpu}",
                                                          None),
    }
    targets = {}
    for name, (top, bottom, target) in ratios.items():
        if top in f and bottom in f and f[bottom]:
            f[name] = f[top] / f[bottom]
            if target is not None:
                targets[name] = target

    def row(label: str, *cells: str) -> None:
        print(f"{label:<40}" + "".join(f"{c:>15}" for c in cells))

    def num(key: str, digits: int = 0) -> str:
        return "-" if key not in f else f"{f[key]:,.{digits}f}"

    def ratio(key: str) -> str:
        if key not in f:
            return "-"
        return f"{f[key]:.2f}" + ("" if key not in targets else " ok" if f[key] >= targets[key] else " LOW")

    if "serve broker CPU-s per 1M records" in f:
        print()
        row(f"/log/read alone, median of {runs}: broker CPU-s per 1M records", "")
        row("  user + system, user, system", num("serve broker CPU-s per 1M records", 3),
            num("serve broker user CPU-s per 1M records", 3), num("serve broker system CPU-s per 1M records", 3))
    if all(name.startswith("serve ") for name in f):
        return f
    print()
    print(f"positional reader / channel source / ceiling, local[2], {n:,} messages of {MSG_SIZE} B, median of {runs}")
    row("", "positional", "channel", "ceiling", "pos/channel", "pos/ceiling")
    row("readStream msg/s, sustained", num("stream positional sustained"), num("stream channel sustained"),
        num("stream ceiling sustained"), ratio("stream sustained positional/channel"),
        ratio("stream sustained positional/ceiling"))
    row("readStream msg/s, end to end", num("stream positional"), num("stream channel"), num("stream ceiling"),
        ratio("stream end to end positional/channel"), ratio("stream end to end positional/ceiling"))
    row("read msg/s (minPartitions=4)", num("batch positional"), num("batch channel"), num("batch ceiling"),
        ratio("read positional/channel"), ratio("read positional/ceiling"))
    row("cold first micro-batch, s", num("cold positional s", 2), num("cold channel s", 2), "",
        ratio("cold first micro-batch positional/channel (s)"), "")
    row("  the sink called (planned), s", num("cold positional sink called s", 2), num("cold channel sink called s", 2))
    row("broker CPU-s per 1M msgs, readStream", num(f"stream positional {cpu}", 2), num(f"stream channel {cpu}", 2),
        "", ratio("broker CPU per message, stream, positional/channel"), "")
    row("broker CPU-s per 1M msgs, read", num(f"batch positional {cpu}", 2), num(f"batch channel {cpu}", 2), "",
        ratio("broker CPU per message, read, positional/channel"), "")
    print("(targets: positional/channel >= 2, positional/ceiling >= 0.85, marked ok or LOW)")
    if "stream positional small" in f:
        print()
        print("growth, positional readStream")
        row("", f"{small:,} msgs", f"{n:,} msgs", "ratio")
        row("msg/s, sustained", num("stream positional small sustained"), num("stream positional sustained"),
            ratio(f"stream sustained {n} / {small} messages"))
        row("msg/s, end to end", num("stream positional small"), num("stream positional"),
            ratio(f"stream end to end {n} / {small} messages"))
        row("broker CPU-s per 1M msgs", num(f"stream positional small {cpu}", 2), num(f"stream positional {cpu}", 2),
            ratio(f"broker CPU per message {n} / {small} messages"))
    if "stream positional spread" in f:
        row("", "1 broker", f"{brokers} brokers", "ratio")
        row("msg/s, sustained", num("stream positional sustained"), num("stream positional spread sustained"),
            ratio(f"stream sustained {brokers} brokers / 1"))
        row("msg/s, end to end", num("stream positional"), num("stream positional spread"),
            ratio(f"stream end to end {brokers} brokers / 1"))
        row("broker CPU-s per 1M msgs (all brokers)", num(f"stream positional {cpu}", 2),
            num(f"stream positional spread {cpu}", 2), ratio(f"broker CPU per message {brokers} brokers / 1"))
    return f


if __name__ == "__main__":
    main()
