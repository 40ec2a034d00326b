"""Idempotent writes (the `idempotent` option, default true): every /mpub request of a Spark write carries
an `Idempotency-Key` that is the same when Spark runs the same work again, so a task that fails part-way
and is run again publishes each row once on a broker that supports keys (trio-nsqd with
"idempotent_publish" in /info). With idempotent=false the same job publishes duplicates.

The Spark tests use the shared local[2,2] session of tests/conftest.py (a failed task is run once more).
"""

from __future__ import annotations

import logging
from collections import Counter

import pytest
from processes import BrokerProcess
from test_spark import Scripted, consume, nsq_write, scripted  # noqa: F401 - scripted is a fixture

from trio_nsq.spark.publisher import MPubClient


class KeyedHandler(Scripted.Handler):
    """Scripted's handler, recording each POST's Idempotency-Key and answering /info as configured."""

    def do_GET(self):
        if self.path == "/info":
            info = self.server.config.get("info")
            self._answer(200, info) if info is not None else self._answer(404, {"message": "NOT_FOUND"})
        else:
            super().do_GET()

    def do_POST(self):
        self.server.keys.append(self.headers.get("Idempotency-Key"))
        super().do_POST()


def keyed_server(scripted, script, info, **kw):
    server = scripted(script, **kw)
    server.RequestHandlerClass = KeyedHandler
    server.keys = []
    server.config["info"] = info
    return server


def test_a_retried_request_reuses_its_key_and_pieces_get_stable_keys(scripted):
    server = keyed_server(scripted, [(503, "EXITING")], {"version": "1.3.0", "idempotent_publish": True})
    with MPubClient([server.address], retry_backoff=0.01, sleep=lambda s: None) as client:
        client.publish("t", [b"a", b"b"], key="w/3/0")
        client.publish("t", [b"c"], key="w/3/1")
    assert server.keys == ["w/3/0", "w/3/0", "w/3/1"]  # the 503 and its retry: one key

    # a batch over the broker's body limit goes in pieces, each keyed by its position: the same every run
    for _ in range(2):
        server = keyed_server(scripted, [], {"idempotent_publish": True}, max_body_size=4 + 3 * 14)
        with MPubClient([server.address]) as client:
            client.publish("t", [b"m" * 10] * 7, key="k")
        assert server.keys == ["k.0", "k.1", "k.2"]


def test_a_broker_without_the_flag_gets_no_key_and_it_is_logged_once(scripted, caplog):
    import trio_nsq.spark.publisher as publisher

    publisher._said_at_least_once.clear()
    caplog.set_level(logging.WARNING, logger="trio_nsq.spark")
    server = keyed_server(scripted, [], {"version": "1.3.0"})  # Go nsqd's /info
    for _ in range(3):
        with MPubClient([server.address]) as client:
            client.publish("t", [b"x"], key="w/0/0")
    assert server.keys == [None, None, None]
    assert caplog.text.count("delivery is at least once") == 1
    assert "does not support Idempotency-Key" in caplog.text


# --- with Spark, against a real broker ---------------------------------------------------------------


def value_failing_once(fail_at: int):
    """A UDF: the row's body, except that on the task's first attempt row `fail_at` of each partition of
    12,500 gets none. The writer refuses a null value (NSQRowError) at the record batch holding it, after
    publishing the batches before it: so the first attempt of every task fails part-way, having published
    part of its partition, and Spark runs it again from the start of the partition."""

    def value(i):
        from pyspark import TaskContext  # runs in Spark's Python worker

        if TaskContext.get().attemptNumber() == 0 and i % 12_500 == fail_at:
            return None
        return f"row-{i}"

    return value


def write_failing_once(spark, broker: BrokerProcess, topic: str, idempotent: str) -> None:
    from pyspark.sql.functions import udf

    value = udf(value_failing_once(6000), "string")
    df = spark.range(100_000, numPartitions=8).select(value("id").alias("value"))
    # the writer gets record batches of 1000 rows: 6 of them (5 /mpub batches of 1000) before the bad row
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "1000")
    try:
        nsq_write(df, broker, topic=topic, batch_size="1000", idempotent=idempotent).save()
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")


# every failed first attempt had published 5 batches of 1000 rows before failing: without idempotent
# writes they come again with the retry (8 tasks × 5000), with them the broker publishes each key once
@pytest.mark.parametrize("idempotent, duplicates", [("true", 0), ("false", 8 * 5000)])
def test_a_task_failing_part_way_publishes_each_row_once_only_with_idempotent_writes(
        spark, module_broker, idempotent, duplicates):
    topic = f"failing_once_{idempotent}"
    write_failing_once(spark, module_broker, topic, idempotent)
    bodies = consume(module_broker, topic, 100_000 + duplicates, quiet=1.0)
    counts = Counter(bodies)
    assert set(counts) == {b"row-%d" % i for i in range(100_000)}
    twice = sum(1 for c in counts.values() if c > 1)
    assert len(bodies) == 100_000 + duplicates and twice == duplicates, f"{len(bodies)} messages, {twice} rows more than once"


def test_idempotent_option_is_checked(spark, module_broker):
    df = spark.createDataFrame([("x",)], "value string")
    with pytest.raises(Exception, match="idempotent='maybe' must be true or false"):
        nsq_write(df, module_broker, topic="t", idempotent="maybe").save()
