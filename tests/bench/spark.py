"""Spark connector figures (not a test): rows/s of `df.write.format("nsq")` with `idempotent` on and off,
against Spark's `noop` format on the same DataFrame, and messages/s read by `readStream.format("nsq")`.

    .venv/bin/python -m tests.bench.spark [--rows 100000] [--partitions 8] [--runs 3] [--messages 100000]
                                          [--max-in-flight 2500]

One local[2] SparkSession and one trio-nsqd on loopback; each figure is the median of --runs, after a
warm-up write (the first Python write of a session starts and imports the workers).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request

from trio_nsq.shared.spark.publisher import MPubClient
from tests.bench.broker import Broker


def channel_stats(http: str, topic: str, channel: str) -> dict:
    with urllib.request.urlopen(f"{http}/stats?format=json&topic={topic}&channel={channel}", timeout=10) as r:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--max-in-flight", type=int, default=2500,
                        help="the source's max_in_flight (the broker's --max-rdy-count is raised to match)")
    args = parser.parse_args()

    from pyspark.sql import SparkSession

    # Spark's Python workers run this interpreter (the venv with pyarrow and the package)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

    from trio_nsq.shared.spark import NSQDataSource

    broker = Broker(f"--max-rdy-count={max(2500, args.max_in_flight)}")
    scratch = tempfile.mkdtemp(prefix="trio-nsq-spark-bench-")
    spark = (SparkSession.builder.master("local[2]").appName("trio-nsq-bench")
             .config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.host", "127.0.0.1")
             .config("spark.ui.enabled", "false").config("spark.local.dir", scratch).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(NSQDataSource)
    http = broker.http_address
    tcp = broker.tcp_address
    try:
        with urllib.request.urlopen(f"{broker.http_url}/info", timeout=10) as r:
            supported = json.load(r).get("idempotent_publish") is True
        df = spark.range(args.rows, numPartitions=args.partitions) \
            .selectExpr("concat('row-', CAST(id AS STRING)) AS value").cache()
        df.count()

        def nsq(topic: str, idempotent: str):
            return lambda: df.write.format("nsq").option("nsqd_http_address", http).option("topic", topic) \
                .option("idempotent", idempotent).mode("append").save()

        df.write.format("noop").mode("append").save()
        nsq("warm-up", "true")()
        figures = {
            "noop": timed(lambda: df.write.format("noop").mode("append").save(), args.runs),
            "nsq idempotent=true": timed(nsq("idem-on", "true"), args.runs),
            "nsq idempotent=false": timed(nsq("idem-off", "false"), args.runs),
        }
        print(f"write: {args.rows} rows in {args.partitions} partitions, median of {args.runs} "
              f"(broker idempotent_publish: {supported})")
        for name, seconds in figures.items():
            print(f"  {name:22} {args.rows / seconds:>12,.0f} rows/s  ({seconds:.2f} s)")

        with MPubClient([http]) as client:
            bodies = [b"message-%08d" % i for i in range(args.messages)]
            for i in range(0, len(bodies), 5000):
                client.publish("read", bodies[i:i + 5000])
        stream = spark.readStream.format("nsq").option("topic", "read").option("channel", "bench") \
            .option("nsqd_tcp_address", tcp) \
            .option("max_in_flight", args.max_in_flight).load()
        start = time.perf_counter()
        query = stream.writeStream.format("noop").option("checkpointLocation", f"{scratch}/checkpoint") \
            .trigger(processingTime="100 milliseconds").start()
        try:
            while True:
                assert query.isActive, query.exception()
                s = channel_stats(broker.http_url, "read", "bench")
                if s and s["message_count"] == args.messages and s["depth"] == 0 and s["in_flight_count"] == 0:
                    break
                time.sleep(0.05)
            elapsed = time.perf_counter() - start
        finally:
            query.stop()
        print(f"read: {args.messages} messages through readStream (noop sink, max_in_flight {args.max_in_flight}), "
              f"read and FIN'd after commit (including the query's start): {args.messages / elapsed:,.0f} "
              f"messages/s ({elapsed:.2f} s)")
    finally:
        spark.stop()
        broker.close()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
