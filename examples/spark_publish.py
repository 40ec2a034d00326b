"""Publish a Spark DataFrame to NSQ with the connector in trio_nsq/spark, then read the topic's count in /stats.

    make run                              # in another shell: nsqd on 127.0.0.1:4151
    python examples/spark_publish.py      # needs the spark extra: pip install -e '.[spark]', and Java 17
    nsq_tail --nsqd-tcp-address=127.0.0.1:4150 --topic=spark-example    # to see the messages

NSQD_HTTP=host:port and TOPIC=name change where it publishes.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request


def message_count(nsqd_http: str, topic: str) -> int:
    with urllib.request.urlopen(f"http://{nsqd_http}/stats?format=json&topic={topic}", timeout=10) as response:
        topics = json.load(response).get("topics") or []
    return sum(t["message_count"] for t in topics if t["topic_name"] == topic)


def main(spark, nsqd_http: str, topic: str, rows: int = 1000) -> int:
    """Write `rows` rows as JSON messages; return how many the broker counted."""
    before = message_count(nsqd_http, topic)
    df = spark.range(rows, numPartitions=2).selectExpr("id", "concat('event-', CAST(id AS STRING)) AS name")
    # no `value` column: each row becomes one JSON object, {"id":0,"name":"event-0"}
    (df.write.format("nsq")
       .option("topic", topic)
       .option("nsqd_http_address", nsqd_http)
       .mode("append")  # the only save mode a topic has
       .save())
    published = message_count(nsqd_http, topic) - before
    print(f"published {rows} rows to topic {topic!r}: the broker counted {published} new messages")
    return published


if __name__ == "__main__":
    from pyspark.sql import SparkSession

    from trio_nsq.spark import NSQDataSource

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the workers use this interpreter too
    spark = (SparkSession.builder.master("local[2]").appName("nsq-example")
             .config("spark.ui.enabled", "false").getOrCreate())
    spark.sparkContext.setLogLevel("WARN")
    spark.dataSource.register(NSQDataSource)  # or nothing: the installed `pyspark_nsq` module is found on its own
    try:
        main(spark, os.environ.get("NSQD_HTTP", "127.0.0.1:4151"), os.environ.get("TOPIC", "spark-example"))
    finally:
        spark.stop()
