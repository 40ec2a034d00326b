"""Spark connector figures (not a test): rows/s of `df.write.format("nsq")` with `idempotent` on and off,
against Spark's `noop` format on the same DataFrame, and messages/s read by `readStream.format("nsq")`.

    .venv/bin/python -m tests.bench.spark [--rows 200000] [--partitions 8] [--runs 3] [--messages 200000]
                                          [--large-messages 1000000] [--option NAME=VALUE ...]
                                          [--broker-flag FLAG ...] [--output FILE]

One local[2] SparkSession and one trio-nsqd on loopback with default flags; each figure is the median of
--runs, after a warm-up write and a warm-up query (the first Python write or query of a session starts and
imports the workers). The reads are of the same 200,000 bodies the write sends, waiting on the channel:
`readStream` into the `noop` sink (counted until every message is FIN'd, after its micro-batch's commit,
the query's start included) and `spark.read` into a `noop` write. Then --large-messages rows are
written by `df.write.format("nsq")` and read back by `readStream`, where Spark's ~1 s to start a query's
Python source is spread over more messages (the rate a query sustains); each stream rate is also given as
a ratio to the write of the same rows in the same run. Each stream read is followed by Spark's own
ceiling for the same count: a Python stream source of the same schema and micro-batch size that costs
nothing (ceiling_source), so the figures say how much of the gap is Spark's.
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

from trio_nsq.spark.publisher import MPubClient
from tests.bench.broker import Broker, publish
from tests.bench.machine import describe, machine, merge_report, process_stat


def channel_stats(http: str, topic: str, channel: str) -> dict:
    # (without clients and memory: polled every 20 ms while it runs, the answer must cost the broker little)
    url = f"{http}/stats?format=json&topic={topic}&channel={channel}&include_clients=false&include_mem=false"
    with urllib.request.urlopen(url, timeout=10) as r:
        for t in json.load(r)["topics"]:
            for c in t["channels"]:
                if t["topic_name"] == topic and c["channel_name"] == channel:
                    return c
    return {}


def timed(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


PHASES = ("latestOffset", "walCommit", "queryPlanning", "addBatch", "commitOffsets", "triggerExecution")


ROLES = ("JVM", "broker", "Spark's Python processes")


def process_cpu(broker_pid: int) -> dict[int, tuple[str, float]]:
    """CPU-seconds (user + system) used so far by each process under this one, with its role: the broker,
    the JVM, or Spark's Python processes (the stream source's, the workers'), from /proc."""
    parent, cpu, program = {}, {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            parent[pid], cpu[pid] = process_stat(pid)
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                program[pid] = os.path.basename(fh.read().split(b"\0")[0])
        except OSError:
            continue
    me, out = os.getpid(), {}
    for pid, seconds in cpu.items():
        ancestor = parent.get(pid, 0)
        while ancestor not in (me, 0, 1):
            ancestor = parent.get(ancestor, 0)
        if ancestor == me and pid in program:
            out[pid] = ("broker" if pid == broker_pid else "JVM" if program[pid] == b"java" else ROLES[2], seconds)
    return out


def cpu_between(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU-seconds by role between two process_cpu() calls: a process started in between counts from
    zero; one that ended in between is not counted (Spark's Python workers outlive a query)."""
    out = dict.fromkeys(ROLES, 0.0)
    for pid, (role, seconds) in after.items():
        out[role] += seconds - before.get(pid, (role, 0.0))[1]
    return out


def shown_cpu(cpu: dict[str, float]) -> str:
    return ", ".join(f"{role} {cpu[role]:.2f}" for role in ROLES) + f" (all {sum(cpu.values()):.2f})"


def stream_read(spark, broker: Broker, topic: str, count: int, scratch: str,
                options: dict[str, str]) -> tuple[float, float, dict[str, float]]:
    """Seconds from the query's start until `count` messages were read into a noop sink and FIN'd (each
    after the commit of its micro-batch); the messages/s of its micro-batches that carried messages
    (their rows over their trigger durations: the sustained rate, without the query's start); and where
    the time went: seconds from start() to the first micro-batch, each phase of Spark's
    StreamingQueryProgress.durationMs summed over the micro-batches, and the CPU-seconds of each
    process role (process_cpu) over the query."""
    reader = spark.readStream.format("nsq").option("topic", topic).option("channel", "bench") \
        .option("nsqd_tcp_address", broker.tcp_address)
    for key, value in options.items():
        reader = reader.option(key, value)
    processes = process_cpu(broker.proc.pid)
    start, started_at = time.perf_counter(), time.time()
    query = reader.load().writeStream.format("noop").option("checkpointLocation", f"{scratch}/{topic}").start()
    try:
        while True:
            assert query.isActive, query.exception()
            s = channel_stats(broker.http_url, topic, "bench")
            if s and s["message_count"] == count and s["depth"] == 0 and s["in_flight_count"] == 0:
                elapsed = time.perf_counter() - start
                cpu = cpu_between(processes, process_cpu(broker.proc.pid))
                progress = query.recentProgress
                busy = [p for p in progress if p["numInputRows"]]
                sustained = sum(p["numInputRows"] for p in busy) / (
                    sum(p["durationMs"]["triggerExecution"] for p in busy) / 1000)
                first = datetime.datetime.fromisoformat(progress[0]["timestamp"].replace("Z", "+00:00"))
                phases = {"start to first micro-batch": first.timestamp() - started_at,
                          "micro-batches": float(len(progress))}
                for phase in PHASES:
                    phases[phase] = sum(p["durationMs"].get(phase, 0) for p in progress) / 1000
                phases.update({f"CPU-s {role}": seconds for role, seconds in cpu.items()})
                return elapsed, sustained, phases
            time.sleep(0.02)
    finally:
        query.stop()


def batch_read(spark, broker: Broker, topic: str, count: int) -> float:
    """Seconds for `spark.read.format("nsq")` of `count` waiting messages into a noop write."""
    start = time.perf_counter()
    spark.read.format("nsq").option("topic", topic).option("channel", "bench") \
        .option("nsqd_tcp_address", broker.tcp_address).option("max_messages", count).load() \
        .write.format("noop").mode("append").save()
    elapsed = time.perf_counter() - start
    s = channel_stats(broker.http_url, topic, "bench")
    assert (s["message_count"], s["depth"], s["in_flight_count"]) == (count, 0, 0), s
    return elapsed


def ceiling_source():
    """Spark's own ceiling for a Python stream source of the nsq schema: a DataSource ("nsq-ceiling") that
    serves `rows` rows in micro-batches of `batch`, two tasks each (as the nsq source cuts its batches),
    every row built in its task as one Arrow record batch of constants. No NSQ, no driver-side data: what
    Spark itself costs to carry the stream's rows into a sink here. (Defined in a function: pyspark is
    imported by main(), and Spark pickles the classes by value.)"""
    from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

    from trio_nsq.spark.source import SCHEMA, arrow_schema

    class Rows(InputPartition):
        def __init__(self, count: int) -> None:
            self.count = count

    class Reader(DataSourceStreamReader):
        def __init__(self, rows: int, batch: int) -> None:
            self.rows, self.batch = rows, batch

        def initialOffset(self) -> dict:
            return {"rows": 0}

        def latestOffset(self, start: dict, limit=None) -> dict:
            return {"rows": min(self.rows, int(start["rows"]) + self.batch)}

        def partitions(self, start: dict, end: dict) -> list:
            count = int(end["rows"]) - int(start["rows"])
            return [Rows(count // 2), Rows(count - count // 2)]

        def read(self, partition):
            import pyarrow as pa

            n = partition.count
            text = lambda value: pa.repeat(pa.scalar(value, pa.string()), n)  # noqa: E731
            yield pa.record_batch([
                pa.repeat(pa.scalar(b"message-00000001", pa.binary()), n), text("topic"), text("bench"),
                text("0123456789abcdef"), pa.repeat(pa.scalar(1_700_000_000_000_000, pa.timestamp("us", tz="UTC")), n),
                pa.repeat(pa.scalar(1, pa.int32()), n), text("127.0.0.1:4150")], schema=arrow_schema())

        def commit(self, end: dict) -> None:
            pass

    class Ceiling(DataSource):
        @classmethod
        def name(cls) -> str:
            return "nsq-ceiling"

        def schema(self):
            return SCHEMA

        def streamReader(self, schema):
            return Reader(int(self.options["rows"]), int(self.options["batch"]))

    return Ceiling


def stream_ceiling(spark, rows: int, batch: int, scratch: str, name: str) -> tuple[float, float]:
    """Seconds from the query's start until `rows` rows of ceiling_source() reached a noop sink, and the
    rows/s of its micro-batches (as stream_read measures the nsq source)."""
    start = time.perf_counter()
    query = spark.readStream.format("nsq-ceiling").option("rows", rows).option("batch", batch).load() \
        .writeStream.format("noop").option("checkpointLocation", f"{scratch}/{name}").start()
    try:
        while sum(p["numInputRows"] for p in query.recentProgress) < rows:
            assert query.isActive, query.exception()
            time.sleep(0.01)
        elapsed = time.perf_counter() - start
        busy = [p for p in query.recentProgress if p["numInputRows"]]
        return elapsed, rows / (sum(p["durationMs"]["triggerExecution"] for p in busy) / 1000)
    finally:
        query.stop()


def trickle_latency(spark, broker: Broker, scratch: str, rate: int = 100, seconds: float = 6.0) -> list[float]:
    """Seconds from publish (nsqd's timestamp) to the foreachBatch sink, for `rate` messages/s."""
    import threading

    seen: list[float] = []

    def sink(df, _batch_id) -> None:
        now = time.time()
        seen.extend(now - r.timestamp.timestamp() for r in df.select("timestamp").collect())

    query = spark.readStream.format("nsq").option("topic", "trickle").option("channel", "bench") \
        .option("nsqd_tcp_address", broker.tcp_address).load() \
        .writeStream.foreachBatch(sink).option("checkpointLocation", f"{scratch}/trickle").start()
    stop = threading.Event()

    def publisher() -> None:
        with MPubClient([broker.http_address]) as client:
            n = 0
            start = time.monotonic()
            while not stop.is_set() and n < rate * seconds:
                client.publish("trickle", [b"trickle-%d" % n])
                n += 1
                time.sleep(max(0.0, start + n / rate - time.monotonic()))

    try:
        time.sleep(3)  # the query's start, so that what is measured is the steady trickle
        thread = threading.Thread(target=publisher)
        thread.start()
        thread.join()
        deadline = time.monotonic() + 30
        while len(seen) < rate * seconds and time.monotonic() < deadline:
            assert query.isActive, query.exception()
            time.sleep(0.1)
    finally:
        stop.set()
        query.stop()
    return sorted(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--large-messages", type=int, default=1_000_000,
                        help="messages waiting for the stream read that spreads the query's start (0: skip)")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="an option of the streaming source (to measure a variant)")
    parser.add_argument("--broker-flag", action="append", default=[], help="a flag for the broker")
    parser.add_argument("--skip-write", action="store_true")
    parser.add_argument("--output", default="", help="merge the figures into this JSON file (bench-results.json)")
    args = parser.parse_args()
    options = dict(o.split("=", 1) for o in args.option)
    info = machine()
    print(f"machine: {describe(info)}")

    from pyspark.sql import SparkSession

    # Spark's Python workers run this interpreter (the venv with pyarrow and the package)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

    from trio_nsq.spark import NSQDataSource

    broker = Broker(*args.broker_flag)
    scratch = tempfile.mkdtemp(prefix="trio-nsq-spark-bench-")
    spark = (SparkSession.builder.master("local[2]").appName("trio-nsq-bench")
             .config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.host", "127.0.0.1")
             .config("spark.ui.enabled", "false").config("spark.local.dir", scratch).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(NSQDataSource)
    spark.dataSource.register(ceiling_source())
    # Spark's ceiling runs in the reads' micro-batch size
    from trio_nsq.spark.options import READ_OPTIONS
    batch_size = int(options.get("max_messages_per_batch", READ_OPTIONS["max_messages_per_batch"][0]))
    http = broker.http_address
    results: dict[str, float] = {}
    try:
        with urllib.request.urlopen(f"{broker.http_url}/info", timeout=10) as r:
            supported = json.load(r).get("idempotent_publish") is True
        df = spark.range(args.rows, numPartitions=args.partitions) \
            .selectExpr("concat('message-', lpad(CAST(id AS STRING), 8, '0')) AS value").cache()
        df.count()

        def nsq(topic: str, idempotent: str, frame=df):
            return lambda: frame.write.format("nsq").option("nsqd_http_address", http).option("topic", topic) \
                .option("idempotent", idempotent).mode("append").save()

        df.write.format("noop").mode("append").save()
        nsq("warm-up", "true")()
        if not args.skip_write:
            print(f"write: {args.rows} rows in {args.partitions} partitions, median of {args.runs} "
                  f"(broker idempotent_publish: {supported})")
            for name, fn in [("noop", lambda: df.write.format("noop").mode("append").save()),
                             ("nsq idempotent=true", nsq("idem-on", "true")),
                             ("nsq idempotent=false", nsq("idem-off", "false"))]:
                seconds = timed(fn, args.runs)
                results[f"write {name} rows/s"] = args.rows / seconds
                print(f"  {name:22} {args.rows / seconds:>12,.0f} rows/s  ({seconds:.2f} s)", flush=True)

        shown = ", ".join(f"{k}={v}" for k, v in options.items()) or "default options"
        print(f"read: {args.messages} messages waiting on one broker, median of {args.runs} ({shown}; broker "
              f"flags: {' '.join(args.broker_flag) or 'defaults'})")
        # a warm-up query: the first one of a session starts the source's Python worker
        publish(http, "read-warm-up", 1000)
        stream_read(spark, broker, "read-warm-up", 1000, scratch, options)
        publish(http, "batch-warm-up", 1000)
        batch_read(spark, broker, "batch-warm-up", 1000)
        stream_ceiling(spark, 1000, batch_size, scratch, "ceiling-warm-up")
        stream, sustained, batch, breakdowns, ceiling, large_ceiling = [], [], [], [], [], []
        for run in range(args.runs):
            publish(http, f"stream-{run}", args.messages)
            elapsed, rate, phases = stream_read(spark, broker, f"stream-{run}", args.messages, scratch, options)
            stream.append(args.messages / elapsed)
            sustained.append(rate)
            breakdowns.append(phases)
            print(f"  readStream -> noop        {stream[-1]:>12,.0f} messages/s from the query's start "
                  f"({elapsed:.2f} s); {rate:,.0f} messages/s in its micro-batches", flush=True)
            print("    where the time went (s): " + ", ".join(
                f"{k} {v:.0f}" if k == "micro-batches" else f"{k} {v:.2f}" for k, v in phases.items()), flush=True)
            elapsed, rate = stream_ceiling(spark, args.messages, batch_size, scratch, f"ceiling-{run}")
            ceiling.append(args.messages / elapsed)
            print(f"  Spark's own ceiling       {ceiling[-1]:>12,.0f} rows/s from the query's start "
                  f"({elapsed:.2f} s); {rate:,.0f} rows/s in its micro-batches", flush=True)
            publish(http, f"batch-{run}", args.messages)
            batch.append(args.messages / batch_read(spark, broker, f"batch-{run}", args.messages))
            print(f"  read (batch) -> noop      {batch[-1]:>12,.0f} messages/s", flush=True)
        # the same rows both ways: --large-messages rows written by df.write.format("nsq") (idempotent),
        # then read back by a stream query from its start
        large, large_write = [], []
        if args.large_messages:
            large_df = spark.range(args.large_messages, numPartitions=args.partitions) \
                .selectExpr("concat('message-', lpad(CAST(id AS STRING), 8, '0')) AS value").cache()
            large_df.count()
        large_cpu: dict[str, list[dict[str, float]]] = {"write": [], "readStream": []}
        for run in range(args.runs if args.large_messages else 0):
            processes = process_cpu(broker.proc.pid)
            started = time.perf_counter()
            nsq(f"large-{run}", "true", large_df)()
            large_write.append(args.large_messages / (time.perf_counter() - started))
            large_cpu["write"].append(cpu_between(processes, process_cpu(broker.proc.pid)))
            elapsed, rate, phases = stream_read(spark, broker, f"large-{run}", args.large_messages, scratch, options)
            large.append(args.large_messages / elapsed)
            print(f"  {args.large_messages:,} rows: write {large_write[-1]:>10,.0f} rows/s; readStream -> noop "
                  f"{large[-1]:>10,.0f} messages/s from the query's start ({elapsed:.2f} s, "
                  f"{phases['micro-batches']:.0f} micro-batches), {rate:,.0f} messages/s in its micro-batches",
                  flush=True)
            large_cpu["readStream"].append({role: phases[f"CPU-s {role}"] for role in ROLES})
            print(f"    CPU-seconds: the write {shown_cpu(large_cpu['write'][-1])}; the read "
                  f"{shown_cpu(large_cpu['readStream'][-1])}", flush=True)
            elapsed, rate = stream_ceiling(spark, args.large_messages, batch_size, scratch, f"large-ceiling-{run}")
            large_ceiling.append(args.large_messages / elapsed)
            print(f"  {args.large_messages:,} rows: Spark's own ceiling {large_ceiling[-1]:>10,.0f} rows/s from the "
                  f"query's start ({elapsed:.2f} s), {rate:,.0f} rows/s in its micro-batches", flush=True)
        latencies = trickle_latency(spark, broker, scratch)
        if latencies:
            results["trickle 100 msg/s latency p50 s"] = latencies[len(latencies) // 2]
            results["trickle 100 msg/s latency max s"] = latencies[-1]
            print(f"  trickle of 100 msg/s -> foreachBatch: {len(latencies)} messages, publish to sink p50 "
                  f"{latencies[len(latencies) // 2]:.2f} s, max {latencies[-1]:.2f} s", flush=True)
        results["readStream messages/s"] = statistics.median(stream)
        results["readStream sustained messages/s"] = statistics.median(sustained)
        for phase in breakdowns[0]:
            results[f"readStream {phase} (s, median)"] = statistics.median(b[phase] for b in breakdowns)
        results["read messages/s"] = statistics.median(batch)
        results["Spark ceiling rows/s"] = statistics.median(ceiling)
        results["readStream / Spark ceiling"] = results["readStream messages/s"] / results["Spark ceiling rows/s"]
        if large:
            results[f"readStream {args.large_messages} messages/s"] = statistics.median(large)
            results[f"write nsq idempotent=true {args.large_messages} rows/s"] = statistics.median(large_write)
            results[f"readStream {args.large_messages} / write"] = statistics.median(large) / statistics.median(large_write)
            results[f"Spark ceiling {args.large_messages} rows/s"] = statistics.median(large_ceiling)
            results[f"readStream {args.large_messages} / Spark ceiling"] = \
                statistics.median(large) / statistics.median(large_ceiling)
            results[f"Spark ceiling {args.large_messages} / write"] = \
                statistics.median(large_ceiling) / statistics.median(large_write)
            for step, samples in large_cpu.items():
                for role in (*ROLES, "all"):
                    results[f"{step} {args.large_messages} CPU-s {role} (median)"] = statistics.median(
                        sum(c.values()) if role == "all" else c[role] for c in samples)
        write = results.get("write nsq idempotent=true rows/s")
        if write:
            results["readStream / write"] = results["readStream messages/s"] / write
            results["Spark ceiling / write"] = results["Spark ceiling rows/s"] / write
        print(f"readStream (median) {results['readStream messages/s']:,.0f} messages/s"
              + (f" ({results['readStream / write']:.2f}x the write)" if write else "")
              + (f", {statistics.median(large):,.0f} with {args.large_messages:,} waiting" if large else "")
              + (f" ({statistics.median(large) / statistics.median(large_write):.2f}x the write of the same "
                 f"{args.large_messages:,} rows, {statistics.median(large_write):,.0f} rows/s)" if large else "")
              + f"; read (batch) {results['read messages/s']:,.0f} messages/s")
        print(f"Spark's own ceiling for a Python stream source of this schema, in micro-batches of {batch_size:,}: "
              f"{results['Spark ceiling rows/s']:,.0f} rows/s ("
              + (f"{results['Spark ceiling / write']:.2f}x the write; " if write else "") + "readStream is "
              f"{results['readStream / Spark ceiling']:.2f}x it)"
              + (f", {statistics.median(large_ceiling):,.0f} with {args.large_messages:,} rows "
                 f"({statistics.median(large_ceiling) / statistics.median(large_write):.2f}x the write; readStream "
                 f"is {statistics.median(large) / statistics.median(large_ceiling):.2f}x it)" if large else ""))
    finally:
        spark.stop()
        broker.close()
        shutil.rmtree(scratch, ignore_errors=True)
    if args.output:
        merge_report(args.output, {"title": "PySpark connector, local[2] (write rows/s, read messages/s)",
                                   "machine": info,
                                   "rows": args.rows, "messages": args.messages,
                                   "large_messages": args.large_messages, "runs": args.runs,
                                   "figures": results}, "results", "spark")
        print(f"merged into {args.output} (results.spark)")


if __name__ == "__main__":
    main()
