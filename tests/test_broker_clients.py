"""Process-level tests: the real broker (``python -m trio_nsq.broker``) with real NSQ clients over real sockets.

Third-party clients from PyPI — pynsq (tornado), gnsq (gevent) and ansq (asyncio) — each run in a
subprocess of their own with a hard timeout, so an event loop that never returns, or gevent's
monkeypatching, cannot hang or leak into pytest. A client script reads a JSON spec file and prints
``READY`` once subscribed and ``RESULT <json>`` at the end. ``tests/nsq_raw.py`` is used where the
assertion is about exact frames, timing or whether the broker closed the connection.

Expected error texts and fatal/non-fatal behaviour are nsqd's (nsqd/protocol_v2.go): a FatalClientErr
sends the error frame and closes the connection; a ClientErr (E_FIN_FAILED, E_REQ_FAILED,
E_TOUCH_FAILED) sends the error frame and keeps the connection.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import re
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from processes import BrokerProcess
from nsq_raw import (
    CLOSE_WAIT,
    OK,
    ConnectionClosed,
    Error,
    FrameTimeout,
    RawNSQ,
    Response,
    encode_command,
    encode_mpub_body,
    publish,
    subscribe,
)

_names = itertools.count(1)


def unique(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_names)}"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


MESSAGE_ID = re.compile(rb"[0-9a-f]{16}")


# ---------------------------------------------------------------------------------------------
# third-party client scripts (each runs as `python -c SCRIPT spec.json`)
# ---------------------------------------------------------------------------------------------

_COMMON = r'''
import base64, json, sys, time
spec = json.load(open(sys.argv[1]))
HOST, PORT = spec["address"].rsplit(":", 1)
PORT = int(PORT)
def emit(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
def b64d(s):
    return base64.b64decode(s)
def record(msg_id, body, attempts, timestamp):
    if isinstance(msg_id, str):
        msg_id = msg_id.encode("latin-1")
    return {"id": msg_id.decode("latin-1"), "body": base64.b64encode(bytes(body)).decode(),
            "attempts": attempts, "ts": timestamp, "at": time.monotonic()}
class Done:
    """Consumer stop rule: `expect` messages then `quiet` more seconds (to catch duplicates), or
    `idle` seconds without a message once one arrived, or `max_seconds` in all."""
    def __init__(self):
        self.start = time.monotonic()
        self.received = []
        self.last = None
        self.stop_at = None
        self.timed_out = False
    def add(self, rec):
        self.received.append(rec)
        self.last = time.monotonic()
    def finished(self):
        now = time.monotonic()
        expect = spec.get("expect")
        if expect is not None:
            if len(self.received) >= expect and self.stop_at is None:
                self.stop_at = now + spec.get("quiet", 0.5)
        elif self.last is not None and now - self.last >= spec.get("idle", 1.0):
            return True
        if self.stop_at is not None and now >= self.stop_at:
            return True
        if now - self.start >= spec.get("max_seconds", 15):
            self.timed_out = True
            return True
        return False
    def result(self, **extra):
        return dict(messages=self.received, timed_out=self.timed_out, **extra)
'''

PYNSQ_SCRIPT = _COMMON + r'''
import logging
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
import tornado.ioloop
import nsq

loop = tornado.ioloop.IOLoop.current()
RESULT = {}

def finish(result):
    emit("RESULT " + json.dumps(result))
    loop.stop()

if spec["mode"] == "publish":
    writer = nsq.Writer([spec["address"]])
    ops = list(spec["ops"])
    responses = []

    def run_next():
        if not ops:
            return finish({"responses": responses})
        op = ops.pop(0)
        def cb(conn, data):
            if isinstance(data, bytes):
                responses.append(data.decode())
            else:
                responses.append("ERROR " + repr(data))
            loop.add_callback(run_next)
        if op["cmd"] == "pub":
            writer.pub(op["topic"], b64d(op["body"]), callback=cb)
        elif op["cmd"] == "mpub":
            writer.mpub(op["topic"], [b64d(b) for b in op["bodies"]], callback=cb)
        elif op["cmd"] == "dpub":
            writer.dpub(op["topic"], op["delay_ms"], b64d(op["body"]), callback=cb)
        else:
            raise SystemExit("unknown op %r" % op)

    def wait_connected(deadline=time.monotonic() + 10):
        if any(c.connected() for c in writer.conns.values()):
            run_next()
        elif time.monotonic() > deadline:
            finish({"responses": responses, "error": "writer never connected"})
        else:
            loop.call_later(0.02, wait_connected)

    loop.add_callback(wait_connected)

elif spec["mode"] == "consume":
    done = Done()
    state = {"ready": False}

    class Reader(nsq.Reader):
        def _on_connection_ready(self, conn, **kwargs):
            def on_response(conn, data, **kw):
                if not state["ready"] and data == b"OK":
                    state["ready"] = True
                    emit("READY")
            conn.on("response", on_response)
            super()._on_connection_ready(conn, **kwargs)

    def handler(message):
        done.add(record(message.id, message.body, message.attempts, message.timestamp))
        delay = spec.get("handler_delay")
        if delay:
            message.enable_async()
            loop.call_later(delay, message.finish)
            return None
        return True

    reader = Reader(spec["topic"], spec["channel"], message_handler=handler,
                    nsqd_tcp_addresses=[spec["address"]],
                    max_in_flight=spec.get("max_in_flight", 1))

    def check():
        if done.finished():
            reader.close()
            finish(done.result(ready=state["ready"]))
        else:
            loop.call_later(0.05, check)

    loop.call_later(0.05, check)

loop.start()
'''

GNSQ_SCRIPT = r'''
from gevent import monkey
monkey.patch_all()
''' + _COMMON + r'''
import logging
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
import gevent
import gnsq

def finish(result):
    emit("RESULT " + json.dumps(result))

if spec["mode"] == "publish":
    producer = gnsq.Producer([spec["address"]])
    producer.start()
    responses = []
    for op in spec["ops"]:
        try:
            if op["cmd"] == "pub":
                resp = producer.publish(op["topic"], b64d(op["body"]))
            elif op["cmd"] == "mpub":
                resp = producer.multipublish(op["topic"], [b64d(b) for b in op["bodies"]])
            elif op["cmd"] == "dpub":
                resp = producer.publish(op["topic"], b64d(op["body"]), defer=op["delay_ms"])
            else:
                raise SystemExit("unknown op %r" % op)
            responses.append(resp.decode() if isinstance(resp, bytes) else repr(resp))
        except gnsq.errors.NSQException as exc:
            responses.append("ERROR " + repr(exc))
    producer.close()
    finish({"responses": responses})

elif spec["mode"] == "consume":
    done = Done()
    state = {"ready": False}

    class Consumer(gnsq.Consumer):
        def handle_response(self, conn, response):
            if not state["ready"] and response == b"OK":
                state["ready"] = True
                emit("READY")
            super().handle_response(conn, response)

    consumer = Consumer(spec["topic"], spec["channel"], nsqd_tcp_addresses=[spec["address"]],
                        max_in_flight=spec.get("max_in_flight", 1))

    @consumer.on_message.connect
    def handler(consumer, message):
        done.add(record(message.id, message.body, message.attempts, message.timestamp))
        delay = spec.get("handler_delay")
        if delay:
            message.enable_async()
            gevent.spawn_later(delay, message.finish)

    consumer.start(block=False)
    while not done.finished():
        gevent.sleep(0.05)
    consumer.close()
    finish(done.result(ready=state["ready"]))

elif spec["mode"] == "cls":
    # subscribe, take `expect` messages and FIN them, then CLS: nsqd answers CLOSE_WAIT and
    # sends no further messages; the client then closes the socket itself.
    conn = gnsq.NsqdTCPClient(HOST, PORT, timeout=10.0)
    conn.connect()
    identify = conn.identify()
    conn.subscribe(spec["topic"], spec["channel"])
    conn.check_ok()
    emit("READY")
    conn.ready(spec["rdy"])
    done = Done()
    responses = []
    while len(done.received) < spec["expect"]:
        frame, data = conn.read_response()
        if frame == gnsq.protocol.FRAME_TYPE_MESSAGE:
            done.add(record(data.id, data.body, data.attempts, data.timestamp))
            data.finish()
        elif frame == gnsq.protocol.FRAME_TYPE_RESPONSE and data == b"_heartbeat_":
            continue
        else:
            responses.append([frame, repr(data)])
    conn.close()  # CLS
    while True:
        frame, data = conn.read_response()
        if frame == gnsq.protocol.FRAME_TYPE_RESPONSE and data == b"_heartbeat_":
            continue
        responses.append([frame, data.decode() if isinstance(data, bytes) else repr(data)])
        if frame == gnsq.protocol.FRAME_TYPE_RESPONSE:
            break
    conn.close_stream()
    finish(done.result(responses=responses, identify=identify))
'''

ANSQ_SCRIPT = _COMMON + r'''
import asyncio, logging
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from ansq import open_connection, ConnectionOptions

def describe(resp):
    body = getattr(resp, "body", resp)
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if getattr(resp, "is_error", False):
        return "ERROR " + str(body)
    return str(body)

async def main():
    nsq = await open_connection(HOST, PORT,
                                connection_options=ConnectionOptions(auto_reconnect=False))
    if spec["mode"] == "publish":
        responses = []
        for op in spec["ops"]:
            try:
                if op["cmd"] == "pub":
                    resp = await nsq.pub(op["topic"], b64d(op["body"]))
                elif op["cmd"] == "mpub":
                    assert len(op["bodies"]) > 1, "ansq sends a 1-message MPUB wrongly"
                    resp = await nsq.mpub(op["topic"], *[b64d(b) for b in op["bodies"]])
                elif op["cmd"] == "dpub":
                    resp = await nsq.dpub(op["topic"], b64d(op["body"]), op["delay_ms"])
                else:
                    raise SystemExit("unknown op %r" % op)
                responses.append(describe(resp))
            except Exception as exc:
                responses.append("ERROR " + repr(exc))
        await nsq.close()
        return {"responses": responses}

    # consume
    done = Done()
    resp = await nsq.sub(spec["topic"], spec["channel"])
    if describe(resp) != "OK":
        return done.result(sub=describe(resp))
    emit("READY")
    await nsq.rdy(spec.get("max_in_flight", 1))
    pending = set()

    async def fin_later(message, delay):
        await asyncio.sleep(delay)
        await message.fin()

    while not done.finished():
        try:
            message = await asyncio.wait_for(nsq.wait_for_message(), 0.05)
        except asyncio.TimeoutError:
            continue
        if message is None:  # connection closed
            break
        done.add(record(message.id, message.body, message.attempts, message.timestamp))
        delay = spec.get("handler_delay")
        if delay:
            task = asyncio.ensure_future(fin_later(message, delay))
            pending.add(task)
            task.add_done_callback(pending.discard)
        else:
            await message.fin()
    if pending:
        await asyncio.wait(pending, timeout=2)
    await nsq.close()
    return done.result()

result = asyncio.run(asyncio.wait_for(main(), spec.get("max_seconds", 15) + 5))
emit("RESULT " + json.dumps(result))
'''

SCRIPTS = {"pynsq": PYNSQ_SCRIPT, "gnsq": GNSQ_SCRIPT, "ansq": ANSQ_SCRIPT}


class ClientProcess:
    """A third-party client script running in its own process, with files for stdout/stderr."""

    def __init__(self, workdir: Path, lib: str, spec: dict, timeout: float):
        self.lib = lib
        self.timeout = timeout
        n = next(_names)
        self.spec_path = workdir / f"client{n}-{lib}-{spec['mode']}.json"
        self.stdout_path = self.spec_path.with_suffix(".stdout")
        self.stderr_path = self.spec_path.with_suffix(".stderr")
        self.spec_path.write_text(json.dumps(spec))
        self._out = open(self.stdout_path, "wb")
        self._err = open(self.stderr_path, "wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SCRIPTS[lib], str(self.spec_path)],
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=self._err,
        )

    def _describe(self) -> str:
        return (
            f"{self.lib} client (exit code {self.proc.poll()})\n--- stdout:\n"
            f"{self.stdout_path.read_text(errors='replace')[-4000:]}\n--- stderr:\n"
            f"{self.stderr_path.read_text(errors='replace')[-4000:]}"
        )

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if b"READY\n" in self.stdout_path.read_bytes():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"client exited before subscribing: {self._describe()}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"client did not subscribe within {timeout}s: {self._describe()}")
            time.sleep(0.02)

    def result(self) -> dict:
        remaining = max(0.1, self.started + self.timeout - time.monotonic())
        try:
            self.proc.wait(remaining)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"client hung for {self.timeout}s and was killed: {self._describe()}")
        self._close_files()
        lines = [
            line for line in self.stdout_path.read_text(errors="replace").splitlines()
            if line.startswith("RESULT ")
        ]
        if self.proc.returncode != 0 or not lines:
            raise AssertionError(f"client failed: {self._describe()}")
        return json.loads(lines[-1][len("RESULT "):])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close_files()

    def _close_files(self) -> None:
        self._out.close()
        self._err.close()


@pytest.fixture
def clients(tmp_path):
    """``clients(lib, spec, timeout=30) -> ClientProcess``; all are killed at teardown."""
    started: list[ClientProcess] = []

    def start(lib: str, spec: dict, timeout: float = 30.0) -> ClientProcess:
        c = ClientProcess(tmp_path, lib, spec, timeout)
        started.append(c)
        return c

    yield start
    for c in started:
        c.kill()


def decoded_bodies(result: dict) -> list[bytes]:
    return [base64.b64decode(m["body"]) for m in result["messages"]]


def assert_published(result: dict, n: int) -> None:
    assert result["responses"] == ["OK"] * n, result


def assert_healthy(broker: BrokerProcess) -> None:
    """The process is alive and a brand-new client can still publish and consume."""
    assert broker.is_alive(), f"broker died:\n{broker.log_text()}"
    topic, channel = unique("health"), "ch"
    body = b"still alive \x00\n" + os.urandom(8)
    with subscribe(broker.tcp_address, topic, channel, rdy=1) as consumer:
        publish(broker.tcp_address, topic, body)
        msg = consumer.expect_message()
        assert msg.body == body
        consumer.fin(msg.id)
        consumer.nop()
    assert broker.is_alive(), f"broker died:\n{broker.log_text()}"


# ---------------------------------------------------------------------------------------------
# publish / consume with third-party clients
# ---------------------------------------------------------------------------------------------


def test_pub_mpub_dpub_reach_two_channels_exactly_once(broker, clients):
    """pynsq publishes (PUB, MPUB, DPUB); gnsq and ansq consume two channels of the topic: each
    channel gets every message exactly once with its body intact, attempts 1, the same message id
    on both channels for the same message."""
    topic = unique("fanout")
    singles = [
        b"hello",
        bytes(range(256)),
        b"line one\nline two\r\nline three\n",
        b"\n",
        b"\x00" * 16 + b"tail",
        "h\u00e9llo \u2713 \u4e16\u754c".encode(),
        os.urandom(100_000),
    ]
    batch = [b"mpub %d\n" % i + os.urandom(i % 40) for i in range(60)]
    deferred = [b"deferred one", b"deferred\ntwo"]
    expected = singles + batch + deferred

    consumers = {
        "gnsq": clients("gnsq", dict(mode="consume", address=broker.tcp_address, topic=topic,
                                     channel="gnsq-ch", max_in_flight=10, expect=len(expected),
                                     quiet=0.7, max_seconds=20)),
        "ansq": clients("ansq", dict(mode="consume", address=broker.tcp_address, topic=topic,
                                     channel="ansq-ch", max_in_flight=10, expect=len(expected),
                                     quiet=0.7, max_seconds=20)),
    }
    for c in consumers.values():
        c.wait_ready()

    ops = [dict(cmd="pub", topic=topic, body=b64(b)) for b in singles]
    ops.append(dict(cmd="mpub", topic=topic, bodies=[b64(b) for b in batch]))
    ops += [dict(cmd="dpub", topic=topic, delay_ms=300, body=b64(b)) for b in deferred]
    published_at = time.time_ns()
    pub = clients("pynsq", dict(mode="publish", address=broker.tcp_address, ops=ops)).result()
    assert_published(pub, len(ops))

    ids_by_body = {}
    for name, c in consumers.items():
        result = c.result()
        assert not result["timed_out"], f"{name}: got {len(result['messages'])}/{len(expected)}"
        bodies = decoded_bodies(result)
        assert len(bodies) == len(expected), f"{name}: {len(bodies)} deliveries for {len(expected)}"
        assert sorted(bodies) == sorted(expected), f"{name}: bodies differ"
        ids = [m["id"].encode("latin-1") for m in result["messages"]]
        assert len(set(ids)) == len(ids), f"{name}: duplicate message ids"
        for msg_id in ids:
            assert MESSAGE_ID.fullmatch(msg_id), f"{name}: message id {msg_id!r} is not 16 hex digits"
        assert {m["attempts"] for m in result["messages"]} == {1}
        for m in result["messages"]:
            assert abs(m["ts"] - published_at) < 60e9, f"{name}: timestamp {m['ts']} is not ns-since-epoch now"
        ids_by_body[name] = {base64.b64decode(m["body"]): m["id"] for m in result["messages"]}
    assert ids_by_body["gnsq"] == ids_by_body["ansq"], "a message must keep its id on every channel"
    assert_healthy(broker)


def test_two_consumers_on_one_channel_split_the_messages(broker, clients):
    """gnsq publishes (MPUB + PUB + DPUB); a pynsq and an ansq consumer share one channel: together
    they get every message, no message goes to both, and both get some."""
    topic = unique("split")
    bodies = [b"split %03d" % i for i in range(120)]
    consumers = [
        clients(lib, dict(mode="consume", address=broker.tcp_address, topic=topic, channel="shared",
                          max_in_flight=1, handler_delay=0.01, idle=1.5, max_seconds=25))
        for lib in ("pynsq", "ansq")
    ]
    for c in consumers:
        c.wait_ready()
    ops = [dict(cmd="mpub", topic=topic, bodies=[b64(b) for b in bodies[:100]])]
    ops += [dict(cmd="pub", topic=topic, body=b64(b)) for b in bodies[100:118]]
    ops += [dict(cmd="dpub", topic=topic, delay_ms=200, body=b64(b)) for b in bodies[118:]]
    assert_published(clients("gnsq", dict(mode="publish", address=broker.tcp_address, ops=ops)).result(),
                     len(ops))

    results = [c.result() for c in consumers]
    got = [decoded_bodies(r) for r in results]
    for lib, bodies_got, r in zip(("pynsq", "ansq"), got, results):
        assert not r["timed_out"], f"{lib} received nothing"
        assert len(bodies_got) == len(set(bodies_got)), f"{lib} got a message twice"
        assert bodies_got, f"{lib} got no messages: the channel did not distribute"
        assert {m["attempts"] for m in r["messages"]} == {1}
    assert not set(got[0]) & set(got[1]), "a message was delivered to both consumers of one channel"
    assert sorted(got[0] + got[1]) == sorted(bodies)
    assert_healthy(broker)


def test_cls_gets_close_wait_and_the_consumer_ends_cleanly(broker, clients):
    """gnsq takes 3 messages, FINs them, sends CLS and gets CLOSE_WAIT, then closes its socket and
    exits 0; the rest of the channel's messages are still there for the next consumer."""
    topic = unique("cls")
    publish(broker.tcp_address, topic, b"first", b"second", b"third")
    result = clients("gnsq", dict(mode="cls", address=broker.tcp_address, topic=topic, channel="c",
                                  rdy=3, expect=3)).result()
    assert sorted(decoded_bodies(result)) == [b"first", b"second", b"third"]
    assert result["responses"] == [[0, "CLOSE_WAIT"]], result["responses"]
    assert result["identify"]["max_rdy_count"] > 0

    publish(broker.tcp_address, topic, b"fourth", b"fifth")
    with subscribe(broker.tcp_address, topic, "c", rdy=5) as conn:
        msgs = conn.expect_messages(2)
        assert sorted(m.body for m in msgs) == [b"fifth", b"fourth"]
        assert all(m.attempts == 1 for m in msgs)
        conn.expect_no_frame(0.5)  # the FINned three never come back
    assert_healthy(broker)


def test_cls_stops_delivery_raw(broker):
    """After CLS (answered CLOSE_WAIT) no further message is sent even with RDY left, FIN of an
    in-flight message is still accepted, and nothing is lost for the next consumer."""
    topic = unique("cls-raw")
    publish(broker.tcp_address, topic, b"one")
    with subscribe(broker.tcp_address, topic, "c", rdy=10) as conn:
        msg = conn.expect_message()
        assert msg.body == b"one"
        conn.cls()
        assert conn.expect_response() == CLOSE_WAIT
        publish(broker.tcp_address, topic, b"two", b"three")
        conn.expect_no_frame(0.7)
        conn.fin(msg.id)  # allowed in the closing state
        conn.command("PUB", topic, body=b"four")  # answers in order: proves FIN raised no error
        assert conn.expect_response() == OK
    with subscribe(broker.tcp_address, topic, "c", rdy=10) as conn:
        msgs = conn.expect_messages(3)
        assert sorted(m.body for m in msgs) == [b"four", b"three", b"two"]
        conn.expect_no_frame(0.3)
    assert_healthy(broker)


# ---------------------------------------------------------------------------------------------
# flow control and timing (raw client: exact frames and times)
# ---------------------------------------------------------------------------------------------


def test_in_flight_never_exceeds_rdy(broker):
    topic = unique("rdy")
    publish(broker.tcp_address, topic, *[b"m%d" % i for i in range(10)])
    with subscribe(broker.tcp_address, topic, "c", rdy=3) as conn:
        first = conn.expect_messages(3)
        conn.expect_no_frame(1.0)  # RDY 3, nothing FINned: no 4th message
        conn.fin(first[0].id)
        fourth = conn.expect_message()
        conn.expect_no_frame(0.5)  # back at 3 in flight
        conn.rdy(0)
        for m in first[1:] + [fourth]:
            conn.fin(m.id)
        conn.expect_no_frame(0.5)  # RDY 0: nothing more although 6 are waiting
        conn.rdy(6)
        rest = conn.expect_messages(6)
        conn.expect_no_frame(0.3)
    bodies = sorted(m.body for m in first + [fourth] + rest)
    assert bodies == sorted(b"m%d" % i for i in range(10))
    assert len({m.id for m in first + [fourth] + rest}) == 10


def test_a_run_of_fins_with_a_bad_one_finishes_the_others_in_order(broker):
    """FINs sent together are executed in order: an unknown id in the middle gets its E_FIN_FAILED
    (not fatal) and the FINs before and after it still finish their messages."""
    topic = unique("finrun")
    publish(broker.tcp_address, topic, *[b"r%d" % i for i in range(6)])
    with subscribe(broker.tcp_address, topic, "c", rdy=6) as conn:
        msgs = conn.expect_messages(6)
        ids = [m.id for m in msgs]
        conn.send(b"".join(b"FIN " + i + b"\n" for i in ids[:3]) + b"FIN " + b"0" * 16 + b"\n"
                  + b"".join(b"FIN " + i + b"\n" for i in ids[3:]))
        error = conn.expect_error()
        assert error.code == "E_FIN_FAILED" and "0000000000000000 failed ID not in flight" in error.text
        conn.send(b"".join(b"FIN " + i + b"\n" for i in ids[:1]))
        error = conn.expect_error()  # all six were finished: a second FIN of one is refused
        assert error.code == "E_FIN_FAILED" and ids[0].decode() in error.text
    url = f"http://{broker.http_address}/stats?format=json&topic={topic}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        stats = json.loads(resp.read())
    channel = stats["topics"][0]["channels"][0]
    assert (channel["in_flight_count"], channel["message_count"]) == (0, 6)


@contextlib.contextmanager
def one_message_in_flight(broker_factory, name: str, body: bytes):
    """A broker with --msg-timeout=1s, one message on a fresh topic, and a consumer (RDY 1) holding it."""
    broker = broker_factory(msg_timeout="1s")
    topic = unique(name)
    publish(broker.tcp_address, topic, body)
    with subscribe(broker.tcp_address, topic, "c", rdy=1) as conn:
        yield broker, topic, conn, conn.expect_message()


def test_msg_timeout_redelivers_with_attempts_incremented(broker_factory):
    with one_message_in_flight(broker_factory, "timeout", b"payload\nwith newline") as (_, _, conn, msg):
        got_at = time.monotonic()
        assert msg.attempts == 1
        again = conn.expect_message(timeout=5)  # not FINned: comes back after msg_timeout
        elapsed = time.monotonic() - got_at
        assert 0.8 <= elapsed <= 3.0, f"redelivered after {elapsed:.2f}s with --msg-timeout=1s"
        assert (again.id, again.body, again.attempts) == (msg.id, msg.body, 2)
        assert again.timestamp == msg.timestamp
        conn.fin(again.id)
        conn.command("PUB", unique("sync"), body=b"x")
        assert conn.expect_response() == OK  # the FIN was accepted (no E_FIN_FAILED before OK)
        conn.expect_no_frame(1.5)  # FINned: never again


def test_req_with_delay_is_not_redelivered_before_the_delay(broker):
    topic = unique("req")
    publish(broker.tcp_address, topic, b"requeue me")
    with subscribe(broker.tcp_address, topic, "c", rdy=1) as conn:
        msg = conn.expect_message()
        assert msg.attempts == 1
        conn.req(msg.id, 0)  # REQ 0: straight back
        again = conn.expect_message(timeout=2)
        assert (again.id, again.body, again.attempts) == (msg.id, msg.body, 2)

        conn.req(again.id, 1500)
        req_at = time.monotonic()
        conn.expect_no_frame(1.2)
        third = conn.expect_message(timeout=4)
        elapsed = time.monotonic() - req_at
        assert elapsed >= 1.4, f"REQ 1500 redelivered after {elapsed:.2f}s"
        assert (third.id, third.body, third.attempts) == (msg.id, msg.body, 3)
        conn.fin(third.id)
        conn.expect_no_frame(0.3)


def test_touch_extends_the_deadline(broker_factory):
    with one_message_in_flight(broker_factory, "touch", b"slow work") as (broker, topic, conn, msg):
        start = time.monotonic()
        while time.monotonic() - start < 2.6:  # 2.6 s > msg_timeout, TOUCH every 0.4 s
            conn.touch(msg.id)
            frames = conn.frames_for(0.4)
            assert not frames, f"touched message still timed out after {time.monotonic() - start:.1f}s: {frames}"
        conn.fin(msg.id)
        conn.command("PUB", unique("sync"), body=b"x")
        assert conn.expect_response() == OK  # FIN succeeded: the message was still in flight
        conn.expect_no_frame(0.5)

        # control: without TOUCH the same broker times a message out after ~1 s
        publish(broker.tcp_address, topic, b"untouched")
        untouched = conn.expect_message()
        assert conn.expect_message(timeout=4).attempts == untouched.attempts + 1


def test_dpub_is_not_delivered_before_its_delay(broker):
    topic = unique("dpub")
    with subscribe(broker.tcp_address, topic, "c", rdy=5) as conn, RawNSQ(broker.tcp_address) as pub:
        sent_at = time.monotonic()
        pub.dpub(topic, 1500, b"later")
        pub.pub(topic, b"now")
        now = conn.expect_message(timeout=1)
        assert now.body == b"now"
        conn.fin(now.id)
        conn.expect_no_frame(max(0.0, 1.2 - (time.monotonic() - sent_at)))
        later = conn.expect_message(timeout=4)
        elapsed = time.monotonic() - sent_at
        assert later.body == b"later"
        assert elapsed >= 1.4, f"DPUB 1500 delivered after {elapsed:.2f}s"
        assert later.attempts == 1
        conn.fin(later.id)


# ---------------------------------------------------------------------------------------------
# heartbeats and IDENTIFY
# ---------------------------------------------------------------------------------------------


def test_heartbeats_arrive_and_nop_keeps_the_connection(broker):
    with RawNSQ(broker.tcp_address) as conn:
        assert conn.identify(heartbeat_interval=1000) == OK
        start = time.monotonic()
        beats = []
        while time.monotonic() - start < 3.5:
            try:
                frame = conn.read_frame(timeout=3.5 - (time.monotonic() - start))
            except FrameTimeout:
                break
            assert frame == Response(b"_heartbeat_"), frame
            beats.append(time.monotonic() - start)
            conn.nop()
        assert len(beats) >= 2, f"heartbeats at {beats} within 3.5 s with heartbeat_interval=1000"
        assert beats[0] < 2.0
        conn.pub(unique("hb"), b"still connected")  # answered OK: the broker kept us


def test_unanswered_heartbeats_close_the_connection(broker):
    with RawNSQ(broker.tcp_address) as conn:
        assert conn.identify(heartbeat_interval=1000) == OK
        start = time.monotonic()
        frames = conn.expect_closed(timeout=6)  # read, never answer
        elapsed = time.monotonic() - start
        assert Response(b"_heartbeat_") in frames, frames
        assert all(f == Response(b"_heartbeat_") for f in frames), frames
        assert 1.5 <= elapsed <= 4.5, f"closed after {elapsed:.2f}s (nsqd: 2 missed heartbeats = 2 s)"
    assert_healthy(broker)


def test_identify_feature_negotiation(broker_factory):
    broker = broker_factory(max_rdy_count=200, msg_timeout="2s", max_msg_timeout="30s")
    with RawNSQ(broker.tcp_address) as conn:
        resp = conn.identify(feature_negotiation=True, client_id="raw", hostname="raw.local",
                             user_agent="nsq_raw/1.0", tls_v1=True, snappy=False, deflate=False)
        for field in ("max_rdy_count", "version", "max_msg_timeout", "msg_timeout", "tls_v1", "deflate",
                      "deflate_level", "max_deflate_level", "snappy", "sample_rate", "auth_required",
                      "output_buffer_size", "output_buffer_timeout"):
            assert field in resp, f"IDENTIFY response lacks {field}: {resp}"
        assert resp["max_rdy_count"] == 200
        assert resp["max_msg_timeout"] == 30_000
        assert resp["msg_timeout"] == 2_000
        assert isinstance(resp["version"], str) and resp["version"]
        assert resp["tls_v1"] is False  # asked for, but no TLS configured: stays plaintext
        assert resp["snappy"] is False and resp["deflate"] is False
        assert resp["deflate_level"] == 6 and resp["max_deflate_level"] == 6
        assert resp["sample_rate"] == 0
        assert resp["auth_required"] is False
        assert resp["output_buffer_size"] == 16384
        assert resp["output_buffer_timeout"] == 250
        conn.pub(unique("ident"), b"plaintext still works")

    with RawNSQ(broker.tcp_address) as conn:
        resp = conn.identify(feature_negotiation=True, msg_timeout=5000, output_buffer_size=8192,
                             output_buffer_timeout=100, heartbeat_interval=2000)
        assert (resp["msg_timeout"], resp["output_buffer_size"], resp["output_buffer_timeout"]) == (
            5000, 8192, 100)

    with RawNSQ(broker.tcp_address) as conn:
        assert conn.identify(client_id="old-style") == OK  # no feature_negotiation: plain OK


def test_ansq_and_pynsq_negotiate_with_the_broker(broker, clients):
    """ansq and pynsq both send IDENTIFY with feature_negotiation and parse the JSON answer; a round
    trip through each proves the answer is what they accept."""
    topic = unique("negotiate")
    consumer = clients("pynsq", dict(mode="consume", address=broker.tcp_address, topic=topic,
                                     channel="c", expect=2, quiet=0.3))
    consumer.wait_ready()
    ops = [dict(cmd="pub", topic=topic, body=b64(b"from ansq")),
           dict(cmd="dpub", topic=topic, delay_ms=100, body=b64(b"deferred from ansq"))]
    assert_published(clients("ansq", dict(mode="publish", address=broker.tcp_address, ops=ops)).result(), 2)
    assert sorted(decoded_bodies(consumer.result())) == [b"deferred from ansq", b"from ansq"]


# ---------------------------------------------------------------------------------------------
# bad input: exact nsqd error frames, fatal or not, and the broker carries on
# ---------------------------------------------------------------------------------------------

MAX_MSG_SIZE = 1024
MAX_BODY_SIZE = 4096
UNKNOWN_ID = b"0123456789abcdef"


@pytest.fixture(scope="module")
def abused_broker(tmp_path_factory):
    b = BrokerProcess(tmp_path_factory.mktemp("abused"), max_msg_size=MAX_MSG_SIZE, max_body_size=MAX_BODY_SIZE)
    b.start()
    yield b
    b.stop()


def _size(n: int) -> bytes:
    return struct.pack(">i", n)


def _identify(body: bytes) -> bytes:
    return b"IDENTIFY\n" + _size(len(body)) + body


# (id, setup: "none" | "sub", bytes to send, expected error frame, fatal)
# Where nsqd answers on the command line alone (bad topic, bad DPUB timeout) the body follows anyway,
# as every real client sends it.
BAD_INPUT = [
    ("unknown-command", "none", b"FOO bar\n", "E_INVALID invalid command FOO", True),
    ("empty-command", "none", b"\n", "E_INVALID invalid command ", True),
    ("pub-bad-topic", "none", b"PUB bad*topic\n" + _size(5) + b"hello",
     'E_BAD_TOPIC PUB topic name "bad*topic" is not valid', True),
    ("pub-topic-too-long", "none", b"PUB " + b"t" * 65 + b"\n" + _size(5) + b"hello",
     'E_BAD_TOPIC PUB topic name "' + "t" * 65 + '" is not valid', True),
    ("dpub-bad-topic", "none", b"DPUB bad*topic 10\n" + _size(5) + b"hello",
     'E_BAD_TOPIC DPUB topic name "bad*topic" is not valid', True),
    # sic: nsqd's MPUB repeats the code inside the description
    ("mpub-bad-topic", "none", b"MPUB bad*topic\n" + _size(9) + encode_mpub_body([b"x"]),
     'E_BAD_TOPIC E_BAD_TOPIC MPUB topic name "bad*topic" is not valid', True),
    ("sub-bad-topic", "none", b"SUB bad*topic ch\n", 'E_BAD_TOPIC SUB topic name "bad*topic" is not valid', True),
    ("sub-bad-channel", "none", b"SUB good bad*chan\n",
     'E_BAD_CHANNEL SUB channel name "bad*chan" is not valid', True),
    ("sub-missing-channel", "none", b"SUB good\n", "E_INVALID SUB insufficient number of parameters", True),
    ("pub-too-big", "none", b"PUB t\n" + _size(2000),
     f"E_BAD_MESSAGE PUB message too big 2000 > {MAX_MSG_SIZE}", True),
    ("pub-empty", "none", b"PUB t\n" + _size(0), "E_BAD_MESSAGE PUB invalid message body size 0", True),
    ("dpub-too-big", "none", b"DPUB t 10\n" + _size(2000),
     f"E_BAD_MESSAGE DPUB message too big 2000 > {MAX_MSG_SIZE}", True),
    ("dpub-bad-timeout", "none", b"DPUB t 3600001\n" + _size(5) + b"hello",
     "E_INVALID DPUB timeout 3600001 out of range 0-3600000", True),
    ("mpub-body-too-big", "none", b"MPUB t\n" + _size(5000),
     f"E_BAD_BODY MPUB body too big 5000 > {MAX_BODY_SIZE}", True),
    ("mpub-count-zero", "none", b"MPUB t\n" + _size(4) + _size(0), "E_BAD_BODY MPUB invalid message count 0", True),
    ("mpub-count-too-large", "none", b"MPUB t\n" + _size(4) + _size(1000),
     "E_BAD_BODY MPUB invalid message count 1000", True),
    ("mpub-message-too-big", "none", b"MPUB t\n" + _size(8 + 2000) + _size(1) + _size(2000) + b"x" * 2000,
     f"E_BAD_MESSAGE MPUB message too big 2000 > {MAX_MSG_SIZE}", True),
    ("rdy-not-a-number", "sub", b"RDY abc\n", "E_INVALID RDY could not parse count abc", True),
    ("rdy-out-of-range", "sub", b"RDY 2501\n", "E_INVALID RDY count 2501 out of range 0-2500", True),
    ("rdy-before-sub", "none", b"RDY 1\n", "E_INVALID cannot RDY in current state", True),
    ("fin-before-sub", "none", b"FIN " + UNKNOWN_ID + b"\n", "E_INVALID cannot FIN in current state", True),
    ("req-before-sub", "none", b"REQ " + UNKNOWN_ID + b" 0\n", "E_INVALID cannot REQ in current state", True),
    ("fin-malformed-id", "sub", b"FIN 1234\n", "E_INVALID invalid message ID", True),
    ("sub-twice", "sub", b"SUB t c\n", "E_INVALID cannot SUB in current state", True),
    ("identify-empty-body", "none", b"IDENTIFY\n" + _size(0), "E_BAD_BODY IDENTIFY invalid body size 0", True),
    ("identify-bad-json", "none", _identify(b"{nope"), "E_BAD_BODY IDENTIFY failed to decode JSON body", True),
    ("identify-bad-heartbeat", "none", _identify(b'{"heartbeat_interval": 500}'),
     "E_BAD_BODY IDENTIFY heartbeat interval (500) is invalid", True),
    ("fin-unknown-id", "sub", b"FIN " + UNKNOWN_ID + b"\n",
     f"E_FIN_FAILED FIN {UNKNOWN_ID.decode()} failed ID not in flight", False),
    ("req-unknown-id", "sub", b"REQ " + UNKNOWN_ID + b" 0\n",
     f"E_REQ_FAILED REQ {UNKNOWN_ID.decode()} failed ID not in flight", False),
    ("touch-unknown-id", "sub", b"TOUCH " + UNKNOWN_ID + b"\n",
     f"E_TOUCH_FAILED TOUCH {UNKNOWN_ID.decode()} failed ID not in flight", False),
]


@pytest.mark.parametrize(("setup", "payload", "expected", "fatal"), [c[1:] for c in BAD_INPUT],
                         ids=[c[0] for c in BAD_INPUT])
def test_bad_input(abused_broker, setup, payload, expected, fatal):
    topic = unique("bad")
    with RawNSQ(abused_broker.tcp_address) as conn:
        if setup == "sub":
            conn.sub(topic, "c")
        conn.send(payload)
        try:
            frame = conn.next_frame()
        except ConnectionClosed as exc:
            raise AssertionError(f"broker closed the connection without sending {expected!r}: {exc}")
        assert isinstance(frame, Error), f"expected error frame {expected!r}, got {frame!r}"
        assert frame.text == expected
        if fatal:
            try:
                extra = conn.expect_closed(timeout=2)
            except FrameTimeout:
                raise AssertionError(f"{frame.code} is fatal in nsqd but the connection stayed open")
            assert extra == [], f"frames after a fatal error: {extra}"
        else:
            # non-fatal: the same connection keeps working, publishing and consuming
            conn.command("PUB", topic, body=b"after the error")
            assert conn.expect_response() == OK
            conn.rdy(1)
            msg = conn.expect_message()
            assert msg.body == b"after the error"
            conn.fin(msg.id)
            conn.command("PUB", topic, body=b"sync")
            assert conn.expect_response() == OK
    assert_healthy(abused_broker)


def test_a_message_in_flight_to_another_consumer_cannot_be_finished_requeued_or_touched(abused_broker):
    """Two consumers of one channel: FIN, REQ and TOUCH of the other's message each get nsqd's
    E_*_FAILED (the same text as Go nsqd 1.3.0), keep the connection, and leave the message with its
    owner, who can still FIN it."""
    topic = unique("owner")
    with RawNSQ(abused_broker.tcp_address) as owner, RawNSQ(abused_broker.tcp_address) as other:
        owner.pub(topic, b"mine")
        owner.sub(topic, "c")
        other.sub(topic, "c")
        owner.rdy(1)
        msg = owner.expect_message()
        for name, params in ((b"FIN", (msg.id,)), (b"REQ", (msg.id, 0)), (b"TOUCH", (msg.id,))):
            other.send(encode_command(name, *params))
            error = other.expect_error()
            command = name.decode()
            assert error.text == f"E_{command}_FAILED {command} {msg.id.decode()} failed client does not own message"
        other.command("PUB", topic + "-other", body=b"still connected")
        assert other.expect_response() == OK
        owner.fin(msg.id)
        owner.command("PUB", topic, body=b"sync")
        assert owner.expect_response() == OK  # the FIN was accepted: no error came before this OK
    assert_healthy(abused_broker)


def test_mpub_with_a_count_larger_than_its_messages_is_rejected(abused_broker):
    """MPUB whose count says 3 but whose body holds 2 messages: nothing of it may be published."""
    topic = unique("mpub-count")
    with subscribe(abused_broker.tcp_address, topic, "c", rdy=10) as consumer:
        two = encode_mpub_body([b"a", b"b"])
        lying = _size(3) + two[4:]
        with RawNSQ(abused_broker.tcp_address) as conn:
            conn.send(b"MPUB " + topic.encode() + b"\n" + _size(len(lying)) + lying)
            # nsqd reads the third message's size from whatever comes next; send a full frame's
            # worth so either reading (nsqd's stream or a body-bounded one) resolves to an error
            conn.send(_size(0))
            frame = conn.next_frame()
            assert isinstance(frame, Error), frame
            assert frame.code in ("E_BAD_BODY", "E_BAD_MESSAGE"), frame
            assert conn.is_closed_by_peer(timeout=2), "MPUB errors are fatal in nsqd"
        consumer.expect_no_frame(0.5)
    assert_healthy(abused_broker)


# ---------------------------------------------------------------------------------------------
# ephemeral channels
# ---------------------------------------------------------------------------------------------


def test_ephemeral_channel_disappears_with_its_last_consumer(broker):
    """Backlog held (RDY 0) by a `#ephemeral` channel is gone once its only consumer leaves: a
    fresh SUB to the same name starts empty. Control: a durable channel on the same topic keeps
    the same backlog after its consumer leaves."""
    addr = broker.tcp_address
    topic = unique("eph")
    backlog = [b"e1", b"e2\n", b"e3"]
    with subscribe(addr, topic, "durable"):
        with subscribe(addr, topic, "gone#ephemeral"):
            publish(addr, topic, *backlog)  # RDY 0 everywhere: both channels hold the backlog
            time.sleep(0.3)
        # the ephemeral consumer left: its channel and backlog are deleted
        time.sleep(0.5)
        with subscribe(addr, topic, "gone#ephemeral", rdy=10) as eph2:
            eph2.expect_no_frame(1.0)  # no old backlog
            publish(addr, topic, b"fresh")
            assert eph2.expect_message().body == b"fresh"
            eph2.expect_no_frame(0.3)
    # the durable channel's consumer left too, but a durable channel keeps everything
    with subscribe(addr, topic, "durable", rdy=10) as again:
        got = sorted(m.body for m in again.expect_messages(4))
        assert got == sorted(backlog + [b"fresh"])
        again.expect_no_frame(0.3)
    assert_healthy(broker)


def test_sigterm_stops_the_broker_cleanly(broker):
    with subscribe(broker.tcp_address, unique("term"), "c", rdy=1):
        code = broker.stop()
    assert code == 0, f"exit code {code} on SIGTERM\n{broker.log_text()}"
    assert "Traceback" not in broker.log_text(), broker.log_text()
