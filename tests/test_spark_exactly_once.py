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


# --- idempotency_key_column: requests keyed by their rows' source, not by Spark's numbers ---------------


def mpub_bodies(data: bytes) -> list[bytes]:
    """The messages of a binary /mpub body: [count u32] then [size u32][bytes] each."""
    import struct

    (count,), at, out = struct.unpack_from(">I", data), 4, []
    for _ in range(count):
        (size,) = struct.unpack_from(">I", data, at)
        out.append(data[at + 4:at + 4 + size])
        at += 4 + size
    assert at == len(data)
    return out


def keyed_settings(address: str, **kw):
    from trio_nsq.spark.options import WriteSettings

    base = dict(topic="out", has_value=True, key_field=None, addresses=(address,), batch_size=3,
                max_body_size=1 << 20, max_retries=0, retry_backoff=0.0, retry_backoff_max=0.0, timeout=10.0,
                key_column="position")
    return WriteSettings(**{**base, **kw})


def test_rows_key_depends_on_every_row_key_and_fits_the_broker():
    from trio_nsq.broker.idempotency import valid_key
    from trio_nsq.spark.publisher import rows_key

    keys = [1 << 40, (1 << 40) + 37, (1 << 40) + 90]
    assert rows_key(keys) == rows_key(list(keys))  # a function of the keys alone
    assert rows_key(keys).startswith(f"rows/{keys[0]}..{keys[-1]}/3/")
    # same ends and count, another row inside: another key (a digest covers every key)
    assert rows_key([keys[0], keys[1] + 1, keys[2]]) != rows_key(keys)
    assert rows_key([str(k) for k in keys]) != rows_key(keys)  # "5" and 5 are other keys
    long = ["127.0.0.1:4151/" + "x" * 300 + str(i) for i in range(2)] + ["é/1", "tab\there"]
    for sample in ([0], keys, long, ["a/b"] * 5000):
        key = rows_key(sample)
        # a piece of a request cut in two, and a half of that, adds a suffix: still a valid key
        assert valid_key(key) and valid_key(key + ".12.h1") and len(key) <= 140, key


def test_a_request_key_comes_from_its_rows_so_the_same_rows_publish_once_whatever_the_batch(scripted):
    """publish_partition (a task's work) without Spark: the same rows, in another micro-batch of another
    query, cut into other record batches, send the same requests with the same keys."""
    import pyarrow as pa

    from trio_nsq.spark.datasource import publish_partition
    from trio_nsq.spark.publisher import rows_key

    positions = [100 + 40 * i for i in range(7)]
    values = [f"v{i}" for i in range(7)]
    runs = []
    for prefix, cuts in (("query-a/3", [7]), ("query-b/0", [2, 4, 1]), ("query-a/9", [1] * 7)):
        server = keyed_server(scripted, [], {"idempotent_publish": True})
        at, batches = 0, []
        for n in cuts:
            batches.append(pa.record_batch({"value": values[at:at + n], "position": pa.array(positions[at:at + n],
                                                                                            pa.int64())}))
            at += n
        done = publish_partition(keyed_settings(server.address), iter(batches), prefix)
        assert (done.messages, done.requests) == (7, 3)
        runs.append((server.keys, [mpub_bodies(body) for _, body, _ in server.posts]))
    assert runs[0] == runs[1] == runs[2]
    keys, requests = runs[0]
    assert requests == [[b"v0", b"v1", b"v2"], [b"v3", b"v4", b"v5"], [b"v6"]]  # the value only: no position
    assert keys == [rows_key(positions[0:3]), rows_key(positions[3:6]), rows_key(positions[6:7])]
    assert not any("query" in k for k in keys)

    # without the option: the keys carry the query and batch (the default, unchanged)
    server = keyed_server(scripted, [], {"idempotent_publish": True})
    rb = pa.record_batch({"value": values, "position": pa.array(positions, pa.int64())})
    publish_partition(keyed_settings(server.address, key_column=None), iter([rb]), "query-a/3")
    assert server.keys == ["query-a/3/0/0", "query-a/3/0/1", "query-a/3/0/2"]


def test_the_key_column_is_left_out_of_json_rows_and_a_null_key_sends_nothing(scripted):
    import pyarrow as pa

    from trio_nsq.spark.datasource import publish_partition
    from trio_nsq.spark.publisher import rows_key
    from trio_nsq.spark.rows import NSQRowError

    server = keyed_server(scripted, [], {"idempotent_publish": True})
    rb = pa.record_batch({"id": pa.array([1, 2], pa.int64()), "src": ["127.0.0.1:4151/30", "127.0.0.1:4151/60"]})
    publish_partition(keyed_settings(server.address, has_value=False, key_column="src"), iter([rb]), "q/0")
    assert mpub_bodies(server.posts[0][1]) == [b'{"id":1}', b'{"id":2}']
    assert server.keys == [rows_key(["127.0.0.1:4151/30", "127.0.0.1:4151/60"])]

    # the key column may be the value itself (a message is its own key)
    server = keyed_server(scripted, [], {"idempotent_publish": True})
    publish_partition(keyed_settings(server.address, key_column="value"), iter([pa.record_batch({"value": ["a"]})]),
                      "q/0")
    assert mpub_bodies(server.posts[0][1]) == [b"a"] and server.keys == [rows_key(["a"])]

    server = keyed_server(scripted, [], {"idempotent_publish": True})
    bad = pa.record_batch({"value": ["a", "b"], "position": pa.array([1, None], pa.int64())})
    good = pa.record_batch({"value": ["c", "d"], "position": pa.array([5, 6], pa.int64())})
    with pytest.raises(NSQRowError, match="row 3 of this partition has a null in its idempotency_key_column"):
        publish_partition(keyed_settings(server.address, batch_size=1), iter([good, bad]), "q/0")
    # "c" went when "d" filled the next batch; "d" was pending; of the bad record batch, nothing
    assert [mpub_bodies(body) for _, body, _ in server.posts] == [[b"c"]]


def test_idempotency_key_column_is_checked_against_the_schema_at_planning():
    from pyspark.sql.types import DoubleType, LongType, StringType, StructField, StructType

    from trio_nsq.spark.options import write_settings

    schema = StructType([StructField("value", StringType()), StructField("position", LongType()),
                         StructField("score", DoubleType())])
    base = {"topic": "t", "nsqd_http_address": "127.0.0.1:4151"}
    assert write_settings({**base, "idempotency_key_column": "position"}, schema).key_column == "position"
    assert write_settings(base, schema).key_column is None  # the default: keys by query, batch, partition
    with pytest.raises(ValueError, match=r"'Position' is not a column of this DataFrame \(did you mean 'position'\?\)"):
        write_settings({**base, "idempotency_key_column": "Position"}, schema)
    with pytest.raises(ValueError, match="'nope' is not a column.*its columns are value, position, score"):
        write_settings({**base, "idempotency_key_column": "nope"}, schema)
    with pytest.raises(ValueError, match="'score' is double, it must be a string or a long"):
        write_settings({**base, "idempotency_key_column": "score"}, schema)
    with pytest.raises(ValueError, match="idempotent=false sends no key"):
        write_settings({**base, "idempotency_key_column": "position", "idempotent": "false"}, schema)


def test_the_same_rows_written_by_two_jobs_are_published_once_on_a_real_broker(module_broker):
    """Without Spark, against trio-nsqd: two 'jobs' (other write ids) publishing the same source rows."""
    import pyarrow as pa

    from trio_nsq.spark.datasource import publish_partition

    rows = pa.record_batch({"value": [f"r{i}" for i in range(50)],
                            "position": pa.array(range(0, 5000, 100), pa.int64())})
    for write_id in ("job-1", "job-2", "job-3"):
        publish_partition(keyed_settings(module_broker.http_address, batch_size=8), iter([rows]), write_id)
    stats = module_broker.http.get("/stats?format=json&topic=out").json()
    assert [t["message_count"] for t in stats["topics"] if t["topic_name"] == "out"] == [50]


def test_the_writer_refuses_a_missing_key_column_before_any_task_runs(spark, module_broker):
    df = spark.createDataFrame([("x", 1)], "value string, n long")
    with pytest.raises(Exception, match="idempotency_key_column 'position' is not a column"):
        nsq_write(df, module_broker, topic="t", idempotency_key_column="position").save()
