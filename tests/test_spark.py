"""The PySpark connector (trio_nsq/spark): its pieces on their own, then a real local SparkSession (local[2],
loopback only, UI off, one for the whole run) writing to real broker processes.

Spark's JVM is started from a temporary working directory and without the repo on PYTHONPATH, so its
Python workers import the connector from the installed package (`pip install -e '.[test,spark]'`), as
they would on a cluster. Messages are counted by a raw TCP V2 consumer that FINs everything it reads.
"""

from __future__ import annotations

import datetime
import decimal
import http.server
import importlib.util
import json
import logging
import os
import select
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from processes import REPO_ROOT, BrokerProcess, LookupdProcess, free_port

from trio_nsq.shared.protocol import (
    MAGIC_V2,
    FrameParser,
    decode_message,
    encode_fin,
    encode_identify,
    encode_rdy,
    encode_sub,
)
from trio_nsq.spark.publisher import (
    Batcher,
    MPubClient,
    NSQRefusedError,
    NSQUnavailableError,
    mpub_size,
    nodes_from_lookupd,
    split_to_fit,
)

try:
    import pyarrow as pa
    import pyspark
except ImportError:
    pa = pyspark = None


@pytest.fixture(autouse=True)
def _spark_extra_installed():
    """Never skipped: without the spark extra every test here fails, saying what to install (and the other
    test files still run)."""
    if pa is None or pyspark is None:
        pytest.fail("the Spark connector tests need the spark extra: pip install -e '.[test,spark]'", pytrace=False)

# --- batching, without Spark ------------------------------------------------------------------------


def test_batches_are_bounded_by_count_and_by_body_size_per_topic():
    batcher = Batcher(max_count=10, max_bytes=1000)
    out = [b for body in [b"x" * 10] * 25 if (b := batcher.add("a", body))]
    out += list(batcher.flush())
    assert [(t, len(b)) for t, b in out] == [("a", 10), ("a", 10), ("a", 5)]

    batcher = Batcher(max_count=100, max_bytes=4 + 3 * 104)  # room for three 100-byte messages
    out = [b for body in [b"z" * 100] * 10 if (b := batcher.add("a", body))] + list(batcher.flush())
    assert [len(b) for _, b in out] == [3, 3, 3, 1]
    assert all(mpub_size(b) <= 4 + 3 * 104 for _, b in out)

    # topics interleaved row by row still make full batches, each topic in its own order
    batcher = Batcher(max_count=3, max_bytes=1 << 20)
    rows = [("t1" if i % 2 else "t2", b"%d" % i) for i in range(12)]
    out = [b for t, body in rows if (b := batcher.add(t, body))] + list(batcher.flush())
    assert sorted(len(b) for _, b in out) == [3, 3, 3, 3]
    batcher.add("t1", b"abc")
    batcher.add("t2", b"de")
    assert batcher.pending_bytes == (4 + 4 + 3) + (4 + 4 + 2)
    for topic in ("t1", "t2"):
        assert [m for t, b in out if t == topic for m in b] == [body for t, body in rows if t == topic]

    # a message larger than a whole body still goes out, alone, for the broker to refuse
    batcher = Batcher(max_count=10, max_bytes=100)
    out = [b for body in [b"s", b"L" * 500, b"s"] if (b := batcher.add("a", body))] + list(batcher.flush())
    assert [b for _, b in out] == [[b"s"], [b"L" * 500], [b"s"]]


def test_split_to_fit():
    bodies = [b"a" * 10, b"b" * 10, b"c" * 200, b"d" * 10]
    assert list(split_to_fit(bodies, 4 + 2 * 14)) == [bodies[:2], [bodies[2]], [bodies[3]]]
    assert list(split_to_fit(bodies, 1 << 20)) == [bodies]


# --- rows to messages, without Spark (Arrow record batches as Spark hands them over) ----------------


def _convert(rb, **kw):
    from trio_nsq.spark.rows import RowConverter

    return list(RowConverter(**kw).messages([rb]))


def test_value_column_string_or_binary_is_the_body_and_the_topic_option_wins():
    rb = pa.record_batch({"value": ["text", "two\nlines", "é"], "topic": ["c1", "c2", "c1"]})
    assert _convert(rb, topic=None, has_value=True) == [("c1", b"text"), ("c2", b"two\nlines"), ("c1", "é".encode())]
    assert _convert(rb, topic="opt", has_value=True) == [("opt", b"text"), ("opt", b"two\nlines"),
                                                         ("opt", "é".encode())]
    rb = pa.record_batch({"value": pa.array([b"\x00\xff\n", b"b"], pa.binary())})
    assert _convert(rb, topic="t", has_value=True) == [("t", b"\x00\xff\n"), ("t", b"b")]
    rb = pa.record_batch({"value": pa.array(["big"], pa.large_string())})
    assert _convert(rb, topic="t", has_value=True) == [("t", b"big")]


def test_rows_without_a_value_column_are_json_like_to_json():
    from trio_nsq.spark.rows import NSQRowError

    rb = pa.record_batch({
        "id": pa.array([1, 2], pa.int64()),
        "name": ["a", None],
        "raw": pa.array([b"\x00\x01", None], pa.binary()),
        "day": pa.array([datetime.date(2024, 5, 1), None], pa.date32()),
        "at": pa.array([datetime.datetime(2024, 5, 1, 12, 30, tzinfo=datetime.timezone.utc), None],
                       pa.timestamp("us", tz="UTC")),
        "price": pa.array([decimal.Decimal("1.50"), decimal.Decimal("3.00")], pa.decimal128(10, 2)),
        "ratio": pa.array([float("nan"), float("-inf")], pa.float64()),
        "tags": pa.array([{"k": 1}, None], pa.map_(pa.string(), pa.int32())),
        "inner": pa.array([{"b": b"\xff", "n": 1}, None], pa.struct([("b", pa.binary()), ("n", pa.int32())])),
        "list": pa.array([[1.0, float("inf")], []], pa.list_(pa.float64())),
    })
    (t1, b1), (t2, b2) = _convert(rb, topic="t", has_value=False, key_field="_key", key_prefix="w/3")
    assert json.loads(b1) == {"id": 1, "name": "a", "raw": "AAE=", "day": "2024-05-01",
                              "at": "2024-05-01T12:30:00+00:00", "price": 1.5, "ratio": "NaN", "tags": {"k": 1},
                              "inner": {"b": "/w==", "n": 1}, "list": [1.0, "Infinity"], "_key": "w/3/0"}
    assert json.loads(b2) == {"id": 2, "name": None, "raw": None, "day": None, "at": None, "price": 3,
                              "ratio": "-Infinity", "tags": None, "inner": None, "list": [], "_key": "w/3/1"}
    assert b"\n" not in b1 and b1.startswith(b'{"id":1,')

    # the row index runs on across the record batches of one partition
    from trio_nsq.spark.rows import RowConverter

    conv = RowConverter(topic="t", has_value=False, key_field="k", key_prefix="q/7/0")
    keys = [json.loads(b)["k"] for _, b in conv.messages([pa.record_batch({"x": [1, 2]}), pa.record_batch({"x": [3]})])]
    assert keys == ["q/7/0/0", "q/7/0/1", "q/7/0/2"]

    with pytest.raises(NSQRowError, match="row 1 .* null 'value'"):
        _convert(pa.record_batch({"value": ["a", None]}), topic="t", has_value=True)
    with pytest.raises(NSQRowError, match="row 0 .* empty 'value'"):
        _convert(pa.record_batch({"value": pa.array([b"", b"x"], pa.binary())}), topic="t", has_value=True)
    with pytest.raises(NSQRowError, match="invalid topic 'no spaces'"):
        _convert(pa.record_batch({"value": ["a", "b"], "topic": ["ok", "no spaces"]}), topic=None, has_value=True)
    with pytest.raises(NSQRowError, match="null topic"):
        _convert(pa.record_batch({"value": ["a"], "topic": pa.array([None], pa.string())}), topic=None, has_value=True)


# --- option checks, without a SparkSession -------------------------------------------------------------


def test_options_are_checked_against_the_schema():
    from pyspark.sql.types import (
        BinaryType,
        IntegerType,
        LongType,
        StringType,
        StructField,
        StructType,
    )

    from trio_nsq.spark.options import write_settings

    def schema(**cols):
        return StructType([StructField(n, t) for n, t in cols.items()])

    addr = {"nsqd_http_address": "127.0.0.1:4151, 127.0.0.2:4151 ,127.0.0.1:4151"}
    s = write_settings({"topic": "t", **addr}, schema(value=StringType()))
    assert (s.topic, s.has_value, s.addresses, s.batch_size) == ("t", True, ("127.0.0.1:4151", "127.0.0.2:4151"), 5000)
    s = write_settings(addr, schema(topic=StringType(), value=BinaryType()))
    assert (s.topic, s.has_value) == (None, True)
    s = write_settings({"topic": "t", "key_field": "_k", **addr}, schema(id=LongType(), topic=IntegerType()))
    assert (s.has_value, s.key_field) == (False, "_k")

    def refused(options, sch, pattern):
        with pytest.raises(ValueError, match=pattern):
            write_settings(options, sch)

    refused(addr, schema(value=StringType()), r"no topic: set \.option\('topic'")
    refused(addr, schema(value=StringType(), topic=IntegerType()), r"'topic' column is int, it must be a string")
    refused({"topic": "t", **addr}, schema(value=LongType()), r"'value' column is bigint, it must be string or binary")
    refused({"topic": "bad name", **addr}, schema(value=StringType()), "invalid topic 'bad name'")
    refused({"topic": "t"}, schema(value=StringType()), r"no broker: set \.option\('nsqd_http_address'")
    refused({"topic": "t", "batchsize": "10", **addr}, schema(value=StringType()), "did you mean 'batch_size'")
    refused({"topic": "t", "batch_size": "0", **addr}, schema(value=StringType()),
            "batch_size='0' must be an integer >= 1")
    refused({"topic": "t", "retry_backoff": "soon", **addr}, schema(value=StringType()), "must be a number")
    refused({"topic": "t", "key_field": "k", **addr}, schema(value=StringType()),
            "key_field adds a field to rows sent as JSON")
    refused({"topic": "t", "key_field": "id", **addr}, schema(id=LongType()), "'id' is already a column")
    refused({"topic": "t", "nsqd_http_address": "host:port"}, schema(value=StringType()), "is not an address")
    refused({"topic": "t", "path": "x", **addr}, schema(value=StringType()), r"call \.save\(\) with no argument")


# --- HTTP publishing against a scripted server -----------------------------------------------------


class Scripted(http.server.ThreadingHTTPServer):
    """An HTTP/1.1 server answering POSTs from a script of (status, json message) and recording bodies;
    GET /config/max_body_size and /config/max_msg_size answer the limits given (404 for None)."""

    daemon_threads = True

    def __init__(self, script, max_body_size=5 * 1024 * 1024, max_msg_size=None):
        self.script, self.posts = list(script), []
        self.config = {"max_body_size": max_body_size, "max_msg_size": max_msg_size}
        super().__init__(("127.0.0.1", 0), self.Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def address(self):
        return f"127.0.0.1:{self.server_address[1]}"

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _answer(self, status, payload):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            value = self.server.config.get(self.path.removeprefix("/config/"))
            if value is not None:
                self._answer(200, value)
            else:
                self._answer(404, {"message": "NOT_FOUND"})

        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            status, message = self.server.script.pop(0) if self.server.script else (200, "OK")
            self.server.posts.append((self.path, body, status))
            self._answer(status, {"message": message} if status != 200 else "OK")


@pytest.fixture
def scripted():
    servers = []

    def make(*a, **kw):
        servers.append(Scripted(*a, **kw))
        return servers[-1]

    yield make
    for server in servers:
        server.shutdown()
        server.server_close()


def test_mpub_client_retries_5xx_and_refusals_fail_at_once(scripted):
    server = scripted([(503, "EXITING"), (500, "INTERNAL_ERROR")])
    sleeps = []
    with MPubClient([server.address], retry_backoff=0.1, sleep=sleeps.append) as client:
        client.publish("t", [b"a\nb", b"c"])
    assert [s for _, _, s in server.posts] == [503, 500, 200]
    path, body, _ = server.posts[-1]
    assert path == "/mpub?topic=t&binary=true" and body == b"\0\0\0\2\0\0\0\3a\nb\0\0\0\1c"
    assert 0.08 <= sleeps[0] <= 0.12 and 0.16 <= sleeps[1] <= 0.24  # backoff doubles, with jitter
    assert (client.messages, client.requests, client.retries) == (2, 3, 2)

    server = scripted([(400, "INVALID_TOPIC")])
    with pytest.raises(NSQRefusedError, match="400 INVALID_TOPIC .*topic names are"):
        MPubClient([server.address], sleep=sleeps.append).publish("t", [b"x"])
    assert len(server.posts) == 1


def test_mpub_client_cuts_batches_to_the_brokers_body_limit(scripted):
    server = scripted([(413, "BODY_TOO_BIG")], max_body_size=4 + 3 * 14)
    with MPubClient([server.address]) as client:
        client.publish("t", [b"m" * 10] * 7)  # the broker's /config says 3 fit: 3 + 3 + 1
    sizes = [len(body) for _, body, status in server.posts if status == 200]
    assert sum(s - 4 for s in sizes) == 7 * 14 and max(sizes) <= 4 + 3 * 14
    assert server.posts[0][2] == 413  # the first request was refused as too big, then halved

    # a message that cannot fit the body limit the broker states is not even sent
    server = scripted([], max_body_size=100, max_msg_size=1000)
    with pytest.raises(NSQRefusedError, match="would refuse .*413 BODY_TOO_BIG .*200 bytes does not fit .* 100 bytes"):
        MPubClient([server.address]).publish("t", [b"x" * 200])
    assert server.posts == []


def test_mpub_client_fails_over_and_gives_up_when_no_broker_answers(scripted):
    server = scripted([])
    dead = f"127.0.0.1:{free_port()}"
    sleeps = []
    with MPubClient([dead, server.address], retry_backoff=0.01, sleep=sleeps.append) as client:
        client.publish("t", [b"x"])
    assert client.retries == 1 and len(server.posts) == 1
    with pytest.raises(NSQUnavailableError, match=rf"after 3 attempts .*brokers: {dead}.*max_retries"):
        MPubClient([dead], max_retries=2, retry_backoff=0.01, sleep=sleeps.append).publish("t", [b"x"])


def test_nodes_from_lookupd(scripted):
    server = scripted([])
    server.RequestHandlerClass = type("H", (Scripted.Handler,), {"do_GET": lambda self: self._answer(200, {
        "producers": [{"broadcast_address": "10.0.0.1", "http_port": 4151, "tcp_port": 4150},
                      {"broadcast_address": "::1", "http_port": 4251, "tcp_port": 4250}]})})
    dead = f"127.0.0.1:{free_port()}"
    assert nodes_from_lookupd([dead, server.address]) == ["10.0.0.1:4151", "[::1]:4251"]
    with pytest.raises(NSQUnavailableError, match="no lookupd answered"):
        nodes_from_lookupd([dead])


def test_commit_logs_the_total(caplog):
    from trio_nsq.spark.datasource import NSQCommitMessage, NSQWriter

    caplog.set_level(logging.INFO, logger="trio_nsq.spark")
    NSQWriter.commit(None, [NSQCommitMessage(0, 3, 30, 1, 0, {"a": 3}),
                            NSQCommitMessage(1, 2, 20, 2, 1, {"a": 1, "b": 1})])
    assert "published 5 messages (50 bytes) from 2 partitions in 3 requests, 1 retries (per topic: a: 4, b: 1)" \
        in caplog.text


# --- with Spark ----------------------------------------------------------------------------------------


def consume(broker: BrokerProcess, topic: str, expected: int, timeout: float = 60, quiet: float = 0.3) -> list[bytes]:
    """Every message of `topic` (each FIN'd): reads until `expected` arrived and then `quiet` seconds pass
    without another (a duplicate would show up then), or until `timeout`."""
    bodies: list[bytes] = []
    sock = socket.create_connection(("127.0.0.1", broker.tcp_port), timeout=timeout)
    sock.sendall(MAGIC_V2 + encode_identify({"heartbeat_interval": 5000}) + encode_sub(topic, "count")
                 + encode_rdy(2500))
    parser = FrameParser()
    deadline = time.monotonic() + timeout
    done_at = None
    try:
        while time.monotonic() < deadline:
            if len(bodies) >= expected:
                done_at = done_at or time.monotonic() + quiet
                if time.monotonic() >= done_at:
                    break
            if not select.select([sock], [], [], 0.1)[0]:
                continue  # nothing for 100 ms: look at the clock again
            data = sock.recv(1 << 20)
            if not data:
                break
            parser.feed(data)
            replies = []
            for kind, payload in parser:
                if kind == 2:
                    msg = decode_message(payload)
                    bodies.append(msg.body)
                    replies.append(encode_fin(msg.id))
                elif payload == b"_heartbeat_":
                    replies.append(b"NOP\n")
            if replies:
                sock.sendall(b"".join(replies))
    finally:
        sock.close()
    return bodies


def nsq_write(df, broker: BrokerProcess | str, **options):
    address = broker if isinstance(broker, str) else broker.http_address
    w = df.write.format("nsq").option("nsqd_http_address", address).mode("append")
    for key, value in options.items():
        w = w.option(key, value)
    return w


def test_workers_import_the_installed_connector_outside_the_repo(spark):
    def where(_):
        import trio_nsq.spark.datasource as mod

        return os.getcwd(), sys.path, mod.__file__

    cwd, path, module = spark.sparkContext.parallelize([0], 1).map(where).collect()[0]
    repo = REPO_ROOT.resolve()
    assert Path(cwd).resolve() != repo
    assert repo not in {Path(p or cwd).resolve() for p in path}  # found through the installed distribution
    assert Path(module).name == "datasource.py"


def test_100k_rows_in_8_partitions_arrive_exactly_once(spark, module_broker):
    df = spark.range(100_000, numPartitions=8).selectExpr("concat('row-', CAST(id AS STRING)) AS value")
    # warm up: Spark's side of the plan, and the Python workers (their first use imports pyspark and pyarrow)
    df.write.format("noop").mode("append").save()
    nsq_write(df.limit(1000).repartition(2), module_broker, topic="warm-up").save()
    start = time.perf_counter()
    df.write.format("noop").mode("append").save()
    noop = time.perf_counter() - start

    start = time.perf_counter()
    nsq_write(df, module_broker, topic="bulk").save()
    elapsed = time.perf_counter() - start

    bodies = consume(module_broker, "bulk", 100_000)
    assert len(bodies) == 100_000, f"{len(bodies)} messages, {len(set(bodies))} distinct"
    assert set(bodies) == {b"row-%d" % i for i in range(100_000)}
    print(f"\n100k rows: nsq {elapsed:.2f}s = {100_000 / elapsed:,.0f} rows/s; "
          f"noop {noop:.2f}s = {100_000 / noop:,.0f} rows/s")


def test_json_rows_binary_values_newlines_and_topic_routing(spark, module_broker):
    json_df = spark.createDataFrame([(1, "a", None), (2, "b\nc", b"\x01")], "id long, name string, raw binary")
    nsq_write(json_df, module_broker, topic="json").save()
    got = sorted(map(json.loads, consume(module_broker, "json", 2)), key=lambda row: row["id"])
    assert got == [{"id": 1, "name": "a", "raw": None}, {"id": 2, "name": "b\nc", "raw": "AQ=="}]

    bin_df = spark.createDataFrame([(bytearray(b"\x00line1\nline2\xff"),), (bytearray(b"\n"),)], "value binary")
    nsq_write(bin_df, module_broker, topic="bin").save()
    assert sorted(consume(module_broker, "bin", 2)) == [b"\x00line1\nline2\xff", b"\n"]

    routed = spark.createDataFrame([("t-one", "1"), ("t-two", "2\n2"), ("t-one", "3")], "topic string, value string")
    nsq_write(routed, module_broker).save()
    assert sorted(consume(module_broker, "t-one", 2)) == [b"1", b"3"]
    assert consume(module_broker, "t-two", 1) == [b"2\n2"]
    nsq_write(routed, module_broker, topic="t-opt").save()  # the option wins over the column
    assert sorted(consume(module_broker, "t-opt", 3)) == [b"1", b"2\n2", b"3"]
    assert consume(module_broker, "t-one", 0, quiet=0.3) == []


def test_planning_errors_say_what_to_change(spark, module_broker):
    df = spark.createDataFrame([("x",)], "value string")

    def fails(write, pattern):
        with pytest.raises(Exception, match=pattern):
            write.save()

    fails(nsq_write(df, module_broker), r"no topic: set \.option\('topic'")
    fails(nsq_write(spark.createDataFrame([(1,)], "value int"), module_broker, topic="t"), "must be string or binary")
    fails(nsq_write(spark.createDataFrame([(1, "x")], "topic int, value string"), module_broker), "must be a string")
    fails(nsq_write(df, module_broker, topic="t").mode("overwrite"), r"use \.mode\('append'\)")
    fails(df.write.format("nsq").option("topic", "t").mode("append"), "nsqd_http_address")
    fails(nsq_write(df, module_broker, topic="t", batchsize="9"), "did you mean 'batch_size'")
    # Spark itself refuses the default mode (errorifexists) before asking the data source
    fails(df.write.format("nsq").option("topic", "t").option("nsqd_http_address", module_broker.http_address), "(?i)append")


def test_an_oversize_row_fails_the_job_with_the_brokers_error(spark, module_broker):
    df = spark.createDataFrame([("small",), ("x" * (1024 * 1024 + 10),)], "value string").coalesce(1)
    with pytest.raises(Exception) as failure:
        nsq_write(df, module_broker, topic="big").save()
    text = str(failure.value)
    assert "413 BAD_MESSAGE" in text and "larger than the broker's --max-msg-size of 1048576" in text, text[-3000:]


def test_a_broker_down_for_the_first_attempts_still_gets_everything(spark, tmp_path):
    late = BrokerProcess(tmp_path)  # its ports are chosen now; it starts 3 s after the job
    timer = threading.Timer(3.0, late.start)
    df = spark.range(2000, numPartitions=2).selectExpr("CAST(id AS STRING) AS value")
    timer.start()
    try:
        start = time.monotonic()
        nsq_write(df, late, topic="late", retry_backoff="0.2").save()
        assert time.monotonic() - start > 3
        assert sorted(consume(late, "late", 2000), key=int) == [b"%d" % i for i in range(2000)]
    finally:
        timer.join()
        late.stop()


def test_brokers_from_lookupd_or_a_list_share_the_partitions(spark, tmp_path):
    from test_lookupd_discovery import eventually

    lookupd = LookupdProcess(tmp_path).start()
    brokers = []
    try:
        for _ in range(2):
            brokers.append(BrokerProcess(tmp_path, lookupd_tcp_address=lookupd.tcp_address, broadcast_address="127.0.0.1"))
            brokers[-1].start()
        eventually(lambda: len(lookupd.get("/nodes").json()["producers"]) == 2)
        df = spark.range(400, numPartitions=4).selectExpr("CAST(id AS STRING) AS value")
        df.write.format("nsq").option("topic", "spread") \
            .option("lookupd_http_address", f"127.0.0.1:{lookupd.http_port}").mode("append").save()
        per_broker = [consume(b, "spread", 200, timeout=10) for b in brokers]
        assert [len(bodies) for bodies in per_broker] == [200, 200]  # 4 partitions of 100 rows over 2 brokers
        assert sorted(int(x) for bodies in per_broker for x in bodies) == list(range(400))

        nsq_write(df, ",".join(b.http_address for b in brokers), topic="listed").save()
        per_broker = [consume(b, "listed", 200, timeout=10) for b in brokers]
        assert sorted(int(x) for bodies in per_broker for x in bodies) == list(range(400))
        assert [len(bodies) for bodies in per_broker] == [200, 200]
    finally:
        for b in brokers:
            b.stop()
        lookupd.stop()


def test_a_stream_from_the_rate_source_delivers_its_micro_batches(spark, module_broker, tmp_path):
    stream = spark.readStream.format("rate").option("rowsPerSecond", 500).option("numPartitions", 2).load() \
        .selectExpr("value AS n", "timestamp AS at")  # no `value` column: each row is sent as JSON
    query = (stream.writeStream.format("nsq").option("topic", "stream").option("nsqd_http_address", module_broker.http_address)
             .option("key_field", "_key").option("checkpointLocation", str(tmp_path / "checkpoint"))
             .trigger(processingTime="300 milliseconds").start())
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert query.isActive, query.exception()
            filled = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
            if len(filled) >= 3 and sum(filled) >= 1000:
                break
            time.sleep(0.2)
    finally:
        query.stop()
    progress = [p for p in query.recentProgress if p["numInputRows"]]
    published = sum(p["numInputRows"] for p in progress)
    assert published >= 1000 and len(progress) >= 3, progress
    rows = [json.loads(b) for b in consume(module_broker, "stream", published, timeout=30)]
    # every committed row arrived once (a batch cut short by stop() may have been sent, never committed)
    values = sorted(row["n"] for row in rows)
    assert values == list(range(len(values))) and len(values) >= published
    keys = {row["_key"] for row in rows}
    assert len(keys) == len(rows)  # query id / batch id / partition / row: unique, and stable on a replay
    batch_ids = {p["batchId"] for p in progress}
    assert {key.split("/")[0] for key in keys} == {query.id}
    assert batch_ids <= {int(key.split("/")[1]) for key in keys}
    assert all(datetime.datetime.fromisoformat(row["at"]).year >= 2024 for row in rows[:10])


def test_the_example_publishes_a_dataframe(spark, module_broker):
    spec = importlib.util.spec_from_file_location("spark_publish", REPO_ROOT / "examples" / "spark_publish.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # defines main(); its __main__ block makes its own SparkSession
    assert example.main(spark, module_broker.http_address, "spark-example", rows=500) == 500
    rows = [json.loads(b) for b in consume(module_broker, "spark-example", 500)]
    assert sorted(row["id"] for row in rows) == list(range(500)) and rows[0]["name"].startswith("event-")


def test_registering_is_one_call(spark, module_broker):
    # last in the file: every test above used the format Spark discovered by itself
    from trio_nsq.spark import NSQDataSource

    spark.dataSource.register(NSQDataSource)  # what a user does without the auto-discovered module
    nsq_write(spark.createDataFrame([("registered",)], "value string"), module_broker, topic="registered").save()
    assert consume(module_broker, "registered", 1) == [b"registered"]

