"""NSQ -> Spark -> NSQ, exactly once: read a topic by position, upper-case each message, publish the result to
another topic, with a checkpoint. Killed at any moment and started again on the same checkpoint, it
publishes every input message to the output once.

    make run                                   # in another shell: trio-nsqd on 127.0.0.1:4151
    # the input topic must keep its messages in its log: have it read by position once, before publishing
    # (this program does it too when it starts; what was published before is not in the log)
    curl -X POST 'http://127.0.0.1:4151/topic/create?topic=spark-in'
    curl 'http://127.0.0.1:4151/log/positions?topic=spark-in'
    for i in $(seq 100); do curl -s -d "hello $i" 'http://127.0.0.1:4151/pub?topic=spark-in' >/dev/null; done

    python examples/spark_exactly_once.py --available-now    # what the input holds now, then it stops
    python examples/spark_exactly_once.py                    # or runs on (Ctrl-C stops it)
    nsq_tail --nsqd-tcp-address=127.0.0.1:4150 --topic=spark-out

Needs the spark extra (pip install -e '.[spark]') and Java 17. Options (or environment): --nsqd-http
(NSQD_HTTP, comma-separated for several brokers), --input / --output (INPUT_TOPIC, OUTPUT_TOPIC),
--checkpoint (CHECKPOINT_DIR), --cursor (CURSOR: the query's durable cursor, a channel of the input
topic whose depth is the query's lag), --max-offsets-per-trigger, --trigger-seconds, --batch-size.

How it is exactly once (trio_nsq/spark/README.md, "End to end exactly once"):
- the reader's offsets are positions in each broker's log, written to the checkpoint before a micro-batch
  runs: a micro-batch replayed after a crash reads the same range, so the same rows in the same order;
- the writer keys each /mpub request with its rows' positions (idempotency_key_column): the replay sends
  the same requests with the same keys, and the broker publishes each key once (for its
  --idempotency-window, 24 h by default). Across a broker's own kill -9 the keys survive: the output
  topic is read by position (the example asks /log/positions of it first, or create it so), so its
  messages go to its log, and each key is journalled with where they end.

For tests only: SPARK_EXACTLY_ONCE_BATCH_LOG=<file> appends one JSON line per row read, {"batch",
"partition", "attempt", "nsqd_address", "position"}; SPARK_EXACTLY_ONCE_HOLD=<batch id>:<seconds> holds
that micro-batch's second task (partition 1: with two brokers, the second's range) that long at its first
row, so that the first task publishes its part of the micro-batch while the micro-batch cannot commit:
a moment to kill it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request

BATCH_LOG = "SPARK_EXACTLY_ONCE_BATCH_LOG"
HOLD = "SPARK_EXACTLY_ONCE_HOLD"


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nsqd-http", default=env("NSQD_HTTP", "127.0.0.1:4151"),
                        help="trio-nsqd HTTP address(es), comma-separated (default %(default)s)")
    parser.add_argument("--input", default=env("INPUT_TOPIC", "spark-in"), help="topic to read (%(default)s)")
    parser.add_argument("--output", default=env("OUTPUT_TOPIC", "spark-out"), help="topic to write (%(default)s)")
    parser.add_argument("--checkpoint", default=env("CHECKPOINT_DIR", "./spark-exactly-once-checkpoint"),
                        help="the query's checkpoint directory: keep it to restart where it stopped")
    parser.add_argument("--cursor", default=env("CURSOR", "spark-exactly-once"),
                        help="the query's durable cursor (a channel of the input topic): one name per query")
    parser.add_argument("--available-now", action="store_true",
                        help="read what the input holds when the query starts, then stop (Trigger.AvailableNow)")
    parser.add_argument("--max-offsets-per-trigger", type=int, default=None, help="records per micro-batch, at most")
    parser.add_argument("--trigger-seconds", type=float, default=1.0,
                        help="without --available-now: a micro-batch every so many seconds (%(default)s)")
    parser.add_argument("--batch-size", type=int, default=5000, help="messages per /mpub request (%(default)s)")
    return parser.parse_args(argv)


def prepare_input(addresses: list[str], topic: str) -> None:
    """Have the topic read by position on each broker: from now on every message goes to its log."""
    for address in addresses:
        base = f"http://{address}"
        urllib.request.urlopen(urllib.request.Request(f"{base}/topic/create?topic={topic}", method="POST"),
                               timeout=10).close()
        urllib.request.urlopen(f"{base}/log/positions?topic={topic}", timeout=10).close()


_held: set[int] = set()  # (test hook) the task attempts already held, in this Python worker


def tap(address: str, position: int) -> int:
    """A UDF, for tests: the row's position unchanged; logs (micro-batch, partition, attempt, broker, position),
    and holds the first row of one micro-batch's partition 1 (of two or more) for a while, so that the other
    task publishes its part of the micro-batch long before this one."""
    import time

    from pyspark import TaskContext

    context = TaskContext.get()
    log = os.environ.get(BATCH_LOG)
    if log:
        line = {"batch": int(context.getLocalProperty("streaming.sql.batchId")), "partition": context.partitionId(),
                "attempt": context.attemptNumber(), "nsqd_address": address, "position": position}
        with open(log, "a") as fh:  # one short line per write: tasks in other processes do not mix them
            fh.write(json.dumps(line) + "\n")
    batch, _, seconds = (os.environ.get(HOLD) or "").partition(":")
    if batch and context.getLocalProperty("streaming.sql.batchId") == batch and context.partitionId() == 1 \
            and context.taskAttemptId() not in _held:
        _held.add(context.taskAttemptId())
        time.sleep(float(seconds))
    return position


def start(spark, args: argparse.Namespace):
    """The query: read by position, upper-case, publish keyed by the rows' positions."""
    addresses = [a.strip() for a in args.nsqd_http.split(",") if a.strip()]
    reader = (spark.readStream.format("nsq")
              .option("mode", "log")
              .option("topic", args.input)
              .option("nsqd_http_address", ",".join(addresses))
              .option("channel", args.cursor)  # the same name on every restart from this checkpoint
              .option("startingOffsets", "earliest"))  # a new checkpoint starts at each broker's first record
    if args.max_offsets_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", str(args.max_offsets_per_trigger))
    stream = reader.load()
    if os.environ.get(BATCH_LOG) or os.environ.get(HOLD):
        from pyspark.sql.functions import col, udf

        hook = udf(tap, "long", useArrow=False).asNondeterministic()
        stream = stream.withColumn("position", hook(col("nsqd_address"), col("position")))
    # the key of a row is where it was read: its position, and its broker when there are several (each broker
    # has its own positions)
    key = "position" if len(addresses) == 1 else "concat_ws('/', nsqd_address, CAST(position AS STRING))"
    out = stream.selectExpr("upper(CAST(value AS STRING)) AS value", f"{key} AS source")
    writer = (out.writeStream.format("nsq")
              .option("topic", args.output)
              .option("nsqd_http_address", ",".join(addresses))
              .option("idempotency_key_column", "source")  # not sent: only the value is the message
              .option("batch_size", str(args.batch_size))
              .option("checkpointLocation", args.checkpoint))
    if args.available_now:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{args.trigger_seconds} seconds")
    return writer.start()


def session():
    from pyspark.sql import SparkSession

    from trio_nsq.spark import NSQDataSource

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the workers use this interpreter too
    builder = (SparkSession.builder.master("local[2]").appName("nsq-exactly-once")
               .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2"))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    spark.dataSource.register(NSQDataSource)  # or nothing: the installed `pyspark_nsq` module is found on its own
    return spark


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    brokers = [a.strip() for a in args.nsqd_http.split(",") if a.strip()]
    prepare_input(brokers, args.input)
    # the output too: its messages then go to its log, and each request's key is journalled with them,
    # so a broker's kill -9 keeps both (a replayed micro-batch publishes nothing twice)
    prepare_input(brokers, args.output)
    spark = session()
    try:
        query = start(spark, args)
        print(f"reading {args.input!r} by position, writing {args.output!r} (checkpoint {args.checkpoint})",
              flush=True)
        try:
            query.awaitTermination()
        except KeyboardInterrupt:
            query.stop()
        except Exception as exc:  # (StreamingQueryException: the query failed)
            print(f"the query failed: {exc}", file=sys.stderr)
            return 1
        rows = sum(p["numInputRows"] for p in query.recentProgress)
        print(f"done: {rows} rows in the last {len(query.recentProgress)} micro-batches", flush=True)
        return 0
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
